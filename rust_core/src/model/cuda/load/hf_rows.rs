//! A fused projection of a quantized Hugging Face checkpoint (FP8 block, AWQ, GPTQ,
//! compressed-tensors pack-quantized) as the one packed weight the CUDA backend holds: the
//! parts' output rows moved, in each of the data / scale / zero tensors, to where the fused
//! matrix wants them (q|k|v with Qwen3.5's gated query reordered, gate|up, the GDN input
//! projection). Only whole units of each tensor's row axis move (8 rows of a nibble-packed
//! word, `block_n` rows of an FP8 scale block), so every fused row decodes to exactly the value
//! its part's row decodes to; a projection whose parts do not cut at such units, or that
//! differ in a companion's dtype or in `g_idx`, is refused as not supported yet.

use crate::quant::{OwnedRaw, QuantFormat, QuantWeight};
use crate::{NinferError, Result};

/// Rows `src..src + len` of part `part` land at rows `dst..dst + len` of the fused weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSeg {
    pub part: usize,
    pub src: usize,
    pub len: usize,
    pub dst: usize,
}

/// Parts of `rows[i]` rows one after the other.
pub fn concat(rows: &[usize]) -> Vec<RowSeg> {
    let mut dst = 0;
    rows.iter()
        .enumerate()
        .map(|(part, &len)| {
            let s = RowSeg { part, src: 0, len, dst };
            dst += len;
            s
        })
        .collect()
}

/// `segs` with the first part (at row 0) cut into `blocks` equal blocks, destination block `d`
/// taken from source block `source_block(d)` (`Packed::permute_first_part` in rows).
pub fn permute_first(mut segs: Vec<RowSeg>, blocks: usize, source_block: impl Fn(usize) -> usize) -> Vec<RowSeg> {
    let first = segs[0];
    debug_assert!(first.part == 0 && first.dst == 0 && first.len.is_multiple_of(blocks));
    let block = first.len / blocks;
    segs.splice(0..1, (0..blocks).map(|d| RowSeg { part: 0, src: source_block(d) * block, len: block, dst: d * block }));
    segs
}

/// Where a tensor keeps the output-row axis: its first dimension (`Major`) or its second
/// (`Minor`), `unit` rows to an index along it.
#[derive(Clone, Copy)]
enum Axis {
    Major(usize),
    Minor(usize),
}

/// The row axes of the data, scale and zero tensors of `format` (hf.rs's layouts).
fn axes(format: QuantFormat) -> [Axis; 3] {
    match format {
        // weight [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)].
        QuantFormat::HfFp8Block { block_n, .. } => [Axis::Major(1), Axis::Major(block_n), Axis::Major(1)],
        // qweight [K, N/8], scales [G, N], qzeros [G, N/8].
        QuantFormat::Awq4 { .. } => [Axis::Minor(8), Axis::Minor(1), Axis::Minor(8)],
        // qweight [K/8, N], scales [G, N], qzeros [G, N/8].
        QuantFormat::Gptq4 { .. } => [Axis::Minor(1), Axis::Minor(1), Axis::Minor(8)],
        // weight_packed [N, K/8], weight_scale [N, G], weight_zero_point [ceil(N/8), G].
        QuantFormat::PackQuantized4 { .. } => [Axis::Major(1), Axis::Major(1), Axis::Major(8)],
        f => unreachable!("not an HF format: {f:?}"),
    }
}

/// Why `segs` over the parts `parts` (`(name, rows)`) cannot be moved in whole units of
/// `format`'s tensors' row axes, if they cannot: checked from the shapes alone, before any
/// weight is read.
pub fn cut_error(name: &str, format: QuantFormat, parts: &[(String, usize)], segs: &[RowSeg]) -> Option<NinferError> {
    let n: usize = segs.iter().map(|s| s.len).sum();
    axes(format).into_iter().find_map(|axis| {
        let unit = match axis {
            Axis::Major(u) | Axis::Minor(u) => u,
        };
        uneven_cut(unit, segs, parts, n).map(|why| unsupported(name, format, why))
    })
}

fn unsupported(name: &str, format: QuantFormat, why: String) -> NinferError {
    NinferError::Unsupported(format!("{name}: {} parts {why} on the CUDA backend (which holds this fused projection as one matrix; the CPU backend loads it)", format.name()))
}

