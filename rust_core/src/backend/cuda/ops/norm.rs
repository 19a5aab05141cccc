//! RMSNorm launchers (cuda/norm.cu).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, strided_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Block size of rmsnorm_gated (a grid-stride loop per row).
const NORM_THREADS: u32 = 256;

/// Block size of rmsnorm / add_rmsnorm for rows of `dim`: one thread per 8-element chunk
/// (norm.cu), rounded up to a warp, at most 1024, so that one pass covers rows up to 8192.
/// It depends on `dim` only: the kernels' f32 sum order follows the block size, and a row's
/// result must not depend on how many rows the launch has (nor on rmsnorm vs rmsnorm_heads).
pub(super) fn chunked_norm_threads(dim: usize) -> u32 {
    dim.div_ceil(8).next_multiple_of(32).clamp(32, 1024) as u32
}

impl CudaDevice {
    /// Per-head RMSNorm in one launch: row r holds `heads` heads of `dim` elements starting at
    /// element r * x_stride of x (contiguous heads), written to r * out_stride + h * dim of
    /// out. Each head is normalised exactly as `rmsnorm` normalises a row.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_heads(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<u16>,
        rows: usize,
        heads: usize,
        dim: usize,
        x_stride: usize,
        out_stride: usize,
        eps: f32,
        plus_one: bool,
    ) -> Result<()> {
        check_len("rmsnorm_heads x", x.len(), strided_len(rows, heads * dim, x_stride))?;
        check_len("rmsnorm_heads w", w.len(), dim)?;
        check_len("rmsnorm_heads out", out.len(), strided_len(rows, heads * dim, out_stride))?;
        let f = self.function(KernelFamily::Norm, "rmsnorm")?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        let args = [
            KArg::Ptr(xp),
            KArg::Ptr(wp),
            KArg::Ptr(op),
            KArg::I32(as_i32("dim", dim)?),
            KArg::I64(x_stride as i64),
            KArg::I64(out_stride as i64),
            KArg::F32(eps),
            KArg::I32(plus_one as i32),
        ];
        let grid = (as_i32("rows", rows)? as u32, as_i32("heads", heads)? as u32, 1);
        self.launch_pdl(&f, cfg(grid, chunked_norm_threads(dim)), "rmsnorm", &args)
    }

    /// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w (or * (1 + w) when `plus_one`), for
    /// `rows` rows of `dim`; x rows are `x_stride` apart and out rows `out_stride` apart, so a
    /// per-head norm can read q/k inside a fused projection.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<u16>,
        rows: usize,
        dim: usize,
        x_stride: usize,
        out_stride: usize,
        eps: f32,
        plus_one: bool,
    ) -> Result<()> {
        self.rmsnorm_heads(x, w, out, rows, 1, dim, x_stride, out_stride, eps, plus_one)
    }

    /// residual += x (rounded to storage), then out = rmsnorm(residual): the fused pre-norm of
    /// every layer after the first. All buffers are contiguous [rows, dim].
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        residual: &mut impl DevicePtrMut<u16>,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<u16>,
        rows: usize,
        dim: usize,
        eps: f32,
        plus_one: bool,
    ) -> Result<()> {
        check_len("add_rmsnorm residual", residual.len(), rows * dim)?;
        check_len("add_rmsnorm x", x.len(), rows * dim)?;
        check_len("add_rmsnorm w", w.len(), dim)?;
        check_len("add_rmsnorm out", out.len(), rows * dim)?;
        let f = self.function(KernelFamily::Norm, "add_rmsnorm")?;
        let s = self.stream();
        let (rp, _r) = residual.device_ptr_mut(s);
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        let args = [
            KArg::Ptr(rp),
            KArg::Ptr(xp),
            KArg::Ptr(wp),
            KArg::Ptr(op),
            KArg::I32(as_i32("dim", dim)?),
            KArg::F32(eps),
            KArg::I32(plus_one as i32),
        ];
        let grid = (as_i32("rows", rows)? as u32, 1, 1);
        self.launch_pdl(&f, cfg(grid, chunked_norm_threads(dim)), "add_rmsnorm", &args)
    }

    /// Gated DeltaNet output norm: out = rmsnorm(x) * w * silu(z), rows of `dim` (one head),
    /// `tokens * heads` rows. x and out are contiguous; token t's z is `heads * dim` values at
    /// t * z_stride (a column range of the fused input projection's rows).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_gated(
        &self,
        x: &impl DevicePtr<u16>,
        z: &impl DevicePtr<u16>,
        z_stride: usize,
        w: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<u16>,
        tokens: usize,
        heads: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let rows = tokens * heads;
        if z_stride < heads * dim {
            return Err(NinferError::Device(format!("rmsnorm_gated: z row stride {z_stride} below {heads} heads x {dim}")));
        }
        check_len("rmsnorm_gated x", x.len(), rows * dim)?;
        check_len("rmsnorm_gated z", z.len(), strided_len(tokens, heads * dim, z_stride))?;
        check_len("rmsnorm_gated w", w.len(), dim)?;
        check_len("rmsnorm_gated out", out.len(), rows * dim)?;
        // A warp per row where the row is whole warps of at most 8 (`rmsnorm_gated_rows_p*`, one
        // entry per warp count, the same bits), else a block per row.
        const ROWS_KERNELS: [&str; 8] = [
            "rmsnorm_gated_rows_p1",
            "rmsnorm_gated_rows_p2",
            "rmsnorm_gated_rows_p3",
            "rmsnorm_gated_rows_p4",
            "rmsnorm_gated_rows_p5",
            "rmsnorm_gated_rows_p6",
            "rmsnorm_gated_rows_p7",
            "rmsnorm_gated_rows_p8",
        ];
        let by_warps = dim.is_multiple_of(32) && (32..=256).contains(&dim);
        let name = if by_warps { ROWS_KERNELS[dim / 32 - 1] } else { "rmsnorm_gated" };
        let f = self.function(KernelFamily::Norm, name)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (zp, _z) = z.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        if rows == 0 {
            return Ok(());
        }
        let mut args = vec![
            KArg::Ptr(xp),
            KArg::Ptr(zp),
            KArg::I32(as_i32("heads", heads.max(1))?),
            KArg::I64(z_stride as i64),
            KArg::Ptr(wp),
            KArg::Ptr(op),
        ];
        if by_warps {
            // The part count is in the kernel's name; rows are counted in 64 bits.
            args.extend([KArg::F32(eps), KArg::I64(rows as i64)]);
            // 8 warps a block, each on two rows at a time, grid-stride over one full wave.
            let per_sm = self.resident_blocks(&f, name, 256)?;
            let blocks = rows.div_ceil(16).min(self.sm_count() * per_sm);
            return self.launch_pdl(&f, cfg((blocks as u32, 1, 1), 256), name, &args);
        }
        args.extend([KArg::I32(as_i32("dim", dim)?), KArg::F32(eps)]);
        let grid = (as_i32("rows", rows)? as u32, 1, 1);
        self.launch_pdl(&f, cfg(grid, NORM_THREADS), name, &args)
    }
}
