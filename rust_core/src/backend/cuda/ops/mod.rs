//! Typed launchers for the kernels in `cuda/`, as methods on `CudaDevice`.
//!
//! Every launcher checks buffer lengths against the shape it is given (a typed error with the
//! numbers, never an out-of-bounds kernel) and queues the kernel on the device's stream; none
//! synchronizes. Storage buffers are `u16` bit patterns of the device's `StorageDType`.

/// The argument list of a kernel launch, `kargs![x, w, y, n, eps]`: each value passed as its
/// Rust type says (`u64` a device pointer, `i32` an `int`, `i64` a `long long`, `f32` a
/// `float`; `KernelArg`), in the kernel's parameter order.
macro_rules! kargs {
    ($($a:expr),* $(,)?) => {
        [$($crate::backend::cuda::ops::KernelArg::karg($a)),*]
    };
}

mod attention;
mod decode_attention;
mod decode_attention_rope;
mod elementwise;
mod flash_attention;
mod fp4_linear;
mod fp8_block;
mod fp8_linear;
mod gdn;
mod gdn_chunked;
mod gdn_replay;
mod gemv;
mod gemv_qkv_rope;
mod gemv_route;
mod norm;
mod quant;
mod quant_chunks;
pub mod quant_tiles;
mod rope_kv;
mod sampling;
mod sampling_pack;

pub use attention::{two_kernel_decode_scratch_len, PagedAttentionShape, DECODE_SPLITS, FIXED_BLOCK_SPLITS};
pub use decode_attention::{
    decode_block_splits, decode_block_splits_with, decode_grid_splits, decode_grid_splits_with, decode_scratch_len, decode_warp_keys, decode_warp_keys_with,
    tc_direct_fits, tc_direct_heads_fit, tc_direct_grid_splits, tc_direct_smem_bytes, tc_direct_split_keys, tc_direct_splits, AttnScratch, DecodeAttentionForm, DecodeGate, DecodeAttentionRoute, decode_attention_launch, default_layout_arg, DecodeAttentionLaunch,
    DecodeScratchLen, DECODE_DEFAULT_LAYOUT, DECODE_MAX_SPLITS, DECODE_MIN_WARP_KEYS, DECODE_SCALED_MAX_TOKENS, DECODE_SHORT_CONTEXT, DECODE_SHORT_WARP_KEYS,
    TC_DIRECT_BLOCKS_PER_SM, TC_DIRECT_WARPS,
};
pub use decode_attention_rope::{tc_direct_rope_fits, HeadNorms};
pub use flash_attention::{flash_tile_for, FlashTile};
pub use fp4_linear::nvfp4_chunk_rows;
pub use fp8_block::{fp8_block_chunk_rows, fp8_block_scale_bytes, fp8_block_segments};
pub use fp8_linear::fp8_chunk_rows;
pub use gdn::{ConvPath, ConvShape, DevicePtrDyn, RecurrentShape, GATED_MAX_DV};
pub use gdn_chunked::{GdnScanForms, PrepForm, ScanForm};
pub use gdn_replay::KeptShape;
pub use gemv_qkv_rope::{qkv_rope_fits, qkv_rope_launch};
pub use gemv_route::{gemv_kernel, gemv_shape_on_cuda_cores, gemv_tc_config, gemv_tc_config_in, GemvForm, GemvKernel, GemvLaunch, GemvTcConfig, GemvTcRule, GEMV_MAX_M, GEMV_ROUTE_MAX_M, GEMV_WARPS};
#[cfg(test)]
pub(crate) use gemv_route::{gemv_launch_spec, GemvOut};
pub use quant::{quant_families, DeviceQuantWeight, Nvfp4Plane, QUANT_GEMV_MAX_M};
pub use rope_kv::RopeKvShape;
pub use sampling::SampleScratch;
pub use sampling_pack::{sample_scan_blocks, PackedSampling, SAMPLE_HDR, SAMPLE_MAX_TOP, SAMPLE_OUT, SAMPLE_SCAN_REC, SAMPLE_SCAN_SPAN};

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, LaunchConfig, PushKernelArg};

use super::device::CudaDevice;
use crate::{NinferError, Result};

