//! The multi-token-prediction head (`mtp.*`) drafting for `--spec mtp` on the CUDA backend,
//! row for row what the CPU drafter does (model/cpu/mtp.rs, whose doc comment gives the
//! arithmetic): an MTP row at position `p` reads the model's final normed hidden state at `p`
//! and the token at `p + 1`, runs `fc` over their two normed halves and one full-attention
//! layer over its own paged KV (the model's block tables address it), and the shared lm_head
//! gives the logits of the token at `p + 2`; drafting recurses on its own normed output.
//!
//! Everything stays on the device: every forward keeps its rows' final hidden states
//! (`keep_hidden`), `mtp_absorb` gathers the rows the engine kept into the MTP step's input and
//! stores each sequence's last one, and `mtp_draft` runs K single-row steps per sequence whose
//! tokens are the argmax of the step before (`argmax_logsumexp` into the drafts buffer, copied
//! into the next step's ids), then copies the K x n drafted ids to the host once. A sampled
//! request's drafts are drawn on the host from each depth's logits row (its q, which the
//! speculative sampling rule needs there anyway) and written back over the argmax.

use std::collections::HashMap;

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::CudaDevice;
use crate::model::runner::{LogitsWanted, MtpDraft, MtpDraftSeq, MtpRows, SeqChunk, StepBatch};
use crate::spec::draw_draft;
use crate::{NinferError, Result};

use super::attention::AttnCtx;
use super::buffers::{alloc, buf, buf_mut};
use super::mlp::mlp;
use super::residual::NormNext;
use super::route::{LayerRoute, MixerRoute};
use super::step_meta::StepMeta;
use super::weights::{DevMixer, DevMtp};
use super::CudaModel;

/// The MTP head's weights, KV and step buffers on the device, and what it keeps between calls.
pub(super) struct CudaMtp {
    w: DevMtp,
    route: LayerRoute,
    /// The MTP layer's KV, `[num_blocks, block_size, n_kv_heads, head_dim]` like each of the
    /// model's attention layers (`allocate`).
    k: Option<CudaSlice<u16>>,
    v: Option<CudaSlice<u16>>,
    /// Final normed hidden states of every row of the last forward `[rows, hidden]`.
    hidden: Option<CudaSlice<u16>>,
    /// First row of each chunk of the last forward, then its row count.
    chunk_rows: Vec<usize>,
    /// Hidden-state input of an MTP step `[rows, hidden]`.
    hin: Option<CudaSlice<u16>>,
    /// `[normed embedding | normed hidden]` of an MTP step `[rows, 2 * hidden]`.
    cat: Option<CudaSlice<u16>>,
    /// Each sequence's last absorbed row: its position and its row of `last_rows`.
    last: HashMap<u64, (usize, usize)>,
    /// The target's hidden state of each sequence's last absorbed row `[capacity, hidden]`.
    last_rows: Option<CudaSlice<u16>>,
    last_capacity: usize,
    free_rows: Vec<usize>,
    /// Greedy drafts `[k, n]` (depth-major) and the argmax kernel's logsumexp output.
    drafts: Option<CudaSlice<i32>>,
    lse: Option<CudaSlice<f32>>,
    meta: StepMeta,
    /// `--lm-head-draft`: the LM head's rows of the draft vocabulary `[ids.len(), hidden]` and
    /// those ids; drafting picks among them (`set_draft_vocab`).
    reduced: Option<(CudaSlice<u16>, Vec<u32>)>,
}

impl CudaMtp {
    /// The drafting state of the loaded head `w`, with no KV yet.
    pub(super) fn new(w: DevMtp, route: LayerRoute) -> Self {
        CudaMtp {
            w,
            route,
            k: None,
            v: None,
            hidden: None,
            chunk_rows: Vec::new(),
            hin: None,
            cat: None,
            last: HashMap::new(),
            last_rows: None,
            last_capacity: 0,
            free_rows: Vec::new(),
            drafts: None,
            lse: None,
            meta: StepMeta::default(),
            reduced: None,
        }
    }

