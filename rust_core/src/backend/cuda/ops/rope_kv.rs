//! Launchers of `rope_kv_write` (cuda/rope.cu): a decode step's RoPE and KV cache write in one
//! kernel, for q, k and v in separate buffers (models with q/k norm) or packed in the rows of
//! the fused qkv projection; and of `rope_kv_write_normed`, the per-head q/k RMSNorm before them
//! in the same kernel.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::norm::chunked_norm_threads;
use super::{as_i32, cfg, check_len, strided_len};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Heads and row strides of one `rope_kv_write` launch. Token t's q heads start at
/// `t * q_stride` of the q buffer, its k heads at `t * k_stride`, its v heads at `t * v_stride`
/// (element offsets from where each buffer, or each part of a packed buffer, begins).
#[derive(Debug, Clone, Copy)]
pub struct RopeKvShape {
    /// Query heads (rotated in place).
    pub n_q_heads: usize,
    /// KV heads (k rotated in place; k and v written to the cache).
    pub n_kv_heads: usize,
    /// Elements per head; the first `inv_freq.len() * 2` of them rotate.
    pub head_dim: usize,
    pub q_stride: usize,
    pub k_stride: usize,
    pub v_stride: usize,
    /// Multiplies cos and sin (1 unless the rope scaling says otherwise).
    pub attn_scale: f32,
}

/// Fails unless the k and v caches (`k_len`, `v_len` elements) are alike and hold whole rows of
/// `n_kv_heads * head_dim` (slots x heads x head_dim): the check of every launcher that writes
/// a decode step's keys and values (`op` names it in the error).
pub(super) fn check_kv_caches(op: &str, k_len: usize, v_len: usize, sh: &RopeKvShape) -> Result<()> {
    let row = sh.n_kv_heads * sh.head_dim;
    if k_len != v_len || !k_len.is_multiple_of(row.max(1)) {
        return Err(NinferError::Device(format!("{op}: caches of {k_len} and {v_len} elements do not hold rows of {row}")));
    }
    Ok(())
}

/// Raw device addresses of one launch's buffers.
struct RopeKvPtrs {
    q: u64,
    k: u64,
    v: u64,
    k_cache: u64,
    v_cache: u64,
    positions: u64,
    slots: u64,
    inv_freq: u64,
}

impl CudaDevice {
    /// RoPE of q [T, q_stride] and k [T, k_stride] in place, as `rope_neox` does, and the rotated
    /// k rows with the v rows [T, v_stride] written into the paged cache at `slot_mapping[t]`
    /// (skipped where negative), as `kv_cache_write` does: bit for bit those two kernels, in one
    /// launch. T = `positions.len()`; the caches are [slots, n_kv_heads * head_dim].
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_write(
        &self,
        q: &mut impl DevicePtrMut<u16>,
        k: &mut impl DevicePtrMut<u16>,
        v: &impl DevicePtr<u16>,
        k_cache: &mut impl DevicePtrMut<u16>,
        v_cache: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        slot_mapping: &impl DevicePtr<i64>,
        inv_freq: &impl DevicePtr<f32>,
        shape: &RopeKvShape,
    ) -> Result<()> {
        let (t, sh) = (positions.len(), shape);
        check_len("rope_kv_write q", q.len(), strided_len(t, sh.n_q_heads * sh.head_dim, sh.q_stride))?;
        check_len("rope_kv_write k", k.len(), strided_len(t, sh.n_kv_heads * sh.head_dim, sh.k_stride))?;
        check_len("rope_kv_write v", v.len(), strided_len(t, sh.n_kv_heads * sh.head_dim, sh.v_stride))?;
        let s = self.stream();
        let (qp, _a) = q.device_ptr_mut(s);
        let (kp, _b) = k.device_ptr_mut(s);
        let (vp, _c) = v.device_ptr(s);
        self.rope_kv_caches(qp, kp, vp, k_cache, v_cache, positions, slot_mapping, inv_freq, sh)
    }

