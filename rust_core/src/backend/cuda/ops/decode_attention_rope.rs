//! Launcher of the rotating direct decode attention (`flash_decode_direct_rope_d*`,
//! cuda/decode_attention.cu): a decode step's q / k head norms, RoPE and KV cache write inside
//! the direct tensor-core form, bit for bit `rope_kv_write_packed` (or `rope_kv_write_normed`)
//! followed by `paged_attention_decode`. Why: at batch-1 decode every kernel boundary costs
//! 2-3 us, and this one came once per attention layer wherever the qkv projection does not
//! rotate (the 4-bit GEMVs, the tensor-core GEMV, more than one row). Batch-1 4-bit decode on
//! the H100: Llama-3-8B 1.005x, Qwen3.5-27B unchanged (the RoPE work still sits between the
//! kernel's PDL wait and its first mma).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::attention::PagedAttentionShape;
use super::decode_attention::{check_scratch_and_gate, decode_attention_launch, default_layout_arg, optional_ptr, tc_direct_heads_fit, AttnScratch, DecodeAttentionForm, DecodeGate, DecodePtrs};
use super::{as_i32, check_len, strided_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::{NinferError, Result};

/// The per-head RMSNorm of q and k (Qwen3, Qwen3.5) that the rotating form applies before RoPE:
/// weights of `head_dim` each, rmsnorm_heads' `eps` and `plus_one` ((1 + w) convention).
#[derive(Clone, Copy)]
pub struct HeadNorms<'a> {
    pub q: &'a CudaSlice<u16>,
    pub k: &'a CudaSlice<u16>,
    pub eps: f32,
    pub plus_one: bool,
}

/// Whether the rotating form serves these heads: the direct form's (`tc_direct_fits`: head size
/// 64 / 128 / 256, at most 8 q heads a kv head) and a rotary part of the head whose pairs fit it
/// (`rotary_dim` even, at most the head size).
pub fn tc_direct_rope_fits(n_q_heads: usize, n_kv_heads: usize, head_dim: usize, rotary_dim: usize) -> bool {
    tc_direct_heads_fit(n_q_heads, n_kv_heads, head_dim) && rotary_dim.is_multiple_of(2) && rotary_dim <= head_dim
}

fn kernel_name(d: usize) -> &'static str {
    match d {
        64 => "flash_decode_direct_rope_d64",
        128 => "flash_decode_direct_rope_d128",
        _ => "flash_decode_direct_rope_d256",
    }
}

/// FddRope's parameters (decode_attention.cu): where the k and v heads and the norm weights are
/// (raw addresses, 0 for no norms), the slots, the rotation.
struct RopePtrs {
    k_src: u64,
    v_src: u64,
    kv_stride: i64,
    slots: u64,
    inv_freq: u64,
    rotary_dim: usize,
    attn_scale: f32,
    q_norm: u64,
    k_norm: u64,
    eps: f32,
    plus_one: bool,
}

/// The parameters of `flash_decode_direct_rope_d*` in order: the direct form's, then FddRope's.
fn rope_args(ptrs: &DecodePtrs, splits: usize, r: &RopePtrs, sh: &PagedAttentionShape) -> Result<Vec<KArg>> {
    let mut args = ptrs.args(sh)?;
    args.extend(kargs![
        as_i32("splits", splits)?,
        r.k_src,
        r.v_src,
        r.kv_stride,
        r.slots,
        r.inv_freq,
        as_i32("rotary_dim", r.rotary_dim)?,
        r.attn_scale,
        r.q_norm,
        r.k_norm,
        r.eps,
        r.plus_one as i32,
    ]);
    Ok(args)
}

