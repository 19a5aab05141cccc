//! Inner loops written so that LLVM vectorizes them: fixed-width lanes with independent
//! accumulators (no reassociation is needed, so no fast-math), with AVX2 versions chosen at
//! runtime on x86_64.

const LANES: usize = 16;

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let pa: &[f32; LANES] = a[c * LANES..c * LANES + LANES].try_into().unwrap();
        let pb: &[f32; LANES] = b[c * LANES..c * LANES + LANES].try_into().unwrap();
        for l in 0..LANES {
            acc[l] += pa[l] * pb[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..n {
        tail += a[i] * b[i];
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}

#[inline(always)]
fn axpy_generic(y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    for (yi, xi) in y[..n].iter_mut().zip(&x[..n]) {
        *yi += a * xi;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_generic(y, a, x)
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// Dot product of the common prefix of `a` and `b`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked at runtime).
        return unsafe { dot_avx2(a, b) };
    }
    dot_generic(a, b)
}

/// `y += a * x` over the common prefix.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked at runtime).
        return unsafe { axpy_avx2(y, a, x) };
    }
    axpy_generic(y, a, x)
}

/// Dot products of one weight row with `m` input rows (`x` is `[m, k]`), written to
/// `out[i * out_stride]`: the weight row is read from memory once for all inputs.
#[inline(always)]
fn row_dots_generic(w: &[f32], x: &[f32], m: usize, k: usize, out: &mut [f32; 8]) {
    for i in 0..m {
        out[i] = dot_generic(w, &x[i * k..(i + 1) * k]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_block_avx2(w: &[f32], x: &[f32], m: usize, k: usize, rows: std::ops::Range<usize>, out: &mut dyn FnMut(usize, &[f32; 8])) {
    let mut tmp = [0f32; 8];
    for j in rows {
        row_dots_generic(&w[j * k..(j + 1) * k], x, m, k, &mut tmp);
        out(j, &tmp);
    }
}

/// For each weight row `j` in `rows` (`w` is `[n, k]`), the dot products with the `m <= 8`
/// input rows of `x`, handed to `out(j, dots)`.
pub fn rows_block(w: &[f32], x: &[f32], m: usize, k: usize, rows: std::ops::Range<usize>, out: &mut dyn FnMut(usize, &[f32; 8])) {
    assert!(m <= 8);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked at runtime).
        return unsafe { rows_block_avx2(w, x, m, k, rows, out) };
    }
    let mut tmp = [0f32; 8];
    for j in rows {
        row_dots_generic(&w[j * k..(j + 1) * k], x, m, k, &mut tmp);
        out(j, &tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_for_odd_lengths() {
        for n in [0, 1, 5, 16, 17, 37, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64) * (*y as f64)).sum();
            assert!((dot(&a, &b) as f64 - naive).abs() < 1e-4, "n={n}");
        }
    }
}
