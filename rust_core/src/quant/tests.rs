//! Format tests: each decoder against its definition on packed random codes and scales (edge
//! scale words included), encoders on edge inputs, load-time refusals, and the tiled matmul
//! against dequantize + a plain matmul.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::scalars::{bf16_to_f32, e4m3_to_f32, f16_to_f32, f32_to_f16};
use super::*;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn normal_ish(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (r.random::<f32>() - 0.5) * 2.0 * scale * if r.random::<f32>() < 0.02 { 8.0 } else { 1.0 }).collect()
}

const GROUPED: [QuantFormat; 4] = [QuantFormat::W8G32F16S, QuantFormat::Q4G64F16S, QuantFormat::Q5G64F16S, QuantFormat::Q6G64F16S];

/// Pack logical codes and scales into `row-split-k128-v1`, written from the layout text: base
/// plane of low nibbles (or bytes), a lane-major high-bit stream, then binary16 scales.
fn pack_row_split(bits: u32, group: usize, n: usize, k: usize, codes: &[i32], scales: &[u16]) -> Vec<u8> {
    let k_pad = k.div_ceil(128) * 128;
    let gpr = k_pad / group;
    let logical = k.div_ceil(group);
    let high_per_group = group * (bits as usize - 4).min(4) / 8 * usize::from(bits < 8);
    let base_len = n * gpr * 32;
    let high_len = n * gpr * high_per_group;
    let high_off = base_len.div_ceil(256) * 256;
    let scale_off = high_off + high_len.div_ceil(256) * 256;
    let mut out = vec![0u8; scale_off + n * gpr * 2];
    for row in 0..n {
        for g in 0..gpr {
            let idx = row * gpr + g;
            let s = if g < logical { scales[row * logical + g] } else { 0 };
            out[scale_off + 2 * idx..scale_off + 2 * idx + 2].copy_from_slice(&s.to_le_bytes());
            let mut stream_bit = 0usize;
            for lane in 0..group {
                let col = g * group + lane;
                let q = if col < k { codes[row * k + col] } else { 0 };
                let u = (q as u32) & ((1u32 << bits) - 1);
                if bits == 8 {
                    out[idx * 32 + lane] = u as u8;
                    continue;
                }
                out[idx * 32 + lane / 2] |= ((u & 15) as u8) << (4 * (lane % 2));
                for b in 4..bits {
                    let byte = high_off + idx * high_per_group + stream_bit / 8;
                    out[byte] |= (((u >> b) & 1) as u8) << (stream_bit % 8);
                    stream_bit += 1;
                }
            }
        }
    }
    out
}

#[test]
fn grouped_formats_decode_scale_times_code_for_edge_scales() {
    let mut r = rng(1);
    for fmt in GROUPED {
        let g = grouped::Grouped::of(fmt).unwrap();
        // K = 200 leaves a partial logical group and whole padding groups.
        let (n, k): (usize, usize) = (5, 200);
        let logical = k.div_ceil(g.group);
        let edge = [0x0000u16, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x3c00];
        let scales: Vec<u16> = (0..n * logical)
            .map(|i| if i < edge.len() { edge[i] } else { f32_to_f16(r.random::<f32>() * 0.1 + 1e-4) })
            .collect();
        let codes: Vec<i32> = (0..n * k)
            .map(|i| if scales[(i / k) * logical + (i % k) / g.group] == 0 { 0 } else { r.random_range(g.qmin()..=g.qmax()) })
            .collect();
        let bytes = pack_row_split(g.bits, g.group, n, k, &codes, &scales);
        let t = QuantTensor::packed("w", fmt, [n, k], &bytes);
        let out = dequantize(&t).unwrap();
        for i in 0..n * k {
            let s = f16_to_f32(scales[(i / k) * logical + (i % k) / g.group]);
            assert_eq!(out[i].to_bits(), (s * codes[i] as f32).to_bits(), "{fmt:?} element {i}");
        }
    }
}

