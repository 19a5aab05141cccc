//! `NVFP4` in the `blockscale-k16-m128x4-v1` layout.
//!
//! Numbers: every 16 consecutive values of a row share one E4M3FN scale word (a sign-zero finite
//! word; +0 allowed), each value is an E2M1 code, and the whole matrix has one finite positive
//! binary32 divisor `d_w`: `w = e2m1(c) * e4m3(s) / d_w`, evaluated left to right in binary32.
//!
//! Bytes, for `[N, K]` with `N % 128 == 0` and `K % 64 == 0`: the row-major code plane (`N*K/2`
//! bytes, the lower K coordinate in the low nibble), zero padding to 256 bytes, the scale plane
//! (`N*K/16` bytes, swizzled in 128-row x 4-group tiles: the word of row `n`, group `g` sits at
//! `((n/128)*(K/64) + g/4)*512 + (n%128 % 32)*16 + (n%128 / 32)*4 + g%4`), then `d_w` as four
//! little-endian bytes.
//!
//! Encoder (ours: NInfer defines no canonical NVFP4 encoder): `d_w = f32(2688 / amax)` over the
//! whole matrix (2688 = 448 * 6, so the largest group scale is the largest E4M3 value; 1.0 for an
//! all-zero matrix); per group `s = e4m3(f32(amax_g / 6) * d_w)` (the smallest subnormal word
//! when a nonzero group rounds to zero); `c = e2m1(f32(x * f32(d_w / s)))`, nearest, ties to even.

use super::scalars::{e2m1_to_f32, e4m3_to_f32, f32_to_e2m1, f32_to_e4m3};

/// Byte offsets of one payload: scale plane, divisor word, total size.
pub fn planes(n: usize, k: usize) -> (usize, usize, usize) {
    let scale_offset = (n * k / 2).div_ceil(256) * 256;
    let divisor_offset = scale_offset + n * k / 16;
    (scale_offset, divisor_offset, divisor_offset + 4)
}

/// Offset of scale word (row, group) inside the scale plane.
pub fn scale_index(n: usize, g: usize, k: usize) -> usize {
    let inner = n % 128;
    ((n / 128) * (k / 64) + g / 4) * 512 + (inner % 32) * 16 + (inner / 32) * 4 + g % 4
}

/// The matrix divisor `d_w`.
pub fn divisor(payload: &[u8], n: usize, k: usize) -> f32 {
    let (_, off, _) = planes(n, k);
    f32::from_le_bytes(payload[off..off + 4].try_into().unwrap())
}

/// Decode rows of a validated payload.
pub fn decode_rows(payload: &[u8], n: usize, k: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let (scale_offset, _, _) = planes(n, k);
    let d_w = divisor(payload, n, k);
    for (r, row) in rows.enumerate() {
        for g in 0..k / 16 {
            let s = e4m3_to_f32(payload[scale_offset + scale_index(row, g, k)]).unwrap_or(f32::NAN);
            for i in 0..16 {
                let col = g * 16 + i;
                let byte = payload[(row * k + col) / 2];
                let c = if col % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                out[r * k + col] = e2m1_to_f32(c) * s / d_w;
            }
        }
    }
}

/// The E4M3FN scale word of a group whose largest magnitude is `amax_g` under divisor `d`, and
/// the codes of its values `xs` (the encoder's rule, module doc): all zero where the scale is.
fn encode_group(xs: &[f32], d: f32) -> (u8, [u8; 16]) {
    let amax_g = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut s = f32_to_e4m3((amax_g / 6.0) * d);
    if s == 0 && amax_g != 0.0 {
        s = 0x01;
    }
    let mut codes = [0u8; 16];
    if s != 0 {
        let inv = d / e4m3_to_f32(s).unwrap();
        for (c, x) in codes.iter_mut().zip(xs) {
            *c = f32_to_e2m1(x * inv);
        }
    }
    (s, codes)
}

/// The divisor that maps a largest magnitude of `amax` to 2688 (1.0 for zero, the largest
/// finite value where the quotient overflows).
fn divisor_of(amax: f32) -> f32 {
    let d = if amax == 0.0 { 1.0 } else { 2688.0f32 / amax };
    if d.is_finite() {
        d
    } else {
        f32::MAX
    }
}

/// Encode a row-major `[n, k]` matrix of finite values (shape already checked), 128-row tiles
/// in parallel (a tile's codes and swizzled scales are each one contiguous span).
pub fn encode(values: &[f32], n: usize, k: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let (scale_offset, divisor_offset, total) = planes(n, k);
    let mut out = vec![0u8; total];
    let d_w = divisor_of(values.iter().fold(0.0f32, |m, x| m.max(x.abs())));
    let (codes, rest) = out.split_at_mut(scale_offset);
    let scales = &mut rest[..divisor_offset - scale_offset];
    codes[..n * k / 2].par_chunks_mut(128 * k / 2).zip(scales.par_chunks_mut(k / 64 * 512)).enumerate().for_each(|(tile, (code_tile, scale_tile))| {
        for inner in 0..128 {
            let row = tile * 128 + inner;
            encode_row(&values[row * k..(row + 1) * k], d_w, row, &mut code_tile[inner * k / 2..(inner + 1) * k / 2], scale_tile, tile * (k / 64) * 512);
        }
    });
    out[divisor_offset..divisor_offset + 4].copy_from_slice(&d_w.to_le_bytes());
    out
}

