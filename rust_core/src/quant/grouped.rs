//! The NInfer grouped signed-integer formats `Q4G64_F16S`, `Q5G64_F16S`, `Q6G64_F16S` and
//! `W8G32_F16S` in the `row-split-k128-v1` layout.
//!
//! Numbers: each row of `[N, K]` is cut into groups of `G` consecutive values (64, or 32 for W8);
//! a group holds one binary16 scale `s` (a multiplier, `+0` or finite positive) and `G` signed
//! two's-complement codes `q` (Q4 [-8,7], Q5 [-16,15], Q6 [-32,31], W8 [-127,127]); the value is
//! `f32(s) * f32(q)`, rounded once to binary32 (exact here).
//!
//! Bytes: `K` is padded to `K_pad = align_up(K, 128)`, so a row has `K_pad / G` physical groups
//! (padding lanes have code 0; wholly padded groups have scale 0). The payload is three planes,
//! each in row-major group order: the base plane (low 4 bits of two lanes per byte, even lane in
//! the low nibble; W8 one byte per lane), zero padding to 256 bytes, the high-bit plane (Q5: bit 4
//! of each lane, Q6: bits 4 and 5, packed as a little-endian bit stream lane after lane; 8 / 16
//! bytes per group), zero padding to 256 bytes, then the little-endian binary16 scales. The
//! payload ends right after the scales. A row is three spans, one in each plane.
//!
//! Encoder (`MAXABS_F16_RECIP_RNE_V1`, the canonical NInfer one): `scale = f16(f32(amax / qmax))`
//! (`0x0001` when that underflows to zero, failure when it overflows); `inv = f32(1 / scale)`;
//! `q = clamp(round_ties_even(f32(x * inv)), qmin, qmax)`; an all-zero group stores scale +0.

use super::scalars::{f16_to_f32, f32_to_f16};
use super::QuantFormat;

/// Geometry of one grouped format: code width, group size, and base / high bytes per group.
#[derive(Clone, Copy, Debug)]
pub struct Grouped {
    pub bits: u32,
    pub group: usize,
    pub base_bytes: usize,
    pub high_bytes: usize,
}

impl Grouped {
    /// The geometry of a grouped format; `None` for every other format.
    pub fn of(format: QuantFormat) -> Option<Grouped> {
        let (bits, group, high_bytes) = match format {
            QuantFormat::Q4G64F16S => (4, 64, 0),
            QuantFormat::Q5G64F16S => (5, 64, 8),
            QuantFormat::Q6G64F16S => (6, 64, 16),
            QuantFormat::W8G32F16S => (8, 32, 0),
            _ => return None,
        };
        Some(Grouped { bits, group, base_bytes: 32, high_bytes })
    }

    /// Largest code (the encoder's scale denominator).
    pub fn qmax(&self) -> i32 {
        if self.bits == 8 {
            127
        } else {
            (1 << (self.bits - 1)) - 1
        }
    }

    /// Smallest code the encoder emits (W8 excludes -128).
    pub fn qmin(&self) -> i32 {
        if self.bits == 8 {
            -127
        } else {
            -(1 << (self.bits - 1))
        }
    }

    /// Physical groups per row (`align_up(K, 128) / G`).
    pub fn groups_per_row(&self, k: usize) -> usize {
        k.div_ceil(128) * 128 / self.group
    }

    /// Byte offsets of the three planes and the total payload size for `[n, k]`.
    pub fn planes(&self, n: usize, k: usize) -> Planes {
        let groups = n * self.groups_per_row(k);
        let base = groups * self.base_bytes;
        let high = groups * self.high_bytes;
        let high_offset = base.div_ceil(256) * 256;
        let scale_offset = high_offset + high.div_ceil(256) * 256;
        Planes { high_offset, scale_offset, payload: scale_offset + groups * 2 }
    }

