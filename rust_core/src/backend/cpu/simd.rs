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

/// Dot products of one weight row with `M` input rows (`x` is `[M, k]`): the weight chunk is
/// loaded once and multiplied into `M` register accumulators.
#[inline(always)]
fn row_dots<const M: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32; 8]) {
    const L: usize = 8;
    if M == 1 {
        out[0] = dot_generic(w, &x[..k]);
        return;
    }
    let mut acc = [[0f32; L]; M];
    let chunks = k / L;
    for c in 0..chunks {
        let wc: &[f32; L] = w[c * L..c * L + L].try_into().unwrap();
        for (i, a) in acc.iter_mut().enumerate() {
            let xc: &[f32; L] = x[i * k + c * L..i * k + c * L + L].try_into().unwrap();
            for l in 0..L {
                a[l] += wc[l] * xc[l];
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        let mut s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        for p in chunks * L..k {
            s += w[p] * x[i * k + p];
        }
        out[i] = s;
    }
}

#[inline(always)]
fn rows_block_m<const M: usize>(w: &[f32], x: &[f32], k: usize, rows: std::ops::Range<usize>, out: &mut dyn FnMut(usize, &[f32; 8])) {
    let mut tmp = [0f32; 8];
    for j in rows {
        row_dots::<M>(&w[j * k..(j + 1) * k], x, k, &mut tmp);
        out(j, &tmp);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_block_avx2<const M: usize>(w: &[f32], x: &[f32], k: usize, rows: std::ops::Range<usize>, out: &mut dyn FnMut(usize, &[f32; 8])) {
    rows_block_m::<M>(w, x, k, rows, out)
}

fn rows_block_dispatch<const M: usize>(w: &[f32], x: &[f32], k: usize, rows: std::ops::Range<usize>, out: &mut dyn FnMut(usize, &[f32; 8])) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked at runtime).
        return unsafe { rows_block_avx2::<M>(w, x, k, rows, out) };
    }
    rows_block_m::<M>(w, x, k, rows, out)
}

/// For each weight row `j` in `rows` (`w` is `[n, k]`), the dot products with the `m <= 8`
/// input rows of `x`, handed to `out(j, dots)`. Each weight row is read once for all inputs.
pub fn rows_block(w: &[f32], x: &[f32], m: usize, k: usize, rows: std::ops::Range<usize>, out: &mut dyn FnMut(usize, &[f32; 8])) {
    match m {
        1 => rows_block_dispatch::<1>(w, x, k, rows, out),
        2 => rows_block_dispatch::<2>(w, x, k, rows, out),
        3 => rows_block_dispatch::<3>(w, x, k, rows, out),
        4 => rows_block_dispatch::<4>(w, x, k, rows, out),
        5 => rows_block_dispatch::<5>(w, x, k, rows, out),
        6 => rows_block_dispatch::<6>(w, x, k, rows, out),
        7 => rows_block_dispatch::<7>(w, x, k, rows, out),
        8 => rows_block_dispatch::<8>(w, x, k, rows, out),
        _ => panic!("rows_block: m = {m} > 8"),
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
