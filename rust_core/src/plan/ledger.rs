//! The plan itself: weights by format, the KV pool and recurrent-state slots sized by the
//! engine's own arithmetic (`EngineConfig::resolve`, `ResolvedConfig::ledger`), a step
//! workspace estimate and the device reserve, against the memory available; and when that
//! does not fit, the largest context and concurrency that do.

use std::collections::BTreeMap;
use std::path::Path;

use super::formats::QuantFormat;
use super::inventory::{checkpoint_tensors, PlannedTensor, Role};
use super::memory::{device_memory, host_available_bytes, DeviceMemory};
use super::drafter::{drafter_bytes, DrafterBytes};
use super::gpu::{fp8_gemm_fits, mtp_layers_error, nvfp4_gemm_fits, nvfp4_held_parts, quant_device_bytes, quant_shape_error, LT_WORKSPACE_BYTES};
use super::{cache_spec, reserve_bytes, verify_rows, Target};
use crate::artifact::WeightStore;
use crate::config::ModelConfig;
use crate::engine::{EngineConfig, MemoryLedger, ResolvedConfig};
use crate::model::CacheSpec;
use crate::quant::QuantizeMode;
use crate::spec::SpecMethod;
use crate::{NinferError, Result};

/// How large a KV pool the settings call for when `--kv-capacity` is not given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolRule {
    /// Every one of `--max-concurrency` sequences can reach `--max-context` at once (what
    /// `ninfer plan` answers).
    PerSequence,
    /// One full context, shared by the running sequences: the least the engine starts with
    /// (its default pool then grows toward `--max-concurrency` contexts as memory allows).
    OneContext,
}

/// What to plan.
#[derive(Clone, Debug)]
pub struct PlanInput<'a> {
    pub cfg: &'a ModelConfig,
    /// `model_tensors` of the model.
    pub tensors: &'a [PlannedTensor],
    pub target: Target,
    /// The engine's flags (`max_context`, `kv_capacity_tokens`, `max_concurrency`,
    /// `prefill_chunk`, `prefix_reuse`, `spec`, `block_size`).
    pub engine: EngineConfig,
    /// `--quantize`: the format of the projections (None: the backend's dense type).
    pub quantize: Option<QuantFormat>,
    /// `--quantize-lm-head`: the embedding and LM head in the `quantize` format too.
    pub quantize_lm_head: bool,
    /// The memory to fit in (None: the ledger without a verdict).
    pub memory: Option<DeviceMemory>,
    pub pool: PoolRule,
}

/// Weights of one format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightLine {
    /// `BF16`, `F32`, `Q4G64_F16S`, ...
    pub format: String,
    pub tensors: usize,
    pub bytes: u64,
}

/// The verdict against the memory available.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    pub available: u64,
    pub fits: bool,
    /// Bytes missing (0 when it fits).
    pub short: u64,
    /// Largest `--max-context` that fits at the given `--max-concurrency` (0: none).
    pub largest_context: usize,
    /// Largest `--max-concurrency` that fits at the given `--max-context` (0: none), at most
    /// `MAX_PLANNED_CONCURRENCY`.
    pub largest_concurrency: usize,
    /// With a `--kv-capacity` given: the largest that fits at the given context and
    /// concurrency (0: none, not even one context).
    pub largest_kv_capacity: Option<usize>,
}

/// The highest concurrency the plan searches.
pub const MAX_PLANNED_CONCURRENCY: usize = 1 << 16;

/// A planned memory ledger.
#[derive(Clone, Debug)]
pub struct Plan {
    pub weights: Vec<WeightLine>,
    pub spec: CacheSpec,
    /// The sizes the engine would run with.
    pub config: ResolvedConfig,
    /// Weights, KV pool, state slots and the workspace estimate, as the engine's ledger.
    pub ledger: MemoryLedger,
    /// Kept free on the device (`reserve_bytes`).
    pub reserve_bytes: u64,
    /// `ledger.total_bytes + reserve_bytes`.
    pub needed_bytes: u64,
    /// Of the workspace: the dequantization workspace (`quant_workspace_bytes`) and cuBLASLt's
    /// (`lt_workspace_bytes`); the rest is the step buffers' estimate.
    pub dequant_workspace_bytes: u64,
    pub lt_workspace_bytes: u64,
    /// The model's own context length (0: not given).
    pub model_max_context: usize,
    pub fit: Option<Fit>,
}

