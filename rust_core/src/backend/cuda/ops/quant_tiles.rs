//! The 4-bit tiled device layout: a 4-bit weight (Q4G64_F16S, and HF AWQ / GPTQ /
//! pack-quantized weights whose groups are whole 64-value runs) repacked at upload so that the
//! decode GEMV (cuda/quant.cuh `q4t_gemv_tile`) streams it in 16-byte loads that are mma.sync A
//! fragments as loaded, and the dequantize kernel (`dec_q4_tiles`) reads the same bytes. Every
//! value is `f32(q - z) * s` for a 4-bit `q`, a zero `z` and a scale `s` per (row, 64 values),
//! the format's value exactly (Q4G64: `q` = code + 8, `z` = 8); only where the bytes sit changes.
//!
//! Geometry: rows in tiles of 16 (`n16 = align_up(n, 16)`, padding rows `q` = `z` = 8, scale +0),
//! K in blocks of 128 values (`KB = align_up(k, 128) / 128`, two groups of 64 a block; lanes past
//! K hold 8, multiplied by x's zeros). Codes: `(tile t, block b)` is 1024 bytes at
//! `(t * KB + b) * 1024`; in it half `h` (rows `8h .. 8h + 7` of the tile) 512 bytes, then lane
//! `L = 4 * gid + t4` 16 bytes (row `8h + gid`), then word `i` (4 bytes: mma steps `2i`, `2i + 1`).
//! Step `j` (0..8) holds group `j / 4` of the block, values `(j % 4) * 16 + 4 * t4 + e` (e = 0..4)
//! of it, as nibbles `NIBBLE[e]` (`j` even) or `NIBBLE[e] + 2` (`j` odd) of the word. So lane
//! `(gid, t4)` holds, for step `j`, the A fragment of m16n8k16 at rows `gid` / `gid + 8` and k
//! `2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9`, taken to be values `e = 0, 1, 2, 3`; x's B fragment is
//! then 4 consecutive values (one 8-byte load).
//! Scales: 16-bit words (binary16, or bfloat16: the kernels' `p2` says which), at
//! `scale_offset = n16 * KB * 512`, 64 bytes a `(tile, block)`, (row `gid` of half `h`, group
//! `g`) at `gid * 8 + h * 4 + g * 2`: lane `gid`'s four scales are one 8-byte load. Zeros (only
//! where a weight has them; else every `z` is 8): bytes at `zero_offset = scale_offset + n16 *
//! KB * 32`, 32 a `(tile, block)`, (gid, h, g) at `gid * 4 + h * 2 + g`: one 4-byte load.

use rayon::prelude::*;

use crate::quant::grouped::Grouped;
use crate::quant::hf::{self, AWQ_NIBBLE};
use crate::quant::scalars::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::quant::{QuantFormat, QuantWeight, RawDtype};

/// Nibble of a word that holds value `e` of an even mma step (odd steps: plus 2). Nibbles `n`
/// and `n + 4` are one 32-bit word's bits `4n` and `4n + 16`: a pair the kernel turns into two
/// 16-bit halves with one mask.
pub const NIBBLE: [usize; 4] = [0, 4, 1, 5];

/// Rows a tile holds, values a K block holds, bytes of a (tile, block)'s codes, scales, zeros.
pub const TILE_ROWS: usize = 16;
pub const BLOCK_K: usize = 128;
const TILE_BLOCK_BYTES: usize = 1024;
const TILE_SCALE_BYTES: usize = 64;
const TILE_ZERO_BYTES: usize = 32;

/// K blocks a warp of the ring GEMV (cuda/quant.cuh `q4t_ring_tile`) holds in flight.
const RING_STAGES: usize = 4;

/// Whether a model whose quantized projections have inputs of at least `min_k` values runs its
/// tiled GEMVs in the ring form (cuda/quant.cuh `q4t_ring_tile`): where every weight's K blocks
/// outnumber its warps' ring stages (K > 4096), so that each ring streams. Otherwise the pass
/// form (`q4t_gemv_tile`) runs them all, since it makes fewer and fuller waves of tiles where K
/// fits one pass. One form a model: on the H100 the two back to back ran slower than either
/// alone. Both forms give the same bits.
pub fn q4t_ring(min_k: usize) -> bool {
    min_k.div_ceil(BLOCK_K) > RING_STAGES * (super::quant::QUANT_THREADS as usize / 32)
}