#[test]
fn grouped_encoder_is_the_canonical_maxabs_reciprocal_one() {
    let mut r = rng(2);
    for fmt in GROUPED {
        let g = grouped::Grouped::of(fmt).unwrap();
        let (n, k): (usize, usize) = (3, 160);
        let x = normal_ish(&mut r, n * k, 0.05);
        let bytes = quantize(fmt, "w", &x, [n, k]).unwrap();
        let w = dequantize(&QuantTensor::packed("w", fmt, [n, k], &bytes)).unwrap();
        for row in 0..n {
            for gi in 0..k.div_ceil(g.group) {
                let cols = gi * g.group..((gi + 1) * g.group).min(k);
                let amax = cols.clone().map(|c| x[row * k + c].abs()).fold(0.0f32, f32::max);
                let s = f16_to_f32(f32_to_f16(amax / g.qmax() as f32));
                let inv = 1.0f32 / s;
                for c in cols {
                    let q = ((x[row * k + c] * inv).round_ties_even() as i32).clamp(g.qmin(), g.qmax());
                    assert_eq!(w[row * k + c], s * q as f32, "{fmt:?} [{row}, {c}]");
                }
            }
        }
    }
}

#[test]
fn rows_encode_independently_of_the_parallel_split() {
    let mut r = rng(21);
    let (n, k) = (37, 192);
    let x = normal_ish(&mut r, n * k, 0.3);
    for fmt in GROUPED.into_iter().chain([QuantFormat::Fp8E4m3fnRowBf16s]) {
        let all = dequantize(&QuantTensor::packed("w", fmt, [n, k], &quantize(fmt, "w", &x, [n, k]).unwrap())).unwrap();
        for row in [0, 15, 16, 17, 36] {
            let one = quantize(fmt, "w", &x[row * k..(row + 1) * k], [1, k]).unwrap();
            let w = dequantize(&QuantTensor::packed("w", fmt, [1, k], &one)).unwrap();
            assert_eq!(&all[row * k..(row + 1) * k], &w[..], "{fmt:?} row {row}");
        }
    }
}

#[test]
fn quantize_edge_values_zeros_max_and_subnormal_scales() {
    for fmt in GROUPED {
        let g = grouped::Grouped::of(fmt).unwrap();
        let k = 128;
        // Zeros: scale +0 and zero codes, decoded as zeros.
        let bytes = quantize(fmt, "w", &vec![0.0; k], [1, k]).unwrap();
        assert!(bytes.iter().all(|&b| b == 0), "{fmt:?}: an all-zero row is all-zero bytes");
        // Largest scale: amax = 65504 * qmax gives scale word 0x7bff; beyond binary16 is refused.
        let mut x = vec![1.0f32; k];
        x[3] = 65504.0 * g.qmax() as f32;
        let bytes = quantize(fmt, "w", &x, [1, k]).unwrap();
        assert_eq!(grouped::scale_word(&g, &bytes, 1, k, 0, 0), 0x7bff);
        x[3] = 1e30;
        let e = quantize(fmt, "big.weight", &x, [1, k]).unwrap_err().to_string();
        assert!(e.contains("big.weight") && e.contains("binary16"), "{e}");
        // Subnormal scales: a tiny group keeps a subnormal scale; one below 2^-24 gets 0x0001.
        let tiny: Vec<f32> = (0..k).map(|i| (i as f32 - 64.0) * 1e-8).collect();
        let bytes = quantize(fmt, "w", &tiny, [1, k]).unwrap();
        let s = grouped::scale_word(&g, &bytes, 1, k, 0, 0);
        assert!(s > 0 && s < 0x0400, "{fmt:?}: subnormal scale word {s:#06x}");
        let w = dequantize(&QuantTensor::packed("w", fmt, [1, k], &bytes)).unwrap();
        for (a, b) in tiny.iter().zip(&w) {
            assert!((a - b).abs() <= f16_to_f32(s) * 0.5 + 1e-12, "{fmt:?}: {a} vs {b}");
        }
        let bytes = quantize(fmt, "w", &vec![1e-12; k], [1, k]).unwrap();
        assert_eq!(grouped::scale_word(&g, &bytes, 1, k, 0, 0), 0x0001);
    }
}

