//! `_core.Model`: a loaded model for whole-prompt logits (parity tests, scoring).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{PyArray2, PyArray3, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::IntoPy;
use crate::backend::cuda::{resolve_device, ResolvedDevice};
use crate::model::{load_model, parse_device, CpuModel, LoadOptions, LogitsDtype, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
use crate::quant::{QuantFormat, QuantWeight, QuantizeMode};
use crate::NinferError;

/// Block size of the private KV pool `logits` uses.
const BLOCK_SIZE: usize = 16;

/// A model loaded from a HF directory (config.json + safetensors).
#[pyclass(name = "Model", module = "ninfer._core")]
pub struct PyModel {
    model: Mutex<Loaded>,
}

/// A runner on any backend plus what `config` reports about it and the size of the private
/// cache pool `logits` allocated.
struct Loaded {
    runner: Box<dyn ModelRunner>,
    has_mtp: bool,
    /// CPU worker threads (None on a GPU).
    num_threads: Option<usize>,
    /// (blocks, block size, state slots) allocated so far.
    capacity: (usize, usize, usize),
}

#[pymethods]
impl PyModel {
    #[new]
    /// `logits_dtype`: "auto" (logits rounded to the 16-bit dtype the model runs in, as
    /// transformers returns them) or "float32" (the lm_head's f32 sums).
    /// `cuda_graphs`, `batch_invariant`, `device_sampling`: the CUDA backend's options
    /// (`CudaOptions`); `device_profile`: a device profile's path (backend/cuda/plan/profile.rs),
    /// whose routes override the plan's defaults (the GPU tests compare routes through it).
    /// `quantize` (a `--quantize` mode such as "q4") and `quantize_lm_head`: quantization on
    /// load (`LoadOptions::quantize`). `quant_tensors`: packed weights by checkpoint tensor name,
    /// each `(format name, bytes, (N, K))`, used instead of the checkpoint's (GGUF tensors the
    /// caller read; `LoadOptions::quant_tensors`).
    #[pyo3(signature = (model_dir, device = "cpu", num_threads = None, logits_dtype = "auto", cuda_graphs = true, batch_invariant = false, device_sampling = true, device_profile = None, quantize = None, quantize_lm_head = false, quant_tensors = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: PathBuf,
        device: &str,
        num_threads: Option<usize>,
        logits_dtype: &str,
        cuda_graphs: bool,
        batch_invariant: bool,
        device_sampling: bool,
        device_profile: Option<PathBuf>,
        quantize: Option<&str>,
        quantize_lm_head: bool,
        quant_tensors: Option<HashMap<String, (String, Vec<u8>, (usize, usize))>>,
    ) -> PyResult<Self> {
        let logits_dtype = LogitsDtype::parse(logits_dtype).py()?;
        let cuda = crate::config::CudaOptions { cuda_graphs, batch_invariant, device_sampling, profile: device_profile };
        let quantize = quantize.map(QuantizeMode::parse).transpose().py()?;
        let quant_tensors = quant_tensors
            .map(|m| {
                m.into_iter()
                    .map(|(name, (format, bytes, (n, k)))| {
                        let f = QuantFormat::from_name(&format).ok_or_else(|| NinferError::Unsupported(format!("quantized format {format:?} of tensor {name} (self-contained formats only)")))?;
                        Ok((name.clone(), QuantWeight::packed(name, f, [n, k], bytes)))
                    })
                    .collect::<crate::Result<HashMap<_, _>>>()
            })
            .transpose()
            .py()?
            .map(Arc::new);
        let opts = LoadOptions { device: device.to_string(), num_threads, logits_dtype, cuda, quantize, quantize_lm_head, quant_tensors, ..Default::default() };
        let model = py
            .detach(|| -> crate::Result<Loaded> {
                if resolve_device(parse_device(device)?)? == ResolvedDevice::Cpu {
                    let cpu = CpuModel::load(&model_dir, &opts)?;
                    let (has_mtp, threads) = (cpu.mtp().is_some(), cpu.num_threads());
                    return Ok(Loaded { runner: Box::new(cpu), has_mtp, num_threads: Some(threads), capacity: (0, 0, 0) });
                }
                let runner = load_model(&model_dir, &opts)?;
                let has_mtp = runner.config().mtp_num_layers > 0;
                Ok(Loaded { runner, has_mtp, num_threads: None, capacity: (0, 0, 0) })
            })
            .py()?;
        Ok(PyModel { model: Mutex::new(model) })
    }

    /// Logits of every position of `token_ids`: float32 `[T, vocab]`, in one forward, or in
    /// forwards of `chunk` tokens each continuing from the cached prefix (chunked prefill).
    #[pyo3(signature = (token_ids, chunk = None))]
    fn logits<'py>(&self, py: Python<'py>, token_ids: Vec<u32>, chunk: Option<usize>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        if token_ids.is_empty() {
            return Err(NinferError::EmptyPrompt).py();
        }
        if chunk == Some(0) {
            return Err(NinferError::invalid("chunk", "must be at least 1 token")).py();
        }
        let t = token_ids.len();
        let logits = py
            .detach(|| {
                let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
                let blocks = t.div_ceil(BLOCK_SIZE);
                let (have_blocks, have_bs, have_slots) = m.capacity;
                if have_bs != BLOCK_SIZE || have_blocks < blocks || have_slots < 1 {
                    m.runner.allocate_caches(blocks, BLOCK_SIZE, 1)?;
                    m.capacity = (blocks, BLOCK_SIZE, 1);
                }
                let chunk = chunk.unwrap_or(t);
                let mut data = Vec::with_capacity(t);
                let mut vocab = 0;
                for start in (0..t).step_by(chunk) {
                    let batch = StepBatch {
                        seqs: vec![SeqChunk {
                            tokens: token_ids[start..(start + chunk).min(t)].to_vec(),
                            start_pos: start,
                            block_table: (0..blocks as u32).collect(),
                            state_slot: 0,
                            logits: LogitsWanted::All,
                        }],
                    };
                    let part = m.runner.forward(&batch)?;
                    vocab = part.vocab;
                    data.extend(part.data);
                }
                Ok::<_, NinferError>((vocab, data))
            })
            .py()?;
        let (vocab, data) = logits;
        numpy::PyArray1::from_vec(py, data).reshape([t, vocab])
    }

    /// Greedy decoding of `prompts` for `steps` tokens, for exactness tests of the decode path:
    /// each prompt is prefilled in a step of its own, then every decode step runs all
    /// sequences together (one token each). Returns (tokens `[n][steps]`, float32 logits
    /// `[steps, n, vocab]` of every decode step, decode graphs the model holds at the end).
    /// A test hook, compiled with the `testing` feature (which the extension's build turns on).
    #[cfg(feature = "testing")]
    fn decode_greedy<'py>(&self, py: Python<'py>, prompts: Vec<Vec<u32>>, steps: usize) -> PyResult<(Vec<Vec<u32>>, Bound<'py, PyArray3<f32>>, usize)> {
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(NinferError::EmptyPrompt).py();
        }
        let n = prompts.len();
        let (tokens, data, vocab, graphs) = py
            .detach(|| -> crate::Result<_> {
                let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
                let lens: Vec<usize> = prompts.iter().map(|p| p.len() + steps).collect();
                let tables = m.own_tables(&lens)?;
                let argmax = crate::sampling::argmax;
                let mut last = Vec::with_capacity(n);
                for (i, p) in prompts.iter().enumerate() {
                    let seqs = vec![SeqChunk { tokens: p.clone(), start_pos: 0, block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::Last }];
                    let l = m.runner.forward(&StepBatch { seqs })?;
                    last.push(argmax(l.of_seq(0)));
                }
                let vocab = m.runner.config().vocab_size;
                let mut tokens = vec![Vec::with_capacity(steps); n];
                let mut data = Vec::with_capacity(steps * n * vocab);
                for step in 0..steps {
                    let seqs = (0..n)
                        .map(|i| SeqChunk { tokens: vec![last[i]], start_pos: prompts[i].len() + step, block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::Last })
                        .collect();
                    let l = m.runner.forward(&StepBatch { seqs })?;
                    for (i, t) in tokens.iter_mut().enumerate() {
                        t.push(last[i]);
                        last[i] = argmax(l.of_seq(i));
                    }
                    data.extend_from_slice(&l.data);
                }
                Ok((tokens, data, vocab, m.runner.decode_graphs()))
            })
            .py()?;
        let logits = numpy::PyArray1::from_vec(py, data).reshape([steps, n, vocab])?;
        Ok((tokens, logits, graphs))
    }

    /// Logits of one step in which sequence `i`, its prompt prefilled before in a step of its
    /// own, runs `chunks[i]` with logits at every position: a speculative verify step (a chunk
    /// of several tokens is a decode token and its drafts; one of a single token, a plain
    /// decode beside them). Returns float32 `[sum of the chunks' lengths, vocab]`, the
    /// sequences' rows in order. A test hook, compiled with the `testing` feature.
    #[cfg(feature = "testing")]
    fn verify_logits<'py>(&self, py: Python<'py>, prompts: Vec<Vec<u32>>, chunks: Vec<Vec<u32>>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        if prompts.len() != chunks.len() {
            return Err(NinferError::invalid("chunks", format!("{} chunks for {} prompts", chunks.len(), prompts.len()))).py();
        }
        if prompts.iter().chain(&chunks).any(|p| p.is_empty()) {
            return Err(NinferError::EmptyPrompt).py();
        }
        let rows: usize = chunks.iter().map(Vec::len).sum();
        let (vocab, data) = py
            .detach(|| -> crate::Result<_> {
                let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
                let lens: Vec<usize> = prompts.iter().zip(&chunks).map(|(p, c)| p.len() + c.len()).collect();
                let tables = m.own_tables(&lens)?;
                for (i, p) in prompts.iter().enumerate() {
                    let seqs = vec![SeqChunk { tokens: p.clone(), start_pos: 0, block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::Last }];
                    m.runner.forward(&StepBatch { seqs })?;
                }
                let seqs = chunks
                    .iter()
                    .enumerate()
                    .map(|(i, c)| SeqChunk { tokens: c.clone(), start_pos: prompts[i].len(), block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::All })
                    .collect();
                let l = m.runner.forward(&StepBatch { seqs })?;
                Ok((l.vocab, l.data))
            })
            .py()?;
        numpy::PyArray1::from_vec(py, data).reshape([rows, vocab])
    }

    /// Logits after a speculative rollback: sequence `i`, its prompt prefilled in a step of its
    /// own, verifies `chunks[i]` in one step with the others (its state kept aside before), then
    /// is rolled back to its first `accepted[i]` chunk tokens, by replay of the kept recurrence
    /// inputs (`replay`, `ModelRunner::replay_states`) or by recompute (the kept state copied
    /// back and those tokens run again), and runs its chunk's next token there. Returns float32
    /// `[n, vocab]`, that token's logits per sequence. A test hook, compiled with the `testing`
    /// feature.
    #[cfg(feature = "testing")]
    fn rolled_back_logits<'py>(&self, py: Python<'py>, prompts: Vec<Vec<u32>>, chunks: Vec<Vec<u32>>, accepted: Vec<usize>, replay: bool) -> PyResult<Bound<'py, PyArray2<f32>>> {
        use crate::model::StateReplay;
        let n = prompts.len();
        if chunks.len() != n || accepted.len() != n || accepted.iter().zip(&chunks).any(|(&a, c)| a == 0 || a >= c.len()) {
            return Err(NinferError::invalid("accepted", "one chunk and 1..len(chunk) accepted tokens per prompt")).py();
        }
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(NinferError::EmptyPrompt).py();
        }
        let (vocab, data) = py
            .detach(|| -> crate::Result<_> {
                let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
                let lens: Vec<usize> = prompts.iter().zip(&chunks).map(|(p, c)| p.len() + c.len()).collect();
                let tables = m.own_tables_with_slots(&lens, 2 * n)?;
                if replay && !m.runner.enable_state_replay(n, chunks.iter().map(Vec::len).max().unwrap_or(1))? {
                    return Err(NinferError::invalid("replay", "this model does not replay states"));
                }
                for (i, p) in prompts.iter().enumerate() {
                    let seqs = vec![SeqChunk { tokens: p.clone(), start_pos: 0, block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::Last }];
                    m.runner.forward(&StepBatch { seqs })?;
                    m.runner.copy_state(i, n + i)?;
                }
                if replay {
                    m.runner.keep_replay_inputs(&(0..n).collect::<Vec<_>>())?;
                }
                let chunk = |i: usize, from: usize, to: usize, logits| SeqChunk { tokens: chunks[i][from..to].to_vec(), start_pos: prompts[i].len() + from, block_table: tables[i].clone(), state_slot: i, logits };
                m.runner.forward(&StepBatch { seqs: (0..n).map(|i| chunk(i, 0, chunks[i].len(), LogitsWanted::All)).collect() })?;
                if replay {
                    let replays: Vec<StateReplay> = (0..n).map(|i| StateReplay { kept: i, src: n + i, dst: i, start: 0, tokens: accepted[i] }).collect();
                    m.runner.replay_states(&replays)?;
                } else {
                    for i in 0..n {
                        m.runner.copy_state(n + i, i)?;
                    }
                    m.runner.forward(&StepBatch { seqs: (0..n).map(|i| chunk(i, 0, accepted[i], LogitsWanted::None)).collect() })?;
                }
                let l = m.runner.forward(&StepBatch { seqs: (0..n).map(|i| chunk(i, accepted[i], accepted[i] + 1, LogitsWanted::Last)).collect() })?;
                Ok((l.vocab, l.data))
            })
            .py()?;
        numpy::PyArray1::from_vec(py, data).reshape([n, vocab])
    }

    /// CUDA graphs the model holds (decode and verify steps; 0 on the CPU or with
    /// `cuda_graphs=False`): lets tests tell a replayed step from an eager one. A test hook,
    /// compiled with the `testing` feature.
    #[cfg(feature = "testing")]
    fn step_graphs(&self) -> usize {
        self.model.lock().unwrap_or_else(|e| e.into_inner()).runner.decode_graphs()
    }

    /// Greedy MTP drafts as the engine makes them (`--spec mtp`): each prompt is prefilled in a
    /// step of its own, its greedy next token `g` taken, and the MTP rows of its positions
    /// absorbed (each paired with the token after it, `g` after the last); then one batched
    /// `mtp_draft` drafts `k` tokens after every `g`. Returns (the `g`s, the drafts `[n][k]`).
    /// A test hook, compiled with the `testing` feature.
    #[cfg(feature = "testing")]
    fn mtp_greedy_drafts(&self, py: Python<'_>, prompts: Vec<Vec<u32>>, k: usize) -> PyResult<(Vec<u32>, Vec<Vec<u32>>)> {
        let (next, drafts) = self.mtp_drafts(py, prompts, k, None)?;
        Ok((next, drafts.into_iter().map(|d| d.tokens).collect()))
    }

    /// `mtp_greedy_drafts` for a sampled request: sequence `i`'s drafts drawn with `u[i]` (one
    /// uniform per draft) from the MTP logits under `temperature` / `top_k` / `top_p` / `min_p`
    /// (`spec::draft_warpers`). Returns (the greedy `g`s, the drafts `[n][k]`, their q
    /// `[n][k][vocab]`). A test hook, compiled with the `testing` feature.
    #[cfg(feature = "testing")]
    #[pyo3(signature = (prompts, k, u, temperature = 1.0, top_k = 0, top_p = 1.0, min_p = 0.0))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn mtp_sampled_drafts(
        &self, py: Python<'_>, prompts: Vec<Vec<u32>>, k: usize, u: Vec<Vec<f64>>, temperature: f32, top_k: usize, top_p: f32, min_p: f32,
    ) -> PyResult<(Vec<u32>, Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>)> {
        if u.len() != prompts.len() || u.iter().any(|d| d.len() != k) {
            return Err(NinferError::invalid("u", format!("one list of {k} draws per prompt ({} prompts)", prompts.len()))).py();
        }
        let warpers = crate::sampling::RowSampling { temperature, top_k, top_p, min_p, ..Default::default() };
        let sampling = u.into_iter().map(|u| crate::model::DraftSampling { warpers: warpers.clone(), u }).collect();
        let (next, drafts) = self.mtp_drafts(py, prompts, k, Some(sampling))?;
        let (tokens, q) = drafts.into_iter().map(|d| (d.tokens, d.q)).unzip();
        Ok((next, tokens, q))
    }

    /// DFlash drafts as the engine makes them (`--spec dflash --drafter DIR`): the prompts are
    /// prefilled together in steps of up to `chunk` tokens each (0: whole), the context rows of
    /// every step absorbed after it, each prompt's greedy next token `g` taken; then one
    /// `dflash_draft` drafts `k` tokens after every `g`: greedy, or with `u` (one list of `k`
    /// uniforms a prompt) drawn from the drafter's logits under `temperature` / `top_k` /
    /// `top_p` / `min_p`. Returns (the `g`s, the drafts `[n][k]`, their q `[n][k][vocab]`, empty
    /// for greedy drafts). A test hook, compiled with the `testing` feature.
    #[cfg(feature = "testing")]
    #[pyo3(signature = (prompts, drafter, k, chunk = 0, u = None, temperature = 1.0, top_k = 0, top_p = 1.0, min_p = 0.0))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn dflash_drafts(
        &self, py: Python<'_>, prompts: Vec<Vec<u32>>, drafter: PathBuf, k: usize, chunk: usize, u: Option<Vec<Vec<f64>>>, temperature: f32, top_k: usize, top_p: f32, min_p: f32,
    ) -> PyResult<(Vec<u32>, Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>)> {
        use crate::model::{DflashDraftSeq, DflashRows, DraftSampling};
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(NinferError::EmptyPrompt).py();
        }
        if u.as_ref().is_some_and(|u| u.len() != prompts.len() || u.iter().any(|d| d.len() != k)) {
            return Err(NinferError::invalid("u", format!("one list of {k} draws per prompt ({} prompts)", prompts.len()))).py();
        }
        let warpers = crate::sampling::RowSampling { temperature, top_k, top_p, min_p, ..Default::default() };
        py.detach(|| -> crate::Result<_> {
            let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
            let block = m.runner.enable_dflash(&drafter)?;
            let lens: Vec<usize> = prompts.iter().map(|p| p.len() + block).collect();
            let tables = m.own_tables(&lens)?;
            let mut next = vec![0u32; prompts.len()];
            let mut done = vec![0usize; prompts.len()];
            while done.iter().zip(&prompts).any(|(d, p)| d < &p.len()) {
                let live: Vec<usize> = (0..prompts.len()).filter(|&i| done[i] < prompts[i].len()).collect();
                let seqs = live
                    .iter()
                    .map(|&i| {
                        let end = if chunk == 0 { prompts[i].len() } else { (done[i] + chunk).min(prompts[i].len()) };
                        let logits = if end == prompts[i].len() { LogitsWanted::Last } else { LogitsWanted::None };
                        SeqChunk { tokens: prompts[i][done[i]..end].to_vec(), start_pos: done[i], block_table: tables[i].clone(), state_slot: i, logits }
                    })
                    .collect::<Vec<_>>();
                let batch = StepBatch { seqs };
                let l = m.runner.forward(&batch)?;
                let rows = batch.seqs.iter().enumerate().map(|(c, s)| DflashRows { chunk: c, start_pos: s.start_pos, rows: s.tokens.len(), block_table: s.block_table.clone() }).collect::<Vec<_>>();
                m.runner.dflash_absorb(&rows)?;
                for (c, &i) in live.iter().enumerate() {
                    done[i] += batch.seqs[c].tokens.len();
                    if done[i] == prompts[i].len() {
                        next[i] = crate::sampling::argmax(l.of_seq(c));
                    }
                }
            }
            let seqs: Vec<DflashDraftSeq> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| DflashDraftSeq {
                    pos: p.len(),
                    token: next[i],
                    block_table: tables[i].clone(),
                    k,
                    sampling: u.as_ref().map(|u| DraftSampling { warpers: warpers.clone(), u: u[i].clone() }),
                })
                .collect();
            let drafts = m.runner.dflash_draft(&seqs)?;
            let (tokens, q) = drafts.into_iter().map(|d| (d.tokens, d.q)).unzip();
            Ok((next, tokens, q))
        })
        .py()
    }

    /// Seconds of each of `steps` steps (after one warm-up) at the ends of the prompts, each
    /// prefilled first in a step of its own; every step runs at the same positions. `rows == 1`:
    /// a plain decode step as the engine runs it (one token a sequence, greedy on the device);
    /// `rows > 1`: a speculative verify step as the engine runs it (each sequence's recurrent
    /// state copied aside for its rollback, `rows` tokens with logits at every position, the
    /// greedy token of every row picked as for a greedy request, `forward_verify`: on the device
    /// with only the ids copied back, or on the host with `device_sampling` off). A bench hook
    /// (benches/gpu_spec.py), compiled with the `testing` feature.
    #[cfg(feature = "testing")]
    fn step_seconds(&self, py: Python<'_>, prompts: Vec<Vec<u32>>, rows: usize, steps: usize) -> PyResult<Vec<f64>> {
        use crate::sampling::RowSampling;
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            return Err(NinferError::EmptyPrompt).py();
        }
        if rows == 0 || steps == 0 {
            return Err(NinferError::invalid("rows", format!("rows {rows} and steps {steps}: both at least 1"))).py();
        }
        py.detach(|| -> crate::Result<Vec<f64>> {
            let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
            let n = prompts.len();
            let lens: Vec<usize> = prompts.iter().map(|p| p.len() + rows).collect();
            // Slots n..2n keep the states a verify step copies aside for its rollback.
            let tables = m.own_tables_with_slots(&lens, 2 * n)?;
            for (i, p) in prompts.iter().enumerate() {
                let seqs = vec![SeqChunk { tokens: p.clone(), start_pos: 0, block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::Last }];
                m.runner.forward(&StepBatch { seqs })?;
            }
            let wanted = if rows == 1 { LogitsWanted::Last } else { LogitsWanted::All };
            let batch = StepBatch {
                seqs: prompts
                    .iter()
                    .enumerate()
                    .map(|(i, p)| SeqChunk { tokens: vec![p[p.len() - 1]; rows], start_pos: p.len(), block_table: tables[i].clone(), state_slot: i, logits: wanted })
                    .collect(),
            };
            let greedy = vec![RowSampling { temperature: 0.0, ..RowSampling::default() }; n];
            let hybrid = m.runner.config().linear_attention.is_some();
            let mut out = Vec::with_capacity(steps);
            for s in 0..=steps {
                let t = std::time::Instant::now();
                if rows == 1 {
                    m.runner.forward_sampled(&batch, &greedy)?;
                } else {
                    if hybrid {
                        for i in 0..n {
                            m.runner.copy_state(i, n + i)?;
                        }
                    }
                    let picks = vec![Some(greedy[0].clone()); n];
                    let v = m.runner.forward_verify(&batch, &picks)?;
                    std::hint::black_box(v.ids.iter().flatten().map(|&t| t as u64).sum::<u64>());
                }
                if s > 0 {
                    out.push(t.elapsed().as_secs_f64());
                }
            }
            Ok(out)
        })
        .py()
    }

    /// The parsed config as a dict.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.model.lock().unwrap_or_else(|e| e.into_inner());
        let c = m.runner.config();
        let d = PyDict::new(py);
        d.set_item("architecture", &c.architecture)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("intermediate_size", c.intermediate_size)?;
        d.set_item("num_layers", c.num_layers)?;
        d.set_item("num_attention_heads", c.num_attention_heads)?;
        d.set_item("num_kv_heads", c.num_kv_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("layer_types", c.layer_types.iter().map(|t| t.as_str()).collect::<Vec<_>>())?;
        d.set_item("max_position_embeddings", c.max_position_embeddings)?;
        d.set_item("tie_word_embeddings", c.tie_word_embeddings)?;
        d.set_item("eos_token_ids", c.eos_token_ids.clone())?;
        d.set_item("has_mtp", m.has_mtp)?;
        d.set_item("num_threads", m.num_threads)?;
        let spec = m.runner.cache_spec();
        d.set_item("kv_bytes_per_token", spec.kv_bytes_per_token)?;
        d.set_item("state_bytes_per_slot", spec.state_bytes_per_slot)?;
        d.set_item("weight_bytes", spec.weight_bytes)?;
        Ok(d)
    }
}

