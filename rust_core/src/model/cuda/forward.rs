//! A `CudaModel` step from its metadata to the logits of the rows that want them: prefill and
//! mixed steps eagerly over exactly their rows, decode steps padded to their bucket and
//! replayed as CUDA graphs (uniform verify steps likewise, `verify`), every layer's sub-blocks
//! in between.

use cudarc::driver::CudaView;

use crate::backend::cuda::device::driver_err;
use crate::model::runner::{Logits, LogitsWanted, StepBatch};
use crate::{NinferError, Result};

use super::attention::AttnCtx;
use super::buffers::{buf, buf_mut};
use super::gdn::{gdn_layer, GdnState, KeepRows};
use super::graphs::{decode_bucket, GraphKey};
use super::mlp::mlp;
use super::residual::NormNext;
use super::route::MixerRoute;
use super::step_meta::PaddedShape;
use super::weights::DevMixer;
use super::CudaModel;

/// Which metadata and kernels a forward over the layers runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// A decode step (`dmeta`, padded rows): decode attention over the split-K scratch, and the
    /// final norm applied after the last layer.
    Decode,
    /// A prefill or mixed step (`meta`) whose longest sequence chunk is `max_rows` tokens:
    /// prefill kernels (flash attention, chunked GDN) above one.
    Prefill { max_rows: usize },
    /// A uniform verify step (`vmeta`, padded sequences of `rows_per_seq` tokens each): the
    /// prefill pass's kernels for chunks of that length, with graph-safe attention
    /// (`AttnCtx::run_verify`: decode attention over the split-K scratch where flash attention
    /// does not serve); like `Prefill`, the final norm is left to the caller.
    Verify { rows_per_seq: usize },
}

impl CudaModel {
    /// Run a step and copy the logits of its wanted rows to the host.
    pub(super) fn step(&mut self, batch: &StepBatch) -> Result<Logits> {
        let counts = self.run(batch)?;
        let m: usize = counts.iter().sum();
        let data = if m == 0 { Vec::new() } else { self.logits_to_host(m)? };
        Ok(Logits { vocab: self.cfg.vocab_size, data, rows: counts })
    }

    /// Run a step up to the f32 logits of its wanted rows, left in `act.logits` in sequence
    /// order; returns how many rows each sequence has.
    pub(super) fn run(&mut self, batch: &StepBatch) -> Result<Vec<usize>> {
        self.run_fed(batch, false)
    }

