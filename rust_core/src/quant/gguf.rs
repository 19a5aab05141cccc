//! The GGUF (ggml) block formats NInfer reads: Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS and IQ3_S.
//!
//! A GGUF matrix `[N, K]` (GGUF lists it as `ne = [K, N]`) stores each row as `K / block` blocks
//! of fixed size, rows one after another, scales inside the blocks; all multi-byte fields are
//! little-endian. "f16" below is a binary16 word; every product is one binary32 rounding, in the
//! order written (the order `gguf.quants.dequantize` uses, which the tests compare against).
//!
//! - Q8_0 (32 values, 34 bytes): `d: f16`, `q: [i8; 32]`; `w = f32(q) * d`.
//! - Q4_K (256 values, 144 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`.
//!   Eight sub-blocks of 32 each have a 6-bit scale `sc` and min `m`: for j < 4
//!   `sc = scales[j] & 63`, `m = scales[j+4] & 63`; for j >= 4
//!   `sc = (scales[j+4] & 15) | ((scales[j-4] >> 6) << 4)`,
//!   `m = (scales[j+4] >> 4) | ((scales[j] >> 6) << 4)`. Sub-blocks 2c and 2c+1 take the low and
//!   high nibbles of `qs[32c..32c+32]`. `w = f32(d * sc) * q - f32(dmin * m)`.
//! - Q5_K (256 values, 176 bytes): `d`, `dmin`, `scales: [u8; 12]` as Q4_K, `qh: [u8; 32]`,
//!   `qs: [u8; 128]`; value `i` of sub-block `j` adds bit `j` of `qh[i]` as bit 4 of its code.
//! - Q6_K (256 values, 210 bytes): `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16`.
//!   In half `h` (128 values), value `h*128 + s*64 + b` (b < 64) takes nibble `s` of
//!   `ql[h*64 + b]`, and value `h*128 + t*32 + b` (b < 32) takes bits `2t..2t+2` of
//!   `qh[h*32 + b]` as its bits 4-5; `w = f32(d * scales[i / 16]) * (code - 32)`.
//! - IQ4_XS (256 values, 136 bytes): `d: f16`, `scales_h: u16`, `scales_l: [u8; 4]`,
//!   `qs: [u8; 128]`. Sub-block `j` (32 values) has the 6-bit scale
//!   `ls = nibble (j % 2) of scales_l[j / 2] | ((scales_h >> 2j) & 3) << 4`; its values 0..16 are
//!   the low nibbles of `qs[16j..16j+16]`, 16..32 the high ones, each an index into the
//!   non-linear table `KVALUES_IQ4NL`; `w = f32(d * (ls - 32)) * kvalue`.
//! - IQ3_S (256 values, 110 bytes): `d: f16`, `qs: [u8; 64]`, `qh: [u8; 8]`,
//!   `signs: [u8; 32]`, `scales: [u8; 4]`. Index `i` (64 of them, four values each) is
//!   `qs[i] | bit (i % 8) of qh[i / 8] << 8` into `IQ3S_GRID`; value `e` is byte `e % 4` of that
//!   entry, negated when bit `e % 8` of `signs[e / 8]` is set, times
//!   `db = f32(d * (1 + 2 * nibble (j % 2) of scales[j / 2]))` for sub-block `j = e / 32`.

use super::iq3s_grid::IQ3S_GRID;
use super::scalars::f16_to_f32;
use super::QuantFormat;

/// The IQ4_NL / IQ4_XS non-linear code table.
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// ggml type ids of the block formats (`GGMLQuantizationType`).
pub const GGUF_TYPE_IDS: [(u32, QuantFormat); 6] = [
    (8, QuantFormat::GgufQ8_0),
    (12, QuantFormat::GgufQ4K),
    (13, QuantFormat::GgufQ5K),
    (14, QuantFormat::GgufQ6K),
    (21, QuantFormat::GgufIq3S),
    (23, QuantFormat::GgufIq4Xs),
];

