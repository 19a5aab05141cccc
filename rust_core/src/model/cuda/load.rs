//! Loading a checkpoint straight into `DevWeights`, without the CPU path's f32 host layouts.
//!
//! Why: the CPU layouts are f32 (twice the bytes of a bf16 checkpoint) and were built single
//! threaded before the upload; a 16 GB checkpoint took 54 s. Here every device tensor is
//! described as a `Packed` list of segments of validated checkpoint tensors (the fused
//! projections are several tensors, Qwen3.5's gated q_proj is reordered block by block) and
//! streamed to the device in chunks through a ring of pinned staging buffers: rayon threads
//! fill one buffer (bf16 -> bf16 is a positioned read straight from the file; other dtypes are
//! converted element by element) while the copy engine drains the ones filled before, so host
//! reads and PCIe copies overlap and host memory stays at the ring's size.
//!
//! What lands on the device is what `weights` documents: norm weights as stored (the
//! kernels add 1 for zero-centred models), `A_log` and `dt_bias` in f32, the GDN input
//! projection as four buffers.
//!
//! With `--quantize` a projection is encoded from its checkpoint values as the CPU loader does
//! (`model::cpu::quant_load`) and held packed (`Linear::quantized`). A fused projection
//! (q|k|v, gate|up, the GDN input projection) is encoded whole where the format encodes every
//! row from that row's values alone, so the fused payload decodes to exactly the parts' values
//! (test: `quantize_packs_...`). NVFP4's tensor divisor spans a matrix, so its fused projection
//! is row-stacked parts, each encoded on its own as the CPU loader does, with the parts its
//! layout cannot hold after them as the dense tail (`nvfp4_held_parts`). Packed tensors handed
//! in by name are fused by concatenating their rows' blocks (GGUF) or stacking the parts
//! (NVFP4) (`Packed::concat_rows`).
//!
//! A quantized Hugging Face checkpoint (FP8 block, AWQ, GPTQ, compressed-tensors) is held as
//! stored and run by its format's kernels (cuda/quant_hf.cu): a fused projection's parts are
//! gathered row unit by row unit into one weight (`hf_rows`). Dense parts after the quantized
//! ones (the official Qwen3.5 FP8 releases keep the GDN `in_proj_b` / `in_proj_a` in bf16) are
//! the weight's dense tail, which the same kernels read in the storage type. A dense part
//! before a quantized one is refused as not supported yet.
//!
//! The LM head: dense as stored, or quantized (`--quantize-lm-head`, a checkpoint's quantized
//! `lm_head`, a handed-in packed `lm_head.weight`); a tied head under `--quantize-lm-head` is a
//! quantized copy of the embedding beside the dense embedding the step reads rows of, as on
//! the CPU. Its prefill route dequantizes QUANT_HEAD_CHUNK_ROWS vocabulary rows at a time into
//! the shared workspace (`CudaDevice::quant_linear_f32_out`), which is sized for that chunk,
//! not for the whole head.

mod hf_rows;
mod pack;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

use crate::artifact::{RawTensor, WeightStore};
use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::CudaDevice;
use crate::config::{LayerType, ModelConfig};
use crate::model::cpu::dflash::DflashConfig;
use crate::model::names;
use crate::model::cpu::quant_load::{checked_hf_quant, hf_weight};
use crate::model::LoadOptions;
use crate::quant::{self, HfQuantConfig, QuantFormat, QuantWeight, RawDtype};
use crate::plan::gpu::{mtp_layers_error, quant_shape_error};
use crate::{NinferError, Result};

pub use pack::Packed;

use super::linear::{Linear, LinearRoute, QuantPart, QuantWorkspace, WeightFormat};
use super::dflash::{DflashLayerWeights, DflashWeights};
use super::weights::{DevAttention, DevGdn, DevLayer, DevMixer, DevMtp, DevWeights};

