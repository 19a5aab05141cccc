//! Softmax attention sub-block of a `CudaModel` layer: the packed qkv projection, q/k norm and
//! RoPE, the KV cache write, paged, decode or flash attention, the output gate, and the output
//! projection into the residual.

use cudarc::driver::{CudaSlice, CudaView};

use crate::backend::cuda::ops::{AttnScratch, DecodeGate, HeadNorms, PagedAttentionShape, RopeKvShape};
use crate::backend::cuda::CudaDevice;
use crate::config::ModelConfig;
use crate::{NinferError, Result};

use super::buffers::{buf, buf_mut, Activations};
use super::residual::{NormNext, ProjIn};
use super::route::{AttentionRoute, QkRoute, QueryLayout};
use super::step_meta::StepMeta;
use super::weights::DevAttention;

/// What an attention layer needs besides its weights and cache.
pub(super) struct AttnCtx<'a> {
    pub(super) cfg: &'a ModelConfig,
    pub(super) dev: &'a CudaDevice,
    pub(super) meta: &'a StepMeta,
    pub(super) inv_freq: &'a CudaSlice<f32>,
    pub(super) rope_scale: f32,
    pub(super) block_size: usize,
    pub(super) num_blocks: usize,
    /// Decode steps: attention with per-token split-K into this scratch (batch-independent
    /// results, graph-stable arguments); `None` for prefill and mixed steps.
    pub(super) decode: Option<&'a AttnScratch>,
    /// Most query rows of one sequence in the step (flash attention above one).
    pub(super) max_rows: usize,
}

