//! Prefill attention launcher (cuda/flash_attention.cu): causal flash attention on tensor
//! cores over the paged KV cache, for steps whose sequences bring chunks of query rows.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::attention::PagedAttentionShape;
use super::{as_i32, check_len, KArg};
use crate::backend::cuda::device::{driver_err, CudaDevice};
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Query rows per block (FA_BM in flash_attention.cu: 16 rows per warp, 4 warps).
const FA_BM: usize = 64;
/// Threads per block.
const FA_THREADS: u32 = 128;
/// Shared-memory row padding in elements (FA_PAD).
const FA_PAD: usize = 8;

/// (kernel name, keys per tile) for a head size; the tile matches FA_INSTANCE in the .cu.
fn kernel(d: usize) -> Result<(&'static str, usize)> {
    Ok(match d {
        64 => ("flash_attention_d64", 64),
        96 => ("flash_attention_d96", 64),
        128 => ("flash_attention_d128", 64),
        256 => ("flash_attention_d256", 32),
        _ => return Err(NinferError::Unsupported(format!("CUDA flash attention with head_dim {d}"))),
    })
}

impl CudaDevice {
    /// Whether this device runs `flash_attention` on tensor cores (sm_80+); below that the
    /// launcher computes the same result with the scalar `paged_attention` kernel.
    pub fn has_flash_attention(&self) -> bool {
        self.compute_capability().0 >= 8
    }

    /// Causal attention of packed query rows over the paged cache: rows
    /// cu_seqlens[s]..cu_seqlens[s+1] are sequence s (token_seq[r] = s), row r at position
    /// token_pos[r] sees keys 0..=token_pos[r]; positions are consecutive within a sequence
    /// (a chunk after any cached prefix; 1-row decode sequences are fine). `max_rows` is the
    /// largest row count of a sequence. out is [rows, n_q_heads * head_dim].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        cu_seqlens: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &PagedAttentionShape,
        max_rows: usize,
    ) -> Result<()> {
        if !self.has_flash_attention() {
            return self.paged_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape);
        }
        self.check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape)?;
        let sh = shape;
        let d = sh.head_dim;
        let (name, bn) = kernel(d)?;
        let n_seqs = cu_seqlens.len().saturating_sub(1);
        if !sh.q_stride.is_multiple_of(8) {
            return Err(NinferError::Device(format!(
                "flash attention: q stride {} is not a multiple of 8 elements (16-byte rows)",
                sh.q_stride
            )));
        }
        if n_seqs == 0 || max_rows == 0 {
            return Ok(());
        }
        check_len("flash attention block_tables", block_tables.len(), n_seqs * sh.max_blocks_per_seq)?;
        let smem = (FA_BM + 2 * bn) * (d + FA_PAD) * 2;
        let f = self.function(KernelFamily::FlashAttention, name)?;
        f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(driver_err("raising the flash attention shared-memory limit"))?;
        let s = self.stream();
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k_cache.device_ptr(s);
        let (vp, _c) = v_cache.device_ptr(s);
        let (bp, _d) = block_tables.device_ptr(s);
        let (cp, _e) = cu_seqlens.device_ptr(s);
        let (pp, _f) = token_pos.device_ptr(s);
        let (op, _g) = out.device_ptr_mut(s);
        let args = [
            KArg::Ptr(qp),
            KArg::I64(sh.q_stride as i64),
            KArg::Ptr(kp),
            KArg::Ptr(vp),
            KArg::Ptr(bp),
            KArg::I32(as_i32("max_blocks_per_seq", sh.max_blocks_per_seq)?),
            KArg::Ptr(cp),
            KArg::Ptr(pp),
            KArg::I32(as_i32("n_q_heads", sh.n_q_heads)?),
            KArg::I32(as_i32("n_kv_heads", sh.n_kv_heads)?),
            KArg::I32(as_i32("block_size", sh.block_size)?),
            KArg::F32(sh.scale * std::f32::consts::LOG2_E),
            KArg::Ptr(op),
        ];
        let grid = (
            as_i32("flash attention row tiles", max_rows.div_ceil(FA_BM))? as u32,
            as_i32("n_q_heads", sh.n_q_heads)? as u32,
            as_i32("n_seqs", n_seqs)? as u32,
        );
        let config = LaunchConfig { grid_dim: grid, block_dim: (FA_THREADS, 1, 1), shared_mem_bytes: smem as u32 };
        self.launch(&f, config, name, &args)
    }
}
