//! The batch-1 qkv projection with RoPE and the KV cache write in its epilogue
//! (`gemv_qkv_rope_kv_write`, cuda/gemv.cu `gemv_qkv_rope_m1`): bit for bit the CUDA-core GEMV
//! (`gemv_with(GemvForm::Simt)`, M = 1) followed by `rope_kv_write_packed` on the same inputs
//! (the qkv row, the k cache and the v cache), for Llama-3-8B's attention (32 q heads, 8 kv
//! heads of 128, K 4096), a GQA shape of head 64 at a K that is no multiple of 256 (a lane's
//! ragged last vectors), and MHA at K = 8 (one vector: every lane but one sums nothing); at
//! positions 0, 7 and 131071 (sincosf's slow argument reduction), with a rope attn_scale, and
//! a negative slot (padding row) that must leave both caches untouched; bf16 and f16; K split 1
//! and 2 (the batch-1 loops of both default splits). Also
//! against the CPU model's GEMV and RoPE within the storage tolerance. The PERF report times the
//! fused kernel against the two kernels it replaces.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::{GemvForm, RopeKvShape};
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::assert_bitwise;
use super::harness::{check, gpu, model_device, rounded, tol16, upload, upload_raw, Out16, Rng, HIDDEN_PER_KSPLIT, STORAGES};
use super::reference;

/// Slots of the test caches.
const SLOTS: usize = 24;

/// One case's inputs on the device.
struct Case {
    hq: usize,
    hkv: usize,
    d: usize,
    k: usize,
    scale: f32,
    x: CudaSlice<u16>,
    w: CudaSlice<u16>,
    freq: CudaSlice<f32>,
}

impl Case {
    fn rows(&self) -> usize {
        (self.hq + 2 * self.hkv) * self.d
    }

    fn shape(&self) -> RopeKvShape {
        let width = self.rows();
        RopeKvShape { n_q_heads: self.hq, n_kv_heads: self.hkv, head_dim: self.d, q_stride: width, k_stride: width, v_stride: width, attn_scale: self.scale }
    }
}

/// (qkv row, k cache, v cache) after the two kernels: the SIMT GEMV into a poisoned row, then
/// `rope_kv_write_packed`.
fn two_kernels(dev: &CudaDevice, c: &Case, pos: &CudaSlice<i32>, slot: &CudaSlice<i64>, k0: &[f32], v0: &[f32]) -> [Vec<f32>; 3] {
    let (qd, kvd) = (c.hq * c.d, c.hkv * c.d);
    let mut y = Out16::new(dev, c.rows());
    let (mut kc, mut vc) = (Out16::with(dev, k0), Out16::with(dev, v0));
    dev.gemv_with(GemvForm::Simt, &c.x, &c.w, &mut y.view(), 1, c.rows(), c.k).unwrap();
    dev.rope_kv_write_packed(&mut y.view(), qd, qd + kvd, &mut kc.view(), &mut vc.view(), pos, slot, &c.freq, &c.shape()).unwrap();
    [y.read(dev, "two-kernel qkv"), kc.read(dev, "two-kernel k cache"), vc.read(dev, "two-kernel v cache")]
}

/// The same after `gemv_qkv_rope_kv_write`.
fn fused(dev: &CudaDevice, c: &Case, pos: &CudaSlice<i32>, slot: &CudaSlice<i64>, k0: &[f32], v0: &[f32]) -> [Vec<f32>; 3] {
    let mut y = Out16::new(dev, c.rows());
    let (mut kc, mut vc) = (Out16::with(dev, k0), Out16::with(dev, v0));
    dev.gemv_qkv_rope_kv_write(&c.x, &c.w, &mut y.view(), &mut kc.view(), &mut vc.view(), pos, slot, &c.freq, &c.shape(), c.k).unwrap();
    [y.read(dev, "fused qkv"), kc.read(dev, "fused k cache"), vc.read(dev, "fused v cache")]
}