/// Where packed tensors go: device buffers, or host vectors in the packing test.
pub trait Sink {
    /// A storage-type buffer.
    type W;
    /// An f32 buffer.
    type F;
    fn storage(&mut self, t: &Packed<'_>) -> Result<Self::W>;
    fn f32(&mut self, values: &[f32]) -> Result<Self::F>;
    /// The format the projections' weights are stored in.
    fn format(&self) -> WeightFormat;
    /// The decode GEMV route of a `[n, k]` projection weight.
    fn route(&self, n: usize, k: usize) -> LinearRoute;
    /// A quantized `shape` projection weight in `format`, from `encode` (which a sink that
    /// only plans need not run: `--quantize`'s encoding is the slow part of such a load) as
    /// row-stacked parts (`CudaDevice::upload_quant_parts`: one payload, or NVFP4's parts each
    /// with its tensor divisor), its last rows the dense `tail` where one is given: the
    /// `Linear`'s placeholder `w` and its device part (None where the sink runs nothing).
    fn quant(&mut self, format: QuantFormat, shape: [usize; 2], encode: impl FnOnce() -> Result<Vec<QuantWeight>>, tail: Option<&Packed<'_>>) -> Result<(Self::W, Option<QuantPart>)>;
    /// Whether `--quantize` progress is shown while building (the device load, on a terminal).
    fn shows_progress(&self) -> bool {
        false
    }
    /// Refuses a stored FP8 / NVFP4 weight whose scales (all of `t` that is read) let values
    /// exceed what this sink stores: a plan for an f16-storage device does; the device
    /// refuses again at upload.
    fn check_range(&self, _t: &quant::QuantTensor<'_>) -> Result<()> {
        Ok(())
    }
}

/// What the projections are held in beyond the checkpoint's dense tensors: `--quantize`'s
/// format, packed tensors handed in by name (`LoadOptions::quant_tensors`), and a quantized HF
/// checkpoint's own format (its config.json `quantization_config`).
#[derive(Clone, Default)]
pub struct QuantLoad {
    pub quantize: Option<QuantFormat>,
    /// `--quantize-lm-head`: the LM head in `quantize`'s format too.
    pub quantize_lm_head: bool,
    pub given: Option<Arc<HashMap<String, QuantWeight>>>,
    pub hf: Option<HfQuantConfig>,
}

impl QuantLoad {
    /// Only `--quantize` (or nothing).
    pub fn quantize(quantize: Option<QuantFormat>) -> Self {
        QuantLoad { quantize, ..Default::default() }
    }

    /// The quantization of a load of the checkpoint in `dir` with `opts`: `--quantize` on an
    /// already quantized checkpoint is refused, as on the CPU.
    pub fn new(dir: &std::path::Path, opts: &LoadOptions) -> Result<Self> {
        let hf = checked_hf_quant(dir, opts)?;
        Ok(QuantLoad { quantize: opts.quantize.map(|m| m.format()), quantize_lm_head: opts.quantize_lm_head, given: opts.quant_tensors.clone(), hf })
    }

    /// Refuses a handed-in tensor the load took no place for (names in `used`); `skip_mtp`: the
    /// MTP head's (`mtp.*`) are the MTP load's.
    fn refuse_unused(&self, used: &BTreeSet<String>, skip_mtp: bool) -> Result<()> {
        let Some(g) = self.given.as_deref() else { return Ok(()) };
        let mut unused: Vec<&String> = g.keys().filter(|n| !used.contains(*n) && !(skip_mtp && n.starts_with("mtp."))).collect();
        unused.sort();
        match unused.first() {
            None => Ok(()),
            Some(name) => Err(NinferError::QuantTensor {
                name: name.to_string(),
                format: g[*name].format.name().to_string(),
                reason: "handed in, but the CUDA backend holds no projection of that name packed (embeddings stay dense there)".into(),
            }),
        }
    }
}

/// `--quantize nvfp4`'s packed parts of a fused projection: the plan's rule too.
pub use crate::plan::gpu::nvfp4_held_parts;

/// Bytes a quantized weight holds: its payload and companions.
fn quant_bytes(w: &QuantWeight) -> usize {
    w.data.len() + [&w.scale, &w.zero, &w.g_idx].into_iter().flatten().map(|r| r.bytes.len()).sum::<usize>()
}

/// Describes every device tensor of `cfg` from `store` and hands it to `sink`, in checkpoint
/// order (layers first), checking names, shapes and dtypes as `ModelWeights::load` does.
/// `quant`: `--quantize` and the handed-in packed tensors of the projections (the embedding
/// stays dense; the LM head is quantized as the module docs say).
pub fn build<S: Sink>(sink: &mut S, store: &WeightStore, cfg: &ModelConfig, quant: &QuantLoad) -> Result<DevWeights<S::W, S::F>> {
    let used = RefCell::new(BTreeSet::new());
    let b = Builder { store, cfg, quantize: quant.quantize, given: quant.given.as_deref(), hf: quant.hf, used: &used };
    let prefix = names::decoder_prefix(store);
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut layers = Vec::with_capacity(cfg.layer_types.len());
    let mut bytes = 0;
    let progress = quant.quantize.filter(|_| sink.shows_progress() && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        if let Some(f) = progress {
            eprint!("\rninfer: quantizing to {}: layer {}/{}", f.name(), i + 1, cfg.layer_types.len());
        }
        layers.push(b.layer(sink, &names::layer(prefix, i), *kind, &mut bytes)?);
    }
    if progress.is_some() {
        eprintln!();
    }
    let head_format = quant.quantize.filter(|_| quant.quantize_lm_head);
    let embed_name = format!("{prefix}.embed_tokens.weight");
    let lm_head = if cfg.tie_word_embeddings {
        // A quantized copy of the embedding where the format holds its shape; else the step
        // multiplies by the dense embedding itself.
        match head_format.filter(|f| matches!(quant::payload_bytes(*f, [v, h]), Some(Ok(_)))) {
            Some(f) => {
                let copy = Builder { quantize: Some(f), given: None, hf: None, ..b };
                Some(copy.linear(sink, Packed::single(store.raw(&embed_name, &[v, h])?), h, &mut bytes)?)
            }
            None => None,
        }
    } else {
        let head = Builder { quantize: head_format, ..b };
        Some(head.projection(sink, &[("lm_head".to_string(), v)], h, None, None, &mut bytes)?)
    };
    let embed = b.put(sink, Packed::single(store.raw(&embed_name, &[v, h])?), &mut bytes)?;
    let final_norm = b.put(sink, Packed::single(store.raw(&format!("{prefix}.norm.weight"), &[h])?), &mut bytes)?;
    quant.refuse_unused(&used.borrow(), store.contains("mtp.fc.weight"))?;
    Ok(DevWeights { embed, layers, final_norm, lm_head, bytes, norm_plus_one: cfg.zero_centered_norm })
}

/// The MTP head of `cfg` from `store` (`mtp.*`, Qwen3.5 naming), handed to `sink` as the
/// CPU loader reads it (`model::cpu::weights`); None when the checkpoint has no `mtp.fc`.
/// Drafting runs one MTP layer, so a checkpoint with more is refused.
pub fn build_mtp<S: Sink>(sink: &mut S, store: &WeightStore, cfg: &ModelConfig, quant: &QuantLoad) -> Result<Option<DevMtp<S::W, S::F>>> {
    if !store.contains("mtp.fc.weight") {
        return Ok(None);
    }
    let mut n_layers = 0;
    while store.contains(&format!("mtp.layers.{n_layers}.input_layernorm.weight")) {
        n_layers += 1;
    }
    if let Some(e) = mtp_layers_error(n_layers.max(cfg.mtp_num_layers).max(1)) {
        return Err(e);
    }
    let used = RefCell::new(BTreeSet::new());
    let b = Builder { store, cfg, quantize: quant.quantize, given: quant.given.as_deref(), hf: quant.hf, used: &used };
    let h = cfg.hidden_size;
    let mut bytes = 0;
    let norm = |sink: &mut S, name: &str, bytes: &mut usize| b.put(sink, Packed::single(store.raw(name, &[h])?), bytes);
    let fc = b.projection(sink, &[("mtp.fc".into(), h)], 2 * h, None, None, &mut bytes)?;
    let pre_fc_norm_embedding = norm(sink, "mtp.pre_fc_norm_embedding.weight", &mut bytes)?;
    let pre_fc_norm_hidden = norm(sink, "mtp.pre_fc_norm_hidden.weight", &mut bytes)?;
    let layer = b.layer(sink, "mtp.layers.0", LayerType::FullAttention, &mut bytes)?;
    let norm = norm(sink, "mtp.norm.weight", &mut bytes)?;
    let mut used = used.borrow().clone();
    // The main load's names: only the MTP head's (`mtp.*`) are checked here.
    used.extend(quant.given.iter().flat_map(|g| g.keys()).filter(|n| !n.starts_with("mtp.")).cloned());
    quant.refuse_unused(&used, false)?;
    Ok(Some(DevMtp { fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layer, norm, bytes }))
}

/// The DFlash drafter in `store` (its public layout: `fc`, `hidden_norm`, `norm`,
/// `layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
/// self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}`) of shape `d`, handed to `sink` dense in the
/// storage type (`--quantize` leaves it dense: it is small beside the target). `cfg` is the
/// target's (the builder reads nothing of it for these tensors).
pub(super) fn build_dflash<S: Sink>(sink: &mut S, store: &WeightStore, cfg: &ModelConfig, d: &DflashConfig) -> Result<DflashWeights<S::W>> {
    let used = RefCell::new(BTreeSet::new());
    let b = Builder { store, cfg, quantize: None, given: None, hf: None, used: &used };
    let (h, hd, inter) = (d.hidden_size, d.head_dim, d.intermediate_size);
    let (qd, kvd) = (d.num_heads * hd, d.num_kv_heads * hd);
    let mut bytes = 0;
    let norm = |sink: &mut S, name: &str, n: usize, bytes: &mut usize| b.put(sink, Packed::single(store.raw(name, &[n])?), bytes);
    let proj = |sink: &mut S, parts: &[(String, usize)], k: usize, bias: bool, bytes: &mut usize| {
        let bias = b.biases(parts.iter().map(|(name, rows)| (name.as_str(), *rows)), bias)?;
        b.projection(sink, parts, k, None, bias, bytes)
    };
    let fc = proj(sink, &[("fc".into(), h)], d.target_layer_ids.len() * h, false, &mut bytes)?;
    let mut layers = Vec::with_capacity(d.num_layers);
    for i in 0..d.num_layers {
        let p = format!("layers.{i}");
        let a = format!("{p}.self_attn");
        let ab = d.attention_bias;
        layers.push(DflashLayerWeights {
            input_norm: norm(sink, &format!("{p}.input_layernorm.weight"), h, &mut bytes)?,
            post_norm: norm(sink, &format!("{p}.post_attention_layernorm.weight"), h, &mut bytes)?,
            q: proj(sink, &[(format!("{a}.q_proj"), qd)], h, ab, &mut bytes)?,
            kv: proj(sink, &[(format!("{a}.k_proj"), kvd), (format!("{a}.v_proj"), kvd)], h, ab, &mut bytes)?,
            o: proj(sink, &[(format!("{a}.o_proj"), h)], qd, ab, &mut bytes)?,
            q_norm: norm(sink, &format!("{a}.q_norm.weight"), hd, &mut bytes)?,
            k_norm: norm(sink, &format!("{a}.k_norm.weight"), hd, &mut bytes)?,
            gate_up: proj(sink, &[(format!("{p}.mlp.gate_proj"), inter), (format!("{p}.mlp.up_proj"), inter)], h, false, &mut bytes)?,
            down: proj(sink, &[(format!("{p}.mlp.down_proj"), h)], inter, false, &mut bytes)?,
        });
    }
    let hidden_norm = norm(sink, "hidden_norm.weight", h, &mut bytes)?;
    let norm = norm(sink, "norm.weight", h, &mut bytes)?;
    Ok(DflashWeights { fc, hidden_norm, norm, layers, bytes })
}

/// Refuses a quantized projection whose shape the GPU kernels cannot run, before any weight is
/// read (`plan::gpu::quant_shape_error`; the device checks each weight again at upload).
fn refuse_shape(name: &str, format: QuantFormat, k: usize) -> Result<()> {
    quant_shape_error(name, format, k).map_or(Ok(()), Err)
}

#[derive(Clone, Copy)]
struct Builder<'a> {
    store: &'a WeightStore,
    cfg: &'a ModelConfig,
    quantize: Option<QuantFormat>,
    given: Option<&'a HashMap<String, QuantWeight>>,
    /// The checkpoint's own quantization (None: dense).
    hf: Option<HfQuantConfig>,
    /// Handed-in tensors taken.
    used: &'a RefCell<BTreeSet<String>>,
}

impl<'a> Builder<'a> {
    fn put<S: Sink>(&self, sink: &mut S, t: Packed<'_>, bytes: &mut usize) -> Result<S::W> {
        *bytes += 2 * t.numel();
        sink.storage(&t)
    }