    /// Device bytes of the head's weights.
    pub(super) fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Allocates the MTP layer's KV: `kv_elems` elements each for k and v, the size of one of
    /// the model's layers, so that its block tables address both. Kept rows are forgotten.
    pub(super) fn allocate(&mut self, dev: &CudaDevice, kv_elems: usize) -> Result<()> {
        (self.k, self.v) = (None, None);
        self.k = Some(alloc(dev, kv_elems, "MTP KV cache")?);
        self.v = Some(alloc(dev, kv_elems, "MTP KV cache")?);
        self.last.clear();
        self.free_rows = (0..self.last_capacity).rev().collect();
        Ok(())
    }

    /// Device bytes of the step buffers (not the KV).
    pub(super) fn workspace_bytes(&self) -> usize {
        fn b<T>(x: &Option<CudaSlice<T>>) -> usize {
            x.as_ref().map_or(0, |s| s.len() * std::mem::size_of::<T>())
        }
        b(&self.hidden) + b(&self.hin) + b(&self.cat) + b(&self.last_rows) + b(&self.drafts) + b(&self.lse) + self.meta.bytes()
    }

    /// Grows the buffers of forwards of up to `forward_rows` rows (their kept hidden states)
    /// and of MTP steps of up to `step_rows` rows (inputs, concatenated halves) now, at
    /// startup (`ModelRunner::reserve_verify`): the plan counts them (`plan::ledger`).
    pub(super) fn reserve(&mut self, dev: &CudaDevice, forward_rows: usize, step_rows: usize, h: usize) -> Result<()> {
        grow(dev, &mut self.hidden, forward_rows * h, "MTP hidden states")?;
        grow(dev, &mut self.hin, step_rows * h, "MTP activations")?;
        grow(dev, &mut self.cat, step_rows * 2 * h, "MTP activations")
    }

    /// `ModelRunner::mtp_release`: the sequence's kept row goes back to the free rows.
    pub(super) fn release(&mut self, key: u64) {
        if let Some((_, row)) = self.last.remove(&key) {
            self.free_rows.push(row);
        }
    }

    /// A row of `last_rows` for `key` (its old one, a free one, or a new one after growing
    /// the buffer, whose kept rows are copied over).
    fn last_row(&mut self, dev: &CudaDevice, key: u64, h: usize) -> Result<usize> {
        if let Some(&(_, row)) = self.last.get(&key) {
            return Ok(row);
        }
        if self.free_rows.is_empty() {
            let grown = (2 * self.last_capacity).max(16);
            let mut rows = alloc::<u16>(dev, grown * h, "MTP kept rows")?;
            if let Some(old) = self.last_rows.as_ref() {
                let n = self.last_capacity * h;
                dev.stream().memcpy_dtod(&old.slice(0..n), &mut rows.slice_mut(0..n)).map_err(driver_err("growing the MTP kept rows"))?;
            }
            self.free_rows.extend((self.last_capacity..grown).rev());
            self.last_rows = Some(rows);
            self.last_capacity = grown;
        }
        Ok(self.free_rows.pop().expect("grown above"))
    }
}

/// Grows `b` to hold at least `n` elements (to the next power of two; never shrinks).
fn grow<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, b: &mut Option<CudaSlice<T>>, n: usize, what: &str) -> Result<()> {
    if b.as_ref().is_none_or(|s| s.len() < n) {
        *b = None;
        *b = Some(alloc(dev, n.next_power_of_two(), what)?);
    }
    Ok(())
}

/// A chunk of MTP rows in the shape the step metadata reads (its `tokens` are the rows' next
/// tokens; the state slot is unused: the MTP layer is attention only).
fn chunk(block_table: &[u32], start_pos: usize, tokens: Vec<u32>) -> SeqChunk {
    SeqChunk { tokens, start_pos, block_table: block_table.to_vec(), state_slot: 0, logits: LogitsWanted::Last }
}

