//! The output projection with the residual add + RMSNorm in its epilogue
//! (`gemv_add_rmsnorm`, cuda/gemv_tc.cu `gemv_tc_add_rmsnorm`): bit for bit the tensor-core
//! GEMV into a buffer followed by `add_rmsnorm` (residual and normed rows) at M = 1..8 for the
//! Llama-3-8B (hidden 4096, K 4096 / 14336) and Qwen3.5-27B (hidden 5120, K 6144 / 17408)
//! projections, a ragged tile (N = 1000) and rows longer than add_rmsnorm's 1024-lane pass
//! (N = 16384), plus_one off and on, bf16 and f16; row r of an M-row launch equals the one-row
//! launch (batch == alone); the block counter is back at zero after every launch, so launches
//! in a row (and graph replays) start clean; the routes that run two kernels give their bits.
//! The PERF report times the fused kernel against the two kernels.

use cudarc::driver::{CudaSlice, DevicePtr};
use ninfer_core::backend::cuda::ops::{add_norm_route, AddNormRoute, GemvForm, GemvTcConfig};
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::assert_bitwise;
use super::harness::{gpu, rounded, upload, upload_raw, Out16, Rng, STORAGES};

const EPS: f32 = 1e-5;

/// The reference: `gemv_with(form)` (`gemm` above 8 rows) into a buffer, then `add_rmsnorm`;
/// returns (residual, h).
#[allow(clippy::too_many_arguments)]
fn two_kernels(dev: &CudaDevice, form: GemvForm, x: &CudaSlice<u16>, w: &CudaSlice<u16>, residual: &[f32], nw: &CudaSlice<u16>, m: usize, n: usize, k: usize, plus_one: bool) -> (Vec<f32>, Vec<f32>) {
    let mut y = Out16::new(dev, m * n);
    if m <= 8 {
        dev.gemv_with(form, x, w, &mut y.view(), m, n, k).unwrap();
    } else {
        dev.gemm(x, w, &mut y.view(), m, n, k).unwrap();
    }
    let yd = upload(dev, &y.read(dev, "projection"));
    let mut res = Out16::with(dev, residual);
    let mut h = Out16::new(dev, m * n);
    dev.add_rmsnorm(&mut res.view(), &yd, nw, &mut h.view(), m, n, EPS, plus_one).unwrap();
    (res.read(dev, "add_rmsnorm residual"), h.read(dev, "add_rmsnorm h"))
}

/// `gemv_add_rmsnorm_with(form)` on a copy of `residual`; returns (residual, h).
#[allow(clippy::too_many_arguments)]
fn fused(dev: &CudaDevice, form: GemvForm, x: &CudaSlice<u16>, w: &CudaSlice<u16>, residual: &[f32], nw: &CudaSlice<u16>, arrivals: &mut CudaSlice<u32>, m: usize, n: usize, k: usize, plus_one: bool) -> (Vec<f32>, Vec<f32>) {
    let mut tmp = Out16::new(dev, m * n);
    let mut res = Out16::with(dev, residual);
    let mut h = Out16::new(dev, m * n);
    dev.gemv_add_rmsnorm_with(form, x, w, &mut tmp.view(), &mut res.view(), nw, &mut h.view(), arrivals, m, n, k, EPS, plus_one).unwrap();
    (res.read(dev, "gemv_add_rmsnorm residual"), h.read(dev, "gemv_add_rmsnorm h"))
}

fn counter(dev: &CudaDevice, arrivals: &CudaSlice<u32>) -> u32 {
    dev.synchronize().unwrap();
    dev.stream().clone_dtoh(arrivals).unwrap()[0]
}

