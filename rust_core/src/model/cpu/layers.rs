//! The step of each layer kind over all rows of a batch: projections batched across
//! sequences, attention and Gated DeltaNet run per sequence on its own cache and state.

use rayon::prelude::*;

use crate::backend::cpu::activation::{sigmoid, softplus, swiglu};
use crate::backend::cpu::attention::{paged_attention, write_kv, KvLayout};
use crate::backend::cpu::gdn::{self, GdnDims};
use crate::backend::cpu::norm::rms_norm_heads_inplace;
use crate::backend::cpu::rope::apply_rope;
use crate::config::ModelConfig;
use crate::model::runner::{SeqChunk, StepBatch};

use super::weights::{AttentionWeights, GdnWeights, LayerWeights, Linear};

/// Buffers reused from step to step (grown, never shrunk), so a step allocates almost nothing.
#[derive(Default)]
pub struct Workspace {
    /// Residual stream `[rows, hidden]`.
    pub x: Vec<f32>,
    /// Normed input of the current sub-block `[rows, hidden]`.
    pub h: Vec<f32>,
    /// Fused projection output.
    pub proj: Vec<f32>,
    /// Mixer output before its output projection.
    pub mix: Vec<f32>,
    /// Sub-block output added to the residual `[rows, hidden]`.
    pub tmp: Vec<f32>,
    pub gate_up: Vec<f32>,
    pub act: Vec<f32>,
    /// RoPE tables of the step's rows `[rows, rotary_dim / 2]`.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub positions: Vec<usize>,
    /// GDN scratch of a single-sequence step.
    pub gdn: GdnScratch,
    /// Rows that produce logits, then normed.
    pub sel: Vec<f32>,
    pub sel_normed: Vec<f32>,
}

impl Workspace {
    /// Bytes the buffers hold (their capacity: they only grow).
    pub fn bytes(&self) -> usize {
        let f = [&self.x, &self.h, &self.proj, &self.mix, &self.tmp, &self.gate_up, &self.act, &self.cos, &self.sin, &self.sel, &self.sel_normed];
        f.iter().map(|v| v.capacity() * 4).sum::<usize>() + self.positions.capacity() * std::mem::size_of::<usize>() + self.gdn.bytes()
    }
}

/// Resize a buffer to exactly `len` values without caring about its contents.
pub fn fit(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

/// Apply a projection to `rows` rows of `x`.
pub fn project(l: &Linear, x: &[f32], rows: usize, out: &mut Vec<f32>) {
    let out = fit(out, rows * l.n);
    l.forward(x, rows, out);
}

/// Paged KV buffers of one attention layer.
pub struct LayerKv<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    pub layout: KvLayout,
}

/// Softmax attention sub-block: reads `ws.h`, writes `ws.tmp`.
pub fn attention_step(cfg: &ModelConfig, a: &AttentionWeights, kv: LayerKv<'_>, batch: &StepBatch, ws: &mut Workspace, rows: usize) {
    let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
    let qd = nh * hd;
    let kvd = nkv * hd;
    let gated = cfg.attn_output_gate;
    let width = a.qkv.n;
    let k_off = if gated { 2 * qd } else { qd };
    let v_off = k_off + kvd;
    project(&a.qkv, &ws.h, rows, &mut ws.proj);
    let proj = &mut ws.proj[..rows * width];
    if let Some(w) = &a.q_norm {
        rms_norm_heads_inplace(proj, rows, width, 0, nh, hd, w, cfg.rms_norm_eps);
    }
    if let Some(w) = &a.k_norm {
        rms_norm_heads_inplace(proj, rows, width, k_off, nkv, hd, w, cfg.rms_norm_eps);
    }
    let half = ws.cos.len() / rows.max(1);
    apply_rope(proj, rows, width, 0, nh, hd, &ws.cos, &ws.sin, half);
    apply_rope(proj, rows, width, k_off, nkv, hd, &ws.cos, &ws.sin, half);
    let mix = fit(&mut ws.mix, rows * qd);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut row = 0;
    for seq in &batch.seqs {
        let t = seq.tokens.len();
        let base = row * width;
        write_kv(kv.k, kv.v, &kv.layout, &seq.block_table, seq.start_pos, t, &proj[base + k_off..], &proj[base + v_off..], width);
        row += t;
    }
    // Every sequence's attention in one parallel region (decode batches have many short ones).
    let mut outs: Vec<(&SeqChunk, usize, &mut [f32])> = Vec::with_capacity(batch.seqs.len());
    let mut rest = &mut *mix;
    let mut row = 0;
    for seq in &batch.seqs {
        let t = seq.tokens.len();
        let (mine, tail) = rest.split_at_mut(t * qd);
        outs.push((seq, row, mine));
        rest = tail;
        row += t;
    }
    let (proj, cache_k, cache_v, layout) = (&*proj, &*kv.k, &*kv.v, &kv.layout);
    outs.into_par_iter().for_each(|(seq, row, out)| {
        let t = seq.tokens.len();
        paged_attention(&proj[row * width..], width, t, nh, cache_k, cache_v, layout, &seq.block_table, seq.start_pos, scale, out, qd);
    });
    if gated {
        for r in 0..rows {
            let gate = &proj[r * width + qd..r * width + 2 * qd];
            for (m, g) in mix[r * qd..(r + 1) * qd].iter_mut().zip(gate) {
                *m *= sigmoid(*g);
            }
        }
    }
    project(&a.o, &ws.mix, rows, &mut ws.tmp);
}