#[test]
fn quantize_refuses_nan_and_infinity_naming_the_tensor() {
    for mode in QUANTIZE_MODES {
        let fmt = QuantizeMode::parse(mode).unwrap().format();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![0.5f32; 128 * 64];
            x[64 + 7] = bad;
            let e = quantize(fmt, "layers.0.mlp.up_proj.weight", &x, [128, 64]).unwrap_err().to_string();
            assert!(e.contains("layers.0.mlp.up_proj.weight") && e.contains("[1, 7]") && e.contains(fmt.name()), "{e}");
        }
    }
    assert!(QuantizeMode::parse("q3").unwrap_err().to_string().contains("w8, q4, q5, q6, fp8, nvfp4"));
}

#[test]
fn fp8_row_decodes_code_times_row_scale_and_encodes_to_nearest() {
    let mut r = rng(3);
    let (n, k) = (4, 300);
    let mut x = normal_ish(&mut r, n * k, 2.0);
    x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
    x[2 * k..3 * k].iter_mut().for_each(|v| *v *= 1e-40);
    let bytes = quantize(QuantFormat::Fp8E4m3fnRowBf16s, "w", &x, [n, k]).unwrap();
    let w = dequantize(&QuantTensor::packed("w", QuantFormat::Fp8E4m3fnRowBf16s, [n, k], &bytes)).unwrap();
    assert_eq!(fp8_row::scale_word(&bytes, n, k, 1), 0, "all-zero row keeps scale +0");
    for row in 0..n {
        let s = bf16_to_f32(fp8_row::scale_word(&bytes, n, k, row));
        for c in 0..k {
            let code = bytes[row * k + c];
            assert_eq!(w[row * k + c], e4m3_to_f32(code).unwrap() * s);
            if s > 0.0 {
                // Nearest: no other finite E4M3 word is closer to x / s.
                let t = x[row * k + c] / s;
                let d = (e4m3_to_f32(code).unwrap() - t).abs();
                for other in 0..=255u8 {
                    if let Some(v) = e4m3_to_f32(other) {
                        assert!((v - t).abs() >= d || t.abs() > 448.0, "row {row} col {c}: {t} coded {code:#04x}, {other:#04x} closer");
                    }
                }
            }
        }
    }
}

#[test]
fn nvfp4_decodes_code_times_scale_over_divisor() {
    let mut r = rng(4);
    let (n, k) = (256, 128);
    let mut x = normal_ish(&mut r, n * k, 1.0);
    x[0..16].iter_mut().for_each(|v| *v = 0.0);
    let bytes = quantize(QuantFormat::Nvfp4, "w", &x, [n, k]).unwrap();
    let w = dequantize(&QuantTensor::packed("w", QuantFormat::Nvfp4, [n, k], &bytes)).unwrap();
    let (scale_off, _, _) = nvfp4::planes(n, k);
    let d_w = nvfp4::divisor(&bytes, n, k);
    assert_eq!(d_w, 2688.0 / x.iter().fold(0.0f32, |m, v| m.max(v.abs())));
    for row in 0..n {
        for c in 0..k {
            let s = e4m3_to_f32(bytes[scale_off + nvfp4::scale_index(row, c / 16, k)]).unwrap();
            let b = bytes[(row * k + c) / 2];
            let code = if c % 2 == 0 { b & 15 } else { b >> 4 };
            assert_eq!(w[row * k + c], scalars::e2m1_to_f32(code) * s / d_w);
            let amax_g = (0..16).map(|i| x[row * k + c / 16 * 16 + i].abs()).fold(0.0f32, f32::max);
            assert!((w[row * k + c] - x[row * k + c]).abs() <= amax_g * 0.2 + 1e-6, "[{row}, {c}]");
        }
    }
    assert!(w[0..16].iter().all(|&v| v == 0.0));
    let e = quantize(QuantFormat::Nvfp4, "w", &vec![1.0; 100 * 64], [100, 64]).unwrap_err().to_string();
    assert!(e.contains("multiple of 128"), "{e}");
}

fn put_f16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