    fn put_f32<S: Sink>(&self, sink: &mut S, name: &str, n: usize, bytes: &mut usize) -> Result<S::F> {
        let values = self.store.load_f32(name, &[n])?;
        *bytes += 4 * n;
        sink.f32(&values)
    }

    fn linear<S: Sink>(&self, sink: &mut S, t: Packed<'_>, k: usize, bytes: &mut usize) -> Result<Linear<S::W>> {
        self.linear_biased(sink, t, k, None, bytes)
    }

    /// A projection with its bias (`[n]`, the parts in the order of the weight's), if any, in
    /// the sink's format and with the route it gives the shape.
    fn linear_biased<S: Sink>(&self, sink: &mut S, t: Packed<'_>, k: usize, bias: Option<Packed<'_>>, bytes: &mut usize) -> Result<Linear<S::W>> {
        let n = t.numel() / k;
        let given: Vec<Option<&QuantWeight>> = t.part_names().map(|name| self.given.and_then(|g| g.get(name))).collect();
        let (w, format, quant) = if given.iter().any(Option::is_some) {
            let given: Vec<&QuantWeight> = given.into_iter().collect::<Option<_>>().ok_or_else(|| {
                NinferError::Unsupported(format!("{}: only some parts of this fused projection are handed in packed; the CUDA backend holds it as one matrix", t.name()))
            })?;
            self.used.borrow_mut().extend(t.part_names().map(str::to_string));
            let parts = t.concat_rows(&given, k)?;
            *bytes += parts.iter().map(|w| crate::plan::gpu::quant_device_bytes(w.format, w.shape, quant_bytes(w))).sum::<usize>();
            let f = parts[0].format;
            refuse_shape(&t.name(), f, k)?;
            for p in &parts {
                sink.check_range(&p.view())?;
            }
            let (w, quant) = sink.quant(f, [n, k], || Ok(parts), None)?;
            (w, WeightFormat::Quant(f), quant)
        } else if let Some(held) = self.quantize.filter(|f| *f == QuantFormat::Nvfp4).and_then(|_| nvfp4_held_parts(&t.part_rows(k), k)) {
            // Each part encoded on its own (its own tensor divisor), as the CPU loader encodes
            // it; the parts the layout cannot hold after them are the dense tail.
            let f = QuantFormat::Nvfp4;
            refuse_shape(&t.name(), f, k)?;
            let rows = t.part_rows(k);
            let names: Vec<String> = t.part_names().map(str::to_string).collect();
            let (qt, tail) = t.split_at_part(held);
            *bytes += rows[..held].iter().map(|r| crate::plan::gpu::quant_device_bytes(f, [*r, k], quant::payload_bytes(f, [*r, k]).and_then(|b| b.ok()).unwrap_or(0))).sum::<usize>() + 2 * tail.as_ref().map_or(0, Packed::numel);
            let encode = || {
                let values = qt.values_f32();
                let mut r0 = 0;
                let mut parts = Vec::with_capacity(held);
                for (name, r) in names.iter().zip(&rows[..held]) {
                    let part = &values[r0 * k..(r0 + r) * k];
                    parts.push(QuantWeight::packed(name.as_str(), f, [*r, k], quant::quantize(f, name, part, [*r, k])?));
                    r0 += r;
                }
                Ok(parts)
            };
            let (w, quant) = sink.quant(f, [n, k], encode, tail.as_ref())?;
            (w, WeightFormat::Quant(f), quant)
        } else if let Some(Some(Ok(size))) = self.quantize.filter(|f| *f != QuantFormat::Nvfp4).map(|f| quant::payload_bytes(f, [n, k])) {
            // A shape the format cannot hold stays dense, as on the CPU (`quant_load`).
            let f = self.quantize.expect("matched");
            refuse_shape(&t.name(), f, k)?;
            *bytes += crate::plan::gpu::quant_device_bytes(f, [n, k], size);
            let (w, quant) = sink.quant(f, [n, k], || Ok(vec![QuantWeight::packed(t.name(), f, [n, k], quant::quantize(f, &t.name(), &t.values_f32(), [n, k])?)]), None)?;
            (w, WeightFormat::Quant(f), quant)
        } else {
            (self.put(sink, t, bytes)?, sink.format(), None)
        };
        let bias = bias.map(|b| self.put(sink, b, bytes)).transpose()?;
        let route = if matches!(format, WeightFormat::Quant(_)) { LinearRoute::quantized() } else { sink.route(n, k) };
        Ok(Linear { w, n, k, format, bias, route, quant })
    }