    /// Signed code of lane `i` of the group whose base bytes start at `base` and high bytes at
    /// `high`.
    pub(crate) fn code(&self, payload: &[u8], base: usize, high: usize, i: usize) -> i32 {
        if self.bits == 8 {
            return payload[base + i] as i8 as i32;
        }
        let low = (payload[base + i / 2] >> ((i % 2) * 4)) as u32 & 0x0f;
        let hb = self.bits - 4;
        let hi = if hb == 0 {
            0
        } else {
            let bit = i * hb as usize;
            (payload[high + bit / 8] as u32 >> (bit % 8)) & ((1 << hb) - 1)
        };
        let u = low | (hi << 4);
        // Two's complement of width `bits`.
        if u >= 1 << (self.bits - 1) {
            u as i32 - (1 << self.bits)
        } else {
            u as i32
        }
    }
}

/// Plane offsets of one `row-split-k128-v1` payload.
#[derive(Clone, Copy, Debug)]
pub struct Planes {
    pub high_offset: usize,
    pub scale_offset: usize,
    pub payload: usize,
}

/// Scale word of (row, group), for validation.
pub fn scale_word(g: &Grouped, payload: &[u8], n: usize, k: usize, row: usize, group: usize) -> u16 {
    let p = g.planes(n, k);
    let idx = row * g.groups_per_row(k) + group;
    u16::from_le_bytes([payload[p.scale_offset + 2 * idx], payload[p.scale_offset + 2 * idx + 1]])
}

/// Signed codes of (row, group), lanes `0..G`.
pub fn group_codes<'a>(g: &Grouped, payload: &'a [u8], n: usize, k: usize, row: usize, group: usize) -> impl Iterator<Item = i32> + 'a {
    let idx = row * g.groups_per_row(k) + group;
    let (base, high) = (idx * g.base_bytes, g.planes(n, k).high_offset + idx * g.high_bytes);
    let g = *g;
    (0..g.group).map(move |i| g.code(payload, base, high, i))
}

/// Decode rows `rows` of a validated payload into `out` (`rows.len() * k` values).
pub fn decode_rows(g: &Grouped, payload: &[u8], n: usize, k: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let p = g.planes(n, k);
    let gpr = g.groups_per_row(k);
    for (r, row) in rows.enumerate() {
        let dst = &mut out[r * k..(r + 1) * k];
        for gi in 0..k.div_ceil(g.group) {
            let idx = row * gpr + gi;
            let s = f16_to_f32(u16::from_le_bytes([payload[p.scale_offset + 2 * idx], payload[p.scale_offset + 2 * idx + 1]]));
            let base = idx * g.base_bytes;
            let high = p.high_offset + idx * g.high_bytes;
            let start = gi * g.group;
            for i in 0..g.group.min(k - start) {
                dst[start + i] = s * g.code(payload, base, high, i) as f32;
            }
        }
    }
}

/// Rows encoded per parallel task.
const ENCODE_ROWS: usize = 16;

/// The base, high and scale plane spans of a run of rows.
type PlaneSpans = (Vec<u8>, Vec<u8>, Vec<u8>);

/// The canonical encoder over a row-major `[n, k]` matrix of finite values (the caller refuses
/// non-finite ones), rows in parallel. Fails with the (row, group) whose scale overflows
/// binary16.
pub fn encode(g: &Grouped, values: &[f32], n: usize, k: usize) -> Result<Vec<u8>, String> {
    use rayon::prelude::*;
    let p = g.planes(n, k);
    let gpr = g.groups_per_row(k);
    let chunks: Vec<PlaneSpans> = (0..n.div_ceil(ENCODE_ROWS))
        .into_par_iter()
        .map(|c| encode_rows(g, values, k, c * ENCODE_ROWS..((c + 1) * ENCODE_ROWS).min(n)))
        .collect::<Result<_, String>>()?;
    let mut out = vec![0u8; p.payload];
    let (mut base, mut high, mut scale) = (0, p.high_offset, p.scale_offset);
    for (b, h, s) in chunks {
        out[base..base + b.len()].copy_from_slice(&b);
        out[high..high + h.len()].copy_from_slice(&h);
        out[scale..scale + s.len()].copy_from_slice(&s);
        (base, high, scale) = (base + b.len(), high + h.len(), scale + s.len());
    }
    debug_assert_eq!(scale, p.payload);
    debug_assert_eq!(base, n * gpr * g.base_bytes);
    Ok(out)
}