/// Random GGUF blocks with finite (edge and random) f16 super-scales.
pub(super) fn random_gguf(fmt: QuantFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut r = rng(seed);
    let (be, bb) = gguf::block_geometry(fmt).unwrap();
    let mut data: Vec<u8> = (0..n * k / be * bb).map(|_| r.random::<u8>()).collect();
    let fields: &[usize] = match fmt {
        QuantFormat::GgufQ4K | QuantFormat::GgufQ5K => &[0, 2],
        QuantFormat::GgufQ6K => &[208],
        _ => &[0],
    };
    let edge = [0x0000u16, 0x7bff, 0x0001, 0x03ff];
    for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
        for &f in fields {
            let v = if i < edge.len() { edge[i] } else { f32_to_f16(r.random::<f32>() * 0.01) };
            put_f16(blk, f, v);
        }
    }
    data
}

#[test]
fn gguf_rows_are_independent_blocks() {
    for fmt in [QuantFormat::GgufQ8_0, QuantFormat::GgufQ4K, QuantFormat::GgufQ5K, QuantFormat::GgufQ6K, QuantFormat::GgufIq4Xs, QuantFormat::GgufIq3S] {
        let (n, k) = (3, 512);
        let data = random_gguf(fmt, n, k, 5);
        let all = dequantize(&QuantTensor::packed("w", fmt, [n, k], &data)).unwrap();
        let row_bytes = data.len() / n;
        let last = dequantize(&QuantTensor::packed("w", fmt, [1, k], &data[2 * row_bytes..])).unwrap();
        assert_eq!(&all[2 * k..], &last[..], "{fmt:?}");
    }
}

struct HfCase {
    weight: QuantWeight,
    expected: Vec<f32>,
}

fn owned(name: &str, dtype: RawDtype, shape: Vec<usize>, bytes: Vec<u8>) -> Option<OwnedRaw> {
    Some(OwnedRaw { name: name.into(), dtype, shape, bytes })
}

