//! Decode-step attention launchers: the direct tensor-core form every sm_80+ decode runs where
//! the head size allows (`flash_decode_direct_*`), the one-kernel form whose split-K layout
//! grows with each token's context (`decode_attention_*`, the batch-invariant route and the
//! small-batch route elsewhere), the fixed-split form (`decode_attention_fixed_*`, batches of 3+
//! where neither tensor-core form applies), and their scratch.

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::attention::{by_head_dim_and_group, fixed_decode_kernel_name, group_and_warps, PagedAttentionShape, FIXED_BLOCK_SPLITS};
use super::{as_i32, cfg, check_len, strided_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

/// Warps per block of both one-kernel forms (DA_WARPS in decode_attention.cu).
const DECODE_WARPS: usize = 8;
/// Most block splits a token takes in `decode_attention_*` (DA_MAX_SPLITS in
/// decode_attention.cu): the stride of the partials in the scratch.
pub const DECODE_MAX_SPLITS: usize = 32;
/// Fewest keys a warp of `decode_attention_*` walks by default above DECODE_SHORT_CONTEXT keys
/// (DA_MIN_WARP_KEYS).
pub const DECODE_MIN_WARP_KEYS: usize = 8;
/// Fewest keys a warp walks by default for a token of up to DECODE_SHORT_CONTEXT keys
/// (DA_SHORT_WARP_KEYS): twice the block splits at short contexts, where the merge is cheap and
/// fewer keys a warp shorten its dependent loads (why: decode_attention.cu, DA_SHORT_CONTEXT).
pub const DECODE_SHORT_WARP_KEYS: usize = 4;
/// Most keys of a token that takes DECODE_SHORT_WARP_KEYS by default (DA_SHORT_CONTEXT).
pub const DECODE_SHORT_CONTEXT: usize = 512;

/// The `min_keys` of the default layout (the kernels' `min_warp_keys` 0).
pub const DECODE_DEFAULT_LAYOUT: usize = 0;

/// Keys per warp of `decode_attention_*` for a token that sees `context` keys at the default
/// layout: 4 up to a 512-key context, 8 up to 2048, then as many as keep the token within
/// DECODE_MAX_SPLITS block splits. The kernel decides (da_warp_keys in decode_attention.cu); this
/// mirror documents the layout and lets tests pick contexts at its edges.
pub fn decode_warp_keys(context: usize) -> usize {
    decode_warp_keys_with(context, DECODE_DEFAULT_LAYOUT)
}

/// `decode_warp_keys` with `min_keys` the fewest keys a warp walks (DECODE_DEFAULT_LAYOUT: the
/// default's, which depend on the context).
pub fn decode_warp_keys_with(context: usize, min_keys: usize) -> usize {
    let fewest = match min_keys {
        DECODE_DEFAULT_LAYOUT if context <= DECODE_SHORT_CONTEXT => DECODE_SHORT_WARP_KEYS,
        DECODE_DEFAULT_LAYOUT => DECODE_MIN_WARP_KEYS,
        m => m,
    };
    fewest.max(context.div_ceil(DECODE_MAX_SPLITS * DECODE_WARPS))
}

/// Block splits of `decode_attention_*` a token that sees `context` keys takes (each
/// DECODE_WARPS x `decode_warp_keys(context)` keys): 8 at 256 keys, 16 at 512, 9 at 513, 16 at
/// 1024, 32 from 2048 on.
pub fn decode_block_splits(context: usize) -> usize {
    decode_block_splits_with(context, DECODE_DEFAULT_LAYOUT)
}

/// `decode_block_splits` with `min_keys` the fewest keys a warp walks.
pub fn decode_block_splits_with(context: usize, min_keys: usize) -> usize {
    context.max(1).div_ceil(decode_warp_keys_with(context, min_keys) * DECODE_WARPS)
}

/// Grid height of `decode_attention_*` for tokens of at most `max_context` keys: a bound on
/// `decode_block_splits` of every context up to it (which itself is not monotone: it drops past
/// 512 and past 2048 keys). The launcher takes `max_context` from the block tables' width, which
/// a decode graph fixes, so the grid never depends on the step's contexts.
pub fn decode_grid_splits(max_context: usize) -> usize {
    decode_grid_splits_with(max_context, DECODE_DEFAULT_LAYOUT)
}

/// `decode_grid_splits` with `min_keys` the fewest keys a warp walks.
pub fn decode_grid_splits_with(max_context: usize, min_keys: usize) -> usize {
    let bound = |max: usize, fewest: usize| max.max(1).div_ceil(fewest * DECODE_WARPS).min(DECODE_MAX_SPLITS);
    match min_keys {
        // The short contexts' bound, and the longer contexts' (the larger past 1024 keys).
        DECODE_DEFAULT_LAYOUT => bound(max_context.min(DECODE_SHORT_CONTEXT), DECODE_SHORT_WARP_KEYS).max(bound(max_context, DECODE_MIN_WARP_KEYS)),
        m => bound(max_context, m),
    }
}

/// Q heads per block of `decode_attention_*`: the largest instance (8, 4, 2, 1) dividing the GQA
/// group, so that one K/V read serves that many heads even where the group has no instance of
/// its own (Qwen3.5-27B's groups of 6: 2 heads a block, each K/V row read 3 times, not 6).
fn decode_group(sh: &PagedAttentionShape) -> usize {
    let group = (sh.n_q_heads / sh.n_kv_heads.max(1)).max(1);
    [8, 4, 2, 1].into_iter().find(|g| group.is_multiple_of(*g)).unwrap_or(1)
}

/// The scaled one-kernel decode attention for head size `d` and `g` q heads per block.
fn decode_kernel_name(d: usize, g: usize) -> &'static str {
    by_head_dim_and_group!("decode_attention", d, g)
}

