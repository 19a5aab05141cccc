//! The quantized Hugging Face checkpoint forms: block-scaled FP8 (the official "-FP8" Qwen
//! releases) and 4-bit AWQ / GPTQ (the older `quantization_config` forms and compressed-tensors
//! "pack-quantized"). Each weight is several safetensors tensors; `[N, K]` is the logical
//! `nn.Linear` weight (N outputs, K inputs) and every value is one binary32 rounding of the
//! expression written.
//!
//! - **FP8 block** (`quant_method: "fp8"`, `weight_block_size: [bn, bk]`): `weight` F8_E4M3
//!   `[N, K]`, `weight_scale_inv` F32 or BF16 `[ceil(N/bn), ceil(K/bk)]` (a multiplier despite its
//!   name); `w[n,k] = e4m3(weight[n,k]) * scale_inv[n/bn, k/bk]`.
//! - **AWQ** (`quant_method: "awq"`, GEMM version): `qweight` I32 `[K, N/8]`, `qzeros` I32
//!   `[K/g, N/8]`, `scales` F16 `[K/g, N]`. Output column `n` is nibble `AWQ_NIBBLE[n % 8]` of word
//!   `n / 8` (AWQ interleaves columns 0,2,4,6,1,3,5,7 into nibbles 0..8), both in `qweight` and
//!   in `qzeros`; `w[n,k] = f32(q - z) * scale[k/g, n]`.
//! - **GPTQ** (`quant_method: "gptq"`): `qweight` I32 `[K/8, N]` (input `k` is nibble `k % 8` of
//!   row `k / 8`), `qzeros` I32 `[G, N/8]` (column `n` is nibble `n % 8`), `scales` F16 `[G, N]`,
//!   optional `g_idx` I32 `[K]` (the group of each input; `k / g` without it). The original
//!   `checkpoint_format: "gptq"` stores each zero minus one, so `zero = stored + 1`;
//!   `"gptq_v2"` stores it as is. `w[n,k] = f32(q - zero) * scale[g_idx[k], n]`.
//! - **compressed-tensors pack-quantized** (`format: "pack-quantized"`, 4-bit int weights):
//!   `weight_packed` I32 `[N, K/8]` (input `k` is nibble `k % 8` of word `k / 8`, the code plus 8),
//!   `weight_scale` F16/BF16/F32 `[N, G]`, for asymmetric schemes `weight_zero_point` I32
//!   `[ceil(N/8), G]` (row `n` is nibble `n % 8` of row `n / 8`, the zero plus 8), optional
//!   `weight_g_idx` I32 `[K]`; `w[n,k] = f32(q - z) * scale[n, g_idx[k]]` with `q`, `z` the
//!   signed values (z = 0 when symmetric).
//!
//! Group `g` is the config's group size; 0 (GPTQ's -1, compressed-tensors' "channel") is one
//! group spanning the whole row.

use super::scalars::e4m3_table;
use super::{QuantFormat, QuantTensor, RawDtype, RawTensor};

/// The nibble that holds output column `n % 8` inside an AWQ word.
pub const AWQ_NIBBLE: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

fn nibble(word: u32, i: u32) -> i32 {
    ((word >> (4 * i)) & 0x0f) as i32
}

/// Element `i` of an F32/F16/BF16 tensor as binary32 (exact).
pub fn float_at(t: &RawTensor<'_>, i: usize) -> f32 {
    let b = t.bytes;
    match t.dtype {
        RawDtype::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        RawDtype::F16 => super::scalars::f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
        RawDtype::BF16 => super::scalars::bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
        _ => unreachable!("validated as a float tensor"),
    }
}

/// Element `i` of an I32 tensor, as its unsigned word.
pub fn word_at(t: &RawTensor<'_>, i: usize) -> u32 {
    u32::from_le_bytes(t.bytes[4 * i..4 * i + 4].try_into().unwrap())
}

/// Number of groups along K (`ceil(K / g)`, 1 for a whole-row group).
pub fn groups(group: usize, k: usize) -> usize {
    if group == 0 {
        1
    } else {
        k.div_ceil(group)
    }
}

/// Group of input `k`: from `g_idx` when present, else `k / g`.
fn group_of(t: &QuantTensor<'_>, group: usize, k: usize) -> usize {
    match &t.g_idx {
        Some(gi) => word_at(gi, k) as usize,
        None if group == 0 => 0,
        None => k / group,
    }
}

