//! The formats whose decode GEMV is the chunk GEMV of cuda/quant_chunk.cuh (GGUF Q4_K and
//! IQ4_XS, NVFP4: 16-byte weight loads, scales factored out of each group's sum) and its grid
//! rule: QC_ROWS output rows a warp. The tests emulate its chunk decoders on the CPU, word for
//! word (the same masks, magic exponents, prmt table lookups and chunk-to-K mapping), and
//! check every value of every chunk against the CPU decoders of rust_core/src/quant.

use crate::quant::QuantFormat;

/// Output rows a warp of the chunk GEMV owns (quant_chunk.cuh QC_ROWS).
pub const QC_ROWS: usize = 2;

/// Whether `format`'s GEMV (in its stored layout) is the chunk GEMV.
pub fn chunk_gemv(format: QuantFormat) -> bool {
    matches!(format, QuantFormat::GgufQ4K | QuantFormat::GgufIq4Xs | QuantFormat::Nvfp4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::KernelFamily;
    use crate::quant::gguf::{decode_block, KVALUES_IQ4NL};
    use crate::quant::scalars::{e2m1_to_f32, e4m3_to_f32, f16_to_f32};
    use crate::quant::{dequantize, nvfp4, quantize, QuantWeight};

    fn word(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// PTX prmt.b32 in its default mode: byte i of the result is byte (sel nibble i) & 7 of
    /// {b, a}, replaced by its sign replicated where that nibble's bit 3 is set.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let bytes = ((b as u64) << 32 | a as u64).to_le_bytes();
        (0..4).fold(0u32, |acc, i| {
            let n = (sel >> (4 * i)) & 15;
            let mut byte = bytes[(n & 7) as usize];
            if n & 8 != 0 {
                byte = if byte & 0x80 != 0 { 0xff } else { 0 };
            }
            acc | (byte as u32) << (8 * i)
        })
    }

    /// qc_field: the field of `w` under `mask` OR-ed into `magic`, less `magic` as a float.
    fn field(w: u32, mask: u32, magic: u32) -> f32 {
        f32::from_bits((w & mask) | magic) - f32::from_bits(magic)
    }

    /// qc_bytes_less128.
    fn bytes_less128(r: u32) -> [f32; 4] {
        [
            f32::from_bits((r & 0xff) | 0x4b00_0000) - 8388736.0,
            f32::from_bits((r & 0xff00) | 0x4700_0000) - 32896.0,
            f32::from_bits(prmt(r, 0x4b00_0000, 0x7442)) - 8388736.0,
            f32::from_bits(prmt(r, 0x4b00_0000, 0x7443)) - 8388736.0,
        ]
    }

    /// qc_lut16.
    fn lut16(w: u32, t: [u32; 4]) -> (u32, u32) {
        let s = w & 0x7777_7777;
        let h = ((w >> 1) & 0x4444_4444) | 0x3210_3210;
        let r0 = prmt(prmt(t[0], t[1], s), prmt(t[2], t[3], s), h);
        let (s1, h1) = (s >> 16, h >> 16);
        let r1 = prmt(prmt(t[0], t[1], s1), prmt(t[2], t[3], s1), h1);
        (r0, r1)
    }

    /// The words of a `#define NAME a, b, c, d` in `src`.
    fn define_words(src: &str, name: &str) -> [u32; 4] {
        let line = src.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap_or_else(|| panic!("no #define {name}"));
        let words: Vec<u32> = line[format!("#define {name} ").len()..]
            .split(',')
            .map(|t| u32::from_str_radix(t.trim().trim_start_matches("0x").trim_end_matches('u'), 16).unwrap())
            .collect();
        words.try_into().unwrap()
    }

    /// Deterministic bytes (xorshift).
    fn bytes(seed: u64, count: usize) -> Vec<u8> {
        let mut s = seed;
        (0..count)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// Random GGUF blocks whose f16 fields at `d_offsets` are finite.
    fn gguf_blocks(seed: u64, blocks: usize, bb: usize, d_offsets: &[usize]) -> Vec<u8> {
        let mut data = bytes(seed, blocks * bb);
        for b in 0..blocks {
            for &o in d_offsets {
                // Exponent below the maximum: finite.
                data[b * bb + o + 1] &= 0xbb;
            }
        }
        data
    }

    /// chunk_q4_k on one 144-byte block: (K position in the block, value) for chunk c = 0..7,
    /// the value as the CPU forms it from the kernel's factors: f32(d1 * q) - m1.
    fn q4k_chunk(b: &[u8], c: usize) -> Vec<(usize, f32)> {
        let (hx, hy, hz, hw) = (word(b, 0), word(b, 4), word(b, 8), word(b, 12));
        let jp = c >> 1;
        let d = f16_to_f32((hx & 0xffff) as u16);
        let dmin = f16_to_f32((hx >> 16) as u16);
        let sc = if jp < 2 { hy & 0x3f3f_3f3f } else { (hw & 0x0f0f_0f0f) | ((hy >> 2) & 0x3030_3030) };
        let mn = if jp < 2 { hz & 0x3f3f_3f3f } else { ((hw >> 4) & 0x0f0f_0f0f) | ((hz >> 2) & 0x3030_3030) };
        let sh = (jp & 1) * 16;
        let da = d * field(sc >> sh, 0xff, 0x4b00_0000);
        let ma = dmin * field(mn >> sh, 0xff, 0x4b00_0000);
        let db = d * field(sc >> (sh + 8), 0xff, 0x4b00_0000);
        let mb = dmin * field(mn >> (sh + 8), 0xff, 0x4b00_0000);
        let mut v = [0.0f32; 32];
        for t in 0..4 {
            let w = word(b, 16 + 16 * c + 4 * t);
            let wh = w >> 16;
            v[4 * t] = field(w, 0x0000_000f, 0x4b00_0000);
            v[16 + 4 * t] = field(w, 0x0000_00f0, 0x4900_0000);
            v[4 * t + 1] = field(w, 0x0000_0f00, 0x4700_0000);
            v[16 + 4 * t + 1] = field(w, 0x0000_f000, 0x4500_0000);
            v[4 * t + 2] = field(w, 0x000f_0000, 0x4300_0000);
            v[16 + 4 * t + 2] = field(wh, 0x0000_00f0, 0x4900_0000);
            v[4 * t + 3] = field(wh, 0x0000_0f00, 0x4700_0000);
            v[16 + 4 * t + 3] = field(wh, 0x0000_f000, 0x4500_0000);
        }
        // chunk_q4_k::x_runs within the block.
        let x0 = (c >> 1) * 64 + (c & 1) * 16;
        let x1 = x0 + 32;
        (0..16).map(|i| (x0 + i, da * v[i] - ma)).chain((0..16).map(|i| (x1 + i, db * v[16 + i] - mb))).collect()
    }

    /// chunk_iq4_xs on one 136-byte block, chunk c = 0..7: f32(dl * kvalue).
    fn iq4xs_chunk(b: &[u8], c: usize, table: [u32; 4]) -> Vec<(usize, f32)> {
        let (hx, hy) = (word(b, 0), word(b, 4));
        let d = f16_to_f32((hx & 0xffff) as u16);
        let ls = ((hy >> (4 * c)) & 15) | (((hx >> (16 + 2 * c)) & 3) << 4);
        let dl = d * (ls as i32 - 32) as f32;
        let mut v = [0.0f32; 32];
        for t in 0..4 {
            let (r0, r1) = lut16(word(b, 8 + 16 * c + 4 * t), table);
            let [a0, a1, a2, a3] = bytes_less128(r0);
            let [b0, b1, b2, b3] = bytes_less128(r1);
            (v[4 * t], v[16 + 4 * t], v[4 * t + 1], v[16 + 4 * t + 1]) = (a0, a1, a2, a3);
            (v[4 * t + 2], v[16 + 4 * t + 2], v[4 * t + 3], v[16 + 4 * t + 3]) = (b0, b1, b2, b3);
        }
        let x0 = 32 * c;
        (0..32).map(|i| (x0 + i, dl * v[i])).collect()
    }

    /// The 8 chunks of a 256-value super-block (`chunk(c)`: (position, value) pairs) cover
    /// every position once, each value the CPU decoder's `want` bit for bit.
    fn each_value_once(want: &[f32; 256], chunk: impl Fn(usize) -> Vec<(usize, f32)>) {
        let mut seen = [false; 256];
        for c in 0..8 {
            for (pos, v) in chunk(c) {
                assert!(!seen[pos], "position {pos} twice");
                seen[pos] = true;
                assert_eq!(v.to_bits(), want[pos].to_bits(), "chunk {c} position {pos}: {v:e}, CPU {:e}", want[pos]);
            }
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn q4_k_chunks_decode_every_value_as_the_cpu_decoder() {
        let blocks = 64;
        let data = gguf_blocks(1, blocks, 144, &[0, 2]);
        for blk in data.chunks(144) {
            let mut want = [0.0f32; 256];
            decode_block(QuantFormat::GgufQ4K, blk, &mut want);
            each_value_once(&want, |c| q4k_chunk(blk, c));
        }
    }

    #[test]
    fn iq4_xs_chunks_decode_every_value_as_the_cpu_decoder() {
        let table = define_words(KernelFamily::QuantGguf.source(), "IQ4NL_BIASED_WORDS");
        for (i, kv) in KVALUES_IQ4NL.iter().enumerate() {
            assert_eq!(table[i / 4].to_le_bytes()[i % 4] as i32, *kv as i32 + 128, "entry {i}");
        }
        let data = gguf_blocks(2, 64, 136, &[0]);
        for blk in data.chunks(136) {
            let mut want = [0.0f32; 256];
            decode_block(QuantFormat::GgufIq4Xs, blk, &mut want);
            each_value_once(&want, |c| iq4xs_chunk(blk, c, table));
        }
    }

    /// chunk_nvfp4 over a one-part weight: each chunk's codes (16 bytes at 16 ch of the row),
    /// its two scale bytes (Row's scale address plus the chunk's offset) and the table lookup,
    /// the value formed as f32(f32(0.5 * v) * s) / d: the CPU's e2m1(c) * s / d (a zero of
    /// either sign as a zero).
    #[test]
    fn nvfp4_chunks_decode_every_value_as_the_cpu_decoder() {
        let table = define_words(KernelFamily::QuantNinfer.source(), "E2M1_BIASED_WORDS");
        for i in 0..16u8 {
            assert_eq!(table[(i / 4) as usize].to_le_bytes()[(i % 4) as usize] as f32 - 128.0, 2.0 * e2m1_to_f32(i), "entry {i}");
        }
        let (n, k) = (256, 192);
        let values: Vec<f32> = bytes(3, n * k).iter().map(|&b| (b as f32 - 127.5) / 64.0).collect();
        let w = QuantWeight::packed("nvfp4", QuantFormat::Nvfp4, [n, k], quantize(QuantFormat::Nvfp4, "nvfp4", &values, [n, k]).unwrap());
        let want = dequantize(&w.view()).unwrap();
        let p = &w.data;
        let rows = n;
        let d = f32::from_le_bytes(p[rows * k / 2 + rows * k / 16..][..4].try_into().unwrap());
        assert_eq!(nvfp4::planes(n, k).0, rows * k / 2, "the kernels read an unpadded scale plane");
        for r in 0..n {
            let inner = r % 128;
            let codes = r * k / 2;
            let scales = rows * k / 2 + (r / 128) * (k / 64) * 512 + (inner % 32) * 16 + (inner / 32) * 4;
            for ch in 0..k / 32 {
                let at = scales + (ch >> 1) * 512 + (ch & 1) * 2;
                let s = [e4m3_to_f32(p[at]).unwrap(), e4m3_to_f32(p[at + 1]).unwrap()];
                for t in 0..4 {
                    let (r0, r1) = lut16(word(p, codes + 16 * ch + 4 * t), table);
                    let v: Vec<f32> = bytes_less128(r0).into_iter().chain(bytes_less128(r1)).collect();
                    for (e, v) in v.iter().enumerate() {
                        let pos = 32 * ch + 8 * t + e;
                        let got = (0.5 * v) * s[t >> 1] / d;
                        let cpu = want[r * k + pos];
                        // The table's -0 code is +0 (the same in any sum).
                        let same = if cpu == 0.0 { got == 0.0 } else { got.to_bits() == cpu.to_bits() };
                        assert!(same, "row {r} position {pos}: {got:e}, CPU {cpu:e}");
                    }
                }
            }
        }
    }

    #[test]
    fn prmt_emulation_selects_bytes_and_replicates_signs() {
        assert_eq!(prmt(0x4433_2211, 0x8877_6655, 0x3210), 0x4433_2211);
        assert_eq!(prmt(0x4433_2211, 0x8877_6655, 0x7654), 0x8877_6655);
        assert_eq!(prmt(0x4433_2211, 0x8877_6655, 0x0c47), 0x1100_5588);
        assert_eq!(prmt(0x4433_2211, 0x8877_6655, 0x0f47), 0x11ff_5588);
    }
}
