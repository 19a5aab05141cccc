//! The activations' side of the FP8 block route of HF block FP8 weights (the CUDA prefill route
//! over cuBLASLt's block scaling, ops/fp8_block.rs): each row of x cut into groups of
//! [`GROUP`] values (the last may be partial), each group quantized to E4M3FN with its own f32
//! multiplier `s = amax / 448` (0 for a group of zeros), `code = e4m3(x / s)`, round to nearest
//! even. The route's product is then, per output, the sum over groups of
//! `s_x * s_w * sum(e4m3(code_x) * e4m3(code_w))`, `s_w` the weight's 128 x 128 block
//! multiplier; [`block_route_reference`] computes it exactly (f64), the CPU reference of the
//! route's numerics.
//!
//! Error of the quantization (E4M3FN's 3 mantissa bits): a value whose `x / s` is in the normal
//! range (>= 2^-6) is off by at most 2^-4 of itself, one in the subnormal range by at most half
//! the step 2^-9, i.e. 2^-10 * s; `s` maps the group's largest magnitude to 448, so nothing
//! saturates. [`group_error_bound`] is that bound.

use super::scalars::{e4m3_table, f32_to_e4m3, E4M3_MAX};

/// Values of x an f32 multiplier covers (cuBLASLt's VEC128_32F block, the HF format's 128).
pub const GROUP: usize = 128;

/// Groups of a row of `k` values.
pub fn groups(k: usize) -> usize {
    k.div_ceil(GROUP)
}

/// Row-major `x` [m, k] as the route quantizes it: (codes [m, k], multipliers [m, groups(k)]
/// row-major).
pub fn quantize_groups(x: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let l = groups(k);
    let mut codes = vec![0u8; m * k];
    let mut scales = vec![0.0f32; m * l];
    for t in 0..m {
        for g in 0..l {
            let cols = g * GROUP..((g + 1) * GROUP).min(k);
            let row = &x[t * k..(t + 1) * k];
            let amax = row[cols.clone()].iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let s = amax / E4M3_MAX;
            scales[t * l + g] = s;
            if s != 0.0 {
                for c in cols {
                    codes[t * k + c] = f32_to_e4m3(row[c] / s);
                }
            }
        }
    }
    (codes, scales)
}

/// The most `x` can be off from its quantized value `e4m3(code) * s` in a group of multiplier
/// `s` (module doc).
pub fn group_error_bound(x: f32, s: f32) -> f64 {
    (2f64).powi(-4) * x.abs() as f64 + (2f64).powi(-10) * s as f64
}

