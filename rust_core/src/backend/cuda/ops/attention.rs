//! Paged attention launchers (cuda/attention.cu): KV cache write, one attention kernel for
//! decode and prefill with optional split-K (flash decoding) and its combine, the names and
//! sizes of the fixed-split decode form (its kernels are decode_attention.cu's, launched from
//! ops/decode_attention.rs) and the two-kernel decode baseline.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::decode_attention::AttnScratch;
use super::{as_i32, cfg, check_len, strided_len};
use crate::backend::cuda::device::{driver_err, CudaDevice};
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Warps per block in attention.cu (one warp per (token, group of q heads)).
const ATTN_WARPS: usize = 4;

/// Shapes of one paged-attention call. The cache is [num_blocks, block_size, n_kv_heads,
/// head_dim] for K and for V; block tables are [n_seqs, max_blocks_per_seq].
#[derive(Debug, Clone, Copy)]
pub struct PagedAttentionShape {
    /// Query heads.
    pub n_q_heads: usize,
    /// KV heads (divides n_q_heads).
    pub n_kv_heads: usize,
    /// Head size: 64, 96, 128 or 256.
    pub head_dim: usize,
    /// Elements between consecutive tokens' q rows (n_q_heads * head_dim when contiguous).
    pub q_stride: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Cache blocks in the pool (bounds-checks the cache buffers).
    pub num_blocks: usize,
    /// Columns of the block table.
    pub max_blocks_per_seq: usize,
    /// Softmax scale (head_dim^-1/2 unless the model says otherwise).
    pub scale: f32,
    /// Largest number of keys any query sees (the longest context in the step).
    pub max_context: usize,
    /// Keys per split; 0 picks one from the step's size (see `splits`). Splits raise the
    /// parallelism of decode, where a step has few query rows and long contexts.
    pub partition: usize,
}

/// Warps (query tokens x head groups x splits) to aim for: enough to fill every SM of a large GPU several times.
const TARGET_WARPS: usize = 8192;
/// Fewest keys a split is given; shorter splits cost more in the combine than they save.
const MIN_PARTITION: usize = 64;

impl PagedAttentionShape {
    /// (keys per split, splits): split the key range until warps x splits reaches
    /// TARGET_WARPS, never below MIN_PARTITION keys per split.
    fn splits(&self, warps: usize) -> (usize, usize) {
        let ctx = self.max_context.max(1);
        if self.partition > 0 {
            return (self.partition, ctx.div_ceil(self.partition));
        }
        let want = (TARGET_WARPS / warps.max(1)).max(1).min(ctx.div_ceil(MIN_PARTITION));
        let partition = ctx.div_ceil(want);
        (partition, ctx.div_ceil(partition))
    }
}

/// Warp splits a decode token may take in attention_keys.cuh (DECODE_SPLITS there, whose
/// decode_partition keeps every context within it): the grid height of the two-kernel decode
/// path, and FIXED_BLOCK_SPLITS blocks of FIXED_WARPS warps in `decode_attention_fixed`.
pub const DECODE_SPLITS: usize = 64;
/// Warps per block of `decode_attention_fixed_*` (DA_WARPS in decode_attention.cu).
const FIXED_WARPS: usize = 8;
/// Block splits per (token, group) of `decode_attention_fixed_*` (DA_SPLITS in decode_attention.cu):
/// its grid height and the stride of its partials in the scratch.
pub const FIXED_BLOCK_SPLITS: usize = DECODE_SPLITS / FIXED_WARPS;

/// (acc, ml) elements of the split partials `paged_attention_decode_two_kernels` needs for
/// `tokens` query tokens (one partial per warp split).
pub fn two_kernel_decode_scratch_len(tokens: usize, shape: &PagedAttentionShape) -> (usize, usize) {
    let rows = tokens * shape.n_q_heads;
    (rows * DECODE_SPLITS * shape.head_dim, rows * DECODE_SPLITS * 2)
}

