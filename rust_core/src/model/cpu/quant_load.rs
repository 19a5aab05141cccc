//! Where a model's quantized projection weights come from at load: a quantized Hugging Face
//! checkpoint (its config.json `quantization_config`), `--quantize` on a dense checkpoint, or
//! packed payloads handed in by tensor name (`LoadOptions::quant_tensors`: GGUF tensors the
//! tests read with the `gguf` package until NInfer reads GGUF files itself).
//!
//! Embeddings stay dense (the step reads rows of them). `--quantize` leaves the logits
//! projection dense unless `--quantize-lm-head`, and keeps dense any weight whose shape the
//! format's layout cannot hold (NVFP4: rows a multiple of 128, columns of 64; Qwen3.5's
//! per-head `in_proj_b` / `in_proj_a` at every published size), which the progress line counts.
//! Every quantized weight is validated against the shape the model config gives it before the
//! model exists, so a bad tensor fails the load naming itself and nothing is half-loaded.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap};
use std::io::IsTerminal;
use std::path::Path;

use crate::artifact::WeightStore;
use crate::model::{names, LoadOptions};
use crate::quant::{self, hf, HfQuantConfig, OwnedRaw, QuantFormat, QuantLinear, QuantWeight, RawDtype};
use crate::{NinferError, Result};

use super::weights::Part;

/// Which projection a weight belongs to: `--quantize` covers the body, the logits projection
/// only with `--quantize-lm-head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearRole {
    Body,
    LmHead,
}

/// The model config's `quantization_config` (top level, or a multimodal checkpoint's text
/// config), read from `dir/config.json`.
pub(crate) fn hf_quant_config(dir: &Path) -> Result<Option<HfQuantConfig>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| NinferError::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| NinferError::malformed(&path, e.to_string()))?;
    match HfQuantConfig::from_model_config(&v)? {
        Some(c) => Ok(Some(c)),
        None => match v.get("text_config") {
            Some(t) => HfQuantConfig::from_model_config(t),
            None => Ok(None),
        },
    }
}

/// The checkpoint's own quantization, with the load's options checked against it (both
/// backends): `--quantize` on an already quantized checkpoint and `--quantize-lm-head` without
/// `--quantize` are refused.
pub(crate) fn checked_hf_quant(dir: &Path, opts: &LoadOptions) -> Result<Option<HfQuantConfig>> {
    let hf = hf_quant_config(dir)?;
    if let (Some(mode), Some(c)) = (opts.quantize, hf) {
        return Err(NinferError::config(
            "quantize (--quantize)",
            format!("{} asked for a checkpoint that is already quantized ({}); leave --quantize out", mode.format().name(), c.format.name()),
        ));
    }
    if opts.quantize_lm_head && opts.quantize.is_none() {
        return Err(NinferError::config("quantize_lm_head (--quantize-lm-head)", "needs --quantize (the format the lm_head is quantized to)"));
    }
    Ok(hf)
}

/// The quantization a load asks for, checked against the checkpoint before any weight is read.
pub struct QuantSource<'a> {
    store: &'a WeightStore,
    hf: Option<HfQuantConfig>,
    quantize: Option<QuantFormat>,
    quantize_lm_head: bool,
    given: Option<&'a HashMap<String, QuantWeight>>,
    /// Handed-in tensors the model took (the rest are refused once the model is built).
    used: RefCell<BTreeSet<String>>,
    progress: Progress,
}

impl<'a> QuantSource<'a> {
    /// The load's quantization: refuses `--quantize` on an already quantized checkpoint and
    /// `--quantize-lm-head` without `--quantize`.
    pub fn new(dir: &Path, store: &'a WeightStore, opts: &'a LoadOptions) -> Result<Self> {
        let hf = checked_hf_quant(dir, opts)?;
        let quantize = opts.quantize.map(|m| m.format());
        Ok(QuantSource {
            store,
            hf,
            quantize,
            quantize_lm_head: opts.quantize_lm_head,
            given: opts.quant_tensors.as_deref(),
            used: RefCell::new(BTreeSet::new()),
            progress: Progress::new(quantize),
        })
    }

    /// A load with every projection dense as stored (tests of the dense layouts).
    #[cfg(test)]
    pub fn dense(store: &'a WeightStore) -> Self {
        QuantSource { store, hf: None, quantize: None, quantize_lm_head: false, given: None, used: RefCell::new(BTreeSet::new()), progress: Progress::new(None) }
    }