#[cfg(feature = "testing")]
impl Loaded {
    /// Fresh caches with one state slot and a block table of its own for each of sequences of
    /// `lens` positions; the tables.
    fn own_tables(&mut self, lens: &[usize]) -> crate::Result<Vec<Vec<u32>>> {
        self.own_tables_with_slots(lens, lens.len())
    }

    /// `own_tables` with `slots` recurrent-state slots (more than the sequences: room for the
    /// states a verify step copies aside).
    fn own_tables_with_slots(&mut self, lens: &[usize], slots: usize) -> crate::Result<Vec<Vec<u32>>> {
        let per_seq: Vec<usize> = lens.iter().map(|&n| n.div_ceil(BLOCK_SIZE)).collect();
        let blocks: usize = per_seq.iter().sum();
        self.runner.allocate_caches(blocks, BLOCK_SIZE, slots)?;
        self.capacity = (blocks, BLOCK_SIZE, slots);
        let mut first = 0u32;
        Ok(per_seq
            .iter()
            .map(|&b| {
                let t: Vec<u32> = (first..first + b as u32).collect();
                first += b as u32;
                t
            })
            .collect())
    }
}

#[cfg(feature = "testing")]
impl PyModel {
    /// The body of the MTP draft hooks: prefill, absorb, draft (greedy where `sampling` is None).
    fn mtp_drafts(&self, py: Python<'_>, prompts: Vec<Vec<u32>>, k: usize, sampling: Option<Vec<crate::model::DraftSampling>>) -> PyResult<(Vec<u32>, Vec<crate::model::MtpDraft>)> {
        use crate::model::{MtpDraftSeq, MtpRows};
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(NinferError::EmptyPrompt).py();
        }
        py.detach(|| -> crate::Result<_> {
            let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
            m.runner.enable_mtp()?;
            let lens: Vec<usize> = prompts.iter().map(|p| p.len() + 1 + k).collect();
            let tables = m.own_tables(&lens)?;
            let mut next = Vec::with_capacity(prompts.len());
            for (i, p) in prompts.iter().enumerate() {
                let seqs = vec![SeqChunk { tokens: p.clone(), start_pos: 0, block_table: tables[i].clone(), state_slot: i, logits: LogitsWanted::Last }];
                let l = m.runner.forward(&StepBatch { seqs })?;
                let g = crate::sampling::argmax(l.of_seq(0));
                let next_tokens: Vec<u32> = p[1..].iter().copied().chain([g]).collect();
                m.runner.mtp_absorb(&[MtpRows { key: i as u64, chunk: 0, start_pos: 0, next_tokens, block_table: tables[i].clone() }])?;
                next.push(g);
            }
            let seqs: Vec<MtpDraftSeq> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| MtpDraftSeq { key: i as u64, pos: p.len(), token: next[i], block_table: tables[i].clone(), k, sampling: sampling.as_ref().map(|s| s[i].clone()) })
                .collect();
            let drafts = m.runner.mtp_draft(&seqs)?;
            for i in 0..prompts.len() {
                m.runner.mtp_release(i as u64);
            }
            Ok((next, drafts))
        })
        .py()
    }
}

/// Add `Model` to the `_core` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyModel>()?;
    Ok(())
}