    /// `run`; with `feed` (a decode step only), the tokens are the ones the device sampler
    /// wrote for the step sampled before (`ModelRunner::launch_forward`).
    pub(super) fn run_fed(&mut self, batch: &StepBatch, feed: bool) -> Result<Vec<usize>> {
        self.meta.validate(&self.cfg, batch, self.caches.block_size, self.caches.num_blocks, self.caches.num_slots)?;
        if let Some(r) = self.replay.as_mut() {
            r.prepare(&self.dev, batch)?;
        }
        if is_decode(batch) {
            return self.decode_step(batch, feed);
        }
        if feed {
            return Err(NinferError::invalid("launch_forward", "only a decode step (one token a sequence) takes its tokens from the step before"));
        }
        if let Some(r) = super::verify::uniform_verify_rows(batch) {
            if let Some(attention) = self.verify_attention() {
                return self.verify_step(batch, r, attention);
            }
        }
        let rows = batch.num_tokens();
        self.ensure_rows(rows)?;
        let counts = self.meta.logit_counts(batch);
        self.ensure_logit_rows(counts.iter().sum())?;
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        self.meta.upload(&self.dev, batch, self.caches.block_size)?;
        self.zero_new_states(batch)?;
        // Longest chunk of the step: prefill kernels (flash attention, chunked GDN) take over
        // from the decode kernels when a sequence brings more than one token.
        let max_rows = batch.seqs.iter().map(|q| q.tokens.len()).max().unwrap_or(0);
        self.run_layers(Pass::Prefill { max_rows }, rows)?;
        let CudaModel { cfg, dev, weights, act, meta, .. } = self;
        let (h, eps, plus_one) = (cfg.hidden_size, cfg.rms_norm_eps, weights.norm_plus_one);
        let picked = meta.picked_runs(batch);
        let m: usize = counts.iter().sum();
        let vocab = cfg.vocab_size;
        self.logits_rows = m;
        // The MTP head reads every row's final hidden state, logits wanted or not, and a DFlash
        // drafter every row's features.
        let keep = self.mtp.is_some() || self.dflash.is_some();
        if m == 0 && !keep {
            return Ok(counts);
        }
        dev.add_rmsnorm(buf_mut(&mut act.x), buf(&act.tmp), &weights.final_norm, buf_mut(&mut act.h), rows, h, eps, plus_one)?;
        self.keep_hidden(batch, rows)?;
        self.keep_dflash(batch, rows)?;
        if m == 0 {
            return Ok(counts);
        }
        let CudaModel { dev, weights, act, logits_round, .. } = self;
        let mut out_row = 0;
        for (r0, n) in picked {
            let src = buf(&act.h).slice(r0 * h..(r0 + n) * h);
            let mut dst = buf_mut(&mut act.sel).slice_mut(out_row * h..(out_row + n) * h);
            dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering logits rows"))?;
            out_row += n;
        }
        weights.logits(dev, buf(&act.sel), buf_mut(&mut act.logits), m, vocab, h, *logits_round)?;
        Ok(counts)
    }

    /// A decode step: padded to its bucket and replayed as a CUDA graph (captured on first
    /// use), or run eagerly over exactly its rows when graphs are off. Both run the same
    /// kernels with the same per-row arithmetic, so their logits agree bit for bit.
    pub(super) fn decode_step(&mut self, batch: &StepBatch, feed: bool) -> Result<Vec<usize>> {
        let n = batch.seqs.len();
        let rows = if self.graphs.enabled() { decode_bucket(n) } else { n };
        let bs = self.caches.block_size.max(1);
        let blocks = batch.seqs.iter().map(|q| (q.start_pos + 1).div_ceil(bs)).max().unwrap_or(1);
        let key = GraphKey::of(n, 1, blocks);
        let stride = key.stride;
        self.ensure_rows(rows)?;
        self.ensure_logit_rows(rows)?;
        self.ensure_scratch(rows)?;
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let spare = self.caches.num_slots;
        if self.dmeta.upload_padded(&self.dev, batch, PaddedShape { seqs: rows, rows_per_seq: 1, stride }, bs, spare)? {
            self.graphs.clear();
        }
        if feed {
            self.dev.feed_sampled_tokens(self.sampler.last_output()?, &mut self.dmeta.ids_mut(n), n)?;
        }
        self.zero_new_states(batch)?;
        self.replay_or_run(key, "decode", |m| m.decode_forward(rows))?;
        // The decode forward leaves the final normed hidden states in act.h.
        self.keep_hidden(batch, n)?;
        self.keep_dflash(batch, n)?;
        self.logits_rows = n;
        Ok(vec![1; n])
    }

    /// Replays the graph of `key` (capturing it on first use) or, with graphs off for `key`'s
    /// kind, runs `forward` eagerly: the same kernels either way (same results). A driver that
    /// cannot capture costs speed, not the service: that kind of step runs eagerly from then on.
    pub(super) fn replay_or_run(&mut self, key: GraphKey, what: &str, forward: impl Fn(&mut Self) -> Result<()>) -> Result<()> {
        if self.graphs.enabled_for(key) && !self.graphs.has(key) {
            let mut graphs = std::mem::take(&mut self.graphs);
            let dev = self.dev.clone();
            let captured = graphs.capture(&dev, key, || forward(self));
            self.graphs = graphs;
            if let Err(e) = captured {
                eprintln!("ninfer: capturing a CUDA graph of a {what} step failed ({e}); {what} steps run eagerly from now on");
                self.graphs.disable_for(key);
            }
        }
        if self.graphs.enabled_for(key) {
            self.graphs.launch(key)
        } else {
            forward(self)
        }
    }