/// Weights by format and their total, as `target` holds them. The MTP head counts where it is
/// loaded: always on the CPU (which loads any head the checkpoint has), on a GPU only when it
/// drafts (`--spec mtp`).
pub fn weight_lines(input: &PlanInput<'_>) -> Result<(Vec<WeightLine>, u64)> {
    if input.quantize_lm_head && input.quantize.is_none() {
        return Err(NinferError::config("quantize_lm_head (--quantize-lm-head)", "needs --quantize (the format to store the LM head and embedding in)"));
    }
    if let (Some(f), Some(t)) = (input.quantize, input.tensors.iter().find(|t| t.stored.is_some())) {
        let stored = t.stored.expect("found").format;
        return Err(NinferError::config(
            "quantize (--quantize)",
            format!("{} asked for a checkpoint that is already quantized ({}, e.g. {}); leave --quantize out", f.name(), stored.name(), t.name),
        ));
    }
    let tensors = loaded(input);
    let held = match input.target {
        Target::Cpu => cpu_held(input, &tensors)?,
        Target::Gpu => gpu_held(input, &tensors)?,
    };
    let mut by: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for (name, bytes) in held {
        let e = by.entry(name).or_default();
        e.0 += 1;
        e.1 += bytes;
    }
    let mut lines: Vec<WeightLine> = by.into_iter().map(|(format, (tensors, bytes))| WeightLine { format, tensors, bytes }).collect();
    if let Some(d) = drafter(input)? {
        lines.push(WeightLine { format: format!("{} DFlash drafter", input.target.dense_name()), tensors: d.tensors, bytes: d.weight_bytes });
    }
    let total = lines.iter().map(|l| l.bytes).sum();
    Ok((lines, total))
}

/// The DFlash drafter `--spec dflash --drafter DIR` loads beside the model (None without one):
/// its weights and context bytes per token as the backend holds them (`plan::drafter`).
pub fn drafter(input: &PlanInput<'_>) -> Result<Option<DrafterBytes>> {
    match input.engine.spec.as_ref().filter(|s| s.method == SpecMethod::Dflash).and_then(|s| s.drafter.as_deref()) {
        Some(dir) => Ok(Some(drafter_bytes(dir, input.cfg, input.target)?)),
        None => Ok(None),
    }
}

/// (format, bytes) of each tensor the CPU loader holds (`cpu::weights`, `cpu::quant_load`):
/// f32, but for `--quantize`d projections, each checkpoint tensor packed on its own (a shape the
/// format cannot hold stays f32), and a quantized checkpoint's projections as stored. The embedding stays f32 (the step reads its rows); a tied
/// head under `--quantize-lm-head` is a quantized copy of it beside it. A quantized gated
/// q_proj keeps its checkpoint row order, so its fused q|k|v projection holds an output order
/// beside it (`U32`, one per fused row).
fn cpu_held(input: &PlanInput<'_>, tensors: &[&PlannedTensor]) -> Result<Vec<(String, u64)>> {
    let fused = fused_rows(tensors);
    let head = input.quantize.filter(|_| input.quantize_lm_head);
    let matrix = |name: &str, n: usize, k: usize, f: Option<QuantFormat>| -> Result<(String, u64)> {
        match f.filter(|f| f.holds(n, k)) {
            Some(f) => Ok((f.name().to_string(), f.matrix_bytes(name, n, k)?)),
            None => Ok(("F32".to_string(), 4 * (n * k) as u64)),
        }
    };
    let mut out = Vec::with_capacity(tensors.len() + 1);
    for (i, t) in tensors.iter().enumerate() {
        let cols: usize = t.shape[1..].iter().product();
        if let Some(q) = t.stored {
            out.push((q.format.name().to_string(), q.bytes));
            if t.gated_query {
                out.push(("U32".to_string(), 4 * fused[i] as u64));
            }
            continue;
        }
        match t.role {
            Role::Matrix => {
                out.push(matrix(&t.name, t.shape[0], cols, input.quantize)?);
                if t.gated_query && input.quantize.is_some_and(|f| f.holds(t.shape[0], cols)) {
                    out.push(("U32".to_string(), 4 * fused[i] as u64));
                }
            }
            Role::LmHead => out.push(matrix(&t.name, t.shape[0], cols, head)?),
            Role::Embedding => {
                out.push(("F32".to_string(), 4 * t.numel()));
                if input.cfg.tie_word_embeddings && head.is_some() {
                    out.push(matrix("lm_head (tied to the embedding)", t.shape[0], cols, head)?);
                }
            }
            Role::Dense | Role::DenseF32 => out.push(("F32".to_string(), 4 * t.numel())),
        }
    }
    Ok(out)
}