/// One row's codes (`k / 2` bytes) and its scale words, written at `scale_index(row, g, k) -
/// base` of `scales`, under divisor `d`.
fn encode_row(xs: &[f32], d: f32, row: usize, codes: &mut [u8], scales: &mut [u8], base: usize) {
    let k = xs.len();
    for g in 0..k / 16 {
        let (s, c) = encode_group(&xs[g * 16..g * 16 + 16], d);
        scales[scale_index(row, g, k) - base] = s;
        for (i, pair) in c.chunks_exact(2).enumerate() {
            codes[g * 8 + i] = pair[0] | (pair[1] << 4);
        }
    }
}

/// Activations for the FP4 tensor-core GEMM (cuda/fp4_gemm.cu `nvfp4_quantize_rows`, bit for
/// bit): each of the `rows` rows of `x` (`[rows, k]`, k a multiple of 64) encoded as a matrix
/// of its own, its divisor `2688 / amax` over the row. Returns the codes (`[rows_ld, k / 2]`),
/// the scale plane of `rows_ld` rows in the weight's swizzle (what cuBLASLt's VEC16_UE4M3
/// reads) and the divisors (`rows_ld`); rows `rows .. rows_ld` (a multiple of 128) are zero
/// codes and scales with divisor 1.
pub fn quantize_rows(x: &[f32], rows: usize, rows_ld: usize, k: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    assert!(k.is_multiple_of(64) && rows_ld.is_multiple_of(128) && rows <= rows_ld && x.len() == rows * k);
    let mut codes = vec![0u8; rows_ld * k / 2];
    let mut scales = vec![0u8; rows_ld * k / 16];
    let mut divisors = vec![1.0f32; rows_ld];
    for t in 0..rows {
        let xs = &x[t * k..(t + 1) * k];
        let d = divisor_of(xs.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        divisors[t] = d;
        encode_row(xs, d, t, &mut codes[t * k / 2..(t + 1) * k / 2], &mut scales, 0);
    }
    (codes, scales, divisors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_swizzle_is_a_permutation_of_the_plane() {
        let (n, k) = (256, 128);
        let mut seen = vec![false; n * k / 16];
        for row in 0..n {
            for g in 0..k / 16 {
                let i = scale_index(row, g, k);
                assert!(!seen[i], "row {row} group {g} collides");
                seen[i] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        // Row 33, group 5 of a K=128 matrix: tile 1 of row tile 0, inner (1*16 + 1*4 + 1).
        assert_eq!(scale_index(33, 5, 128), 512 + 16 + 4 + 1);
    }

    #[test]
    fn each_activation_row_is_encoded_as_a_matrix_of_that_row() {
        // A row's codes, scales and divisor are those of `encode` on a 128-row matrix whose
        // rows all equal it (so that its amax is the row's): a zero group, a zero row, a row
        // whose small groups round to no scale, and a row whose divisor overflows binary32.
        let k = 128;
        let mut x: Vec<f32> = (0..5 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        x[16..32].iter_mut().for_each(|v| *v = 0.0);
        x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
        x[2 * k..3 * k].iter_mut().for_each(|v| *v *= 1e-7);
        x[2 * k + 3] = 2.5;
        x[3 * k..4 * k].iter_mut().for_each(|v| *v *= 1e-38);
        let (codes, scales, divisors) = quantize_rows(&x, 5, 128, k);
        assert_eq!(divisors[3], f32::MAX, "2688 / 1e-38 overflows");
        assert_eq!(divisors[1], 1.0, "a zero row");
        assert!(divisors[5..].iter().all(|&d| d == 1.0) && codes[5 * k / 2..].iter().all(|&c| c == 0));
        for t in 0..5 {
            let row = &x[t * k..(t + 1) * k];
            let matrix: Vec<f32> = (0..128).flat_map(|_| row.iter().copied()).collect();
            let payload = encode(&matrix, 128, k);
            assert_eq!(divisor(&payload, 128, k).to_bits(), divisors[t].to_bits(), "row {t}");
            assert_eq!(&payload[t * k / 2..(t + 1) * k / 2], &codes[t * k / 2..(t + 1) * k / 2], "row {t} codes");
            let (scale_offset, _, _) = planes(128, k);
            for g in 0..k / 16 {
                assert_eq!(payload[scale_offset + scale_index(t, g, k)], scales[scale_index(t, g, k)], "row {t} group {g}");
            }
        }
        // The small groups of row 2 take the smallest subnormal scale, not zero.
        assert_eq!(scales[scale_index(2, 1, k)], 0x01);
        assert_eq!(scales[scale_index(0, 1, k)], 0, "the zero group");
    }
}