/// The base, high and scale plane spans of rows `rows`.
fn encode_rows(g: &Grouped, values: &[f32], k: usize, rows: std::ops::Range<usize>) -> Result<PlaneSpans, String> {
    let gpr = g.groups_per_row(k);
    let groups = rows.len() * gpr;
    let (mut base, mut high, mut scales) = (vec![0u8; groups * g.base_bytes], vec![0u8; groups * g.high_bytes], vec![0u8; groups * 2]);
    let qmax = g.qmax();
    let qmin = g.qmin();
    let mut codes = vec![0i32; g.group];
    for (r, row) in rows.enumerate() {
        for gi in 0..k.div_ceil(g.group) {
            let start = gi * g.group;
            let xs = &values[row * k + start..row * k + (start + g.group).min(k)];
            let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            codes.iter_mut().for_each(|c| *c = 0);
            let mut scale_bits = 0u16;
            if amax != 0.0 {
                scale_bits = f32_to_f16(amax / qmax as f32);
                if scale_bits == 0 {
                    scale_bits = 0x0001;
                }
                let scale = f16_to_f32(scale_bits);
                if !scale.is_finite() {
                    return Err(format!("row {row} group {gi}: max |x| {amax} needs a scale beyond binary16"));
                }
                let inv = 1.0f32 / scale;
                for (c, x) in codes.iter_mut().zip(xs) {
                    *c = ((x * inv).round_ties_even() as i32).clamp(qmin, qmax);
                }
            }
            let idx = r * gpr + gi;
            scales[2 * idx..2 * idx + 2].copy_from_slice(&scale_bits.to_le_bytes());
            let b0 = idx * g.base_bytes;
            let h0 = idx * g.high_bytes;
            for (i, &q) in codes.iter().enumerate() {
                if g.bits == 8 {
                    base[b0 + i] = q as i8 as u8;
                    continue;
                }
                let u = (q as u32) & ((1 << g.bits) - 1);
                base[b0 + i / 2] |= ((u & 0x0f) as u8) << ((i % 2) * 4);
                let hb = (g.bits - 4) as usize;
                if hb > 0 {
                    let bit = i * hb;
                    high[h0 + bit / 8] |= (((u >> 4) & ((1 << hb) - 1)) as u8) << (bit % 8);
                }
            }
        }
    }
    Ok((base, high, scales))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plane_offsets_match_the_layout_example() {
        // Q5 [2, 130]: K_pad 256, 4 groups a row, base 256, high 64, scales 16 bytes.
        let g = Grouped::of(QuantFormat::Q5G64F16S).unwrap();
        let p = g.planes(2, 130);
        assert_eq!((p.high_offset, p.scale_offset, p.payload), (256, 512, 528));
    }

    #[test]
    fn codes_decode_as_twos_complement_with_split_high_bits() {
        for fmt in [QuantFormat::Q4G64F16S, QuantFormat::Q5G64F16S, QuantFormat::Q6G64F16S, QuantFormat::W8G32F16S] {
            let g = Grouped::of(fmt).unwrap();
            // One row whose codes walk the whole legal interval, scale 1.0.
            let k = 128;
            let vals: Vec<f32> = (0..k).map(|i| (g.qmin() + (i as i32 % (g.qmax() - g.qmin() + 1))) as f32).collect();
            let bytes = encode(&g, &vals, 1, k).unwrap();
            let mut out = vec![0.0; k];
            decode_rows(&g, &bytes, 1, k, 0..1, &mut out);
            // amax / qmax is not 1 when qmin's magnitude wins; decode must equal scale * code.
            for gi in 0..k / g.group {
                let s = f16_to_f32(scale_word(&g, &bytes, 1, k, 0, gi));
                let inv = 1.0 / s;
                for i in 0..g.group {
                    let x = vals[gi * g.group + i];
                    let q = ((x * inv).round_ties_even() as i32).clamp(g.qmin(), g.qmax());
                    assert_eq!(out[gi * g.group + i], s * q as f32, "{fmt:?} lane {i}");
                }
            }
        }
    }
}