/// Decode-attention scratch, allocated once by the caller (a captured CUDA graph must not
/// allocate): block-split partials `acc` f32 `[rows, DECODE_MAX_SPLITS, head_dim]` and `ml` f32
/// `[rows, DECODE_MAX_SPLITS, 2]` (rows = tokens x q heads), and arrival counters (one per
/// (token, group of q heads a block serves), at most one per row), which must be allocated
/// zeroed: the kernels leave every counter at 0 when they complete. The fixed-split baseline
/// uses the first FIXED_BLOCK_SPLITS partials of each row.
pub struct AttnScratch {
    pub acc: CudaSlice<f32>,
    pub ml: CudaSlice<f32>,
    pub arrivals: CudaSlice<u32>,
}

/// Elements of each `AttnScratch` buffer for a number of query tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeScratchLen {
    pub acc: usize,
    pub ml: usize,
    pub arrivals: usize,
}

/// The scratch `paged_attention_decode` (either form) needs for `tokens`
/// query tokens. Counters are one per row, whatever the group a block serves.
pub fn decode_scratch_len(tokens: usize, shape: &PagedAttentionShape) -> DecodeScratchLen {
    let rows = tokens * shape.n_q_heads;
    DecodeScratchLen { acc: rows * DECODE_MAX_SPLITS * shape.head_dim, ml: rows * DECODE_MAX_SPLITS * 2, arrivals: rows }
}

/// The one-kernel decode attention a launch runs (`decode_attention_form`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeAttentionForm {
    /// `decode_attention_*`: splits grow with each token's context.
    Scaled,
    /// `decode_attention_fixed_*`: FIXED_BLOCK_SPLITS blocks per (token, group).
    Fixed,
    /// `flash_decode_direct_*`: the tensor-core form with K/V loaded straight into the mma
    /// fragments, no shared-memory staging (sm_80+, head sizes 64 / 128 / 256, at most 8 q heads
    /// a kv head; `tc_direct_fits`).
    TensorCoreDirect,
}

/// Keys a tensor-core tile row takes (FD_BN in decode_attention.cu).
const TC_TILE_KEYS: usize = 16;
/// Warps a block of `flash_decode_direct_d{d}` (FDD_WARPS in decode_attention.cu).
pub const TC_DIRECT_WARPS: usize = 4;

/// Blocks an SM the direct tensor-core form's launch aims at (its kernels take at most 255
/// registers a thread for two 4-warp blocks an SM): `tc_direct_splits`.
pub const TC_DIRECT_BLOCKS_PER_SM: usize = 2;

/// Most splits a token of a direct tensor-core launch takes: as many blocks over the launch's
/// tokens and kv heads as fit TC_DIRECT_BLOCKS_PER_SM blocks on each of `sms` SMs in one wave
/// (rounded down: a few blocks past the wave cost a second one), within 1..=DECODE_MAX_SPLITS
/// (a token's splits are `tc_direct_split_keys`). Why by launch, not by context alone: per call
/// on an H200 (Llama-3-8B shape, 132 SMs) the fastest setting held ~256 blocks at every batch: batch 1 32 splits a token (16 took
/// 1.27x at 16k keys, 1.37x at 32k), batch 2 16, 4 8, 16 2 (3 took 1.25x at 1k keys, 1.23x at
/// 4k), 32 1 (2 took 1.23x at 1k); 9 splits at batch 4 (288 blocks) took 1.12x of 5 at 16k keys.
/// The token count is taken at its decode-graph bucket (`decode_bucket`): a graph launches its
/// bucket's rows and an eager step its batch's, and both must give the same bits
/// (turning CUDA graphs off changes no value).
pub fn tc_direct_splits(tokens: usize, n_kv_heads: usize, sms: usize) -> usize {
    let rows = crate::model::cuda::graphs::decode_bucket(tokens.max(1));
    ((TC_DIRECT_BLOCKS_PER_SM * sms) / (rows * n_kv_heads.max(1))).clamp(1, DECODE_MAX_SPLITS)
}

