//! A decode step's per-head q/k RMSNorm, RoPE and KV cache write in one kernel
//! (`rope_kv_write_normed`, cuda/rope.cu): bit for bit `rmsnorm_heads` of the q heads into qn,
//! `rmsnorm_heads` of the k heads into kn, then `rope_kv_write(qn, kn, v, ...)` (qn, kn, the k
//! cache and the v cache), the three kernels a q/k-norm model's decode ran per attention layer.
//! Head sizes 64, 128 and 256; full and partial rotary; the gated query layout (keys after the
//! gate, Qwen3.5) and the plain one (Qwen3), with rows wider than the heads and an odd row width
//! (heads off 16-byte alignment: the norm's scalar loads); plus_one true and false; a rope
//! attn_scale; positions 0, 7 and 131071 (sincosf's slow argument reduction); a negative slot
//! (padding row) that must leave both caches untouched; one token and several in a launch; bf16
//! and f16. Also against the CPU model's RMSNorm and RoPE within the storage tolerance. The
//! PERF report times the fused kernel against the three it replaces at the Qwen3.5-27B shape.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::RopeKvShape;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::assert_bitwise;
use super::harness::{check, gpu, rounded, tol16, upload, upload_raw, Out16, Rng, STORAGES};
use super::reference;

/// Slots of the test caches.
const SLOTS: usize = 24;
const EPS: f32 = 1e-6;

/// One case's shape and device inputs.
struct Case {
    hq: usize,
    hkv: usize,
    d: usize,
    k_off: usize,
    v_off: usize,
    width: usize,
    plus_one: bool,
    scale: f32,
    qkv: CudaSlice<u16>,
    qw: CudaSlice<u16>,
    kw: CudaSlice<u16>,
    freq: CudaSlice<f32>,
}

impl Case {
    fn dims(&self) -> (usize, usize) {
        (self.hq * self.d, self.hkv * self.d)
    }

    fn shape(&self, q_stride: usize, k_stride: usize) -> RopeKvShape {
        RopeKvShape { n_q_heads: self.hq, n_kv_heads: self.hkv, head_dim: self.d, q_stride, k_stride, v_stride: self.width, attn_scale: self.scale }
    }
}

/// [qn, kn, k cache, v cache] after `rmsnorm_heads` twice and `rope_kv_write`, from poisoned
/// qn / kn and the given caches.
fn three_kernels(dev: &CudaDevice, c: &Case, pos: &CudaSlice<i32>, slot: &CudaSlice<i64>, k0: &[f32], v0: &[f32]) -> [Vec<f32>; 4] {
    let (t, (qd, kvd)) = (pos.len(), c.dims());
    let (mut qn, mut kn) = (Out16::new(dev, t * qd), Out16::new(dev, t * kvd));
    let (mut kc, mut vc) = (Out16::with(dev, k0), Out16::with(dev, v0));
    dev.rmsnorm_heads(&c.qkv, &c.qw, &mut qn.view(), t, c.hq, c.d, c.width, qd, EPS, c.plus_one).unwrap();
    dev.rmsnorm_heads(&c.qkv.slice(c.k_off..), &c.kw, &mut kn.view(), t, c.hkv, c.d, c.width, kvd, EPS, c.plus_one).unwrap();
    dev.rope_kv_write(&mut qn.view(), &mut kn.view(), &c.qkv.slice(c.v_off..), &mut kc.view(), &mut vc.view(), pos, slot, &c.freq, &c.shape(qd, kvd)).unwrap();
    [qn.read(dev, "three-kernel qn"), kn.read(dev, "three-kernel kn"), kc.read(dev, "three-kernel k cache"), vc.read(dev, "three-kernel v cache")]
}

/// The same after `rope_kv_write_normed`.
fn fused(dev: &CudaDevice, c: &Case, pos: &CudaSlice<i32>, slot: &CudaSlice<i64>, k0: &[f32], v0: &[f32]) -> [Vec<f32>; 4] {
    let (t, (qd, kvd)) = (pos.len(), c.dims());
    let (mut qn, mut kn) = (Out16::new(dev, t * qd), Out16::new(dev, t * kvd));
    let (mut kc, mut vc) = (Out16::with(dev, k0), Out16::with(dev, v0));
    let shape = c.shape(c.width, c.width);
    dev.rope_kv_write_normed(&c.qkv, c.k_off, c.v_off, &c.qw, &c.kw, EPS, c.plus_one, &mut qn.view(), &mut kn.view(), &mut kc.view(), &mut vc.view(), pos, slot, &c.freq, &shape).unwrap();
    [qn.read(dev, "fused qn"), kn.read(dev, "fused kn"), kc.read(dev, "fused k cache"), vc.read(dev, "fused v cache")]
}