#[test]
fn gemv_add_rmsnorm_equals_gemv_then_add_rmsnorm_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_add_rmsnorm", st) else { return };
        if dev.compute_capability().0 < 8 {
            eprintln!("SKIP gemv_add_rmsnorm: {} runs the SIMT GEMV (two kernels)", dev.arch());
            return;
        }
        let tc = GemvForm::TensorCores;
        let mut rng = Rng::new(97);
        let mut arrivals = upload_raw(&dev, &[0u32]);
        for (n, k) in [(4096, 4096), (4096, 14336), (5120, 6144), (5120, 17408), (1000, 1000), (16384, 256)] {
            let s = 2.0 / (k as f32).sqrt();
            let w = upload(&dev, &rounded(&rng.vec(n * k, -s, s), st));
            let x = rounded(&rng.vec(8 * k, -1.0, 1.0), st);
            let residual = rounded(&rng.vec(8 * n, -4.0, 4.0), st);
            let nw = upload(&dev, &rounded(&rng.vec(n, -1.5, 1.5), st));
            for plus_one in [false, true] {
                // One-row launches of each row, for batch == alone.
                let alone: Vec<(Vec<f32>, Vec<f32>)> = (0..8)
                    .map(|r| fused(&dev, tc, &upload(&dev, &x[r * k..(r + 1) * k]), &w, &residual[r * n..(r + 1) * n], &nw, &mut arrivals, 1, n, k, plus_one))
                    .collect();
                for m in 1..=8 {
                    let what = format!("{st:?} m{m} n{n} k{k} plus_one={plus_one}");
                    let xd = upload(&dev, &x[..m * k]);
                    let (want_res, want_h) = two_kernels(&dev, tc, &xd, &w, &residual[..m * n], &nw, m, n, k, plus_one);
                    let (res, h) = fused(&dev, tc, &xd, &w, &residual[..m * n], &nw, &mut arrivals, m, n, k, plus_one);
                    assert_bitwise(&res, &want_res, &format!("gemv_add_rmsnorm residual {what} vs gemv + add_rmsnorm"));
                    assert_bitwise(&h, &want_h, &format!("gemv_add_rmsnorm h {what} vs gemv + add_rmsnorm"));
                    for (r, (ares, ah)) in alone.iter().enumerate().take(m) {
                        let row = r * n..(r + 1) * n;
                        assert_bitwise(&res[row.clone()], ares, &format!("gemv_add_rmsnorm residual {what} row {r} vs M=1"));
                        assert_bitwise(&h[row], ah, &format!("gemv_add_rmsnorm h {what} row {r} vs M=1"));
                    }
                    assert_eq!(counter(&dev, &arrivals), 0, "{what}: block counter not reset");
                }
            }
        }
    }
}

/// Every tensor-core GEMV instance (warps per block 4 / 8 / 16 change the norm tail's loops
/// too): the fused kernel of the instance equals that instance's GEMV + add_rmsnorm bit for bit.
#[test]
fn gemv_add_rmsnorm_every_instance_bitwise() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_add_rmsnorm_instances", st) else { return };
    if dev.compute_capability().0 < 8 {
        eprintln!("SKIP gemv_add_rmsnorm_instances: {} runs the SIMT GEMV", dev.arch());
        return;
    }
    let mut rng = Rng::new(96);
    let (n, k) = (5120, 4096);
    let w = upload(&dev, &rounded(&rng.vec(n * k, -0.03, 0.03), st));
    let nw = upload(&dev, &rounded(&rng.vec(n, 0.5, 1.5), st));
    let x = rounded(&rng.vec(8 * k, -1.0, 1.0), st);
    let residual = rounded(&rng.vec(8 * n, -2.0, 2.0), st);
    let mut arrivals = upload_raw(&dev, &[0u32]);
    for c in GemvTcConfig::all() {
        let form = GemvForm::TensorCoresAs(c);
        for m in [1, 5, 8] {
            let xd = upload(&dev, &x[..m * k]);
            let (want_res, want_h) = two_kernels(&dev, form, &xd, &w, &residual[..m * n], &nw, m, n, k, false);
            let (res, h) = fused(&dev, form, &xd, &w, &residual[..m * n], &nw, &mut arrivals, m, n, k, false);
            assert_bitwise(&res, &want_res, &format!("{} m{m} residual", c.label()));
            assert_bitwise(&h, &want_h, &format!("{} m{m} h", c.label()));
        }
    }
    assert_eq!(counter(&dev, &arrivals), 0, "block counter not reset");
}

