//! `_core.Engine`: the engine as Python sees it.
//!
//! Two modes share one object: inline (`step()` runs one engine step on the caller's thread, for
//! the offline API) and background (`start_background()` moves the core to its own OS thread;
//! `poll()` waits for deltas). Every call that can take time releases the GIL, and each `step` /
//! `poll` crosses into Python once with all deltas of the step(s).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::chat::{resolve_max_tokens, ChatInput};
use super::delta::PyDelta;
use super::errors::{IntoPy, InvalidRequestError};
use super::generation::defaults_dict;
use super::sampling::PySamplingParams;
use super::tokenizer::PyTokenizer;
use crate::config::generation_config::SamplingDefaults;
use crate::config::{GenerationConfig, ModelConfig};
use crate::engine::{EngineConfig, EngineCore, EngineHandle, EngineStats, MemoryLedger, RequestOutput, ResolvedConfig, ToyRunner};
use crate::config::CudaOptions;
use crate::model::{load_model, resolve_device_name, KvDtype, LoadOptions, LogitsDtype, ModelRunner};
use crate::quant::QuantizeMode;
use crate::sampling::thinking::ThinkingTags;
use crate::sampling::SamplingParams;
use crate::spec::SpecConfig;
use crate::tokenizer::Tokenizer;
use crate::{NinferError, Result};

enum Mode {
    Inline(Box<EngineCore>),
    Background(Arc<EngineHandle>),
    Closed,
}

/// The engine object of `ninfer._core`.
#[pyclass(name = "Engine", module = "ninfer._core")]
pub struct PyEngine {
    mode: Mutex<Mode>,
    config: ResolvedConfig,
    ledger: MemoryLedger,
    eos_token_ids: Vec<u32>,
    vocab_size: usize,
    device: String,
    tokenizer: Option<Arc<Tokenizer>>,
    /// generation_config.json's sampling defaults, parsed with the EOS ids at load.
    generation_defaults: SamplingDefaults,
    /// Whether steps overlap the host's work on the step before (asynchronous scheduling).
    async_scheduling: bool,
    /// Speculative decoding (`--spec`), None when off.
    spec: Option<SpecConfig>,
}

impl PyEngine {
    fn from_core(core: EngineCore, device: String, generation_defaults: SamplingDefaults) -> Self {
        PyEngine {
            generation_defaults,
            config: core.config().clone(),
            ledger: core.ledger(),
            eos_token_ids: core.eos_token_ids().to_vec(),
            vocab_size: core.validator().vocab_size,
            device,
            tokenizer: core.tokenizer().cloned(),
            async_scheduling: core.overlaps_steps(),
            spec: core.spec_config().cloned(),
            mode: Mutex::new(Mode::Inline(Box::new(core))),
        }
    }

    /// The background handle (None once shut down); an error in inline mode.
    fn background(&self) -> PyResult<Option<Arc<EngineHandle>>> {
        self.with_mode(|m| match m {
            Mode::Background(h) => Ok(Some(h.clone())),
            Mode::Inline(_) => Err(PyRuntimeError::new_err("poll() needs start_background() first")),
            Mode::Closed => Ok(None),
        })
    }

    /// Queue one checked request in either mode (the caller has released the GIL).
    fn queue(&self, request_id: &str, prompt: Vec<u32>, params: SamplingParams) -> PyResult<()> {
        self.with_mode(|m| match m {
            Mode::Inline(core) => core.add_request(request_id, prompt, params).py(),
            Mode::Background(h) => h.submit(request_id, prompt, params).py(),
            Mode::Closed => Err(closed()),
        })
    }

    /// Abort a request in either mode (the caller has released the GIL).
    fn abort_queued(&self, request_id: &str) -> PyResult<()> {
        self.with_mode(|m| match m {
            Mode::Inline(core) => {
                core.abort(request_id);
                Ok(())
            }
            Mode::Background(h) => h.abort(request_id).py(),
            Mode::Closed => Ok(()),
        })
    }

    fn with_mode<T>(&self, f: impl FnOnce(&mut Mode) -> PyResult<T>) -> PyResult<T> {
        let mut g = self.mode.lock().map_err(|_| PyRuntimeError::new_err("engine lock poisoned"))?;
        f(&mut g)
    }
}

