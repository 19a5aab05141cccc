//! The tensor-core decode GEMV (cuda/gemv_tc.cu, `GemvForm::TensorCores`, on sm_80+ the route
//! of every M of 1..8 for the shapes `GemvForm::ByShape` keeps on tensor cores) in every instance (warps x unroll) against the CPU reference at
//! M = 1..8, ragged N and K = 8 / 1000 / 4096 / 14336 in both storage types and all three
//! epilogues; row r of an M-row launch against the one-row launch bit for bit (batch == alone);
//! the SwiGLU epilogue against its own GEMV of the fused weight followed by swiglu bit for bit;
//! the routing (`gemv` runs the plan's `gemv_form`, the tensor-core form the shape's `gemv_tc_config`);
//! and the cold-L2 sweep of the instances over the decode shapes of Llama-3-8B and Qwen3.5-27B
//! (`report_gemv_tc_sweep`, ignored: run on the GPU to fill `GEMV_TC_RULES`).

use ninfer_core::backend::cuda::ops::{gemv_shape_on_cuda_cores, gemv_tc_config, GemvForm, GemvTcConfig};
use ninfer_core::backend::cuda::plan::TC_PREFETCH_STEPS;
use ninfer_core::backend::cuda::StorageDType;

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::CudaDevice;

use super::assert_bitwise;
use super::harness::{check, gpu, profile_device, rounded, tol16, upload, Out16, Out32, Rng, STORAGES, TOL32};
use super::reference;

/// One instance's one-row results of each x row: storage, f32 and SwiGLU outputs.
struct OneRows {
    config: GemvTcConfig,
    y16: Vec<Vec<f32>>,
    y32: Vec<Vec<f32>>,
    act: Vec<Vec<f32>>,
}