/// Two fused launches queued back to back on one counter (no host synchronisation between:
/// the second must find the counter the first reset) each give the two-kernel bits; the
/// second runs on the first's outputs, as consecutive layers do.
#[test]
fn gemv_add_rmsnorm_launches_in_a_row_reset_the_counter() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_add_rmsnorm_twice", st) else { return };
    if dev.compute_capability().0 < 8 {
        eprintln!("SKIP gemv_add_rmsnorm_twice: {} runs the SIMT GEMV", dev.arch());
        return;
    }
    let tc = GemvForm::TensorCores;
    let mut rng = Rng::new(98);
    let (m, n, k) = (3, 4096, 4096);
    let w1 = upload(&dev, &rounded(&rng.vec(n * k, -0.03, 0.03), st));
    let w2 = upload(&dev, &rounded(&rng.vec(n * k, -0.03, 0.03), st));
    let nw = upload(&dev, &rounded(&rng.vec(n, 0.5, 1.5), st));
    let x = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
    let residual = rounded(&rng.vec(m * n, -2.0, 2.0), st);
    let mut arrivals = upload_raw(&dev, &[0u32]);
    let mut tmp = Out16::new(&dev, m * n);
    let mut res = Out16::with(&dev, &residual);
    let mut h1 = Out16::new(&dev, m * n);
    let mut h2 = Out16::new(&dev, m * n);
    dev.gemv_add_rmsnorm_with(tc, &x, &w1, &mut tmp.view(), &mut res.view(), &nw, &mut h1.view(), &mut arrivals, m, n, k, EPS, false).unwrap();
    dev.gemv_add_rmsnorm_with(tc, &h1.view(), &w2, &mut tmp.view(), &mut res.view(), &nw, &mut h2.view(), &mut arrivals, m, n, k, EPS, false).unwrap();
    let (res, h1, h2) = (res.read(&dev, "residual"), h1.read(&dev, "h1"), h2.read(&dev, "h2"));
    let (want_res1, want_h1) = two_kernels(&dev, tc, &x, &w1, &residual, &nw, m, n, k, false);
    let (want_res2, want_h2) = two_kernels(&dev, tc, &upload(&dev, &want_h1), &w2, &want_res1, &nw, m, n, k, false);
    assert_bitwise(&h1, &want_h1, "first launch h");
    assert_bitwise(&h2, &want_h2, "second launch h");
    assert_bitwise(&res, &want_res2, "residual after both");
    assert_eq!(counter(&dev, &arrivals), 0, "block counter not reset");
}

/// The two-kernel routes: the SIMT form (sm_7x), 11 rows (cuBLAS, prefill) and a residual that
/// is not 16-byte aligned give exactly their two kernels' bits.
#[test]
fn gemv_add_rmsnorm_two_kernel_routes() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_add_rmsnorm_routes", st) else { return };
    let mut rng = Rng::new(99);
    let (n, k) = (1024, 512);
    let w = upload(&dev, &rounded(&rng.vec(n * k, -0.05, 0.05), st));
    let nw = upload(&dev, &rounded(&rng.vec(n, 0.5, 1.5), st));
    let mut arrivals = upload_raw(&dev, &[0u32]);
    for (form, m) in [(GemvForm::Simt, 4), (dev.gemv_form(), 11)] {
        let x = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
        let residual = rounded(&rng.vec(m * n, -2.0, 2.0), st);
        assert_eq!(add_norm_route(form, m, n, k, true), AddNormRoute::TwoKernels);
        let (want_res, want_h) = two_kernels(&dev, form, &x, &w, &residual, &nw, m, n, k, true);
        let (res, h) = fused(&dev, form, &x, &w, &residual, &nw, &mut arrivals, m, n, k, true);
        assert_bitwise(&res, &want_res, &format!("{form:?} m{m} residual"));
        assert_bitwise(&h, &want_h, &format!("{form:?} m{m} h"));
    }
    // The device's form (ByShape on sm_80+: at M = 1 the shapes it runs on CUDA cores stay
    // unfused) gives its own gemv + add_rmsnorm bits, fused or not, at the 8B's o and down, at
    // M = 1 and 2.
    for (n, k, m) in [(4096, 4096, 1), (4096, 4096, 2), (4096, 14336, 1), (4096, 14336, 2)] {
        let form = dev.gemv_form();
        let w = upload(&dev, &rounded(&rng.vec(n * k, -0.02, 0.02), st));
        let nw = upload(&dev, &rounded(&rng.vec(n, 0.5, 1.5), st));
        let x = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
        let residual = rounded(&rng.vec(m * n, -2.0, 2.0), st);
        let (want_res, want_h) = two_kernels(&dev, form, &x, &w, &residual, &nw, m, n, k, false);
        let mut tmp = Out16::new(&dev, m * n);
        let mut res = Out16::with(&dev, &residual);
        let mut h = Out16::new(&dev, m * n);
        dev.gemv_add_rmsnorm(&x, &w, &mut tmp.view(), &mut res.view(), &nw, &mut h.view(), &mut arrivals, m, n, k, EPS, false).unwrap();
        let what = format!("{form:?} ({:?}) n{n} k{k} m{m}", add_norm_route(form, m, n, k, true));
        assert_bitwise(&res.read(&dev, "device form residual"), &want_res, &format!("{what} residual"));
        assert_bitwise(&h.read(&dev, "device form h"), &want_h, &format!("{what} h"));
    }
    // Residual one element into its buffer: not 16-byte aligned, so two kernels.
    let (m, form) = (2, dev.gemv_form());
    let x = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
    let residual = rounded(&rng.vec(m * n + 1, -2.0, 2.0), st);
    let mut res = Out16::with(&dev, &residual);
    let mut tmp = Out16::new(&dev, m * n);
    let mut h = Out16::new(&dev, m * n);
    {
        let mut view = res.view();
        let mut shifted = view.slice_mut(1..);
        let p = shifted.device_ptr(dev.stream()).0;
        assert_ne!(p % 16, 0);
        dev.gemv_add_rmsnorm(&x, &w, &mut tmp.view(), &mut shifted, &nw, &mut h.view(), &mut arrivals, m, n, k, EPS, true).unwrap();
    }
    let (want_res, want_h) = two_kernels(&dev, form, &x, &w, &residual[1..], &nw, m, n, k, true);
    assert_bitwise(&res.read(&dev, "unaligned residual")[1..], &want_res, "unaligned residual");
    assert_bitwise(&h.read(&dev, "unaligned h"), &want_h, "unaligned h");
    assert_eq!(counter(&dev, &arrivals), 0, "block counter touched by two-kernel routes");
}