/// Keys one split of the direct tensor-core form takes for a token seeing `limit` keys when a
/// token takes at most `splits` (fdd_split_keys): whole blocks' worth of 16-key tiles
/// (TC_DIRECT_WARPS x 16 keys).
pub fn tc_direct_split_keys(limit: usize, splits: usize) -> usize {
    let unit = TC_DIRECT_WARPS * TC_TILE_KEYS;
    unit.max(limit.div_ceil(splits.max(1)).div_ceil(unit) * unit)
}

/// Grid splits of the direct tensor-core form for tokens of at most `max_context` keys.
pub fn tc_direct_grid_splits(max_context: usize, splits: usize) -> usize {
    max_context.max(1).div_ceil(TC_DIRECT_WARPS * TC_TILE_KEYS).min(splits).min(DECODE_MAX_SPLITS)
}

/// Whether the direct tensor-core form serves this shape: head sizes 64 / 128 / 256 (a lane
/// holds two tiles of K/V of up to 128 dims in registers; at 256 a pair of warps splits the
/// dims) and GQA groups of at most 8 q heads.
pub fn tc_direct_fits(sh: &PagedAttentionShape) -> bool {
    tc_direct_heads_fit(sh.n_q_heads, sh.n_kv_heads, sh.head_dim)
}

/// `tc_direct_fits` of a model's attention heads.
pub fn tc_direct_heads_fit(n_q_heads: usize, n_kv_heads: usize, head_dim: usize) -> bool {
    matches!(head_dim, 64 | 128 | 256) && n_kv_heads > 0 && n_q_heads.is_multiple_of(n_kv_heads) && n_q_heads / n_kv_heads <= 8
}

/// Dynamic shared memory of `flash_decode_direct_d{d}`: the merge of its slots (a warp, or at
/// d 256 a pair of warps; their O^T accumulators, maxima and sums), reused for the last
/// block's split merge.
pub fn tc_direct_smem_bytes(d: usize) -> usize {
    let slots = TC_DIRECT_WARPS / d.div_ceil(128).max(1);
    let merge = slots * 8 * d * 4 + 2 * slots * 8 * 4;
    let split_merge = (2 * 8 * DECODE_MAX_SPLITS + 8) * 4;
    merge.max(split_merge)
}

fn tc_direct_kernel_name(d: usize) -> &'static str {
    match d {
        64 => "flash_decode_direct_d64",
        128 => "flash_decode_direct_d128",
        _ => "flash_decode_direct_d256",
    }
}

/// Most query tokens a decode launch runs the scaled form for by default. Measured on an H200
/// (TIMING lines of cuda_ops decode_attention, scaled / fixed per call): at batch 1, 0.48x at 4096 keys and 0.32x at 16384 (Llama-3-8B;
/// Qwen3.5-27B 0.80x / 0.44x), within noise at 256 keys on the 8B (1.13x, +0.9 us, on the 27B);
/// batch 2 0.59-0.88x at every context of both shapes; batch 4 mixed (1.17-1.21x at 1-4k keys
/// on the 8B); batch 8 1.13-1.23x at 1-4k keys: there the fixed grid (64 blocks a token on the
/// 8B) already fills the GPU and the scaled form's short splits cost more in the merge.
/// End to end, Llama-3-8B batch-1 decode at ~3.8k keys: 213.5 tok/s against 188.6 (+13%).
pub const DECODE_SCALED_MAX_TOKENS: usize = 2;

/// The plan's decode attention route: which form a launch runs (`form`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeAttentionRoute {
    /// The direct tensor-core form where the shape fits (sm_80+).
    pub tensor_cores: bool,
    /// Every launch in the scaled form (the plan's batch invariance).
    pub batch_invariant: bool,
}