/// Geometry of the tiled layout of an `[n, k]` weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q4Tiles {
    pub tiles: usize,
    pub k_blocks: usize,
    /// Whether the layout has a zero plane.
    pub zeros: bool,
}

impl Q4Tiles {
    pub fn new(n: usize, k: usize, zeros: bool) -> Q4Tiles {
        Q4Tiles { tiles: n.div_ceil(TILE_ROWS), k_blocks: k.div_ceil(BLOCK_K), zeros }
    }

    fn blocks(&self) -> usize {
        self.tiles * self.k_blocks
    }

    /// Byte offset of the scale plane (the kernels' `p0`).
    pub fn scale_offset(&self) -> usize {
        self.blocks() * TILE_BLOCK_BYTES
    }

    /// Byte offset of the zero plane (the kernels' `p1`; 0, none, without one).
    pub fn zero_offset(&self) -> usize {
        if self.zeros {
            self.scale_offset() + self.blocks() * TILE_SCALE_BYTES
        } else {
            0
        }
    }

    /// Bytes of the whole layout.
    pub fn bytes(&self) -> usize {
        self.scale_offset() + self.blocks() * (TILE_SCALE_BYTES + if self.zeros { TILE_ZERO_BYTES } else { 0 })
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

    /// Offset of (row, group of 64) in a plane of `bytes` a (tile, block), `width` bytes each.
    fn plane_at(&self, row: usize, group: usize, bytes: usize, width: usize) -> usize {
        let (t, h, gid) = (row / TILE_ROWS, (row / 8) % 2, row % 8);
        (t * self.k_blocks + group / 2) * bytes + (gid * 4 + h * 2 + group % 2) * width
    }

    /// Byte offset of the scale word of (row, group of 64).
    pub fn scale_at(&self, row: usize, group: usize) -> usize {
        self.scale_offset() + self.plane_at(row, group, TILE_SCALE_BYTES, 2)
    }

    /// Byte offset of the zero of (row, group of 64); needs a zero plane.
    pub fn zero_at(&self, row: usize, group: usize) -> usize {
        debug_assert!(self.zeros);
        self.zero_offset() + self.plane_at(row, group, TILE_ZERO_BYTES, 1)
    }
}

/// The scale words' type: the kernels' `p2`, as quant.cuh `q_float_at` numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleWord {
    F16 = 1,
    Bf16 = 2,
}

/// A weight in the tiled layout: the bytes and the kernels' parameters `[p0, p1, p2]`.
pub struct TiledWeight {
    pub bytes: Vec<u8>,
    pub params: [i64; 3],
}

/// The layout from a weight's parts: `code(row, col)` its 4-bit q, `scale(row, g)` and
/// `zero(row, g)` (None: every z is 8) those of group g of 64 (called only for groups holding
/// values), tiles in parallel.
fn build<C, S, Z>(n: usize, k: usize, word: ScaleWord, code: C, scale: S, zero: Option<Z>) -> TiledWeight
where
    C: Fn(usize, usize) -> u8 + Sync,
    S: Fn(usize, usize) -> u16 + Sync,
    Z: Fn(usize, usize) -> u8 + Sync,
{
    let lay = Q4Tiles::new(n, k, zero.is_some());
    // 0x88 is q = 8 in both nibbles (z = 8: value 0); each q is XOR-ed in as q ^ 8.
    let mut out = vec![0x88u8; lay.bytes()];
    out[lay.scale_offset()..].iter_mut().for_each(|b| *b = 0);
    if lay.zeros {
        out[lay.zero_offset()..].iter_mut().for_each(|b| *b = 8);
    }
    let (codes, planes) = out.split_at_mut(lay.scale_offset());
    let (scales, zeros) = planes.split_at_mut(lay.blocks() * TILE_SCALE_BYTES);
    let per_tile = |bytes: usize| lay.k_blocks * bytes;
    // Offsets relative to one tile: the geometry of a one-tile weight of the same K.
    let one = Q4Tiles { tiles: 1, ..lay };
    let zero_chunks: Vec<&mut [u8]> = if lay.zeros { zeros.chunks_mut(per_tile(TILE_ZERO_BYTES)).collect() } else { (0..lay.tiles).map(|_| &mut [][..]).collect() };
    codes
        .par_chunks_mut(per_tile(TILE_BLOCK_BYTES))
        .zip(scales.par_chunks_mut(per_tile(TILE_SCALE_BYTES)))
        .zip(zero_chunks.into_par_iter())
        .enumerate()
        .for_each(|(t, ((tc, ts), tz))| {
            for row in t * TILE_ROWS..((t + 1) * TILE_ROWS).min(n) {
                let r = row % TILE_ROWS;
                for g in 0..k.div_ceil(64) {
                    let s = one.scale_at(r, g) - one.scale_offset();
                    ts[s..s + 2].copy_from_slice(&scale(row, g).to_le_bytes());
                    if let Some(z) = &zero {
                        tz[one.zero_at(r, g) - one.zero_offset()] = z(row, g);
                    }
                    for col in g * 64..(g * 64 + 64).min(k) {
                        let (off, sh) = one.code_at(r, col);
                        tc[off] ^= ((code(row, col) & 0x0f) ^ 8) << sh;
                    }
                }
            }
        });
    TiledWeight { params: [lay.scale_offset() as i64, lay.zero_offset() as i64, word as i64], bytes: out }
}