#[test]
fn rope_kv_write_normed_equals_head_norms_then_rope_kv_write_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("rope_kv_write_normed", st) else { return };
        let mut rng = Rng::new(53);
        // (q heads, kv heads, head_dim, rotary_dim, gated queries, extra row columns, plus_one,
        // attn_scale): Qwen3.5-27B's attention (partial rotary), Qwen3-8B's (full), a head of
        // 64 with partial rotary, MHA of 128 at a rope scale, and odd row widths.
        let cases = [
            (24, 4, 256, 64, true, 0, true, 1.0),
            (32, 8, 128, 128, false, 0, false, 1.0),
            (8, 2, 64, 32, true, 3, true, 1.25),
            (4, 4, 128, 128, false, 5, false, 1.25),
            (16, 2, 256, 256, false, 1, false, 1.0),
            (6, 3, 64, 64, true, 8, true, 1.0),
        ];
        for (hq, hkv, d, rot, gated, extra, plus_one, scale) in cases {
            let (qd, kvd) = (hq * d, hkv * d);
            let k_off = if gated { 2 * qd } else { qd };
            let v_off = k_off + kvd;
            let width = v_off + kvd + extra;
            // Three tokens' rows: the one-token launches read row 0, the three-token one all.
            let qkv_host = rounded(&rng.vec(3 * width, -2.0, 2.0), st);
            let (wlo, whi) = if plus_one { (-0.5, 0.5) } else { (0.5, 1.5) };
            let (qw_host, kw_host) = (rounded(&rng.vec(d, wlo, whi), st), rounded(&rng.vec(d, wlo, whi), st));
            let inv_freq: Vec<f32> = (0..rot / 2).map(|i| 10_000_000f32.powf(-(2.0 * i as f32) / rot as f32)).collect();
            let c = Case {
                hq,
                hkv,
                d,
                k_off,
                v_off,
                width,
                plus_one,
                scale,
                qkv: upload(&dev, &qkv_host),
                qw: upload(&dev, &qw_host),
                kw: upload(&dev, &kw_host),
                freq: upload_raw(&dev, &inv_freq),
            };
            let (k0, v0) = (rounded(&rng.vec(SLOTS * kvd, -1.0, 1.0), st), rounded(&rng.vec(SLOTS * kvd, -1.0, 1.0), st));
            // One token at each position with a slot and with the padding slot, then three
            // tokens at once (positions 0, 7, 131071; the middle one padding).
            let mut runs: Vec<(Vec<i32>, Vec<i64>)> = Vec::new();
            for p in [0, 7, 131_071] {
                runs.push((vec![p], vec![rng.below(SLOTS) as i64]));
                runs.push((vec![p], vec![-1]));
            }
            let perm = rng.permutation(SLOTS);
            runs.push((vec![0, 7, 131_071], vec![perm[0] as i64, -1, perm[1] as i64]));
            for (positions, slots) in runs {
                let t = positions.len();
                let (pos, sl) = (upload_raw(&dev, &positions), upload_raw(&dev, &slots));
                let join = |v: Vec<String>| v.join("+");
                let (pl, sll) = (join(positions.iter().map(|p| p.to_string()).collect()), join(slots.iter().map(|s| s.to_string()).collect()));
                let label = format!("{st:?} hq{hq}/hkv{hkv}/d{d}/rot{rot}/gated{}/width{width}/plus_one{}/scale{scale}/pos{pl}/slot{sll}", gated as u8, plus_one as u8);
                let want = three_kernels(&dev, &c, &pos, &sl, &k0, &v0);
                let got = fused(&dev, &c, &pos, &sl, &k0, &v0);
                for (i, what) in ["qn", "kn", "k cache", "v cache"].iter().enumerate() {
                    assert_bitwise(&got[i], &want[i], &format!("rope_kv_write_normed {label} {what}"));
                }
                println!("PARITY op=rope_kv_write_normed storage={} shape={label} bitwise=1", st.name());
                // Each token's slot holds its rotated k and plain v heads; the padding token's
                // slot nothing; every other slot keeps its bits.
                let (kc, vc) = (&got[2], &got[3]);
                let (mut k_want, mut v_want) = (k0.clone(), v0.clone());
                for (i, &slot) in slots.iter().enumerate() {
                    if slot >= 0 {
                        let at = slot as usize * kvd;
                        k_want[at..at + kvd].copy_from_slice(&got[1][i * kvd..(i + 1) * kvd]);
                        v_want[at..at + kvd].copy_from_slice(&qkv_host[i * width + v_off..i * width + v_off + kvd]);
                    }
                }
                assert_bitwise(kc, &k_want, &format!("rope_kv_write_normed {label}: k cache"));
                assert_bitwise(vc, &v_want, &format!("rope_kv_write_normed {label}: v cache"));
                // The CPU model: per-head RMSNorm of the token's q and k heads, then RoPE.
                let take = |off: usize, n: usize| -> Vec<f32> { (0..t).flat_map(|i| qkv_host[i * width + off..i * width + off + n].to_vec()).collect() };
                let mut q_cpu = reference::rmsnorm(&take(0, qd), &qw_host, t * hq, d, d, EPS, plus_one);
                let mut k_cpu = reference::rmsnorm(&take(k_off, kvd), &kw_host, t * hkv, d, d, EPS, plus_one);
                reference::rope(&mut q_cpu, &positions, qd, hq, d, &inv_freq, scale);
                reference::rope(&mut k_cpu, &positions, kvd, hkv, d, &inv_freq, scale);
                check("rope_kv_write_normed q", st, &label, &got[0], &q_cpu, 2.0 * tol16(st));
                check("rope_kv_write_normed k", st, &label, &got[1], &k_cpu, 2.0 * tol16(st));
            }
        }
    }
}

