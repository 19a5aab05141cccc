//! `Packed`: one device tensor described as segments of checkpoint tensors (a fused
//! projection's parts one after the other, Qwen3.5's gated q_proj reordered block by block),
//! converted to the device's storage type chunk by chunk on the rayon pool.

use rayon::prelude::*;
use ::safetensors::Dtype;

use crate::artifact::RawTensor;
use crate::backend::cuda::kernels::StorageDType;
use crate::backend::cuda::transfer::{storage_bit_from_bf16, storage_bit_from_f32};
use crate::quant::{self, QuantFormat, QuantWeight};
use crate::{NinferError, Result};

/// Elements `src..src + len` of part `part` land at `dst..dst + len` of the packed tensor.
struct Segment {
    part: usize,
    src: usize,
    len: usize,
    dst: usize,
}

/// One device tensor in storage type, assembled from checkpoint tensors.
pub struct Packed<'a> {
    parts: Vec<RawTensor<'a>>,
    /// Sorted by `dst`, covering `0..numel` without gaps.
    segments: Vec<Segment>,
    numel: usize,
}

/// Elements converted per rayon task (2 MiB of bf16: large enough that a positioned read is
/// efficient, small enough to spread a staging buffer over all cores).
const TASK_ELEMS: usize = 1 << 20;

impl<'a> Packed<'a> {
    /// The checkpoint tensors one after the other (a fused projection's row blocks).
    pub fn concat(parts: Vec<RawTensor<'a>>) -> Self {
        let mut segments = Vec::with_capacity(parts.len());
        let mut dst = 0;
        for (i, p) in parts.iter().enumerate() {
            segments.push(Segment { part: i, src: 0, len: p.numel, dst });
            dst += p.numel;
        }
        Packed { parts, segments, numel: dst }
    }

    /// One checkpoint tensor as is.
    pub fn single(t: RawTensor<'a>) -> Self {
        Self::concat(vec![t])
    }

