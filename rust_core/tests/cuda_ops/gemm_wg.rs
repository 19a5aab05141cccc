//! The warpgroup decode GEMM (cuda/gemm_wg.cu, `gemm_wg_with`; sm_90a only) against the CPU
//! reference at every instance (M of 1..64 around the 16 / 32 / 64 boundaries), ragged N and K
//! (partial tiles, partial stages, K from one 8-element chunk to the 8B down projection's
//! 14336), 128- and 256-row blocks, K split over 1-8 blocks of a cluster, both storage types; launches are deterministic
//! and rows of a padded launch equal the same rows of a fuller launch of the same instance bit
//! for bit; `linear` routes 9-64 rows to it when switched on; and the cold-L2 sweep against cuBLAS over the
//! decode shapes of Llama-3-8B and Qwen3.5-27B (`report_gemm_wg_sweep`, ignored: run on the GPU).

use ninfer_core::backend::cuda::kernels::has_sm90a_code;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::assert_bitwise;
use super::gemv_tc::{cold_weights, copy_ceiling, times_ms, REPEATS};
use super::harness::{check, gpu, rounded, tol16, upload, Out16, Rng, STORAGES};
use super::reference;

/// The device when it runs sm_90a code, else None with the reason printed.
fn hopper(test: &str, st: StorageDType) -> Option<CudaDevice> {
    let dev = gpu(test, st)?;
    let (major, minor) = dev.compute_capability();
    if !has_sm90a_code(major, minor) {
        eprintln!("SKIP {test}: {} has no wgmma", dev.arch());
        return None;
    }
    Some(dev)
}

#[test]
fn gemm_wg_matches_reference_at_every_instance_and_split() {
    for st in STORAGES {
        let Some(dev) = hopper("gemm_wg", st) else { return };
        let mut rng = Rng::new(71);
        for (n, k) in [(333, 8), (333, 1000), (1000, 4096), (256, 14336)] {
            let s = 3.0 / (k as f32).sqrt();
            let w = rounded(&rng.vec(n * k, -s, s), st);
            let wd = upload(&dev, &w);
            let x = rounded(&rng.vec(64 * k, -1.0, 1.0), st);
            for m in [1, 9, 16, 17, 32, 33, 48, 64] {
                let want = reference::matmul_nt(&x[..m * k], &w, m, n, k);
                let xd = upload(&dev, &x[..m * k]);
                for rows in [128, 256] {
                    for splits in [None, Some(1), Some(3), Some(8)] {
                        let plan = dev.gemm_wg_plan_for(m, n, k, Some(rows), splits).unwrap();
                        let shape = format!("m{m}n{n}k{k} rows {rows} splits {}x{} steps", plan.splits, plan.steps);
                        let mut y = Out16::new(&dev, m * n);
                        dev.gemm_wg_with(&xd, &wd, &mut y.view(), m, n, k, Some(rows), splits).unwrap();
                        let got = y.read(&dev, "gemm_wg");
                        check("gemm_wg", st, &shape, &got, &want, tol16(st));
                        // The cluster sums partials in split order, whichever block finishes first.
                        let mut again = Out16::new(&dev, m * n);
                        dev.gemm_wg_with(&xd, &wd, &mut again.view(), m, n, k, Some(rows), splits).unwrap();
                        assert_bitwise(&again.read(&dev, "gemm_wg again"), &got, &format!("gemm_wg {st:?} {shape} repeated"));
                    }
                }
            }
        }
    }
}

/// Each output depends only on its weight row and x row, so the x rows an instance pads with
/// zeros change nothing: rows of a 9-row launch equal the first 9 rows of a 16-row launch (the
/// n16 instance), 17 of 32 (n32) and 33 of 64 (n64), bit for bit, at the same split.
#[test]
fn gemm_wg_padded_rows_equal_the_same_rows_of_a_full_launch() {
    let st = StorageDType::Bf16;
    let Some(dev) = hopper("gemm_wg_padding", st) else { return };
    let mut rng = Rng::new(72);
    let (n, k) = (520, 2048);
    let w = upload(&dev, &rounded(&rng.vec(n * k, -0.05, 0.05), st));
    let x = rounded(&rng.vec(64 * k, -1.0, 1.0), st);
    for (part, full) in [(9, 16), (17, 32), (33, 64)] {
        let run = |m: usize| {
            let xd = upload(&dev, &x[..m * k]);
            let mut y = Out16::new(&dev, m * n);
            dev.gemm_wg_with(&xd, &w, &mut y.view(), m, n, k, None, Some(4)).unwrap();
            y.read(&dev, "gemm_wg")
        };
        let (a, b) = (run(part), run(full));
        assert_bitwise(&a, &b[..part * n], &format!("gemm_wg m{part} vs the first rows of m{full}"));
    }
}