/// N = 333 (not a multiple of the 16-row tile; the SwiGLU tile's 8 activations: inter = 333),
/// K from one 8-element chunk (one partial k32 step) through 1000 (K % 32 = 8: a partial last
/// step) to the 8B down projection's 14336, in every instance (warps x unroll) of the kernel.
/// Per instance, the one-row results of the 8 x rows are computed once per K and every M-row
/// launch (its x the first M of those rows) must reproduce them; and instances with the same
/// warps must agree bit for bit whatever their unroll and hold (they change the loads in
/// flight, not the order of any sum), which with the rows == one row check covers every M.
#[test]
fn tc_gemv_matches_reference_and_rows_equal_one_row_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_tc", st) else { return };
        if dev.compute_capability().0 < 8 {
            eprintln!("SKIP gemv_tc: {} runs the SIMT GEMV", dev.arch());
            return;
        }
        let mut rng = Rng::new(41);
        let n = 333;
        for k in [8, 1000, 4096, 14336] {
            let s = 3.0 / (k as f32).sqrt();
            let w = rounded(&rng.vec(2 * n * k, -s, s), st);
            let wd = upload(&dev, &w);
            let x = rounded(&rng.vec(8 * k, -1.0, 1.0), st);
            // The references of every M (the first M rows of x): GEMV over the first n rows of
            // w, and SwiGLU of the fused [2n, k] weight's sums rounded as the GEMV stores them.
            let want: Vec<Vec<f32>> = (1..=8).map(|m| reference::matmul_nt(&x[..m * k], &w[..n * k], m, n, k)).collect();
            let want_act: Vec<Vec<f32>> = (1..=8)
                .map(|m| reference::swiglu(&rounded(&reference::matmul_nt(&x[..m * k], &w, m, 2 * n, k), st), m, n))
                .collect();
            // One-row results of the first instance of each warps count.
            let mut first_of_warps: Vec<OneRows> = Vec::new();
            for c in GemvTcConfig::all() {
                let tc = GemvForm::TensorCoresAs(c);
                let inst = c.label();
                // One-row launches of each x row: storage, f32 and SwiGLU outputs.
                let (mut one16, mut one32, mut one_act) = (Vec::new(), Vec::new(), Vec::new());
                for r in 0..8 {
                    let xr = upload(&dev, &x[r * k..(r + 1) * k]);
                    let mut y = Out16::new(&dev, n);
                    dev.gemv_with(tc, &xr, &wd, &mut y.view(), 1, n, k).unwrap();
                    one16.push(y.read(&dev, "gemv_tc one"));
                    let mut y32 = Out32::new(&dev, n);
                    dev.gemv_f32_out_with(tc, &xr, &wd, &mut y32.view(), 1, n, k).unwrap();
                    one32.push(y32.read(&dev, "gemv_tc_f32out one"));
                    let mut act = Out16::new(&dev, n);
                    dev.gemv_gateup_swiglu_with(tc, &xr, &wd, &mut act.view(), 1, n, k).unwrap();
                    one_act.push(act.read(&dev, "gemv_tc_gateup_swiglu one"));
                }
                match first_of_warps.iter().find(|f| f.config.warps == c.warps) {
                    Some(f) => {
                        for r in 0..8 {
                            let what = |op: &str| format!("{op} {st:?} n{n}k{k} x row {r}: {inst} vs {}", f.config.label());
                            assert_bitwise(&one16[r], &f.y16[r], &what("gemv_tc"));
                            assert_bitwise(&one32[r], &f.y32[r], &what("gemv_tc_f32out"));
                            assert_bitwise(&one_act[r], &f.act[r], &what("gemv_tc_gateup_swiglu"));
                        }
                    }
                    None => first_of_warps.push(OneRows { config: c, y16: one16.clone(), y32: one32.clone(), act: one_act.clone() }),
                }
                for m in 1..=8 {
                    let xd = upload(&dev, &x[..m * k]);
                    let shape = format!("{inst}/m{m}n{n}k{k}");
                    let mut y = Out16::new(&dev, m * n);
                    dev.gemv_with(tc, &xd, &wd, &mut y.view(), m, n, k).unwrap();
                    let y = y.read(&dev, "gemv_tc");
                    check("gemv_tc", st, &shape, &y, &want[m - 1], tol16(st));
                    let mut y32 = Out32::new(&dev, m * n);
                    dev.gemv_f32_out_with(tc, &xd, &wd, &mut y32.view(), m, n, k).unwrap();
                    let y32 = y32.read(&dev, "gemv_tc_f32out");
                    check("gemv_tc_f32out", st, &shape, &y32, &want[m - 1], TOL32);
                    // SwiGLU over the fused [2n, k] weight, against the reference and bit for
                    // bit against this instance's GEMV of the fused weight followed by swiglu.
                    let mut act = Out16::new(&dev, m * n);
                    dev.gemv_gateup_swiglu_with(tc, &xd, &wd, &mut act.view(), m, n, k).unwrap();
                    let act = act.read(&dev, "gemv_tc_gateup_swiglu");
                    check("gemv_tc_gateup_swiglu", st, &shape, &act, &want_act[m - 1], tol16(st));
                    let mut gu = Out16::new(&dev, m * 2 * n);
                    dev.gemv_with(tc, &xd, &wd, &mut gu.view(), m, 2 * n, k).unwrap();
                    let gud = upload(&dev, &gu.read(&dev, "gemv_tc gate_up"));
                    let mut act2 = Out16::new(&dev, m * n);
                    dev.swiglu(&gud, &gud.slice(n..), &mut act2.view(), m, n, 2 * n, 2 * n).unwrap();
                    assert_bitwise(&act, &act2.read(&dev, "swiglu"), &format!("gemv_tc_gateup_swiglu {st:?} {shape} vs gemv_tc + swiglu"));
                    // Batch == alone: every row of the M-row launch equals its one-row launch.
                    for r in 0..m {
                        let rows = r * n..(r + 1) * n;
                        assert_bitwise(&y[rows.clone()], &one16[r], &format!("gemv_tc {st:?} {shape} row {r} vs M=1"));
                        assert_bitwise(&y32[rows.clone()], &one32[r], &format!("gemv_tc_f32out {st:?} {shape} row {r} vs M=1"));
                        assert_bitwise(&act[rows], &one_act[r], &format!("gemv_tc_gateup_swiglu {st:?} {shape} row {r} vs M=1"));
                    }
                }
            }
        }
    }
}

