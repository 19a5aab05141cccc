//! `_core.plan(...)`: the memory plan (rust_core/src/plan) as a dict for `ninfer plan`, with the
//! keys of `Engine.info()` for what both report, so that one formatter prints both ledgers.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::engine::spec_config;
use super::errors::IntoPy;
use crate::artifact::WeightStore;
use crate::backend::cuda::select::cuda_device_count;
use crate::config::ModelConfig;
use crate::engine::EngineConfig;
use crate::model::KvDtype;
use crate::plan::{checkpoint_tensors, device_memory, host_available_bytes, DeviceMemory, PlanInput, PoolRule, QuantFormat, Target};
use crate::{NinferError, Result};

/// Which backend the plan is for, its memory, and the words the ledger names it with.
fn target(device: Option<&str>, gpu_memory: Option<u64>) -> Result<(Target, Option<DeviceMemory>, String)> {
    if let Some(bytes) = gpu_memory {
        if device.is_some() {
            return Err(NinferError::config("gpu_memory (--gpu-memory)", "give either --gpu-memory or --device, not both"));
        }
        return Ok((Target::Gpu, Some(DeviceMemory { free: bytes, total: bytes, cuda: None }), format!("a GPU of {:.1} GiB", bytes as f64 / (1u64 << 30) as f64)));
    }
    let device = device.unwrap_or("auto").trim().to_ascii_lowercase();
    let ordinal = match device.as_str() {
        "cpu" => {
            let memory = host_available_bytes();
            return Ok((Target::Cpu, memory, "cpu".into()));
        }
        "auto" => match cuda_device_count() {
            Ok(n) if n > 0 => 0,
            Ok(_) => return Err(NinferError::Device("device auto: no GPU here; give --gpu-memory SIZE to plan for a GPU, or --device cpu".into())),
            Err(e) => return Err(NinferError::Device(format!("device auto: {e}; give --gpu-memory SIZE to plan for a GPU, or --device cpu"))),
        },
        "cuda" => 0,
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => return Err(NinferError::config("device (--device)", format!("`{device}` is not a device; use cpu, cuda or cuda:N"))),
        },
    };
    let memory = device_memory(ordinal).map_err(|e| match e {
        NinferError::Device(m) => NinferError::Device(format!("{m}; give --gpu-memory SIZE to plan for a GPU without one")),
        e => e,
    })?;
    Ok((Target::Gpu, Some(memory), format!("cuda:{ordinal}")))
}

/// Whether `dir` has weights (else it is planned from config.json alone).
fn has_weights(dir: &Path) -> bool {
    dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists()
}

