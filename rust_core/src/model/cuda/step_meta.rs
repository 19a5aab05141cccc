//! The per-step metadata of a `CudaModel` step: token ids, positions, KV slots, block tables,
//! sequence offsets and state slots, built on the host from a `StepBatch` and uploaded in two
//! copies (one i32 buffer, one i64 buffer, through page-locked staging) into device buffers
//! that only grow.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::transfer::PinnedRing;
use crate::backend::cuda::CudaDevice;
use crate::config::ModelConfig;
use crate::{NinferError, Result};

use crate::model::runner::{LogitsWanted, StepBatch};

/// Where each section lives in the packed i32 buffer.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
struct Sections {
    tokens: usize,
    seqs: usize,
    max_blocks: usize,
    max_context: usize,
}

/// Host staging and device copies of one step's metadata.
pub struct StepMeta {
    host_i32: Vec<i32>,
    host_i64: Vec<i64>,
    dev_i32: Option<CudaSlice<i32>>,
    dev_i64: Option<CudaSlice<i64>>,
    /// Page-locked staging of the two copies: a decode step queued while the one before still
    /// runs (asynchronous scheduling) must not wait for it, nor overwrite what it reads.
    up_i32: PinnedRing<i32>,
    up_i64: PinnedRing<i64>,
    sec: Sections,
}

impl Default for StepMeta {
    fn default() -> Self {
        StepMeta {
            host_i32: Vec::new(),
            host_i64: Vec::new(),
            dev_i32: None,
            dev_i64: None,
            up_i32: PinnedRing::new(2),
            up_i64: PinnedRing::new(2),
            sec: Sections::default(),
        }
    }
}

