//! `_core.MtpDrafter`: one sequence's target forward with its hidden states and greedy MTP
//! drafts on the CPU, for the MTP head's parity tests and its offline acceptance benchmark.

use std::path::PathBuf;
use std::sync::Mutex;

use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2};
use pyo3::prelude::*;

use super::errors::IntoPy;
use crate::model::cpu::mtp::{MtpDrafter, MtpSeq};
use crate::model::{CpuModel, LoadOptions, LogitsDtype, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
use crate::NinferError;

/// Block size of the private KV pools.
const BLOCK_SIZE: usize = 16;

/// A CPU model and its MTP drafter over one sequence of at most `max_tokens` positions.
#[pyclass(name = "MtpDrafter", module = "ninfer._core")]
pub struct PyMtpDrafter {
    inner: Mutex<(CpuModel, MtpDrafter)>,
    max_tokens: usize,
}

impl PyMtpDrafter {
    fn table(&self) -> Vec<u32> {
        (0..self.max_tokens.div_ceil(BLOCK_SIZE) as u32).collect()
    }
}

#[pymethods]
impl PyMtpDrafter {
    /// Load `model_dir` on the CPU; a checkpoint without `mtp.*` tensors is refused.
    #[new]
    #[pyo3(signature = (model_dir, num_threads = None, logits_dtype = "auto", max_tokens = 4096))]
    fn new(py: Python<'_>, model_dir: PathBuf, num_threads: Option<usize>, logits_dtype: &str, max_tokens: usize) -> PyResult<Self> {
        let logits_dtype = LogitsDtype::parse(logits_dtype).py()?;
        let opts = LoadOptions { device: "cpu".into(), num_threads, logits_dtype, ..Default::default() };
        let inner = py
            .detach(|| -> crate::Result<_> {
                let mut model = CpuModel::load(&model_dir, &opts)?;
                let mut drafter = MtpDrafter::new(&model)?;
                let blocks = max_tokens.div_ceil(BLOCK_SIZE);
                model.allocate_caches(blocks, BLOCK_SIZE, 1)?;
                drafter.allocate(&model, blocks, BLOCK_SIZE)?;
                Ok((model, drafter))
            })
            .py()?;
        Ok(PyMtpDrafter { inner: Mutex::new(inner), max_tokens })
    }

    /// The target's logits `[T, vocab]` and final hidden states `[T, hidden]` (after the
    /// model's norm) of `token_ids` as a new sequence, in forwards of `chunk` tokens.
    #[pyo3(signature = (token_ids, chunk = None))]
    fn target<'py>(&self, py: Python<'py>, token_ids: Vec<u32>, chunk: Option<usize>) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>)> {
        let t = token_ids.len();
        if t == 0 || t > self.max_tokens {
            return Err(NinferError::invalid("token_ids", format!("{t} tokens; 1..={} fit", self.max_tokens))).py();
        }
        let chunk = chunk.unwrap_or(t).max(1);
        let table = self.table();
        let (vocab, h, logits, hidden) = py
            .detach(|| -> crate::Result<_> {
                let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                let model = &mut g.0;
                let (mut logits, mut hidden, mut part) = (Vec::new(), Vec::new(), Vec::new());
                for start in (0..t).step_by(chunk) {
                    let tokens = token_ids[start..(start + chunk).min(t)].to_vec();
                    let seq = SeqChunk { tokens, start_pos: start, block_table: table.clone(), state_slot: 0, logits: LogitsWanted::All };
                    logits.extend(model.forward_with_hidden(&StepBatch { seqs: vec![seq] }, &mut part)?.data);
                    hidden.extend_from_slice(&part);
                }
                let c = model.config();
                Ok((c.vocab_size, c.hidden_size, logits, hidden))
            })
            .py()?;
        Ok((numpy::PyArray1::from_vec(py, logits).reshape([t, vocab])?, numpy::PyArray1::from_vec(py, hidden).reshape([t, h])?))
    }

    /// Draft over `token_ids` only from now on (`--lm-head-draft`): the logits of every other
    /// id are -inf.
    fn set_draft_vocab(&self, py: Python<'_>, token_ids: Vec<u32>) -> PyResult<()> {
        py.detach(|| {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let (model, drafter) = &mut *g;
            drafter.set_draft_vocab(model, &token_ids)
        })
        .py()
    }

    /// Greedy MTP drafts: rows `i` of `hidden` `[rows, hidden]` (the target's hidden states at
    /// positions `start_pos + i`) with `next_tokens[i]` (the tokens after them) are written to
    /// the MTP KV (dropping what it held from `start_pos` on), then `k` tokens are drafted, each
    /// the argmax of its logits. Returns (tokens `[k]`, logits `[k, vocab]`).
    fn draft<'py>(&self, py: Python<'py>, hidden: PyReadonlyArray2<'py, f32>, next_tokens: Vec<u32>, start_pos: usize, k: usize) -> PyResult<(Vec<u32>, Bound<'py, PyArray2<f32>>)> {
        let hidden = hidden.as_slice()?.to_vec();
        let table = self.table();
        let (vocab, drafts) = py
            .detach(|| -> crate::Result<_> {
                let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                let (model, drafter) = &mut *g;
                let seq = MtpSeq { block_table: &table, start_pos, hidden: &hidden, next_tokens: &next_tokens };
                let drafts = drafter.draft(model, &[seq], k, &mut |_, _, l| crate::sampling::argmax(l))?;
                Ok((model.config().vocab_size, drafts.into_iter().next().unwrap_or_default()))
            })
            .py()?;
        let tokens = drafts.iter().map(|d| d.token).collect();
        let logits: Vec<f32> = drafts.into_iter().flat_map(|d| d.logits).collect();
        Ok((tokens, numpy::PyArray1::from_vec(py, logits).reshape([k, vocab])?))
    }
}

/// Add `MtpDrafter` to the `_core` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMtpDrafter>()?;
    Ok(())
}