/// (q heads per warp, warps) for `t` query tokens: one warp serves a whole GQA group when the
/// group size has a kernel instance.
pub(super) fn group_and_warps(sh: &PagedAttentionShape, t: usize) -> (usize, usize) {
    let group = sh.n_q_heads / sh.n_kv_heads.max(1);
    let g = if matches!(group, 2 | 4 | 8) { group } else { 1 };
    (g, t * sh.n_q_heads / g)
}

/// The instance of a kernel family `$prefix_d{D}_g{G}` (attention.cu's instance macros) for
/// head size `d` (64, 96, 128, 256) and `g` q heads per warp or block (1, 2, 4, 8).
macro_rules! by_head_dim_and_group {
    ($prefix:literal, $d:expr, $g:expr) => {
        match ($d, $g) {
            (64, 1) => concat!($prefix, "_d64_g1"),
            (64, 2) => concat!($prefix, "_d64_g2"),
            (64, 4) => concat!($prefix, "_d64_g4"),
            (64, _) => concat!($prefix, "_d64_g8"),
            (96, 1) => concat!($prefix, "_d96_g1"),
            (96, 2) => concat!($prefix, "_d96_g2"),
            (96, 4) => concat!($prefix, "_d96_g4"),
            (96, _) => concat!($prefix, "_d96_g8"),
            (128, 1) => concat!($prefix, "_d128_g1"),
            (128, 2) => concat!($prefix, "_d128_g2"),
            (128, 4) => concat!($prefix, "_d128_g4"),
            (128, _) => concat!($prefix, "_d128_g8"),
            (_, 1) => concat!($prefix, "_d256_g1"),
            (_, 2) => concat!($prefix, "_d256_g2"),
            (_, 4) => concat!($prefix, "_d256_g4"),
            _ => concat!($prefix, "_d256_g8"),
        }
    };
}
pub(super) use by_head_dim_and_group;

/// The split attention kernel (prefill on sm_70/75, the two-kernel decode) for head size `d`
/// and `g` q heads per warp.
fn kernel_name(d: usize, g: usize) -> &'static str {
    by_head_dim_and_group!("paged_attention", d, g)
}

/// The fixed-split one-kernel decode attention for head size `d` and `g` q heads per block.
pub(super) fn fixed_decode_kernel_name(d: usize, g: usize) -> &'static str {
    by_head_dim_and_group!("decode_attention_fixed", d, g)
}

/// The split-combine kernel for head size `d`.
fn combine_name(d: usize) -> &'static str {
    match d {
        64 => "attention_combine_d64",
        96 => "attention_combine_d96",
        128 => "attention_combine_d128",
        _ => "attention_combine_d256",
    }
}