/// The expected (dtype choices, shape) of every companion of an HF weight, in the order data,
/// scale, zero, g_idx; `None` where the part is absent.
pub type PartSpec = Option<(&'static [RawDtype], Vec<usize>)>;

const FLOATS: &[RawDtype] = &[RawDtype::F32, RawDtype::F16, RawDtype::BF16];
const I32: &[RawDtype] = &[RawDtype::I32];

/// Shapes and dtypes the parts of an HF weight must have for logical `[n, k]`.
pub fn part_specs(format: QuantFormat, n: usize, k: usize, has_g_idx: bool) -> [PartSpec; 4] {
    let g_idx = has_g_idx.then(|| (I32, vec![k]));
    match format {
        QuantFormat::HfFp8Block { block_n, block_k } => [
            Some((&[RawDtype::F8E4M3, RawDtype::U8][..], vec![n, k])),
            Some((&[RawDtype::F32, RawDtype::BF16][..], vec![n.div_ceil(block_n), k.div_ceil(block_k)])),
            None,
            None,
        ],
        QuantFormat::Awq4 { group } => {
            [Some((I32, vec![k, n / 8])), Some((&[RawDtype::F16][..], vec![groups(group, k), n])), Some((I32, vec![groups(group, k), n / 8])), None]
        }
        QuantFormat::Gptq4 { group, .. } => [
            Some((I32, vec![k / 8, n])),
            Some((&[RawDtype::F16][..], vec![groups(group, k), n])),
            Some((I32, vec![groups(group, k), n / 8])),
            g_idx,
        ],
        QuantFormat::PackQuantized4 { group, symmetric } => [
            Some((I32, vec![n, k / 8])),
            Some((FLOATS, vec![n, groups(group, k)])),
            (!symmetric).then(|| (I32, vec![n.div_ceil(8), groups(group, k)])),
            g_idx,
        ],
        _ => unreachable!("not an HF format: {format:?}"),
    }
}

/// Divisibility the packing needs: (what must divide, by what), checked before shapes.
pub fn packing_rules(format: QuantFormat, n: usize, k: usize) -> Vec<(&'static str, usize, usize)> {
    match format {
        QuantFormat::HfFp8Block { .. } => vec![],
        QuantFormat::Awq4 { group } => vec![("output features N", n, 8), ("input features K", k, group.max(1))],
        QuantFormat::Gptq4 { group, .. } => vec![("input features K", k, 8), ("output features N", n, 8), ("input features K", k, group.max(1))],
        QuantFormat::PackQuantized4 { group, .. } => vec![("input features K", k, 8), ("input features K", k, group.max(1))],
        _ => vec![],
    }
}

/// Decode output rows of a validated HF weight.
pub fn decode_rows(t: &QuantTensor<'_>, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let [n, k] = t.shape;
    let scale = t.scale.as_ref().expect("validated");
    match t.format {
        QuantFormat::HfFp8Block { block_n, block_k } => {
            let table = e4m3_table();
            let sk = k.div_ceil(block_k);
            for (r, row) in rows.enumerate() {
                for col in 0..k {
                    let s = float_at(scale, (row / block_n) * sk + col / block_k);
                    out[r * k + col] = table[t.data[row * k + col] as usize] * s;
                }
            }
        }
        QuantFormat::Awq4 { group } => {
            let zeros = t.zero.as_ref().expect("validated");
            for (r, row) in rows.enumerate() {
                let (wc, ni) = (row / 8, AWQ_NIBBLE[row % 8]);
                for col in 0..k {
                    let q = nibble(u32::from_le_bytes(t.data[4 * (col * (n / 8) + wc)..][..4].try_into().unwrap()), ni);
                    let g = group_of(t, group, col);
                    let z = nibble(word_at(zeros, g * (n / 8) + wc), ni);
                    out[r * k + col] = (q - z) as f32 * float_at(scale, g * n + row);
                }
            }
        }
        QuantFormat::Gptq4 { group, zero_plus_one } => {
            let zeros = t.zero.as_ref().expect("validated");
            for (r, row) in rows.enumerate() {
                for col in 0..k {
                    let q = nibble(u32::from_le_bytes(t.data[4 * ((col / 8) * n + row)..][..4].try_into().unwrap()), (col % 8) as u32);
                    let g = group_of(t, group, col);
                    let z = nibble(word_at(zeros, g * (n / 8) + row / 8), (row % 8) as u32) + zero_plus_one as i32;
                    out[r * k + col] = (q - z) as f32 * float_at(scale, g * n + row);
                }
            }
        }
        QuantFormat::PackQuantized4 { group, .. } => {
            let gs = groups(group, k);
            for (r, row) in rows.enumerate() {
                for col in 0..k {
                    let q = nibble(u32::from_le_bytes(t.data[4 * (row * (k / 8) + col / 8)..][..4].try_into().unwrap()), (col % 8) as u32) - 8;
                    let g = group_of(t, group, col);
                    let z = match &t.zero {
                        Some(zp) => nibble(word_at(zp, (row / 8) * gs + g), (row % 8) as u32) - 8,
                        None => 0,
                    };
                    out[r * k + col] = (q - z) as f32 * float_at(scale, row * gs + g);
                }
            }
        }
        _ => unreachable!("not an HF format"),
    }
}
