//! Projections with a bias (`linear_bias`: Qwen2's q/k/v, Llama's `attention_bias` and
//! `mlp_bias`): each output is the f32 sum `linear_f32_out` gives plus the bias, rounded once to
//! the storage type (as torch's addmm rounds), bit for bit, on both routes (the GEMV up to 8
//! rows, cuBLAS above); Out16 / Out32 poison the outputs and guard past their ends.

use super::harness::{gpu, rounded, upload, Out16, Out32, Rng, STORAGES};

#[test]
fn linear_bias_rounds_the_sums_plus_the_bias_once_on_both_routes() {
    for st in STORAGES {
        let Some(dev) = gpu("linear_bias", st) else { return };
        let mut rng = Rng::new(94);
        let (n, k) = (3001, 512);
        let w = upload(&dev, &rounded(&rng.vec(n * k, -1.0, 1.0), st));
        let bias_host = rounded(&rng.vec(n, -4.0, 4.0), st);
        let bias = upload(&dev, &bias_host);
        let plus_bias = |sums: &[f32]| -> Vec<f32> { sums.iter().enumerate().map(|(i, s)| s + bias_host[i % n]).collect() };
        for m in [1, 5, 8, 9, 64, 300] {
            let xd = upload(&dev, &rounded(&rng.vec(m * k, -2.0, 2.0), st));
            let mut sums = Out32::new(&dev, m * n);
            dev.linear_f32_out(&xd, &w, &mut sums.view(), m, n, k, false).unwrap();
            let sums = sums.read(&dev, "linear_f32_out");
            let (mut y32, mut y) = (Out32::new(&dev, m * n), Out16::new(&dev, m * n));
            dev.linear_bias(&xd, &w, &bias, &mut y32.view(), &mut y.view(), m, n, k).unwrap();
            let got = y.read(&dev, "linear_bias");
            let want = rounded(&plus_bias(&sums), st);
            // Rounding the sums before adding the bias (two roundings) must differ somewhere,
            // or this test could not tell the two apart.
            assert_ne!(rounded(&plus_bias(&rounded(&sums, st)), st), want, "m{m}: the cases need sums where rounding twice differs");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{st:?} m{m}: element {i} is {g}, the sum {} plus the bias {} rounded once is {w}", sums[i], bias_host[i % n]);
            }
        }
        // A bias shorter than N is refused, naming it.
        let short = upload(&dev, &bias_host[..n - 1]);
        let xd = upload(&dev, &rounded(&rng.vec(k, -2.0, 2.0), st));
        let (mut y32, mut y) = (Out32::new(&dev, n), Out16::new(&dev, n));
        let err = dev.linear_bias(&xd, &w, &short, &mut y32.view(), &mut y.view(), 1, n, k).unwrap_err();
        assert!(err.to_string().contains("linear_bias bias"), "{err}");
    }
}
