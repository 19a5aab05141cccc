//! The 4-bit tiled device layout: a Q4G64_F16S weight repacked at upload so that the decode GEMV
//! (cuda/quant.cuh `q4t_gemv_tile`) streams it in 16-byte loads that are mma.sync A fragments as
//! loaded, and the dequantize kernel (`dec_q4_tiles`) reads the same bytes. The values are the
//! format's exactly (`f32(s) * code`); only where the bytes sit changes.
//!
//! Geometry: rows in tiles of 16 (`n16 = align_up(n, 16)`, padding rows code 0 and scale +0), K
//! in blocks of 128 values (`KB = align_up(k, 128) / 128`, two groups of 64 a block, padding
//! lanes code 0 as in the checkpoint). Codes: `(tile t, block b)` is 1024 bytes at
//! `(t * KB + b) * 1024`; in it half `h` (rows `8h .. 8h + 7` of the tile) 512 bytes, then lane
//! `L = 4 * gid + t4` 16 bytes (row `8h + gid`), then word `i` (4 bytes: mma steps `2i`, `2i + 1`).
//! Step `j` (0..8) holds group `j / 4` of the block, values `(j % 4) * 16 + 4 * t4 + e` (e = 0..4)
//! of it, as nibbles `NIBBLE[e]` (`j` even) or `NIBBLE[e] + 2` (`j` odd) of the word, each the
//! code plus 8 (offset binary). So lane `(gid, t4)` holds, for step `j`, the A fragment of
//! m16n8k16 at rows `gid` / `gid + 8` and k `2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9`, taken to be
//! values `e = 0, 1, 2, 3`; x's B fragment is then 4 consecutive values (one 8-byte load).
//! Scales: binary16, at `scale_offset = n16 * KB * 512`, 64 bytes a `(tile, block)`, (row `gid` of
//! half `h`, group `g`) at `gid * 8 + h * 4 + g * 2`: lane `gid`'s four scales are one 8-byte load.

use rayon::prelude::*;

use crate::quant::grouped::Grouped;
use crate::quant::QuantFormat;

/// Nibble of a word that holds value `e` of an even mma step (odd steps: plus 2). Nibbles `n`
/// and `n + 4` are one 32-bit word's bits `4n` and `4n + 16`: a pair the kernel turns into two
/// 16-bit halves with one mask.
pub const NIBBLE: [usize; 4] = [0, 4, 1, 5];

/// Rows a tile holds, values a K block holds, bytes of a (tile, block)'s codes and scales.
pub const TILE_ROWS: usize = 16;
pub const BLOCK_K: usize = 128;
const TILE_BLOCK_BYTES: usize = 1024;
const TILE_SCALE_BYTES: usize = 64;

/// Geometry of the tiled layout of an `[n, k]` weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q4Tiles {
    pub tiles: usize,
    pub k_blocks: usize,
}

impl Q4Tiles {
    pub fn new(n: usize, k: usize) -> Q4Tiles {
        Q4Tiles { tiles: n.div_ceil(TILE_ROWS), k_blocks: k.div_ceil(BLOCK_K) }
    }

    /// Byte offset of the scale plane (the kernels' `p0`).
    pub fn scale_offset(&self) -> usize {
        self.tiles * self.k_blocks * TILE_BLOCK_BYTES
    }

    /// Bytes of the whole layout.
    pub fn bytes(&self) -> usize {
        self.scale_offset() + self.tiles * self.k_blocks * TILE_SCALE_BYTES
    }

    /// Byte offset and bit shift of the nibble holding (row, col).
    pub fn code_at(&self, row: usize, col: usize) -> (usize, u32) {
        let (t, h, gid) = (row / TILE_ROWS, (row / 8) % 2, row % 8);
        let (b, p) = (col / BLOCK_K, col % BLOCK_K);
        let (g, i) = (p / 64, p % 64);
        let (j, t4, e) = (g * 4 + i / 16, (i % 16) / 4, i % 4);
        let nib = NIBBLE[e] + 2 * (j % 2);
        let off = (t * self.k_blocks + b) * TILE_BLOCK_BYTES + h * 512 + (gid * 4 + t4) * 16 + (j / 2) * 4 + nib / 2;
        (off, 4 * (nib % 2) as u32)
    }

    /// Byte offset of the binary16 scale of (row, group of 64).
    pub fn scale_at(&self, row: usize, group: usize) -> usize {
        let (t, h, gid) = (row / TILE_ROWS, (row / 8) % 2, row % 8);
        self.scale_offset() + (t * self.k_blocks + group / 2) * TILE_SCALE_BYTES + gid * 8 + h * 4 + (group % 2) * 2
    }
}

/// Whether `format` is uploaded in the tiled layout (and runs the tiled kernels).
pub fn is_tiled(format: QuantFormat) -> bool {
    format == QuantFormat::Q4G64F16S
}