    /// Whether the HF checkpoint stores `module` quantized (its data tensor present; for FP8,
    /// an F8_E4M3 `weight`), as the CPU loader decides (`quant_load::hf_weight`).
    fn hf_quantized(&self, module: &str) -> Result<bool> {
        let Some(c) = &self.hf else { return Ok(false) };
        let data = c.tensor_names(module).data;
        if !self.store.contains(&data) {
            return Ok(false);
        }
        Ok(!matches!(c.format, QuantFormat::HfFp8Block { .. }) || self.store.info(&data)?.dtype == "F8_E4M3")
    }

    /// Refuses the HF-quantized `modules` of one fused projection (`name`) where they store
    /// different g_idx (act-order input groups): the fused weight has one.
    fn same_g_idx(&self, c: &HfQuantConfig, name: &str, modules: &[(String, usize)]) -> Result<()> {
        let stored = modules
            .iter()
            .map(|(m, _)| c.tensor_names(m).g_idx.filter(|g| self.store.contains(g)).map(|g| self.store.stored(&g).map(|(_, b)| b)).transpose())
            .collect::<Result<Vec<Option<&[u8]>>>>()?;
        if stored.iter().any(|g| *g != stored[0]) {
            return Err(NinferError::Unsupported(format!(
                "{name}: {} parts with different g_idx (act-order input groups) on the CUDA backend (which holds this fused projection as one matrix; the CPU backend loads it)",
                c.format.name()
            )));
        }
        Ok(())
    }

    /// `Sink::check_range` of the HF-quantized `module` (`[rows, k]`) from its stored scale
    /// tensor alone (mapped: only its pages are read), before any weight is read.
    fn check_stored_range<S: Sink>(&self, sink: &S, c: &HfQuantConfig, module: &str, rows: usize, k: usize) -> Result<()> {
        let names = c.tensor_names(module);
        if !matches!(c.format, QuantFormat::HfFp8Block { .. }) || !self.store.contains(&names.scale) {
            return Ok(());
        }
        let (info, bytes) = self.store.stored(&names.scale)?;
        let Some(dtype) = RawDtype::from_safetensors(&info.dtype) else { return Ok(()) };
        let scale = quant::RawTensor { name: &names.scale, dtype, shape: info.shape, bytes };
        sink.check_range(&quant::QuantTensor { name: &names.data, format: c.format, shape: [rows, k], data: &[], scale: Some(scale), zero: None, g_idx: None })
    }

    /// Bytes the stored tensors of the HF-quantized `modules` take once fused (one g_idx for all).
    fn hf_bytes(&self, c: &HfQuantConfig, modules: &[(String, usize)]) -> Result<usize> {
        let (mut total, mut g_idx, mut g_count) = (0usize, 0usize, 0usize);
        for (m, _) in modules {
            let names = c.tensor_names(m);
            for (i, name) in [Some(names.data), Some(names.scale), names.zero, names.g_idx].into_iter().enumerate() {
                let Some(name) = name.filter(|n| self.store.contains(n)) else { continue };
                let info = self.store.info(&name)?;
                let size = RawDtype::from_safetensors(&info.dtype).map_or(1, |d| d.size()) * info.shape.iter().product::<usize>();
                total += size;
                if i == 3 {
                    (g_idx, g_count) = (size, g_count + 1);
                }
            }
        }
        Ok(total - g_idx * g_count.saturating_sub(1))
    }