impl DecodeAttentionRoute {
    /// The form a decode launch of `tokens` query tokens of `shape` runs: the scaled one at
    /// every batch size when batch invariant (it gives a row the same bits in any batch, but
    /// switching form, or the direct form's splits, by batch size would not); else the direct
    /// tensor-core one where it fits; else the scaled one up to DECODE_SCALED_MAX_TOKENS and
    /// the fixed one above.
    /// Why the direct form: per call on the Llama-3-8B shape (H200) 0.42-0.84x the scaled /
    /// fixed forms' time at batch 1-8 and 1-32k keys and 0.64-0.83x the (removed) staged
    /// tensor-core form's at batch 16-64; in the model batch-1 decode at a 32k context +14%, c = 4 / 8
    /// +6.8% / +9.3%, c = 64 +5.0%; on Qwen3.5-27B (head size 256) batch-1 decode at a 32k
    /// context +3.1%, at 1k -0.35%, c = 8 / 64 +1.5% / +2.1%.
    pub fn form(&self, tokens: usize, shape: &PagedAttentionShape) -> DecodeAttentionForm {
        if self.batch_invariant {
            DecodeAttentionForm::Scaled
        } else if self.tensor_cores && tc_direct_fits(shape) {
            DecodeAttentionForm::TensorCoreDirect
        } else if tokens <= DECODE_SCALED_MAX_TOKENS {
            DecodeAttentionForm::Scaled
        } else {
            DecodeAttentionForm::Fixed
        }
    }
}

/// One decode attention launch as the plan routes it: the kernel, its grid (tokens x groups of
/// q heads, splits), block, dynamic shared memory, and the layout argument the scaled and
/// direct kernels take last (None for the fixed form, which takes none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeAttentionLaunch {
    pub family: KernelFamily,
    pub name: &'static str,
    pub grid: (usize, usize),
    pub block: usize,
    pub smem: usize,
    pub layout_arg: Option<usize>,
}

/// The layout argument a launch of `form` takes by default: the direct form's most splits a
/// token (`tc_direct_splits` of the launch and the device's SMs), else the scaled form's
/// default layout (ignored by the fixed form).
pub fn default_layout_arg(form: DecodeAttentionForm, tokens: usize, shape: &PagedAttentionShape, sm_count: usize) -> usize {
    match form {
        DecodeAttentionForm::TensorCoreDirect => tc_direct_splits(tokens, shape.n_kv_heads, sm_count),
        _ => DECODE_DEFAULT_LAYOUT,
    }
}

/// The launch of decode attention form `form` with layout argument `layout_arg` for `tokens`
/// query tokens of `shape` on a device of compute capability `cc`; an error where the form does
/// not serve the shape there.
pub fn decode_attention_launch(cc: (u32, u32), form: DecodeAttentionForm, layout_arg: usize, shape: &PagedAttentionShape, tokens: usize) -> Result<DecodeAttentionLaunch> {
    let max_context = shape.max_blocks_per_seq * shape.block_size;
    let (family, name, g, splits, block, smem, scaled) = match form {
        DecodeAttentionForm::Scaled => {
            let g = decode_group(shape);
            (KernelFamily::DecodeAttention, decode_kernel_name(shape.head_dim, g), g, decode_grid_splits_with(max_context, layout_arg), DECODE_WARPS, 0, true)
        }
        DecodeAttentionForm::Fixed => {
            let (g, _) = group_and_warps(shape, 0);
            (KernelFamily::DecodeAttention, fixed_decode_kernel_name(shape.head_dim, g), g, FIXED_BLOCK_SPLITS, DECODE_WARPS, 0, false)
        }
        DecodeAttentionForm::TensorCoreDirect => {
            if !tc_direct_fits(shape) || cc.0 < 8 {
                return Err(crate::NinferError::invalid(
                    "decode attention form",
                    format!(
                        "the direct tensor-core form needs sm_80+, head size 64/128/256 and at most 8 q heads a kv head (sm_{}{}, head size {}, {} / {} heads)",
                        cc.0, cc.1, shape.head_dim, shape.n_q_heads, shape.n_kv_heads
                    ),
                ));
            }
            if !(1..=DECODE_MAX_SPLITS).contains(&layout_arg) {
                return Err(crate::NinferError::invalid("decode attention splits", format!("the direct tensor-core form takes 1..={DECODE_MAX_SPLITS} splits a token, got {layout_arg}")));
            }
            let splits = tc_direct_grid_splits(max_context, layout_arg);
            let d = shape.head_dim;
            (KernelFamily::DecodeAttention, tc_direct_kernel_name(d), shape.n_q_heads / shape.n_kv_heads, splits, TC_DIRECT_WARPS, tc_direct_smem_bytes(d), true)
        }
    };
    Ok(DecodeAttentionLaunch {
        family,
        name,
        grid: (tokens * shape.n_q_heads / g, splits),
        block: block * 32,
        smem,
        layout_arg: scaled.then_some(layout_arg),
    })
}