/// A validated Q4G64_F16S payload (`row-split-k128-v1`) of `[n, k]` in the tiled layout.
pub fn q4g64_to_tiles(payload: &[u8], n: usize, k: usize) -> TiledWeight {
    let g = Grouped::of(QuantFormat::Q4G64F16S).expect("Q4G64 is grouped");
    let planes = g.planes(n, k);
    let gpr = g.groups_per_row(k);
    // The stored two's-complement nibble u is code + 8 = u ^ 8 in offset binary.
    let code = |row: usize, col: usize| ((payload[(row * gpr + col / 64) * 32 + (col % 64) / 2] >> (4 * (col % 2))) & 0x0f) ^ 8;
    let scale = |row: usize, gi: usize| {
        let at = planes.scale_offset + 2 * (row * gpr + gi);
        u16::from_le_bytes([payload[at], payload[at + 1]])
    };
    build(n, k, ScaleWord::F16, code, scale, None::<fn(usize, usize) -> u8>)
}

/// The group of 64 values each HF group of `group` values covers whole, or None when the groups
/// do not map onto runs of 64 (a group that is not a multiple of 64; a `g_idx` that is not
/// `k / group`, act-order).
fn hf_group_of_64(w: &QuantWeight, group: usize) -> Option<usize> {
    let k = w.shape[1];
    if group != 0 && !group.is_multiple_of(64) {
        return None;
    }
    if let Some(gi) = &w.g_idx {
        let trivial = (0..k).all(|c| u32::from_le_bytes(gi.bytes[4 * c..4 * c + 4].try_into().unwrap()) as usize == if group == 0 { 0 } else { c / group });
        if !trivial {
            return None;
        }
    }
    Some(if group == 0 { usize::MAX } else { group / 64 })
}

