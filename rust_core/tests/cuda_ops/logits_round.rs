//! logits_dtype "auto" on the device: the lm_head's f32 outputs rounded to the storage type in
//! the GEMV epilogue (`round_out` of gemv_f32out / gemv_tc_f32out) and after the cuBLAS GEMM
//! (`round_f32_to_storage`) must be, bit for bit, the unrounded outputs of the same kernel
//! rounded to nearest even afterwards (the host's half-crate rounding, as torch's
//! `.to(bfloat16)`), for every GEMV form, every M of the GEMV route and the cuBLAS route.

use ninfer_core::backend::cuda::ops::GemvForm;

use super::harness::{gpu, model_device, rounded, upload, Out32, Rng, HIDDEN_PER_KSPLIT, STORAGES};

fn assert_rounded(got: &[f32], unrounded: &[f32], st: ninfer_core::backend::cuda::StorageDType, what: &str) {
    let want = rounded(unrounded, st);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what} {st:?}: element {i} is {g} ({:#x}), rounding the unflagged {} gives {w}", g.to_bits(), unrounded[i]);
    }
}

#[test]
fn rounded_f32_gemv_equals_the_unrounded_output_rounded_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv f32out round_out", st) else { return };
        let mut rng = Rng::new(91);
        let mut forms = vec![GemvForm::Simt];
        if dev.compute_capability().0 >= 8 {
            forms.extend([GemvForm::TensorCores, GemvForm::ByShape]);
        }
        // A 128256-row head (the Llama 3 vocabulary) at a small K, and a ragged N.
        for ((n, k), hidden) in [(128_256, 256), (1000, 2056)].into_iter().flat_map(|case| HIDDEN_PER_KSPLIT.map(|h| (case, h))) {
            let dev = model_device(&dev, hidden);
            let split = dev.cc_ksplit_for(n, k);
            let w = upload(&dev, &rounded(&rng.vec(n * k, -1.0, 1.0), st));
            for m in 1..=8 {
                let xd = upload(&dev, &rounded(&rng.vec(m * k, -2.0, 2.0), st));
                for &form in &forms {
                    let mut plain = Out32::new(&dev, m * n);
                    dev.gemv_f32_out_round_with(form, &xd, &w, &mut plain.view(), m, n, k, false).unwrap();
                    let mut round = Out32::new(&dev, m * n);
                    dev.gemv_f32_out_round_with(form, &xd, &w, &mut round.view(), m, n, k, true).unwrap();
                    let (plain, round) = (plain.read(&dev, "gemv f32"), round.read(&dev, "gemv f32 rounded"));
                    assert!(plain.iter().any(|x| rounded(&[*x], st)[0] != *x), "the test needs sums that rounding changes");
                    assert_rounded(&round, &plain, st, &format!("{form:?} ksplit {split} m{m}n{n}k{k}"));
                }
            }
        }
    }
}

#[test]
fn rounded_linear_f32_out_equals_the_unrounded_output_rounded_on_both_routes() {
    for st in STORAGES {
        let Some(dev) = gpu("linear_f32_out round", st) else { return };
        let mut rng = Rng::new(92);
        let (n, k) = (3001, 512);
        let w = upload(&dev, &rounded(&rng.vec(n * k, -1.0, 1.0), st));
        // M <= 8: the GEMV epilogue; above: cuBLAS, then round_f32_to_storage.
        for m in [1, 5, 8, 9, 64, 300] {
            let xd = upload(&dev, &rounded(&rng.vec(m * k, -2.0, 2.0), st));
            let mut plain = Out32::new(&dev, m * n);
            dev.linear_f32_out(&xd, &w, &mut plain.view(), m, n, k, false).unwrap();
            let mut round = Out32::new(&dev, m * n);
            dev.linear_f32_out(&xd, &w, &mut round.view(), m, n, k, true).unwrap();
            assert_rounded(&round.read(&dev, "linear rounded"), &plain.read(&dev, "linear"), st, &format!("linear_f32_out m{m}"));
        }
    }
}

/// `round_f32_to_storage` on 16-byte aligned logits (four a thread, a ragged tail) and on a
/// buffer one f32 past the boundary (the scalar kernel): both the host's rounding, bit for bit,
/// and nothing past the length touched (Out32's guard).
#[test]
fn round_f32_to_storage_rounds_aligned_and_unaligned_buffers() {
    for st in STORAGES {
        let Some(dev) = gpu("round_f32_to_storage", st) else { return };
        let mut rng = Rng::new(93);
        for len in [1, 3, 4, 1027, 64 * 1283 + 2] {
            let v = rng.vec(len, -30.0, 30.0);
            let mut aligned = Out32::with(&dev, &v);
            dev.round_f32_to_storage(&mut aligned.view(), len).unwrap();
            assert_rounded(&aligned.read(&dev, "round aligned"), &v, st, &format!("aligned len {len}"));
            let shifted: Vec<f32> = std::iter::once(7.0).chain(v.iter().copied()).collect();
            let mut skewed = Out32::with(&dev, &shifted);
            dev.round_f32_to_storage(&mut skewed.view().slice_mut(1..), len).unwrap();
            let got = skewed.read(&dev, "round unaligned");
            assert_eq!(got[0], 7.0, "the element before the buffer was touched");
            assert_rounded(&got[1..], &v, st, &format!("unaligned len {len}"));
        }
    }
}