/// The output gate of gated attention (Qwen3.5: attention output x sigmoid(gate)) that decode
/// attention applies in its final write, bit for bit the attention followed by
/// `sigmoid_gate_mul` (common.cuh gated_out): token t's gate of q head h, element e at
/// `rows[t * stride + h * head_dim + e]`, so a row of the q projection is read in place
/// (`stride` its width, `rows` starting at the gate's column). Why fused: at batch-1 decode
/// every kernel boundary costs 2-3 us, and this one came once per attention layer.
#[derive(Clone, Copy)]
pub struct DecodeGate<'a, 'b> {
    pub rows: &'a CudaView<'b, u16>,
    pub stride: usize,
}

/// The raw address of an optional kernel input (0, the kernels' null, where absent) and the
/// guard that orders its use on the stream.
pub(super) fn optional_ptr<'a, P: DevicePtr<u16>>(p: Option<&'a P>, s: &'a CudaStream) -> (u64, Option<SyncOnDrop<'a>>) {
    match p {
        Some(p) => {
            let (ptr, sync) = p.device_ptr(s);
            (ptr, Some(sync))
        }
        None => (0, None),
    }
}

/// Fails unless `scratch` holds `decode_scratch_len(tokens, sh)` and `gate` (where given) holds
/// `tokens` rows of at least the q heads' width: the checks of every decode attention launcher.
pub(super) fn check_scratch_and_gate(tokens: usize, sh: &PagedAttentionShape, scratch: &AttnScratch, gate: Option<&DecodeGate<'_, '_>>) -> Result<()> {
    let need = decode_scratch_len(tokens, sh);
    check_len("attention scratch acc", scratch.acc.len(), need.acc)?;
    check_len("attention scratch ml", scratch.ml.len(), need.ml)?;
    check_len("attention scratch arrivals", scratch.arrivals.len(), need.arrivals)?;
    let qd = sh.n_q_heads * sh.head_dim;
    if let Some(g) = gate {
        if g.stride < qd {
            return Err(crate::NinferError::Device(format!("decode attention gate: row stride {} is shorter than a row's {} gate columns ({} q heads x {} dims)", g.stride, qd, sh.n_q_heads, sh.head_dim)));
        }
        check_len("decode attention gate", g.rows.len(), strided_len(tokens, qd, g.stride))?;
    }
    Ok(())
}

