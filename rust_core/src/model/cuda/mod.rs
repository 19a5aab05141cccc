//! `CudaModel`: a loaded model on one CUDA device, running engine steps with the kernels of
//! `backend::cuda` on the device's stream.
//!
//! A step uploads its metadata (`step_meta`: token ids, positions, KV slots, block tables,
//! sequence offsets) in two copies, runs every layer over all rows of the step (`forward`, the
//! sub-blocks in `attention`, `gdn`, `mlp`, each ending in `residual`), and copies only the
//! wanted logits rows back as f32 through a pinned buffer, or samples them on the device and
//! copies back only ids and logprobs (`sampler`); that copy is the only host synchronization.
//! Decode steps (one token per sequence, each wanting its logits) and uniform speculative verify
//! steps (`verify`: K + 1 tokens per sequence, logits at each) are padded to a batch bucket and
//! replayed as CUDA graphs (`graphs`); prefill and mixed steps run eagerly, with the prefill
//! kernels (flash attention, chunked GDN). `weights` and `load` hold the weights on the
//! device and stream them there, each projection a `linear::Linear` carrying its format and
//! kernel route; `route` the kernels each layer runs, decided at load; `buffers` the caches and
//! activations a step runs in; `runner` the engine-facing `ModelRunner`; `mtp` the MTP head
//! drafting for `--spec mtp`; `dflash` the DFlash drafter for `--spec dflash`.

mod attention;
mod buffers;
mod dflash;
mod forward;
mod gdn;
pub(crate) mod graphs;
pub mod linear;
pub mod load;
mod mlp;
mod mtp;
mod replay;
mod residual;
pub mod route;
mod runner;
mod sampler;
mod step_meta;
mod verify;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, PinnedHostSlice};

use crate::artifact::WeightStore;
use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::ops::AttnScratch;
use crate::backend::cuda::plan::ModelShape;
use crate::backend::cuda::CudaDevice;
use crate::config::{CudaOptions, ModelConfig};
use crate::model::kv_dtype::KvDtype;
use crate::model::logits_dtype::LogitsDtype;
use crate::quant::QuantFormat;
use crate::{NinferError, Result};

use buffers::{alloc, Activations, DevCaches};
use graphs::StepGraphs;
use route::{Fusions, LayerRoute};
use sampler::DeviceSampler;
use step_meta::StepMeta;
use weights::DevWeights;

/// A model on one CUDA device (weights in the device's storage type).
pub struct CudaModel {
    cfg: ModelConfig,
    dev: Arc<CudaDevice>,
    weights: DevWeights,
    /// The kernels of each layer (`weights.layers[i]` runs `routes[i]`), decided at load.
    routes: Vec<LayerRoute>,
    /// Layer index -> index into the KV lists (attention) or the state lists (GDN).
    cache_index: Vec<usize>,
    /// f32 `[rotary_dim / 2]`.
    inv_freq: CudaSlice<f32>,
    rope_scale: f32,
    caches: DevCaches,
    act: Activations,
    meta: StepMeta,
    /// A one-element buffer for the unused k argument of a q-only RoPE launch.
    dummy: CudaSlice<u16>,
    /// Decode steps' metadata, padded to the bucket (its own buffers, so that prefill steps
    /// never move what a captured graph reads).
    dmeta: StepMeta,
    /// Uniform verify steps' metadata, padded to the bucket (`verify`), in buffers of its own
    /// for the same reason.
    vmeta: StepMeta,
    /// Split-K partials of decode attention for `scratch_rows` tokens.
    scratch: Option<AttnScratch>,
    scratch_rows: usize,
    graphs: StepGraphs,
    /// Page-locked staging for the logits copy to the host.
    pinned: Option<PinnedHostSlice<f32>>,
    /// Rows of `act.logits` the last step produced (in the order of `Logits::data`).
    logits_rows: usize,
    /// Device-side sampling (`forward_sampled`).
    sampler: DeviceSampler,
    /// The step `launch_forward` queued and `launch_sampling` has not sampled yet: its logits
    /// rows per sequence, and whether it was fed (its input ids are then the sampled tokens).
    forwarded: Option<(Vec<usize>, bool)>,
    /// The lm_head rounds logits to the storage type (logits_dtype "auto",
    /// model/logits_dtype.rs): in the decode GEMV's epilogue and after prefill's cuBLAS GEMM
    /// (`linear_f32_out`), the one place every consumer (device and host sampling, logprobs,
    /// `Model.logits`) reads logits from.
    logits_round: bool,
    /// The checkpoint directory, for the MTP head `enable_mtp` loads on demand.
    dir: PathBuf,
    /// `--quantize` and handed-in packed tensors: how the projections (the MTP head's too) are held.
    quant: load::QuantLoad,
    /// `--spec mtp`'s head and drafting state (`enable_mtp`); None otherwise.
    mtp: Option<Box<mtp::CudaMtp>>,
    /// `--spec dflash`'s drafter, its paged context and the kept target features
    /// (`enable_dflash`); None otherwise.
    dflash: Option<Box<dflash::CudaDflash>>,
    /// The kept GDN inputs of verify chunks (`enable_state_replay`); None otherwise.
    replay: Option<replay::DevReplay>,
}

