//! `_core.DflashDrafter`: one sequence's target forward with the context features a DFlash
//! drafter reads, and its drafting forward, on the CPU: for the drafter's parity test against
//! the PyTorch reference (tools/dflash) and its offline acceptance benchmark.

use std::path::PathBuf;
use std::sync::Mutex;

use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2};
use pyo3::prelude::*;

use super::errors::IntoPy;
use crate::model::cpu::dflash::{DflashDrafter, DraftContext};
use crate::model::{CpuModel, LoadOptions, LogitsDtype, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
use crate::NinferError;

/// Block size of the private KV pool.
const BLOCK_SIZE: usize = 16;

/// A CPU model and a DFlash drafter over one sequence of at most `max_tokens` positions (blocks
/// `0..` of both pools, in order), and the sequence's context length.
#[pyclass(name = "DflashDrafter", module = "ninfer._core")]
pub struct PyDflashDrafter {
    inner: Mutex<(CpuModel, DflashDrafter, usize)>,
    max_tokens: usize,
}

impl PyDflashDrafter {
    /// The one sequence's block table.
    fn table(&self) -> Vec<u32> {
        (0..self.max_tokens.div_ceil(BLOCK_SIZE) as u32).collect()
    }
}

#[pymethods]
impl PyDflashDrafter {
    /// Load `model_dir` on the CPU and the drafter in `drafter_dir` for it (refused, naming
    /// `--drafter`, when malformed or built for another target).
    #[new]
    #[pyo3(signature = (model_dir, drafter_dir, num_threads = None, max_tokens = 4096))]
    fn new(py: Python<'_>, model_dir: PathBuf, drafter_dir: PathBuf, num_threads: Option<usize>, max_tokens: usize) -> PyResult<Self> {
        let opts = LoadOptions { device: "cpu".into(), num_threads, logits_dtype: LogitsDtype::Float32, ..Default::default() };
        let inner = py
            .detach(|| -> crate::Result<_> {
                let mut model = CpuModel::load(&model_dir, &opts)?;
                let mut drafter = DflashDrafter::load(&drafter_dir, model.config())?;
                model.allocate_caches(max_tokens.div_ceil(BLOCK_SIZE), BLOCK_SIZE, 1)?;
                drafter.allocate(max_tokens.div_ceil(BLOCK_SIZE), BLOCK_SIZE)?;
                Ok((model, drafter, 0))
            })
            .py()?;
        Ok(PyDflashDrafter { inner: Mutex::new(inner), max_tokens })
    }

    /// Tokens of one drafting forward: the anchor and the drafts after it.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).1.cfg.block_size
    }

    /// The target's logits `[T, vocab]` and the drafter's context features
    /// `[T, len(target_layer_ids) * hidden]` of `token_ids` as a new sequence.
    fn target<'py>(&self, py: Python<'py>, token_ids: Vec<u32>) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>)> {
        let t = token_ids.len();
        if t == 0 || t > self.max_tokens {
            return Err(NinferError::invalid("token_ids", format!("{t} tokens; 1..={} fit", self.max_tokens))).py();
        }
        let table = self.table();
        let (vocab, width, logits, features) = py
            .detach(|| -> crate::Result<_> {
                let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                let (model, drafter, _) = &mut *g;
                let ids = drafter.cfg.target_layer_ids.clone();
                let mut features = Vec::new();
                let seq = SeqChunk { tokens: token_ids, start_pos: 0, block_table: table, state_slot: 0, logits: LogitsWanted::All };
                let logits = model.forward_with_features(&StepBatch { seqs: vec![seq] }, &ids, &mut features)?;
                Ok((logits.vocab, drafter.feature_width(), logits.data, features))
            })
            .py()?;
        Ok((numpy::PyArray1::from_vec(py, logits).reshape([t, vocab])?, numpy::PyArray1::from_vec(py, features).reshape([t, width])?))
    }

    /// Set the context rows at positions `start_pos..` from `features` `[rows, width]`; the
    /// context then ends after them (what it held past them is dropped).
    fn absorb(&self, py: Python<'_>, features: PyReadonlyArray2<'_, f32>, start_pos: usize) -> PyResult<()> {
        let features = features.as_slice()?.to_vec();
        let table = self.table();
        py.detach(|| -> crate::Result<()> {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let (_, drafter, len) = &mut *g;
            if start_pos > *len {
                return Err(NinferError::invalid("start_pos", format!("the context holds {len} positions; rows from {start_pos} would leave a gap")));
            }
            let rows = features.len() / drafter.feature_width().max(1);
            if start_pos + rows > self.max_tokens {
                return Err(NinferError::invalid("features", format!("rows up to {} of {} positions", start_pos + rows, self.max_tokens)));
            }
            drafter.absorb(&table, start_pos, &features)?;
            *len = start_pos + rows;
            Ok(())
        })
        .py()
    }

    /// The drafter's logits `[block_size - 1, vocab]` of the tokens after `anchor`, which sits
    /// right after the absorbed context.
    fn draft_logits<'py>(&self, py: Python<'py>, anchor: u32) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (rows, vocab, logits) = py
            .detach(|| -> crate::Result<_> {
                let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                let (model, drafter, len) = &*g;
                let table = self.table();
                let logits = drafter.draft_logits_with(model, &[DraftContext { block_table: &table, len: *len, anchor }])?.pop().unwrap_or_default();
                Ok((drafter.cfg.block_size - 1, model.config().vocab_size, logits))
            })
            .py()?;
        numpy::PyArray1::from_vec(py, logits).reshape([rows, vocab])
    }
}

/// Add `DflashDrafter` to the `_core` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDflashDrafter>()?;
    Ok(())
}
