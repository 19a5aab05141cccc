//! The multi-token-prediction head of Qwen3.5 / Qwen3-Next checkpoints (`mtp.*`) drafting for
//! speculative decoding, on the CPU backend.
//!
//! An MTP row at position `p` reads the target's final hidden state at `p` (after the model's
//! norm: what its lm_head reads) and the token at `p + 1`:
//! `x = fc([pre_fc_norm_embedding(embed(token)) | pre_fc_norm_hidden(hidden)])`, one
//! full-attention decoder layer over `x` attending to the MTP rows before it, then `mtp.norm`
//! and the model's (shared) lm_head give the logits of the token at `p + 2`. Drafting recurses:
//! the next row reads the drafted token and the MTP's own normed output.
//!
//! The MTP layer's KV is paged like the target's and keyed by the same positions, so a
//! sequence's block table serves both. Entries at or after a call's `start_pos` are rewritten
//! by that call and never read before, so rolling back to an accepted length is drafting again
//! from it.

use crate::backend::cpu::matmul::linear;
use crate::backend::cpu::attention::KvLayout;
use crate::backend::cpu::norm::rms_norm;
use crate::backend::cpu::rope::rope_tables;
use std::collections::HashMap;

use crate::model::runner::{LogitsWanted, MtpDraft, MtpDraftSeq, MtpRows, SeqChunk, StepBatch};
use crate::sampling::argmax;
use crate::spec::draw_draft;
use crate::{NinferError, Result};

use super::layers::{attention_step, fit, mlp_step, LayerKv, Workspace};
use super::weights::{Mixer, MtpWeights};
use super::{add_into, alloc, CpuModel};

/// What a model without an MTP head answers to `--spec mtp`.
pub const NO_MTP_WEIGHTS: &str = "--spec mtp needs the model's mtp.* weights; this checkpoint has none";

/// One sequence's rows of an MTP call: the MTP KV is (re)written at positions
/// `start_pos..start_pos + next_tokens.len()`, which also drops whatever it held from
/// `start_pos` on (the rollback to an accepted length). Row `i` reads the target's hidden
/// state at `start_pos + i` and the token at `start_pos + i + 1`; the last row starts drafting.
#[derive(Clone, Copy, Debug)]
pub struct MtpSeq<'a> {
    /// The sequence's KV block ids (the target's), covering every position the call writes:
    /// `start_pos + rows + k - 1` of them with `k` drafts.
    pub block_table: &'a [u32],
    /// Position of the first row.
    pub start_pos: usize,
    /// The target's final hidden states `[rows, hidden_size]` (`CpuModel::forward_with_hidden`).
    pub hidden: &'a [f32],
    /// The token after each row's position `[rows]`.
    pub next_tokens: &'a [u32],
}

/// A drafted token and the MTP logits it was picked from (what the speculative sampling rule
/// reads as the draft distribution).
#[derive(Clone, Debug)]
pub struct Draft {
    pub token: u32,
    pub logits: Vec<f32>,
}

/// The MTP head's drafting state on one model: its layer's paged KV and its step buffers. The
/// weights stay in the `CpuModel` each call is given.
pub struct MtpDrafter {
    /// `[num_blocks, block_size, n_kv_heads, head_dim]`, as the target's KV.
    k: Vec<f32>,
    v: Vec<f32>,
    num_blocks: usize,
    block_size: usize,
    ws: Workspace,
    /// Normed MTP output of every row of the last step `[rows, hidden]`.
    out: Vec<f32>,
    /// Normed embedding and hidden halves, then their concatenation `[rows, 2 * hidden]`.
    emb: Vec<f32>,
    hid: Vec<f32>,
    cat: Vec<f32>,
    /// `--lm-head-draft`: the draft vocabulary and its gathered LM-head rows.
    head: Option<ReducedHead>,
}