    /// Queues a decode step's forward over `rows` (padded) rows of `dmeta`, logits of every row
    /// into `act.logits`. Nothing here allocates or synchronizes (it is what graphs capture).
    pub(super) fn decode_forward(&mut self, rows: usize) -> Result<()> {
        self.run_layers(Pass::Decode, rows)?;
        let CudaModel { cfg, dev, weights, act, logits_round, .. } = self;
        weights.logits(dev, buf(&act.h), buf_mut(&mut act.logits), rows, cfg.vocab_size, cfg.hidden_size, *logits_round)
    }

    /// Embedding and every layer over `rows` rows of the step's metadata (`dmeta` with decode
    /// attention for `Pass::Decode`, `vmeta` for `Pass::Verify`, else `meta`). Each sub-block's
    /// output projection also adds into the residual and applies the norm that follows it
    /// (`Activations::project_out`: one kernel at decode). A decode step, whose every row wants
    /// logits, ends with the final norm in `act.h`; a prefill or verify step leaves the last
    /// projection in `act.tmp` for `run` (which norms only when some row wants logits) or
    /// `verify_forward`.
    pub(super) fn run_layers(&mut self, pass: Pass, rows: usize) -> Result<()> {
        let CudaModel { cfg, dev, weights, routes, cache_index, inv_freq, rope_scale, caches, act, meta, dummy, dmeta, vmeta, scratch, dflash, replay, .. } = self;
        let (meta, decode, max_rows) = match pass {
            Pass::Decode => (&*dmeta, scratch.as_ref(), 1),
            Pass::Prefill { max_rows } => (&*meta, None, max_rows),
            Pass::Verify { rows_per_seq } => (&*vmeta, None, rows_per_seq),
        };
        let (h, eps, plus_one) = (cfg.hidden_size, cfg.rms_norm_eps, weights.norm_plus_one);
        dev.embedding(&weights.embed, &meta.ids(), buf_mut(&mut act.x), cfg.vocab_size, h)?;
        if let Some(first) = weights.layers.first() {
            dev.rmsnorm(buf(&act.x), &first.input_norm, buf_mut(&mut act.h), rows, h, h, h, eps, plus_one)?;
        }
        for (li, (layer, route)) in weights.layers.iter().zip(routes.iter()).enumerate() {
            let ci = cache_index[li];
            let post = NormNext { w: Some(&layer.post_norm), eps, plus_one };
            match (&layer.mixer, &route.mixer) {
                (DevMixer::Attention(a), MixerRoute::Attention(r)) => {
                    let attn = AttnCtx { cfg, dev, meta, inv_freq, rope_scale: *rope_scale, block_size: caches.block_size, num_blocks: caches.num_blocks, decode, max_rows };
                    let (kc, vc) = (&mut caches.k[ci], &mut caches.v[ci]);
                    match pass {
                        Pass::Verify { .. } => attn.run_verify(scratch.as_ref(), a, r, kc, vc, act, dummy, rows, &post)?,
                        _ => attn.run(a, r, kc, vc, act, dummy, rows, &post)?,
                    }
                }
                (DevMixer::Gdn(g), MixerRoute::Gdn(r)) => {
                    let state = GdnState { conv: &mut caches.conv[ci], delta: &mut caches.delta[ci], n_slots: caches.num_slots + 1 };
                    // A verify pass always copies (a captured graph keeps the launch; an
                    // unkept step's row map names no row), another pass only when keeping.
                    let keep = replay.as_mut().filter(|k| k.keeping || matches!(pass, Pass::Verify { .. })).map(|k| KeepRows { rows: &k.rows, shape: k.shape, kept: &mut k.kept[ci] });
                    gdn_layer(cfg, dev, meta, g, r, state, act, rows, max_rows, &post, keep)?;
                }
                _ => unreachable!("LayerRoute::choose gives each layer its mixer's route"),
            }
            let next = match weights.layers.get(li + 1) {
                Some(l) => Some(&l.input_norm),
                None if pass == Pass::Decode => Some(&weights.final_norm),
                None => None,
            };
            mlp(dev, layer, &route.mlp, act, rows, &NormNext { w: next, eps, plus_one })?;
            if let Some(d) = dflash.as_mut() {
                d.capture_layer(dev, li, weights.layers.len(), buf(&act.x), rows)?;
            }
        }
        Ok(())
    }