impl CudaDevice {
    /// Writes the new tokens' K and V rows (n_kv_heads * head_dim elements each, rows
    /// `k_stride` / `v_stride` apart) into the paged cache at flat slots
    /// `slot_mapping[t]` = block * block_size + offset; a negative slot skips the token.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_cache_write(
        &self,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        k_cache: &mut impl DevicePtrMut<u16>,
        v_cache: &mut impl DevicePtrMut<u16>,
        slot_mapping: &impl DevicePtr<i64>,
        row_elems: usize,
        k_stride: usize,
        v_stride: usize,
    ) -> Result<()> {
        let t = slot_mapping.len();
        check_len("kv_cache_write k", k.len(), strided_len(t, row_elems, k_stride))?;
        check_len("kv_cache_write v", v.len(), strided_len(t, row_elems, v_stride))?;
        if k_cache.len() != v_cache.len() || k_cache.len() % row_elems.max(1) != 0 {
            return Err(NinferError::Device(format!(
                "kv_cache_write: caches of {} and {} elements do not hold rows of {row_elems}",
                k_cache.len(),
                v_cache.len()
            )));
        }
        let f = self.function(KernelFamily::Attention, "kv_cache_write")?;
        let s = self.stream();
        let (kp, _a) = k.device_ptr(s);
        let (vp, _b) = v.device_ptr(s);
        let (kc, _c) = k_cache.device_ptr_mut(s);
        let (vc, _d) = v_cache.device_ptr_mut(s);
        let (sp, _e) = slot_mapping.device_ptr(s);
        let args = kargs![
            kp,
            vp,
            kc,
            vc,
            sp,
            as_i32("row_elems", row_elems)?,
            k_stride as i64,
            v_stride as i64,
        ];
        self.launch_pdl(&f, cfg((as_i32("tokens", t)? as u32, 1, 1), 128), "kv_cache_write", &args)
    }

    /// Causal attention of `token_seq.len()` query tokens over the paged cache; token t is in
    /// sequence token_seq[t] at position token_pos[t] and sees keys 0..=token_pos[t]. Decode
    /// is one token per sequence at context_len - 1. out is [T, n_q_heads, head_dim].
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &PagedAttentionShape,
    ) -> Result<()> {
        self.check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape)?;
        let sh = shape;
        let t = token_seq.len();
        let d = sh.head_dim;
        let (group, _) = group_and_warps(sh, t);
        let (partition, n_splits) = sh.splits(t * sh.n_q_heads / group);
        let rows = t * sh.n_q_heads;
        let s = self.stream();
        let scratch = if n_splits > 1 {
            // SAFETY: every (row, split) partial the combine reads is written by the attention
            // kernel first (idle splits write only their (max, sum), which the combine skips).
            unsafe {
                Some((
                    s.alloc::<f32>(rows * n_splits * d).map_err(driver_err("attention partials"))?,
                    s.alloc::<f32>(rows * n_splits * 2).map_err(driver_err("attention partials"))?,
                ))
            }
        } else {
            None
        };
        self.attention_launch(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, sh, partition as i32, n_splits, scratch.as_ref().map(|(a, m)| (a, m)))
    }

    /// The two-kernel form of decode attention (a warp per split of
    /// `decode_partition(context)` keys over a grid of DECODE_SPLITS splits, then
    /// `attention_combine`), with per-token splits as `paged_attention_decode`; kept as a
    /// baseline the one-kernel forms are checked against. `scratch.acc` / `scratch.ml` must hold
    /// `two_kernel_decode_scratch_len(tokens, shape)`; `scratch.arrivals` is unused.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode_two_kernels(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &PagedAttentionShape,
        scratch: &AttnScratch,
    ) -> Result<()> {
        self.check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape)?;
        let (acc, ml) = two_kernel_decode_scratch_len(token_seq.len(), shape);
        check_len("attention scratch acc", scratch.acc.len(), acc)?;
        check_len("attention scratch ml", scratch.ml.len(), ml)?;
        self.attention_launch(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape, 0, DECODE_SPLITS, Some((&scratch.acc, &scratch.ml)))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_launch(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        sh: &PagedAttentionShape,
        partition: i32,
        n_splits: usize,
        scratch: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
    ) -> Result<()> {
        let t = token_seq.len();
        let d = sh.head_dim;
        let (g, warps) = group_and_warps(sh, t);
        let rows = t * sh.n_q_heads;
        let s = self.stream();
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k_cache.device_ptr(s);
        let (vp, _c) = v_cache.device_ptr(s);
        let (bp, _d) = block_tables.device_ptr(s);
        let (sp, _e) = token_seq.device_ptr(s);
        let (pp, _f) = token_pos.device_ptr(s);
        let (op, _g) = out.device_ptr_mut(s);
        let (pa, pm) = match scratch {
            Some((acc, ml)) => (acc.device_ptr(s).0, ml.device_ptr(s).0),
            None => (0, 0),
        };
        let name = (kernel_name(d, g), combine_name(d));
        let f = self.function(KernelFamily::Attention, name.0)?;
        let args = kargs![
            qp,
            kp,
            vp,
            bp,
            as_i32("max_blocks_per_seq", sh.max_blocks_per_seq)?,
            sp,
            pp,
            as_i32("tokens", t)?,
            as_i32("n_q_heads", sh.n_q_heads)?,
            as_i32("n_kv_heads", sh.n_kv_heads)?,
            sh.q_stride as i64,
            as_i32("block_size", sh.block_size)?,
            sh.scale,
            partition,
            op,
            pa,
            pm,
        ];
        let blocks = as_i32("attention blocks", warps.div_ceil(ATTN_WARPS))? as u32;
        let block = (ATTN_WARPS * 32) as u32;
        self.launch_pdl(&f, cfg((blocks, n_splits as u32, 1), block), name.0, &args)?;
        if n_splits > 1 {
            let blocks = as_i32("attention blocks", rows.div_ceil(ATTN_WARPS))? as u32;
            let f = self.function(KernelFamily::Attention, name.1)?;
            let args = kargs![
                pa,
                pm,
                as_i32("rows", rows)?,
                n_splits as i32,
                op,
            ];
            self.launch_pdl(&f, cfg((blocks, 1, 1), block), name.1, &args)?;
        }
        Ok(())
    }

    /// Shape and buffer checks shared by both attention entry points.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_attention(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &PagedAttentionShape,
    ) -> Result<()> {
        let sh = shape;
        let t = token_seq.len();
        let d = sh.head_dim;
        if !matches!(d, 64 | 96 | 128 | 256) {
            return Err(NinferError::Unsupported(format!("CUDA attention with head_dim {d}")));
        }
        if sh.n_kv_heads == 0 || !sh.n_q_heads.is_multiple_of(sh.n_kv_heads) {
            return Err(NinferError::Device(format!(
                "attention: {} q heads are not a multiple of {} kv heads",
                sh.n_q_heads, sh.n_kv_heads
            )));
        }
        check_len("attention q", q.len(), strided_len(t, sh.n_q_heads * d, sh.q_stride))?;
        let cache = sh.num_blocks * sh.block_size * sh.n_kv_heads * d;
        check_len("attention k_cache", k_cache.len(), cache)?;
        check_len("attention v_cache", v_cache.len(), cache)?;
        check_len("attention token_pos", token_pos.len(), t)?;
        check_len("attention out", out.len(), t * sh.n_q_heads * d)?;
        if block_tables.len() % sh.max_blocks_per_seq.max(1) != 0 {
            return Err(NinferError::Device(format!(
                "attention: block table of {} entries is not [n_seqs, {}]",
                block_tables.len(),
                sh.max_blocks_per_seq
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_follow_the_instances_of_the_attention_sources() {
        assert_eq!(kernel_name(64, 1), "paged_attention_d64_g1");
        assert_eq!(kernel_name(96, 4), "paged_attention_d96_g4");
        assert_eq!(kernel_name(128, 8), "paged_attention_d128_g8");
        assert_eq!(kernel_name(256, 2), "paged_attention_d256_g2");
        assert_eq!(fixed_decode_kernel_name(128, 4), "decode_attention_fixed_d128_g4");
        assert_eq!(fixed_decode_kernel_name(256, 1), "decode_attention_fixed_d256_g1");
        assert_eq!(fixed_decode_kernel_name(64, 8), "decode_attention_fixed_d64_g8");
        // Every name the launchers can ask for is an instance in the kernel source:
        // ATTN_GROUP_INSTANCE(D, G) in attention.cu, DA_FIXED_INSTANCE(D, G) in
        // decode_attention.cu, G = 1, 2, 4, 8, for each head size.
        let src = include_str!("../../../../../cuda/attention.cu");
        let decode = include_str!("../../../../../cuda/decode_attention.cu");
        for d in [64, 96, 128, 256] {
            assert!(src.contains(&format!("\nATTN_INSTANCE({d})")), "ATTN_INSTANCE({d})");
            assert!(decode.contains(&format!("\nDA_FIXED_HEAD_INSTANCES({d})")), "DA_FIXED_HEAD_INSTANCES({d})");
            for g in [1, 2, 4, 8] {
                assert!(src.contains(&format!("ATTN_GROUP_INSTANCE(D, {g})")), "G = {g}");
                assert!(decode.contains(&format!("DA_FIXED_INSTANCE(D, {g})")), "G = {g}");
                for (prefix, name) in [("paged_attention", kernel_name(d, g)), ("decode_attention_fixed", fixed_decode_kernel_name(d, g))] {
                    assert_eq!(name, format!("{prefix}_d{d}_g{g}"));
                }
            }
        }
        assert!(src.contains("paged_attention_d##D##_g##G(") && decode.contains("decode_attention_fixed_d##D##_g##G("));
    }
}