fn words(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16s(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn awq_case(n: usize, k: usize, group: usize, seed: u64) -> HfCase {
    let mut r = rng(seed);
    let gs = k / group;
    let q: Vec<u32> = (0..n * k).map(|_| r.random_range(0..16)).collect(); // q[n][k]
    let z: Vec<u32> = (0..gs * n).map(|_| r.random_range(0..16)).collect(); // z[g][n]
    let s: Vec<u16> = (0..gs * n).map(|_| f32_to_f16(r.random::<f32>() * 0.02)).collect();
    // AutoAWQ's packing: nibble i of a word holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i].
    let order = [0usize, 2, 4, 6, 1, 3, 5, 7];
    let mut qw = vec![0u32; k * n / 8];
    let mut qz = vec![0u32; gs * n / 8];
    for c in 0..n / 8 {
        for (i, &o) in order.iter().enumerate() {
            for kk in 0..k {
                qw[kk * (n / 8) + c] |= q[(8 * c + o) * k + kk] << (4 * i);
            }
            for g in 0..gs {
                qz[g * (n / 8) + c] |= z[g * n + 8 * c + o] << (4 * i);
            }
        }
    }
    let expected = (0..n * k)
        .map(|i| {
            let (row, col) = (i / k, i % k);
            let g = col / group;
            (q[i] as i32 - z[g * n + row] as i32) as f32 * f16_to_f32(s[g * n + row])
        })
        .collect();
    HfCase {
        weight: QuantWeight {
            name: "model.layers.0.mlp.down_proj".into(),
            format: QuantFormat::Awq4 { group },
            shape: [n, k],
            data: words(&qw),
            scale: owned("down_proj.scales", RawDtype::F16, vec![gs, n], f16s(&s)),
            zero: owned("down_proj.qzeros", RawDtype::I32, vec![gs, n / 8], words(&qz)),
            g_idx: None,
        },
        expected,
    }
}

fn gptq_case(n: usize, k: usize, group: usize, seed: u64) -> HfCase {
    let mut r = rng(seed);
    let gs = k / group;
    let q: Vec<u32> = (0..n * k).map(|_| r.random_range(0..16)).collect();
    let z: Vec<u32> = (0..gs * n).map(|_| r.random_range(1..16)).collect();
    let s: Vec<u16> = (0..gs * n).map(|_| f32_to_f16(r.random::<f32>() * 0.02)).collect();
    // Act-order: each input's group is a random one (not k / group).
    let gi: Vec<u32> = (0..k).map(|_| r.random_range(0..gs as u32)).collect();
    let mut qw = vec![0u32; k / 8 * n];
    let mut qz = vec![0u32; gs * n / 8];
    for row in 0..n {
        for col in 0..k {
            qw[(col / 8) * n + row] |= q[row * k + col] << (4 * (col % 8));
        }
        for g in 0..gs {
            // The original GPTQ format stores zero - 1.
            qz[g * (n / 8) + row / 8] |= (z[g * n + row] - 1) << (4 * (row % 8));
        }
    }
    let expected = (0..n * k)
        .map(|i| {
            let (row, col) = (i / k, i % k);
            let g = gi[col] as usize;
            (q[i] as i32 - z[g * n + row] as i32) as f32 * f16_to_f32(s[g * n + row])
        })
        .collect();
    HfCase {
        weight: QuantWeight {
            name: "model.layers.0.self_attn.q_proj".into(),
            format: QuantFormat::Gptq4 { group, zero_plus_one: true },
            shape: [n, k],
            data: words(&qw),
            scale: owned("q_proj.scales", RawDtype::F16, vec![gs, n], f16s(&s)),
            zero: owned("q_proj.qzeros", RawDtype::I32, vec![gs, n / 8], words(&qz)),
            g_idx: owned("q_proj.g_idx", RawDtype::I32, vec![k], words(&gi)),
        },
        expected,
    }
}

fn pack_quantized_case(n: usize, k: usize, group: usize, symmetric: bool, seed: u64) -> HfCase {
    let mut r = rng(seed);
    let gs = k / group;
    let q: Vec<i32> = (0..n * k).map(|_| r.random_range(-8..8)).collect();
    let z: Vec<i32> = (0..n * gs).map(|_| if symmetric { 0 } else { r.random_range(-8..8) }).collect(); // z[n][g]
    let s: Vec<u16> = (0..n * gs).map(|_| half::bf16::from_f32(r.random::<f32>() * 0.02).to_bits()).collect();
    let mut wp = vec![0u32; n * k / 8];
    let mut zp = vec![0u32; n.div_ceil(8) * gs];
    for row in 0..n {
        for col in 0..k {
            wp[row * (k / 8) + col / 8] |= ((q[row * k + col] + 8) as u32) << (4 * (col % 8));
        }
        for g in 0..gs {
            zp[(row / 8) * gs + g] |= ((z[row * gs + g] + 8) as u32) << (4 * (row % 8));
        }
    }
    let expected = (0..n * k)
        .map(|i| {
            let (row, col) = (i / k, i % k);
            let g = col / group;
            (q[i] - z[row * gs + g]) as f32 * bf16_to_f32(s[row * gs + g])
        })
        .collect();
    HfCase {
        weight: QuantWeight {
            name: "model.layers.1.mlp.gate_proj".into(),
            format: QuantFormat::PackQuantized4 { group, symmetric },
            shape: [n, k],
            data: words(&wp),
            scale: owned("gate_proj.weight_scale", RawDtype::BF16, vec![n, gs], f16s(&s)),
            zero: if symmetric { None } else { owned("gate_proj.weight_zero_point", RawDtype::I32, vec![n.div_ceil(8), gs], words(&zp)) },
            g_idx: None,
        },
        expected,
    }
}

fn fp8_block_case(n: usize, k: usize, seed: u64) -> HfCase {
    let mut r = rng(seed);
    let codes: Vec<u8> = (0..n * k).map(|_| loop {
        let c = r.random::<u8>();
        if c & 0x7f != 0x7f {
            break c;
        }
    }).collect();
    let (sn, sk) = (n.div_ceil(128), k.div_ceil(128));
    let s: Vec<f32> = (0..sn * sk).map(|_| r.random::<f32>() * 1e-3).collect();
    let expected = (0..n * k).map(|i| e4m3_to_f32(codes[i]).unwrap() * s[(i / k / 128) * sk + (i % k) / 128]).collect();
    HfCase {
        weight: QuantWeight {
            name: "model.layers.2.mlp.up_proj.weight".into(),
            format: QuantFormat::HfFp8Block { block_n: 128, block_k: 128 },
            shape: [n, k],
            data: codes,
            scale: owned("up_proj.weight_scale_inv", RawDtype::F32, vec![sn, sk], s.iter().flat_map(|v| v.to_le_bytes()).collect()),
            zero: None,
            g_idx: None,
        },
        expected,
    }
}

fn hf_cases() -> Vec<HfCase> {
    vec![
        awq_case(32, 256, 128, 6),
        gptq_case(16, 256, 64, 7),
        pack_quantized_case(20, 256, 128, true, 8),
        pack_quantized_case(20, 256, 32, false, 9),
        fp8_block_case(200, 300, 10),
    ]
}

#[test]
fn hf_formats_decode_their_packing_definitions() {
    for case in hf_cases() {
        let out = dequantize(&case.weight.view()).unwrap();
        for (i, (a, b)) in out.iter().zip(&case.expected).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{:?} element {i}", case.weight.format);
        }
    }
}

fn matmul_reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f32;
            for t in 0..k {
                s += x[i * k + t] * w[j * k + t];
            }
            y[i * n + j] = s;
        }
    }
    y
}