/// Throughput report (run with --ignored on the GPU): the fused kernel against the tensor-core
/// GEMV and add_rmsnorm it replaces, and against the CUDA-core GEMV + add_rmsnorm (what
/// `GemvForm::ByShape` keeps for the shapes it runs on CUDA cores: whether fusing on tensor
/// cores beats them is `simt_two_kernel_ms` against `fused_ms`), 200 launches back to back (PDL as the model launches them), the
/// weights rotated over 4 copies so that none is L2-resident (H200 L2: 50 MB).
#[test]
#[ignore]
fn report_gemv_add_rmsnorm_throughput() {
    let Some(dev) = gpu("gemv_add_rmsnorm_perf", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    let mut arrivals = upload_raw(&dev, &[0u32]);
    // Llama-3-8B's o_proj and down, Qwen3.5-27B's down.
    for (n, k) in [(4096, 4096), (4096, 14336), (5120, 17408)] {
        let nw = upload(&dev, &vec![1.0; n]);
        let ws: Vec<CudaSlice<u16>> = (0..4).map(|_| s.alloc_zeros::<u16>(n * k).unwrap()).collect();
        for m in [1, 2, 4, 8] {
            let x = s.alloc_zeros::<u16>(m * k).unwrap();
            let mut tmp = s.alloc_zeros::<u16>(m * n).unwrap();
            let mut res = s.alloc_zeros::<u16>(m * n).unwrap();
            let mut h = s.alloc_zeros::<u16>(m * n).unwrap();
            let mut i = 0;
            let tc = GemvForm::TensorCores;
            let fused_ms = super::time_ms(&dev, 200, || {
                i += 1;
                dev.gemv_add_rmsnorm_with(tc, &x, &ws[i % 4], &mut tmp, &mut res, &nw, &mut h, &mut arrivals, m, n, k, EPS, false).unwrap();
            });
            let mut two = |form: GemvForm| {
                super::time_ms(&dev, 200, || {
                    i += 1;
                    dev.gemv_with(form, &x, &ws[i % 4], &mut tmp, m, n, k).unwrap();
                    dev.add_rmsnorm(&mut res, &tmp, &nw, &mut h, m, n, EPS, false).unwrap();
                })
            };
            let (two_ms, simt_two_ms) = (two(tc), two(GemvForm::Simt));
            let gbps = (n * k * 2) as f64 / fused_ms / 1e6;
            println!(
                "PERF op=gemv_add_rmsnorm m={m} n={n} k={k} fused_ms={fused_ms:.4} two_kernel_ms={two_ms:.4} saved_us={:.2} simt_two_kernel_ms={simt_two_ms:.4} fused_GBps={gbps:.0} device_route={:?}",
                (two_ms - fused_ms) * 1e3,
                add_norm_route(dev.gemv_form(), m, n, k, true)
            );
        }
    }
}