    /// As `rope_kv_write` with q, k and v packed in one buffer (the fused qkv projection): token
    /// t's q heads at `t * q_stride`, k heads at `k_off + t * k_stride`, v heads at
    /// `v_off + t * v_stride`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_write_packed(
        &self,
        qkv: &mut impl DevicePtrMut<u16>,
        k_off: usize,
        v_off: usize,
        k_cache: &mut impl DevicePtrMut<u16>,
        v_cache: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        slot_mapping: &impl DevicePtr<i64>,
        inv_freq: &impl DevicePtr<f32>,
        shape: &RopeKvShape,
    ) -> Result<()> {
        let (t, sh) = (positions.len(), shape);
        let kv_row = sh.n_kv_heads * sh.head_dim;
        check_len("rope_kv_write q", qkv.len(), strided_len(t, sh.n_q_heads * sh.head_dim, sh.q_stride))?;
        check_len("rope_kv_write k", qkv.len(), k_off + strided_len(t, kv_row, sh.k_stride))?;
        check_len("rope_kv_write v", qkv.len(), v_off + strided_len(t, kv_row, sh.v_stride))?;
        let s = self.stream();
        let (p, _a) = qkv.device_ptr_mut(s);
        self.rope_kv_caches(p, p + 2 * k_off as u64, p + 2 * v_off as u64, k_cache, v_cache, positions, slot_mapping, inv_freq, sh)
    }

    /// Per-head RMSNorm of the q and k heads packed in the qkv projection rows, then
    /// `rope_kv_write` of the normed heads: bit for bit `rmsnorm_heads` of the q heads into
    /// `q_out` [T, n_q_heads * head_dim] and of the k heads into `k_out` [T, n_kv_heads *
    /// head_dim] (weights `q_norm` / `k_norm` of head_dim, `eps`, `plus_one`), then
    /// `rope_kv_write(q_out, k_out, v, ...)`. One kernel where those three ran per attention
    /// layer of a q/k-norm model's batch-1 decode, each boundary ~2-3 us. The qkv rows are laid
    /// out as `rope_kv_write_packed` reads them: token t's q heads at `t * q_stride`, k heads at
    /// `k_off + t * k_stride`, v heads at `v_off + t * v_stride`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_write_normed(
        &self,
        qkv: &impl DevicePtr<u16>,
        k_off: usize,
        v_off: usize,
        q_norm: &impl DevicePtr<u16>,
        k_norm: &impl DevicePtr<u16>,
        eps: f32,
        plus_one: bool,
        q_out: &mut impl DevicePtrMut<u16>,
        k_out: &mut impl DevicePtrMut<u16>,
        k_cache: &mut impl DevicePtrMut<u16>,
        v_cache: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        slot_mapping: &impl DevicePtr<i64>,
        inv_freq: &impl DevicePtr<f32>,
        shape: &RopeKvShape,
    ) -> Result<()> {
        const OP: &str = "rope_kv_write_normed";
        let (t, sh) = (positions.len(), shape);
        let (qd, kvd) = (sh.n_q_heads * sh.head_dim, sh.n_kv_heads * sh.head_dim);
        check_len("rope_kv_write_normed q", qkv.len(), strided_len(t, qd, sh.q_stride))?;
        check_len("rope_kv_write_normed k", qkv.len(), k_off + strided_len(t, kvd, sh.k_stride))?;
        check_len("rope_kv_write_normed v", qkv.len(), v_off + strided_len(t, kvd, sh.v_stride))?;
        check_len("rope_kv_write_normed q_norm", q_norm.len(), sh.head_dim)?;
        check_len("rope_kv_write_normed k_norm", k_norm.len(), sh.head_dim)?;
        check_len("rope_kv_write_normed q_out", q_out.len(), t * qd)?;
        check_len("rope_kv_write_normed k_out", k_out.len(), t * kvd)?;
        check_kv_caches(OP, k_cache.len(), v_cache.len(), sh)?;
        check_len("rope_kv_write_normed slot_mapping", slot_mapping.len(), t)?;
        let rotary_dim = inv_freq.len() * 2;
        if rotary_dim > sh.head_dim {
            return Err(NinferError::Device(format!("{OP}: rotary_dim {rotary_dim} exceeds head_dim {}", sh.head_dim)));
        }
        let heads = sh.n_q_heads + sh.n_kv_heads;
        if heads > 65_535 {
            return Err(NinferError::Device(format!("{OP}: {heads} heads exceed the grid height 65535")));
        }
        let f = self.function(KernelFamily::Rope, OP)?;
        let s = self.stream();
        let (p, _a) = qkv.device_ptr(s);
        let (qw, _b) = q_norm.device_ptr(s);
        let (kw, _c) = k_norm.device_ptr(s);
        let (qo, _d) = q_out.device_ptr_mut(s);
        let (ko, _e) = k_out.device_ptr_mut(s);
        let (kc, _f) = k_cache.device_ptr_mut(s);
        let (vc, _g) = v_cache.device_ptr_mut(s);
        let (pp, _h) = positions.device_ptr(s);
        let (sp, _i) = slot_mapping.device_ptr(s);
        let (fp, _j) = inv_freq.device_ptr(s);
        let args = kargs![
            p,
            p + 2 * k_off as u64,
            p + 2 * v_off as u64,
            qw,
            kw,
            qo,
            ko,
            kc,
            vc,
            pp,
            sp,
            fp,
            as_i32("n_q_heads", sh.n_q_heads)?,
            as_i32("n_kv_heads", sh.n_kv_heads)?,
            as_i32("head_dim", sh.head_dim)?,
            as_i32("rotary_dim", rotary_dim)?,
            sh.q_stride as i64,
            sh.k_stride as i64,
            sh.v_stride as i64,
            eps,
            plus_one as i32,
            sh.attn_scale,
        ];
        // A block per (token, head), q heads then k heads (grid y), of the block size
        // rmsnorm_heads launches for head_dim (its sum of squares' order); the normed head waits
        // in shared memory, a 16-byte chunk per 8 elements, for the rotation.
        let mut config = cfg((as_i32("tokens", t)? as u32, heads as u32, 1), chunked_norm_threads(sh.head_dim));
        config.shared_mem_bytes = (sh.head_dim.div_ceil(8) * 16) as u32;
        self.launch_pdl(&f, config, OP, &args)
    }

    /// Checks the caches and the per-token inputs, then launches.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_caches(
        &self,
        q: u64,
        k: u64,
        v: u64,
        k_cache: &mut impl DevicePtrMut<u16>,
        v_cache: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        slot_mapping: &impl DevicePtr<i64>,
        inv_freq: &impl DevicePtr<f32>,
        sh: &RopeKvShape,
    ) -> Result<()> {
        let t = positions.len();
        check_kv_caches("rope_kv_write", k_cache.len(), v_cache.len(), sh)?;
        check_len("rope_kv_write slot_mapping", slot_mapping.len(), t)?;
        let s = self.stream();
        let (kc, _a) = k_cache.device_ptr_mut(s);
        let (vc, _b) = v_cache.device_ptr_mut(s);
        let (pp, _c) = positions.device_ptr(s);
        let (sp, _d) = slot_mapping.device_ptr(s);
        let (fp, _e) = inv_freq.device_ptr(s);
        let ptrs = RopeKvPtrs { q, k, v, k_cache: kc, v_cache: vc, positions: pp, slots: sp, inv_freq: fp };
        self.rope_kv_launch(&ptrs, t, inv_freq.len() * 2, sh)
    }

    fn rope_kv_launch(&self, p: &RopeKvPtrs, t: usize, rotary_dim: usize, sh: &RopeKvShape) -> Result<()> {
        if rotary_dim > sh.head_dim {
            return Err(NinferError::Device(format!("rope_kv_write: rotary_dim {rotary_dim} exceeds head_dim {}", sh.head_dim)));
        }
        let heads = sh.n_q_heads + sh.n_kv_heads;
        if heads > 65_535 {
            return Err(NinferError::Device(format!("rope_kv_write: {heads} heads exceed the grid height 65535")));
        }
        let f = self.function(KernelFamily::Rope, "rope_kv_write")?;
        let args = kargs![
            p.q,
            p.k,
            p.v,
            p.k_cache,
            p.v_cache,
            p.positions,
            p.slots,
            p.inv_freq,
            as_i32("n_q_heads", sh.n_q_heads)?,
            as_i32("n_kv_heads", sh.n_kv_heads)?,
            as_i32("head_dim", sh.head_dim)?,
            as_i32("rotary_dim", rotary_dim)?,
            sh.q_stride as i64,
            sh.k_stride as i64,
            sh.v_stride as i64,
            sh.attn_scale,
        ];
        // A block per (token, head), q heads then k heads (grid y); a thread per rotated pair,
        // as rope_neox, and the k blocks' cache copies loop over the head with the same threads.
        let threads = (rotary_dim / 2).next_multiple_of(32).clamp(32, 256) as u32;
        let grid = (as_i32("tokens", t)? as u32, heads as u32, 1);
        self.launch_pdl(&f, cfg(grid, threads), "rope_kv_write", &args)
    }
}