/// The kernels an attention sub-block runs.
#[derive(Clone, Copy)]
enum Attend<'a> {
    /// A decode step: rotation fused with the cache write, decode attention over the scratch.
    Decode(&'a AttnScratch),
    /// A prefill or mixed step: rotation, then the cache write, then flash attention above one
    /// row a sequence (where the route and the device take it), else paged attention.
    Prefill,
    /// A uniform verify step: rotation and cache write as prefill, flash attention where the
    /// route and the device take it, else decode attention over the scratch (each row
    /// attending to its own prefix after every row's K/V is written); never paged attention,
    /// whose split partials are allocated per launch, which a captured graph must not do.
    Verify(Option<&'a AttnScratch>),
}

impl AttnCtx<'_> {
    /// Softmax attention sub-block, as the layer's `route` says: reads `act.h`, ends with
    /// `Activations::project_out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(&self, a: &DevAttention, route: &AttentionRoute, kc: &mut CudaSlice<u16>, vc: &mut CudaSlice<u16>, act: &mut Activations, dummy: &mut CudaSlice<u16>, rows: usize, then: &NormNext) -> Result<()> {
        let attend = self.decode.map_or(Attend::Prefill, Attend::Decode);
        self.run_as(attend, a, route, kc, vc, act, dummy, rows, then)
    }

    /// `run` for a uniform verify step (`Pass::Verify`; `self.decode` is None and
    /// `self.max_rows` its tokens a sequence): where flash attention does not serve the layer,
    /// decode attention over `scratch` (`VerifyAttention`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_verify(&self, scratch: Option<&AttnScratch>, a: &DevAttention, route: &AttentionRoute, kc: &mut CudaSlice<u16>, vc: &mut CudaSlice<u16>, act: &mut Activations, dummy: &mut CudaSlice<u16>, rows: usize, then: &NormNext) -> Result<()> {
        self.run_as(Attend::Verify(scratch), a, route, kc, vc, act, dummy, rows, then)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_as(&self, attend: Attend<'_>, a: &DevAttention, route: &AttentionRoute, kc: &mut CudaSlice<u16>, vc: &mut CudaSlice<u16>, act: &mut Activations, dummy: &mut CudaSlice<u16>, rows: usize, then: &NormNext) -> Result<()> {
        let (c, dev) = (self.cfg, self.dev);
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let width = a.qkv.n;
        let k_off = match route.query {
            QueryLayout::Plain => qd,
            QueryLayout::Gated => 2 * qd,
        };
        let v_off = k_off + kvd;
        let positions = self.meta.positions();
        let rope = |q_stride, k_stride| RopeKvShape { n_q_heads: nh, n_kv_heads: nkv, head_dim: hd, q_stride, k_stride, v_stride: width, attn_scale: self.rope_scale };
        let decode = matches!(attend, Attend::Decode(_));
        // Batch-1 decode projects, rotates and caches in one kernel where the route allows.
        let rope_in_gemv = route.rope_in_gemv && decode && rows == 1;
        if rope_in_gemv {
            dev.gemv_qkv_rope_kv_write(buf(&act.h), &a.qkv.w, buf_mut(&mut act.proj), kc, vc, &positions, &self.meta.slot_mapping(), self.inv_freq, &rope(width, width), a.qkv.k)?;
        } else {
            a.qkv.forward(dev, buf(&act.h), buf_mut(&mut act.proj), buf_mut(&mut act.lin32), rows)?;
        }
        // A decode step whose projection did not rotate q and k norms, rotates and caches them
        // inside decode attention where the route allows (below: paged_attention_decode_rope),
        // else in one kernel before it (rope_kv_write, bit for bit rope_neox followed by
        // kv_cache_write; with q/k norm, rope_kv_write_normed normalises the heads in it too);
        // other steps run the kernels apart.
        let rope_in_attention = route.rope_in_attention && decode && !rope_in_gemv;
        let (q_src, q_stride, k_rows, k_stride): (CudaView<'_, u16>, usize, CudaView<'_, u16>, usize);
        match route.qk {
            _ if rope_in_attention => {
                (q_src, q_stride, k_rows, k_stride) = (buf(&act.proj).as_view(), width, buf(&act.proj).slice(k_off..), width);
            }
            QkRoute::HeadNorm => {
                let (Some(qw), Some(kw)) = (&a.q_norm, &a.k_norm) else {
                    unreachable!("LayerRoute::choose routes HeadNorm only where both norms are loaded")
                };
                let (proj, eps, plus_one) = (buf(&act.proj), c.rms_norm_eps, c.zero_centered_norm);
                if decode {
                    // Bit for bit the two head norms and rope_kv_write below, one kernel.
                    let (qn, kn) = (buf_mut(&mut act.qn), buf_mut(&mut act.kn));
                    dev.rope_kv_write_normed(proj, k_off, v_off, qw, kw, eps, plus_one, qn, kn, kc, vc, &positions, &self.meta.slot_mapping(), self.inv_freq, &rope(width, width))?;
                } else {
                    head_norm(dev, proj, 0, width, qw, buf_mut(&mut act.qn), nh, hd, rows, eps, plus_one)?;
                    head_norm(dev, proj, k_off, width, kw, buf_mut(&mut act.kn), nkv, hd, rows, eps, plus_one)?;
                    dev.rope_neox(buf_mut(&mut act.qn), buf_mut(&mut act.kn), &positions, self.inv_freq, nh, nkv, hd, qd, kvd, self.rope_scale)?;
                }
                (q_src, q_stride, k_rows, k_stride) = (buf(&act.qn).as_view(), qd, buf(&act.kn).as_view(), kvd);
            }
            QkRoute::InPlace => {
                let proj = buf_mut(&mut act.proj);
                if rope_in_gemv {
                    // gemv_qkv_rope_kv_write rotated q and k and wrote the cache.
                } else if decode {
                    dev.rope_kv_write_packed(proj, k_off, v_off, kc, vc, &positions, &self.meta.slot_mapping(), self.inv_freq, &rope(width, width))?;
                } else if route.query == QueryLayout::Plain {
                    // Keys follow the queries in each row: one launch rotates both as q heads.
                    dev.rope_neox(proj, dummy, &positions, self.inv_freq, nh + nkv, 0, hd, width, 0, self.rope_scale)?;
                } else {
                    dev.rope_neox(proj, dummy, &positions, self.inv_freq, nh, 0, hd, width, 0, self.rope_scale)?;
                    dev.rope_neox(&mut proj.slice_mut(k_off..), dummy, &positions, self.inv_freq, nkv, 0, hd, width, 0, self.rope_scale)?;
                }
                (q_src, q_stride, k_rows, k_stride) = (buf(&act.proj).as_view(), width, buf(&act.proj).slice(k_off..), width);
            }
        }
        if !decode {
            let v_rows = buf(&act.proj).slice(v_off..);
            dev.kv_cache_write(&k_rows, &v_rows, kc, vc, &self.meta.slot_mapping(), kvd, k_stride, width)?;
        }
        let shape = PagedAttentionShape {
            n_q_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            q_stride,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_blocks_per_seq: self.meta.max_blocks_per_seq(),
            scale: 1.0 / (hd as f32).sqrt(),
            max_context: self.meta.max_context(),
            partition: 0,
        };
        let mut mix = buf_mut(&mut act.mix).slice_mut(0..rows * qd);
        let (tables, token_seq) = (self.meta.block_tables(), self.meta.token_seq());
        // Flash attention falls back to paged attention on a device without it, which a verify
        // step must not run.
        let flash = self.max_rows > 1 && route.flash_prefill && (matches!(attend, Attend::Prefill) || dev.has_flash_attention());
        // Gated queries: the gate columns follow the queries in each projection row. Decode
        // attention applies the gate in its final write (one kernel less a layer at decode, bit
        // for bit the same); flash and paged attention leave it to sigmoid_gate_mul.
        let gate_rows = buf(&act.proj).slice(qd..);
        let gate = (route.query == QueryLayout::Gated).then_some(DecodeGate { rows: &gate_rows, stride: width });
        let gated_in_attention = match attend {
            Attend::Decode(scratch) if rope_in_attention => {
                let norms = match (route.qk, &a.q_norm, &a.k_norm) {
                    (QkRoute::HeadNorm, Some(q), Some(k)) => Some(HeadNorms { q, k, eps: c.rms_norm_eps, plus_one: c.zero_centered_norm }),
                    _ => None,
                };
                let proj = buf(&act.proj);
                dev.paged_attention_decode_rope(proj, k_off, v_off, norms, kc, vc, &tables, &token_seq, &positions, &self.meta.slot_mapping(), self.inv_freq, self.rope_scale, &mut mix, gate, &shape, scratch)?;
                true
            }
            Attend::Decode(scratch) => {
                dev.paged_attention_decode(&q_src, kc, vc, &tables, &token_seq, &positions, &mut mix, gate, &shape, scratch)?;
                true
            }
            _ if flash => {
                dev.flash_attention(&q_src, kc, vc, &tables, &token_seq, &positions, &self.meta.cu_seqlens(), &mut mix, &shape, self.max_rows)?;
                false
            }
            Attend::Verify(Some(scratch)) => {
                dev.paged_attention_decode(&q_src, kc, vc, &tables, &token_seq, &positions, &mut mix, gate, &shape, scratch)?;
                true
            }
            Attend::Verify(None) => return Err(NinferError::Device("a verify step's attention without flash attention needs the decode attention scratch".into())),
            Attend::Prefill => {
                dev.paged_attention(&q_src, kc, vc, &tables, &token_seq, &positions, &mut mix, &shape)?;
                false
            }
        };
        if route.query == QueryLayout::Gated && !gated_in_attention {
            dev.sigmoid_gate_mul(&mut mix, &gate_rows, rows, qd, width)?;
        }
        act.project_out(dev, &a.o, ProjIn::Mix, rows, then)
    }
}

/// Per-head RMSNorm of `heads` heads starting at column `offset` of `src` rows (stride
/// `width`) into contiguous `[rows, heads * hd]`, one launch for all rows and heads.
#[allow(clippy::too_many_arguments)]
fn head_norm(dev: &CudaDevice, src: &CudaSlice<u16>, offset: usize, width: usize, w: &CudaSlice<u16>, out: &mut CudaSlice<u16>, heads: usize, hd: usize, rows: usize, eps: f32, plus_one: bool) -> Result<()> {
    dev.rmsnorm_heads(&src.slice(offset..), w, out, rows, heads, hd, width, heads * hd, eps, plus_one)
}
