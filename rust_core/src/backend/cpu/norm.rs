//! RMSNorm, as transformers computes it in f32: `x * rsqrt(mean(x²) + eps) * w`.
//!
//! Zero-centred variants (Qwen3.5 stores `w` and applies `1 + w`) are folded at load time, so
//! one kernel serves all architectures.

use rayon::prelude::*;

use super::simd;

fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = simd::dot(x, x) / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * r * wi;
    }
}

/// Normalize each of `rows` rows of width `dim` of `x` into `out`.
pub fn rms_norm(x: &[f32], rows: usize, dim: usize, w: &[f32], eps: f32, out: &mut [f32]) {
    let x = &x[..rows * dim];
    let out = &mut out[..rows * dim];
    if rows >= 4 {
        out.par_chunks_mut(dim).zip(x.par_chunks(dim)).for_each(|(o, xr)| norm_row(xr, w, eps, o));
    } else {
        for (o, xr) in out.chunks_mut(dim).zip(x.chunks(dim)) {
            norm_row(xr, w, eps, o);
        }
    }
}

/// Normalize, in place, `heads` consecutive sub-rows of width `dim` in each of `rows` rows of
/// stride `stride` (per-head q/k norm inside a fused projection output).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_heads_inplace(x: &mut [f32], rows: usize, stride: usize, offset: usize, heads: usize, dim: usize, w: &[f32], eps: f32) {
    for r in 0..rows {
        for h in 0..heads {
            let s = r * stride + offset + h * dim;
            let seg = &mut x[s..s + dim];
            let ms = simd::dot(seg, seg) / dim as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (xi, wi) in seg.iter_mut().zip(w) {
                *xi = *xi * inv * wi;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 4.0, 4.0, -4.0, 4.0];
        let w = [0.5f32, 1.0, 2.0, -1.0];
        let mut out = [0f32; 8];
        rms_norm(&x, 2, 4, &w, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * 4..r * 4 + 4];
            let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 4.0;
            for i in 0..4 {
                let e = row[i] as f64 / (ms + 1e-6).sqrt() * w[i] as f64;
                assert!((out[r * 4 + i] as f64 - e).abs() < 1e-5);
            }
        }
        let mut y = x;
        rms_norm_heads_inplace(&mut y, 1, 8, 0, 2, 4, &w, 1e-6);
        assert_eq!(&y[..], &out[..]);
    }
}