#[test]
fn quant_linear_equals_dequantize_then_matmul() {
    let mut r = rng(11);
    let mut weights: Vec<QuantWeight> = Vec::new();
    let (n, k) = (256, 256);
    let x_src = normal_ish(&mut r, n * k, 0.1);
    for mode in QUANTIZE_MODES {
        let fmt = QuantizeMode::parse(mode).unwrap().format();
        weights.push(QuantWeight::packed("w", fmt, [n, k], quantize(fmt, "w", &x_src, [n, k]).unwrap()));
    }
    for (i, fmt) in [QuantFormat::GgufQ8_0, QuantFormat::GgufQ4K, QuantFormat::GgufQ5K, QuantFormat::GgufQ6K, QuantFormat::GgufIq4Xs, QuantFormat::GgufIq3S]
        .into_iter()
        .enumerate()
    {
        weights.push(QuantWeight::packed("w", fmt, [130, k], random_gguf(fmt, 130, k, 20 + i as u64)));
    }
    weights.extend(hf_cases().into_iter().map(|c| c.weight));
    for w in weights {
        let [n, k] = w.shape;
        let m = 3;
        let x = normal_ish(&mut r, m * k, 1.0);
        let dense = dequantize(&w.view()).unwrap();
        let lin = QuantLinear::new(w).unwrap();
        let y = lin.forward(&x, m).unwrap();
        let want = matmul_reference(&x, &dense, m, n, k);
        for (i, (a, b)) in y.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{:?} output {i}", lin.weight().format);
        }
    }
}

fn refusal(t: &QuantTensor<'_>) -> String {
    validate(t).unwrap_err().to_string()
}

#[test]
fn truncated_payloads_are_refused_naming_the_tensor() {
    for fmt in GROUPED.into_iter().chain([QuantFormat::Fp8E4m3fnRowBf16s, QuantFormat::Nvfp4]) {
        let bytes = quantize(fmt, "w", &vec![0.25; 128 * 128], [128, 128]).unwrap();
        let e = refusal(&QuantTensor::packed("blk.3.ffn_up.weight", fmt, [128, 128], &bytes[..bytes.len() - 1]));
        assert!(e.contains("blk.3.ffn_up.weight") && e.contains("truncated") && e.contains(fmt.name()), "{e}");
    }
    let data = random_gguf(QuantFormat::GgufQ6K, 2, 256, 12);
    let e = refusal(&QuantTensor::packed("blk.0.attn_q.weight", QuantFormat::GgufQ6K, [2, 256], &data[..300]));
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("300 bytes") && e.contains("420"), "{e}");
    let mut awq = awq_case(32, 256, 128, 13).weight;
    awq.data.truncate(100);
    let e = validate(&awq.view()).unwrap_err().to_string();
    assert!(e.contains("down_proj") && e.contains("truncated"), "{e}");
}

