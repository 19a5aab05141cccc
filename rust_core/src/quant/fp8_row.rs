//! `FP8_E4M3FN_ROW_BF16S` in the `row-scale-v1` layout.
//!
//! Numbers: one E4M3FN code per value (the NaN words 0x7f / 0xff are invalid) and one bfloat16
//! multiplier per row (+0 or finite positive; a +0 row holds only zero codes):
//! `w = f32(e4m3(c) * bf16(s))`.
//!
//! Bytes, for `[N, K]`: the row-major code plane (`N*K` bytes), zero padding to 256 bytes, then
//! `N` little-endian bfloat16 row scales.
//!
//! Encoder (ours: NInfer names no format-wide encoder): `s = bf16(f32(amax_row / 448))` (the
//! smallest subnormal bfloat16 when a nonzero row rounds to zero; +0 for an all-zero row),
//! `c = e4m3(f32(x / s))` nearest, ties to even, saturating at +-448.

use super::scalars::{bf16_to_f32, e4m3_table, f32_to_bf16, f32_to_e4m3, E4M3_MAX};

/// Scale-plane offset and payload size for `[n, k]`.
pub fn planes(n: usize, k: usize) -> (usize, usize) {
    let scale_offset = (n * k).div_ceil(256) * 256;
    (scale_offset, scale_offset + 2 * n)
}

/// The bfloat16 scale word of `row`.
pub fn scale_word(payload: &[u8], n: usize, k: usize, row: usize) -> u16 {
    let off = planes(n, k).0 + 2 * row;
    u16::from_le_bytes([payload[off], payload[off + 1]])
}

/// Decode rows of a validated payload.
pub fn decode_rows(payload: &[u8], n: usize, k: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let table = e4m3_table();
    for (r, row) in rows.enumerate() {
        let s = bf16_to_f32(scale_word(payload, n, k, row));
        for (dst, &c) in out[r * k..(r + 1) * k].iter_mut().zip(&payload[row * k..(row + 1) * k]) {
            *dst = table[c as usize] * s;
        }
    }
}

/// Encode a row-major `[n, k]` matrix of finite values, rows in parallel.
pub fn encode(values: &[f32], n: usize, k: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let (scale_offset, total) = planes(n, k);
    let mut out = vec![0u8; total];
    let scales: Vec<u16> = out[..n * k]
        .par_chunks_mut(k)
        .zip(values.par_chunks(k))
        .map(|(dst, xs)| {
            let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let mut s = f32_to_bf16(amax / E4M3_MAX);
            if s == 0 && amax != 0.0 {
                s = 0x0001;
            }
            if s != 0 {
                let s32 = bf16_to_f32(s);
                for (d, x) in dst.iter_mut().zip(xs) {
                    *d = f32_to_e4m3(x / s32);
                }
            }
            s
        })
        .collect();
    for (row, s) in scales.iter().enumerate() {
        out[scale_offset + 2 * row..scale_offset + 2 * row + 2].copy_from_slice(&s.to_le_bytes());
    }
    out
}