/// `GemvForm::TensorCores` runs the weight shape's `gemv_tc_config` instance: bit for bit
/// `TensorCoresAs` of it, for a plain weight and for the SwiGLU epilogue (looked up by the
/// fused weight's 2 * inter rows), at M = 1 and 5.
#[test]
fn tensor_cores_run_the_shapes_instance() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_tc_config", st) else { return };
    if dev.compute_capability().0 < 8 {
        eprintln!("SKIP gemv_tc_config: {} runs the SIMT GEMV", dev.arch());
        return;
    }
    let mut rng = Rng::new(47);
    let (n, k) = (4096, 1024);
    let w = upload(&dev, &rounded(&rng.vec(n * k, -0.05, 0.05), st));
    for m in [1, 5] {
        let xd = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
        let fixed = GemvForm::TensorCoresAs(gemv_tc_config(n, k));
        let mut a = Out16::new(&dev, m * n);
        dev.gemv_with(GemvForm::TensorCores, &xd, &w, &mut a.view(), m, n, k).unwrap();
        let mut b = Out16::new(&dev, m * n);
        dev.gemv_with(fixed, &xd, &w, &mut b.view(), m, n, k).unwrap();
        assert_bitwise(&a.read(&dev, "gemv TensorCores"), &b.read(&dev, "gemv TensorCoresAs"), &format!("gemv {n}x{k} m={m}"));
        let inter = n / 2;
        let fixed = GemvForm::TensorCoresAs(gemv_tc_config(2 * inter, k));
        let mut c = Out16::new(&dev, m * inter);
        dev.gemv_gateup_swiglu_with(GemvForm::TensorCores, &xd, &w, &mut c.view(), m, inter, k).unwrap();
        let mut d = Out16::new(&dev, m * inter);
        dev.gemv_gateup_swiglu_with(fixed, &xd, &w, &mut d.view(), m, inter, k).unwrap();
        assert_bitwise(&c.read(&dev, "swiglu TensorCores"), &d.read(&dev, "swiglu TensorCoresAs"), &format!("gemv_gateup_swiglu inter {inter} k {k} m={m}"));
    }
    // ByShape: at M = 1 a shape the table runs on CUDA cores there runs the SIMT kernel (every
    // shape today), else its instance; at M = 5 its instance; bit for bit.
    for (n2, k2) in [(4096, 8192), (4096, 1024)] {
        let w2 = upload(&dev, &rounded(&rng.vec(n2 * k2, -0.05, 0.05), st));
        for m in [1, 5] {
            let form = if m == 1 && gemv_shape_on_cuda_cores(n2, k2) { GemvForm::Simt } else { GemvForm::TensorCoresAs(gemv_tc_config(n2, k2)) };
            let xd = upload(&dev, &rounded(&rng.vec(m * k2, -1.0, 1.0), st));
            let mut a = Out16::new(&dev, m * n2);
            dev.gemv_with(GemvForm::ByShape, &xd, &w2, &mut a.view(), m, n2, k2).unwrap();
            let mut b = Out16::new(&dev, m * n2);
            dev.gemv_with(form, &xd, &w2, &mut b.view(), m, n2, k2).unwrap();
            assert_bitwise(&a.read(&dev, "gemv ByShape"), &b.read(&dev, "gemv fixed form"), &format!("ByShape {n2}x{k2} m={m} as {form:?}"));
        }
    }
    // A pair that has no instance is a typed error naming it, not a launch.
    let xd = upload(&dev, &rounded(&rng.vec(k, -1.0, 1.0), st));
    let mut y = Out16::new(&dev, n);
    let err = dev.gemv_with(GemvForm::TensorCoresAs(GemvTcConfig { warps: 12, unroll: 4, hold: false }), &xd, &w, &mut y.view(), 1, n, k).unwrap_err();
    assert!(err.to_string().contains("12 warps"), "{err}");
}