#[test]
fn a_group_size_that_does_not_divide_the_row_is_refused() {
    let data = vec![0u8; 144 * 2];
    let e = refusal(&QuantTensor::packed("blk.1.ffn_down.weight", QuantFormat::GgufQ4K, [1, 320], &data));
    assert!(e.contains("blk.1.ffn_down.weight") && e.contains("256 does not divide the row length 320"), "{e}");
    let mut awq = awq_case(32, 256, 128, 14).weight;
    awq.shape = [32, 200];
    awq.format = QuantFormat::Awq4 { group: 128 };
    let e = validate(&awq.view()).unwrap_err().to_string();
    assert!(e.contains("input features K 200 is not a multiple of 128 (the group size)"), "{e}");
}

#[test]
fn a_scale_tensor_of_the_wrong_shape_is_refused() {
    let mut awq = awq_case(32, 256, 128, 15).weight;
    awq.scale.as_mut().unwrap().shape = vec![2, 33];
    let e = validate(&awq.view()).unwrap_err().to_string();
    assert!(e.contains("down_proj.scales") && e.contains("[2, 33]") && e.contains("expected [2, 32]"), "{e}");
    let mut fp8 = fp8_block_case(200, 300, 16).weight;
    fp8.scale.as_mut().unwrap().shape = vec![1, 3];
    let e = validate(&fp8.view()).unwrap_err().to_string();
    assert!(e.contains("weight_scale_inv") && e.contains("expected [2, 3]"), "{e}");
    let mut gptq = gptq_case(16, 256, 64, 17).weight;
    gptq.g_idx.as_mut().unwrap().bytes[0..4].copy_from_slice(&9u32.to_le_bytes());
    let e = validate(&gptq.view()).unwrap_err().to_string();
    assert!(e.contains("g_idx") && e.contains("outside the 4 groups"), "{e}");
}

#[test]
fn unknown_and_unsupported_gguf_types_are_refused_naming_the_tensor() {
    let e = QuantFormat::from_gguf_type(99, "blk.7.attn_v.weight").unwrap_err().to_string();
    assert!(e.contains("blk.7.attn_v.weight") && e.contains("unknown GGUF type id 99"), "{e}");
    let e = QuantFormat::from_gguf_type(2, "blk.7.attn_v.weight").unwrap_err().to_string();
    assert!(e.contains("Q4_0 is not supported yet"), "{e}");
    assert_eq!(QuantFormat::from_gguf_type(21, "x").unwrap(), Some(QuantFormat::GgufIq3S));
    assert_eq!(QuantFormat::from_gguf_type(30, "x").unwrap(), None);
}

#[test]
fn invalid_scale_words_are_refused() {
    let fmt = QuantFormat::Q4G64F16S;
    let g = grouped::Grouped::of(fmt).unwrap();
    let mut bytes = quantize(fmt, "w", &vec![0.5; 2 * 128], [2, 128]).unwrap();
    let off = g.planes(2, 128).scale_offset + 2 * 3;
    bytes[off + 1] |= 0x80;
    let e = refusal(&QuantTensor::packed("lm.w", fmt, [2, 128], &bytes));
    assert!(e.contains("lm.w") && e.contains("row 1 group 1"), "{e}");
    let mut w8 = quantize(QuantFormat::W8G32F16S, "w", &vec![0.5; 128], [1, 128]).unwrap();
    w8[5] = 0x80;
    assert!(refusal(&QuantTensor::packed("w", QuantFormat::W8G32F16S, [1, 128], &w8)).contains("-128"));
    let mut q4 = quantize(fmt, "w", &vec![0.0; 128], [1, 128]).unwrap();
    q4[0] = 0x10;
    assert!(refusal(&QuantTensor::packed("w", fmt, [1, 128], &q4)).contains("scale +0 with nonzero codes"));
    let mut f8 = quantize(QuantFormat::Fp8E4m3fnRowBf16s, "w", &vec![0.5; 2 * 64], [2, 64]).unwrap();
    f8[64 + 9] = 0xff;
    assert!(refusal(&QuantTensor::packed("w", QuantFormat::Fp8E4m3fnRowBf16s, [2, 64], &f8)).contains("element [1, 9] is an E4M3FN NaN"));
    let mut bytes = quantize(QuantFormat::Nvfp4, "w", &vec![0.5; 128 * 64], [128, 64]).unwrap();
    let n = bytes.len();
    bytes[n - 4..].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert!(refusal(&QuantTensor::packed("w", QuantFormat::Nvfp4, [128, 64], &bytes)).contains("divisor"));
}

