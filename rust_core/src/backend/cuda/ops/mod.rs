//! Typed launchers for the kernels in `cuda/`, as methods on `CudaDevice`.
//!
//! Every launcher checks buffer lengths against the shape it is given (a typed error with the
//! numbers, never an out-of-bounds kernel) and queues the kernel on the device's stream; none
//! synchronizes. Storage buffers are `u16` bit patterns of the device's `StorageDType`.

mod attention;
mod elementwise;
mod flash_attention;
mod gdn;
mod gdn_chunked;
mod gemv;
mod norm;
mod sampling;
mod sampling_pack;

pub use attention::{decode_scratch_len, AttnScratch, PagedAttentionShape, DECODE_SPLITS};
pub use gdn::{ConvShape, DevicePtrDyn, RecurrentShape};
pub use sampling_pack::{PackedSampling, SAMPLE_HDR, SAMPLE_MAX_TOP, SAMPLE_OUT};

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::device::CudaDevice;
use crate::{NinferError, Result};

/// Fails with the buffer name and both lengths when `got < needed`.
pub(crate) fn check_len(what: &str, got: usize, needed: usize) -> Result<()> {
    if got < needed {
        return Err(NinferError::Device(format!(
            "{what}: buffer holds {got} elements, the shape needs {needed}"
        )));
    }
    Ok(())
}

/// Elements a strided row-major matrix spans: (rows - 1) * stride + cols (0 when empty).
pub(crate) fn strided_len(rows: usize, cols: usize, stride: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + cols
    }
}

/// Fails unless `v` fits the i32 a kernel parameter takes.
pub(crate) fn as_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| NinferError::Device(format!("{what} = {v} exceeds i32")))
}

/// A launch configuration of `grid` blocks of `block` threads.
pub(crate) fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// One kernel parameter, by value (device pointers are raw addresses).
#[derive(Debug, Clone, Copy)]
pub(crate) enum KArg {
    /// A device pointer (0 for a null optional input).
    Ptr(u64),
    /// An `int` parameter.
    I32(i32),
    /// A `long long` parameter (strides, offsets).
    I64(i64),
    /// A `float` parameter.
    F32(f32),
}

impl CudaDevice {
    /// Queues `f` with `args` in order.
    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        config: LaunchConfig,
        name: &str,
        args: &[KArg],
    ) -> Result<()> {
        if config.grid_dim.0 == 0 || config.grid_dim.1 == 0 || config.grid_dim.2 == 0 {
            return Ok(());
        }
        let mut b = self.stream().launch_builder(f);
        for a in args {
            match a {
                KArg::Ptr(p) => b.arg(p),
                KArg::I32(v) => b.arg(v),
                KArg::I64(v) => b.arg(v),
                KArg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: each launcher checked every buffer against the shape the kernel indexes.
        unsafe { b.launch(config) }
            .map(|_| ())
            .map_err(|e| NinferError::Device(format!("launching {name}: {e}")))
    }
}
