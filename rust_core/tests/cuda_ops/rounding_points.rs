//! The elementwise kernels round where transformers (bf16 eager) rounds: each op against a host
//! emulation of transformers' rounding points (every intermediate that transformers holds in a
//! bf16 tensor rounded to storage, the rest f32), element by element. The device's expf /
//! sincosf and its f32 sum order of a norm's squares differ from the host's by an ulp or so,
//! which flips a rounding now and then, so the check is the share of bitwise-equal elements
//! (ROUNDING_MATCH) rather than all of them; the same outputs against the single-rounding form
//! the kernels had before (f32 throughout, one rounding at the store) must match fewer, so the
//! test fails if a rounding point is lost. docs/rounding.md holds the op-by-op table.

use ninfer_core::backend::cuda::StorageDType;

use super::harness::{gpu, rounded, upload, upload_raw, Out16, Out32, Rng, STORAGES};

/// Share of elements that must equal the emulation of transformers' rounding bit for bit.
const ROUNDING_MATCH: f64 = 0.99;

fn r(x: f32, st: StorageDType) -> f32 {
    rounded(&[x], st)[0]
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn bitwise_share(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).filter(|(a, b)| a.to_bits() == b.to_bits()).count() as f64 / got.len() as f64
}

/// Asserts `got` matches `points` (transformers' rounding points) on ROUNDING_MATCH of its
/// elements and `single` (one rounding at the store) on fewer, printing both shares.
fn check_points(op: &str, st: StorageDType, shape: &str, got: &[f32], points: &[f32], single: &[f32]) {
    let (p, s) = (bitwise_share(got, points), bitwise_share(got, single));
    println!("ROUNDING op={op} storage={} shape={shape} equal_to_transformers_points={p:.4} equal_to_single_rounding={s:.4}", st.name());
    assert!(p >= ROUNDING_MATCH, "{op} ({}, {shape}): {p:.4} of elements equal transformers' rounding points (< {ROUNDING_MATCH})", st.name());
    assert!(s < p, "{op} ({}, {shape}): the single-rounding form matches as often ({s:.4} >= {p:.4}): no rounding point is visible", st.name());
}

/// f32 reciprocal RMS of a row (the sum in f64: the device's f32 order differs anyway).
fn rstd(row: &[f32], eps: f32) -> f32 {
    let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
    1.0 / ((ss / row.len() as f64) as f32 + eps).sqrt()
}

#[test]
fn swiglu_and_sigmoid_gate_round_silu_and_sigmoid_before_the_product() {
    for st in STORAGES {
        let Some(dev) = gpu("rounding_swiglu", st) else { return };
        let mut rng = Rng::new(71);
        let (rows, n) = (9, 3072);
        let gu = rounded(&rng.vec(rows * 2 * n, -4.0, 4.0), st);
        let gu_dev = upload(&dev, &gu);
        let mut out = Out16::new(&dev, rows * n);
        dev.swiglu(&gu_dev, &gu_dev.slice(n..), &mut out.view(), rows, n, 2 * n, 2 * n).unwrap();
        let (g, u) = (|e: usize| gu[(e / n) * 2 * n + e % n], |e: usize| gu[(e / n) * 2 * n + n + e % n]);
        let points: Vec<f32> = (0..rows * n).map(|e| r(r(silu(g(e)), st) * u(e), st)).collect();
        let single: Vec<f32> = (0..rows * n).map(|e| r(silu(g(e)) * u(e), st)).collect();
        check_points("swiglu", st, &format!("{rows}x{n}"), &out.read(&dev, "swiglu"), &points, &single);

        let x = rounded(&rng.vec(rows * n, -2.0, 2.0), st);
        let mut xo = Out16::with(&dev, &x);
        dev.sigmoid_gate_mul(&mut xo.view(), &gu_dev, rows, n, 2 * n).unwrap();
        let points: Vec<f32> = (0..rows * n).map(|e| r(x[e] * r(sigmoid(g(e)), st), st)).collect();
        let single: Vec<f32> = (0..rows * n).map(|e| r(x[e] * sigmoid(g(e)), st)).collect();
        check_points("sigmoid_gate_mul", st, &format!("{rows}x{n}"), &xo.read(&dev, "gate"), &points, &single);
    }
}

/// Llama / Qwen3 RMSNorm (`weight * x.to(bf16)`) rounds x * rstd before the weight; the
/// (1 + w) convention (Qwen3.5) rounds once, which this checks too (there `single` is the
/// emulation itself, so only the first assertion applies).
#[test]
fn rmsnorm_rounds_the_normalised_value_before_a_plain_weight() {
    for st in STORAGES {
        let Some(dev) = gpu("rounding_rmsnorm", st) else { return };
        let mut rng = Rng::new(72);
        let (rows, dim, eps) = (8, 4096, 1e-5f32);
        let x = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
        let w = rounded(&rng.vec(dim, -1.5, 1.5), st);
        let rs: Vec<f32> = (0..rows).map(|i| rstd(&x[i * dim..(i + 1) * dim], eps)).collect();
        for plus_one in [false, true] {
            let mut out = Out16::new(&dev, rows * dim);
            dev.rmsnorm(&upload(&dev, &x), &upload(&dev, &w), &mut out.view(), rows, dim, dim, dim, eps, plus_one).unwrap();
            let got = out.read(&dev, "rmsnorm");
            let shape = format!("{rows}x{dim}/p{}", plus_one as u8);
            if plus_one {
                let points: Vec<f32> = (0..rows * dim).map(|e| r(x[e] * rs[e / dim] * (1.0 + w[e % dim]), st)).collect();
                let p = bitwise_share(&got, &points);
                println!("ROUNDING op=rmsnorm storage={} shape={shape} equal_to_transformers_points={p:.4}", st.name());
                assert!(p >= ROUNDING_MATCH, "rmsnorm (1 + w) ({}): {p:.4} equal", st.name());
            } else {
                let points: Vec<f32> = (0..rows * dim).map(|e| r(r(x[e] * rs[e / dim], st) * w[e % dim], st)).collect();
                let single: Vec<f32> = (0..rows * dim).map(|e| r(x[e] * rs[e / dim] * w[e % dim], st)).collect();
                check_points("rmsnorm", st, &shape, &got, &points, &single);
            }
        }
    }
}