#[allow(clippy::too_many_arguments)]
fn engine_config(max_context: Option<usize>, kv_capacity: Option<usize>, max_concurrency: usize, prefill_chunk: usize, prefix_reuse: bool, async_scheduling: bool) -> EngineConfig {
    EngineConfig { max_context, kv_capacity_tokens: kv_capacity, max_concurrency, prefill_chunk, prefix_reuse, async_scheduling, ..Default::default() }
}

/// `--spec` / `--draft-tokens` / `--drafter` / `--spec-adaptive` / `--lm-head-draft
/// [--lm-head-draft-size]` as the engine takes them; the others without a method are refused
/// naming their flag.
pub(super) fn spec_config(spec: Option<&str>, draft_tokens: Option<usize>, drafter: Option<PathBuf>, adaptive: bool, lm_head_draft: bool, lm_head_draft_size: Option<usize>) -> Result<Option<SpecConfig>> {
    let Some(method) = spec else {
        if draft_tokens.is_some() {
            return Err(NinferError::config("draft_tokens (--draft-tokens)", "needs --spec (the method that drafts them)"));
        }
        if drafter.is_some() {
            return Err(NinferError::config("drafter (--drafter)", "needs --spec dflash (the method that drafts with it)"));
        }
        if adaptive {
            return Err(NinferError::config("spec_adaptive (--spec-adaptive)", "needs --spec (the method whose draft length it adapts)"));
        }
        if lm_head_draft || lm_head_draft_size.is_some() {
            return Err(NinferError::config("lm_head_draft (--lm-head-draft)", "--lm-head-draft needs --spec mtp (the MTP head drafts over the reduced vocabulary)"));
        }
        return Ok(None);
    };
    let cfg = SpecConfig::with_drafter(method, draft_tokens, drafter)?.with_adaptive(adaptive);
    match (lm_head_draft, lm_head_draft_size) {
        (true, size) => cfg.with_lm_head_draft(size).map(Some),
        (false, Some(_)) => Err(NinferError::config("lm_head_draft_size (--lm-head-draft-size)", "needs --lm-head-draft")),
        (false, None) => Ok(Some(cfg)),
    }
}

/// Load the engine; also returns the device it resolved to ("auto" becomes "cpu" or "cuda:N")
/// and generation_config.json's sampling defaults.
#[allow(clippy::too_many_arguments)]
fn load(dir: &str, device: &str, num_threads: Option<usize>, logits_dtype: LogitsDtype, kv_dtype: KvDtype, cuda: CudaOptions, quant: (Option<QuantizeMode>, bool), cfg: &EngineConfig) -> Result<(EngineCore, String, SamplingDefaults)> {
    let dir = PathBuf::from(dir);
    let device = resolve_device_name(device)?;
    // The flags that need only config.json (and the draft vocabulary) are checked before any
    // weight is read, then the memory plan (`ninfer plan`'s arithmetic): a start that cannot fit
    // fails here, naming the bytes needed, the bytes available and the settings that would fit.
    let model_cfg = ModelConfig::from_dir(&dir)?;
    cfg.check(model_cfg.max_position_embeddings)?;
    let mut cfg = cfg.clone();
    if let Some(d) = cfg.spec.as_mut().and_then(|s| s.lm_head_draft.as_mut()) {
        d.token_ids = crate::spec::draft_vocab::read(&dir, d.size, model_cfg.vocab_size)?;
    }
    let cfg = &cfg;
    crate::plan::check_startup(&dir, &model_cfg, &device, cfg, quant)?;
    let runner: Box<dyn ModelRunner> = load_model(&dir, &LoadOptions { device: device.clone(), num_threads, logits_dtype, kv_dtype, cuda, quantize: quant.0, quantize_lm_head: quant.1, quant_tensors: None })?;
    let tokenizer = match Tokenizer::from_dir(&dir) {
        Ok(t) => Some(Arc::new(t)),
        Err(NinferError::MissingFile { .. }) => None,
        Err(e) => return Err(e),
    };
    let gen = GenerationConfig::from_dir(&dir)?;
    Ok((EngineCore::new(runner, cfg, tokenizer, gen.eos_token_ids)?, device, gen.sampling))
}

fn outputs_list<'py>(py: Python<'py>, outs: &[RequestOutput]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for o in outs {
        list.append(PyDelta::from_output(py, o)?)?;
    }
    Ok(list)
}