impl CudaDevice {
    /// Decode attention (one query token per sequence, or any tokens) in one kernel, in the form
    /// the plan's route picks for this launch's token count (`paged_attention_decode_as`). A
    /// decode graph's token count is fixed, so every replay of it runs the form it captured.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        gate: Option<DecodeGate<'_, '_>>,
        shape: &PagedAttentionShape,
        scratch: &AttnScratch,
    ) -> Result<()> {
        let form = self.plan().decode_attention.form(token_seq.len(), shape);
        self.paged_attention_decode_as(form, q, k_cache, v_cache, block_tables, token_seq, token_pos, out, gate, shape, scratch)
    }

    /// Decode attention in one kernel of the given form (all take the same arguments and
    /// scratch).
    ///
    /// `Scaled` (`decode_attention_*`, decode_attention.cu): a split-K layout that depends on
    /// each token's own context only: `decode_block_splits(context)` blocks of 8 warps,
    /// `decode_warp_keys(context)` keys a warp, merged in-kernel (the last block to arrive
    /// merges all, in split order). The grid is (tokens x groups,
    /// `decode_grid_splits(max_blocks_per_seq x block_size)`): block tables bound every token's
    /// context, and their width is fixed per decode graph, so a graph captured once replays any
    /// later step of its bucket.
    ///
    /// `Fixed` (`decode_attention_fixed_*`, decode_attention.cu): FIXED_BLOCK_SPLITS blocks per (token,
    /// group) whatever the context.
    ///
    /// `TensorCoreDirect` (`flash_decode_direct_*`; `tc_direct_fits` shapes on sm_80+): a block
    /// per (token, kv head, split of `tc_direct_split_keys` keys), K/V loaded straight into the
    /// mma fragments, merged in-kernel as the scaled form.
    ///
    /// In every form a row's result is the same in any batch (batch == alone, bit for bit) and
    /// in any launch. `shape.max_context` and `shape.partition` are ignored; `scratch` must hold
    /// `decode_scratch_len(tokens, shape)`, its counters zeroed. With `gate` (`DecodeGate`: tokens
    /// rows of `stride`, n_q_heads x head_dim gate columns each) every form multiplies its output
    /// by the gate's sigmoid in the final write, the bits of `sigmoid_gate_mul` after it; `None`
    /// stores the attention output alone.
    ///
    /// Under PDL the scaled form reads the metadata and each token's keys before its newest
    /// (position `token_pos`) before waiting for the kernel launched just before it, so only a
    /// token's newest key may be written by that kernel: one token per sequence, as in a decode
    /// step (the model's `is_decode`); keys written earlier in the stream are safe.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode_as(
        &self,
        form: DecodeAttentionForm,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        gate: Option<DecodeGate<'_, '_>>,
        shape: &PagedAttentionShape,
        scratch: &AttnScratch,
    ) -> Result<()> {
        let layout_arg = default_layout_arg(form, token_seq.len(), shape, self.sm_count());
        self.paged_attention_decode_layout(form, layout_arg, q, k_cache, v_cache, block_tables, token_seq, token_pos, out, gate, shape, scratch)
    }

    /// `paged_attention_decode_as` with the layout argument given: the scaled form's fewest keys
    /// a warp (DECODE_DEFAULT_LAYOUT: the context's), the direct tensor-core form's most splits a
    /// token (1..=DECODE_MAX_SPLITS; ignored by the fixed form). Every value keeps a row's result
    /// independent of the batch; values differ in the last bits.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode_layout(
        &self,
        form: DecodeAttentionForm,
        layout_arg: usize,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        gate: Option<DecodeGate<'_, '_>>,
        shape: &PagedAttentionShape,
        scratch: &AttnScratch,
    ) -> Result<()> {
        let t = token_seq.len();
        let l = decode_attention_launch(self.compute_capability(), form, layout_arg, shape, t)?;
        self.check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape)?;
        let sh = shape;
        check_scratch_and_gate(t, sh, scratch, gate.as_ref())?;
        let s = self.stream();
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k_cache.device_ptr(s);
        let (vp, _c) = v_cache.device_ptr(s);
        let (bp, _d) = block_tables.device_ptr(s);
        let (sp, _e) = token_seq.device_ptr(s);
        let (pp, _f) = token_pos.device_ptr(s);
        let (op, _g) = out.device_ptr_mut(s);
        let (pa, _h) = scratch.acc.device_ptr(s);
        let (pm, _i) = scratch.ml.device_ptr(s);
        let (ar, _j) = scratch.arrivals.device_ptr(s);
        // No gate: a null pointer (the kernels store the attention output as before).
        let (gp, _k) = optional_ptr(gate.as_ref().map(|g| g.rows), s);
        let gate_stride = gate.as_ref().map_or(0, |g| g.stride) as i64;
        let ptrs = DecodePtrs { q: qp, k_cache: kp, v_cache: vp, tables: bp, token_seq: sp, token_pos: pp, out: op, acc: pa, ml: pm, arrivals: ar, gate: gp, gate_stride };
        let mut args = ptrs.args(sh)?;
        args.extend(l.layout_arg.map(|a| KArg::I32(a as i32)));
        self.launch_decode(&l, l.name, &args)
    }

    /// Launches decode attention launch `l` as kernel `name` with `args`.
    pub(super) fn launch_decode(&self, l: &DecodeAttentionLaunch, name: &'static str, args: &[KArg]) -> Result<()> {
        let f = self.function_with_smem(l.family, name, l.smem)?;
        let grid = (as_i32("decode attention blocks", l.grid.0)? as u32, l.grid.1 as u32, 1);
        let mut config = cfg(grid, l.block as u32);
        config.shared_mem_bytes = l.smem as u32;
        self.launch_pdl(&f, config, name, args)
    }
}

/// Raw addresses of one decode attention launch (0 for no gate), and the gate's row stride.
pub(super) struct DecodePtrs {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub tables: u64,
    pub token_seq: u64,
    pub token_pos: u64,
    pub out: u64,
    pub acc: u64,
    pub ml: u64,
    pub arrivals: u64,
    pub gate: u64,
    pub gate_stride: i64,
}