/// Fails with the buffer name and both lengths when `got < needed`.
/// The lengths of a linear op's x `[m, k]`, y `[m, n]` and bias `[n]` (`what` names the op).
pub(crate) fn check_linear(what: &str, x: usize, y: usize, bias: Option<usize>, [m, n, k]: [usize; 3]) -> Result<()> {
    check_len(&format!("{what} x"), x, m * k)?;
    check_len(&format!("{what} y"), y, m * n)?;
    bias.map_or(Ok(()), |b| check_len(&format!("{what} bias"), b, n))
}

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

/// A value a kernel parameter takes by value (`kargs!`).
pub(crate) trait KernelArg: Copy {
    /// The value as a launch argument.
    fn karg(self) -> KArg;
}

impl KernelArg for u64 {
    fn karg(self) -> KArg {
        KArg::Ptr(self)
    }
}

impl KernelArg for i32 {
    fn karg(self) -> KArg {
        KArg::I32(self)
    }
}

impl KernelArg for i64 {
    fn karg(self) -> KArg {
        KArg::I64(self)
    }
}

impl KernelArg for f32 {
    fn karg(self) -> KArg {
        KArg::F32(self)
    }
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

    /// Queues `f` with `args` as a Programmatic Dependent Launch where the device allows it
    /// (the plan's `pdl`: sm_90+), else as `launch` does. With PDL
    /// the kernel's blocks may be scheduled before the previous kernel on the stream has
    /// finished, which hides the launch gap between the small kernels of a decode step (inside
    /// a CUDA graph too: capture records the dependency as a programmatic edge).
    ///
    /// Only for kernels that begin with `pdl_wait()` (cuda/common.cuh) in every block, before
    /// any early return, any read of an earlier kernel's output and any write: the ordering of
    /// the whole stream rests on it (see the invariant there and in docs/kernels.md). Kernels
    /// without it (flash attention, chunked GDN, cuBLAS, embedding, sampling) use `launch`.
    pub(crate) fn launch_pdl(
        &self,
        f: &CudaFunction,
        config: LaunchConfig,
        name: &str,
        args: &[KArg],
    ) -> Result<()> {
        if !self.pdl() {
            return self.launch(f, config, name, args);
        }
        self.launch_ex(f, config, name, args, true, 1)
    }

    /// Queues `f` with `args` through cuLaunchKernelEx with the launch attributes asked for:
    /// PDL (`pdl`, only for kernels that keep `launch_pdl`'s invariant) and thread-block
    /// clusters of `cluster_x` x 1 x 1 blocks (`cluster_x` > 1, sm_90+; grid.x a multiple of it).
    pub(crate) fn launch_ex(
        &self,
        f: &CudaFunction,
        config: LaunchConfig,
        name: &str,
        args: &[KArg],
        pdl: bool,
        cluster_x: u32,
    ) -> Result<()> {
        if config.grid_dim.0 == 0 || config.grid_dim.1 == 0 || config.grid_dim.2 == 0 {
            return Ok(());
        }
        // The kernel parameter array points at each argument's value, as cuLaunchKernel takes it.
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                KArg::Ptr(p) => p as *const u64 as *mut c_void,
                KArg::I32(v) => v as *const i32 as *mut c_void,
                KArg::I64(v) => v as *const i64 as *mut c_void,
                KArg::F32(v) => v as *const f32 as *mut c_void,
            })
            .collect();
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if pdl {
            // SAFETY: an all-zero attribute is a valid plain-old-data value; id and value are set next.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(attr);
        }
        if cluster_x > 1 {
            // SAFETY: as above.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attr.value.clusterDim.x = cluster_x;
            attr.value.clusterDim.y = 1;
            attr.value.clusterDim.z = 1;
            attrs.push(attr);
        }
        let lc = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.stream().cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        self.context().bind_to_thread().map_err(|e| NinferError::Device(format!("launching {name}: {e}")))?;
        // SAFETY: each launcher checked every buffer against the shape the kernel indexes; the
        // parameter array, the values it points at (`args`) and the attributes outlive the
        // call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| NinferError::Device(format!("launching {name} (cuLaunchKernelEx, PDL {pdl}, cluster {cluster_x}): {e}")))
    }
}