    /// Copies the first `m` logits rows to the host through the pinned buffer (the step's one
    /// synchronization).
    pub(super) fn logits_to_host(&mut self, m: usize) -> Result<Vec<f32>> {
        self.logit_floats_to_host(m * self.cfg.vocab_size)
    }

    /// The first `n` floats of the logits buffer on the host (rows narrower than the
    /// vocabulary: the MTP head's reduced draft vocabulary).
    pub(super) fn logit_floats_to_host(&mut self, n: usize) -> Result<Vec<f32>> {
        if self.pinned.as_ref().is_none_or(|p| p.len() < n) {
            self.pinned = None;
            // SAFETY: the buffer is written by the copy below before it is read.
            let p = unsafe { self.dev.context().alloc_pinned_with_flags::<f32>(n.next_power_of_two(), 0) }.map_err(driver_err("allocating pinned logits"))?;
            self.pinned = Some(p);
        }
        let pinned = self.pinned.as_mut().expect("allocated above");
        let src = buf(&self.act.logits).slice(0..n);
        // Copy into exactly n elements: cudarc sizes a copy by its destination, and the pinned
        // buffer is rounded up (copying into all of it would read past the logits).
        let host = pinned.as_mut_slice().map_err(driver_err("waiting for the pinned logits buffer"))?;
        self.dev.stream().memcpy_dtoh(&src, &mut host[..n]).map_err(driver_err("copying logits to the host"))?;
        self.dev.synchronize()?;
        let host = pinned.as_slice().map_err(driver_err("reading pinned logits"))?;
        Ok(host[..n].to_vec())
    }

    /// The logits of the last step on the device, f32 `[rows, vocab]` (rows in the order of
    /// `Logits::data`), for device-side sampling without a host copy. Valid until the next step.
    pub fn device_logits(&self) -> Option<(CudaView<'_, f32>, usize)> {
        let l = self.act.logits.as_ref()?;
        let m = self.logits_rows;
        Some((l.slice(0..m * self.cfg.vocab_size), m))
    }

    /// Sequences that start at position 0 begin from a zero recurrent state.
    pub(super) fn zero_new_states(&mut self, batch: &StepBatch) -> Result<()> {
        let Some(la) = self.cfg.linear_attention else { return Ok(()) };
        let (conv_elems, delta_elems) = (la.conv_floats(), la.delta_floats());
        let s = self.dev.stream().clone();
        for seq in batch.seqs.iter().filter(|q| q.start_pos == 0) {
            let slot = seq.state_slot;
            for conv in &mut self.caches.conv {
                s.memset_zeros(&mut conv.slice_mut(slot * conv_elems..(slot + 1) * conv_elems)).map_err(driver_err("clearing a state slot"))?;
            }
            for delta in &mut self.caches.delta {
                s.memset_zeros(&mut delta.slice_mut(slot * delta_elems..(slot + 1) * delta_elems)).map_err(driver_err("clearing a state slot"))?;
            }
        }
        Ok(())
    }
}

/// A step the decode graphs serve: every sequence runs one token and wants its logits.
fn is_decode(batch: &StepBatch) -> bool {
    !batch.seqs.is_empty() && batch.seqs.iter().all(|q| q.tokens.len() == 1 && q.logits == LogitsWanted::Last)
}