    /// The weight `{module}.weight` (`[n, k]`) in the format it is held in.
    pub fn weight(&self, module: &str, n: usize, k: usize, role: LinearRole) -> Result<Part> {
        let name = format!("{module}.weight");
        if let Some(w) = self.given_weight(&name, n, k)? {
            return Ok(Part::Quant(QuantLinear::new(w)?));
        }
        if let Some(c) = &self.hf {
            if let Some(w) = hf_weight(self.store, c, module, n, k)? {
                return Ok(Part::Quant(QuantLinear::new(w)?));
            }
        }
        let values = self.store.load_f32(&name, &[n, k])?;
        let wanted = role == LinearRole::Body || self.quantize_lm_head;
        match self.quantize.filter(|_| wanted) {
            Some(f) => self.quantized(f, &name, values, [n, k]),
            None => Ok(Part::Dense(values)),
        }
    }

    /// `--quantize` applied to one weight's values (dense where the layout cannot hold it).
    fn quantized(&self, f: QuantFormat, name: &str, values: Vec<f32>, shape: [usize; 2]) -> Result<Part> {
        if let Some(Err(_)) = quant::payload_bytes(f, shape) {
            self.progress.kept_dense.set(self.progress.kept_dense.get() + 1);
            return Ok(Part::Dense(values));
        }
        let data = quant::quantize(f, name, &values, shape)?;
        self.progress.quantized.set(self.progress.quantized.get() + 1);
        Ok(Part::Quant(QuantLinear::new(QuantWeight::packed(name, f, shape, data))?))
    }

    /// The logits projection of a tied-embedding model: a quantized copy of the embedding with
    /// `--quantize-lm-head`, else None (the step multiplies by the dense embedding).
    pub fn tied_lm_head(&self, embed: &[f32], v: usize, h: usize) -> Result<Option<Part>> {
        match self.quantize.filter(|_| self.quantize_lm_head) {
            Some(f) => self.quantized(f, "lm_head (tied to the embedding)", embed.to_vec(), [v, h]).map(Some),
            None => Ok(None),
        }
    }

    /// A dense tensor that is never quantized (the embedding), decoded when handed in packed.
    pub fn embedding(&self, name: &str, v: usize, h: usize) -> Result<Vec<f32>> {
        match self.given_weight(name, v, h)? {
            Some(w) => quant::dequantize(&w.view()),
            None => self.store.load_f32(name, &[v, h]),
        }
    }

    fn given_weight(&self, name: &str, n: usize, k: usize) -> Result<Option<QuantWeight>> {
        let Some(w) = self.given.and_then(|g| g.get(name)) else { return Ok(None) };
        if w.shape != [n, k] {
            return Err(NinferError::QuantTensor {
                name: name.to_string(),
                format: w.format.name().to_string(),
                reason: format!("handed in as [{}, {}], the model config gives [{n}, {k}]", w.shape[0], w.shape[1]),
            });
        }
        self.used.borrow_mut().insert(name.to_string());
        Ok(Some(w.clone()))
    }

    /// Progress on a terminal: the layer being read (with `--quantize`).
    pub fn layer_done(&self, i: usize, total: usize) {
        self.progress.layer(i + 1, total);
    }

    /// Refuses handed-in tensors the model has no place for; ends the progress line.
    pub fn finish(&self) -> Result<()> {
        self.progress.finish();
        if let Some(g) = self.given {
            let used = self.used.borrow();
            let mut unused: Vec<&String> = g.keys().filter(|n| !used.contains(*n)).collect();
            unused.sort();
            if let Some(name) = unused.first() {
                return Err(NinferError::QuantTensor {
                    name: name.to_string(),
                    format: g[*name].format.name().to_string(),
                    reason: "handed in, but the model has no projection or embedding of that name".into(),
                });
            }
        }
        Ok(())
    }
}