impl StepMeta {
    /// The checks the CPU model makes, so that a bad step is a typed error, not a bad kernel.
    pub fn validate(&self, cfg: &ModelConfig, batch: &StepBatch, block_size: usize, num_blocks: usize, num_slots: usize) -> Result<()> {
        if cfg.num_attention_layers() > 0 && block_size == 0 {
            return Err(NinferError::invalid("caches", "allocate_caches was not called before forward"));
        }
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(NinferError::invalid(format!("seqs[{i}].tokens"), "empty chunk"));
            }
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(NinferError::invalid(format!("seqs[{i}].tokens"), format!("token id {t} >= vocab_size {}", cfg.vocab_size)));
            }
            if cfg.num_attention_layers() > 0 {
                let end = s.start_pos + s.tokens.len();
                let need = end.div_ceil(block_size);
                if s.block_table.len() < need {
                    return Err(NinferError::invalid(
                        format!("seqs[{i}].block_table"),
                        format!("{} blocks cover fewer than {end} positions (block size {block_size})", s.block_table.len()),
                    ));
                }
                if let Some(b) = s.block_table[..need].iter().find(|&&b| b as usize >= num_blocks) {
                    return Err(NinferError::invalid(format!("seqs[{i}].block_table"), format!("block {b} >= num_blocks {num_blocks}")));
                }
            }
            if cfg.num_linear_layers() > 0 && s.state_slot >= num_slots {
                return Err(NinferError::invalid(format!("seqs[{i}].state_slot"), format!("slot {} >= num_state_slots {num_slots}", s.state_slot)));
            }
        }
        if cfg.num_linear_layers() > 0 {
            // Two sequences on one slot would race in the conv and recurrent kernels.
            let mut slots: Vec<usize> = batch.seqs.iter().map(|s| s.state_slot).collect();
            slots.sort_unstable();
            if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
                return Err(NinferError::invalid("state_slot", format!("slot {} is used by two sequences of one step", w[0])));
            }
        }
        Ok(())
    }

    /// Build the metadata of `batch` and queue its upload (layout: `step_layout`).
    pub fn upload(&mut self, dev: &CudaDevice, batch: &StepBatch, block_size: usize) -> Result<()> {
        self.sec = step_layout(&mut self.host_i32, &mut self.host_i64, batch, block_size);
        self.copy_up(dev).map(|_| ())
    }

    /// Build and queue the upload of a step whose every sequence brings `shape.rows_per_seq`
    /// tokens (a decode step, or a uniform verify step), padded to `shape.seqs` sequences
    /// (`padded_layout`), so that the layout, and with it every address a captured CUDA graph
    /// reads, depends only on the shape. Returns true when the device buffers had to grow.
    pub fn upload_padded(&mut self, dev: &CudaDevice, batch: &StepBatch, shape: PaddedShape, block_size: usize, spare_slot: usize) -> Result<bool> {
        self.sec = padded_layout(&mut self.host_i32, &mut self.host_i64, batch, shape, block_size, spare_slot);
        self.copy_up(dev)
    }

    /// Queue the upload of the staged host buffers, growing the device buffers when needed
    /// (then returns true).
    fn copy_up(&mut self, dev: &CudaDevice) -> Result<bool> {
        let (h, l) = (&self.host_i32, &self.host_i64);
        let stream = dev.stream().clone();
        let mut grown = false;
        if self.dev_i32.as_ref().is_none_or(|b| b.len() < h.len()) {
            self.dev_i32 = Some(stream.alloc_zeros::<i32>(h.len().next_power_of_two()).map_err(driver_err("allocating step metadata"))?);
            grown = true;
        }
        if self.dev_i64.as_ref().is_none_or(|b| b.len() < l.len().max(1)) {
            self.dev_i64 = Some(stream.alloc_zeros::<i64>(l.len().max(1).next_power_of_two()).map_err(driver_err("allocating step metadata"))?);
            grown = true;
        }
        let d32 = self.dev_i32.as_mut().expect("allocated above");
        self.up_i32.upload(dev, h, &mut d32.slice_mut(0..h.len()))?;
        if !l.is_empty() {
            let d64 = self.dev_i64.as_mut().expect("allocated above");
            self.up_i64.upload(dev, l, &mut d64.slice_mut(0..l.len()))?;
        }
        Ok(grown)
    }

    /// Device bytes of the metadata buffers.
    pub fn bytes(&self) -> usize {
        self.dev_i32.as_ref().map_or(0, |b| b.len() * 4) + self.dev_i64.as_ref().map_or(0, |b| b.len() * 8)
    }

    fn i32_view(&self, start: usize, len: usize) -> CudaView<'_, i32> {
        self.dev_i32.as_ref().expect("step metadata uploaded").slice(start..start + len)
    }

    /// Token ids `[T]`.
    pub fn ids(&self) -> CudaView<'_, i32> {
        self.i32_view(0, self.sec.tokens)
    }

    /// The first `n` token ids, to overwrite on the device after the upload (fed decode steps).
    pub fn ids_mut(&mut self, n: usize) -> CudaViewMut<'_, i32> {
        self.dev_i32.as_mut().expect("step metadata uploaded").slice_mut(0..n.min(self.sec.tokens))
    }

    /// Position of each token `[T]`.
    pub fn positions(&self) -> CudaView<'_, i32> {
        self.i32_view(self.sec.tokens, self.sec.tokens)
    }

    /// Sequence index of each token `[T]`.
    pub fn token_seq(&self) -> CudaView<'_, i32> {
        self.i32_view(2 * self.sec.tokens, self.sec.tokens)
    }

    /// Token offsets of the sequences `[S + 1]`.
    pub fn cu_seqlens(&self) -> CudaView<'_, i32> {
        self.i32_view(3 * self.sec.tokens, self.sec.seqs + 1)
    }

    /// Recurrent-state slot of each sequence `[S]`.
    pub fn slots(&self) -> CudaView<'_, i32> {
        self.i32_view(3 * self.sec.tokens + self.sec.seqs + 1, self.sec.seqs)
    }

    /// Block tables `[S, max_blocks_per_seq]`, zero-padded.
    pub fn block_tables(&self) -> CudaView<'_, i32> {
        self.i32_view(3 * self.sec.tokens + 2 * self.sec.seqs + 1, self.sec.seqs * self.sec.max_blocks)
    }

    /// Flat KV slot of each token `[T]` (block * block_size + offset).
    pub fn slot_mapping(&self) -> CudaView<'_, i64> {
        self.dev_i64.as_ref().expect("step metadata uploaded").slice(0..self.sec.tokens)
    }

    /// Columns of the block tables.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.sec.max_blocks
    }

    /// The longest context any token of the step sees.
    pub fn max_context(&self) -> usize {
        self.sec.max_context
    }

    /// Runs `(first row, rows)` of the step's rows that produce logits, in order.
    pub fn picked_runs(&self, batch: &StepBatch) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut r0 = 0;
        for s in &batch.seqs {
            let t = s.tokens.len();
            let (start, n) = match s.logits {
                LogitsWanted::None => (r0, 0),
                LogitsWanted::Last => (r0 + t - 1, 1),
                LogitsWanted::All => (r0, t),
            };
            if n > 0 {
                match runs.last_mut() {
                    Some(last) if last.0 + last.1 == start => last.1 += n,
                    _ => runs.push((start, n)),
                }
            }
            r0 += t;
        }
        runs
    }

    /// Logits rows each sequence gets (0, 1 or its chunk length).
    pub fn logit_counts(&self, batch: &StepBatch) -> Vec<usize> {
        batch
            .seqs
            .iter()
            .map(|s| match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => s.tokens.len(),
            })
            .collect()
    }
}

/// The shape of a padded step (`StepMeta::upload_padded`): what a captured graph is keyed by
/// besides the model's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PaddedShape {
    /// Sequences, real ones first, then padding.
    pub seqs: usize,
    /// Tokens each sequence brings (1 at decode, K + 1 at a verify step).
    pub rows_per_seq: usize,
    /// Block-table columns.
    pub stride: usize,
}

