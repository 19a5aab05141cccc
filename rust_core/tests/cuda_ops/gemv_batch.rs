//! The decode batch GEMM (cuda/gemv_tc.cu `gemv_tc_batch_*`, ops/gemv_batch.rs: 9..64 rows on
//! sm_80+): both instances (4 and 8 warps) against the CPU reference at M = 9..64, ragged N,
//! one to 112 chunks of K, split and unsplit, in both storage types; row r the same bits
//! whatever M (the split depends on the shape only); a forced single split against the planned
//! split (different sum order, within tolerance); `linear` routing 9..64 rows to it; and its
//! cold-L2 time against cuBLAS at the decode shapes of Llama-3-8B and Qwen3.5-27B.

use ninfer_core::backend::cuda::ops::{batch_gemm_plan_with, BatchGemmPlan, BATCH_GEMM_WARPS};
use ninfer_core::backend::cuda::StorageDType;

use super::assert_bitwise;
use super::harness::{check, gpu, rounded, tol16, upload, Out16, Rng, STORAGES};
use super::reference;

/// The M values checked: each side of every instance boundary (16 / 32 / 64 rows).
const MS: [usize; 7] = [9, 13, 16, 17, 32, 33, 64];

#[test]
fn batch_gemm_matches_reference_and_rows_agree_across_m() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_batch", st) else { return };
        if !dev.batch_gemm() {
            eprintln!("SKIP gemv_batch: {} has no batch GEMM (sm_80+)", dev.arch());
            return;
        }
        let mut rng = Rng::new(71);
        // (n, k): ragged N with one chunk, a few chunks, the 8B o projection (split 5 ways) and
        // a long K with ragged N (split, last split shorter).
        for (n, k) in [(333, 128), (1000, 1024), (4096, 4096), (1000, 14336)] {
            let s = 3.0 / (k as f32).sqrt();
            let w = rounded(&rng.vec(n * k, -s, s), st);
            let wd = upload(&dev, &w);
            let x = rounded(&rng.vec(64 * k, -1.0, 1.0), st);
            let want = reference::matmul_nt(&x, &w, 64, n, k);
            for warps in [4, 8] {
                let mut first: Option<Vec<f32>> = None;
                for m in MS {
                    let plan = batch_gemm_plan_with(m, n, k, dev.sm_count(), warps).unwrap();
                    let xd = upload(&dev, &x[..m * k]);
                    let mut y = Out16::new(&dev, m * n);
                    dev.gemv_batch_with(plan, &xd, &wd, &mut y.view(), m, n, k).unwrap();
                    let y = y.read(&dev, "gemv_batch");
                    let shape = format!("w{warps}/m{m}n{n}k{k} splits {} ks {}", plan.splits, plan.ks);
                    check("gemv_batch", st, &shape, &y, &want[..m * n], tol16(st));
                    // Row r of every M equals row r of the first M's launch bit for bit.
                    match &first {
                        None => first = Some(y),
                        Some(f) => {
                            let rows = 9 * n;
                            assert_bitwise(&y[..rows], &f[..rows], &format!("gemv_batch {st:?} {shape}: first 9 rows vs M = 9"));
                        }
                    }
                }
                // One split (a block sums all of K) against the planned split: another order.
                let plan = batch_gemm_plan_with(40, n, k, dev.sm_count(), warps).unwrap();
                let one = BatchGemmPlan { splits: 1, ks: k, ..plan };
                let xd = upload(&dev, &x[..40 * k]);
                let mut y = Out16::new(&dev, 40 * n);
                dev.gemv_batch_with(one, &xd, &wd, &mut y.view(), 40, n, k).unwrap();
                check("gemv_batch unsplit", st, &format!("w{warps}/m40n{n}k{k}"), &y.read(&dev, "gemv_batch unsplit"), &want[..40 * n], tol16(st));
            }
        }
    }
}

/// `linear` sends 9..64 rows to the batch kernel (the device's plan: bit for bit its launch)
/// and 65 rows to cuBLAS (within tolerance of the reference).
#[test]
fn linear_routes_9_to_64_rows_to_the_batch_kernel() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_batch_route", st) else { return };
    if !dev.batch_gemm() {
        eprintln!("SKIP gemv_batch_route: {} has no batch GEMM", dev.arch());
        return;
    }
    let mut rng = Rng::new(72);
    let (n, k) = (2048, 2048);
    let w = rounded(&rng.vec(n * k, -0.05, 0.05), st);
    let wd = upload(&dev, &w);
    let x = rounded(&rng.vec(65 * k, -1.0, 1.0), st);
    let want = reference::matmul_nt(&x, &w, 65, n, k);
    for m in [9, 24, 64] {
        let plan = dev.batch_gemm_plan(m, n, k).expect("the shape fits the batch kernel");
        assert_eq!(plan, batch_gemm_plan_with(m, n, k, dev.sm_count(), BATCH_GEMM_WARPS).unwrap());
        let xd = upload(&dev, &x[..m * k]);
        let mut a = Out16::new(&dev, m * n);
        dev.linear(&xd, &wd, &mut a.view(), m, n, k).unwrap();
        let mut b = Out16::new(&dev, m * n);
        dev.gemv_batch_with(plan, &xd, &wd, &mut b.view(), m, n, k).unwrap();
        assert_bitwise(&a.read(&dev, "linear"), &b.read(&dev, "gemv_batch"), &format!("linear m{m} vs the batch kernel"));
    }
    assert_eq!(dev.batch_gemm_plan(65, n, k), None);
    let xd = upload(&dev, &x);
    let mut y = Out16::new(&dev, 65 * n);
    dev.linear(&xd, &wd, &mut y.view(), 65, n, k).unwrap();
    check("linear m65 (cuBLAS)", st, "m65", &y.read(&dev, "linear m65"), &want, tol16(st));
}