    /// The projection whose weight is the checkpoint modules `modules` (`(name, rows)` each,
    /// `[rows, k]`) stacked in order, the first one's rows reordered from Qwen3.5's per-head
    /// `[query | gate]` to all queries then all gates where `gated_heads` gives the head count;
    /// `bias` packed as the rows are. HF-quantized modules are held as stored, gathered into one
    /// weight, with dense modules after them as its dense tail; an all-dense projection as
    /// `linear_biased` holds it.
    fn projection<S: Sink>(&self, sink: &mut S, modules: &[(String, usize)], k: usize, gated_heads: Option<usize>, bias: Option<Packed<'_>>, bytes: &mut usize) -> Result<Linear<S::W>> {
        let quantized = modules.iter().map(|(m, _)| self.hf_quantized(m)).collect::<Result<Vec<bool>>>()?;
        if !quantized.iter().any(|q| *q) {
            let parts = modules.iter().map(|(m, rows)| self.weight(m, *rows, k)).collect::<Result<Vec<_>>>()?;
            let mut t = Packed::concat(parts);
            if let Some(nh) = gated_heads {
                t = t.permute_first_part(2 * nh, |d| names::gated_query_source_block(d, nh));
            }
            return self.linear_biased(sink, t, k, bias, bytes);
        }
        let c = self.hf.expect("quantized modules");
        // Quantized parts first, then dense ones: those are the weight's dense tail.
        let nq_parts = quantized.iter().take_while(|q| **q).count();
        let name = modules.iter().map(|(m, _)| format!("{m}.weight")).collect::<Vec<_>>().join("|");
        if let Some(i) = quantized.iter().position(|q| !q).filter(|_| quantized[nq_parts..].iter().any(|q| *q)) {
            return Err(NinferError::Unsupported(format!(
                "{name}: a fused projection with a dense part ({}.weight) before {} ones on the CUDA backend (which holds it as one matrix, dense rows only after the quantized; the CPU backend loads it)",
                modules[i].0,
                c.format.name()
            )));
        }
        let (quant_modules, dense_modules) = modules.split_at(nq_parts);
        let tail = if dense_modules.is_empty() {
            None
        } else {
            Some(Packed::concat(dense_modules.iter().map(|(m, rows)| self.weight(m, *rows, k)).collect::<Result<Vec<_>>>()?))
        };
        let rows: Vec<usize> = quant_modules.iter().map(|(_, r)| *r).collect();
        let n = modules.iter().map(|(_, r)| *r).sum();
        let mut segs = hf_rows::concat(&rows);
        if let Some(nh) = gated_heads {
            segs = hf_rows::permute_first(segs, 2 * nh, |d| names::gated_query_source_block(d, nh));
        }
        // Refused here, before any weight is read (the plan pass), rather than mid-upload.
        let quant_name = quant_modules.iter().map(|(m, _)| format!("{m}.weight")).collect::<Vec<_>>().join("|");
        if let Some(e) = hf_rows::cut_error(&quant_name, c.format, quant_modules, &segs) {
            return Err(e);
        }
        self.same_g_idx(&c, &quant_name, quant_modules)?;
        refuse_shape(&quant_name, c.format, k)?;
        for (m, r) in quant_modules {
            self.check_stored_range(sink, &c, m, *r, k)?;
        }
        let nq: usize = rows.iter().sum();
        *bytes += crate::plan::gpu::quant_device_bytes(c.format, [nq, k], self.hf_bytes(&c, quant_modules)?) + 2 * tail.as_ref().map_or(0, Packed::numel);
        let store = self.store;
        let encode = || {
            let parts = quant_modules
                .iter()
                .map(|(m, r)| {
                    let w = hf_weight(store, &c, m, *r, k)?.ok_or_else(|| NinferError::Device(format!("{m}: stored quantized, then not found")))?;
                    quant::validate(&w.view())?;
                    Ok(w)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(vec![hf_rows::gather(&quant_name, &parts, &segs, k)?])
        };
        let (w, quant) = sink.quant(c.format, [n, k], encode, tail.as_ref())?;
        let bias = bias.map(|b| self.put(sink, b, bytes)).transpose()?;
        Ok(Linear { w, n, k, format: WeightFormat::Quant(c.format), bias, route: LinearRoute::quantized(), quant })
    }

    /// `{name}.bias` of each part (`[rows]`), packed in order, where `on`.
    fn biases<'n>(&self, parts: impl IntoIterator<Item = (&'n str, usize)>, on: bool) -> Result<Option<Packed<'a>>> {
        if !on {
            return Ok(None);
        }
        let raws = parts.into_iter().map(|(name, rows)| self.store.raw(&format!("{name}.bias"), &[rows])).collect::<Result<Vec<_>>>()?;
        Ok(Some(Packed::concat(raws)))
    }

    /// Decoder layer `p` (a `{prefix}.layers.{i}` or `mtp.layers.{i}`) with the mixer `kind`.
    fn layer<S: Sink>(&self, sink: &mut S, p: &str, kind: LayerType, bytes: &mut usize) -> Result<DevLayer<S::W, S::F>> {
        let (store, cfg, h) = (self.store, self.cfg, self.cfg.hidden_size);
        let mixer = match kind {
            LayerType::FullAttention => DevMixer::Attention(Box::new(self.attention(sink, &names::mixer(p, kind), bytes)?)),
            LayerType::LinearAttention => DevMixer::Gdn(Box::new(self.gdn(sink, &names::mixer(p, kind), bytes)?)),
        };
        let gate_up_parts = names::gate_up(cfg, p);
        let gate_up: Vec<(String, usize)> = gate_up_parts.iter().map(|part| (part.name.clone(), part.rows)).collect();
        let gate_up_bias = self.biases(gate_up_parts.iter().map(|part| (part.name.as_str(), part.rows)), cfg.mlp_bias)?;
        let down_name = format!("{p}.mlp.down_proj");
        let down_bias = self.biases([(down_name.as_str(), h)], cfg.mlp_bias)?;
        Ok(DevLayer {
            input_norm: self.put(sink, Packed::single(store.raw(&format!("{p}.input_layernorm.weight"), &[h])?), bytes)?,
            post_norm: self.put(sink, Packed::single(store.raw(&format!("{p}.post_attention_layernorm.weight"), &[h])?), bytes)?,
            mixer,
            gate_up: self.projection(sink, &gate_up, h, None, gate_up_bias, bytes)?,
            down: self.projection(sink, &[(down_name.clone(), h)], cfg.intermediate_size, None, down_bias, bytes)?,
        })
    }

    fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<RawTensor<'a>> {
        self.store.raw(&format!("{name}.weight"), &[rows, cols])
    }

    fn attention<S: Sink>(&self, sink: &mut S, p: &str, bytes: &mut usize) -> Result<DevAttention<S::W>> {
        let c = self.cfg;
        let (h, nh, hd) = (c.hidden_size, c.num_attention_heads, c.head_dim);
        let qkv_parts = names::attention_qkv(c, p);
        let parts: Vec<(String, usize)> = qkv_parts.iter().map(|part| (part.name.clone(), part.rows)).collect();
        // CudaModel::check_supported refuses q/k/v biases beside the gated query layout.
        let qkv_bias = self.biases(qkv_parts.iter().map(|part| (part.name.as_str(), part.rows)), c.qkv_bias)?;
        let o_name = format!("{p}.o_proj");
        let o_bias = self.biases([(o_name.as_str(), h)], c.o_bias)?;
        let (q_norm, k_norm) = if c.qk_norm {
            let q = Packed::single(self.store.raw(&format!("{p}.q_norm.weight"), &[hd])?);
            let k = Packed::single(self.store.raw(&format!("{p}.k_norm.weight"), &[hd])?);
            (Some(self.put(sink, q, bytes)?), Some(self.put(sink, k, bytes)?))
        } else {
            (None, None)
        };
        Ok(DevAttention {
            qkv: self.projection(sink, &parts, h, c.attn_output_gate.then_some(nh), qkv_bias, bytes)?,
            o: self.projection(sink, &[(o_name.clone(), h)], nh * hd, None, o_bias, bytes)?,
            q_norm,
            k_norm,
        })
    }

    fn gdn<S: Sink>(&self, sink: &mut S, p: &str, bytes: &mut usize) -> Result<DevGdn<S::W, S::F>> {
        let c = self.cfg;
        let la = c.linear_attention.ok_or_else(|| NinferError::config("linear_num_key_heads", "missing for a linear_attention layer"))?;
        let (h, cd, vd, nv) = (c.hidden_size, la.conv_dim(), la.value_dim(), la.num_value_heads);
        let in_proj: Vec<(String, usize)> = names::gdn_in_proj(c, p)?.iter().map(|part| (part.name.clone(), part.rows)).collect();
        let conv_b_name = format!("{p}.conv1d.bias");
        let conv_b = if self.store.contains(&conv_b_name) { Some(self.put(sink, Packed::single(self.store.raw(&conv_b_name, &[cd])?), bytes)?) } else { None };
        Ok(DevGdn {
            in_proj: self.projection(sink, &in_proj, h, None, None, bytes)?,
            conv_w: self.put(sink, Packed::single(self.store.raw(&format!("{p}.conv1d.weight"), &[cd, 1, la.conv_kernel])?), bytes)?,
            conv_b,
            a_log: self.put_f32(sink, &format!("{p}.A_log"), nv, bytes)?,
            dt_bias: self.put_f32(sink, &format!("{p}.dt_bias"), nv, bytes)?,
            norm: self.put(sink, Packed::single(self.store.raw(&format!("{p}.norm.weight"), &[la.value_head_dim])?), bytes)?,
            out: self.projection(sink, &[(format!("{p}.out_proj"), h)], vd, None, None, bytes)?,
        })
    }
}

/// Staging buffers in the ring: with four, three chunks can be in flight on the copy engine
/// while the host fills the fourth.
const STAGES: usize = 4;
/// Elements per staging buffer (32 MiB of 16-bit values).
const STAGE_ELEMS: usize = 16 << 20;

/// A host buffer the copy engine reads from: pinned when the driver grants it (asynchronous
/// copies), pageable otherwise (the driver then copies synchronously; slower, still correct).
enum Stage {
    Pinned(PinnedHostSlice<u16>),
    Pageable(Vec<u16>),
}

/// Streams packed tensors onto a device through the staging ring.
pub struct DeviceSink<'a> {
    dev: &'a CudaDevice,
    stages: Vec<(Stage, CudaEvent)>,
    next: usize,
    /// Seconds spent filling staging buffers, and waiting for a buffer's copy to finish: which
    /// side limits the load (printed with the load time).
    fill_s: f64,
    wait_s: f64,
    /// The dequantization workspace every quantized projection shares (None: all dense).
    workspace: Option<Arc<QuantWorkspace>>,
}

impl<'a> DeviceSink<'a> {
    /// Same-type tensors are copied with positioned reads (`convert` falls back to the memory
    /// mapping where a read fails). `workspace`: the dequantization workspace the quantized
    /// projections share (`workspace_for`).
    pub fn new(dev: &'a CudaDevice, workspace: Option<Arc<QuantWorkspace>>) -> Result<Self> {
        let ctx = dev.context();
        let mut stages = Vec::with_capacity(STAGES);
        for _ in 0..STAGES {
            // SAFETY: the buffer is written before any copy reads from it (`fill` covers the
            // whole prefix that is copied).
            let stage = match unsafe { ctx.alloc_pinned::<u16>(STAGE_ELEMS) } {
                Ok(p) => Stage::Pinned(p),
                Err(e) => {
                    if stages.is_empty() {
                        eprintln!("ninfer: pinned host memory unavailable ({e}); loading through pageable buffers");
                    }
                    Stage::Pageable(vec![0u16; STAGE_ELEMS])
                }
            };
            stages.push((stage, ctx.new_event(None).map_err(driver_err("creating a staging event"))?));
        }
        Ok(DeviceSink { dev, stages, next: 0, fill_s: 0.0, wait_s: 0.0, workspace })
    }
}

impl Drop for DeviceSink<'_> {
    /// Copies may still read the staging buffers: wait for them before the buffers are freed
    /// (also on an error path).
    fn drop(&mut self) {
        for (_, ev) in &self.stages {
            let _ = ev.synchronize();
        }
    }
}

impl Sink for DeviceSink<'_> {
    type W = CudaSlice<u16>;
    type F = CudaSlice<f32>;

    fn storage(&mut self, t: &Packed<'_>) -> Result<CudaSlice<u16>> {
        let stream = self.dev.stream();
        let n = t.numel();
        let mut dst = stream.alloc_zeros::<u16>(n.max(1)).map_err(|e| out_of_memory(self.dev, 2 * n, e))?;
        let storage = self.dev.storage();
        let mut first = 0;
        while first < n {
            let len = STAGE_ELEMS.min(n - first);
            let (stage, ev) = &mut self.stages[self.next];
            self.next = (self.next + 1) % STAGES;
            // The copy that last read this buffer must be done before it is refilled.
            let clock = std::time::Instant::now();
            ev.synchronize().map_err(driver_err("waiting for a staging buffer"))?;
            self.wait_s += clock.elapsed().as_secs_f64();
            let clock = std::time::Instant::now();
            let host: &mut [u16] = match stage {
                Stage::Pinned(p) => &mut p.as_mut_slice().map_err(driver_err("mapping a staging buffer"))?[..len],
                Stage::Pageable(v) => &mut v[..len],
            };
            t.fill(first, host, storage, true)?;
            self.fill_s += clock.elapsed().as_secs_f64();
            stream.memcpy_htod(&*host, &mut dst.slice_mut(first..first + len)).map_err(driver_err("uploading weights"))?;
            ev.record(stream).map_err(driver_err("recording a staging event"))?;
            first += len;
        }
        Ok(dst)
    }

    fn f32(&mut self, values: &[f32]) -> Result<CudaSlice<f32>> {
        self.dev.stream().clone_htod(values).map_err(driver_err("uploading weights"))
    }

    fn format(&self) -> WeightFormat {
        self.dev.storage().into()
    }

    fn route(&self, n: usize, k: usize) -> LinearRoute {
        LinearRoute::on_device(self.dev, n, k)
    }

    fn shows_progress(&self) -> bool {
        true
    }

    fn quant(&mut self, _format: QuantFormat, _shape: [usize; 2], encode: impl FnOnce() -> Result<Vec<QuantWeight>>, tail: Option<&Packed<'_>>) -> Result<(CudaSlice<u16>, Option<QuantPart>)> {
        let parts = encode()?;
        let name = parts.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join("|");
        let workspace = self.workspace.clone().ok_or_else(|| NinferError::Device(format!("{name}: quantized, but the load planned no dequantization workspace")))?;
        let mut bits = vec![0u16; tail.map_or(0, Packed::numel)];
        if let Some(t) = tail {
            t.fill(0, &mut bits, self.dev.storage(), false)?;
        }
        let weight = self.dev.upload_quant_parts(&parts, &bits)?;
        let placeholder = self.dev.stream().alloc_zeros::<u16>(1).map_err(|e| NinferError::Device(format!("allocating {name}: {e}")))?;
        Ok((placeholder, Some(QuantPart::new(self.dev, weight, workspace)?)))
    }
}