impl CudaModel {
    /// Whether this backend runs weights quantized as `format`: the one place a quantized load
    /// on a GPU is refused (`model::load_model`, naming the tensor, the format and the device).
    /// The loader takes `--quantize` in every NInfer format (fused projections encoded whole,
    /// or for NVFP4, whose tensor divisor spans a matrix, as row-stacked parts: `load`),
    /// handed-in GGUF and NVFP4 tensors and quantized HF checkpoints (fused by moving whole row
    /// units of their tensors, `load::hf_rows`). NVFP4 runs dequantized on every arch (no FP4
    /// tensor-core route). The device's own limits (K a multiple of 8, f16 range on sm_7x)
    /// refuse a tensor at upload, and the loader a fused projection it cannot hold as one.
    pub fn supports(format: QuantFormat) -> bool {
        matches!(format.spec().family, crate::quant::Family::Ninfer | crate::quant::Family::Gguf | crate::quant::Family::HuggingFace)
    }

    /// Load config and weights from a HF model directory onto device `ordinal`.
    pub fn load(dir: &Path, ordinal: usize) -> Result<Self> {
        Self::load_with(dir, ordinal, LogitsDtype::Auto, KvDtype::Auto, &CudaOptions::default(), load::QuantLoad::default())
    }

    /// As `load`, with the logits rounded as `logits_dtype` says, `kv_dtype` checked against
    /// the device's storage type (the KV cache's) as soon as the device is open, and the
    /// device's route plan made for this model under `options`, and the projections held as
    /// `quant` says (`--quantize`, handed-in packed tensors; formats `supports` takes).
    pub fn load_with(dir: &Path, ordinal: usize, logits_dtype: LogitsDtype, kv_dtype: KvDtype, options: &CudaOptions, quant: load::QuantLoad) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let dev = Arc::new(CudaDevice::for_model(ordinal, ModelShape { hidden_size: Some(cfg.hidden_size) }, options)?);
        kv_dtype.check(&format!("cuda:{ordinal} ({}, {})", dev.name(), dev.arch()), dev.storage().into())?;
        Self::check_supported(&cfg)?;
        let (graphs, sampler) = (StepGraphs::new(dev.plan().cuda_graphs), DeviceSampler::new(dev.plan().device_sampling));
        let fusions = Fusions::of(dev.plan(), dev.compute_capability());
        let store = WeightStore::open(dir)?;
        // The device runs every checkpoint in its 16-bit storage type (an f32 checkpoint is
        // converted while loading, as transformers' `dtype=torch.bfloat16` does), so "auto"
        // rounds to that type whatever the file holds: f32 and bf16 copies of a model give the
        // same logits here.
        let logits_round = logits_dtype == LogitsDtype::Auto;
        // Kernels compile (or load from the disk cache) on a second thread while the weights
        // stream in: a cold start pays for the longer of the two, not their sum.
        let (kernels, weights, load_s) = std::thread::scope(|s| {
            let kernels = s.spawn(|| dev.load_all_kernels());
            let t0 = std::time::Instant::now();
            let weights = DevWeights::load(&dev, &cfg, &store, &quant);
            let load_s = t0.elapsed().as_secs_f64();
            (kernels.join(), weights, load_s)
        });
        kernels.map_err(|_| NinferError::Device("the kernel loading thread panicked".into()))??;
        let weights = weights?;
        let cache_index = cfg.cache_index();
        let (inv_freq, rope_scale) = cfg.rope.inv_freq(cfg.head_dim);
        let gdn_chunked = cfg.linear_attention.is_some_and(|la| dev.has_gdn_chunked(la.key_head_dim));
        let routes = weights.layers.iter().map(|l| LayerRoute::choose(&cfg, l, 2 * inv_freq.len(), gdn_chunked, fusions)).collect();
        let inv_freq = dev.stream().clone_htod(&inv_freq).map_err(driver_err("uploading rope frequencies"))?;
        let dummy = alloc::<u16>(&dev, 1, "rope scratch")?;
        eprintln!(
            "ninfer: loaded {} on cuda:{} ({}, {}, {:?}): {:.2} GiB of weights in {:.1} s ({:.1} GB/s)",
            cfg.architecture,
            ordinal,
            dev.name(),
            dev.arch(),
            dev.storage(),
            weights.bytes as f64 / (1u64 << 30) as f64,
            load_s,
            weights.bytes as f64 / 1e9 / load_s.max(1e-9)
        );
        Ok(CudaModel {
            cfg,
            dev,
            weights,
            routes,
            cache_index,
            inv_freq,
            rope_scale,
            caches: DevCaches::default(),
            act: Activations::default(),
            meta: StepMeta::default(),
            dummy,
            dmeta: StepMeta::default(),
            vmeta: StepMeta::default(),
            scratch: None,
            scratch_rows: 0,
            graphs,
            pinned: None,
            logits_rows: 0,
            sampler,
            forwarded: None,
            logits_round,
            dir: dir.to_path_buf(),
            quant,
            mtp: None,
            dflash: None,
            replay: None,
        })
    }

    /// Shapes the kernels do not cover yet fail at load with the reason, not mid-step.
    fn check_supported(cfg: &ModelConfig) -> Result<()> {
        let unsupported = |what: String| Err(NinferError::Unsupported(format!("{what} on the CUDA backend (use device=\"cpu\")")));
        if cfg.num_attention_layers() > 0 && !matches!(cfg.head_dim, 64 | 96 | 128 | 256) {
            return unsupported(format!("head_dim {} (kernels: 64, 96, 128, 256)", cfg.head_dim));
        }
        if cfg.qkv_bias && cfg.attn_output_gate {
            return unsupported("q/k/v projection biases with a gated query (attn_output_gate)".into());
        }
        if let Some(la) = cfg.linear_attention {
            if !matches!(la.key_head_dim, 64 | 128) || la.value_head_dim % 32 != 0 || !(2..=4).contains(&la.conv_kernel) {
                return unsupported(format!(
                    "Gated DeltaNet with key head dim {}, value head dim {}, conv kernel {} (kernels: dk 64/128, dv a multiple of 32, kernel 2-4)",
                    la.key_head_dim, la.value_head_dim, la.conv_kernel
                ));
            }
        }
        Ok(())
    }

    /// The device this model runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// KV blocks, block size and state slots currently allocated.
    pub fn cache_capacity(&self) -> (usize, usize, usize) {
        (self.caches.num_blocks, self.caches.block_size, self.caches.num_slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(arch: &str, extra: serde_json::Value) -> ModelConfig {
        let mut v = serde_json::json!({"architectures": [arch], "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        ModelConfig::from_json_str(&v.to_string(), std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn projection_biases_load_on_the_gpu_except_beside_a_gated_query() {
        CudaModel::check_supported(&config("Qwen2ForCausalLM", serde_json::json!({}))).unwrap();
        CudaModel::check_supported(&config("LlamaForCausalLM", serde_json::json!({"attention_bias": true, "mlp_bias": true}))).unwrap();
        let mut gated = config("Qwen2ForCausalLM", serde_json::json!({}));
        gated.attn_output_gate = true;
        let err = CudaModel::check_supported(&gated).unwrap_err().to_string();
        assert!(err.contains("q/k/v projection biases with a gated query"), "{err}");
    }
}