/// (format, bytes) of each tensor the CUDA loader holds (`cuda::load`): the dense type, f32
/// for `A_log` / `dt_bias`; `--quantize`d projections encoded as the fused matrix where the
/// format encodes rows alone (counted on the fused projection's first tensor); the untied head
/// in the format too with `--quantize-lm-head`, a tied one as a quantized copy beside the dense
/// embedding; a quantized checkpoint's projections and head as stored (a fused projection keeps
/// one g_idx for its parts).
fn gpu_held(input: &PlanInput<'_>, tensors: &[&PlannedTensor]) -> Result<Vec<(String, u64)>> {
    let target = input.target;
    let fused_rows = fused_rows(tensors);
    let head = input.quantize.filter(|_| input.quantize_lm_head);
    if is_mtp(&input.engine) {
        // The MTP layers as the inventory counts them (`mtp.layers.{i}.input_layernorm`).
        let layers = tensors.iter().filter(|t| t.mtp && t.name.starts_with("mtp.layers.") && t.name.ends_with(".input_layernorm.weight")).count();
        if let Some(e) = mtp_layers_error(layers) {
            return Err(e);
        }
    }
    let mut out = Vec::with_capacity(tensors.len() + 1);
    for (i, t) in tensors.iter().enumerate() {
        let cols: usize = t.shape[1..].iter().product();
        if let Some(q) = t.stored {
            if !matches!(t.role, Role::Matrix | Role::LmHead) {
                return Err(NinferError::Unsupported(format!("{} stored quantized ({}) on the CUDA backend (its embedding is dense)", t.name, q.format.name())));
            }
            if let Some(e) = quant_shape_error(&t.name, q.format, cols) {
                return Err(e);
            }
            let stored = q.bytes - if t.fused { q.g_idx_bytes } else { 0 };
            out.push((q.format.name().to_string(), quant_device_bytes(q.format, [t.shape[0], cols], stored as usize) as u64));
            continue;
        }
        if t.role == Role::Embedding && input.cfg.tie_word_embeddings {
            if let Some(f) = head.filter(|f| f.holds(t.shape[0], cols)) {
                if let Some(e) = quant_shape_error(&t.name, f.mode.format(), cols) {
                    return Err(e);
                }
                let stored = f.matrix_bytes("lm_head (tied to the embedding)", t.shape[0], cols)?;
                out.push((f.name().to_string(), quant_device_bytes(f.mode.format(), [t.shape[0], cols], stored as usize) as u64));
            }
        }
        let quant = match t.role {
            Role::Matrix => input.quantize.filter(|f| f.encodes_rows_alone() || stacks_parts(tensors, i, *f)),
            Role::LmHead => head,
            _ => None,
        }
        .filter(|f| f.holds(t.shape[0], cols));
        if let Some(e) = quant.and_then(|f| quant_shape_error(&t.name, f.mode.format(), cols)) {
            return Err(e);
        }
        out.push(match (quant, t.role) {
            (Some(f), Role::Matrix) if f.encodes_rows_alone() => {
                let rows = fused_rows[i];
                (f.name().to_string(), if rows > 0 { quant_device_bytes(f.mode.format(), [rows, cols], f.matrix_bytes(&t.name, rows, cols)? as usize) as u64 } else { 0 })
            }
            (Some(f), _) => (f.name().to_string(), quant_device_bytes(f.mode.format(), [t.shape[0], cols], f.matrix_bytes(&t.name, t.shape[0], cols)? as usize) as u64),
            (None, Role::DenseF32) => ("F32".to_string(), 4 * t.numel()),
            (None, _) => (target.dense_name().to_string(), target.dense_bytes() as u64 * t.numel()),
        });
    }
    Ok(out)
}