/// Qwen3_5RMSNormGated: bf16(x * rstd), times the bf16 weight (rounded), times silu(z) in f32,
/// rounded.
#[test]
fn gated_rmsnorm_rounds_the_norm_and_the_weight_product_before_the_gate() {
    for st in STORAGES {
        let Some(dev) = gpu("rounding_rmsnorm_gated", st) else { return };
        let mut rng = Rng::new(73);
        let (tokens, heads, dim, eps) = (4, 16, 128, 1e-6f32);
        let rows = tokens * heads;
        let x = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
        let z = rounded(&rng.vec(rows * dim, -4.0, 4.0), st);
        let w = rounded(&rng.vec(dim, 0.5, 1.5), st);
        let mut out = Out16::new(&dev, rows * dim);
        dev.rmsnorm_gated(&upload(&dev, &x), &upload(&dev, &z), heads * dim, &upload(&dev, &w), &mut out.view(), tokens, heads, dim, eps).unwrap();
        let rs: Vec<f32> = (0..rows).map(|i| rstd(&x[i * dim..(i + 1) * dim], eps)).collect();
        let points: Vec<f32> = (0..rows * dim).map(|e| r(r(w[e % dim] * r(x[e] * rs[e / dim], st), st) * silu(z[e]), st)).collect();
        let single: Vec<f32> = (0..rows * dim).map(|e| r(x[e] * rs[e / dim] * w[e % dim] * silu(z[e]), st)).collect();
        check_points("rmsnorm_gated", st, &format!("{tokens}x{heads}x{dim}"), &out.read(&dev, "rmsnorm_gated"), &points, &single);
    }
}

/// transformers' q * cos + rotate_half(q) * sin on bf16 tensors: cos and sin cast to bf16, each
/// product rounded, then the sum.
#[test]
fn rope_rounds_cos_sin_and_each_product() {
    for st in STORAGES {
        let Some(dev) = gpu("rounding_rope", st) else { return };
        let mut rng = Rng::new(74);
        let (t, hq, hk, d) = (16, 8, 2, 128);
        let half = d / 2;
        let theta: f32 = 500_000.0;
        let inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / d as f32)).collect();
        let positions: Vec<i32> = (0..t).map(|_| rng.below(4000) as i32).collect();
        let q0 = rounded(&rng.vec(t * hq * d, -2.0, 2.0), st);
        let k0 = rounded(&rng.vec(t * hk * d, -2.0, 2.0), st);
        let (mut q, mut k) = (Out16::with(&dev, &q0), Out16::with(&dev, &k0));
        dev.rope_neox(&mut q.view(), &mut k.view(), &upload_raw(&dev, &positions), &upload_raw(&dev, &inv_freq), hq, hk, d, hq * d, hk * d, 1.0).unwrap();
        let mut got = q.read(&dev, "rope q");
        got.extend(k.read(&dev, "rope k"));
        let (mut points, mut single) = (Vec::new(), Vec::new());
        for (x, heads) in [(&q0, hq), (&k0, hk)] {
            for e in 0..t * heads * d {
                let (row, i) = (e / d, e % d);
                let (j, lo) = (i % half, i < half);
                let (s, c) = ((positions[row / heads] as f32) * inv_freq[j]).sin_cos();
                let (a, b) = (x[row * d + j], x[row * d + j + half]);
                let (cr, sr) = (r(c, st), r(s, st));
                if lo {
                    points.push(r(r(a * cr, st) - r(b * sr, st), st));
                    single.push(r(a * c - b * s, st));
                } else {
                    points.push(r(r(b * cr, st) + r(a * sr, st), st));
                    single.push(r(b * c + a * s, st));
                }
            }
        }
        check_points("rope", st, &format!("t{t}/hq{hq}/hk{hk}/d{d}"), &got, &points, &single);
    }
}

/// beta = b.sigmoid() on the bf16 projection is a bf16 tensor in transformers; g stays f32.
#[test]
fn gdn_gates_round_beta_to_storage() {
    for st in STORAGES {
        let Some(dev) = gpu("rounding_gdn_gates", st) else { return };
        let mut rng = Rng::new(75);
        let (t, h) = (64, 48);
        let a = rounded(&rng.vec(t * h, -6.0, 6.0), st);
        let b = rounded(&rng.vec(t * h, -6.0, 6.0), st);
        let (a_log, dt_bias) = (rng.vec(h, -1.0, 1.0), rng.vec(h, -1.0, 1.0));
        let (mut g, mut beta) = (Out32::new(&dev, t * h), Out32::new(&dev, t * h));
        dev.gdn_gates(&upload(&dev, &a), &upload(&dev, &b), h, &upload_raw(&dev, &a_log), &upload_raw(&dev, &dt_bias), &mut g.view(), &mut beta.view(), t, h).unwrap();
        let points: Vec<f32> = b.iter().map(|&x| r(sigmoid(x), st)).collect();
        let single: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
        check_points("gdn_gates.beta", st, &format!("t{t}h{h}"), &beta.read(&dev, "beta"), &points, &single);
    }
}