#[test]
fn gemv_qkv_rope_equals_gemv_then_rope_kv_write_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_qkv_rope", st) else { return };
        let mut rng = Rng::new(77);
        // (q heads, kv heads, head_dim, K, attn_scale)
        let cases = [(32, 8, 128, 4096, 1.0), (8, 2, 64, 1000, 1.25), (4, 4, 128, 8, 1.0)];
        for ((hq, hkv, d, k, scale), hidden) in cases.into_iter().flat_map(|case| HIDDEN_PER_KSPLIT.map(|h| (case, h))) {
            let dev = model_device(&dev, hidden);
            let rows = (hq + 2 * hkv) * d;
            let s = 2.0 / (k as f32).sqrt();
            let (x_host, w_host) = (rounded(&rng.vec(k, -1.0, 1.0), st), rounded(&rng.vec(rows * k, -s, s), st));
            let inv_freq: Vec<f32> = (0..d / 2).map(|i| 500_000f32.powf(-(2.0 * i as f32) / d as f32)).collect();
            let c = Case { hq, hkv, d, k, scale, x: upload(&dev, &x_host), w: upload(&dev, &w_host), freq: upload_raw(&dev, &inv_freq) };
            let kvd = hkv * d;
            let (k0, v0) = (rounded(&rng.vec(SLOTS * kvd, -1.0, 1.0), st), rounded(&rng.vec(SLOTS * kvd, -1.0, 1.0), st));
            for p in [0, 7, 131_071] {
                let pos = upload_raw(&dev, &[p]);
                for slot in [rng.below(SLOTS) as i64, -1] {
                    let sl = upload_raw(&dev, &[slot]);
                    let label = format!("{st:?} hq{hq}/hkv{hkv}/d{d}/k{k}/ksplit{}/pos{p}/slot{slot}", dev.cc_ksplit_for(rows, k));
                    let want = two_kernels(&dev, &c, &pos, &sl, &k0, &v0);
                    let got = fused(&dev, &c, &pos, &sl, &k0, &v0);
                    for (i, what) in ["qkv row", "k cache", "v cache"].iter().enumerate() {
                        assert_bitwise(&got[i], &want[i], &format!("gemv_qkv_rope {label} {what}"));
                    }
                    println!("PARITY op=gemv_qkv_rope storage={} shape={label} bitwise=1", st.name());
                    let (kc, vc) = (&got[1], &got[2]);
                    if slot < 0 {
                        // Padding row: the caches keep every bit they had.
                        assert_bitwise(kc, &k0, &format!("gemv_qkv_rope {label}: k cache written at a negative slot"));
                        assert_bitwise(vc, &v0, &format!("gemv_qkv_rope {label}: v cache written at a negative slot"));
                        continue;
                    }
                    // The slot's rows are the qkv row's rotated k and plain v heads, and no
                    // other slot changed.
                    let (qd, at) = (hq * d, slot as usize * kvd);
                    assert_bitwise(&kc[at..at + kvd], &got[0][qd..qd + kvd], &format!("gemv_qkv_rope {label}: cached k"));
                    assert_bitwise(&vc[at..at + kvd], &got[0][qd + kvd..], &format!("gemv_qkv_rope {label}: cached v"));
                    for (cache, init) in [(kc, &k0), (vc, &v0)] {
                        assert_bitwise(&cache[..at], &init[..at], &format!("gemv_qkv_rope {label}: slots before"));
                        assert_bitwise(&cache[at + kvd..], &init[at + kvd..], &format!("gemv_qkv_rope {label}: slots after"));
                    }
                    // The CPU model: the projection, then RoPE of the q and k heads (adjacent in
                    // the row, so one pass over hq + hkv heads).
                    let mut cpu = reference::matmul_nt(&x_host, &w_host, 1, rows, k);
                    reference::rope(&mut cpu, &[p], rows, hq + hkv, d, &inv_freq, scale);
                    check("gemv_qkv_rope", st, &label, &got[0], &cpu, tol16(st));
                }
            }
        }
    }
}

/// Throughput report (run with --ignored on the GPU): Llama-3-8B's qkv projection with the
/// fused epilogue against the SIMT GEMV + rope_kv_write it replaces, 200 launches back to back
/// (PDL as the model launches them), the weights rotated over 4 copies so that none is
/// L2-resident.
#[test]
#[ignore]
fn report_gemv_qkv_rope_throughput() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_qkv_rope_perf", st) else { return };
    let s = dev.stream().clone();
    let (hq, hkv, d, k) = (32, 8, 128, 4096);
    let rows = (hq + 2 * hkv) * d;
    let (qd, kvd) = (hq * d, hkv * d);
    let ws: Vec<CudaSlice<u16>> = (0..4).map(|_| s.alloc_zeros::<u16>(rows * k).unwrap()).collect();
    let x = s.alloc_zeros::<u16>(k).unwrap();
    let mut y = s.alloc_zeros::<u16>(rows).unwrap();
    let (mut kc, mut vc) = (s.alloc_zeros::<u16>(SLOTS * kvd).unwrap(), s.alloc_zeros::<u16>(SLOTS * kvd).unwrap());
    let freq = upload_raw(&dev, &vec![1e-3f32; d / 2]);
    let (pos, sl) = (upload_raw(&dev, &[4000i32]), upload_raw(&dev, &[3i64]));
    let shape = RopeKvShape { n_q_heads: hq, n_kv_heads: hkv, head_dim: d, q_stride: rows, k_stride: rows, v_stride: rows, attn_scale: 1.0 };
    let mut i = 0;
    let fused_ms = super::time_ms(&dev, 200, || {
        i += 1;
        dev.gemv_qkv_rope_kv_write(&x, &ws[i % 4], &mut y, &mut kc, &mut vc, &pos, &sl, &freq, &shape, k).unwrap();
    });
    let two_ms = super::time_ms(&dev, 200, || {
        i += 1;
        dev.gemv_with(GemvForm::Simt, &x, &ws[i % 4], &mut y, 1, rows, k).unwrap();
        dev.rope_kv_write_packed(&mut y, qd, qd + kvd, &mut kc, &mut vc, &pos, &sl, &freq, &shape).unwrap();
    });
    let gemv_ms = super::time_ms(&dev, 200, || {
        i += 1;
        dev.gemv_with(GemvForm::Simt, &x, &ws[i % 4], &mut y, 1, rows, k).unwrap();
    });
    let gbps = (rows * k * 2) as f64 / fused_ms / 1e6;
    println!(
        "PERF op=gemv_qkv_rope rows={rows} k={k} fused_ms={fused_ms:.4} two_kernel_ms={two_ms:.4} saved_us={:.2} simt_gemv_ms={gemv_ms:.4} fused_GBps={gbps:.0}",
        (two_ms - fused_ms) * 1e3
    );
}