/// For a format that does not encode rows alone (NVFP4), whether the CUDA loader packs matrix
/// `i` of its fused projection (`plan::gpu::nvfp4_held_parts`, the loader's rule): one of the
/// leading parts the format holds, when every part it cannot hold comes after them.
fn stacks_parts(tensors: &[&PlannedTensor], i: usize, _f: QuantFormat) -> bool {
    // The projection's matrices in order, as `fused_rows` groups them.
    let matrices: Vec<usize> = (0..tensors.len()).filter(|&j| tensors[j].role == Role::Matrix).collect();
    let at = matrices.iter().position(|&j| j == i).expect("a matrix");
    let lead = (0..=at).rev().find(|&m| !tensors[matrices[m]].fused).unwrap_or(0);
    let end = (lead + 1..matrices.len()).find(|&m| !tensors[matrices[m]].fused).unwrap_or(matrices.len());
    let rows: Vec<usize> = matrices[lead..end].iter().map(|&j| tensors[j].shape[0]).collect();
    nvfp4_held_parts(&rows, tensors[i].shape[1..].iter().product()).is_some_and(|held| at - lead < held)
}

/// The tensors the target loads (the MTP head's on the GPU only under `--spec mtp`).
fn loaded<'t>(input: &PlanInput<'t>) -> Vec<&'t PlannedTensor> {
    let mtp_loaded = input.target == Target::Cpu || is_mtp(&input.engine);
    input.tensors.iter().filter(|t| !t.mtp || mtp_loaded).collect()
}

/// Rows of the fused projection each matrix of `tensors` begins (0 for the later parts): a
/// format that encodes rows alone holds it as one matrix on the GPU, so its bytes are the fused
/// payload's.
fn fused_rows(tensors: &[&PlannedTensor]) -> Vec<usize> {
    let mut rows = vec![0usize; tensors.len()];
    let mut lead = 0;
    for (i, t) in tensors.iter().enumerate().filter(|(_, t)| t.role == Role::Matrix) {
        if !t.fused {
            lead = i;
        }
        rows[lead] += t.shape[0];
    }
    rows
}

/// Vocabulary rows of a quantized LM head its prefill route dequantizes at a time into the
/// shared workspace (`CudaDevice::quant_linear_f32_out`): the workspace holds this chunk, not
/// the whole head (about 2.5 GB in bf16 at the Qwen3.5-27B shape; the chunk is 160 MiB there).
pub const QUANT_HEAD_CHUNK_ROWS: usize = 16384;

/// The GPU's dequantization workspace under `--quantize`: the largest quantized (fused)
/// projection in the dense type, which the prefill route decodes each weight into, or a
/// quantized LM head's chunk of QUANT_HEAD_CHUNK_ROWS rows where that is larger; the MTP head
/// shares it.
pub fn quant_workspace_bytes(input: &PlanInput<'_>) -> u64 {
    if input.target != Target::Gpu {
        return 0;
    }
    let tensors = loaded(input);
    let rows = fused_rows(&tensors);
    let quantized = |i: usize, t: &PlannedTensor| {
        t.stored.is_some() || input.quantize.is_some_and(|f| f.holds(t.shape[0], t.shape[1]) && (f.encodes_rows_alone() || stacks_parts(&tensors, i, f)))
    };
    let largest = tensors.iter().zip(rows).enumerate().filter(|(i, (t, r))| t.role == Role::Matrix && *r > 0 && quantized(*i, t)).map(|(_, (t, r))| r * t.shape[1]).max().unwrap_or(0);
    // The head: stored quantized, or `--quantize-lm-head` on an untied head or a tied one's copy.
    let head_format = input.quantize.filter(|_| input.quantize_lm_head);
    let head = tensors
        .iter()
        .filter(|t| match t.role {
            Role::LmHead => t.stored.is_some() || head_format.is_some_and(|f| f.holds(t.shape[0], t.shape[1])),
            Role::Embedding => input.cfg.tie_word_embeddings && head_format.is_some_and(|f| f.holds(t.shape[0], t.shape[1])),
            _ => false,
        })
        .map(|t| t.shape[0].min(QUANT_HEAD_CHUNK_ROWS) * t.shape[1])
        .max()
        .unwrap_or(0);
    input.target.dense_bytes() as u64 * largest.max(head) as u64
}