/// Recurrent state of one GDN layer for every slot.
pub struct LayerState<'a> {
    /// `[slots, conv_dim, kernel - 1]`.
    pub conv: &'a mut [f32],
    /// `[slots, num_value_heads, key_head_dim, value_head_dim]`.
    pub delta: &'a mut [f32],
}

/// Buffers of one sequence's GDN computation.
#[derive(Default)]
pub struct GdnScratch {
    conv_in: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    z: Vec<f32>,
    pub(super) rec: RecurrenceScratch,
}

impl GdnScratch {
    fn bytes(&self) -> usize {
        let f = [&self.conv_in, &self.g, &self.beta, &self.z];
        f.iter().map(|v| v.capacity() * 4).sum::<usize>() + self.rec.bytes()
    }
}

/// Buffers of the conv and delta rule of one sequence (`gdn_recurrence`); `core` holds its
/// output.
#[derive(Default)]
pub struct RecurrenceScratch {
    conv_out: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    core: Vec<f32>,
}

impl RecurrenceScratch {
    fn bytes(&self) -> usize {
        let f = [&self.conv_out, &self.q, &self.k, &self.v, &self.core];
        f.iter().map(|v| v.capacity() * 4).sum()
    }
}

/// Where a GDN layer keeps the recurrence inputs of a step's verify chunks
/// (`replay::KeptLayer`): `chunks[i]` is the kept index of the step's chunk i, rows of
/// `tokens` tokens a kept chunk.
pub struct KeepLayer<'a> {
    pub chunks: &'a [Option<usize>],
    pub tokens: usize,
    pub layer: &'a mut super::replay::KeptLayer,
}

/// Where one sequence's recurrence inputs go: conv inputs `[t, conv_dim]`, g and beta
/// `[t, num_value_heads]`.
struct KeepSeq<'a> {
    conv_in: &'a mut [f32],
    g: &'a mut [f32],
    beta: &'a mut [f32],
}

/// One sequence's share of a GDN sub-block.
struct GdnJob<'a> {
    row: usize,
    t: usize,
    conv: &'a mut [f32],
    delta: &'a mut [f32],
    out: &'a mut [f32],
    keep: Option<KeepSeq<'a>>,
}

/// Gated DeltaNet sub-block: reads `ws.h`, writes `ws.tmp`. Sequences run in parallel (each
/// owns its state slot; the engine never puts one slot twice in a step). With `keep`, the
/// recurrence inputs of the kept chunks are copied out for a later replay.
pub fn gdn_step(cfg: &ModelConfig, g: &GdnWeights, state: LayerState<'_>, batch: &StepBatch, ws: &mut Workspace, rows: usize, keep: Option<KeepLayer<'_>>) {
    let la = cfg.linear_attention.expect("linear layer without linear_attention config");
    let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
    let (conv_floats, delta_floats) = (la.conv_floats(), la.delta_floats());
    let width = g.in_proj.n;
    project(&g.in_proj, &ws.h, rows, &mut ws.proj);
    let mut conv_slots: Vec<Option<&mut [f32]>> = state.conv.chunks_mut(conv_floats).map(Some).collect();
    let mut delta_slots: Vec<Option<&mut [f32]>> = state.delta.chunks_mut(delta_floats).map(Some).collect();
    let (keep_chunks, mut keep_rows) = match keep {
        Some(k) => {
            let n = k.tokens;
            let l = k.layer;
            let rows: Vec<_> = l.conv_in.chunks_mut(n * cd).zip(l.g.chunks_mut(n * nv)).zip(l.beta.chunks_mut(n * nv)).map(|((c, g), b)| Some((c, g, b))).collect();
            (k.chunks, rows)
        }
        None => (&[][..], Vec::new()),
    };
    let mut jobs = Vec::with_capacity(batch.seqs.len());
    let mut rest = fit(&mut ws.mix, rows * vd);
    let mut row = 0;
    for (i, seq) in batch.seqs.iter().enumerate() {
        let t = seq.tokens.len();
        let (out, tail) = rest.split_at_mut(t * vd);
        rest = tail;
        let conv = conv_slots[seq.state_slot].take().expect("state slot used twice in one step");
        let delta = delta_slots[seq.state_slot].take().expect("state slot used twice in one step");
        let keep = keep_chunks.get(i).copied().flatten().map(|j| {
            let (c, g, b) = keep_rows[j].take().expect("chunk kept twice in one step");
            KeepSeq { conv_in: &mut c[..t * cd], g: &mut g[..t * nv], beta: &mut b[..t * nv] }
        });
        jobs.push(GdnJob { row, t, conv, delta, out, keep });
        row += t;
    }
    let proj = &ws.proj[..rows * width];
    if jobs.len() == 1 {
        let job = jobs.pop().expect("one job");
        gdn_seq(cfg, g, proj, job, &mut ws.gdn);
    } else {
        jobs.into_par_iter().for_each_init(GdnScratch::default, |scratch, job| gdn_seq(cfg, g, proj, job, scratch));
    }
    project(&g.out_proj, &ws.mix, rows, &mut ws.tmp);
}