/// A validated HF 4-bit weight (AWQ, GPTQ, pack-quantized) in the tiled layout with its zeros
/// (none for symmetric pack-quantized), or None where its groups do not map onto the layout's
/// (see `hf_group_of_64`) or a pack-quantized F32 scale is neither an f16 nor a bf16 value.
pub fn hf4_to_tiles(w: &QuantWeight) -> Option<TiledWeight> {
    let [n, k] = w.shape;
    let word = |bytes: &[u8], i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    let nib = |v: u32, i: usize| ((v >> (4 * i)) & 0x0f) as u8;
    let scale = w.scale.as_ref()?;
    let half = |i: usize| u16::from_le_bytes([scale.bytes[2 * i], scale.bytes[2 * i + 1]]);
    match w.format {
        QuantFormat::Awq4 { group } => {
            let per = hf_group_of_64(w, group)?;
            let zeros = &w.zero.as_ref()?.bytes;
            let g_of = move |g: usize| if per == usize::MAX { 0 } else { g / per };
            let code = |row: usize, col: usize| nib(word(&w.data, col * (n / 8) + row / 8), AWQ_NIBBLE[row % 8] as usize);
            let zero = move |row: usize, g: usize| nib(word(zeros, g_of(g) * (n / 8) + row / 8), AWQ_NIBBLE[row % 8] as usize);
            Some(build(n, k, ScaleWord::F16, code, |row, g| half(g_of(g) * n + row), Some(zero)))
        }
        QuantFormat::Gptq4 { group, zero_plus_one } => {
            let per = hf_group_of_64(w, group)?;
            let zeros = &w.zero.as_ref()?.bytes;
            let g_of = move |g: usize| if per == usize::MAX { 0 } else { g / per };
            let code = |row: usize, col: usize| nib(word(&w.data, (col / 8) * n + row), col % 8);
            let zero = move |row: usize, g: usize| nib(word(zeros, g_of(g) * (n / 8) + row / 8), row % 8) + zero_plus_one as u8;
            Some(build(n, k, ScaleWord::F16, code, |row, g| half(g_of(g) * n + row), Some(zero)))
        }
        QuantFormat::PackQuantized4 { group, .. } => {
            let per = hf_group_of_64(w, group)?;
            let gs = hf::groups(group, k);
            let g_of = move |g: usize| if per == usize::MAX { 0 } else { g / per };
            // Scales as 16-bit words of one type, exactly.
            let (words, kind): (Vec<u16>, ScaleWord) = match scale.dtype {
                RawDtype::F16 => ((0..n * gs).map(half).collect(), ScaleWord::F16),
                RawDtype::BF16 => ((0..n * gs).map(half).collect(), ScaleWord::Bf16),
                _ => {
                    let v: Vec<f32> = (0..n * gs).map(|i| f32::from_le_bytes(scale.bytes[4 * i..4 * i + 4].try_into().unwrap())).collect();
                    if v.iter().all(|&x| f16_to_f32(f32_to_f16(x)).to_bits() == x.to_bits()) {
                        (v.iter().map(|&x| f32_to_f16(x)).collect(), ScaleWord::F16)
                    } else if v.iter().all(|&x| bf16_to_f32(f32_to_bf16(x)).to_bits() == x.to_bits()) {
                        (v.iter().map(|&x| f32_to_bf16(x)).collect(), ScaleWord::Bf16)
                    } else {
                        return None;
                    }
                }
            };
            // q and z are stored plus 8: q - z is the stored difference.
            let code = |row: usize, col: usize| nib(word(&w.data, row * (k / 8) + col / 8), col % 8);
            let scale = |row: usize, g: usize| words[row * gs + g_of(g)];
            match &w.zero {
                Some(zp) => {
                    let zero = |row: usize, g: usize| nib(word(&zp.bytes, (row / 8) * gs + g_of(g)), row % 8);
                    Some(build(n, k, kind, code, scale, Some(zero)))
                }
                None => Some(build(n, k, kind, code, scale, None::<fn(usize, usize) -> u8>)),
            }
        }
        _ => None,
    }
}

