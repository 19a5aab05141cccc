//! The tensor-core decode GEMV (cuda/gemv_tc.cu, `GemvForm::TensorCores`, the route of every
//! M of 1..8 on sm_80+) against the CPU reference at M = 1..8, ragged N and K = 8 / 1000 / 4096 /
//! 14336 in both storage types and all three epilogues; row r of an M-row launch against the
//! one-row launch bit for bit (batch == alone); the SwiGLU epilogue against its own GEMV of the
//! fused weight followed by swiglu bit for bit; and the routing (`gemv` runs `gemv_form`).

use ninfer_core::backend::cuda::ops::{gemv_form, GemvForm};
use ninfer_core::backend::cuda::StorageDType;

use super::assert_bitwise;
use super::harness::{check, gpu, rounded, tol16, upload, Out16, Out32, Rng, STORAGES, TOL32};
use super::reference;

#[test]
fn gemv_form_is_tensor_cores_from_sm80() {
    assert_eq!(gemv_form((7, 0)), GemvForm::Simt);
    assert_eq!(gemv_form((7, 5)), GemvForm::Simt);
    assert_eq!(gemv_form((8, 0)), GemvForm::TensorCores);
    assert_eq!(gemv_form((8, 9)), GemvForm::TensorCores);
    assert_eq!(gemv_form((9, 0)), GemvForm::TensorCores);
}

/// N = 333 (not a multiple of the 16-row tile; the SwiGLU tile's 8 activations: inter = 333),
/// K from one 8-element chunk (one partial k32 step) through 1000 (K % 32 = 8: a partial last
/// step) to the 8B down projection's 14336. The one-row results of the 8 x rows are computed
/// once per K and every M-row launch (its x the first M of those rows) must reproduce them.
#[test]
fn tc_gemv_matches_reference_and_rows_equal_one_row_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_tc", st) else { return };
        if dev.gemv_form() != GemvForm::TensorCores {
            eprintln!("SKIP gemv_tc: {} runs the SIMT GEMV", dev.arch());
            return;
        }
        let tc = GemvForm::TensorCores;
        let mut rng = Rng::new(41);
        let n = 333;
        for k in [8, 1000, 4096, 14336] {
            let s = 3.0 / (k as f32).sqrt();
            let w = rounded(&rng.vec(2 * n * k, -s, s), st);
            let wd = upload(&dev, &w);
            let x = rounded(&rng.vec(8 * k, -1.0, 1.0), st);
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
            for m in 1..=8 {
                let xm = &x[..m * k];
                let xd = upload(&dev, xm);
                let shape = format!("m{m}n{n}k{k}");
                // Plain GEMV over the first n rows of w, in both output types.
                let want = reference::matmul_nt(xm, &w[..n * k], m, n, k);
                let mut y = Out16::new(&dev, m * n);
                dev.gemv_with(tc, &xd, &wd, &mut y.view(), m, n, k).unwrap();
                let y = y.read(&dev, "gemv_tc");
                check("gemv_tc", st, &shape, &y, &want, tol16(st));
                let mut y32 = Out32::new(&dev, m * n);
                dev.gemv_f32_out_with(tc, &xd, &wd, &mut y32.view(), m, n, k).unwrap();
                let y32 = y32.read(&dev, "gemv_tc_f32out");
                check("gemv_tc_f32out", st, &shape, &y32, &want, TOL32);
                // SwiGLU over the fused [2n, k] weight, against the reference and bit for bit
                // against this kernel's GEMV of the fused weight followed by swiglu.
                let mut act = Out16::new(&dev, m * n);
                dev.gemv_gateup_swiglu_with(tc, &xd, &wd, &mut act.view(), m, n, k).unwrap();
                let act = act.read(&dev, "gemv_tc_gateup_swiglu");
                let gu_want = rounded(&reference::matmul_nt(xm, &w, m, 2 * n, k), st);
                check("gemv_tc_gateup_swiglu", st, &shape, &act, &reference::swiglu(&gu_want, m, n), tol16(st));
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