/// Conv, delta rule and gated norm of one sequence's rows of the fused input projection.
fn gdn_seq(cfg: &ModelConfig, g: &GdnWeights, proj: &[f32], job: GdnJob<'_>, s: &mut GdnScratch) {
    let la = cfg.linear_attention.expect("linear layer without linear_attention config");
    let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
    let width = g.in_proj.n;
    let GdnJob { row, t, conv, delta, out, keep } = job;
    let proj = &proj[row * width..(row + t) * width];
    let conv_in = fit(&mut s.conv_in, t * cd);
    for r in 0..t {
        conv_in[r * cd..(r + 1) * cd].copy_from_slice(&proj[r * width..r * width + cd]);
    }
    let (gb, beta, z) = (fit(&mut s.g, t * nv), fit(&mut s.beta, t * nv), fit(&mut s.z, t * vd));
    for r in 0..t {
        let p = &proj[r * width..(r + 1) * width];
        z[r * vd..(r + 1) * vd].copy_from_slice(&p[cd..cd + vd]);
        for hh in 0..nv {
            let b = p[cd + vd + hh];
            let a = p[cd + vd + nv + hh];
            beta[r * nv + hh] = sigmoid(b);
            gb[r * nv + hh] = g.neg_a[hh] * softplus(a + g.dt_bias[hh]);
        }
    }
    if let Some(k) = keep {
        k.conv_in.copy_from_slice(conv_in);
        k.g.copy_from_slice(gb);
        k.beta.copy_from_slice(beta);
    }
    gdn_recurrence(cfg, g, conv_in, gb, beta, t, conv, delta, &mut s.rec);
    gdn::rms_norm_gated(&s.rec.core[..t * vd], z, t * nv, la.value_head_dim, &g.norm, cfg.rms_norm_eps, out);
}

/// The recurrence of one sequence's `t` tokens from their inputs (conv inputs `[t, conv_dim]`,
/// decay logs `gb` and `beta` `[t, num_value_heads]`): the short conv over `conv` (the carried
/// inputs, updated), then the delta rule over `delta` (updated; chunked for several tokens),
/// its output left in `s.core`. A forward and a replay of kept inputs (`replay`) both run
/// this, so they leave the same state from the same inputs.
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrence(cfg: &ModelConfig, g: &GdnWeights, conv_in: &[f32], gb: &[f32], beta: &[f32], t: usize, conv: &mut [f32], delta: &mut [f32], s: &mut RecurrenceScratch) {
    let la = cfg.linear_attention.expect("linear layer without linear_attention config");
    let (cd, kd, vd, nv) = (la.conv_dim(), la.key_dim(), la.value_dim(), la.num_value_heads);
    let conv_out = fit(&mut s.conv_out, t * cd);
    gdn::causal_conv1d_silu(conv_in, t, cd, &g.conv_w, la.conv_kernel, g.conv_b.as_deref(), conv, conv_out);
    let (q, k, v) = (fit(&mut s.q, t * kd), fit(&mut s.k, t * kd), fit(&mut s.v, t * vd));
    for r in 0..t {
        let src = &conv_out[r * cd..(r + 1) * cd];
        q[r * kd..(r + 1) * kd].copy_from_slice(&src[..kd]);
        k[r * kd..(r + 1) * kd].copy_from_slice(&src[kd..2 * kd]);
        v[r * vd..(r + 1) * vd].copy_from_slice(&src[2 * kd..]);
    }
    let core = fit(&mut s.core, t * vd);
    let dims = GdnDims { t, num_k_heads: la.num_key_heads, num_v_heads: nv, k_dim: la.key_head_dim, v_dim: la.value_head_dim };
    if t > 1 {
        gdn::gated_delta_rule_chunked(&dims, q, k, v, gb, beta, delta, core);
    } else {
        gdn::gated_delta_rule_recurrent(&dims, q, k, v, gb, beta, delta, core);
    }
}

/// SwiGLU MLP sub-block: reads `ws.h`, writes `ws.tmp`.
pub fn mlp_step(l: &LayerWeights, ws: &mut Workspace, rows: usize) {
    project(&l.gate_up, &ws.h, rows, &mut ws.gate_up);
    let inter = l.gate_up.n / 2;
    swiglu(&ws.gate_up, rows, inter, fit(&mut ws.act, rows * inter));
    project(&l.down, &ws.act, rows, &mut ws.tmp);
}