/// Names of the ggml type ids that exist but NInfer does not read (refused as not supported yet,
/// which a user can act on by picking another file, unlike an unknown id).
pub const KNOWN_UNSUPPORTED_GGUF_TYPES: [(u32, &str); 25] = [
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (22, "IQ2_S"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
    (40, "NVFP4 (GGUF blocks)"),
    (41, "Q1_0"),
];

/// Values per block and bytes per block.
pub fn block_geometry(format: QuantFormat) -> Option<(usize, usize)> {
    Some(match format {
        QuantFormat::GgufQ8_0 => (32, 34),
        QuantFormat::GgufQ4K => (256, 144),
        QuantFormat::GgufQ5K => (256, 176),
        QuantFormat::GgufQ6K => (256, 210),
        QuantFormat::GgufIq4Xs => (256, 136),
        QuantFormat::GgufIq3S => (256, 110),
        _ => return None,
    })
}

fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// The (scale, min) pair of sub-block `j` of a Q4_K / Q5_K block's 12 scale bytes.
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Decode one block into `out` (block-size values).
pub fn decode_block(format: QuantFormat, b: &[u8], out: &mut [f32]) {
    match format {
        QuantFormat::GgufQ8_0 => {
            let d = f16_at(b, 0);
            for i in 0..32 {
                out[i] = (b[2 + i] as i8) as f32 * d;
            }
        }
        QuantFormat::GgufQ4K | QuantFormat::GgufQ5K => {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let (qh, qs) = if format == QuantFormat::GgufQ5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for j in 0..8 {
                let (sc, m) = scale_min_k4(scales, j);
                let d1 = d * sc as f32;
                let m1 = dmin * m as f32;
                let shift = (j % 2) * 4;
                for i in 0..32 {
                    let mut q = (qs[(j / 2) * 32 + i] >> shift) & 0x0f;
                    if let Some(qh) = qh {
                        q |= ((qh[i] >> j) & 1) << 4;
                    }
                    out[j * 32 + i] = d1 * q as f32 - m1;
                }
            }
        }
        QuantFormat::GgufQ6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for e in 0..256 {
                let (h, r) = (e / 128, e % 128);
                let low = (ql[h * 64 + r % 64] >> ((r / 64) * 4)) & 0x0f;
                let high = (qh[h * 32 + r % 32] >> ((r / 32) * 2)) & 3;
                let q = (low | (high << 4)) as i32 - 32;
                out[e] = (d * (sc[e / 16] as i8) as f32) * q as f32;
            }
        }
        QuantFormat::GgufIq4Xs => {
            let d = f16_at(b, 0);
            let scales_h = u16::from_le_bytes([b[2], b[3]]);
            let (scales_l, qs) = (&b[4..8], &b[8..136]);
            for j in 0..8 {
                let ls = ((scales_l[j / 2] >> ((j % 2) * 4)) & 0x0f) | ((((scales_h >> (2 * j)) & 3) as u8) << 4);
                let dl = d * (ls as i32 - 32) as f32;
                for i in 0..32 {
                    let q = (qs[16 * j + i % 16] >> ((i / 16) * 4)) & 0x0f;
                    out[j * 32 + i] = dl * KVALUES_IQ4NL[q as usize] as f32;
                }
            }
        }
        QuantFormat::GgufIq3S => {
            let d = f16_at(b, 0);
            let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
            for e in 0..256 {
                let j = e / 32;
                let db = d * (1 + 2 * ((scales[j / 2] >> ((j % 2) * 4)) & 0x0f) as u32) as f32;
                let i = e / 4;
                let idx = qs[i] as usize | ((((qh[i / 8] >> (i % 8)) & 1) as usize) << 8);
                let g = ((IQ3S_GRID[idx] >> (8 * (e % 4))) & 0xff) as f32;
                let v = db * g;
                out[e] = if (signs[e / 8] >> (e % 8)) & 1 != 0 { -v } else { v };
            }
        }
        _ => unreachable!("not a GGUF block format: {format:?}"),
    }
}

/// Decode rows of a validated `[n, k]` payload.
pub fn decode_rows(format: QuantFormat, payload: &[u8], k: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let (be, bb) = block_geometry(format).unwrap();
    let row_bytes = k / be * bb;
    for (r, row) in rows.enumerate() {
        for blk in 0..k / be {
            let off = row * row_bytes + blk * bb;
            decode_block(format, &payload[off..off + bb], &mut out[r * k + blk * be..r * k + (blk + 1) * be]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iq3s_grid_holds_only_odd_magnitudes_up_to_15() {
        for w in IQ3S_GRID {
            for j in 0..4 {
                let v = (w >> (8 * j)) & 0xff;
                assert!(v % 2 == 1 && v <= 15, "{w:#010x}");
            }
        }
        assert_eq!(IQ3S_GRID[0], 0x01010101);
    }

    #[test]
    fn q8_0_block_is_scale_times_code() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        for i in 0..32 {
            b[2 + i] = (i as i8 - 16) as u8;
        }
        let mut out = [0.0f32; 32];
        decode_block(QuantFormat::GgufQ8_0, &b, &mut out);
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, (i as f32 - 16.0) * 0.5);
        }
    }
}