/// The pre-wait L2 prefetch depth (the plan's `tc_prefetch_steps`, which a device profile may
/// set) changes no bit: every epilogue (storage, f32, SwiGLU) of instances with 4,
/// 8 and 16 warps at depths 0 (none), 7 (not a multiple of the warps), 64 and 512 (past K)
/// against the default depth 16, at M = 1 and 8, K = 1000 (a partial last step) and 14336.
#[test]
fn tc_prefetch_depth_changes_no_bit() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_tc_prefetch", st) else { return };
    if dev.compute_capability().0 < 8 {
        eprintln!("SKIP gemv_tc_prefetch: {} runs the SIMT GEMV", dev.arch());
        return;
    }
    assert_eq!(dev.tc_prefetch_steps(), TC_PREFETCH_STEPS);
    let mut rng = Rng::new(53);
    let n = 1024;
    for k in [1000, 14336] {
        let s = 3.0 / (k as f32).sqrt();
        let w = upload(&dev, &rounded(&rng.vec(2 * n * k, -s, s), st));
        for m in [1, 8] {
            let x = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
            for c in [GemvTcConfig { warps: 4, unroll: 4, hold: false }, GemvTcConfig { warps: 8, unroll: 8, hold: true }, GemvTcConfig { warps: 16, unroll: 4, hold: true }] {
                let form = GemvForm::TensorCoresAs(c);
                let run = |dev: &ninfer_core::backend::cuda::CudaDevice| {
                    let mut y = Out16::new(&dev, m * n);
                    dev.gemv_with(form, &x, &w, &mut y.view(), m, n, k).unwrap();
                    let mut y32 = Out32::new(&dev, m * n);
                    dev.gemv_f32_out_with(form, &x, &w, &mut y32.view(), m, n, k).unwrap();
                    let mut act = Out16::new(&dev, m * n);
                    dev.gemv_gateup_swiglu_with(form, &x, &w, &mut act.view(), m, n, k).unwrap();
                    [y.read(dev, "y"), y32.read(dev, "y32"), act.read(dev, "act")]
                };
                let want = run(&dev);
                for depth in [0, 7, 64, 512] {
                    let deep = profile_device(&dev, &format!(r#"{{"tc_prefetch_steps": {depth}}}"#));
                    assert_eq!(deep.tc_prefetch_steps(), depth);
                    let got = run(&deep);
                    for (i, what) in ["gemv", "f32out", "swiglu"].iter().enumerate() {
                        assert_bitwise(&got[i], &want[i], &format!("{what} {} k{k} m{m} prefetch {depth}", c.label()));
                    }
                }
            }
        }
    }
}

/// `gemv`, `linear` and `gemv_gateup_swiglu` run the device's form: on sm_80+ their results are
/// the tensor-core kernel's bit for bit (M = 3, and M = 11: launches of 8 + 3 rows).
#[test]
fn gemv_routes_through_gemv_form() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_route", st) else { return };
    let form = dev.gemv_form();
    let mut rng = Rng::new(43);
    let (n, k) = (100, 264);
    let w = upload(&dev, &rounded(&rng.vec(2 * n * k, -0.2, 0.2), st));
    for m in [3, 8, 11] {
        let xd = upload(&dev, &rounded(&rng.vec(m * k, -1.0, 1.0), st));
        if m <= 8 {
            let mut a = Out16::new(&dev, m * n);
            dev.linear(&xd, &w, &mut a.view(), m, n, k).unwrap();
            let mut b = Out16::new(&dev, m * n);
            dev.gemv_with(form, &xd, &w, &mut b.view(), m, n, k).unwrap();
            assert_bitwise(&a.read(&dev, "linear"), &b.read(&dev, "gemv_with"), &format!("linear vs gemv_with({form:?}) m={m}"));
        }
        let mut c = Out16::new(&dev, m * n);
        dev.gemv_gateup_swiglu(&xd, &w, &mut c.view(), m, n, k).unwrap();
        let mut d = Out16::new(&dev, m * n);
        dev.gemv_gateup_swiglu_with(form, &xd, &w, &mut d.view(), m, n, k).unwrap();
        assert_bitwise(&c.read(&dev, "gemv_gateup_swiglu"), &d.read(&dev, "gemv_gateup_swiglu_with"), &format!("gemv_gateup_swiglu vs _with({form:?}) m={m}"));
    }
}