/// `linear` runs 9-64 rows on the warpgroup GEMM once it is switched on (`NINFER_WG_GEMM=1`,
/// here `set_wg_gemm`), bit for bit, and cuBLAS once it is off.
#[test]
fn linear_routes_9_to_64_rows_to_gemm_wg_when_switched_on() {
    let st = StorageDType::Bf16;
    let Some(dev) = hopper("gemm_wg_route", st) else { return };
    let mut rng = Rng::new(73);
    let (n, k) = (768, 1024);
    let w = upload(&dev, &rounded(&rng.vec(n * k, -0.05, 0.05), st));
    for m in [9, 24, 64] {
        let xd = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
        let run = |route: &dyn Fn(&mut Out16)| {
            let mut y = Out16::new(&dev, m * n);
            route(&mut y);
            y.read(&dev, "linear")
        };
        dev.set_wg_gemm(true).unwrap();
        assert!(dev.wg_gemm_fits(m, k), "m {m}");
        let routed = run(&|y| dev.linear(&xd, &w, &mut y.view(), m, n, k).unwrap());
        let direct = run(&|y| dev.gemm_wg_with(&xd, &w, &mut y.view(), m, n, k, None, None).unwrap());
        assert_bitwise(&routed, &direct, &format!("linear m{m} with NINFER_WG_GEMM on"));
        dev.set_wg_gemm(false).unwrap();
        assert!(!dev.wg_gemm_fits(m, k), "m {m}");
        let off = run(&|y| dev.linear(&xd, &w, &mut y.view(), m, n, k).unwrap());
        let cublas = run(&|y| dev.gemm(&xd, &w, &mut y.view(), m, n, k).unwrap());
        assert_bitwise(&off, &cublas, &format!("linear m{m} with NINFER_WG_GEMM off"));
    }
    dev.set_wg_gemm(true).unwrap();
    assert!(!dev.wg_gemm_fits(8, k) && !dev.wg_gemm_fits(65, k) && !dev.wg_gemm_fits(16, 1001));
}

/// Decode projections (name, weight rows, K) of Llama-3-8B and Qwen3.5-27B (shapes as in
/// gemv_tc.rs SWEEP_SHAPES; gate_up as a plain GEMM of the fused weight).
const SHAPES: [(&str, usize, usize); 9] = [
    ("llama8b.qkv", 6144, 4096),
    ("llama8b.o", 4096, 4096),
    ("llama8b.gate_up", 28672, 4096),
    ("llama8b.down", 4096, 14336),
    ("qwen35_27b.attn_qkv", 14336, 5120),
    ("qwen35_27b.attn_o+gdn_out", 5120, 6144),
    ("qwen35_27b.gdn_in_proj", 16480, 5120),
    ("qwen35_27b.gate_up", 34816, 5120),
    ("qwen35_27b.down", 5120, 17408),
];

/// Cold-L2 sweep (run with --ignored on the GPU): per shape and M = 16, 32, 64, the weight read
/// rate (GB/s) of cuBLAS and of gemm_wg at its defaults, with 128-row blocks at their plan, and
/// at 2, 4, 8 splits, each
/// launch on its own copy of the weight (gemv_tc.rs `times_ms`), against a 1 GB copy.
#[test]
#[ignore]
fn report_gemm_wg_sweep() {
    let st = StorageDType::Bf16;
    let Some(dev) = hopper("gemm_wg_sweep", st) else { return };
    let s = dev.stream().clone();
    let mut rng = Rng::new(74);
    let block = upload(&dev, &rounded(&rng.vec(4 << 20, -0.05, 0.05), st));
    let (copy_src, mut copy_dst, copy) = copy_ceiling(&dev);
    println!("PERF op=gemm_wg_sweep_copy GBps={copy:.0}");
    let mut filler = || s.memcpy_dtod(&copy_src, &mut copy_dst).unwrap();
    let (mut sum_cublas, mut sum_wg) = (0.0, 0.0);
    for (name, rows, k) in SHAPES {
        let len = rows * k;
        let bytes = len * 2;
        let (w, copies, launches) = cold_weights(&dev, &block, len);
        let x = upload(&dev, &rounded(&rng.vec(64 * k, -1.0, 1.0), st));
        let mut y = s.alloc_zeros::<u16>(64 * rows).unwrap();
        for m in [16, 32, 64] {
            let xm = x.slice(..m * k);
            // None: cuBLAS; Some((rows, splits)): gemm_wg (None: its defaults).
            let mut time = |form: Option<(Option<usize>, Option<usize>)>| {
                times_ms(&dev, &mut filler, launches, &mut |i| {
                    let wi = w.slice((i % copies) * len..(i % copies + 1) * len);
                    match form {
                        None => dev.gemm(&xm, &wi, &mut y, m, rows, k),
                        Some((r, sp)) => dev.gemm_wg_with(&xm, &wi, &mut y, m, rows, k, r, sp),
                    }
                    .unwrap()
                })[REPEATS / 2]
            };
            let gbps = |ms: f64| bytes as f64 / ms / 1e6;
            let cublas = time(None);
            let plan = dev.gemm_wg_plan_for(m, rows, k, None, None).unwrap();
            let plan128 = dev.gemm_wg_plan_for(m, rows, k, Some(128), None).unwrap();
            let wg = time(Some((None, None)));
            sum_cublas += cublas;
            sum_wg += wg;
            let mut line = format!(
                "PERF op=gemm_wg_sweep shape={name} rows={rows} k={k} m={m} cublas={:.0} wg={:.0} plan_splits={} wg_vs_cublas={:.3} wg_frac={:.3} cublas_frac={:.3} r128={:.0} r128_splits={}",
                gbps(cublas),
                gbps(wg),
                plan.splits,
                cublas / wg,
                gbps(wg) / copy,
                gbps(cublas) / copy,
                gbps(time(Some((Some(128), None)))),
                plan128.splits
            );
            for sp in [2, 4, 8] {
                line += &format!(" s{sp}={:.0}", gbps(time(Some((None, Some(sp))))));
            }
            println!("{line}");
        }
    }
    println!("PERF op=gemm_wg_sweep_total cublas_ms={sum_cublas:.4} wg_ms={sum_wg:.4} speedup={:.3}", sum_cublas / sum_wg);
}