/// Plan the memory of the model in `model_dir` on `device` ("cpu", "cuda:N"; None: the GPU
/// when one is present) or on a GPU of `gpu_memory` bytes, without reading any weight.
#[pyfunction]
#[pyo3(signature = (model_dir, device=None, gpu_memory=None, max_context=None, kv_capacity=None, max_concurrency=1, prefill_chunk=512, prefix_reuse=true, kv_dtype="auto", quantize=None, quantize_lm_head=false, spec=None, draft_tokens=None, drafter=None))]
#[allow(clippy::too_many_arguments)]
pub fn plan<'py>(
    py: Python<'py>,
    model_dir: PathBuf,
    device: Option<&str>,
    gpu_memory: Option<u64>,
    max_context: Option<usize>,
    kv_capacity: Option<usize>,
    max_concurrency: usize,
    prefill_chunk: usize,
    prefix_reuse: bool,
    kv_dtype: &str,
    quantize: Option<&str>,
    quantize_lm_head: bool,
    spec: Option<&str>,
    draft_tokens: Option<usize>,
    drafter: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let engine = EngineConfig { max_context, kv_capacity_tokens: kv_capacity, max_concurrency, prefill_chunk, prefix_reuse, spec: spec_config(spec, draft_tokens, drafter, false, false, None).py()?, ..Default::default() };
    let quantize = quantize.map(QuantFormat::parse).transpose().py()?;
    let kv_dtype = KvDtype::parse(kv_dtype).py()?;
    let run = || -> Result<_> {
        let (target, memory, device) = target(device, gpu_memory)?;
        target.check_kv_dtype(kv_dtype)?;
        let cfg = ModelConfig::from_dir(&model_dir)?;
        let config_only = !has_weights(&model_dir);
        let store = if config_only { None } else { Some(WeightStore::open(&model_dir)?) };
        let tensors = checkpoint_tensors(&model_dir, &cfg, store.as_ref())?;
        let input = PlanInput { cfg: &cfg, tensors: &tensors, target, engine, quantize, quantize_lm_head, memory, pool: PoolRule::PerSequence };
        if target == Target::Gpu {
            // What the CUDA loader would refuse is refused here, before any ledger.
            crate::plan::check_gpu_load(&model_dir, store.as_ref(), &input)?;
        }
        Ok((crate::plan::plan(&input)?, device, config_only, target))
    };
    let (p, device, config_only, target) = py.detach(run).py()?;
    let d = PyDict::new(py);
    let (c, l) = (&p.config, &p.ledger);
    d.set_item("device", device)?;
    d.set_item("target", match target { Target::Cpu => "cpu", Target::Gpu => "gpu" })?;
    d.set_item("config_only", config_only)?;
    d.set_item("model_max_context", p.model_max_context)?;
    d.set_item("max_context", c.max_context)?;
    d.set_item("kv_capacity_tokens", c.kv_capacity_tokens)?;
    d.set_item("block_size", c.block_size)?;
    d.set_item("num_blocks", c.num_blocks)?;
    d.set_item("max_concurrency", c.max_concurrency)?;
    d.set_item("prefill_chunk", c.prefill_chunk)?;
    d.set_item("prefix_reuse", c.prefix_reuse)?;
    d.set_item("state_slots_running", c.running_state_slots)?;
    d.set_item("state_slots_snapshot", c.snapshot_state_slots)?;
    d.set_item("state_slots_rollback", c.rollback_state_slots)?;
    d.set_item("weight_bytes", l.weight_bytes)?;
    d.set_item("kv_bytes_per_token", l.kv_bytes_per_token)?;
    d.set_item("kv_bytes", l.kv_bytes)?;
    d.set_item("state_bytes_per_slot", l.state_bytes_per_slot)?;
    d.set_item("state_bytes", l.state_bytes)?;
    d.set_item("workspace_bytes", l.workspace_bytes)?;
    d.set_item("workspace_dequant_bytes", p.dequant_workspace_bytes)?;
    d.set_item("workspace_cublaslt_bytes", p.lt_workspace_bytes)?;
    d.set_item("total_bytes", l.total_bytes)?;
    d.set_item("reserve_bytes", p.reserve_bytes)?;
    d.set_item("needed_bytes", p.needed_bytes)?;
    let weights = PyList::empty(py);
    for w in &p.weights {
        let e = PyDict::new(py);
        e.set_item("format", &w.format)?;
        e.set_item("tensors", w.tensors)?;
        e.set_item("bytes", w.bytes)?;
        weights.append(e)?;
    }
    d.set_item("weights", weights)?;
    if let Some(f) = &p.fit {
        d.set_item("available_bytes", f.available)?;
        d.set_item("fits", f.fits)?;
        d.set_item("short_bytes", f.short)?;
        d.set_item("largest_context", f.largest_context)?;
        d.set_item("largest_concurrency", f.largest_concurrency)?;
        d.set_item("hint", p.fit_hint())?;
    }
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    // `ninfer plan --quantize` choices (python/ninfer/plan.py keeps a copy a test compares).
    m.add("QUANTIZE_FORMATS", crate::quant::QUANTIZE_MODES.to_vec())?;
    Ok(())
}
