//! `CudaModel` as the engine's `ModelRunner`: cache allocation and the memory plan, steps with
//! host or device sampling, the overlapped launch / sample / collect of asynchronous
//! scheduling, state-slot copies, and the cuBLAS warm-up.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::backend::cuda::blas::padded_row_buckets;
use crate::backend::cuda::device::driver_err;
use crate::config::ModelConfig;
use crate::artifact::WeightStore;
use crate::model::cpu::mtp::NO_MTP_WEIGHTS;
use crate::model::runner::{check_verify_rows, CacheSpec, DflashDraftSeq, DflashRows, Logits, ModelRunner, MtpDraft, MtpDraftSeq, MtpRows, StateReplay, StepBatch, VerifyLogits};
use crate::sampling::{RowSampling, SampledToken};
use crate::{NinferError, Result};

use super::buffers::{alloc, buf, Activations, DevCaches};
use super::graphs::decode_bucket;
use super::linear::Linear;
use super::mtp::CudaMtp;
use super::route::{Fusions, LayerRoute};
use super::weights::{DevMixer, DevMtp};
use super::CudaModel;

impl CudaModel {
    /// Grows the buffers a step of `rows` sequences wanting logits needs besides the
    /// activations and logits (the decode attention's split-K scratch, the device sampler's
    /// buffers) now: they then count in the memory plan and the startup ledger, and a running
    /// server does not allocate them as its concurrency climbs, nor drop every captured decode
    /// graph each time the attention scratch grows (it did at 16, 32 and 64 sequences).
    fn reserve_decode(&mut self, rows: usize) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        self.ensure_scratch(rows)?;
        if self.sampler.enabled() {
            self.sampler.reserve(&self.dev, rows, self.cfg.vocab_size)?;
        }
        Ok(())
    }

    /// Runs each cuBLAS GEMM shape of the model (every projection's [n, k], the lm_head with
    /// f32 output) once at every row bucket of `padded_rows` the step buffers hold, on whatever
    /// they contain (nothing reads the results), so that cuBLAS meets its kernels now and not
    /// inside a request (backend/cuda/blas.rs: ~4 ms a kernel it has not run yet, on Hopper).
    /// The MLP's buffers serve every shape: `gate_up` has the widest rows of the step buffers
    /// and `act` the next; a shape they do not hold (none of the supported models') is left out.
    fn warm_gemm_kernels(&mut self) -> Result<()> {
        let CudaModel { cfg, dev, weights, act, .. } = self;
        let mut shapes: Vec<&Linear> = Vec::new();
        for l in &weights.layers {
            match &l.mixer {
                DevMixer::Attention(a) => shapes.extend([&a.qkv, &a.o]),
                DevMixer::Gdn(g) => shapes.extend([&g.in_proj, &g.out]),
            }
            shapes.extend([&l.gate_up, &l.down]);
        }
        // Quantized projections run cuBLAS on their dequantized workspace, not on `w`.
        shapes.retain(|l| l.quant.is_none());
        // A projection with a bias runs cuBLAS with f32 output (`linear_bias`): another kernel.
        shapes.sort_by_key(|l| (l.n, l.k, l.bias.is_some()));
        shapes.dedup_by_key(|l| (l.n, l.k, l.bias.is_some()));
        let Activations { act: x, gate_up: y, logits, lin32, rows, .. } = act;
        let (Some(x), Some(y), Some(y32)) = (x.as_ref(), y.as_mut(), lin32.as_mut()) else {
            return Ok(());
        };
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        for m in padded_row_buckets(*rows) {
            for l in &shapes {
                if x.len() < m * l.k {
                    continue;
                }
                if l.bias.is_some() && y32.len() >= m * l.n {
                    dev.gemm_f32_out(x, &l.w, y32, m, l.n, l.k)?;
                } else if l.bias.is_none() && y.len() >= m * l.n {
                    dev.gemm(x, &l.w, y, m, l.n, l.k)?;
                }
            }
            // A quantized head runs cuBLAS on its workspace chunks, not on a dense matrix.
            if let (Some(out), Some(head)) = (logits.as_mut().filter(|o| o.len() >= m * vocab && x.len() >= m * h), weights.lm_head()) {
                dev.gemm_f32_out(x, head, out, m, vocab, h)?;
            }
        }
        Ok(())
    }
}