/// Flat KV slot of position `p` through `table` (block * block_size + offset), -1 past it.
fn kv_slot(table: &[u32], p: usize, bs: usize) -> i64 {
    table.get(p / bs).map_or(-1, |&b| b as i64 * bs as i64 + (p % bs) as i64)
}

/// The host metadata of `batch` exactly as it runs. Layout of the i32 buffer: ids[T],
/// positions[T], token_seq[T], cu_seqlens[S + 1], slots[S], block_tables[S, max_blocks]
/// (max_blocks: the most any sequence needs); the i64 buffer: the KV slot of each token.
fn step_layout(h: &mut Vec<i32>, l: &mut Vec<i64>, batch: &StepBatch, block_size: usize) -> Sections {
    let t = batch.num_tokens();
    let s = batch.seqs.len();
    let bs = block_size.max(1);
    let max_context = batch.seqs.iter().map(|q| q.start_pos + q.tokens.len()).max().unwrap_or(0);
    let max_blocks = batch.seqs.iter().map(|q| (q.start_pos + q.tokens.len()).div_ceil(bs)).max().unwrap_or(0).max(1);
    h.clear();
    h.extend(batch.seqs.iter().flat_map(|q| q.tokens.iter().map(|&x| x as i32)));
    h.extend(batch.seqs.iter().flat_map(|q| (q.start_pos..q.start_pos + q.tokens.len()).map(|p| p as i32)));
    h.extend(batch.seqs.iter().enumerate().flat_map(|(i, q)| std::iter::repeat_n(i as i32, q.tokens.len())));
    let mut acc = 0i32;
    h.push(0);
    for q in &batch.seqs {
        acc += q.tokens.len() as i32;
        h.push(acc);
    }
    h.extend(batch.seqs.iter().map(|q| q.state_slot as i32));
    for q in &batch.seqs {
        let n = q.block_table.len().min(max_blocks);
        h.extend(q.block_table[..n].iter().map(|&b| b as i32));
        h.extend(std::iter::repeat_n(0, max_blocks - n));
    }
    l.clear();
    l.extend(batch.seqs.iter().flat_map(|q| (q.start_pos..q.start_pos + q.tokens.len()).map(|p| kv_slot(&q.block_table, p, bs))));
    Sections { tokens: t, seqs: s, max_blocks, max_context }
}

/// The host metadata of `batch` (every sequence `shape.rows_per_seq` tokens) padded to
/// `shape.seqs` sequences of `shape.stride` block-table columns, in `step_layout`'s layout:
/// sequence i's rows are i * rows_per_seq.., so each real sequence's rows, and their logits,
/// come in order before any padding. Padding sequences take token 0 at positions
/// 0..rows_per_seq of an all-zero block table, write no KV (slot -1) and run on `spare_slot`, a
/// recurrent-state slot no sequence owns. `max_context` is the real sequences' longest (no
/// kernel a padded step runs reads it: flash and decode attention derive each token's context
/// from its uploaded position).
fn padded_layout(h: &mut Vec<i32>, l: &mut Vec<i64>, batch: &StepBatch, shape: PaddedShape, block_size: usize, spare_slot: usize) -> Sections {
    let PaddedShape { seqs, rows_per_seq: r, stride } = shape;
    let n = batch.seqs.len();
    debug_assert!(n <= seqs && batch.seqs.iter().all(|q| q.tokens.len() == r));
    let (pad, bs) = (seqs - n, block_size.max(1));
    h.clear();
    h.extend(batch.seqs.iter().flat_map(|q| q.tokens.iter().map(|&x| x as i32)));
    h.extend(std::iter::repeat_n(0, pad * r));
    h.extend(batch.seqs.iter().flat_map(|q| (q.start_pos..q.start_pos + r).map(|p| p as i32)));
    h.extend((0..pad).flat_map(|_| 0..r as i32));
    h.extend((0..seqs as i32).flat_map(|i| std::iter::repeat_n(i, r)));
    h.extend((0..=seqs as i32).map(|i| i * r as i32));
    h.extend(batch.seqs.iter().map(|q| q.state_slot as i32));
    h.extend(std::iter::repeat_n(spare_slot as i32, pad));
    for q in &batch.seqs {
        let m = q.block_table.len().min(stride);
        h.extend(q.block_table[..m].iter().map(|&b| b as i32));
        h.extend(std::iter::repeat_n(0, stride - m));
    }
    h.extend(std::iter::repeat_n(0, pad * stride));
    l.clear();
    l.extend(batch.seqs.iter().flat_map(|q| (q.start_pos..q.start_pos + r).map(|p| kv_slot(&q.block_table, p, bs))));
    l.extend(std::iter::repeat_n(-1, pad * r));
    let max_context = batch.seqs.iter().map(|q| q.start_pos + r).max().unwrap_or(0);
    Sections { tokens: seqs * r, seqs, max_blocks: stride, max_context }
}

#[cfg(test)]
mod tests;