fn is_mtp(engine: &EngineConfig) -> bool {
    engine.spec.as_ref().is_some_and(|s| s.method == SpecMethod::Mtp)
}

/// Bytes of the cuBLASLt workspace (`plan::gpu::LT_WORKSPACE_BYTES`) a GPU load allocates
/// when a weight takes an FP8 tensor-core route: `--quantize fp8` rows (FP8_E4M3FN_ROW_BF16S)
/// whose fused N and K are multiples of 16 (`fp8_gemm_fits`), the LM head's with
/// `--quantize-lm-head`, and a checkpoint's HF block FP8 projections of 128 x 128 blocks at
/// such fused shapes (the block-scaled route); NVFP4 parts (stored or `--quantize nvfp4`) where
/// the device is sm_100 or newer or unnamed (the FP4 route). The FP8 routes also need sm_89 or newer (bf16
/// storage for the rows; the block route a cuBLASLt with block scaling, sm_90), which a plan
/// for `--gpu-memory` cannot know: it counts the workspace wherever a shape would take it. The
/// routes' activation codes and multipliers live in the dequantization workspace
/// (`quant_workspace_bytes`): a weight's N x K in the dense type holds 4 rows of its codes
/// beside its widened multipliers, the block route's least (ops/fp8_block.rs).
pub fn lt_workspace_bytes(input: &PlanInput<'_>) -> u64 {
    if input.target != Target::Gpu {
        return 0;
    }
    let tensors = loaded(input);
    let rows = fused_rows(&tensors);
    let blocks128 = crate::quant::QuantFormat::HfFp8Block { block_n: 128, block_k: 128 };
    let stored = tensors.iter().zip(&rows).any(|(t, &r)| t.role == Role::Matrix && t.stored.is_some_and(|q| q.format == blocks128) && r > 0 && fp8_gemm_fits(r, t.shape[1]));
    let quantized = input.quantize.filter(|f| f.mode == QuantizeMode::Fp8).is_some_and(|f| {
        let body = tensors.iter().zip(&rows).any(|(t, &r)| t.role == Role::Matrix && t.stored.is_none() && r > 0 && f.holds(r, t.shape[1]) && fp8_gemm_fits(r, t.shape[1]));
        let head = input.quantize_lm_head
            && tensors.iter().any(|t| (t.role == Role::LmHead || (t.role == Role::Embedding && input.cfg.tie_word_embeddings)) && t.stored.is_none() && fp8_gemm_fits(t.shape[0], t.shape[1]));
        body || head
    });
    // The NVFP4 route (FP4 tensor cores, sm_100 and newer: counted unless the plan names an
    // older device) for NVFP4 parts the layout holds, stored or `--quantize nvfp4`.
    let fp4_device = input.memory.as_ref().and_then(|m| m.cuda).is_none_or(|a| a.compute_capability.0 >= 10);
    let nvfp4_quantized = input.quantize.is_some_and(|f| f.mode == QuantizeMode::Nvfp4);
    let nvfp4 = fp4_device
        && tensors.iter().any(|t| {
            t.role == Role::Matrix && t.shape.len() == 2 && nvfp4_gemm_fits(t.shape[0], t.shape[1]) && (t.stored.is_some_and(|q| q.format == crate::quant::QuantFormat::Nvfp4) || (nvfp4_quantized && t.stored.is_none()))
        });
    if stored || quantized || nvfp4 {
        LT_WORKSPACE_BYTES as u64
    } else {
        0
    }
}

/// What speculative decoding adds to the step buffers: the most drafts a round carries and
/// whether the MTP head drafts (its step buffers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecRows {
    pub max_drafts: usize,
    pub mtp: bool,
}