impl ModelRunner for CudaModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_spec(&self) -> CacheSpec {
        // The plan's arithmetic (plan/mod.rs): KV and conv state in the storage type, the
        // delta state in f32, the MTP layer's KV under --spec mtp; `ninfer plan` counts the same bytes.
        // A DFlash drafter's context is paged beside the KV: its bytes a token, and its weights.
        let mtp_weights = self.mtp.as_ref().map_or(0, |m| m.weight_bytes());
        let spec = crate::plan::cache_spec(&self.cfg, crate::plan::Target::Gpu, self.mtp.is_some(), self.weights.bytes + mtp_weights);
        let (dflash_kv, dflash_weights) = self.dflash.as_ref().map_or((0, 0), |d| (d.context_bytes_per_token(), d.weight_bytes()));
        CacheSpec { kv_bytes_per_token: spec.kv_bytes_per_token + dflash_kv, weight_bytes: spec.weight_bytes + dflash_weights, ..spec }
    }

    fn allocate_caches(&mut self, num_blocks: usize, block_size: usize, num_state_slots: usize) -> Result<()> {
        if block_size == 0 {
            return Err(NinferError::config("block_size", "must be positive"));
        }
        self.caches = DevCaches::default();
        if let Some(d) = self.dflash.as_mut() {
            d.free_pool();
        }
        self.graphs.clear();
        let c = &self.cfg;
        let spec = self.cache_spec();
        // The state buffers hold one spare slot past the running ones (decode padding rows); a
        // DFlash drafter's pool holds the spare pages of its block rows past the KV's blocks.
        let spare = self.dflash.as_ref().map_or(0, |d| d.spare_bytes(block_size));
        let needed = (num_blocks * block_size * spec.kv_bytes_per_token + (num_state_slots + 1) * spec.state_bytes_per_slot + spare) as u64;
        let (free, _) = self.dev.memory_info()?;
        if needed > free as u64 {
            return Err(NinferError::OutOfMemory {
                what: format!("KV cache ({} tokens) and {num_state_slots} state slots on cuda:{}", num_blocks * block_size, self.dev.ordinal()),
                needed,
                available: free as u64,
                hint: crate::engine::cache_fit_hint(free as u64, &spec, num_state_slots + 1, block_size),
            });
        }
        let mut caches = DevCaches { block_size, num_blocks, num_slots: num_state_slots, ..Default::default() };
        let kv_elems = num_blocks * block_size * c.num_kv_heads * c.head_dim;
        for _ in 0..c.num_attention_layers() {
            caches.k.push(alloc(&self.dev, kv_elems, "KV cache")?);
            caches.v.push(alloc(&self.dev, kv_elems, "KV cache")?);
        }
        if let Some(la) = c.linear_attention {
            for _ in 0..c.num_linear_layers() {
                let slots = num_state_slots + 1;
                caches.conv.push(alloc(&self.dev, slots * la.conv_floats(), "recurrent state")?);
                caches.delta.push(alloc(&self.dev, slots * la.delta_floats(), "recurrent state")?);
            }
        }
        self.caches = caches;
        if let Some(mtp) = self.mtp.as_mut() {
            mtp.allocate(&self.dev, kv_elems)?;
        }
        if let Some(d) = self.dflash.as_mut() {
            d.allocate(&self.dev, num_blocks, block_size)?;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        self.step(batch)
    }

    fn warm_up_kernels(&mut self) -> Result<()> {
        self.warm_gemm_kernels()
    }

    fn workspace_bytes(&self) -> usize {
        let scratch = self.scratch.as_ref().map_or(0, |s| s.acc.len() * 4 + s.ml.len() * 4);
        let mtp = self.mtp.as_ref().map_or(0, |m| m.workspace_bytes());
        let dflash = self.dflash.as_ref().map_or(0, |d| d.workspace_bytes());
        self.act.bytes() + self.meta.bytes() + self.dmeta.bytes() + scratch + self.sampler.bytes() + mtp + dflash + self.replay.as_ref().map_or(0, |r| r.bytes())
    }

    /// Rollback by replay on the device (model/cuda/replay.rs).
    fn enable_state_replay(&mut self, seqs: usize, tokens: usize) -> Result<bool> {
        if self.cfg.num_linear_layers() == 0 {
            return Ok(false);
        }
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        // Verify graphs captured before copy into the buffers this replaces, or not at all.
        self.graphs.clear();
        self.replay = None;
        self.replay = Some(super::replay::DevReplay::new(&self.dev, &self.cfg, seqs, tokens)?);
        Ok(true)
    }

    fn keep_replay_inputs(&mut self, chunks: &[usize]) -> Result<()> {
        self.replay.as_mut().ok_or_else(|| NinferError::invalid("keep_replay_inputs", "state replay is not enabled"))?.keep(chunks)
    }

    fn replay_states(&mut self, replays: &[StateReplay]) -> Result<()> {
        self.replay_on_device(replays)
    }

    fn device_free_bytes(&self) -> Option<u64> {
        self.dev.memory_info().ok().map(|(free, _)| free as u64)
    }

    fn reserve_verify(&mut self, step_rows: usize, decode_rows: usize, max_drafts: usize) -> Result<()> {
        self.reserve_verify_rows(step_rows, decode_rows, max_drafts)
    }

    fn cache_budget_bytes(&mut self, step_rows: usize, decode_rows: usize) -> Result<Option<u64>> {
        self.ensure_rows(step_rows.max(decode_bucket(decode_rows)))?;
        self.ensure_logit_rows(decode_bucket(decode_rows))?;
        self.reserve_decode(decode_bucket(decode_rows))?;
        let (free, total) = self.dev.memory_info()?;
        Ok(Some(cache_budget(free as u64, total as u64)))
    }

    fn forward_sampled(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> Result<Vec<SampledToken>> {
        if !self.sampler.enabled() {
            return self.step(batch)?.sample_on_host(rows);
        }
        let counts = self.run(batch)?;
        self.sampler.sample(&self.dev, buf(&self.act.logits), &counts, rows, self.cfg.vocab_size)
    }

    /// The argmax of every row of the sequences that `argmax` picks, by the device sampler's
    /// greedy kernel after the forward (outside any captured verify graph), with only their ids
    /// copied back; the logits of the other sequences are copied as `forward` copies them
    /// (with `device_sampling` off, every sequence's, and the host picks).
    fn forward_verify(&mut self, batch: &StepBatch, argmax: &[Option<RowSampling>]) -> Result<VerifyLogits> {
        check_verify_rows(batch.seqs.len(), argmax)?;
        if !self.sampler.enabled() || argmax.iter().all(Option::is_none) {
            return VerifyLogits::on_host(self.step(batch)?, argmax);
        }
        let counts = self.run(batch)?;
        let vocab = self.cfg.vocab_size;
        let ids = self.sampler.argmax_rows(&self.dev, buf(&self.act.logits), &counts, argmax, vocab)?;
        // The host sequences' rows: the logits up to the last of them, kept for those only.
        let host_end = counts.iter().zip(argmax).rposition(|(&c, pick)| c > 0 && pick.is_none()).map_or(0, |i| counts[..=i].iter().sum::<usize>());
        let all = if host_end == 0 { Vec::new() } else { self.logits_to_host(host_end)? };
        let mut logits = Logits { vocab, data: Vec::new(), rows: counts.clone() };
        let mut start = 0;
        for (i, &c) in counts.iter().enumerate() {
            if argmax[i].is_some() {
                logits.rows[i] = 0;
            } else if c > 0 {
                logits.data.extend_from_slice(&all[start * vocab..(start + c) * vocab]);
            }
            start += c;
        }
        Ok(VerifyLogits { logits, ids })
    }

    /// Steps overlap when they sample on the device (the host sampler needs the logits first).
    fn overlaps_steps(&self) -> bool {
        self.sampler.enabled()
    }

    /// The forward only (a CUDA graph for a decode step): the sampling, queued behind it by
    /// `launch_sampling`, is never part of a captured graph.
    fn launch_forward(&mut self, batch: &StepBatch, feed: bool) -> Result<()> {
        if !self.sampler.enabled() {
            return Err(NinferError::invalid("launch_forward", "steps sample on the host (device_sampling off), which needs each step's logits first"));
        }
        self.forwarded = None;
        let counts = self.run_fed(batch, feed).inspect_err(|_| self.sampler.reset())?;
        self.forwarded = Some((counts, feed));
        Ok(())
    }

    fn launch_sampling(&mut self, rows: &[RowSampling]) -> Result<()> {
        let (counts, feed) = self.forwarded.take().ok_or_else(|| NinferError::invalid("launch_sampling", "no forward pass was queued to sample (launch_forward)"))?;
        // A fed step's rows with penalties count its input token, which the device ids hold
        // (feed_sampled_tokens wrote them; row i is sequence i). Nothing queued since the
        // forward rewrote them: the next step's metadata is uploaded after this.
        let fed = feed.then(|| self.dmeta.ids());
        self.sampler.launch(&self.dev, buf(&self.act.logits), &counts, rows, self.cfg.vocab_size, fed.as_ref()).inspect_err(|_| self.sampler.reset())
    }

    fn collect_sampled(&mut self) -> Result<Vec<SampledToken>> {
        self.sampler.collect().inspect_err(|_| self.sampler.reset())
    }

    /// The decode and verify step graphs captured (`graphs::StepGraphs`).
    fn decode_graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Verify chunks (a decode token and its drafts, logits at every position) run as chunks of
    /// K + 1 rows with the prefill kernels: a step of nothing else but such chunks of one K as
    /// a CUDA graph (`verify`), others eagerly (`run_fed`); `copy_state` copies a recurrent
    /// state slot bit for bit, which the engine's rollback by recompute needs.
    fn verifies_drafts(&self) -> bool {
        true
    }

    /// Loads the checkpoint's MTP head (only now: it costs device memory only with `--spec
    /// mtp`); from here on every forward keeps its rows' final hidden states.
    fn enable_mtp(&mut self) -> Result<()> {
        if self.mtp.is_some() {
            return Ok(());
        }
        let store = WeightStore::open(&self.dir)?;
        let w = DevMtp::load(&self.dev, &self.cfg, &store, &self.quant, self.weights.quant_workspace())?.ok_or_else(|| NinferError::config("spec", NO_MTP_WEIGHTS))?;
        // The MTP layer runs eagerly (never a one-row decode step): no decode fusion applies.
        let route = LayerRoute::choose(&self.cfg, &w.layer, 2 * self.inv_freq.len(), false, Fusions::NONE);
        eprintln!("ninfer: loaded the MTP head on cuda:{} ({:.1} MiB)", self.dev.ordinal(), w.bytes as f64 / (1u64 << 20) as f64);
        self.mtp = Some(Box::new(CudaMtp::new(w, route)));
        Ok(())
    }

    fn set_mtp_draft_vocab(&mut self, token_ids: &[u32]) -> Result<()> {
        self.set_draft_vocab_mtp(token_ids)
    }

    fn mtp_absorb(&mut self, rows: &[MtpRows]) -> Result<()> {
        self.absorb_mtp(rows)
    }

    /// Greedy drafts by the device argmax; a sampled request's drawn from its q (the speculative
    /// sampling rule verifies them).
    fn mtp_draft(&mut self, seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        self.draft_mtp(seqs)
    }

    fn mtp_release(&mut self, key: u64) {
        if let Some(mtp) = self.mtp.as_mut() {
            mtp.release(key);
        }
    }

    /// Loads the drafter (only now: it costs device memory only with `--spec dflash`); from
    /// here on every forward keeps the target features it reads.
    fn enable_dflash(&mut self, dir: &std::path::Path) -> Result<usize> {
        self.enable_dflash_cuda(dir)
    }

    fn dflash_absorb(&mut self, rows: &[DflashRows]) -> Result<()> {
        self.absorb_dflash(rows)
    }

    /// One drafting forward a group of sequences; greedy drafts by the device argmax, a sampled
    /// request's drawn from its q on the host.
    fn dflash_draft(&mut self, seqs: &[DflashDraftSeq]) -> Result<Vec<MtpDraft>> {
        self.draft_dflash(seqs)
    }

    fn copy_state(&mut self, src: usize, dst: usize) -> Result<()> {
        let slots = self.caches.num_slots;
        if src >= slots || dst >= slots {
            return Err(NinferError::invalid("state_slot", format!("copy {src} -> {dst} outside {slots} slots")));
        }
        if src == dst {
            return Ok(());
        }
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let s = self.dev.stream().clone();
        // Buffers hold one more slot than the engine's (the decode padding slot).
        for buf in &mut self.caches.conv {
            copy_slot(&s, buf, slots + 1, src, dst)?;
        }
        for buf in &mut self.caches.delta {
            copy_slot(&s, buf, slots + 1, src, dst)?;
        }
        Ok(())
    }
}

/// What the default KV pool and state slots may take of `free` device bytes (step buffers
/// already allocated): all but a reserve of 5% of the device, at least 1 GiB, for what is
/// allocated later (decode graphs and their scratch, the warm-up step's leftovers, the CUDA
/// context's own growth, other processes' drift).
fn cache_budget(free: u64, total: u64) -> u64 {
    free.saturating_sub(crate::plan::reserve_bytes(crate::plan::Target::Gpu, total))
}

/// Device-to-device copy of slot `src` of `buf` (equal-sized slots) onto slot `dst`.
fn copy_slot<T: DeviceRepr>(s: &Arc<cudarc::driver::CudaStream>, buf: &mut CudaSlice<T>, slots: usize, src: usize, dst: usize) -> Result<()> {
    let per = buf.len() / slots;
    let (lo, mut hi) = buf.split_at_mut(src.max(dst) * per);
    let r = if src < dst {
        let from = lo.slice(src * per..(src + 1) * per);
        let mut to = hi.slice_mut(0..per);
        s.memcpy_dtod(&from, &mut to)
    } else {
        let mut lo = lo;
        let from = hi.slice(0..per);
        let mut to = lo.slice_mut(dst * per..(dst + 1) * per);
        s.memcpy_dtod(&from, &mut to)
    };
    r.map_err(driver_err("copying a state slot"))
}