fn stats_dict<'py>(py: Python<'py>, s: &EngineStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("running", s.running)?;
    d.set_item("waiting", s.waiting)?;
    d.set_item("kv_blocks_used", s.kv_blocks_used)?;
    d.set_item("kv_blocks_total", s.kv_blocks_total)?;
    d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
    d.set_item("prompt_tokens_total", s.prompt_tokens_total)?;
    d.set_item("generation_tokens_total", s.generation_tokens_total)?;
    d.set_item("reasoning_tokens_total", s.reasoning_tokens_total)?;
    d.set_item("prefill_tokens_computed", s.prefill_tokens_computed)?;
    d.set_item("max_batch_size_seen", s.max_batch_size_seen)?;
    d.set_item("steps", s.steps)?;
    d.set_item("lookahead_steps", s.lookahead_steps)?;
    d.set_item("split_lookahead_steps", s.split_lookahead_steps)?;
    d.set_item("preemptions", s.preemptions)?;
    d.set_item("spec_verify_steps", s.spec.verify_steps)?;
    d.set_item("spec_drafted_tokens", s.spec.drafted)?;
    d.set_item("spec_accepted_tokens", s.spec.accepted)?;
    d.set_item("spec_mean_accepted_length", s.spec.mean_accepted_length())?;
    d.set_item("spec_acceptance_by_position", s.spec.acceptance_by_position())?;
    d.set_item("spec_rollback_tokens", s.spec.rollback_tokens)?;
    d.set_item("spec_replayed_tokens", s.spec.replayed_tokens)?;
    d.set_item("spec_mean_k_chosen", s.spec.mean_k_chosen())?;
    Ok(d)
}

fn closed() -> PyErr {
    PyRuntimeError::new_err("the engine was shut down")
}