/// What a swept projection stores: the epilogue of its decode launch.
#[derive(Clone, Copy, PartialEq)]
enum SweepOut {
    Store,
    /// f32 logits (the lm_head).
    F32,
    /// SwiGLU of the fused gate_up weight (rows = 2 * inter).
    SwiGlu,
}

/// The decode GEMV shapes (name, weight rows, K, epilogue) of Llama-3-8B (hidden 4096, 32 / 8
/// heads of 128, FFN 14336, vocab 128256) and Qwen3.5-27B (hidden 5120; attention 24 q heads
/// of 256 with an output gate, fused q | gate | k | v = 2 * 6144 + 2 * 1024 rows; GDN in_proj
/// q | k | v | z | b | a = 2 * 2048 + 6144 + 6144 + 2 * 48 rows; attention o and GDN out both
/// 5120 x 6144; FFN 17408; vocab 248320 untied).
const SWEEP_SHAPES: [(&str, usize, usize, SweepOut); 11] = [
    ("llama8b.qkv", 6144, 4096, SweepOut::Store),
    ("llama8b.o", 4096, 4096, SweepOut::Store),
    ("llama8b.gate_up", 28672, 4096, SweepOut::SwiGlu),
    ("llama8b.down", 4096, 14336, SweepOut::Store),
    ("llama8b.lm_head", 128256, 4096, SweepOut::F32),
    ("qwen35_27b.attn_qkv", 14336, 5120, SweepOut::Store),
    ("qwen35_27b.attn_o+gdn_out", 5120, 6144, SweepOut::Store),
    ("qwen35_27b.gdn_in_proj", 16480, 5120, SweepOut::Store),
    ("qwen35_27b.gate_up", 34816, 5120, SweepOut::SwiGlu),
    ("qwen35_27b.down", 5120, 17408, SweepOut::Store),
    ("qwen35_27b.lm_head", 248320, 5120, SweepOut::F32),
];

/// Weight bytes each timed run streams through distinct copies of a shape's weight, at least:
/// five times the H200's 50 MB L2, so no launch finds its weight in L2 from an earlier one.
const COLD_BYTES: usize = 256 << 20;
/// Weight bytes per timed repeat, at least (a whole number of passes over the copies): enough
/// launches that the events' resolution does not matter.
const REPEAT_BYTES: usize = 512 << 20;
/// Timed repeats per figure; the median is reported.
pub(super) const REPEATS: usize = 7;

/// The ceiling of the sweeps: two 1 GB buffers and the rate (GB/s, read + write bytes) of one
/// device-to-device copy between them, the fastest of the repeats (benches/gpu_bench.py's
/// ceiling: the best of 20 copies). The buffers stay for the copy before each timed repeat.
pub(super) fn copy_ceiling(dev: &CudaDevice) -> (CudaSlice<u16>, CudaSlice<u16>, f64) {
    let s = dev.stream().clone();
    let copy_elems = 512 << 20;
    let copy_src = s.alloc_zeros::<u16>(copy_elems).unwrap();
    let mut copy_dst = s.alloc_zeros::<u16>(copy_elems).unwrap();
    let copy_ms = times_ms(dev, &mut || {}, 1, &mut |_| s.memcpy_dtod(&copy_src, &mut copy_dst).unwrap())[0];
    (copy_src, copy_dst, 2.0 * (copy_elems * 2) as f64 / copy_ms / 1e6)
}

/// Distinct copies of a weight of `len` elements, at least COLD_BYTES in all, each filled from
/// `block` (random values: the mma datapath's power depends on the data), and the launches a
/// timed repeat runs (at least REPEAT_BYTES, whole passes over the copies).
pub(super) fn cold_weights(dev: &CudaDevice, block: &CudaSlice<u16>, len: usize) -> (CudaSlice<u16>, usize, usize) {
    let s = dev.stream();
    let bytes = len * 2;
    let copies = COLD_BYTES.div_ceil(bytes);
    let launches = REPEAT_BYTES.div_ceil(bytes).div_ceil(copies) * copies;
    let mut w = s.alloc_zeros::<u16>(copies * len).unwrap();
    let mut at = 0;
    while at < copies * len {
        let n = block.len().min(copies * len - at);
        s.memcpy_dtod(&block.slice(..n), &mut w.slice_mut(at..at + n)).unwrap();
        at += n;
    }
    (w, copies, launches)
}