/// Timing report (run with --ignored on the GPU): Qwen3.5-27B's attention at batch-1 decode (24
/// q heads, 4 kv heads of 256, rotary_dim 64, the (1 + w) norm, gated queries), the fused
/// kernel against the two head norms and rope_kv_write it replaces, 500 steps back to back
/// (PDL as the model launches them).
#[test]
#[ignore]
fn report_rope_kv_write_normed_time() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("rope_kv_write_normed_perf", st) else { return };
    let s = dev.stream().clone();
    let (hq, hkv, d, rot) = (24, 4, 256, 64);
    let (qd, kvd) = (hq * d, hkv * d);
    let (k_off, v_off, width) = (2 * qd, 2 * qd + kvd, 2 * qd + 2 * kvd);
    let mut rng = Rng::new(5);
    let qkv = upload(&dev, &rng.vec(width, -2.0, 2.0));
    let (qw, kw) = (upload(&dev, &rng.vec(d, -0.5, 0.5)), upload(&dev, &rng.vec(d, -0.5, 0.5)));
    let (mut qn, mut kn) = (s.alloc_zeros::<u16>(qd).unwrap(), s.alloc_zeros::<u16>(kvd).unwrap());
    let (mut kc, mut vc) = (s.alloc_zeros::<u16>(SLOTS * kvd).unwrap(), s.alloc_zeros::<u16>(SLOTS * kvd).unwrap());
    let freq = upload_raw(&dev, &vec![1e-3f32; rot / 2]);
    let (pos, sl) = (upload_raw(&dev, &[4000i32]), upload_raw(&dev, &[3i64]));
    let shape = |q_stride, k_stride| RopeKvShape { n_q_heads: hq, n_kv_heads: hkv, head_dim: d, q_stride, k_stride, v_stride: width, attn_scale: 1.0 };
    let fused_ms = super::time_ms(&dev, 500, || {
        dev.rope_kv_write_normed(&qkv, k_off, v_off, &qw, &kw, EPS, true, &mut qn, &mut kn, &mut kc, &mut vc, &pos, &sl, &freq, &shape(width, width)).unwrap();
    });
    let three_ms = super::time_ms(&dev, 500, || {
        dev.rmsnorm_heads(&qkv, &qw, &mut qn, 1, hq, d, width, qd, EPS, true).unwrap();
        dev.rmsnorm_heads(&qkv.slice(k_off..), &kw, &mut kn, 1, hkv, d, width, kvd, EPS, true).unwrap();
        dev.rope_kv_write(&mut qn, &mut kn, &qkv.slice(v_off..), &mut kc, &mut vc, &pos, &sl, &freq, &shape(qd, kvd)).unwrap();
    });
    println!(
        "PERF op=rope_kv_write_normed shape=hq{hq}/hkv{hkv}/d{d}/rot{rot}/plus_one1/t1 fused_us={:.2} three_kernel_us={:.2} saved_us={:.2}",
        fused_ms * 1e3,
        three_ms * 1e3,
        (three_ms - fused_ms) * 1e3
    );
}