fn out_of_memory(dev: &CudaDevice, needed: usize, e: cudarc::driver::DriverError) -> NinferError {
    NinferError::OutOfMemory {
        what: format!("model weights on cuda:{} ({e})", dev.ordinal()),
        needed: needed as u64,
        available: dev.memory_info().map(|(f, _)| f as u64).unwrap_or(0),
        hint: "the weights alone do not fit this device; use a smaller model or device=\"cpu\"".into(),
    }
}

/// A sink that allocates and reads nothing: `build` through it checks every name, shape and
/// dtype and totals the device bytes, so that a model that cannot fit is refused with its whole
/// size before the first upload (the one tensor whose allocation failed would name a fraction).
/// Its projections get `format` and the CUDA-core route: a plan runs nothing.
struct PlanSink {
    format: WeightFormat,
    /// The f16-storage device the plan is for, named where a weight's scales exceed binary16's
    /// range (`quant::f16_range_error`); None: no such check.
    f16_device: Option<String>,
}

impl PlanSink {
    /// A plan in `format` that checks no value range.
    fn new(format: WeightFormat) -> Self {
        PlanSink { format, f16_device: None }
    }

    /// The plan of a load onto `dev`, in its storage type.
    fn of(dev: &CudaDevice) -> Self {
        let format = dev.storage().into();
        PlanSink { format, f16_device: (format == WeightFormat::F16).then(|| dev.describe()) }
    }
}

impl Sink for PlanSink {
    type W = ();
    type F = ();

    fn storage(&mut self, _t: &Packed<'_>) -> Result<()> {
        Ok(())
    }

    fn f32(&mut self, _values: &[f32]) -> Result<()> {
        Ok(())
    }

    fn format(&self) -> WeightFormat {
        self.format
    }

    fn route(&self, _n: usize, k: usize) -> LinearRoute {
        LinearRoute::cuda_cores(k)
    }

    fn quant(&mut self, _format: QuantFormat, _shape: [usize; 2], _encode: impl FnOnce() -> Result<Vec<QuantWeight>>, _tail: Option<&Packed<'_>>) -> Result<((), Option<QuantPart>)> {
        Ok(((), None))
    }