/// The first segment that does not start, end and land on a whole `unit` of rows (a partial
/// unit is whole only where it ends both its part and the fused weight of `n` rows).
fn uneven_cut(unit: usize, segs: &[RowSeg], parts: &[(String, usize)], n: usize) -> Option<String> {
    segs.iter().find_map(|s| {
        let (name, rows) = &parts[s.part];
        let ends = s.src + s.len == *rows && s.dst + s.len == n;
        let whole = s.src.is_multiple_of(unit) && s.dst.is_multiple_of(unit) && (s.len.is_multiple_of(unit) || ends);
        (!whole).then(|| format!("cut at rows that are not multiples of {unit} ({name} rows {}..{} to {})", s.src, s.src + s.len, s.dst))
    })
}

/// The fused weight named `name` (`[n, k]`) from `parts` (each validated, `[rows_i, k]`, one
/// format) placed as `segs` say.
pub fn gather(name: &str, parts: &[QuantWeight], segs: &[RowSeg], k: usize) -> Result<QuantWeight> {
    let format = parts[0].format;
    let n: usize = segs.iter().map(|s| s.len).sum();
    let unsupported = |why: String| unsupported(name, format, why);
    for p in parts {
        if p.format != format || p.shape[1] != k {
            return Err(unsupported(format!("of different formats or widths ({} is {} [{}, {}])", p.name, p.format.name(), p.shape[0], p.shape[1])));
        }
    }
    let [data_axis, scale_axis, zero_axis] = axes(format);
    let data_parts: Vec<OwnedRaw> = parts
        .iter()
        .map(|p| OwnedRaw { name: p.name.clone(), dtype: data_dtype(format), shape: data_shape(format, p.shape), bytes: p.data.clone() })
        .collect();
    let data = gather_tensor(&data_parts.iter().collect::<Vec<_>>(), parts, segs, n, data_axis).map_err(|why| unsupported(format!("{why} (data)")))?;
    let companion = |get: fn(&QuantWeight) -> Option<&OwnedRaw>, axis: Axis, what: &str| -> Result<Option<OwnedRaw>> {
        let raws: Vec<Option<&OwnedRaw>> = parts.iter().map(get).collect();
        if raws.iter().all(Option::is_none) {
            return Ok(None);
        }
        let raws: Vec<&OwnedRaw> = raws.into_iter().collect::<Option<_>>().ok_or_else(|| unsupported(format!("where only some have a {what} tensor")))?;
        if raws.iter().any(|r| r.dtype != raws[0].dtype) {
            return Err(unsupported(format!("with {what} tensors of different dtypes")));
        }
        let bytes = gather_tensor(&raws, parts, segs, n, axis).map_err(|why| unsupported(format!("{why} ({what})")))?;
        let shape = fused_shape(&raws[0].shape, n, axis);
        Ok(Some(OwnedRaw { name: format!("{name} ({what})"), dtype: raws[0].dtype, shape, bytes }))
    };
    let scale = companion(|p| p.scale.as_ref(), scale_axis, "scale")?;
    let zero = companion(|p| p.zero.as_ref(), zero_axis, "zero")?;
    // g_idx maps inputs to groups: the fused matrix has one, so every part must have the same.
    let g_idx = if parts.iter().all(|p| p.g_idx.is_none()) {
        None
    } else {
        let all: Vec<&OwnedRaw> = parts.iter().map(|p| p.g_idx.as_ref()).collect::<Option<_>>().ok_or_else(|| unsupported("where only some have a g_idx tensor".into()))?;
        if all.iter().any(|g| g.bytes != all[0].bytes) {
            return Err(unsupported("with different g_idx (act-order) input groups".into()));
        }
        Some(OwnedRaw { name: format!("{name} (g_idx)"), ..all[0].clone() })
    };
    Ok(QuantWeight { name: name.to_string(), format, shape: [n, k], data, scale, zero, g_idx })
}

/// The stored dtype of a format's data tensor (its bytes are moved, never read as numbers).
fn data_dtype(format: QuantFormat) -> crate::quant::RawDtype {
    match format {
        QuantFormat::HfFp8Block { .. } => crate::quant::RawDtype::U8,
        _ => crate::quant::RawDtype::I32,
    }
}

/// The stored shape of a format's data tensor for logical `[n, k]`.
fn data_shape(format: QuantFormat, [n, k]: [usize; 2]) -> Vec<usize> {
    match format {
        QuantFormat::HfFp8Block { .. } => vec![n, k],
        QuantFormat::Awq4 { .. } => vec![k, n / 8],
        QuantFormat::Gptq4 { .. } => vec![k / 8, n],
        _ => vec![n, k / 8],
    }
}

/// `shape` with its row axis holding `n` rows.
fn fused_shape(shape: &[usize], n: usize, axis: Axis) -> Vec<usize> {
    match axis {
        Axis::Major(u) => vec![n.div_ceil(u), shape[1]],
        Axis::Minor(u) => vec![shape[0], n.div_ceil(u)],
    }
}