/// A validated Q4G64_F16S payload (`row-split-k128-v1`) of `[n, k]` in the tiled layout, tiles
/// in parallel.
pub fn q4g64_to_tiles(payload: &[u8], n: usize, k: usize) -> Vec<u8> {
    let g = Grouped::of(QuantFormat::Q4G64F16S).expect("Q4G64 is grouped");
    let planes = g.planes(n, k);
    let gpr = g.groups_per_row(k);
    let lay = Q4Tiles::new(n, k);
    // Offset binary: 0x88 is code 0 in both nibbles, and XOR-ing a stored two's-complement
    // nibble u into 8 gives u ^ 8 = code + 8, so every untouched nibble (padding rows) stays 0.
    let mut out = vec![0x88u8; lay.bytes()];
    out[lay.scale_offset()..].iter_mut().for_each(|b| *b = 0);
    let (codes, scales) = out.split_at_mut(lay.scale_offset());
    let tile_codes = lay.k_blocks * TILE_BLOCK_BYTES;
    let tile_scales = lay.k_blocks * TILE_SCALE_BYTES;
    codes.par_chunks_mut(tile_codes).zip(scales.par_chunks_mut(tile_scales)).enumerate().for_each(|(t, (tc, ts))| {
        // Offsets relative to this tile (the geometry of a one-tile weight of the same K).
        let one = Q4Tiles { tiles: 1, k_blocks: lay.k_blocks };
        for row in t * TILE_ROWS..((t + 1) * TILE_ROWS).min(n) {
            let r = row % TILE_ROWS;
            for gi in 0..gpr {
                let idx = row * gpr + gi;
                let base = &payload[idx * 32..idx * 32 + 32];
                for (i, &byte) in base.iter().enumerate() {
                    for half in 0..2 {
                        let u = (byte >> (4 * half)) & 0x0f;
                        let (off, sh) = one.code_at(r, gi * 64 + 2 * i + half);
                        tc[off] ^= u << sh;
                    }
                }
                let s = one.scale_at(r, gi) - one.scale_offset();
                ts[s..s + 2].copy_from_slice(&payload[planes.scale_offset + 2 * idx..planes.scale_offset + 2 * idx + 2]);
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::scalars::f16_to_f32;
    use crate::quant::{dequantize, quantize, QuantWeight};

    /// Value (row, col) of a tiled weight the way `dec_q4_tiles` reads it.
    fn tiled_value(lay: &Q4Tiles, bytes: &[u8], row: usize, col: usize) -> f32 {
        let (off, sh) = lay.code_at(row, col);
        let code = ((bytes[off] >> sh) & 0x0f) as i32 - 8;
        let s = lay.scale_at(row, col / 64);
        f16_to_f32(u16::from_le_bytes([bytes[s], bytes[s + 1]])) * code as f32
    }

    fn random_q4(n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let mut state = seed;
        let mut v: Vec<f32> = (0..n * k)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        // An all-zero row (scale +0) and a row of tiny values (subnormal scales).
        v[..k].iter_mut().for_each(|x| *x = 0.0);
        if n > 1 {
            v[k..2 * k].iter_mut().for_each(|x| *x *= 1e-6);
        }
        let payload = quantize(QuantFormat::Q4G64F16S, "w", &v, [n, k]).unwrap();
        let want = dequantize(&QuantWeight::packed("w", QuantFormat::Q4G64F16S, [n, k], payload.clone()).view()).unwrap();
        (payload, want)
    }

    #[test]
    fn every_value_has_one_nibble_and_the_layout_is_dense() {
        // Each (row, col) of a [32, 256] weight maps to its own nibble, and all of them are used.
        let lay = Q4Tiles::new(32, 256);
        let mut seen = vec![0u8; lay.scale_offset()];
        for row in 0..32 {
            for col in 0..256 {
                let (off, sh) = lay.code_at(row, col);
                assert_eq!(seen[off] & (0x0f << sh), 0, "({row}, {col}) shares a nibble");
                seen[off] |= 0x0f << sh;
            }
        }
        assert!(seen.iter().all(|&b| b == 0xff));
        let mut scales = std::collections::HashSet::new();
        for row in 0..32 {
            for g in 0..4 {
                assert!(scales.insert(lay.scale_at(row, g)));
            }
        }
        assert_eq!(scales.len() * 2, lay.bytes() - lay.scale_offset());
    }

    #[test]
    fn tiled_values_equal_the_reference_decoder_bit_for_bit() {
        // Ragged rows (a padded last tile), K padded to 128, several blocks, edge scales.
        for (n, k) in [(37, 200), (16, 128), (5, 8), (48, 640)] {
            let (payload, want) = random_q4(n, k, (n * k) as u64);
            let lay = Q4Tiles::new(n, k);
            let tiled = q4g64_to_tiles(&payload, n, k);
            assert_eq!(tiled.len(), lay.bytes());
            for row in 0..n {
                for col in 0..k {
                    let got = tiled_value(&lay, &tiled, row, col);
                    assert_eq!(got.to_bits(), want[row * k + col].to_bits(), "[{n}, {k}] ({row}, {col})");
                }
            }
            // Padding: rows past n and lanes past k are code 0 under scale +0 or a real scale.
            for row in 0..lay.tiles * TILE_ROWS {
                for col in 0..lay.k_blocks * BLOCK_K {
                    if row >= n || col >= k {
                        assert_eq!(tiled_value(&lay, &tiled, row, col), 0.0, "[{n}, {k}] padding ({row}, {col})");
                    }
                }
            }
        }
    }

    /// The mma.sync operands as `q4t_gemv_tile` forms them, multiplied the way m16n8k16 defines
    /// (A row-major 16 x 16 from lanes (gid, t4): a0 a1 = (gid, 2t4 .. 2t4+1), a2 a3 = (gid+8, same),
    /// a4 a5 = (gid, 2t4+8 ..), a6 a7 = (gid+8, 2t4+8 ..); B 16 x 8: b0 b1 = (2t4 .., col gid),
    /// b2 b3 = (2t4+8 .., col gid)), group sums times scales: the tile's y equals x W^T.
    #[test]
    fn the_kernels_fragment_order_multiplies_matching_values() {
        let (n, k, m) = (24, 200, 3);
        let (payload, want_w) = random_q4(n, k, 99);
        let lay = Q4Tiles::new(n, k);
        let tiled = q4g64_to_tiles(&payload, n, k);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 23) as f32 / 8.0 - 1.0).collect();
        let mut y = vec![0.0f64; m * n];
        for tile in 0..lay.tiles {
            for kb in 0..lay.k_blocks {
                for g in 0..2 {
                    let mut d = [[0.0f64; 8]; 16];
                    for a in 0..4 {
                        let j = g * 4 + a;
                        // A[16][16] and B[16][8] of this step from the lanes' registers.
                        let mut am = [[0.0f64; 16]; 16];
                        let mut bm = [[0.0f64; 8]; 16];
                        for lane in 0..32 {
                            let (gid, t4) = (lane / 4, lane % 4);
                            for h in 0..2 {
                                let off = (tile * lay.k_blocks + kb) * 1024 + h * 512 + lane * 16 + (j / 2) * 4;
                                let word = u32::from_le_bytes(tiled[off..off + 4].try_into().unwrap()) >> ((j % 2) * 8);
                                // Value e of the lane's step: low pair (mask 0x000f000f) e = 0, 1;
                                // high pair (0x00f000f0) e = 2, 3.
                                let code = |e: usize| ((word >> [0, 16, 4, 20][e]) & 0x0f) as f64 - 8.0;
                                am[gid + 8 * h][2 * t4] = code(0);
                                am[gid + 8 * h][2 * t4 + 1] = code(1);
                                am[gid + 8 * h][2 * t4 + 8] = code(2);
                                am[gid + 8 * h][2 * t4 + 9] = code(3);
                            }
                            // x values kx + 4 t4 + e of batch row gid (zero past m or k).
                            let kx = kb * 128 + j * 16 + 4 * t4;
                            let xv = |e: usize| if gid < m && kx < k { x[gid * k + kx + e] as f64 } else { 0.0 };
                            bm[2 * t4][gid] = xv(0);
                            bm[2 * t4 + 1][gid] = xv(1);
                            bm[2 * t4 + 8][gid] = xv(2);
                            bm[2 * t4 + 9][gid] = xv(3);
                        }
                        for (r, dr) in d.iter_mut().enumerate() {
                            for (c, dc) in dr.iter_mut().enumerate() {
                                *dc += (0..16).map(|kk| am[r][kk] * bm[kk][c]).sum::<f64>();
                            }
                        }
                    }
                    for r in 0..16 {
                        let row = tile * 16 + r;
                        let s = lay.scale_at(row, 2 * kb + g);
                        let s = f16_to_f32(u16::from_le_bytes([tiled[s], tiled[s + 1]])) as f64;
                        for c in 0..m {
                            if row < n {
                                y[c * n + row] += s * d[r][c];
                            }
                        }
                    }
                }
            }
        }
        for c in 0..m {
            for row in 0..n {
                let exact: f64 = (0..k).map(|kk| want_w[row * k + kk] as f64 * x[c * k + kk] as f64).sum();
                assert!((y[c * n + row] - exact).abs() <= 1e-9 * (1.0 + exact.abs()), "y[{c}, {row}] = {}, want {exact}", y[c * n + row]);
            }
        }
    }
}