    fn check_range(&self, t: &quant::QuantTensor<'_>) -> Result<()> {
        match self.f16_device.as_deref().and_then(|device| quant::f16_range_error(t, device)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The shared dequantization workspace `linears` need (storage elements): the largest quantized
/// projection's N x K, and for a quantized LM head (`head`) a chunk of QUANT_HEAD_CHUNK_ROWS
/// vocabulary rows (its prefill route's), not the whole head.
fn workspace_elems<'l, W: 'l>(linears: impl IntoIterator<Item = &'l Linear<W>>, head: Option<&Linear<W>>) -> usize {
    let quantized = |l: &&Linear<W>| matches!(l.format, WeightFormat::Quant(_));
    let body = linears.into_iter().filter(quantized).map(|l| l.n * l.k).max().unwrap_or(0);
    let head = head.filter(quantized).map_or(0, |l| l.n.min(crate::plan::ledger::QUANT_HEAD_CHUNK_ROWS) * l.k);
    body.max(head)
}

/// The projections of a layer (fused as the step runs them).
fn layer_linears<W, F>(l: &DevLayer<W, F>) -> [&Linear<W>; 4] {
    let [a, b] = match &l.mixer {
        DevMixer::Attention(a) => [&a.qkv, &a.o],
        DevMixer::Gdn(g) => [&g.in_proj, &g.out],
    };
    [a, b, &l.gate_up, &l.down]
}

/// The workspace for quantized projections of up to `quant_elems` elements (the plan's
/// `Planned::quant_elems`): `shared` where it is large enough, else a new one; None for none.
fn workspace_for(dev: &CudaDevice, quant_elems: usize, shared: Option<Arc<QuantWorkspace>>) -> Result<Option<Arc<QuantWorkspace>>> {
    match shared {
        _ if quant_elems == 0 => Ok(None),
        Some(w) if w.elems() >= quant_elems => Ok(Some(w)),
        _ => Ok(Some(QuantWorkspace::new(dev, quant_elems)?)),
    }
}

/// What a load of the weights will hold, from a `PlanSink` pass.
pub struct Planned {
    /// Device bytes of the weights.
    pub bytes: usize,
    /// The largest quantized projection's N x K: the shared dequantization workspace.
    pub quant_elems: usize,
    /// The smallest K of the quantized projections (the layers' and the LM head's), None for
    /// none: which form the tiled 4-bit GEMVs run (`quant_tiles::q4t_ring`).
    pub min_quant_k: Option<usize>,
}

/// Device bytes the weights of `cfg` in `store` take in `format` (every tensor checked as the
/// load will).
pub fn planned_weight_bytes(cfg: &ModelConfig, store: &WeightStore, format: WeightFormat, quant: &QuantLoad) -> Result<usize> {
    Ok(plan(cfg, store, format, quant)?.bytes)
}

/// The weights of `cfg` in `store` as a load in `format` with `quantize` will hold them (every
/// tensor checked, and quantized, as the load will).
pub fn plan(cfg: &ModelConfig, store: &WeightStore, format: WeightFormat, quant: &QuantLoad) -> Result<Planned> {
    plan_with(PlanSink::new(format), cfg, store, quant)
}

fn plan_with(mut sink: PlanSink, cfg: &ModelConfig, store: &WeightStore, quant: &QuantLoad) -> Result<Planned> {
    let w = build(&mut sink, store, cfg, quant)?;
    let quant_elems = workspace_elems(w.layers.iter().flat_map(layer_linears), w.lm_head.as_ref());
    let min_quant_k = w.layers.iter().flat_map(layer_linears).chain(w.lm_head.as_ref()).filter(|l| matches!(l.format, WeightFormat::Quant(_))).map(|l| l.k).min();
    Ok(Planned { bytes: w.bytes, quant_elems, min_quant_k })
}

/// The CUDA loader's refusals of a load of `cfg` with `quant` (and of its MTP head where
/// `mtp`), before any weight is read: the configuration's (`CudaModel::check_supported`) and,
/// with the checkpoint's headers (`store`), every refusal of the load's plan pass (a fused
/// projection whose parts cannot be held as one matrix: formats, widths, row units, g_idx, a
/// dense part before quantized ones; a quantized shape the kernels cannot run; more than one
/// MTP layer; with `f16_device`, the f16-storage device (sm_7x) the load is for, a stored FP8
/// / NVFP4 weight whose scales exceed binary16's range). `ninfer plan` for a GPU and the
/// engine's startup check run it, so that a plan refuses what the load would. Returns what the
/// load will hold (nothing without `store`).
pub fn check_load(cfg: &ModelConfig, store: Option<&WeightStore>, quant: &QuantLoad, mtp: bool, f16_device: Option<&str>) -> Result<Planned> {
    super::CudaModel::check_supported(cfg)?;
    let Some(store) = store else { return Ok(Planned { bytes: 0, quant_elems: 0, min_quant_k: None }) };
    let sink = || PlanSink { format: if f16_device.is_some() { WeightFormat::F16 } else { WeightFormat::Bf16 }, f16_device: f16_device.map(str::to_string) };
    let mut planned = plan_with(sink(), cfg, store, quant)?;
    let head = if mtp { build_mtp(&mut sink(), store, cfg, quant)? } else { None };
    if let Some(head) = head {
        planned.bytes += head.bytes;
        planned.quant_elems = planned.quant_elems.max(workspace_elems(layer_linears(&head.layer).into_iter().chain([&head.fc]), None));
    }
    Ok(planned)
}

impl DevWeights {
    /// The dequantization workspace the quantized projections (and a quantized LM head) share
    /// (None: all dense).
    pub fn quant_workspace(&self) -> Option<Arc<QuantWorkspace>> {
        let linears = self.layers.iter().flat_map(layer_linears).chain(self.lm_head.as_ref());
        linears.filter_map(|l| l.quant.as_ref()).map(|q| q.workspace.clone()).next()
    }

    /// Loads the weights of `cfg` from `store` onto `dev`; returns when they are on the device.
    /// `quant`: `--quantize` and the handed-in packed tensors of the projections.
    pub fn load(dev: &CudaDevice, cfg: &ModelConfig, store: &WeightStore, quant: &QuantLoad) -> Result<Self> {
        dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let planned = plan_with(PlanSink::of(dev), cfg, store, quant)?;
        // The dequantization workspace is allocated beside the weights.
        let needed = planned.bytes + 2 * planned.quant_elems;
        let (free, _) = dev.memory_info()?;
        if needed > free {
            return Err(NinferError::OutOfMemory {
                what: format!("model weights on cuda:{}", dev.ordinal()),
                needed: needed as u64,
                available: free as u64,
                hint: "the weights alone do not fit this device; use a smaller model or device=\"cpu\"".into(),
            });
        }
        let workspace = workspace_for(dev, planned.quant_elems, None)?;
        dev.set_q4_ring(dev.plan().q4_ring.unwrap_or_else(|| planned.min_quant_k.is_some_and(crate::backend::cuda::ops::quant_tiles::q4t_ring)));
        let mut sink = DeviceSink::new(dev, workspace)?;
        let w = build(&mut sink, store, cfg, quant)?;
        dev.synchronize()?;
        let pinned = sink.stages.iter().all(|(s, _)| matches!(s, Stage::Pinned(_)));
        eprintln!(
            "ninfer: weights streamed through {} staging (positioned reads): {:.1} s filling, {:.1} s waiting for copies, {} threads",
            if pinned { "pinned" } else { "pageable" },
            sink.fill_s,
            sink.wait_s,
            rayon::current_num_threads()
        );
        Ok(w)
    }
}

impl DevMtp {
    /// Loads the MTP head of `cfg` from `store` onto `dev` (None: the checkpoint has none),
    /// refusing a head that does not fit the free device memory with its size.
    /// `shared`: the model's dequantization workspace, used where it is large enough.
    pub fn load(dev: &CudaDevice, cfg: &ModelConfig, store: &WeightStore, quant: &QuantLoad, shared: Option<Arc<QuantWorkspace>>) -> Result<Option<Self>> {
        dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let Some(planned) = build_mtp(&mut PlanSink::of(dev), store, cfg, quant)? else { return Ok(None) };
        let quant_elems = workspace_elems(layer_linears(&planned.layer).into_iter().chain([&planned.fc]), None);
        let (free, _) = dev.memory_info()?;
        let reuse = shared.as_ref().is_some_and(|w| w.elems() >= quant_elems);
        if planned.bytes + if reuse { 0 } else { 2 * quant_elems } > free {
            return Err(NinferError::OutOfMemory {
                what: format!("the MTP head's weights on cuda:{} (--spec mtp)", dev.ordinal()),
                needed: planned.bytes as u64,
                available: free as u64,
                hint: "run without --spec mtp, or with --spec ngram".into(),
            });
        }
        let workspace = workspace_for(dev, quant_elems, shared)?;
        let mut sink = DeviceSink::new(dev, workspace)?;
        let mtp = build_mtp(&mut sink, store, cfg, quant)?;
        dev.synchronize()?;
        Ok(mtp)
    }
}

impl DflashWeights {
    /// Loads the DFlash drafter of shape `d` from `store` onto `dev` (`build_dflash`), refusing
    /// one that does not fit the free device memory with its size; every problem names
    /// `--drafter`.
    pub(super) fn load(dev: &CudaDevice, cfg: &ModelConfig, store: &WeightStore, d: &DflashConfig) -> Result<Self> {
        let flag = |e: NinferError| match e {
            e @ NinferError::OutOfMemory { .. } => e,
            e => NinferError::config("drafter (--drafter)", e.to_string()),
        };
        dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let planned = build_dflash(&mut PlanSink::of(dev), store, cfg, d).map_err(flag)?;
        let (free, _) = dev.memory_info()?;
        if planned.bytes > free {
            return Err(NinferError::OutOfMemory {
                what: format!("the DFlash drafter's weights on cuda:{} (--spec dflash)", dev.ordinal()),
                needed: planned.bytes as u64,
                available: free as u64,
                hint: "run without --spec dflash, or with --spec ngram".into(),
            });
        }
        let mut sink = DeviceSink::new(dev, None)?;
        let w = build_dflash(&mut sink, store, cfg, d).map_err(flag)?;
        dev.synchronize()?;
        Ok(w)
    }
}

#[cfg(test)]
mod tests;