/// The bytes of one tensor of the fused weight from the parts' (`raws[i]` of `parts[i]`), or
/// why the segments cannot be moved in whole units of its row axis.
fn gather_tensor(raws: &[&OwnedRaw], parts: &[QuantWeight], segs: &[RowSeg], n: usize, axis: Axis) -> std::result::Result<Vec<u8>, String> {
    let (unit, major) = match axis {
        Axis::Major(u) => (u, true),
        Axis::Minor(u) => (u, false),
    };
    let first = raws[0];
    let esize = first.bytes.len() / first.shape.iter().product::<usize>().max(1);
    let out_shape = fused_shape(&first.shape, n, axis);
    let mut out = vec![0u8; out_shape[0] * out_shape[1] * esize];
    let named: Vec<(String, usize)> = parts.iter().map(|p| (p.name.clone(), p.shape[0])).collect();
    if let Some(why) = uneven_cut(unit, segs, &named, n) {
        return Err(why);
    }
    for s in segs {
        let raw = raws[s.part];
        let (from, count, to) = (s.src / unit, s.len.div_ceil(unit), s.dst / unit);
        if major {
            let width = raw.shape[1] * esize;
            out[to * width..(to + count) * width].copy_from_slice(&raw.bytes[from * width..(from + count) * width]);
        } else {
            let (src_w, dst_w) = (raw.shape[1] * esize, out_shape[1] * esize);
            for r in 0..raw.shape[0] {
                out[r * dst_w + to * esize..r * dst_w + (to + count) * esize].copy_from_slice(&raw.bytes[r * src_w + from * esize..r * src_w + (from + count) * esize]);
            }
        }
    }
    Ok(out)
}