#[test]
fn format_table_names_round_trip() {
    for spec in &FORMATS[..12] {
        let f = QuantFormat::from_name(spec.name).unwrap();
        assert_eq!(f.name(), spec.name);
    }
    assert_eq!(QuantFormat::from_ninfer("Q4G64_F16S", "row-split-k128-v1"), Some(QuantFormat::Q4G64F16S));
    assert_eq!(QuantFormat::from_ninfer("Q4G64_F16S", "row-scale-v1"), None);
    assert_eq!(QuantFormat::Awq4 { group: 128 }.name(), "HF_AWQ4");
}

#[test]
fn nvfp4_random_words_with_edge_scales_decode_by_definition() {
    let mut r = rng(30);
    let (n, k) = (256, 128);
    for d_w in [1.0f32, 3.0, 1e-3, 2688.0] {
        let (scale_off, div_off, total) = nvfp4::planes(n, k);
        let mut bytes = vec![0u8; total];
        bytes[..n * k / 2].iter_mut().for_each(|b| *b = r.random());
        // Sign-zero, non-NaN scale words: edges (+0, smallest subnormal, largest subnormal,
        // smallest normal, 448) first, then random.
        let edge = [0x00u8, 0x01, 0x07, 0x08, 0x7e];
        let mut scales = vec![0u8; n * k / 16];
        for (i, s) in scales.iter_mut().enumerate() {
            *s = if i < edge.len() { edge[i] } else { r.random_range(0..0x7f) };
        }
        for row in 0..n {
            for g in 0..k / 16 {
                bytes[scale_off + nvfp4::scale_index(row, g, k)] = scales[row * (k / 16) + g];
            }
        }
        bytes[div_off..].copy_from_slice(&d_w.to_le_bytes());
        let w = dequantize(&QuantTensor::packed("w", QuantFormat::Nvfp4, [n, k], &bytes)).unwrap();
        for row in 0..n {
            for c in 0..k {
                let b = bytes[(row * k + c) / 2];
                let code = if c % 2 == 0 { b & 15 } else { b >> 4 };
                let s = e4m3_to_f32(scales[row * (k / 16) + c / 16]).unwrap();
                assert_eq!(w[row * k + c].to_bits(), (scalars::e2m1_to_f32(code) * s / d_w).to_bits(), "[{row}, {c}] d_w {d_w}");
            }
        }
    }
}

#[test]
fn fp8_row_random_words_with_edge_scales_decode_by_definition() {
    let mut r = rng(31);
    let (n, k) = (6, 100);
    let (scale_off, total) = fp8_row::planes(n, k);
    let mut bytes = vec![0u8; total];
    for c in bytes[..n * k].iter_mut() {
        *c = loop {
            let v: u8 = r.random();
            if v & 0x7f != 0x7f {
                break v;
            }
        };
    }
    // +0 (its row all zero codes), smallest subnormal, largest finite, 1.0, random.
    let scales = [0x0000u16, 0x0001, 0x7f7f, 0x3f80, half::bf16::from_f32(0.0123).to_bits(), 0x007f];
    bytes[..k].iter_mut().enumerate().for_each(|(i, b)| *b = if i % 2 == 0 { 0x00 } else { 0x80 });
    for (row, s) in scales.iter().enumerate() {
        bytes[scale_off + 2 * row..scale_off + 2 * row + 2].copy_from_slice(&s.to_le_bytes());
    }
    let w = dequantize(&QuantTensor::packed("w", QuantFormat::Fp8E4m3fnRowBf16s, [n, k], &bytes)).unwrap();
    for row in 0..n {
        for c in 0..k {
            let want = e4m3_to_f32(bytes[row * k + c]).unwrap() * bf16_to_f32(scales[row]);
            assert_eq!(w[row * k + c].to_bits(), want.to_bits(), "[{row}, {c}]");
        }
    }
}