    /// Elements in the packed tensor.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The packed tensor's values in f32, exactly as the CPU loader reads each part
    /// (`--quantize` encodes these, as the CPU model does).
    pub fn values_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel];
        for seg in &self.segments {
            self.parts[seg.part].f32_into(seg.src, &mut out[seg.dst..seg.dst + seg.len]);
        }
        out
    }

    /// The checkpoint tensors' names joined by `|` (the name a fused quantized weight's errors give).
    pub fn name(&self) -> String {
        self.parts.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join("|")
    }

    /// The packed tensor from quantized payloads handed in for its parts (`given[i]` for part
    /// `i`, `[rows, k]` each), rows moved as the segments say, as row-stacked parts
    /// (`CudaDevice::upload_quant_parts`): GGUF rows (independent runs of whole blocks) as one
    /// payload; NVFP4 parts each as its own payload (its tensor divisor is the part's), their
    /// rows moved within the part with their codes and swizzled scale words. Each payload is
    /// validated first, so a bad one is refused naming its tensor.
    pub fn concat_rows(&self, given: &[&QuantWeight], k: usize) -> Result<Vec<QuantWeight>> {
        let f = given[0].format;
        for (p, w) in self.parts.iter().zip(given) {
            quant::validate(&w.view())?;
            let err = |reason: String| NinferError::QuantTensor { name: p.name.clone(), format: w.format.name().to_string(), reason };
            if w.shape != [p.numel / k, k] {
                return Err(err(format!("handed in as [{}, {}], the model config gives [{}, {k}]", w.shape[0], w.shape[1], p.numel / k)));
            }
            if w.format != f {
                return Err(err(format!("the CUDA backend packs this fused projection as one matrix, and {} is {}", given[0].name, f.name())));
            }
            if f.spec().family != quant::Family::Gguf && f != QuantFormat::Nvfp4 {
                return Err(NinferError::Unsupported(format!(
                    "{}: a handed-in {} tensor on the CUDA backend (only GGUF rows, runs of whole blocks, and NVFP4 parts are packed into fused projections there); load on the CPU",
                    p.name,
                    f.name()
                )));
            }
        }
        if f == QuantFormat::Nvfp4 {
            return Ok(self.parts.iter().enumerate().map(|(i, p)| self.nvfp4_part(i, given[i], p.numel, k)).collect());
        }
        let (be, bb) = quant::gguf::block_geometry(f).expect("a GGUF format");
        let row = k / be * bb;
        let mut data = Vec::with_capacity(self.numel / k * row);
        for seg in &self.segments {
            debug_assert!(seg.src % k == 0 && seg.len % k == 0, "segments are whole rows");
            data.extend_from_slice(&given[seg.part].data[seg.src / k * row..(seg.src + seg.len) / k * row]);
        }
        Ok(vec![QuantWeight::packed(self.name(), f, [self.numel / k, k], data)])
    }

    /// Part `part`'s NVFP4 payload `w` (`numel` values) with its rows in the packed order: each
    /// destination row's codes and scale words from its source row; the divisor as is.
    fn nvfp4_part(&self, part: usize, w: &QuantWeight, numel: usize, k: usize) -> QuantWeight {
        let n = numel / k;
        let (scales, _, _) = quant::nvfp4::planes(n, k);
        let base = self.segments.iter().filter(|s| s.part == part).map(|s| s.dst).min().unwrap_or(0);
        if self.segments.iter().filter(|s| s.part == part).all(|s| s.src == s.dst - base) {
            return w.clone();
        }
        let mut data = w.data.clone();
        for seg in self.segments.iter().filter(|s| s.part == part) {
            for r in 0..seg.len / k {
                let (src, dst) = (seg.src / k + r, (seg.dst - base) / k + r);
                data[dst * k / 2..(dst + 1) * k / 2].copy_from_slice(&w.data[src * k / 2..(src + 1) * k / 2]);
                for g in 0..k / 16 {
                    data[scales + quant::nvfp4::scale_index(dst, g, k)] = w.data[scales + quant::nvfp4::scale_index(src, g, k)];
                }
            }
        }
        QuantWeight::packed(w.name.clone(), QuantFormat::Nvfp4, [n, k], data)
    }

    /// Rows of each part (`k` values a row), in order.
    pub fn part_rows(&self, k: usize) -> Vec<usize> {
        self.parts.iter().map(|p| p.numel / k).collect()
    }

    /// The first `at` parts and the rest (None when none are left), each with its segments: a
    /// fused projection's quantized parts and its dense tail. The segments of a part stay within
    /// the part's rows (a permutation moves rows of the first part only).
    pub fn split_at_part(mut self, at: usize) -> (Packed<'a>, Option<Packed<'a>>) {
        if at >= self.parts.len() {
            return (self, None);
        }
        let rest_parts = self.parts.split_off(at);
        let head_numel: usize = self.parts.iter().map(|p| p.numel).sum();
        let (head_segs, rest_segs): (Vec<Segment>, Vec<Segment>) = self.segments.into_iter().partition(|s| s.part < at);
        let rest_segs = rest_segs.into_iter().map(|s| Segment { part: s.part - at, src: s.src, len: s.len, dst: s.dst - head_numel }).collect();
        let rest_numel = self.numel - head_numel;
        (Packed { parts: self.parts, segments: head_segs, numel: head_numel }, Some(Packed { parts: rest_parts, segments: rest_segs, numel: rest_numel }))
    }

    /// The checkpoint tensors' names, in part order.
    pub fn part_names(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().map(|p| p.name.as_str())
    }

    /// Replaces the first part (which must start at 0) by its `blocks` equal blocks taken in
    /// the order `source_block(d)` gives for destination block `d`.
    pub(super) fn permute_first_part(mut self, blocks: usize, source_block: impl Fn(usize) -> usize) -> Self {
        let first = &self.segments[0];
        debug_assert!(first.part == 0 && first.dst == 0 && first.len.is_multiple_of(blocks));
        let block = first.len / blocks;
        let permuted = (0..blocks).map(|d| Segment { part: 0, src: source_block(d) * block, len: block, dst: d * block });
        self.segments.splice(0..1, permuted);
        self
    }

    /// Elements `first..first + out.len()` of the packed tensor as `storage` bits, spread over
    /// the rayon pool. `read`: copy same-type bytes with positioned file reads rather than
    /// through the mapping.
    pub fn fill(&self, first: usize, out: &mut [u16], storage: StorageDType, read: bool) -> Result<()> {
        out.par_chunks_mut(TASK_ELEMS).enumerate().try_for_each(|(i, chunk)| self.fill_serial(first + i * TASK_ELEMS, chunk, storage, read))
    }

    pub(super) fn fill_serial(&self, first: usize, out: &mut [u16], storage: StorageDType, read: bool) -> Result<()> {
        let end = first + out.len();
        let start = self.segments.partition_point(|s| s.dst + s.len <= first);
        for seg in self.segments[start..].iter().take_while(|s| s.dst < end) {
            let lo = seg.dst.max(first);
            let hi = (seg.dst + seg.len).min(end);
            let src = seg.src + (lo - seg.dst);
            convert(&self.parts[seg.part], src, &mut out[lo - first..hi - first], storage, read)?;
        }
        Ok(())
    }
}

static READ_FALLBACK: std::sync::Once = std::sync::Once::new();

/// Elements `src..src + out.len()` of `t` as `storage` bits.
fn convert(t: &RawTensor<'_>, src: usize, out: &mut [u16], storage: StorageDType, read: bool) -> Result<()> {
    let n = out.len();
    match (t.dtype, storage) {
        (Dtype::BF16, StorageDType::Bf16) | (Dtype::F16, StorageDType::F16) => {
            if read && cfg!(target_endian = "little") {
                // SAFETY: u16 has no invalid bit patterns and u8 has alignment 1; on a
                // little-endian host the stored bytes are the u16 values.
                let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), 2 * n) };
                match t.read_into(2 * src, bytes) {
                    Ok(()) => return Ok(()),
                    // The mapping holds the same bytes: a sandbox that refuses reads into
                    // pinned memory costs speed, not the load.
                    Err(e) => READ_FALLBACK.call_once(|| eprintln!("ninfer: positioned read failed ({e}); copying through the mapping")),
                }
            }
            for (o, b) in out.iter_mut().zip(t.bytes[2 * src..2 * (src + n)].chunks_exact(2)) {
                *o = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        (Dtype::BF16, StorageDType::F16) => {
            for (o, b) in out.iter_mut().zip(t.bytes[2 * src..2 * (src + n)].chunks_exact(2)) {
                *o = storage_bit_from_bf16(u16::from_le_bytes([b[0], b[1]]), storage);
            }
        }
        _ => {
            // F32 or F16 sources (and F16 into bf16): through f32, rounding to nearest even once.
            let mut tmp = vec![0f32; n];
            t.f32_into(src, &mut tmp);
            for (o, v) in out.iter_mut().zip(tmp) {
                *o = storage_bit_from_f32(v, storage);
            }
        }
    }
    Ok(())
}