#[pymethods]
impl PyEngine {
    /// Load a model directory (weights, tokenizer.json if present, generation_config.json).
    /// `kv_dtype`: "auto" or the type the backend keeps its KV cache in by name
    /// (model/kv_dtype.rs); another is refused before any weight is read. `async_scheduling`:
    /// keep a step in flight where the runner overlaps steps (`EngineConfig::async_scheduling`).
    /// `cuda_graphs`, `batch_invariant`, `device_sampling` and `device_profile` (a measured
    /// profile's path, backend/cuda/plan/profile.rs): the CUDA backend's options (`CudaOptions`).
    /// `json_schema_open_objects`: `EngineConfig::json_schema_open_objects`. `quantize` (a
    /// `--quantize` mode) and `quantize_lm_head`: `LoadOptions::quantize` / `quantize_lm_head`.
    #[new]
    #[pyo3(signature = (model_dir, device="cpu", max_context=None, kv_capacity=None, max_concurrency=64, prefill_chunk=512, prefix_reuse=true, num_threads=None, logits_dtype="auto", kv_dtype="auto", async_scheduling=true, cuda_graphs=true, batch_invariant=false, device_sampling=true, device_profile=None, json_schema_open_objects=false, spec=None, draft_tokens=None, spec_adaptive=false, lm_head_draft=false, lm_head_draft_size=None, quantize=None, quantize_lm_head=false, drafter=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: &str,
        device: &str,
        max_context: Option<usize>,
        kv_capacity: Option<usize>,
        max_concurrency: usize,
        prefill_chunk: usize,
        prefix_reuse: bool,
        num_threads: Option<usize>,
        logits_dtype: &str,
        kv_dtype: &str,
        async_scheduling: bool,
        cuda_graphs: bool,
        batch_invariant: bool,
        device_sampling: bool,
        device_profile: Option<PathBuf>,
        json_schema_open_objects: bool,
        spec: Option<&str>,
        draft_tokens: Option<usize>,
        spec_adaptive: bool,
        lm_head_draft: bool,
        lm_head_draft_size: Option<usize>,
        quantize: Option<&str>,
        quantize_lm_head: bool,
        drafter: Option<PathBuf>,
    ) -> PyResult<Self> {
        let quant = (quantize.map(QuantizeMode::parse).transpose().py()?, quantize_lm_head);
        let mut cfg = EngineConfig { json_schema_open_objects, ..engine_config(max_context, kv_capacity, max_concurrency, prefill_chunk, prefix_reuse, async_scheduling) };
        cfg.spec = spec_config(spec, draft_tokens, drafter, spec_adaptive, lm_head_draft, lm_head_draft_size).py()?;
        let logits_dtype = LogitsDtype::parse(logits_dtype).py()?;
        let kv_dtype = KvDtype::parse(kv_dtype).py()?;
        let cuda = CudaOptions { cuda_graphs, batch_invariant, device_sampling, profile: device_profile };
        let (core, device, defaults) = py.detach(|| load(model_dir, device, num_threads, logits_dtype, kv_dtype, cuda, quant, &cfg)).py()?;
        Ok(PyEngine::from_core(core, device, defaults))
    }

    /// An engine over the deterministic toy model (no weights, no tokenizer): for testing the
    /// Python layers, the server and the CLI without a model. `overlapping`: the toy overlaps
    /// steps as the CUDA runner does (`ToyRunner::overlapping`), so `async_scheduling` takes
    /// effect.
    #[staticmethod]
    #[pyo3(signature = (vocab_size=64, max_position_embeddings=4096, hybrid=false, eos_token_ids=None, max_context=None, kv_capacity=None, max_concurrency=64, prefill_chunk=512, prefix_reuse=true, overlapping=false, async_scheduling=true, spec=None, draft_tokens=None, spec_adaptive=false))]
    #[allow(clippy::too_many_arguments)]
    fn toy(
        vocab_size: usize,
        max_position_embeddings: usize,
        hybrid: bool,
        eos_token_ids: Option<Vec<u32>>,
        max_context: Option<usize>,
        kv_capacity: Option<usize>,
        max_concurrency: usize,
        prefill_chunk: usize,
        prefix_reuse: bool,
        overlapping: bool,
        async_scheduling: bool,
        spec: Option<&str>,
        draft_tokens: Option<usize>,
        spec_adaptive: bool,
    ) -> PyResult<Self> {
        let mut cfg = engine_config(max_context, kv_capacity, max_concurrency, prefill_chunk, prefix_reuse, async_scheduling);
        cfg.spec = spec_config(spec, draft_tokens, None, spec_adaptive, false, None).py()?;
        let runner = ToyRunner::new(vocab_size, max_position_embeddings, hybrid);
        let runner = if overlapping { runner.overlapping() } else { runner };
        let core = EngineCore::new(Box::new(runner), &cfg, None, eos_token_ids.unwrap_or_default()).py()?;
        Ok(PyEngine::from_core(core, "toy".into(), SamplingDefaults::default()))
    }

    /// Queue a request; raises InvalidRequestError / ContextOverflowError at once on bad input.
    fn submit(&self, py: Python<'_>, request_id: &str, prompt_token_ids: Vec<u32>, params: PyRef<'_, PySamplingParams>) -> PyResult<()> {
        let params = params.inner.clone();
        py.detach(|| self.queue(request_id, prompt_token_ids, params))
    }

    /// A chat request in one crossing: render `messages` (JSON) with the chat template (with
    /// `tools` and `chat_template_kwargs`, JSON too), tokenize, and queue one request per id
    /// (the `n` choices of one call; choice `i` samples with `seed + i`). `params` is as
    /// `submit`'s; its `max_tokens` is replaced by `max_tokens`, or when None by
    /// `default_max_tokens` clamped to the context left, else all of it. All or nothing: when
    /// one request is refused, those queued are aborted and the error raised. Returns
    /// (prompt tokens, whether the output starts inside `<think>`, whether the vocabulary has
    /// the `<think>` / `</think>` tags).
    #[pyo3(signature = (request_ids, messages_json, params, tools_json=None, chat_template_kwargs_json=None, max_tokens=None, default_max_tokens=None, add_generation_prompt=true))]
    #[allow(clippy::too_many_arguments)]
    fn submit_chat(
        &self,
        py: Python<'_>,
        request_ids: Vec<String>,
        messages_json: &str,
        params: PyRef<'_, PySamplingParams>,
        tools_json: Option<&str>,
        chat_template_kwargs_json: Option<&str>,
        max_tokens: Option<usize>,
        default_max_tokens: Option<usize>,
        add_generation_prompt: bool,
    ) -> PyResult<(usize, bool, bool)> {
        let tokenizer = self.tokenizer.clone().ok_or_else(|| InvalidRequestError::new_err("this model has no tokenizer: pass prompt token ids"))?;
        let params = params.inner.clone();
        let input = ChatInput::parse(messages_json, tools_json, chat_template_kwargs_json).py()?;
        let prompt = py.detach(|| tokenizer.chat_prompt(&input.messages, input.tools.as_ref(), add_generation_prompt, &input.kwargs)).py()?;
        let max_tokens = resolve_max_tokens(py, max_tokens, default_max_tokens, prompt.token_ids.len(), self.config.max_context)?;
        py.detach(|| {
            for (i, rid) in request_ids.iter().enumerate() {
                let p = SamplingParams { max_tokens, seed: params.seed.map(|s| s.wrapping_add(i as u64)), ..params.clone() };
                if let Err(e) = self.queue(rid, prompt.token_ids.clone(), p) {
                    for done in &request_ids[..i] {
                        let _ = self.abort_queued(done);
                    }
                    return Err(e);
                }
            }
            Ok(())
        })?;
        Ok((prompt.token_ids.len(), prompt.starts_in_reasoning, tokenizer.has_thinking_tags()))
    }

    /// Abort a request; its final delta ("abort") comes with the next step / poll.
    fn abort(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        py.detach(|| self.abort_queued(request_id))
    }

    /// Run one engine step (inline mode) and return its deltas (`Delta`: request_id, token_ids,
    /// text, logprobs, finish_reason, prompt_tokens, completion_tokens, cached_tokens, error,
    /// the message only on the last delta of a request that failed midway: finish_reason
    /// "error", and stop_reason, the stop string or stop token id that ended it).
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let outs = py.detach(|| {
            self.with_mode(|m| match m {
                Mode::Inline(core) => core.step().py(),
                Mode::Background(_) => Err(PyRuntimeError::new_err("the engine runs in the background: use poll()")),
                Mode::Closed => Err(closed()),
            })
        })?;
        outputs_list(py, &outs)
    }

    /// Whether any request has not delivered its final delta.
    fn has_unfinished(&self) -> PyResult<bool> {
        self.with_mode(|m| {
            Ok(match m {
                Mode::Inline(core) => core.has_unfinished(),
                Mode::Background(h) => h.has_unfinished(),
                Mode::Closed => false,
            })
        })
    }

    /// Logits of every position of `token_ids`, as a float32 array [T, vocab].
    fn score<'py>(&self, py: Python<'py>, token_ids: Vec<u32>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let t = token_ids.len();
        let data = py.detach(move || -> PyResult<Vec<f32>> {
            let mut g = self.mode.lock().map_err(|_| PyRuntimeError::new_err("engine lock poisoned"))?;
            match &mut *g {
                Mode::Inline(core) => core.score(&token_ids).py(),
                Mode::Background(h) => {
                    let h = h.clone();
                    drop(g);
                    h.score(token_ids).py()
                }
                Mode::Closed => Err(closed()),
            }
        })?;
        let vocab = data.len().checked_div(t).unwrap_or(0);
        let arr = PyArray1::from_vec(py, data);
        arr.reshape([t, vocab])
    }

    /// Move the engine onto its own OS thread; use `poll` from then on.
    fn start_background(&self) -> PyResult<()> {
        self.with_mode(|m| match std::mem::replace(m, Mode::Closed) {
            Mode::Inline(core) => {
                *m = Mode::Background(Arc::new(EngineHandle::start(*core).py()?));
                Ok(())
            }
            other => {
                *m = other;
                Err(PyRuntimeError::new_err("the engine is not in inline mode"))
            }
        })
    }

    /// Wait (GIL released) for deltas; returns as soon as there are some. `timeout_s` None
    /// waits until there are, the engine fails or it is shut down (then the list is empty),
    /// so the caller's thread sleeps instead of waking on a timer. The wait holds no lock:
    /// `submit`, `abort` and `shutdown` from other threads go through meanwhile.
    #[pyo3(signature = (timeout_s=None))]
    fn poll<'py>(&self, py: Python<'py>, timeout_s: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let timeout = timeout_s.map(|t| Duration::from_secs_f64(t.max(0.0)));
        let handle = self.background()?;
        let outs = match handle {
            Some(h) => py.detach(|| h.wait(timeout)).py()?,
            None => Vec::new(),
        };
        outputs_list(py, &outs)
    }

    /// Counters: running, waiting, kv blocks, prefix hits, token totals, steps.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with_mode(|m| {
            Ok(match m {
                Mode::Inline(core) => core.stats(),
                Mode::Background(h) => h.stats(),
                Mode::Closed => EngineStats::default(),
            })
        })?;
        stats_dict(py, &s)
    }

    /// The memory ledger and the resolved configuration.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let (c, l) = (&self.config, &self.ledger);
        d.set_item("device", &self.device)?;
        d.set_item("max_context", c.max_context)?;
        d.set_item("kv_capacity_tokens", c.kv_capacity_tokens)?;
        d.set_item("block_size", c.block_size)?;
        d.set_item("num_blocks", c.num_blocks)?;
        d.set_item("max_concurrency", c.max_concurrency)?;
        d.set_item("prefill_chunk", c.prefill_chunk)?;
        d.set_item("prefix_reuse", c.prefix_reuse)?;
        d.set_item("async_scheduling", self.async_scheduling)?;
        d.set_item("spec", self.spec.as_ref().map(|s| s.method.name()))?;
        d.set_item("draft_tokens", self.spec.as_ref().map(|s| s.draft_tokens))?;
        d.set_item("spec_adaptive", self.spec.as_ref().is_some_and(|s| s.adaptive))?;
        d.set_item("lm_head_draft_size", self.spec.as_ref().and_then(|s| s.lm_head_draft.as_ref()).map(|d| d.token_ids.len()))?;
        d.set_item("drafter", self.spec.as_ref().and_then(|s| s.drafter.as_ref()).map(|p| p.display().to_string()))?;
        d.set_item("state_slots_rollback", c.rollback_state_slots)?;
        d.set_item("state_slots_running", c.running_state_slots)?;
        d.set_item("state_slots_snapshot", c.snapshot_state_slots)?;
        d.set_item("weight_bytes", l.weight_bytes)?;
        d.set_item("kv_bytes_per_token", l.kv_bytes_per_token)?;
        d.set_item("kv_bytes", l.kv_bytes)?;
        d.set_item("state_bytes_per_slot", l.state_bytes_per_slot)?;
        d.set_item("state_bytes", l.state_bytes)?;
        d.set_item("workspace_bytes", l.workspace_bytes)?;
        d.set_item("total_bytes", l.total_bytes)?;
        if let Some(free) = l.device_free_bytes {
            d.set_item("device_free_bytes", free)?;
        }
        d.set_item("vocab_size", self.vocab_size)?;
        Ok(d)
    }

    /// The tokenizer the engine decodes with (None when the model directory has no
    /// tokenizer.json).
    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> PyResult<Option<Py<PyTokenizer>>> {
        self.tokenizer.as_ref().map(|t| Py::new(py, PyTokenizer::from_shared(t.clone()))).transpose()
    }

    /// Token ids that end generation (from generation_config.json).
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_ids.clone()
    }

    /// generation_config.json's sampling defaults under the request's field names (temperature,
    /// top_p, top_k, min_p, repetition_penalty, max_tokens): the fields it sets, {} without it.
    #[getter]
    fn generation_defaults<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        defaults_dict(py, &self.generation_defaults)
    }

    /// How many tokens the engine forces to close a reasoning block whose `thinking_budget`
    /// ran out (with `message`, a transition sentence, before the end tag); None when the
    /// vocabulary has no thinking tags (budgets then change nothing). A request's budget plus
    /// this must stay under its max_tokens.
    #[pyo3(signature = (message=None))]
    fn thinking_closing_tokens(&self, message: Option<&str>) -> PyResult<Option<usize>> {
        let Some(tags) = self.tokenizer.as_ref().and_then(ThinkingTags::of) else {
            return Ok(None);
        };
        Ok(Some(tags.closing(message).py()?.len()))
    }

    /// Longest prompt + max_tokens a request may have.
    #[getter]
    fn max_context(&self) -> usize {
        self.config.max_context
    }

    /// Stop the engine (the thread, if any) and free the model.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            self.with_mode(|m| {
                if let Mode::Background(h) = m {
                    h.shutdown();
                }
                *m = Mode::Closed;
                Ok(())
            })
        })
    }
}

/// Add `Engine` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()
}