/// Cold-L2 time of the batch kernel against cuBLAS at the decode projections of Llama-3-8B and
/// Qwen3.5-27B for M = 16, 32, 64 (each launch on its own copy of the weight, >= 512 MB of
/// copies, as a decode step streams distinct layers): TIMING lines with both weight read rates
/// and their ratio. Asserts the kernel is not slower than cuBLAS by more than 5% summed over
/// each model's projections at each M (the route takes every such shape).
#[test]
fn batch_gemm_timing_against_cublas() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_batch_timing", st) else { return };
    if !dev.batch_gemm() {
        eprintln!("SKIP gemv_batch_timing: {} has no batch GEMM", dev.arch());
        return;
    }
    let s = dev.stream().clone();
    let mut rng = Rng::new(73);
    let block = upload(&dev, &rounded(&rng.vec(4 << 20, -0.05, 0.05), st));
    let copy_elems = 256 << 20;
    let copy_src = s.alloc_zeros::<u16>(copy_elems).unwrap();
    let mut copy_dst = s.alloc_zeros::<u16>(copy_elems).unwrap();
    let mut filler = || s.memcpy_dtod(&copy_src, &mut copy_dst).unwrap();
    let models: [(&str, &[(&str, usize, usize)]); 2] = [
        ("llama-3-8b", &[("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]),
        ("qwen3_5-27b", &[("gdn_in", 16480, 5120), ("attn_qkv", 14336, 5120), ("o", 5120, 6144), ("gate_up", 34816, 5120), ("down", 5120, 17408)]),
    ];
    let mut failures = Vec::new();
    for (model, shapes) in models {
        for m in [16, 32, 64] {
            let (mut ours_sum, mut cublas_sum) = (0.0, 0.0);
            for &(name, n, k) in shapes {
                let len = n * k;
                let copies = (512usize << 20).div_ceil(len * 2).max(2);
                let mut w = s.alloc_zeros::<u16>(copies * len).unwrap();
                let mut at = 0;
                while at < copies * len {
                    let c = block.len().min(copies * len - at);
                    s.memcpy_dtod(&block.slice(..c), &mut w.slice_mut(at..at + c)).unwrap();
                    at += c;
                }
                let x = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
                let mut y = s.alloc_zeros::<u16>(m * n).unwrap();
                let plan = batch_gemm_plan_with(m, n, k, dev.sm_count(), BATCH_GEMM_WARPS).unwrap();
                let launches = copies * 4;
                let mut time = |ours: bool| {
                    super::gemv_tc::times_ms(&dev, &mut filler, launches, &mut |i| {
                        let wi = w.slice((i % copies) * len..(i % copies + 1) * len);
                        if ours {
                            dev.gemv_batch_with(plan, &x, &wi, &mut y, m, n, k).unwrap()
                        } else {
                            dev.gemm(&x, &wi, &mut y, m, n, k).unwrap()
                        }
                    })[3]
                };
                let ours = time(true);
                let cublas = time(false);
                ours_sum += ours;
                cublas_sum += cublas;
                let tbs = |ms: f64| (len * 2) as f64 / ms / 1e9;
                println!(
                    "TIMING batch_gemm {model} {name} n{n} k{k} m{m} (splits {} ks {}): {:.2} us {:.2} TB/s, cuBLAS {:.2} us {:.2} TB/s ({:.3}x)",
                    plan.splits,
                    plan.ks,
                    ours * 1e3,
                    tbs(ours),
                    cublas * 1e3,
                    tbs(cublas),
                    cublas / ours
                );
            }
            println!("TIMING batch_gemm {model} m{m} all projections: {:.2} us against cuBLAS {:.2} us ({:.3}x)", ours_sum * 1e3, cublas_sum * 1e3, cublas_sum / ours_sum);
            if ours_sum > 1.05 * cublas_sum {
                failures.push(format!("{model} m{m}: {:.2} us against cuBLAS {:.2}", ours_sum * 1e3, cublas_sum * 1e3));
            }
        }
    }
    assert!(failures.is_empty(), "batch GEMM slower than cuBLAS: {failures:?}");
}