impl CudaModel {
    /// After a forward of `batch` over `rows` rows whose final normed hidden states are in
    /// `act.h`: keeps them for `mtp_absorb` when the MTP head drafts (nothing otherwise).
    pub(super) fn keep_hidden(&mut self, batch: &StepBatch, rows: usize) -> Result<()> {
        let Some(mtp) = self.mtp.as_mut() else { return Ok(()) };
        let n = rows * self.cfg.hidden_size;
        grow(&self.dev, &mut mtp.hidden, n, "MTP hidden states")?;
        let src = buf(&self.act.h).slice(0..n);
        let mut dst = buf_mut(&mut mtp.hidden).slice_mut(0..n);
        self.dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("keeping the hidden states"))?;
        mtp.chunk_rows.clear();
        mtp.chunk_rows.push(0);
        for s in &batch.seqs {
            mtp.chunk_rows.push(mtp.chunk_rows.last().copied().unwrap_or(0) + s.tokens.len());
        }
        Ok(())
    }

    /// `ModelRunner::mtp_absorb`: the MTP KV of the given rows of the last forward, all
    /// sequences in one MTP step; each sequence's last row is kept for its next drafts.
    pub(super) fn absorb_mtp(&mut self, rows: &[MtpRows]) -> Result<()> {
        let mut mtp = self.mtp.take().ok_or_else(|| NinferError::invalid("mtp_absorb", "MTP drafting is not enabled"))?;
        let r = self.absorb_with(&mut mtp, rows);
        self.mtp = Some(mtp);
        r
    }

    fn absorb_with(&mut self, mtp: &mut CudaMtp, rows: &[MtpRows]) -> Result<()> {
        let h = self.cfg.hidden_size;
        let mut chunks = Vec::with_capacity(rows.len());
        let mut firsts = Vec::with_capacity(rows.len());
        for r in rows.iter().filter(|r| !r.next_tokens.is_empty()) {
            let n = r.next_tokens.len();
            let first = match (mtp.chunk_rows.get(r.chunk), mtp.chunk_rows.get(r.chunk + 1)) {
                (Some(&a), Some(&b)) if a + n <= b => a,
                _ => return Err(NinferError::invalid("mtp_absorb", format!("{n} rows of chunk {} are not in the last forward", r.chunk))),
            };
            chunks.push(chunk(&r.block_table, r.start_pos, r.next_tokens.clone()));
            firsts.push((r.key, first));
        }
        if chunks.is_empty() {
            return Ok(());
        }
        let batch = StepBatch { seqs: chunks };
        self.validate_mtp(&batch, 0)?;
        let total = batch.num_tokens();
        self.ensure_mtp_rows(mtp, total)?;
        // The rows' hidden states, gathered in batch order.
        let mut off = 0;
        for (s, &(_, first)) in batch.seqs.iter().zip(&firsts) {
            let n = s.tokens.len();
            let src = buf(&mtp.hidden).slice(first * h..(first + n) * h);
            let mut dst = buf_mut(&mut mtp.hin).slice_mut(off * h..(off + n) * h);
            self.dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering MTP rows"))?;
            off += n;
        }
        mtp.meta.upload(&self.dev, &batch, self.caches.block_size)?;
        self.mtp_forward(mtp, &batch, None)?;
        for (s, &(key, first)) in batch.seqs.iter().zip(&firsts) {
            let n = s.tokens.len();
            let row = mtp.last_row(&self.dev, key, h)?;
            let src = buf(&mtp.hidden).slice((first + n - 1) * h..(first + n) * h);
            let mut dst = buf_mut(&mut mtp.last_rows).slice_mut(row * h..(row + 1) * h);
            self.dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("keeping an MTP row"))?;
            mtp.last.insert(key, (s.start_pos + n - 1, row));
        }
        Ok(())
    }

    /// `ModelRunner::set_mtp_draft_vocab` (`--lm-head-draft`): gathers the LM head's rows of
    /// `ids` (distinct, below the vocabulary size) into the head drafting reads.
    pub(super) fn set_draft_vocab_mtp(&mut self, ids: &[u32]) -> Result<()> {
        const WHAT: &str = "lm_head_draft (--lm-head-draft)";
        let (h, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        if self.mtp.is_none() {
            return Err(NinferError::invalid("set_mtp_draft_vocab", "MTP drafting is not enabled"));
        }
        if ids.is_empty() {
            return Err(NinferError::config(WHAT, "the draft vocabulary is empty"));
        }
        let mut seen = vec![false; vocab];
        for &t in ids {
            match seen.get_mut(t as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(NinferError::config(WHAT, format!("draft vocabulary id {t} is repeated or outside the vocabulary of {vocab}"))),
            }
        }
        let mut w = alloc(&self.dev, ids.len() * h, "the draft vocabulary's LM head rows")?;
        match self.weights.lm_head() {
            Some(head) => {
                let rows: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
                let rows = self.dev.stream().clone_htod(&rows).map_err(driver_err("uploading the draft vocabulary"))?;
                self.dev.embedding(head, &rows, &mut w, vocab, h)?;
            }
            // A quantized head (`--quantize-lm-head`, a checkpoint's quantized lm_head).
            None => self.gather_quantized_head_rows(ids, &mut w)?,
        }
        self.dev.synchronize()?;
        self.mtp.as_mut().expect("checked above").reduced = Some((w, ids.to_vec()));
        Ok(())
    }

    /// The rows `ids` (distinct, in range) of the quantized LM head into `w` (`[ids.len(),
    /// hidden]`, storage type), as its prefill route decodes them (`quant_dequantize_rows`): a
    /// chunk of QUANT_HEAD_CHUNK_ROWS vocabulary rows at a time into a scratch buffer, the ids
    /// inside it gathered in id order, then put in the order of `ids`. Run once, at set-up.
    fn gather_quantized_head_rows(&self, ids: &[u32], w: &mut CudaSlice<u16>) -> Result<()> {
        let (h, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let head = self.weights.lm_head.as_ref().and_then(|l| l.quant.as_ref()).ok_or_else(|| NinferError::Device("the LM head is neither dense nor quantized".into()))?;
        let chunk = crate::plan::ledger::QUANT_HEAD_CHUNK_ROWS.min(vocab);
        let mut sorted: Vec<(u32, usize)> = ids.iter().copied().zip(0..).collect();
        sorted.sort_unstable();
        let mut scratch = alloc::<u16>(&self.dev, chunk * h, "the LM head's dequantized chunk")?;
        let mut by_id = alloc::<u16>(&self.dev, ids.len() * h, "the draft vocabulary's LM head rows")?;
        let stream = self.dev.stream().clone();
        let mut start = 0;
        for r0 in (0..vocab).step_by(chunk) {
            let rows = chunk.min(vocab - r0);
            let end = start + sorted[start..].partition_point(|&(t, _)| (t as usize) < r0 + rows);
            if end == start {
                continue;
            }
            self.dev.quant_dequantize_rows(&head.weight, r0, rows, &mut scratch)?;
            let rel: Vec<i32> = sorted[start..end].iter().map(|&(t, _)| (t as usize - r0) as i32).collect();
            let rel = stream.clone_htod(&rel).map_err(driver_err("uploading the draft vocabulary"))?;
            self.dev.embedding(&scratch.slice(0..rows * h), &rel, &mut by_id.slice_mut(start * h..end * h), rows, h)?;
            // The scratch is rewritten, and this chunk's ids freed, only after these reads.
            self.dev.synchronize()?;
            start = end;
        }
        // Row i of `w` is row `rank[i]` of the id-ordered rows.
        let mut rank = vec![0i32; ids.len()];
        for (j, &(_, i)) in sorted.iter().enumerate() {
            rank[i] = j as i32;
        }
        let rank = stream.clone_htod(&rank).map_err(driver_err("uploading the draft vocabulary"))?;
        self.dev.embedding(&by_id, &rank, w, ids.len(), h)
    }

    /// `ModelRunner::mtp_draft`: the sequences of each K in one batched run; greedy drafts stay
    /// on the device, a sampled sequence's are drawn on the host from q (`draw_draft`).
    pub(super) fn draft_mtp(&mut self, seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        let mut mtp = self.mtp.take().ok_or_else(|| NinferError::invalid("mtp_draft", "MTP drafting is not enabled"))?;
        let r = self.draft_with(&mut mtp, seqs);
        self.mtp = Some(mtp);
        r
    }

    fn draft_with(&mut self, mtp: &mut CudaMtp, seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        let (h, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let mut out = vec![MtpDraft::default(); seqs.len()];
        if let Some(s) = seqs.iter().find(|s| s.sampling.as_ref().is_some_and(|d| d.u.len() < s.k)) {
            return Err(NinferError::invalid("mtp_draft", format!("sequence {} has fewer draws than its {} drafts", s.key, s.k)));
        }
        let mut ks: Vec<usize> = seqs.iter().map(|s| s.k).filter(|&k| k > 0).collect();
        ks.sort_unstable();
        ks.dedup();
        for k in ks {
            let idx: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].k == k).collect();
            let mut starts = Vec::with_capacity(idx.len());
            for &i in &idx {
                let s = &seqs[i];
                match mtp.last.get(&s.key) {
                    Some(&(pos, row)) if pos + 1 == s.pos => starts.push((pos, row)),
                    _ => return Err(NinferError::invalid("mtp_draft", format!("no MTP row absorbed at position {} of sequence {}", s.pos.wrapping_sub(1), s.key))),
                }
            }
            let n = idx.len();
            // Depth 0 rewrites each sequence's last absorbed row with its verify input token
            // (what the CPU drafter does) and drafts from it.
            let first = StepBatch { seqs: idx.iter().zip(&starts).map(|(&i, &(pos, _))| chunk(&seqs[i].block_table, pos, vec![seqs[i].token])).collect() };
            self.validate_mtp(&first, k)?;
            self.ensure_mtp_rows(mtp, n)?;
            self.ensure_logit_rows(n)?;
            grow(&self.dev, &mut mtp.drafts, k * n, "MTP drafts")?;
            grow(&self.dev, &mut mtp.lse, n, "MTP drafts")?;
            for (j, &(_, row)) in starts.iter().enumerate() {
                let src = buf(&mtp.last_rows).slice(row * h..(row + 1) * h);
                let mut dst = buf_mut(&mut mtp.hin).slice_mut(j * h..(j + 1) * h);
                self.dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering MTP rows"))?;
            }
            mtp.meta.upload(&self.dev, &first, self.caches.block_size)?;
            self.mtp_forward(mtp, &first, Some(0))?;
            self.draw_sampled(mtp, seqs, &idx, 0, &mut out)?;
            for depth in 1..k {
                // The MTP's own normed output of each row feeds the next row.
                let src = buf(&self.act.h).slice(0..n * h);
                let mut dst = buf_mut(&mut mtp.hin).slice_mut(0..n * h);
                self.dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("feeding MTP rows"))?;
                // Token placeholders, replaced on the device by the drafts of the depth before.
                let batch = StepBatch { seqs: idx.iter().zip(&starts).map(|(&i, &(pos, _))| chunk(&seqs[i].block_table, pos + depth, vec![0])).collect() };
                mtp.meta.upload(&self.dev, &batch, self.caches.block_size)?;
                let src = buf(&mtp.drafts).slice((depth - 1) * n..depth * n);
                self.dev.stream().memcpy_dtod(&src, &mut mtp.meta.ids_mut(n)).map_err(driver_err("feeding MTP drafts"))?;
                self.mtp_forward(mtp, &batch, Some(depth))?;
                self.draw_sampled(mtp, seqs, &idx, depth, &mut out)?;
            }
            let ids = self.dev.stream().clone_dtoh(&buf(&mtp.drafts).slice(0..k * n)).map_err(driver_err("copying MTP drafts to the host"))?;
            self.dev.synchronize()?;
            for (j, &i) in idx.iter().enumerate() {
                out[i].tokens = (0..k).map(|d| ids[d * n + j] as u32).collect();
            }
            if let Some(t) = out.iter().flat_map(|d| &d.tokens).find(|&&t| t as usize >= vocab) {
                return Err(NinferError::Device(format!("MTP drafted token id {t} >= vocab_size {vocab}")));
            }
        }
        Ok(out)
    }

    /// The sampled sequences' drafts at `depth` (rows of the drafting step just run, `idx` its
    /// sequences): each is drawn on the host from its logits row under the request's warpers
    /// with its draw for this depth, as the CPU drafter does, kept with q in `out`, and written
    /// over the device argmax in the drafts buffer, which the next depth reads as its tokens.
    /// Under a reduced draft vocabulary the argmax is an index into it, mapped to its id here.
    fn draw_sampled(&mut self, mtp: &mut CudaMtp, seqs: &[MtpDraftSeq], idx: &[usize], depth: usize, out: &mut [MtpDraft]) -> Result<()> {
        let sampled = idx.iter().any(|&i| seqs[i].sampling.is_some());
        if !sampled && mtp.reduced.is_none() {
            return Ok(());
        }
        let (n, vocab) = (idx.len(), self.cfg.vocab_size);
        let cols = mtp.reduced.as_ref().map_or(vocab, |(_, r)| r.len());
        let logits = if sampled { self.logit_floats_to_host(n * cols)? } else { Vec::new() };
        let row = buf(&mtp.drafts).slice(depth * n..(depth + 1) * n);
        let mut ids = self.dev.stream().clone_dtoh(&row).map_err(driver_err("copying MTP drafts to the host"))?;
        self.dev.synchronize()?;
        let mut full = Vec::new();
        for (j, &i) in idx.iter().enumerate() {
            match (&seqs[i].sampling, &mtp.reduced) {
                (Some(s), None) => {
                    let (token, q) = draw_draft(&logits[j * vocab..(j + 1) * vocab], &s.warpers, s.u[depth]);
                    ids[j] = token as i32;
                    out[i].q.push(q);
                }
                (Some(s), Some((_, r))) => {
                    // Every id outside the draft vocabulary at -inf, as the CPU drafter has it.
                    full.clear();
                    full.resize(vocab, f32::NEG_INFINITY);
                    for (c, &t) in r.iter().enumerate() {
                        full[t as usize] = logits[j * cols + c];
                    }
                    let (token, q) = draw_draft(&full, &s.warpers, s.u[depth]);
                    ids[j] = token as i32;
                    out[i].q.push(q);
                }
                (None, Some((_, r))) => ids[j] = r[ids[j] as usize] as i32,
                (None, None) => {}
            }
        }
        let mut dst = buf_mut(&mut mtp.drafts).slice_mut(depth * n..(depth + 1) * n);
        self.dev.stream().memcpy_htod(&ids, &mut dst).map_err(driver_err("writing sampled MTP drafts"))
    }

    /// The checks of the CPU drafter: chunks of known tokens whose block tables cover their
    /// rows and the `k - 1` recursive rows after them.
    fn validate_mtp(&self, batch: &StepBatch, k: usize) -> Result<()> {
        let (bs, nb, vocab) = (self.caches.block_size, self.caches.num_blocks, self.cfg.vocab_size);
        if bs == 0 {
            return Err(NinferError::invalid("mtp", "allocate_caches was not called before drafting"));
        }
        for (i, s) in batch.seqs.iter().enumerate() {
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(NinferError::invalid(format!("mtp seqs[{i}].next_tokens"), format!("token id {t} >= vocab_size {vocab}")));
            }
            let end = s.start_pos + s.tokens.len() + k.saturating_sub(1);
            let need = end.div_ceil(bs);
            if s.block_table.len() < need || s.block_table[..need].iter().any(|&b| b as usize >= nb) {
                return Err(NinferError::invalid(format!("mtp seqs[{i}].block_table"), format!("must hold {need} blocks below {nb} to cover {end} positions (block size {bs})")));
            }
        }
        Ok(())
    }

    /// Grows the activations and the MTP step buffers for `rows` rows.
    fn ensure_mtp_rows(&mut self, mtp: &mut CudaMtp, rows: usize) -> Result<()> {
        self.ensure_rows(rows)?;
        let h = self.cfg.hidden_size;
        grow(&self.dev, &mut mtp.hin, rows * h, "MTP activations")?;
        grow(&self.dev, &mut mtp.cat, rows * 2 * h, "MTP activations")
    }

    /// One MTP step over `batch` (uploaded to `mtp.meta`, hidden inputs in `mtp.hin`): writes
    /// the MTP KV of every row and leaves every row's normed MTP output in `act.h`. With
    /// `draft_depth`, every chunk is one row and its greedy token goes to row `draft_depth` of
    /// the drafts buffer.
    fn mtp_forward(&mut self, mtp: &mut CudaMtp, batch: &StepBatch, draft_depth: Option<usize>) -> Result<()> {
        let CudaModel { cfg, dev, weights, inv_freq, rope_scale, caches, act, dummy, logits_round, .. } = self;
        let (h, eps, plus_one, vocab) = (cfg.hidden_size, cfg.rms_norm_eps, weights.norm_plus_one, cfg.vocab_size);
        let rows = batch.num_tokens();
        let CudaMtp { w, route, k, v, hin, cat, drafts, lse, meta, reduced, .. } = mtp;
        let (DevMixer::Attention(a), MixerRoute::Attention(r)) = (&w.layer.mixer, &route.mixer) else {
            unreachable!("the MTP layer is loaded as full attention")
        };
        let (Some(kc), Some(vc)) = (k.as_mut(), v.as_mut()) else {
            return Err(NinferError::invalid("mtp", "allocate_caches was not called before drafting"));
        };
        dev.embedding(&weights.embed, &meta.ids(), buf_mut(&mut act.x), vocab, h)?;
        let cat = buf_mut(cat);
        dev.rmsnorm(buf(&act.x), &w.pre_fc_norm_embedding, cat, rows, h, h, 2 * h, eps, plus_one)?;
        dev.rmsnorm(buf(&*hin), &w.pre_fc_norm_hidden, &mut cat.slice_mut(h..), rows, h, h, 2 * h, eps, plus_one)?;
        w.fc.forward(dev, cat, buf_mut(&mut act.x), buf_mut(&mut act.lin32), rows)?;
        dev.rmsnorm(buf(&act.x), &w.layer.input_norm, buf_mut(&mut act.h), rows, h, h, h, eps, plus_one)?;
        let max_rows = batch.seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
        let attn = AttnCtx { cfg, dev, meta: &*meta, inv_freq, rope_scale: *rope_scale, block_size: caches.block_size, num_blocks: caches.num_blocks, decode: None, max_rows };
        attn.run(a, r, kc, vc, act, dummy, rows, &NormNext { w: Some(&w.layer.post_norm), eps, plus_one })?;
        mlp(dev, &w.layer, &route.mlp, act, rows, &NormNext { w: Some(&w.norm), eps, plus_one })?;
        let Some(depth) = draft_depth else { return Ok(()) };
        let n = batch.seqs.len();
        if rows != n {
            return Err(NinferError::invalid("mtp_draft", format!("a drafting step of {n} sequences has {rows} rows")));
        }
        let cols = match &*reduced {
            Some((w, ids)) => {
                dev.linear_f32_out(buf(&act.h), w, buf_mut(&mut act.logits), n, ids.len(), h, *logits_round)?;
                ids.len()
            }
            None => {
                weights.logits(dev, buf(&act.h), buf_mut(&mut act.logits), n, vocab, h, *logits_round)?;
                vocab
            }
        };
        let mut ids = buf_mut(drafts).slice_mut(depth * n..(depth + 1) * n);
        dev.argmax_logsumexp(buf(&act.logits), &mut ids, &mut buf_mut(lse).slice_mut(0..n), n, cols)
    }
}