/// y[t, j] (f64, exact up to f64's rounding) = sum over groups g of xs[t, g] * ws[j / 128, g] *
/// sum over the group's i of e4m3(x_codes[t, i]) * e4m3(w_codes[j, i]): the block route's
/// product before its output rounding, for x's codes and multipliers from [`quantize_groups`]
/// and an HF block FP8 weight of 128 x 128 blocks (`w_codes` [n, k], `w_scales`
/// [ceil(n / 128), groups(k)] row-major, as f32).
pub fn block_route_reference(x_codes: &[u8], x_scales: &[f32], w_codes: &[u8], w_scales: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let table = e4m3_table();
    let l = groups(k);
    let mut y = vec![0.0f64; m * n];
    for t in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for g in 0..l {
                // Products of E4M3 values have at most 8 significant bits within 2^-18 .. 2^18:
                // a group's sum is exact in f64.
                let sum: f64 = (g * GROUP..((g + 1) * GROUP).min(k)).map(|i| table[x_codes[t * k + i] as usize] as f64 * table[w_codes[j * k + i] as usize] as f64).sum();
                acc += x_scales[t * l + g] as f64 * w_scales[(j / GROUP) * l + g] as f64 * sum;
            }
            y[t * n + j] = acc;
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, OwnedRaw, QuantFormat, QuantWeight, RawDtype};

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// Rows with a group's edge cases: uniform, a zero row, one outlier 300x the rest (most
    /// codes of its group subnormal), tiny values.
    fn activations(rng: &mut Rng, m: usize, k: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..m * k).map(|_| half::bf16::from_f32(rng.unit()).to_f32()).collect();
        x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
        x[2 * k..3 * k].iter_mut().for_each(|v| *v *= 0.01);
        x[2 * k + 5] = 3.0;
        x[3 * k..4 * k].iter_mut().for_each(|v| *v *= 1e-30);
        x
    }

    #[test]
    fn each_value_is_within_the_group_bound_of_its_code() {
        let table = e4m3_table();
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for k in [128, 320, 4096, 48] {
            let m = 6;
            let x = activations(&mut rng, m, k);
            let (codes, scales) = quantize_groups(&x, m, k);
            let l = groups(k);
            assert_eq!(scales.len(), m * l);
            for t in 0..m {
                for g in 0..l {
                    let cols = g * GROUP..((g + 1) * GROUP).min(k);
                    let s = scales[t * l + g];
                    let amax = cols.clone().map(|c| x[t * k + c].abs()).fold(0.0f32, f32::max);
                    assert_eq!(s, amax / 448.0, "k {k} row {t} group {g}: the multiplier maps the group's amax to 448");
                    let mut hit = false;
                    for c in cols {
                        let (v, q) = (x[t * k + c], table[codes[t * k + c] as usize] * s);
                        let err = (v as f64 - q as f64).abs();
                        assert!(err <= group_error_bound(v, s) * (1.0 + 1e-6), "k {k} [{t}, {c}]: {v:e} quantized to {q:e}");
                        hit |= v.abs() == amax && amax > 0.0 && (q.abs() - amax).abs() <= amax * 1e-6;
                    }
                    assert!(hit || s == 0.0, "k {k} row {t} group {g}: the largest value is 448 * s");
                }
            }
            // The zero row has zero multipliers and codes.
            assert!(scales[l..2 * l].iter().all(|&s| s == 0.0) && codes[k..2 * k].iter().all(|&c| c == 0));
        }
    }

    /// The route's exact product over x's codes against x W^T over x itself and the dequantized
    /// weight: within sum_i |w_i| * group_error_bound(x_i) (the per-value bound carried through
    /// the product; f32 dequantization adds 2^-24 of each product), for K with a partial last
    /// group and N with a partial last block.
    #[test]
    fn the_route_reference_is_within_the_quantization_bound_of_the_dequantized_matmul() {
        let mut rng = Rng(0x0ddb_a11c_afe0_f00d);
        for (n, k) in [(130usize, 320usize), (128, 256), (16, 48)] {
            let m = 5;
            let data: Vec<u8> = (0..n * k).map(|_| (rng.next() % 256) as u8).map(|c| if c & 0x7f == 0x7f { c - 1 } else { c }).collect();
            let (nb, l) = (n.div_ceil(128), groups(k));
            let w_scales: Vec<f32> = (0..nb * l).map(|_| 0.001 + (rng.next() % 1000) as f32 * 5e-5).collect();
            let scale = OwnedRaw { name: "weight_scale_inv".into(), dtype: RawDtype::F32, shape: vec![nb, l], bytes: w_scales.iter().flat_map(|v| v.to_le_bytes()).collect() };
            let w = QuantWeight { scale: Some(scale), ..QuantWeight::packed("w", QuantFormat::HfFp8Block { block_n: 128, block_k: 128 }, [n, k], data.clone()) };
            let dense = dequantize(&w.view()).unwrap();
            let x = activations(&mut rng, m, k);
            let (codes, xs) = quantize_groups(&x, m, k);
            let got = block_route_reference(&codes, &xs, &data, &w_scales, m, n, k);
            for t in 0..m {
                for j in 0..n {
                    let (mut want, mut bound) = (0.0f64, 0.0f64);
                    for i in 0..k {
                        let (a, b) = (x[t * k + i], dense[j * k + i] as f64);
                        want += a as f64 * b;
                        bound += b.abs() * group_error_bound(a, xs[t * l + i / GROUP]) + (2f64).powi(-24) * (a as f64 * b).abs();
                    }
                    let err = (got[t * n + j] - want).abs();
                    assert!(err <= bound * (1.0 + 1e-9) + 1e-300, "[{n}, {k}] y[{t}, {j}] = {}, want {want} (err {err:e} > {bound:e})", got[t * n + j]);
                }
            }
        }
    }
}