/// Milliseconds per call of `f(i)` over `launches` back-to-back calls (i = call index), timed
/// with CUDA events, REPEATS times after one untimed pass, ascending. Before each start event
/// the stream gets a 1 GB device copy (`filler`), during which the host queues the launches
/// ahead of the GPU, so small shapes are timed as the GPU runs them (as in a CUDA graph), not at
/// the host's launch rate.
pub(super) fn times_ms(dev: &CudaDevice, filler: &mut dyn FnMut(), launches: usize, f: &mut dyn FnMut(usize)) -> Vec<f64> {
    use cudarc::driver::sys::CUevent_flags;
    for i in 0..launches {
        f(i);
    }
    let start = dev.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    let end = dev.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    let mut ms: Vec<f64> = (0..REPEATS)
        .map(|_| {
            filler();
            start.record(dev.stream()).unwrap();
            for i in 0..launches {
                f(i);
            }
            end.record(dev.stream()).unwrap();
            end.synchronize().unwrap();
            start.elapsed_ms(&end).unwrap() as f64 / launches as f64
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms
}

/// Cold-L2 sweep of the tensor-core GEMV instances (run with --ignored on the GPU): for each
/// decode shape of SWEEP_SHAPES and M = 1, 2, 4, 8, the weight read rate (GB/s) of every
/// instance (w{warps}u{unroll}), the SIMT GEMV and cuBLAS, each launch on its own copy of the
/// weight (>= COLD_BYTES of copies per shape, as decode streams ~16 GB of distinct weights per
/// token), against the rate of a 1 GB device-to-device copy (read + write bytes). One line per
/// (shape, M), then per shape the instance with the highest M = 1 rate, the one with the least
/// time over M = 1, 2, 4, 8, and the latter among the default's warps count (bit-identical
/// results), each against the default: the cold-L2 starting point of `GEMV_TC_RULES` (the M = 1 column is now set from in-model decode).
#[test]
#[ignore]
fn report_gemv_tc_sweep() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gemv_tc_sweep", st) else { return };
    if dev.compute_capability().0 < 8 {
        eprintln!("SKIP gemv_tc_sweep: {} runs the SIMT GEMV", dev.arch());
        return;
    }
    let s = dev.stream().clone();
    let clock = std::time::Instant::now();
    // Random weights (not zeros: the mma datapath's power depends on the data): an 8 MB random
    // block repeated over every copy.
    let mut rng = Rng::new(53);
    let block = upload(&dev, &rounded(&rng.vec(4 << 20, -0.05, 0.05), st));
    // The copy rate: 1 GB device to device, counted as read + write bytes, the best of the
    // repeats (benches/gpu_bench.py's ceiling: the best of 20 copies).
    let (copy_src, mut copy_dst, copy) = copy_ceiling(&dev);
    println!("PERF op=gemv_tc_sweep_copy bytes={} GBps={copy:.0}", copy_src.len() * 2);
    let mut filler = || s.memcpy_dtod(&copy_src, &mut copy_dst).unwrap();
    let default = GemvTcConfig::DEFAULT;
    for (name, rows, k, out) in SWEEP_SHAPES {
        let len = rows * k;
        let bytes = len * 2;
        let (w, copies, launches) = cold_weights(&dev, &block, len);
        let x = upload(&dev, &rounded(&rng.vec(8 * k, -1.0, 1.0), st));
        let mut y16 = s.alloc_zeros::<u16>(8 * rows).unwrap();
        let mut y32 = s.alloc_zeros::<f32>(8 * rows).unwrap();
        // Per instance, the time summed over M (one instance serves every M of a shape).
        let configs: Vec<GemvTcConfig> = GemvTcConfig::all().collect();
        let (mut m1_ms, mut sum_ms) = (vec![0.0; configs.len()], vec![0.0; configs.len()]);
        for m in [1, 2, 4, 8] {
            let xm = x.slice(..m * k);
            // `form` None: cuBLAS (for SwiGLU the GEMM of the fused weight, without the epilogue).
            // The median over the repeats.
            let mut time = |form: Option<GemvForm>| {
                times_ms(&dev, &mut filler, launches, &mut |i| {
                    let wi = w.slice((i % copies) * len..(i % copies + 1) * len);
                    match (out, form) {
                        (SweepOut::Store, Some(f)) => dev.gemv_with(f, &xm, &wi, &mut y16, m, rows, k),
                        (SweepOut::F32, Some(f)) => dev.gemv_f32_out_with(f, &xm, &wi, &mut y32, m, rows, k),
                        (SweepOut::SwiGlu, Some(f)) => dev.gemv_gateup_swiglu_with(f, &xm, &wi, &mut y16, m, rows / 2, k),
                        (SweepOut::F32, None) => dev.gemm_f32_out(&xm, &wi, &mut y32, m, rows, k),
                        (_, None) => dev.gemm(&xm, &wi, &mut y16, m, rows, k),
                    }
                    .unwrap()
                })[REPEATS / 2]
            };
            let gbps = |ms: f64| bytes as f64 / ms / 1e6;
            let mut line = format!(
                "PERF op=gemv_tc_sweep shape={name} rows={rows} k={k} out={} m={m} copies={copies}",
                match out {
                    SweepOut::Store => "storage",
                    SweepOut::F32 => "f32",
                    SweepOut::SwiGlu => "swiglu",
                }
            );
            let mut best = (0, f64::MAX);
            let mut default_ms = 0.0;
            for (j, &c) in configs.iter().enumerate() {
                let ms = time(Some(GemvForm::TensorCoresAs(c)));
                if m == 1 {
                    m1_ms[j] = ms;
                }
                if c == default {
                    default_ms = ms;
                }
                sum_ms[j] += ms;
                if ms < best.1 {
                    best = (j, ms);
                }
                line += &format!(" {}={:.0}", c.label(), gbps(ms));
            }
            let simt = time(Some(GemvForm::Simt));
            let cublas = time(None);
            let frac = |ms: f64| gbps(ms) / copy;
            line += &format!(
                " simt={:.0} cublas={:.0} copy={copy:.0} best={} best_frac={:.3} default_frac={:.3} simt_frac={:.3} cublas_frac={:.3}",
                gbps(simt),
                gbps(cublas),
                configs[best.0].label(),
                frac(best.1),
                frac(default_ms),
                frac(simt),
                frac(cublas)
            );
            println!("{line}");
        }
        let dflt = configs.iter().position(|&c| c == default).unwrap();
        let argmin = |v: &[f64]| (0..v.len()).min_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        let (b1, bs) = (argmin(&m1_ms), argmin(&sum_ms));
        // The best of the default's warps count: unroll and hold leave every bit of the result
        // as it is, so this pick changes speed only.
        let same_warps: Vec<f64> = (0..configs.len()).map(|j| if configs[j].warps == default.warps { sum_ms[j] } else { f64::MAX }).collect();
        let bw = argmin(&same_warps);
        println!(
            "PERF op=gemv_tc_sweep_pick shape={name} rows={rows} k={k} blocks={} best_m1={} m1_speedup={:.3} best_sum={} sum_speedup={:.3} best_sum_m1_speedup={:.3} best_w{}={} w{}_sum_speedup={:.3} w{}_m1_speedup={:.3}",
            rows.div_ceil(16),
            configs[b1].label(),
            m1_ms[dflt] / m1_ms[b1],
            configs[bs].label(),
            sum_ms[dflt] / sum_ms[bs],
            m1_ms[dflt] / m1_ms[bs],
            default.warps,
            configs[bw].label(),
            default.warps,
            sum_ms[dflt] / sum_ms[bw],
            default.warps,
            m1_ms[dflt] / m1_ms[bw]
        );
    }
    println!("PERF op=gemv_tc_sweep_done seconds={:.1}", clock.elapsed().as_secs_f64());
}
