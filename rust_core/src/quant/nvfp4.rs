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

/// Encode a row-major `[n, k]` matrix of finite values (shape already checked), 128-row tiles
/// in parallel (a tile's codes and swizzled scales are each one contiguous span).
pub fn encode(values: &[f32], n: usize, k: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let (scale_offset, divisor_offset, total) = planes(n, k);
    let mut out = vec![0u8; total];
    let amax = values.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let d_w = if amax == 0.0 { 1.0 } else { 2688.0f32 / amax };
    let d_w = if d_w.is_finite() { d_w } else { f32::MAX };
    let (codes, rest) = out.split_at_mut(scale_offset);
    let scales = &mut rest[..divisor_offset - scale_offset];
    codes[..n * k / 2].par_chunks_mut(128 * k / 2).zip(scales.par_chunks_mut(k / 64 * 512)).enumerate().for_each(|(tile, (code_tile, scale_tile))| {
        for inner in 0..128 {
            let row = tile * 128 + inner;
            for g in 0..k / 16 {
                let xs = &values[row * k + g * 16..row * k + g * 16 + 16];
                let amax_g = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let mut s = f32_to_e4m3((amax_g / 6.0) * d_w);
                if s == 0 && amax_g != 0.0 {
                    s = 0x01;
                }
                scale_tile[scale_index(row, g, k) - tile * (k / 64) * 512] = s;
                if s == 0 {
                    continue;
                }
                let inv = d_w / e4m3_to_f32(s).unwrap();
                for (i, x) in xs.iter().enumerate() {
                    let col = g * 16 + i;
                    let c = f32_to_e2m1(x * inv);
                    code_tile[(inner * k + col) / 2] |= if col % 2 == 0 { c } else { c << 4 };
                }
            }
        }
    });
    out[divisor_offset..divisor_offset + 4].copy_from_slice(&d_w.to_le_bytes());
    out
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
}
