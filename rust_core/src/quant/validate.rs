//! Load-time checks of a quantized tensor against its declared format and shape: byte counts,
//! group divisibility, companion tensor dtypes and shapes, and the scale words the formats
//! restrict. Each refusal names the tensor and says what is wrong with the numbers.

use super::scalars::{bf16_to_f32, e4m3_to_f32, f16_to_f32};
use super::{fp8_row, gguf, grouped, hf, nvfp4, Family, QuantFormat, QuantTensor, RawTensor};
use crate::{NinferError, Result};

/// Exact payload size of a self-contained `[n, k]` tensor (NInfer and GGUF formats), or the
/// reason the shape cannot be held; `None` for HF forms (several tensors).
pub fn payload_bytes(format: QuantFormat, shape: [usize; 2]) -> Option<std::result::Result<usize, String>> {
    let [n, k] = shape;
    if let Some(g) = grouped::Grouped::of(format) {
        return Some(Ok(g.planes(n, k).payload));
    }
    match format {
        QuantFormat::Fp8E4m3fnRowBf16s => Some(Ok(fp8_row::planes(n, k).1)),
        QuantFormat::Nvfp4 => Some(if n % 128 != 0 || k % 64 != 0 {
            Err(format!("NVFP4 needs rows a multiple of 128 and a row length a multiple of 64, got [{n}, {k}]"))
        } else {
            Ok(nvfp4::planes(n, k).2)
        }),
        f if f.spec().family == Family::Gguf => {
            let (be, bb) = gguf::block_geometry(f).unwrap();
            Some(if k % be != 0 {
                Err(format!("block size {be} does not divide the row length {k}"))
            } else {
                Ok(n * (k / be) * bb)
            })
        }
        _ => None,
    }
}

/// Check a quantized tensor before anything reads it.
pub fn validate(t: &QuantTensor<'_>) -> Result<()> {
    let err = |reason: String| NinferError::QuantTensor { name: t.name.to_string(), format: t.format.name().to_string(), reason };
    let [n, k] = t.shape;
    if n == 0 || k == 0 {
        return Err(err(format!("shape [{n}, {k}] has no elements")));
    }
    match payload_bytes(t.format, t.shape) {
        Some(size) => {
            let size = size.map_err(&err)?;
            if t.data.len() != size {
                let what = if t.data.len() < size { "truncated" } else { "longer than its shape" };
                return Err(err(format!("{what}: {} bytes, shape [{n}, {k}] needs {size}", t.data.len())));
            }
            if let Some(part) = [&t.scale, &t.zero, &t.g_idx].into_iter().flatten().next() {
                return Err(err(format!("companion tensor {} is not part of this format (its scales are inside the payload)", part.name)));
            }
            check_scale_words(t).map_err(err)
        }
        None => validate_hf(t).map_err(err),
    }
}

/// The words the NInfer formats restrict: every scale word (the scale planes are small next to
/// the codes), the codes of +0-scale groups, W8's excluded -128 and FP8's NaN codes.
fn check_scale_words(t: &QuantTensor<'_>) -> std::result::Result<(), String> {
    let [n, k] = t.shape;
    if let Some(g) = grouped::Grouped::of(t.format) {
        let logical = k.div_ceil(g.group);
        for row in 0..n {
            for gi in 0..g.groups_per_row(k) {
                let w = grouped::scale_word(&g, t.data, n, k, row, gi);
                let ok = if gi < logical { w == 0 || (w & 0x8000 == 0 && f16_to_f32(w).is_finite()) } else { w == 0 };
                if !ok {
                    return Err(format!(
                        "row {row} group {gi}: scale word {w:#06x} is not {}",
                        if gi < logical { "+0 or a finite positive binary16" } else { "+0 (a padding group)" }
                    ));
                }
                if w == 0 && grouped::group_codes(&g, t.data, n, k, row, gi).any(|q| q != 0) {
                    return Err(format!("row {row} group {gi}: scale +0 with nonzero codes"));
                }
            }
        }
        let base_len = n * g.groups_per_row(k) * g.base_bytes;
        if g.bits == 8 {
            if let Some(i) = t.data[..base_len].iter().position(|&b| b == 0x80) {
                return Err(format!("code byte {i} is 0x80 (-128), outside W8's [-127, 127]"));
            }
        }
    } else if t.format == QuantFormat::Fp8E4m3fnRowBf16s {
        for row in 0..n {
            let w = fp8_row::scale_word(t.data, n, k, row);
            if w != 0 && (w & 0x8000 != 0 || !bf16_to_f32(w).is_finite()) {
                return Err(format!("row {row}: scale word {w:#06x} is not +0 or a finite positive bfloat16"));
            }
            let codes = &t.data[row * k..(row + 1) * k];
            if let Some(c) = codes.iter().position(|&c| c & 0x7f == 0x7f) {
                return Err(format!("element [{row}, {c}] is an E4M3FN NaN word"));
            }
            if w == 0 && codes.iter().any(|&c| c & 0x7f != 0) {
                return Err(format!("row {row}: scale +0 with nonzero codes"));
            }
        }
    } else if t.format == QuantFormat::Nvfp4 {
        let d_w = nvfp4::divisor(t.data, n, k);
        if !(d_w.is_finite() && d_w > 0.0) {
            return Err(format!("tensor divisor {d_w} is not finite and positive"));
        }
        let (scale_offset, divisor_offset, _) = nvfp4::planes(n, k);
        if let Some(i) = t.data[scale_offset..divisor_offset].iter().position(|&w| w & 0x80 != 0 || e4m3_to_f32(w).is_none()) {
            return Err(format!("scale byte {i}: word {:#04x} is negative or NaN", t.data[scale_offset + i]));
        }
    }
    Ok(())
}

