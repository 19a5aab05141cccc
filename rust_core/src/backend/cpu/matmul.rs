//! `y = x · Wᵀ (+ b)`: the one matmul shape the models need (weights stored `[out, in]` as in
//! HF checkpoints).
//!
//! Few rows (decode) are memory bound: each weight row is read once and dotted with every input
//! row, output rows split across threads. Many rows (prefill) are compute bound: a blocked GEMM
//! (`matrixmultiply`) per column slice, slices split across threads.

use rayon::prelude::*;

use super::simd;
use super::SharedMut;

/// Input rows up to which the weight-streaming (GEMV-like) path is used.
pub const SMALL_M: usize = 8;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ + bias[n]`.
pub fn linear(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>, out: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "linear: buffer too small");
    if m == 0 || n == 0 {
        return;
    }
    if m <= SMALL_M {
        gemv_rows(x, m, k, w, n, bias, out);
    } else {
        gemm(x, m, k, w, n, out);
        if let Some(b) = bias {
            out[..m * n].par_chunks_mut(n).for_each(|row| {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            });
        }
    }
}

fn gemv_rows(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>, out: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    // Enough blocks to balance, each large enough to amortize task overhead (~16 KiB of weights).
    let min_rows = (4096 / k.max(1)).max(4);
    let block = (n / (threads * 4)).max(min_rows).min(n);
    let nblocks = n.div_ceil(block);
    let ptr = SharedMut(out.as_mut_ptr());
    (0..nblocks).into_par_iter().for_each(|bi| {
        #[allow(clippy::redundant_locals)] // capture the Send wrapper whole, not its raw-pointer field
        let ptr = ptr;
        let rows = bi * block..((bi + 1) * block).min(n);
        simd::rows_block(w, x, m, k, rows, &mut |j, dots| {
            let b = bias.map_or(0.0, |b| b[j]);
            for (i, d) in dots.iter().enumerate().take(m) {
                // SAFETY: each task writes only columns j of its own row range; i < m, j < n.
                unsafe { *ptr.0.add(i * n + j) = d + b };
            }
        });
    });
}

fn gemm(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    let slice = n.div_ceil(threads * 2).div_ceil(16).max(1) * 16;
    let nslices = n.div_ceil(slice);
    let ptr = SharedMut(out.as_mut_ptr());
    (0..nslices).into_par_iter().for_each(|si| {
        #[allow(clippy::redundant_locals)] // capture the Send wrapper whole, not its raw-pointer field
        let ptr = ptr;
        let j0 = si * slice;
        let nc = slice.min(n - j0);
        // SAFETY: A is x [m, k] row-major; B is w[j0.., :]ᵀ seen as [k, nc] with row stride 1
        // and column stride k; C is columns j0..j0+nc of out [m, n]. Slices are disjoint.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                nc,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                w.as_ptr().add(j0 * k),
                1,
                k as isize,
                0.0,
                ptr.0.add(j0),
                n as isize,
                1,
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    s += x[i * k + p] as f64 * w[j * k + p] as f64;
                }
                out[i * n + j] = s as f32 + bias.map_or(0.0, |b| b[j]);
            }
        }
        out
    }

    fn rand_vec(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn linear_matches_naive_for_small_and_large_m() {
        for &(m, k, n) in &[(1, 37, 53), (3, 64, 100), (8, 19, 7), (9, 33, 41), (40, 70, 130)] {
            let x = rand_vec(m * k, 1);
            let w = rand_vec(n * k, 2);
            let b = rand_vec(n, 3);
            let mut out = vec![f32::NAN; m * n];
            linear(&x, m, k, &w, n, Some(&b), &mut out);
            let r = naive(&x, m, k, &w, n, Some(&b));
            for (a, e) in out.iter().zip(&r) {
                assert!((a - e).abs() < 1e-4, "m={m} k={k} n={n}: {a} vs {e}");
            }
        }
    }
}
