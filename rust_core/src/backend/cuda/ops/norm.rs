//! RMSNorm launchers (cuda/norm.cu).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, strided_len};
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

/// Rows from which `add_rmsnorm` runs a warp per row (`add_rmsnorm_rows_g*`, norm.cu) where it
/// can: a prefill's rows (8k rows of 5120 on the H200: 151.5 -> 91.8 us, 1.86x -> 1.13x a copy
/// of its bytes; 4096: 86.9 -> 74.5 us). Fewer rows (decode
/// batches) keep a block per row, whose 640 threads load a row at once where one warp would
/// load it 40 chunks a lane. Both give the same bits, so the split is speed only.
const ADD_NORM_ROWS_MIN: usize = 128;
/// Warps (rows) per block of `add_rmsnorm_rows_g*`.
const ADD_NORM_ROWS_WARPS: usize = 4;

/// The warp-per-row kernel of `add_rmsnorm` for `rows` rows of `dim` (`aligned`: every pointer
/// on a 16-byte boundary), or None for the block-per-row kernel: the one place that decides.
/// Instanced for dim = 256 G at the hidden sizes it serves (G = 32 spills registers).
pub(super) fn add_norm_rows_kernel(rows: usize, dim: usize, aligned: bool) -> Option<&'static str> {
    if rows < ADD_NORM_ROWS_MIN || !aligned {
        return None;
    }
    match dim {
        2048 => Some("add_rmsnorm_rows_g8"),
        3072 => Some("add_rmsnorm_rows_g12"),
        4096 => Some("add_rmsnorm_rows_g16"),
        5120 => Some("add_rmsnorm_rows_g20"),
        _ => None,
    }
}

/// How `rmsnorm_gated` runs rows of one shape (`gated_norm_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GatedNormRoute {
    /// `rmsnorm_gated`: a block per row.
    BlockPerRow,
    /// A `rmsnorm_gated_rows_*` kernel: each warp takes `rows_per_warp` rows at a time,
    /// grid-stride.
    Warps { name: &'static str, rows_per_warp: usize },
}