/// An upper estimate of the step buffers: activations of a `step_rows`-token step, or of the
/// largest padded verify step under speculation (`spec`; `plan::verify_rows`), rounded up to a
/// power of two as the CUDA runner grows them, in the dense type, with the GDN chunk
/// workspace; two f32 logits rows (logits and the sampler's copy) per row wanting logits
/// (decode rows, or every row of a verify step); the MTP head's hidden-state and input
/// buffers. The CUDA runner allocates the verify and sampler buffers at startup
/// (`ModelRunner::reserve_verify`), the engine measures the real high-water mark after its
/// warm-up step, and the device reserve absorbs the difference.
pub fn workspace_estimate(cfg: &ModelConfig, target: Target, step_rows: usize, decode_rows: usize, spec: Option<SpecRows>) -> u64 {
    let pad = |n: usize| n.next_power_of_two().max(8);
    let (verify, verify_logits) = spec.map_or((0, 0), |s| verify_rows(step_rows, decode_rows, s.max_drafts, pad));
    let rows = pad(step_rows.max(verify)) as u64;
    let e = target.dense_bytes() as u64;
    let (h, qd, kvd) = (cfg.hidden_size as u64, (cfg.num_attention_heads * cfg.head_dim) as u64, (cfg.num_kv_heads * cfg.head_dim) as u64);
    let attn_width = qd * if cfg.attn_output_gate { 2 } else { 1 } + 2 * kvd;
    let (cd, vd, nv, dk, dv) = cfg.linear_attention.map_or((0, 0, 0, 0, 0), |la| {
        (la.conv_dim() as u64, la.value_dim() as u64, la.num_value_heads as u64, la.key_head_dim as u64, la.value_head_dim as u64)
    });
    let inter = cfg.intermediate_size as u64;
    let norms = if cfg.qk_norm { qd + kvd } else { 0 };
    let per_row = 4 * h + attn_width.max(cd + vd + 2 * nv) + norms + qd.max(vd) + 3 * inter + cd + vd;
    let gdn = 2 * nv + nv * (dk + dv + 68);
    let logits = 2 * pad(decode_rows.max(verify_logits)) as u64 * cfg.vocab_size as u64 * 4;
    // The MTP head keeps the last forward's hidden rows and gathers its inputs (h) and the
    // concatenated halves (2h) of a step's rows.
    let mtp = if spec.is_some_and(|s| s.mtp) { (rows + 3 * pad(step_rows) as u64) * h * e } else { 0 };
    rows * (per_row * e + gdn * 4) + logits + mtp
}

/// The speculation of `input`'s settings, as the step buffers count it: None without `--spec`.
fn spec_rows(input: &PlanInput<'_>) -> Result<Option<SpecRows>> {
    let Some(s) = input.engine.spec.as_ref() else { return Ok(None) };
    let max_drafts = match drafter(input)? {
        Some(d) => super::drafter::max_drafts(d.block_size, s.draft_tokens)?,
        None => crate::spec::MAX_DRAFT_TOKENS,
    };
    Ok(Some(SpecRows { max_drafts, mtp: s.method == SpecMethod::Mtp }))
}

/// The sizes, ledger and needed bytes of `input` at concurrency `c`, context `ctx` and KV pool
/// `kv` tokens.
fn sized(input: &PlanInput<'_>, spec: &CacheSpec, rows: Option<SpecRows>, c: usize, ctx: usize, kv: usize, reserve: u64) -> Result<(ResolvedConfig, MemoryLedger, u64)> {
    let model_max = input.cfg.max_position_embeddings;
    let engine = EngineConfig { max_concurrency: c, max_context: Some(ctx), kv_capacity_tokens: Some(kv), ..input.engine.clone() };
    let r = engine.resolve(model_max, spec, None)?;
    let mut l = r.ledger(spec);
    let step_rows = if model_max > 0 { r.prefill_chunk.min(model_max) } else { r.prefill_chunk };
    let ws = workspace_estimate(input.cfg, input.target, step_rows, c.min(step_rows), rows) + quant_workspace_bytes(input) + lt_workspace_bytes(input);
    l.workspace_bytes = ws;
    l.total_bytes += ws;
    let needed = l.total_bytes + reserve;
    Ok((r, l, needed))
}