fn shape_str(s: &[usize]) -> String {
    format!("[{}]", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

fn validate_hf(t: &QuantTensor<'_>) -> std::result::Result<(), String> {
    let [n, k] = t.shape;
    for (what, value, by) in hf::packing_rules(t.format, n, k) {
        if value % by != 0 {
            return Err(format!("{} {value} is not a multiple of {by} (the {})", what, if by == 8 { "eight 4-bit codes of an int32" } else { "group size" }));
        }
    }
    let specs = hf::part_specs(t.format, n, k, t.g_idx.is_some());
    let roles = ["weight", "scale", "zero point", "g_idx"];
    let data = RawTensor { name: t.name, dtype: super::RawDtype::U8, shape: vec![t.data.len()], bytes: t.data };
    let parts = [Some(&data), t.scale.as_ref(), t.zero.as_ref(), t.g_idx.as_ref()];
    for ((spec, part), role) in specs.iter().zip(parts).zip(roles) {
        match (spec, part) {
            (None, None) => {}
            (None, Some(p)) => return Err(format!("{role} tensor {} is not part of this format", p.name)),
            (Some(_), None) => return Err(format!("its {role} tensor is missing")),
            (Some((dtypes, shape)), Some(p)) => {
                let elems: usize = shape.iter().product();
                if role == "weight" {
                    // The data bytes arrive untyped: check the byte count of the packed words.
                    let need = elems * dtypes[0].size();
                    if p.bytes.len() != need {
                        let what = if p.bytes.len() < need { "truncated" } else { "longer than its shape" };
                        return Err(format!("{what}: {} bytes of packed weight, [{n}, {k}] needs {need} ({} {:?})", p.bytes.len(), shape_str(shape), dtypes[0]));
                    }
                    continue;
                }
                if !dtypes.contains(&p.dtype) {
                    return Err(format!("{role} tensor {} has dtype {:?}, expected one of {:?}", p.name, p.dtype, dtypes));
                }
                if &p.shape != shape {
                    return Err(format!("{role} tensor {} has shape {}, expected {} for [{n}, {k}]", p.name, shape_str(&p.shape), shape_str(shape)));
                }
                if p.bytes.len() != elems * p.dtype.size() {
                    return Err(format!("{role} tensor {} is truncated: {} bytes, needs {}", p.name, p.bytes.len(), elems * p.dtype.size()));
                }
            }
        }
    }
    if let Some(gi) = &t.g_idx {
        let groups = match t.format {
            QuantFormat::Gptq4 { group, .. } | QuantFormat::PackQuantized4 { group, .. } => hf::groups(group, k),
            _ => 0,
        };
        for i in 0..k {
            let g = hf::word_at(gi, i) as i32;
            if g < 0 || g as usize >= groups {
                return Err(format!("g_idx tensor {} entry {i} is {g}, outside the {groups} groups", gi.name));
            }
        }
    }
    Ok(())
}