/// The route of `rmsnorm_gated` for rows of `dim` whose z rows are `z_stride` apart, `aligned`
/// when x, z, w and out all start on 16-byte boundaries: the one place that decides it. Rows of
/// whole warps up to 8 (every GDN head size) take a warp per row (`rmsnorm_gated_rows_p*`, the
/// part count in the name, two rows a warp at a time); of those, dims 32, 64, 128 and 256 take
/// the 16-byte form (`rmsnorm_gated_rows_v8_p*`, 2 loads of 256 / dim rows a warp at a time)
/// where every row of x, z and out and every 8-element chunk of a row starts on a 16-byte
/// boundary (aligned bases, z_stride a multiple of 8; dim is one). All give the bits of the
/// block-per-row `rmsnorm_gated`, which takes every other dim.
fn gated_norm_route(dim: usize, z_stride: usize, aligned: bool) -> GatedNormRoute {
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
    if !dim.is_multiple_of(32) || !(32..=256).contains(&dim) {
        return GatedNormRoute::BlockPerRow;
    }
    let v8 = aligned && z_stride.is_multiple_of(8);
    let name = match dim / 32 {
        1 if v8 => "rmsnorm_gated_rows_v8_p1",
        2 if v8 => "rmsnorm_gated_rows_v8_p2",
        4 if v8 => "rmsnorm_gated_rows_v8_p4",
        8 if v8 => "rmsnorm_gated_rows_v8_p8",
        parts => return GatedNormRoute::Warps { name: ROWS_KERNELS[parts - 1], rows_per_warp: 2 },
    };
    // GATED_V8_LOADS (2) loads of 32 / (dim / 8) rows each (cuda/norm.cu).
    GatedNormRoute::Warps { name, rows_per_warp: 2 * 256 / dim }
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
        let args = kargs![
            xp,
            wp,
            op,
            as_i32("dim", dim)?,
            x_stride as i64,
            out_stride as i64,
            eps,
            plus_one as i32,
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
        let s = self.stream();
        let (rp, _r) = residual.device_ptr_mut(s);
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        // The kernels differ in one argument: the warp-per-row ones take the row count (their
        // dim is a template constant), the block kernel dim (a block is a row).
        let (name, count, blocks, threads) = match add_norm_rows_kernel(rows, dim, (rp | xp | wp | op).is_multiple_of(16)) {
            Some(name) => (name, as_i32("rows", rows)?, rows.div_ceil(ADD_NORM_ROWS_WARPS) as u32, 32 * ADD_NORM_ROWS_WARPS as u32),
            None => ("add_rmsnorm", as_i32("dim", dim)?, as_i32("rows", rows)? as u32, chunked_norm_threads(dim)),
        };
        let f = self.function(KernelFamily::Norm, name)?;
        let args = kargs![rp, xp, wp, op, count, eps, plus_one as i32];
        self.launch_pdl(&f, cfg((blocks, 1, 1), threads), name, &args)
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
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (zp, _z) = z.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        let aligned = [xp, zp, wp, op].iter().all(|p| p.is_multiple_of(16));
        let route = gated_norm_route(dim, z_stride, aligned);
        let name = match route {
            GatedNormRoute::BlockPerRow => "rmsnorm_gated",
            GatedNormRoute::Warps { name, .. } => name,
        };
        let f = self.function(KernelFamily::Norm, name)?;
        if rows == 0 {
            return Ok(());
        }
        let mut args = Vec::from(kargs![
            xp,
            zp,
            as_i32("heads", heads.max(1))?,
            z_stride as i64,
            wp,
            op,
        ]);
        if let GatedNormRoute::Warps { rows_per_warp, .. } = route {
            // The part count is in the kernel's name; rows are counted in 64 bits.
            args.extend(kargs![eps, rows as i64]);
            // 8 warps a block, grid-stride over one full wave.
            let per_sm = self.resident_blocks(&f, name, 256)?;
            let blocks = rows.div_ceil(8 * rows_per_warp).min(self.sm_count() * per_sm);
            return self.launch_pdl(&f, cfg((blocks as u32, 1, 1), 256), name, &args);
        }
        args.extend(kargs![as_i32("dim", dim)?, eps]);
        let grid = (as_i32("rows", rows)? as u32, 1, 1);
        self.launch_pdl(&f, cfg(grid, NORM_THREADS), name, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_norm_takes_a_warp_per_row_for_aligned_prefill_rows_of_the_instanced_sizes() {
        assert_eq!(add_norm_rows_kernel(8192, 5120, true), Some("add_rmsnorm_rows_g20"));
        assert_eq!(add_norm_rows_kernel(128, 4096, true), Some("add_rmsnorm_rows_g16"));
        assert_eq!(add_norm_rows_kernel(300, 2048, true), Some("add_rmsnorm_rows_g8"));
        assert_eq!(add_norm_rows_kernel(300, 3072, true), Some("add_rmsnorm_rows_g12"));
        // decode batches, unaligned rows, other sizes: a block per row
        assert_eq!(add_norm_rows_kernel(127, 5120, true), None);
        assert_eq!(add_norm_rows_kernel(8192, 5120, false), None);
        for dim in [64, 1000, 1024, 2304, 8192] {
            assert_eq!(add_norm_rows_kernel(8192, dim, true), None, "dim {dim}");
        }
    }

    fn warps(name: &'static str, rows_per_warp: usize) -> GatedNormRoute {
        GatedNormRoute::Warps { name, rows_per_warp }
    }

    #[test]
    fn gated_norm_takes_16_byte_rows_only_for_aligned_power_of_two_warp_parts() {
        // The 27B prefill: 48 heads of 128, z a column range of 16480-wide projection rows.
        assert_eq!(gated_norm_route(128, 16480, true), warps("rmsnorm_gated_rows_v8_p4", 4));
        assert_eq!(gated_norm_route(32, 32, true), warps("rmsnorm_gated_rows_v8_p1", 16));
        assert_eq!(gated_norm_route(64, 64, true), warps("rmsnorm_gated_rows_v8_p2", 8));
        assert_eq!(gated_norm_route(256, 520, true), warps("rmsnorm_gated_rows_v8_p8", 2));
        assert_eq!(gated_norm_route(128, 16480, false), warps("rmsnorm_gated_rows_p4", 2));
        assert_eq!(gated_norm_route(128, 6 * 128 + 4, true), warps("rmsnorm_gated_rows_p4", 2));
        assert_eq!(gated_norm_route(96, 300, true), warps("rmsnorm_gated_rows_p3", 2));
        assert_eq!(gated_norm_route(224, 224, true), warps("rmsnorm_gated_rows_p7", 2));
        assert_eq!(gated_norm_route(80, 240, true), GatedNormRoute::BlockPerRow);
        assert_eq!(gated_norm_route(512, 512, true), GatedNormRoute::BlockPerRow);
    }
}