/// Output row `row` of `head` as f32 into `out`: a quantized block's row decoded as its format
/// defines it (`quant::dequantize_rows`, the values its matmul multiplies by), so that the
/// reduced head's logits are the full head's at its ids.
fn head_row(head: &super::weights::Linear, row: usize, out: &mut [f32]) {
    let k = head.k;
    let mut r = head.order.as_ref().map_or(row, |o| o[row] as usize);
    for part in &head.parts {
        let rows = part.rows(k);
        if r >= rows {
            r -= rows;
            continue;
        }
        match part {
            super::weights::Part::Dense(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            super::weights::Part::Quant(q) => crate::quant::dequantize_rows(&q.weight().view(), r..r + 1, out),
        }
        return;
    }
    unreachable!("row {row} is inside the head's {} rows", head.n);
}

/// The LM-head rows of a draft vocabulary (`--lm-head-draft`): drafting computes logits for
/// these ids only, a fraction of the full head's cost, and the draft is the argmax among them.
struct ReducedHead {
    ids: Vec<u32>,
    /// `[ids.len(), hidden_size]`, row i the LM-head row of `ids[i]`.
    w: Vec<f32>,
}

impl MtpDrafter {
    /// A drafter for `model`'s MTP head, with no KV yet (`allocate`). A checkpoint without
    /// `mtp.*` tensors is refused naming the flag.
    pub fn new(model: &CpuModel) -> Result<Self> {
        let mtp = model.weights.mtp.as_ref().ok_or_else(|| NinferError::config("spec", NO_MTP_WEIGHTS))?;
        // vLLM runs layer `depth % n` at each draft depth; every public Qwen3.5 / Qwen3-Next
        // checkpoint has one layer, and this drafter runs exactly that.
        if mtp.layers.len() != 1 {
            return Err(NinferError::Unsupported(format!("drafting with {} MTP layers (mtp_num_hidden_layers); one", mtp.layers.len())));
        }
        Ok(MtpDrafter { k: Vec::new(), v: Vec::new(), num_blocks: 0, block_size: 0, ws: Workspace::default(), out: Vec::new(), emb: Vec::new(), hid: Vec::new(), cat: Vec::new(), head: None })
    }

    /// Draft over `ids` only (`--lm-head-draft`): the MTP logits of every other id are -inf,
    /// so the argmax (and any distribution read from the logits) stays within them. The ids
    /// must be distinct and below the vocabulary size. A quantized LM head's rows of those ids
    /// are decoded to f32 here, once.
    pub fn set_draft_vocab(&mut self, model: &CpuModel, ids: &[u32]) -> Result<()> {
        let (h, vocab) = (model.cfg.hidden_size, model.cfg.vocab_size);
        let mut seen = vec![false; vocab];
        for &t in ids {
            match seen.get_mut(t as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(NinferError::config("lm_head_draft (--lm-head-draft)", format!("draft vocabulary id {t} is repeated or outside the vocabulary of {vocab}"))),
            }
        }
        if ids.is_empty() {
            return Err(NinferError::config("lm_head_draft (--lm-head-draft)", "the draft vocabulary is empty"));
        }
        let mut w = vec![0f32; ids.len() * h];
        match (model.weights.lm_head_dense(), model.weights.lm_head.as_ref()) {
            (Some(full), _) => {
                for (row, &t) in w.chunks_exact_mut(h).zip(ids) {
                    row.copy_from_slice(&full[t as usize * h..(t as usize + 1) * h]);
                }
            }
            (None, Some(head)) => {
                for (row, &t) in w.chunks_exact_mut(h).zip(ids) {
                    head_row(head, t as usize, row);
                }
            }
            (None, None) => unreachable!("a tied head is the dense embedding"),
        }
        self.head = Some(ReducedHead { ids: ids.to_vec(), w });
        Ok(())
    }

    /// KV bytes the MTP layer takes per token (f32), for the memory ledger.
    pub fn kv_bytes_per_token(model: &CpuModel) -> usize {
        2 * model.cfg.num_kv_heads * model.cfg.head_dim * 4
    }

    /// Allocate the MTP KV pool: `num_blocks` blocks of `block_size` tokens, the shape of the
    /// target's pool so that its block tables address both.
    pub fn allocate(&mut self, model: &CpuModel, num_blocks: usize, block_size: usize) -> Result<()> {
        if block_size == 0 {
            return Err(NinferError::config("block_size", "must be positive"));
        }
        let floats = num_blocks * block_size * model.cfg.num_kv_heads * model.cfg.head_dim;
        self.k = Vec::new();
        self.v = Vec::new();
        self.k = alloc(floats, "MTP KV cache")?;
        self.v = alloc(floats, "MTP KV cache")?;
        (self.num_blocks, self.block_size) = (num_blocks, block_size);
        Ok(())
    }

    /// Write the MTP KV of every sequence's rows, then draft `k` tokens per sequence: the first
    /// from its last row, each next one from the one before. `pick(seq, depth, logits)` chooses
    /// the token drafted at `depth` (0-based) from the MTP logits (argmax for greedy drafts).
    /// All sequences run each MTP step together. `k == 0` only absorbs the rows (a prefill).
    pub fn draft(&mut self, model: &CpuModel, seqs: &[MtpSeq<'_>], k: usize, pick: &mut dyn FnMut(usize, usize, &[f32]) -> u32) -> Result<Vec<Vec<Draft>>> {
        self.validate(model, seqs, k)?;
        let h = model.cfg.hidden_size;
        let vocab = model.cfg.vocab_size;
        let mut drafts: Vec<Vec<Draft>> = seqs.iter().map(|_| Vec::with_capacity(k)).collect();
        let chunks = seqs.iter().map(|s| chunk(s.block_table, s.start_pos, s.next_tokens.to_vec())).collect();
        let hidden: Vec<f32> = seqs.iter().flat_map(|s| s.hidden.iter().copied()).collect();
        let mut logits = self.step_in_pool(model, &StepBatch { seqs: chunks }, &hidden, k > 0);
        if k == 0 {
            return Ok(drafts);
        }
        // The MTP output of each sequence's last row feeds its next draft.
        let mut last = vec![0f32; seqs.len() * h];
        let mut row = 0;
        for (i, s) in seqs.iter().enumerate() {
            row += s.next_tokens.len();
            last[i * h..(i + 1) * h].copy_from_slice(&self.out[(row - 1) * h..row * h]);
        }
        for depth in 0..k {
            for (i, d) in drafts.iter_mut().enumerate() {
                let l = &logits[i * vocab..(i + 1) * vocab];
                d.push(Draft { token: pick(i, depth, l), logits: l.to_vec() });
            }
            if depth + 1 == k {
                break;
            }
            let chunks = seqs
                .iter()
                .zip(&drafts)
                .map(|(s, d)| chunk(s.block_table, s.start_pos + s.next_tokens.len() + depth, vec![d[depth].token]))
                .collect();
            logits = self.step_in_pool(model, &StepBatch { seqs: chunks }, &last, true);
            last.copy_from_slice(&self.out[..seqs.len() * h]);
        }
        Ok(drafts)
    }

    fn validate(&self, model: &CpuModel, seqs: &[MtpSeq<'_>], k: usize) -> Result<()> {
        let (h, vocab) = (model.cfg.hidden_size, model.cfg.vocab_size);
        if self.block_size == 0 {
            return Err(NinferError::invalid("mtp", "allocate was not called before draft"));
        }
        for (i, s) in seqs.iter().enumerate() {
            let rows = s.next_tokens.len();
            if rows == 0 {
                return Err(NinferError::invalid(format!("mtp seqs[{i}].next_tokens"), "no rows"));
            }
            if s.hidden.len() != rows * h {
                return Err(NinferError::invalid(format!("mtp seqs[{i}].hidden"), format!("{} values for {rows} rows of {h}", s.hidden.len())));
            }
            if let Some(t) = s.next_tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(NinferError::invalid(format!("mtp seqs[{i}].next_tokens"), format!("token id {t} >= vocab_size {vocab}")));
            }
            // Rows, then the k - 1 recursive rows after them.
            let end = s.start_pos + rows + k.saturating_sub(1);
            let need = end.div_ceil(self.block_size);
            if s.block_table.len() < need || s.block_table[..need].iter().any(|&b| b as usize >= self.num_blocks) {
                return Err(NinferError::invalid(
                    format!("mtp seqs[{i}].block_table"),
                    format!("must hold {need} blocks below {} to cover {end} positions (block size {})", self.num_blocks, self.block_size),
                ));
            }
        }
        Ok(())
    }

    fn step_in_pool(&mut self, model: &CpuModel, batch: &StepBatch, hidden: &[f32], want_logits: bool) -> Vec<f32> {
        model.pool.install(|| self.step(model, batch, hidden, want_logits))
    }

    /// One MTP step over `batch` (each chunk's `tokens` are its rows' next tokens) with the
    /// hidden states `hidden` `[rows, h]`: writes the MTP KV of every row and the normed MTP
    /// output of every row into `self.out`; with `want_logits`, returns the logits of each
    /// chunk's last row `[chunks, vocab]`.
    fn step(&mut self, model: &CpuModel, batch: &StepBatch, hidden: &[f32], want_logits: bool) -> Vec<f32> {
        let CpuModel { cfg, weights, inv_freq, rope_scale, logits_round, .. } = model;
        let mtp: &MtpWeights = weights.mtp.as_ref().expect("checked by new");
        let layer = &mtp.layers[0];
        let Mixer::Attention(attn) = &layer.mixer else { unreachable!("MTP layers are loaded as full attention") };
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let rows = batch.num_tokens();
        let ws = &mut self.ws;
        let emb = fit(&mut self.emb, rows * h);
        ws.positions.clear();
        let mut r = 0;
        for s in &batch.seqs {
            for (i, &tok) in s.tokens.iter().enumerate() {
                let t = tok as usize;
                emb[r * h..(r + 1) * h].copy_from_slice(&weights.embed[t * h..(t + 1) * h]);
                ws.positions.push(s.start_pos + i);
                r += 1;
            }
        }
        let normed_emb = fit(&mut ws.h, rows * h);
        rms_norm(emb, rows, h, &mtp.pre_fc_norm_embedding, eps, normed_emb);
        let normed_hid = fit(&mut self.hid, rows * h);
        rms_norm(hidden, rows, h, &mtp.pre_fc_norm_hidden, eps, normed_hid);
        let cat = fit(&mut self.cat, rows * 2 * h);
        for r in 0..rows {
            cat[r * 2 * h..r * 2 * h + h].copy_from_slice(&ws.h[r * h..(r + 1) * h]);
            cat[r * 2 * h + h..(r + 1) * 2 * h].copy_from_slice(&normed_hid[r * h..(r + 1) * h]);
        }
        mtp.fc.forward(cat, rows, fit(&mut ws.x, rows * h));
        rope_tables(&ws.positions, inv_freq, *rope_scale, &mut ws.cos, &mut ws.sin);
        let layout = KvLayout { block_size: self.block_size, n_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim };
        rms_norm(&ws.x, rows, h, &layer.input_norm, eps, fit(&mut ws.h, rows * h));
        attention_step(cfg, attn, LayerKv { k: &mut self.k, v: &mut self.v, layout }, batch, ws, rows);
        add_into(&mut ws.x[..rows * h], &ws.tmp[..rows * h]);
        rms_norm(&ws.x, rows, h, &layer.post_norm, eps, fit(&mut ws.h, rows * h));
        mlp_step(layer, ws, rows);
        add_into(&mut ws.x[..rows * h], &ws.tmp[..rows * h]);
        rms_norm(&ws.x, rows, h, &mtp.norm, eps, fit(&mut self.out, rows * h));
        if !want_logits {
            return Vec::new();
        }
        let m = batch.seqs.len();
        let sel = fit(&mut ws.sel, m * h);
        let mut end = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            end += s.tokens.len();
            sel[i * h..(i + 1) * h].copy_from_slice(&self.out[(end - 1) * h..end * h]);
        }
        let vocab = cfg.vocab_size;
        let Some(head) = &self.head else {
            let mut logits = vec![0f32; m * vocab];
            weights.lm_head_forward(sel, m, h, vocab, &mut logits);
            if let Some(round) = *logits_round {
                round.apply(&mut logits);
            }
            return logits;
        };
        let n = head.ids.len();
        let mut part = vec![0f32; m * n];
        linear(sel, m, h, &head.w, n, None, &mut part);
        if let Some(round) = *logits_round {
            round.apply(&mut part);
        }
        let mut logits = vec![f32::NEG_INFINITY; m * vocab];
        for (row, p) in logits.chunks_exact_mut(vocab).zip(part.chunks_exact(n)) {
            for (&t, &l) in head.ids.iter().zip(p) {
                row[t as usize] = l;
            }
        }
        logits
    }
}

/// A chunk of MTP rows in the shape `attention_step` reads (its `tokens` count the rows).
fn chunk(block_table: &[u32], start_pos: usize, tokens: Vec<u32>) -> SeqChunk {
    SeqChunk { tokens, start_pos, block_table: block_table.to_vec(), state_slot: 0, logits: LogitsWanted::Last }
}

/// What the CPU runner keeps for `--spec mtp`: the drafter, the final hidden states of every row
/// of the last forward, and each sequence's last absorbed row (position and hidden state), from
/// which its next drafts start.
pub(super) struct MtpState {
    pub(super) drafter: MtpDrafter,
    /// `[rows, hidden_size]` of the last forward.
    pub(super) hidden: Vec<f32>,
    /// First row of each chunk of the last forward, then the row count.
    pub(super) chunk_rows: Vec<usize>,
    last: HashMap<u64, (usize, Vec<f32>)>,
}

impl MtpState {
    pub(super) fn new(drafter: MtpDrafter) -> Self {
        MtpState { drafter, hidden: Vec::new(), chunk_rows: Vec::new(), last: HashMap::new() }
    }

    /// `ModelRunner::mtp_absorb`.
    pub(super) fn absorb(&mut self, model: &CpuModel, rows: &[MtpRows]) -> Result<()> {
        let h = model.cfg.hidden_size;
        let (mut seqs, mut keys) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
        for r in rows.iter().filter(|r| !r.next_tokens.is_empty()) {
            let n = r.next_tokens.len();
            let (first, end) = match (self.chunk_rows.get(r.chunk), self.chunk_rows.get(r.chunk + 1)) {
                (Some(&a), Some(&b)) if a + n <= b => (a, a + n),
                _ => return Err(NinferError::invalid("mtp_absorb", format!("{n} rows of chunk {} are not in the last forward", r.chunk))),
            };
            seqs.push(MtpSeq { block_table: &r.block_table, start_pos: r.start_pos, hidden: &self.hidden[first * h..end * h], next_tokens: &r.next_tokens });
            keys.push(r.key);
        }
        if seqs.is_empty() {
            return Ok(());
        }
        self.drafter.draft(model, &seqs, 0, &mut |_, _, _| 0)?;
        for (s, key) in seqs.iter().zip(keys) {
            let n = s.next_tokens.len();
            self.last.insert(key, (s.start_pos + n - 1, s.hidden[(n - 1) * h..].to_vec()));
        }
        Ok(())
    }

    /// `ModelRunner::mtp_draft`: greedy drafts, or drafts drawn from the head's distribution
    /// (`spec::draw_draft`) for a sequence with `sampling`; the sequences of each K in one
    /// batched call.
    pub(super) fn draft(&mut self, model: &CpuModel, seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        let mut out = vec![MtpDraft::default(); seqs.len()];
        let mut ks: Vec<usize> = seqs.iter().map(|s| s.k).filter(|&k| k > 0).collect();
        ks.sort_unstable();
        ks.dedup();
        for k in ks {
            let idx: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].k == k).collect();
            let mut batch = Vec::with_capacity(idx.len());
            for &i in &idx {
                let s = &seqs[i];
                match self.last.get(&s.key) {
                    Some((pos, hidden)) if pos + 1 == s.pos => batch.push(MtpSeq {
                        block_table: &s.block_table,
                        start_pos: *pos,
                        hidden,
                        next_tokens: std::slice::from_ref(&s.token),
                    }),
                    _ => return Err(NinferError::invalid("mtp_draft", format!("no MTP row absorbed at position {} of sequence {}", s.pos.wrapping_sub(1), s.key))),
                }
            }
            for &i in &idx {
                if let Some(s) = seqs[i].sampling.as_ref().filter(|s| s.u.len() < k) {
                    return Err(NinferError::invalid("mtp_draft", format!("{} draft draws for {k} drafts", s.u.len())));
                }
            }
            let mut pick = |b: usize, depth: usize, logits: &[f32]| match &seqs[idx[b]].sampling {
                Some(s) => {
                    let (token, q) = draw_draft(logits, &s.warpers, s.u[depth]);
                    out[idx[b]].q.push(q);
                    token
                }
                None => argmax(logits),
            };
            let drafts = self.drafter.draft(model, &batch, k, &mut pick)?;
            for (d, &i) in drafts.into_iter().zip(&idx) {
                out[i].tokens = d.into_iter().map(|d| d.token).collect();
            }
        }
        Ok(out)
    }

    /// `ModelRunner::mtp_release`.
    pub(super) fn release(&mut self, key: u64) {
        self.last.remove(&key);
    }
}