impl CudaDevice {
    /// Decode attention of one token per sequence whose q and k come unrotated from the packed
    /// qkv projection rows (`qkv`: token t's q heads at `t * shape.q_stride`, its k heads at
    /// `k_off + t * shape.q_stride`, its v heads at `v_off + t * shape.q_stride`): each block
    /// norms (with `norms`) and rotates (`inv_freq`, rotary_dim = 2 x its length, `attn_scale`
    /// multiplying cos and sin, position `token_pos[t]`) its q heads, and the block whose split
    /// holds the token's newest key does the same to that key and writes it and its v head to
    /// the caches at `slot_mapping[t]` (none where negative), then attends as
    /// `paged_attention_decode` does (gate, scratch and layout alike). Bit for bit
    /// `rope_kv_write_packed` (`rope_kv_write_normed` with norms; their q / k outputs are not
    /// written here) then `paged_attention_decode`. The plan's route must give the direct
    /// tensor-core form for this launch (sm_80+, not batch invariant) and the shape must fit it
    /// (`tc_direct_rope_fits`); otherwise an error naming both (the model's route takes this
    /// launcher only where they hold).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode_rope<C: DevicePtr<u16> + DevicePtrMut<u16>>(
        &self,
        qkv: &impl DevicePtr<u16>,
        k_off: usize,
        v_off: usize,
        norms: Option<HeadNorms<'_>>,
        k_cache: &mut C,
        v_cache: &mut C,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        slot_mapping: &impl DevicePtr<i64>,
        inv_freq: &impl DevicePtr<f32>,
        attn_scale: f32,
        out: &mut impl DevicePtrMut<u16>,
        gate: Option<DecodeGate<'_, '_>>,
        shape: &PagedAttentionShape,
        scratch: &AttnScratch,
    ) -> Result<()> {
        const OP: &str = "decode attention with RoPE";
        let (t, sh) = (token_seq.len(), shape);
        let rotary_dim = inv_freq.len() * 2;
        let form = self.plan().decode_attention.form(t, sh);
        if form != DecodeAttentionForm::TensorCoreDirect || !tc_direct_rope_fits(sh.n_q_heads, sh.n_kv_heads, sh.head_dim, rotary_dim) {
            return Err(NinferError::Device(format!(
                "{OP}: runs in the direct tensor-core form only (the plan's route gives {form:?} here; head size {}, {} / {} heads, rotary dim {rotary_dim})",
                sh.head_dim, sh.n_q_heads, sh.n_kv_heads
            )));
        }
        let layout_arg = default_layout_arg(form, t, sh, self.sm_count());
        let l = decode_attention_launch(self.compute_capability(), form, layout_arg, sh, t)?;
        self.check_attention(qkv, &*k_cache, &*v_cache, block_tables, token_seq, token_pos, out, sh)?;
        check_scratch_and_gate(t, sh, scratch, gate.as_ref())?;
        let kvd = sh.n_kv_heads * sh.head_dim;
        check_len("decode attention with RoPE k", qkv.len(), k_off + strided_len(t, kvd, sh.q_stride))?;
        check_len("decode attention with RoPE v", qkv.len(), v_off + strided_len(t, kvd, sh.q_stride))?;
        check_len("decode attention with RoPE slot_mapping", slot_mapping.len(), t)?;
        if let Some(n) = &norms {
            check_len("decode attention with RoPE q_norm", n.q.len(), sh.head_dim)?;
            check_len("decode attention with RoPE k_norm", n.k.len(), sh.head_dim)?;
        }
        let s = self.stream();
        let (p, _a) = qkv.device_ptr(s);
        let (kp, _b) = k_cache.device_ptr_mut(s);
        let (vp, _c) = v_cache.device_ptr_mut(s);
        let (bp, _d) = block_tables.device_ptr(s);
        let (sp, _e) = token_seq.device_ptr(s);
        let (pp, _f) = token_pos.device_ptr(s);
        let (op, _g) = out.device_ptr_mut(s);
        let (pa, _h) = scratch.acc.device_ptr(s);
        let (pm, _i) = scratch.ml.device_ptr(s);
        let (ar, _j) = scratch.arrivals.device_ptr(s);
        let (slots, _k) = slot_mapping.device_ptr(s);
        let (fp, _l) = inv_freq.device_ptr(s);
        let (gp, _m) = optional_ptr(gate.as_ref().map(|g| g.rows), s);
        let gate_stride = gate.as_ref().map_or(0, |g| g.stride) as i64;
        // No norms: null weights (the kernel rotates the heads as projected).
        let (qw, _n) = optional_ptr(norms.as_ref().map(|n| n.q), s);
        let (kw, _o) = optional_ptr(norms.as_ref().map(|n| n.k), s);
        let (eps, plus_one) = norms.as_ref().map_or((0.0, false), |n| (n.eps, n.plus_one));
        let ptrs = DecodePtrs { q: p, k_cache: kp, v_cache: vp, tables: bp, token_seq: sp, token_pos: pp, out: op, acc: pa, ml: pm, arrivals: ar, gate: gp, gate_stride };
        let rope = RopePtrs { k_src: p + 2 * k_off as u64, v_src: p + 2 * v_off as u64, kv_stride: sh.q_stride as i64, slots, inv_freq: fp, rotary_dim, attn_scale, q_norm: qw, k_norm: kw, eps, plus_one };
        let args = rope_args(&ptrs, layout_arg, &rope, sh)?;
        self.launch_decode(&l, kernel_name(sh.head_dim), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotating_form_takes_the_direct_forms_heads_and_a_rotary_part_that_fits() {
        assert!(tc_direct_rope_fits(32, 8, 128, 128), "Llama-3-8B");
        assert!(tc_direct_rope_fits(24, 4, 256, 64), "Qwen3.5-27B, partial rotary");
        assert!(tc_direct_rope_fits(8, 8, 64, 0), "no rotary part");
        assert!(!tc_direct_rope_fits(32, 8, 96, 96), "head size 96");
        assert!(!tc_direct_rope_fits(32, 2, 128, 128), "groups of 16");
        assert!(!tc_direct_rope_fits(32, 8, 128, 130), "rotary past the head");
        assert!(!tc_direct_rope_fits(32, 8, 128, 63), "an odd rotary dim");
    }

    /// Each parameter of the kernel `name`'s signature in decode_attention.cu as the KArg kind a
    /// launch must pass for it (a pointer, `int`, `long long` or `float`).
    fn signature(name: &str) -> Vec<&'static str> {
        let src = include_str!("../../../../../cuda/decode_attention.cu");
        let at = src.find(&format!("{name}(")).unwrap_or_else(|| panic!("{name} in decode_attention.cu")) + name.len() + 1;
        let params = &src[at..at + src[at..].find(')').unwrap()];
        params
            .replace('\\', " ")
            .split(',')
            .map(|p| {
                let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                match () {
                    _ if p.contains('*') => "ptr",
                    _ if p.starts_with("long long ") => "i64",
                    _ if p.starts_with("int ") => "i32",
                    _ if p.starts_with("float ") => "f32",
                    _ => panic!("{name}: parameter {p:?}"),
                }
            })
            .collect()
    }

    fn kinds(args: &[KArg]) -> Vec<&'static str> {
        args.iter().map(|a| match a {
            KArg::Ptr(_) => "ptr",
            KArg::I32(_) => "i32",
            KArg::I64(_) => "i64",
            KArg::F32(_) => "f32",
        })
        .collect()
    }

    #[test]
    fn the_launch_passes_each_kernel_parameter_in_order() {
        let sh = PagedAttentionShape { n_q_heads: 32, n_kv_heads: 8, head_dim: 128, q_stride: 6144, block_size: 16, num_blocks: 4, max_blocks_per_seq: 2, scale: 0.1, max_context: 0, partition: 0 };
        let ptrs = DecodePtrs { q: 1, k_cache: 2, v_cache: 3, tables: 4, token_seq: 5, token_pos: 6, out: 7, acc: 8, ml: 9, arrivals: 10, gate: 0, gate_stride: 0 };
        let rope = RopePtrs { k_src: 11, v_src: 12, kv_stride: 6144, slots: 13, inv_freq: 14, rotary_dim: 128, attn_scale: 1.0, q_norm: 0, k_norm: 0, eps: 0.0, plus_one: false };
        assert_eq!(kinds(&rope_args(&ptrs, 4, &rope, &sh).unwrap()), signature("flash_decode_direct_rope_d##D"));
        // The direct form's own kernel: the shared parameters and its splits.
        let mut plain = ptrs.args(&sh).unwrap();
        plain.push(KArg::I32(4));
        assert_eq!(kinds(&plain), signature("flash_decode_direct_d##D"));
    }

    #[test]
    fn kernel_names_follow_the_instances_of_decode_attention_cu() {
        let src = include_str!("../../../../../cuda/decode_attention.cu");
        for d in [64, 128, 256] {
            assert!(src.contains(&format!("\nFDD_ROPE_INSTANCE({d})")), "FDD_ROPE_INSTANCE({d})");
            assert_eq!(kernel_name(d), format!("flash_decode_direct_rope_d{d}"));
        }
        assert!(src.contains("flash_decode_direct_rope_d##D("));
    }
}