fn pool_tokens(rule: PoolRule, c: usize, ctx: usize) -> usize {
    match rule {
        PoolRule::PerSequence => ctx.saturating_mul(c),
        PoolRule::OneContext => ctx,
    }
}

/// The largest `v` in `1..=hi` with `ok(v)`, for `ok` true up to some value and false after
/// (0 when `ok(1)` is false).
fn largest(hi: usize, ok: impl Fn(usize) -> Result<bool>) -> Result<usize> {
    if hi == 0 || !ok(1)? {
        return Ok(0);
    }
    let (mut lo, mut hi) = (1, hi);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if ok(mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}

/// Plan `input`.
pub fn plan(input: &PlanInput<'_>) -> Result<Plan> {
    let cfg = input.cfg;
    let model_max = cfg.max_position_embeddings;
    let max_context = input.engine.check(model_max)?;
    let (weights, weight_bytes) = weight_lines(input)?;
    let mut spec = cache_spec(cfg, input.target, is_mtp(&input.engine), weight_bytes as usize);
    // A DFlash drafter's context K/V is paged with the KV: part of every token's bytes.
    spec.kv_bytes_per_token += drafter(input)?.map_or(0, |d| d.context_bytes_per_token);
    let rows = spec_rows(input)?;
    let reserve = input.memory.map_or(0, |m| reserve_bytes(input.target, m.total));
    let c = input.engine.max_concurrency;
    let kv = input.engine.kv_capacity_tokens.unwrap_or_else(|| pool_tokens(input.pool, c, max_context));
    let (config, ledger, needed) = sized(input, &spec, rows, c, max_context, kv, reserve)?;
    let fit = match input.memory {
        None => None,
        Some(m) => {
            let fits_at = |c: usize, ctx: usize| -> Result<bool> { Ok(sized(input, &spec, rows, c, ctx, pool_tokens(input.pool, c, ctx), reserve)?.2 <= m.free) };
            let ctx_hi = if model_max > 0 { model_max } else { max_context.max(1 << 22) };
            Some(Fit {
                available: m.free,
                fits: needed <= m.free,
                short: needed.saturating_sub(m.free),
                largest_context: largest(ctx_hi, |ctx| fits_at(c, ctx))?,
                largest_concurrency: largest(MAX_PLANNED_CONCURRENCY, |n| fits_at(n, max_context))?,
                largest_kv_capacity: match input.engine.kv_capacity_tokens {
                    None => None,
                    // The pool cannot go below one context: search above it.
                    Some(kv) => Some(match largest(kv.saturating_sub(max_context) + 1, |extra| Ok(sized(input, &spec, rows, c, max_context, max_context + extra - 1, reserve)?.2 <= m.free))? {
                        0 => 0,
                        n => max_context + n - 1,
                    }),
                },
            })
        }
    };
    let (dequant_workspace_bytes, lt_workspace_bytes) = (quant_workspace_bytes(input), lt_workspace_bytes(input));
    Ok(Plan { weights, spec, config, ledger, reserve_bytes: reserve, needed_bytes: needed, dequant_workspace_bytes, lt_workspace_bytes, model_max_context: model_max, fit })
}

impl Plan {
    /// What would fit, in the flags that set it (for an error or `ninfer plan`'s verdict).
    pub fn fit_hint(&self) -> String {
        let Some(f) = &self.fit else { return String::new() };
        let (c, ctx) = (self.config.max_concurrency, self.config.max_context);
        if f.largest_context == 0 && f.largest_concurrency == 0 {
            let fixed = self.ledger.weight_bytes + self.ledger.workspace_bytes + self.reserve_bytes;
            return format!(
                "nothing fits: the weights ({} B), step workspace and reserve alone need {fixed} B of {} B; use a larger device or smaller weights (--quantize)",
                self.ledger.weight_bytes, f.available
            );
        }
        let mut parts = Vec::new();
        match f.largest_kv_capacity {
            Some(0) => parts.push(format!("no --kv-capacity fits at --max-context {ctx}")),
            Some(kv) => parts.push(format!("at most --kv-capacity {kv} fits")),
            None => {}
        }
        if f.largest_context > 0 {
            parts.push(format!("at --max-concurrency {c} at most --max-context {} fits", f.largest_context));
        } else {
            parts.push(format!("no --max-context fits at --max-concurrency {c}"));
        }
        if f.largest_concurrency > 0 {
            parts.push(format!("at --max-context {ctx} at most --max-concurrency {} fits", f.largest_concurrency));
        } else {
            parts.push(format!("no --max-concurrency fits at --max-context {ctx}"));
        }
        parts.join("; ")
    }
}

/// The engine's startup check, before any weight is read: plan the model in `dir` on `device`
/// ("cpu" or "cuda:N") with one full context of KV (`PoolRule::OneContext`, or the
/// `--kv-capacity` given) and the weights as the load's `--quantize` / `--quantize-lm-head`
/// (`quantize`) will hold them, and refuse with an `OutOfMemory` error, bytes needed against
/// available and the settings that would fit, when even that does not fit. Where the host does
/// not say how much memory it has, nothing is checked.
pub fn check_startup(dir: &Path, cfg: &ModelConfig, device: &str, engine: &EngineConfig, quantize: (Option<QuantizeMode>, bool)) -> Result<Plan> {
    let (target, memory) = match device.strip_prefix("cuda:") {
        Some(n) => {
            let ordinal = n.parse().map_err(|_| NinferError::Device(format!("`{device}` is not a device")))?;
            (Target::Gpu, Some(device_memory(ordinal)?))
        }
        None => (Target::Cpu, host_available_bytes()),
    };
    let store = WeightStore::open(dir)?;
    let tensors = checkpoint_tensors(dir, cfg, Some(&store))?;
    let input = PlanInput { cfg, tensors: &tensors, target, engine: engine.clone(), quantize: quantize.0.map(QuantFormat::of), quantize_lm_head: quantize.1, memory, pool: PoolRule::OneContext };
    if target == Target::Gpu {
        check_gpu_load(dir, Some(&store), &input)?;
    }
    let p = plan(&input)?;
    if let Some(f) = p.fit.as_ref().filter(|f| !f.fits) {
        let l = &p.ledger;
        return Err(NinferError::OutOfMemory {
            what: format!(
                "{} on {device} before loading it (weights {} B, KV {} tokens {} B, {} state slots {} B, workspace {} B, reserve {} B)",
                dir.display(),
                l.weight_bytes,
                l.kv_capacity_tokens,
                l.kv_bytes,
                l.state_slots,
                l.state_bytes,
                l.workspace_bytes,
                p.reserve_bytes
            ),
            needed: p.needed_bytes,
            available: f.available,
            hint: p.fit_hint(),
        });
    }
    Ok(p)
}

/// The CUDA loader's own refusals of `input`'s load of the model in `dir` (`store`: its
/// safetensors headers, None for config.json alone), run before any weight is read
/// (`model::cuda::load::check_load`: the configuration the kernels take, and with the headers
/// the loader's whole plan pass, whose fused projections refuse parts of mixed formats, widths,
/// row units or g_idx, dense parts before quantized ones, and on an f16-storage device (sm_7x,
/// known only where `input.memory` came from the device, not `--gpu-memory`) stored FP8 /
/// NVFP4 weights whose scales exceed binary16's range), so that `ninfer plan` for a GPU
/// refuses, naming the tensor, the format and the reason, what the load would refuse. The
/// shape rules that need no headers (`plan::gpu`) run in `plan` itself. A build without the
/// CUDA backend has no loader to ask: only those.
pub fn check_gpu_load(dir: &Path, store: Option<&WeightStore>, input: &PlanInput<'_>) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use crate::backend::cuda::kernels::StorageDType;
        let hf = crate::model::cpu::quant_load::hf_quant_config(dir)?;
        let quant = crate::model::cuda::load::QuantLoad { quantize: input.quantize.map(|f| f.mode.format()), quantize_lm_head: input.quantize_lm_head, given: None, hf };
        let f16 = input.memory.and_then(|m| m.cuda).filter(|a| StorageDType::for_arch(a.compute_capability.0, a.compute_capability.1) == StorageDType::F16);
        crate::model::cuda::load::check_load(input.cfg, store, &quant, is_mtp(&input.engine), f16.map(|a| a.describe()).as_deref())?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (dir, store, input);
    Ok(())
}