impl DecodePtrs {
    /// The parameters every decode attention kernel takes first, in order (decode_attention.cu);
    /// the scaled and direct forms take their layout argument after them.
    pub(super) fn args(&self, sh: &PagedAttentionShape) -> Result<Vec<KArg>> {
        Ok(kargs![
            self.q,
            self.k_cache,
            self.v_cache,
            self.tables,
            as_i32("max_blocks_per_seq", sh.max_blocks_per_seq)?,
            self.token_seq,
            self.token_pos,
            as_i32("n_q_heads", sh.n_q_heads)?,
            as_i32("n_kv_heads", sh.n_kv_heads)?,
            sh.q_stride as i64,
            as_i32("block_size", sh.block_size)?,
            sh.scale,
            self.out,
            self.acc,
            self.ml,
            self.arrivals,
            self.gate,
            self.gate_stride,
        ]
        .to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fewest_keys_a_warp_bounds_the_grid() {
        // 256 keys: 8 splits of 4-key warps, 2 of 16, 1 of 32; the cap of 32 splits holds.
        assert_eq!([4, 16, 32].map(|m| decode_block_splits_with(256, m)), [8, 2, 1]);
        for min in [DECODE_DEFAULT_LAYOUT, 1, 4, 16, 32, 256] {
            for max in [1, 63, 64, 65, 300, 512, 513, 700, 1100, 2048, 2049, 5000] {
                let grid = decode_grid_splits_with(max, min);
                assert!(grid <= DECODE_MAX_SPLITS);
                for ctx in 1..=max {
                    assert!(decode_block_splits_with(ctx, min) <= grid, "context {ctx} under a grid for {max}, min {min}");
                }
                // Tight: some context up to `max` takes the whole grid.
                assert!((1..=max).any(|ctx| decode_block_splits_with(ctx, min) == grid), "grid for {max}, min {min}");
            }
        }
    }

    #[test]
    fn small_batches_and_batch_invariant_runs_take_the_scaled_form() {
        use DecodeAttentionForm::{Fixed, Scaled, TensorCoreDirect};
        let (fits, d96) = (shape(32, 8, 128), shape(32, 8, 96));
        for (tokens, invariant, form) in [(1, false, Scaled), (2, false, Scaled), (3, false, Fixed), (8, false, Fixed), (64, false, Fixed), (1, true, Scaled), (8, true, Scaled), (64, true, Scaled)] {
            let cuda_cores = DecodeAttentionRoute { tensor_cores: false, batch_invariant: invariant };
            assert_eq!(cuda_cores.form(tokens, &fits), form, "{tokens} tokens, invariant {invariant}");
            // The direct form takes every launch where it fits, never a batch-invariant one.
            let tc = DecodeAttentionRoute { tensor_cores: true, batch_invariant: invariant };
            assert_eq!(tc.form(tokens, &fits), if invariant { Scaled } else { TensorCoreDirect }, "{tokens} tokens, invariant {invariant}, direct");
            assert_eq!(tc.form(tokens, &d96), form, "head size 96 has no direct form");
        }
    }
    #[test]
    fn the_direct_form_aims_at_two_blocks_an_sm_and_its_grid_covers_every_context() {
        // H200 (132 SMs), Llama-3-8B's 8 kv heads: batch 1 32 splits (the cap), 2 16, 4 8, 8 4,
        // 16 2, 32 and more 1; the batch-4 / 1k-key case takes 128-key splits (2 tiles a warp),
        // batch 8 256.
        assert_eq!([1, 2, 4, 8, 16, 32, 33, 64].map(|t| tc_direct_splits(t, 8, 132)), [32, 16, 8, 4, 2, 1, 1, 1]);
        // By graph bucket: an eager step of 3 or 5 sequences takes the splits of its graph's 4 / 8.
        assert_eq!((tc_direct_splits(3, 8, 132), tc_direct_splits(5, 8, 132)), (8, 4));
        assert_eq!(tc_direct_split_keys(1024, tc_direct_splits(4, 8, 132)), 128);
        assert_eq!(tc_direct_split_keys(1024, tc_direct_splits(8, 8, 132)), 256);
        assert_eq!(tc_direct_split_keys(1, 32), 64);
        // Never more blocks than one wave (but for the floor of one split a token).
        for sms in [46, 108, 132] {
            for t in 1..=64 {
                let rows = crate::model::cuda::graphs::decode_bucket(t);
                let splits = tc_direct_splits(t, 8, sms);
                assert!(splits == 1 || rows * 8 * splits <= TC_DIRECT_BLOCKS_PER_SM * sms, "{sms} SMs, {t} tokens");
            }
        }
        for d in [64, 128, 256] {
            assert!(tc_direct_smem_bytes(d) <= 48 * 1024, "d{d}: within the default limit: no opt-in, a small carveout");
        }
        for splits in [1, 3, 9, 17, DECODE_MAX_SPLITS] {
            for max in [1, 63, 64, 65, 1000, 2048, 2049, 40000] {
                let grid = tc_direct_grid_splits(max, splits);
                assert!((1..=splits).contains(&grid));
                for ctx in 1..=max {
                    let split = tc_direct_split_keys(ctx, splits);
                    assert_eq!(split % (TC_DIRECT_WARPS * TC_TILE_KEYS), 0);
                    assert!(ctx.div_ceil(split) <= grid, "splits {splits}: context {ctx} under a grid for {max}");
                }
                assert!((1..=max).any(|ctx| ctx.div_ceil(tc_direct_split_keys(ctx, splits)) == grid), "tight: splits {splits}, max {max}");
            }
        }
    }

    fn shape(n_q_heads: usize, n_kv_heads: usize, head_dim: usize) -> PagedAttentionShape {
        PagedAttentionShape {
            n_q_heads,
            n_kv_heads,
            head_dim,
            q_stride: n_q_heads * head_dim,
            block_size: 16,
            num_blocks: 1,
            max_blocks_per_seq: 1,
            scale: 1.0,
            max_context: 0,
            partition: 0,
        }
    }

    #[test]
    fn kernel_names_follow_the_instances_of_decode_attention_cu() {
        let src = include_str!("../../../../../cuda/decode_attention.cu");
        assert!(src.contains("decode_attention_d##D##_g##G("));
        for d in [64, 96, 128, 256] {
            assert!(src.contains(&format!("\nDA_HEAD_INSTANCES({d})")), "DA_HEAD_INSTANCES({d})");
            for g in [1, 2, 4, 8] {
                assert!(src.contains(&format!("DA_INSTANCE(D, {g})")), "G = {g}");
                assert_eq!(decode_kernel_name(d, g), format!("decode_attention_d{d}_g{g}"));
            }
        }
        // The constants this file mirrors.
        for (name, value) in [
            ("DA_WARPS", DECODE_WARPS),
            ("DA_MAX_SPLITS", DECODE_MAX_SPLITS),
            ("DA_MIN_WARP_KEYS", DECODE_MIN_WARP_KEYS),
            ("DA_SHORT_WARP_KEYS", DECODE_SHORT_WARP_KEYS),
            ("DA_SHORT_CONTEXT", DECODE_SHORT_CONTEXT),
        ] {
            assert!(src.contains(&format!("#define {name} {value}\n")), "{name} {value}");
        }
        // The direct tensor-core form's instances and block size.
        let fa = src;
        assert!(fa.contains(&format!("#define FDD_WARPS {TC_DIRECT_WARPS}\n")));
        assert!(fa.contains(&format!("#define FD_BN {TC_TILE_KEYS}\n")));
        for d in [64, 128, 256] {
            assert!(fa.contains(&format!("\nFDD_INSTANCE({d})")), "FDD_INSTANCE({d})");
            assert_eq!(tc_direct_kernel_name(d), format!("flash_decode_direct_d{d}"));
        }
    }

    /// The layout's edges: one block up to 32 keys, splits of 4-key warps up to 512 keys, of 8-key
    /// warps up to 2048, then 32 splits of longer warps; the grid bound covers every context below it.
    #[test]
    fn splits_grow_with_the_context_up_to_the_cap() {
        let cases = [(1, 4, 1), (32, 4, 1), (33, 4, 2), (256, 4, 8), (512, 4, 16), (513, 8, 9), (1024, 8, 16), (2048, 8, 32), (2049, 9, 29), (4096, 16, 32), (16384, 64, 32)];
        for (ctx, keys, splits) in cases {
            assert_eq!((decode_warp_keys(ctx), decode_block_splits(ctx)), (keys, splits), "context {ctx}");
        }
        for max in [1, 63, 64, 65, 300, 512, 513, 600, 2048, 2049, 2100, 5000] {
            let grid = decode_grid_splits(max);
            assert!(grid <= DECODE_MAX_SPLITS);
            for ctx in 1..=max {
                assert!(decode_block_splits(ctx) <= grid, "context {ctx} under a grid for {max}");
            }
        }
        assert_eq!(decode_grid_splits(16 * 16), 8);
        assert_eq!(decode_grid_splits(600), 16);
        assert_eq!(decode_grid_splits(16 * 256), 32);
    }

    /// One counter per row covers every group a block serves; partials for DECODE_MAX_SPLITS
    /// splits (the fixed form's FIXED_BLOCK_SPLITS fit in them).
    #[test]
    fn decode_scratch_has_a_partial_per_split_and_a_counter_per_row() {
        let len = decode_scratch_len(3, &shape(32, 8, 128));
        assert_eq!(len, DecodeScratchLen { acc: 3 * 32 * 32 * 128, ml: 3 * 32 * 32 * 2, arrivals: 3 * 32 });
        const { assert!(FIXED_BLOCK_SPLITS <= DECODE_MAX_SPLITS) };
        // Llama-3-8B groups of 4; Qwen3.5-27B groups of 6 take 2 heads a block; MHA 1; 16 -> 8.
        assert_eq!(decode_group(&shape(32, 8, 128)), 4);
        assert_eq!(decode_group(&shape(24, 4, 256)), 2);
        assert_eq!(decode_group(&shape(8, 8, 64)), 1);
        assert_eq!(decode_group(&shape(9, 3, 64)), 1);
        assert_eq!(decode_group(&shape(32, 2, 64)), 8);
    }
}