/// `module`'s quantized weight in an HF checkpoint, or None where the checkpoint stores it dense
/// (no data tensor; for FP8, a `weight` that is not F8_E4M3). The data tensor's stored shape and
/// dtype are checked here, the companions by `quant::validate`.
pub(crate) fn hf_weight(store: &WeightStore, c: &HfQuantConfig, module: &str, n: usize, k: usize) -> Result<Option<QuantWeight>> {
    let names = c.tensor_names(module);
    if !store.contains(&names.data) {
        return Ok(None);
    }
    let (info, data) = store.stored(&names.data)?;
    let fp8 = matches!(c.format, QuantFormat::HfFp8Block { .. });
    if fp8 && info.dtype != "F8_E4M3" {
        return Ok(None);
    }
    let err = |reason: String| NinferError::QuantTensor { name: names.data.clone(), format: c.format.name().to_string(), reason };
    for (what, value, by) in hf::packing_rules(c.format, n, k) {
        if value % by != 0 {
            return Err(err(format!("{what} {value} is not a multiple of {by} (the {})", if by == 8 { "eight 4-bit codes of an int32" } else { "group size" })));
        }
    }
    let g_idx = names.g_idx.as_deref().filter(|g| store.contains(g));
    let [data_spec, ..] = hf::part_specs(c.format, n, k, g_idx.is_some());
    let (dtypes, shape) = data_spec.expect("every HF format has a data tensor");
    let dtype = RawDtype::from_safetensors(&info.dtype);
    if !dtype.is_some_and(|d| dtypes.contains(&d)) {
        return Err(err(format!("dtype {}, expected one of {dtypes:?}", info.dtype)));
    }
    if info.shape != shape {
        return Err(err(format!("shape {:?}, expected {shape:?} for the [{n}, {k}] weight", info.shape)));
    }
    let raw = |name: &str| -> Result<OwnedRaw> {
        let (info, bytes) = store.stored(name)?;
        let dtype = RawDtype::from_safetensors(&info.dtype).ok_or_else(|| NinferError::QuantTensor {
            name: name.to_string(),
            format: c.format.name().to_string(),
            reason: format!("dtype {} is not one a quantized weight's companion can have", info.dtype),
        })?;
        Ok(OwnedRaw { name: name.to_string(), dtype, shape: info.shape, bytes: bytes.to_vec() })
    };
    Ok(Some(QuantWeight {
        name: names.data.clone(),
        format: c.format,
        shape: [n, k],
        data: data.to_vec(),
        scale: Some(raw(&names.scale)?),
        zero: names.zero.as_deref().map(raw).transpose()?,
        g_idx: g_idx.map(raw).transpose()?,
    }))
}

/// A quantized weight of the checkpoint as a load would see it (the first one found), without
/// reading any weight: what a backend that cannot run the format refuses. `None`: all dense.
pub fn first_quantized(dir: &Path, opts: &LoadOptions) -> Result<Option<(String, QuantFormat)>> {
    if let Some(g) = opts.quant_tensors.as_deref() {
        if let Some(name) = g.keys().min() {
            return Ok(Some((name.clone(), g[name].format)));
        }
    }
    let store = WeightStore::open(dir)?;
    if let Some(mode) = opts.quantize {
        let prefix = names::decoder_prefix(&store);
        return Ok(Some((format!("{}.mlp.down_proj.weight", names::layer(prefix, 0)), mode.format())));
    }
    let Some(c) = hf_quant_config(dir)? else { return Ok(None) };
    let suffix = format!(".{}", c.tensor_names("m").data.trim_start_matches("m."));
    for name in store.names() {
        if name.ends_with(&suffix) {
            let fp8 = matches!(c.format, QuantFormat::HfFp8Block { .. });
            if !fp8 || store.info(name)?.dtype == "F8_E4M3" {
                return Ok(Some((name.to_string(), c.format)));
            }
        }
    }
    Ok(None)
}

/// Refuses a load on `device` when the checkpoint (or `--quantize`) gives a weight a format
/// `supports` says the backend cannot run, naming the tensor, the format and the device.
pub fn refuse_unsupported(dir: &Path, opts: &LoadOptions, device: &str, supports: impl Fn(QuantFormat) -> bool) -> Result<()> {
    match first_quantized(dir, opts)? {
        Some((name, f)) if !supports(f) => Err(NinferError::Device(format!(
            "{device}: tensor {name} is quantized as {} ({}), which this backend cannot run yet; load it on the CPU (--device cpu)",
            f.name(),
            f.spec().element
        ))),
        _ => Ok(()),
    }
}

/// `--quantize` progress on stderr, only when stderr is a terminal.
struct Progress {
    format: Option<QuantFormat>,
    tty: bool,
    quantized: Cell<usize>,
    kept_dense: Cell<usize>,
    /// Length of the line on the terminal, blanked before the next one is written over it.
    shown: Cell<usize>,
}

impl Progress {
    fn new(format: Option<QuantFormat>) -> Self {
        Progress { format, tty: std::io::stderr().is_terminal(), quantized: Cell::new(0), kept_dense: Cell::new(0), shown: Cell::new(0) }
    }

    /// Replace the line on the terminal with `line`.
    fn show(&self, line: &str, end: &str) {
        let blank = self.shown.get().saturating_sub(line.len());
        eprint!("\r{line}{:blank$}{end}", "");
        self.shown.set(line.len());
    }

    fn layer(&self, done: usize, total: usize) {
        if let (Some(f), true) = (self.format, self.tty) {
            self.show(&format!("ninfer: quantizing to {}: layer {done}/{total}, {} weights", f.name(), self.quantized.get()), "");
        }
    }

    fn finish(&self) {
        if let (Some(f), true) = (self.format, self.tty) {
            let dense = self.kept_dense.get();
            let kept = if dense > 0 { format!(" ({dense} kept dense: shapes {} cannot hold)", f.name()) } else { String::new() };
            self.show(&format!("ninfer: quantized {} weights to {}{kept}", self.quantized.get(), f.name()), "\n");
        }
    }
}