/// A weight in the tiled layout where its format and groups allow (Q4G64_F16S always; HF 4-bit
/// forms by `hf4_to_tiles`), else None (uploaded as stored).
pub fn to_tiles(w: &QuantWeight) -> Option<TiledWeight> {
    match w.format {
        QuantFormat::Q4G64F16S => Some(q4g64_to_tiles(&w.data, w.shape[0], w.shape[1])),
        QuantFormat::Awq4 { .. } | QuantFormat::Gptq4 { .. } | QuantFormat::PackQuantized4 { .. } => hf4_to_tiles(w),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::scalars::f16_to_f32;
    use crate::quant::{dequantize, quantize, QuantWeight};

    #[test]
    fn the_ring_form_takes_models_whose_every_k_is_past_one_pass_of_the_warps() {
        // Llama-3-8B's smallest K 4096 (qkv, o, gate_up: one pass); Qwen3.5-27B's 5120 (its K
        // are 5120 .. 17408); K = 4224 is one block past a pass.
        for (min_k, ring) in [(8, false), (4096, false), (4097, true), (4224, true), (5120, true)] {
            assert_eq!(q4t_ring(min_k), ring, "smallest K = {min_k}");
        }
    }

    /// Value (row, col) of a tiled weight the way `dec_q4_tiles` reads it.
    fn tiled_value(lay: &Q4Tiles, bytes: &[u8], row: usize, col: usize) -> f32 {
        tiled_value_of(lay, bytes, ScaleWord::F16, row, col)
    }

    fn tiled_value_of(lay: &Q4Tiles, bytes: &[u8], word: ScaleWord, row: usize, col: usize) -> f32 {
        let (off, sh) = lay.code_at(row, col);
        let z = if lay.zeros { bytes[lay.zero_at(row, col / 64)] as i32 } else { 8 };
        let q = ((bytes[off] >> sh) & 0x0f) as i32;
        let s = lay.scale_at(row, col / 64);
        let s = u16::from_le_bytes([bytes[s], bytes[s + 1]]);
        let s = if word == ScaleWord::Bf16 { bf16_to_f32(s) } else { f16_to_f32(s) };
        s * (q - z) as f32
    }

    /// A random HF 4-bit weight (random words; scales positive, in `dtype`; zeros where the form
    /// has them; `g_idx` = k / group where asked).
    fn random_hf(format: QuantFormat, [n, k]: [usize; 2], dtype: RawDtype, g_idx: Option<Vec<u32>>, seed: u64) -> QuantWeight {
        use crate::quant::OwnedRaw;
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 32) as u32
        };
        let mut words = |count: usize| -> Vec<u8> { (0..count).flat_map(|_| next().to_le_bytes()).collect() };
        let raw = |name: &str, dtype, shape: Vec<usize>, bytes| OwnedRaw { name: name.into(), dtype, shape, bytes };
        let scales = |count: usize, dtype: RawDtype, words: &mut dyn FnMut(usize) -> Vec<u8>| -> Vec<u8> {
            let w = words(count);
            (0..count)
                .flat_map(|i| {
                    let v = 0.001 + (w[4 * i] as f32) / 256.0 * 0.05;
                    match dtype {
                        RawDtype::F32 => v.to_le_bytes().to_vec(),
                        RawDtype::BF16 => f32_to_bf16(v).to_le_bytes().to_vec(),
                        _ => f32_to_f16(v).to_le_bytes().to_vec(),
                    }
                })
                .collect()
        };
        let mut w = QuantWeight::packed("hf", format, [n, k], Vec::new());
        let gs = |g: usize| hf::groups(g, k);
        match format {
            QuantFormat::Awq4 { group } | QuantFormat::Gptq4 { group, .. } => {
                w.data = words(k * n / 8);
                w.scale = Some(raw("scales", RawDtype::F16, vec![gs(group), n], scales(gs(group) * n, RawDtype::F16, &mut words)));
                w.zero = Some(raw("qzeros", RawDtype::I32, vec![gs(group), n / 8], words(gs(group) * n / 8)));
            }
            QuantFormat::PackQuantized4 { group, symmetric } => {
                w.data = words(n * k / 8);
                w.scale = Some(raw("weight_scale", dtype, vec![n, gs(group)], scales(n * gs(group), dtype, &mut words)));
                if !symmetric {
                    w.zero = Some(raw("weight_zero_point", RawDtype::I32, vec![n.div_ceil(8), gs(group)], words(n.div_ceil(8) * gs(group))));
                }
            }
            _ => unreachable!(),
        }
        if let Some(gi) = g_idx {
            w.g_idx = Some(raw("g_idx", RawDtype::I32, vec![k], gi.iter().flat_map(|v| v.to_le_bytes()).collect()));
        }
        w
    }

    /// The plan counts what the upload holds: the layout's size is the plan's arithmetic for
    /// every shape and zero plane, each HF form that tiles takes the zero plane the plan
    /// expects, and the plan's bound is never below the tiled or the stored bytes.
    #[test]
    fn the_plan_counts_the_tiled_bytes_the_upload_holds() {
        use crate::plan::gpu::{q4_tiled_bytes, q4_tiled_layout, quant_device_bytes};
        for (n, k) in [(1, 8), (37, 200), (300, 1152), (16, 2176), (4096, 4096)] {
            for zeros in [false, true] {
                assert_eq!(Q4Tiles::new(n, k, zeros).bytes(), q4_tiled_bytes(n, k, zeros), "[{n}, {k}] zeros {zeros}");
            }
        }
        let (payload, _) = random_q4(24, 256, 5);
        assert_eq!(q4g64_to_tiles(&payload, 24, 256).bytes.len(), quant_device_bytes(QuantFormat::Q4G64F16S, [24, 256], payload.len()));
        let (n, k) = (40, 384);
        for format in [
            QuantFormat::Awq4 { group: 128 },
            QuantFormat::Gptq4 { group: 64, zero_plus_one: true },
            QuantFormat::PackQuantized4 { group: 128, symmetric: false },
            QuantFormat::PackQuantized4 { group: 0, symmetric: true },
        ] {
            let w = random_hf(format, [n, k], RawDtype::F16, None, 11);
            let tiled = hf4_to_tiles(&w).expect("groups of 64-value runs tile");
            assert_eq!(Some(tiled.params[1] != 0), q4_tiled_layout(format), "{format:?}: zero plane");
            let stored = w.data.len() + [&w.scale, &w.zero, &w.g_idx].into_iter().flatten().map(|r| r.bytes.len()).sum::<usize>();
            let bound = quant_device_bytes(format, [n, k], stored);
            assert!(bound >= tiled.bytes.len() && bound >= stored, "{format:?}: bound {bound}, tiled {}, stored {stored}", tiled.bytes.len());
        }
    }

    #[test]
    fn hf_weights_with_groups_of_64_runs_tile_to_their_reference_values() {
        let (n, k) = (40, 384);
        let trivial = |g: usize| Some((0..k).map(|c| if g == 0 { 0 } else { (c / g) as u32 }).collect::<Vec<u32>>());
        let cases = [
            (QuantFormat::Awq4 { group: 128 }, RawDtype::F16, None, ScaleWord::F16),
            (QuantFormat::Awq4 { group: 64 }, RawDtype::F16, None, ScaleWord::F16),
            (QuantFormat::Gptq4 { group: 128, zero_plus_one: true }, RawDtype::F16, None, ScaleWord::F16),
            (QuantFormat::Gptq4 { group: 0, zero_plus_one: false }, RawDtype::F16, None, ScaleWord::F16),
            (QuantFormat::Gptq4 { group: 128, zero_plus_one: false }, RawDtype::F16, trivial(128), ScaleWord::F16),
            (QuantFormat::PackQuantized4 { group: 128, symmetric: false }, RawDtype::BF16, None, ScaleWord::Bf16),
            (QuantFormat::PackQuantized4 { group: 64, symmetric: true }, RawDtype::F16, trivial(64), ScaleWord::F16),
            // Groups of three runs of 64.
            (QuantFormat::PackQuantized4 { group: 192, symmetric: true }, RawDtype::BF16, None, ScaleWord::Bf16),
        ];
        for (i, (f, dtype, g_idx, word)) in cases.into_iter().enumerate() {
            let w = random_hf(f, [n, k], dtype, g_idx, 17 + i as u64);
            let want = dequantize(&w.view()).unwrap();
            let t = to_tiles(&w).unwrap_or_else(|| panic!("{f:?} tiles"));
            let lay = Q4Tiles::new(n, k, w.zero.is_some());
            assert_eq!(t.params, [lay.scale_offset() as i64, lay.zero_offset() as i64, word as i64], "{f:?}");
            assert_eq!(t.bytes.len(), lay.bytes());
            for row in 0..n {
                for col in 0..k {
                    let got = tiled_value_of(&lay, &t.bytes, word, row, col);
                    assert_eq!(got.to_bits(), want[row * k + col].to_bits(), "{f:?} ({row}, {col}): {got} want {}", want[row * k + col]);
                }
            }
        }
        // F32 scales: exact f16 values tile as f16, bf16 values as bf16, others stay as stored.
        let f = QuantFormat::PackQuantized4 { group: 128, symmetric: true };
        let mut w = random_hf(f, [n, k], RawDtype::F32, None, 5);
        let set = |w: &mut QuantWeight, v: &dyn Fn(usize) -> f32| {
            let s = w.scale.as_mut().unwrap();
            s.bytes = (0..s.bytes.len() / 4).flat_map(|i| v(i).to_le_bytes()).collect();
        };
        set(&mut w, &|i| f16_to_f32(f32_to_f16(0.01 + i as f32 * 1e-4)));
        assert_eq!(to_tiles(&w).unwrap().params[2], ScaleWord::F16 as i64);
        set(&mut w, &|i| bf16_to_f32(f32_to_bf16(1e-6 + i as f32 * 1e-7)));
        assert_eq!(to_tiles(&w).unwrap().params[2], ScaleWord::Bf16 as i64);
        set(&mut w, &|i| 0.0123457 + i as f32 * 1e-7);
        assert!(to_tiles(&w).is_none(), "F32 scales beyond f16 and bf16 keep the stored layout");
        // Groups that are not runs of 64, and act-order g_idx, keep the stored layout.
        assert!(to_tiles(&random_hf(QuantFormat::Awq4 { group: 32 }, [n, k], RawDtype::F16, None, 6)).is_none());
        let mut act: Vec<u32> = (0..k).map(|c| (c / 128) as u32).collect();
        act.swap(0, 200);
        assert!(to_tiles(&random_hf(QuantFormat::Gptq4 { group: 128, zero_plus_one: true }, [n, k], RawDtype::F16, Some(act), 7)).is_none());
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
        let lay = Q4Tiles::new(32, 256, false);
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
            let lay = Q4Tiles::new(n, k, false);
            let tiled = q4g64_to_tiles(&payload, n, k).bytes;
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
        let lay = Q4Tiles::new(n, k, false);
        let tiled = q4g64_to_tiles(&payload, n, k).bytes;
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
