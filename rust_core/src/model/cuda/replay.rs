//! Rollback of the GDN states by replay on the device (`ModelRunner::replay_states`): a verify
//! forward copies each kept chunk's rows of every GDN layer's fused input projection (conv
//! inputs, b, a; `gdn_keep_rows`) into buffers sized at `enable_state_replay`, and a rollback
//! runs `gdn_replay` on each GDN layer: one block per (replay, value head) carries the head's
//! state from the kept slot through the accepted tokens in registers and writes it once.

use cudarc::driver::CudaSlice;

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::ops::{KeptShape, RecurrentShape};
use crate::backend::cuda::CudaDevice;
use crate::config::ModelConfig;
use crate::model::runner::{check_replays, StateReplay, StepBatch};
use crate::{NinferError, Result};

use super::buffers::alloc;
use super::weights::DevMixer;
use super::CudaModel;

/// The kept inputs of every GDN layer, for up to `seqs` chunks of up to `tokens` tokens.
pub(super) struct DevReplay {
    seqs: usize,
    tokens: usize,
    pub(super) shape: KeptShape,
    /// Per GDN layer, `[seqs * tokens, shape.width()]` in storage type: kept chunk j's token i
    /// at row j * tokens + i.
    pub(super) kept: Vec<CudaSlice<u16>>,
    /// `[seqs * tokens]`: the step row each kept row copies, -1 for none (`gdn_keep_rows`).
    pub(super) rows: CudaSlice<i32>,
    /// The replays of one `replay_states` call, 4 ints each (`gdn_replay`).
    params: CudaSlice<i32>,
    /// Chunks the next forward keeps (`keep_replay_inputs`).
    pending: Vec<usize>,
    /// Tokens of each chunk the last keeping forward kept.
    kept_lens: Vec<usize>,
    /// `rows` names some step row (uploaded by a keeping step, not cleared since).
    rows_set: bool,
    /// The step being run keeps its pending chunks.
    pub(super) keeping: bool,
}

impl DevReplay {
    pub(super) fn new(dev: &CudaDevice, cfg: &ModelConfig, seqs: usize, tokens: usize) -> Result<Self> {
        let la = cfg.linear_attention.ok_or_else(|| NinferError::invalid("enable_state_replay", "the model has no linear-attention layers"))?;
        let shape = KeptShape { channels: la.conv_dim(), n_v_heads: la.num_value_heads };
        let n = seqs * tokens;
        let kept = (0..cfg.num_linear_layers()).map(|_| alloc(dev, n * shape.width(), "replay inputs")).collect::<Result<Vec<_>>>()?;
        let mut rows = alloc(dev, n, "replay rows")?;
        dev.stream().memcpy_htod(&vec![-1i32; n], &mut rows).map_err(driver_err("uploading replay rows"))?;
        let params = alloc(dev, 4 * seqs, "replay params")?;
        Ok(DevReplay { seqs, tokens, shape, kept, rows, params, pending: Vec::new(), kept_lens: Vec::new(), rows_set: false, keeping: false })
    }

    pub(super) fn bytes(&self) -> usize {
        self.kept.iter().map(|k| k.len() * 2).sum::<usize>() + self.rows.len() * 4 + self.params.len() * 4
    }

    pub(super) fn keep(&mut self, chunks: &[usize]) -> Result<()> {
        if chunks.len() > self.seqs {
            return Err(NinferError::invalid("keep_replay_inputs", format!("{} chunks kept, buffers for {}", chunks.len(), self.seqs)));
        }
        self.pending = chunks.to_vec();
        Ok(())
    }

    /// Before a forward of `batch` (step rows in batch order, as both the eager pass and a
    /// padded verify step lay them out): upload the row map of its pending chunks, or clear a
    /// map a keeping step left (a verify graph always runs the copy, so it must find no row).
    pub(super) fn prepare(&mut self, dev: &CudaDevice, batch: &StepBatch) -> Result<()> {
        self.keeping = !self.pending.is_empty();
        if !self.keeping && !self.rows_set {
            return Ok(());
        }
        dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let mut map = vec![-1i32; self.seqs * self.tokens];
        if self.keeping {
            let mut starts = Vec::with_capacity(batch.seqs.len());
            let mut row = 0;
            for c in &batch.seqs {
                starts.push(row);
                row += c.tokens.len();
            }
            self.kept_lens.clear();
            for (j, &i) in std::mem::take(&mut self.pending).iter().enumerate() {
                let t = batch.seqs.get(i).map(|c| c.tokens.len()).ok_or_else(|| NinferError::invalid("keep_replay_inputs", format!("chunk {i} of a step of {}", batch.seqs.len())))?;
                if t > self.tokens {
                    return Err(NinferError::invalid("keep_replay_inputs", format!("chunk {i} of {t} tokens past the buffers' {}", self.tokens)));
                }
                for r in 0..t {
                    map[j * self.tokens + r] = (starts[i] + r) as i32;
                }
                self.kept_lens.push(t);
            }
        }
        dev.stream().memcpy_htod(&map, &mut self.rows).map_err(driver_err("uploading replay rows"))?;
        self.rows_set = self.keeping;
        Ok(())
    }
}

impl CudaModel {
    /// `ModelRunner::replay_states`: the replays' parameters uploaded once, then one
    /// `gdn_replay` launch per GDN layer.
    pub(super) fn replay_on_device(&mut self, replays: &[StateReplay]) -> Result<()> {
        let r = self.replay.as_mut().ok_or_else(|| NinferError::invalid("replay_states", "state replay is not enabled"))?;
        check_replays(replays, self.caches.num_slots, &r.kept_lens)?;
        if replays.len() > r.seqs {
            return Err(NinferError::invalid("replay_states", format!("{} replays, buffers for {}", replays.len(), r.seqs)));
        }
        let la = self.cfg.linear_attention.expect("replay buffers exist only for linear-attention models");
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let params: Vec<i32> = replays.iter().flat_map(|p| [(p.kept * r.tokens + p.start) as i32, p.tokens as i32, p.src as i32, p.dst as i32]).collect();
        self.dev.stream().memcpy_htod(&params, &mut r.params.slice_mut(0..params.len())).map_err(driver_err("uploading replay params"))?;
        let shape = RecurrentShape {
            n_tokens: 0,
            n_k_heads: la.num_key_heads,
            n_v_heads: la.num_value_heads,
            dk: la.key_head_dim,
            dv: la.value_head_dim,
            qk_stride: 0,
            v_stride: 0,
            // The buffers hold one more slot than the engine's (decode padding).
            n_slots: self.caches.num_slots + 1,
        };
        let rows = r.seqs * r.tokens;
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let DevMixer::Gdn(g) = &layer.mixer else { continue };
            let ci = self.cache_index[li];
            let bias = g.conv_b.as_ref().map(|b| b as &dyn crate::backend::cuda::ops::DevicePtrDyn);
            let (conv, delta) = (&mut self.caches.conv[ci], &mut self.caches.delta[ci]);
            self.dev.gdn_replay(&r.kept[ci], rows, &r.params, replays.len(), conv, &g.conv_w, bias, la.conv_kernel, &g.a_log, &g.dt_bias, delta, &shape)?;
        }
        Ok(())
    }
}