/// A random HF weight of `format` for `[n, k]` (valid: finite positive scales, codes anywhere but
/// the E4M3 NaN words), for the loader's tests; `g_idx`: the input groups to store.
#[cfg(test)]
pub(super) fn random(format: QuantFormat, name: &str, n: usize, k: usize, seed: u64, g_idx: Option<&[i32]>) -> QuantWeight {
    use crate::quant::RawDtype;
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut bytes = |len: usize| (0..len).map(|_| next() as u8).collect::<Vec<u8>>();
    let specs = crate::quant::hf::part_specs(format, n, k, g_idx.is_some());
    let raw = |i: usize, dtype: RawDtype, bytes: Vec<u8>| {
        let shape = specs[i].as_ref().unwrap().1.clone();
        OwnedRaw { name: format!("{name}.{i}"), dtype, shape, bytes }
    };
    let scale_of = |count: usize, dtype: RawDtype, next: &mut dyn FnMut() -> u64| -> Vec<u8> {
        (0..count)
            .flat_map(|_| {
                let v = 0.01 + (next() % 1000) as f32 * 1e-4;
                match dtype {
                    RawDtype::F32 => v.to_le_bytes().to_vec(),
                    RawDtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                    _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                }
            })
            .collect()
    };
    let count = |i: usize| specs[i].as_ref().unwrap().1.iter().product::<usize>();
    let (data, scale_dtype) = match format {
        // E4M3 codes without the two NaN words.
        QuantFormat::HfFp8Block { .. } => (bytes(n * k).into_iter().map(|b| if b & 0x7f == 0x7f { 0x3f } else { b }).collect(), RawDtype::BF16),
        QuantFormat::PackQuantized4 { .. } => (bytes(4 * count(0)), RawDtype::F32),
        _ => (bytes(4 * count(0)), RawDtype::F16),
    };
    let mut next2 = {
        let mut t = seed ^ 0x5555;
        move || {
            t = t.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            t >> 33
        }
    };
    let scale = raw(1, scale_dtype, scale_of(count(1), scale_dtype, &mut next2));
    let zero = specs[2].as_ref().map(|_| raw(2, RawDtype::I32, (0..4 * count(2)).map(|_| next2() as u8).collect()));
    let g_idx = g_idx.map(|g| raw(3, RawDtype::I32, g.iter().flat_map(|v| v.to_le_bytes()).collect()));
    QuantWeight { name: name.into(), format, shape: [n, k], data, scale: Some(scale), zero, g_idx }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;

    /// The formats with a group of 16 (FP8: 16-row blocks), one with symmetric and one with
    /// asymmetric compressed-tensors.
    fn formats() -> Vec<QuantFormat> {
        vec![
            QuantFormat::HfFp8Block { block_n: 16, block_k: 16 },
            QuantFormat::Awq4 { group: 16 },
            QuantFormat::Gptq4 { group: 16, zero_plus_one: true },
            QuantFormat::PackQuantized4 { group: 16, symmetric: true },
            QuantFormat::PackQuantized4 { group: 16, symmetric: false },
        ]
    }

    #[test]
    fn gathered_rows_decode_to_their_parts_rows_in_every_format() {
        let k = 48;
        for f in formats() {
            // A gated query (4 blocks of 16 rows, reordered) then two 16-row parts; and a last
            // part of 8 rows (a partial FP8 block where it ends the fused weight).
            for rows in [vec![64, 16, 16], vec![32, 16, 8]] {
                let parts: Vec<QuantWeight> = rows.iter().enumerate().map(|(i, &r)| random(f, &format!("p{i}"), r, k, i as u64 + 3, None)).collect();
                let mut segs = concat(&rows);
                if rows[0] == 64 {
                    segs = permute_first(segs, 4, |d| [2, 0, 3, 1][d]);
                }
                let fused = gather("p0|p1|p2", &parts, &segs, k).unwrap();
                let got = dequantize(&fused.view()).unwrap();
                let want: Vec<Vec<f32>> = parts.iter().map(|p| dequantize(&p.view()).unwrap()).collect();
                for s in &segs {
                    for r in 0..s.len {
                        let (g, w) = (&got[(s.dst + r) * k..][..k], &want[s.part][(s.src + r) * k..][..k]);
                        assert!(g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()), "{f:?} rows {rows:?}: fused row {}", s.dst + r);
                    }
                }
                assert_eq!(fused.shape, [rows.iter().sum::<usize>(), k]);
                let bytes = |w: &QuantWeight| w.data.len() + [&w.scale, &w.zero, &w.g_idx].into_iter().flatten().map(|r| r.bytes.len()).sum::<usize>();
                assert_eq!(bytes(&fused), parts.iter().map(bytes).sum::<usize>(), "{f:?}: the parts' bytes, moved");
            }
        }
    }

    #[test]
    fn cuts_inside_a_unit_and_different_g_idx_are_refused_as_not_supported_yet() {
        let k = 48;
        // 8-row parts before the end: an FP8 16-row scale block would hold rows of two parts.
        let f = QuantFormat::HfFp8Block { block_n: 16, block_k: 16 };
        let parts: Vec<QuantWeight> = [8, 16].iter().enumerate().map(|(i, &r)| random(f, &format!("p{i}"), r, k, i as u64, None)).collect();
        let e = gather("p0|p1", &parts, &concat(&[8, 16]), k).unwrap_err().to_string();
        assert!(e.contains("HF_FP8_BLOCK") && e.contains("not supported yet") && e.contains("multiples of 16") && e.contains("p0|p1"), "{e}");
        // The same refusal from the shapes alone; the aligned cuts pass.
        let named = |rows: &[usize]| rows.iter().enumerate().map(|(i, r)| (format!("p{i}"), *r)).collect::<Vec<_>>();
        let shapes = cut_error("p0|p1", f, &named(&[8, 16]), &concat(&[8, 16])).unwrap().to_string();
        assert!(shapes.contains("p0 rows 0..8") && shapes.contains("multiples of 16") && shapes.contains("not supported yet"), "{shapes}");
        assert!(cut_error("p", f, &named(&[16, 8]), &concat(&[16, 8])).is_none());
        // GPTQ act-order parts with their own input groups.
        let f = QuantFormat::Gptq4 { group: 16, zero_plus_one: false };
        let g1: Vec<i32> = (0..k as i32).map(|i| i / 16).collect();
        let g2: Vec<i32> = (0..k as i32).map(|i| (47 - i) / 16).collect();
        let parts = vec![random(f, "a", 16, k, 1, Some(&g1)), random(f, "b", 16, k, 2, Some(&g2))];
        let e = gather("a|b", &parts, &concat(&[16, 16]), k).unwrap_err().to_string();
        assert!(e.contains("g_idx") && e.contains("not supported yet"), "{e}");
        // The same g_idx in both is kept once.
        let parts = vec![random(f, "a", 16, k, 1, Some(&g1)), random(f, "b", 16, k, 2, Some(&g1))];
        let fused = gather("a|b", &parts, &concat(&[16, 16]), k).unwrap();
        assert_eq!(fused.g_idx.as_ref().unwrap().bytes.len(), 4 * k);
        let d = dequantize(&fused.view()).unwrap();
        assert_eq!(d[16 * k..], dequantize(&parts[1].view()).unwrap()[..]);
    }
}
