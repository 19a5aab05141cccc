//! Typed launchers for the kernels in `cuda/`, as methods on `CudaDevice`.
//!
//! Every launcher checks buffer lengths against the shape it is given (a typed error with the
//! numbers, never an out-of-bounds kernel) and queues the kernel on the device's stream; none
//! synchronizes. Storage buffers are `u16` bit patterns of the device's `StorageDType`.

mod attention;
mod decode_attention;
mod elementwise;
mod flash_attention;
mod gdn;
mod gdn_chunked;
mod gemm_wg;
mod gemv;
mod gemv_add_rmsnorm;
mod gemv_qkv_rope;
mod gemv_tuning;
mod norm;
mod rope_kv;
mod sampling;
mod sampling_pack;

pub use attention::{two_kernel_decode_scratch_len, PagedAttentionShape, DECODE_SPLITS, FIXED_BLOCK_SPLITS};
pub use decode_attention::{
    decode_attention_form, decode_block_splits, decode_block_splits_with, decode_grid_splits, decode_grid_splits_with, decode_scratch_len,
    decode_warp_keys, decode_warp_keys_with, parse_da_min_warp_keys, AttnScratch, DecodeAttentionForm, DecodeScratchLen, DA_MIN_WARP_KEYS_VAR,
    DECODE_DEFAULT_LAYOUT, DECODE_MAX_SPLITS, DECODE_MAX_WARP_KEYS_SETTING, DECODE_MIN_WARP_KEYS, DECODE_SHORT_CONTEXT, DECODE_SHORT_WARP_KEYS, DECODE_SCALED_MAX_TOKENS, tc_decode_fits, check_staged_tc_settings, tc_direct_fits, tc_direct_smem_bytes, tc_direct_splits, tc_direct_split_keys, tc_direct_grid_splits, TC_DIRECT_BLOCKS_PER_SM, TC_DECODE_DIRECT_SWITCH, TC_DIRECT_WARPS, tc_grid_splits, tc_smem_bytes, tc_split_keys, tc_split_keys_with, tc_decode_warps, parse_tc_min_warp_tiles, TC_MIN_WARP_TILES, TC_MIN_WARP_TILES_VAR, TC_MAX_WARP_TILES_SETTING, TC_DECODE_ATTN_SWITCH, TC_DECODE_MIN_TOKENS, TC_DECODE_MIN_TOKENS_VAR, parse_tc_decode_min_tokens,
};
pub use gdn::{ConvPath, ConvShape, DevicePtrDyn, RecurrentShape, GATED_MAX_DV};
pub use flash_attention::{FlashTile, FA_WS_SWITCH};
pub use gdn_chunked::{PrepForm, ScanForm};
pub use gemm_wg::{check_wg_shape, gemm_wg_plan, parse_wg_gemm_switch, wg_gemm_enabled, GemmWgInstance, GemmWgPlan, WgPlanCache, WG_GEMM_MAX_M, WG_GEMM_MIN_M, WG_GEMM_SWITCH};
pub use gemv::{gemv_form, gemv_form_with_switch, BATCH_INVARIANT_SWITCH, gemv_kernel, gemv_shape_on_cuda_cores, gemv_tc_config, GemvForm, GemvTcConfig, GemvTcRule, GEMV_ROUTE_MAX_M, GEMV_TC_RULES, TC_GEMV_SWITCH};
pub use gemv_add_rmsnorm::{add_norm_route, add_norm_route_for, AddNormRoute};
pub use gemv_qkv_rope::qkv_rope_fits;
pub use gemv_tuning::{
    default_cc_ksplit, default_cc_warps, gemv_shapes_for, parse_cc_prefetch, parse_cc_ksplit, parse_cc_warps, parse_gemv_shapes, parse_tc_prefetch_steps, CcKsplitPlan, CcPrefetch, CcPrefetchPlan, GemvKernel, CC_PREFETCH_DEFAULT, CC_KSPLIT_VAR, CC_PREFETCH_VAR, CC_WARPS_VAR, GemvShapeOverride, GEMV_SHAPES_VAR, TC_PREFETCH_DEFAULT_STEPS,
    TC_PREFETCH_MAX_STEPS, TC_PREFETCH_VAR,
};
pub use rope_kv::RopeKvShape;
pub use sampling::SampleScratch;
pub use sampling_pack::{sample_scan_blocks, PackedSampling, SAMPLE_HDR, SAMPLE_MAX_TOP, SAMPLE_OUT, SAMPLE_SCAN_REC, SAMPLE_SCAN_SPAN};

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, LaunchConfig, PushKernelArg};

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

/// The environment switch for Programmatic Dependent Launch (`launch_pdl`).
pub const PDL_SWITCH: &str = "NINFER_PDL";

/// Whether kernels that support it are launched with PDL on a device of compute capability
/// `cc`, given the value of `NINFER_PDL` (`config::parse_switch`; unset means on where the
/// device has it): PDL needs sm_90 (the griddepcontrol instructions; older devices would ignore
/// the attribute). A misspelt value, or on named explicitly for an older device (where it
/// could only be ignored), is an error naming the variable.
pub fn pdl_enabled(cc: (u32, u32), switch: Option<&str>) -> Result<bool> {
    let on = crate::config::env_switch::parse_switch(PDL_SWITCH, switch, true)?;
    refuse_explicit_on(PDL_SWITCH, switch, cc.0 >= 9, &needs_cc("programmatic dependent launch", (9, 0), cc))?;
    Ok(on && cc.0 >= 9)
}

/// Switch `name`, whose value is `value`, named on (1/true/on/yes) where what it turns on is
/// unavailable (`has` false; `why` says why): an error naming the variable and the reason,
/// since there it could only be ignored. Unset, blank, off and `has` pass; a misspelt value is
/// `parse_switch`'s error.
pub fn refuse_explicit_on(name: &str, value: Option<&str>, has: bool, why: &str) -> Result<()> {
    let explicit_on = value.is_some_and(|v| !v.trim().is_empty()) && crate::config::env_switch::parse_switch(name, value, false)?;
    if explicit_on && !has {
        return Err(NinferError::config(name, format!("{why} (unset it, or 0)")));
    }
    Ok(())
}

/// "`what` needs compute capability X.Y or newer; this device is A.B": `refuse_explicit_on`'s
/// reason for a feature of newer GPUs.
pub fn needs_cc(what: &str, needed: (u32, u32), cc: (u32, u32)) -> String {
    format!("{what} needs compute capability {}.{} or newer; this device is {}.{}", needed.0, needed.1, cc.0, cc.1)
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

    /// Queues `f` with `args` as a Programmatic Dependent Launch where the device allows it
    /// (`CudaDevice::pdl`: sm_90+ and `NINFER_PDL` not off), else as `launch` does. With PDL
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdl_is_on_by_default_from_sm90_only_and_the_switch_turns_it_off() {
        assert!(pdl_enabled((9, 0), None).unwrap());
        assert!(pdl_enabled((10, 0), Some("")).unwrap());
        assert!(!pdl_enabled((8, 9), None).unwrap(), "no griddepcontrol before sm_90");
        assert!(!pdl_enabled((8, 0), Some("")).unwrap());
        assert!(!pdl_enabled((8, 0), Some("0")).unwrap());
        for off in ["0", "off", "False"] {
            assert!(!pdl_enabled((9, 0), Some(off)).unwrap(), "{off}");
        }
        assert!(pdl_enabled((9, 0), Some("on")).unwrap());
    }

    #[test]
    fn pdl_named_on_for_a_device_without_it_is_an_error_naming_the_variable_and_device() {
        for v in ["1", "on", " yes "] {
            let e = pdl_enabled((8, 6), Some(v)).unwrap_err().to_string();
            assert!(e.contains("NINFER_PDL") && e.contains("9.0") && e.contains("8.6"), "{e}");
        }
    }

    #[test]
    fn an_explicit_on_is_refused_only_where_the_device_lacks_it() {
        let need = needs_cc("X", (8, 0), (7, 5));
        assert_eq!(need, "X needs compute capability 8.0 or newer; this device is 7.5");
        assert!(refuse_explicit_on("NINFER_X", Some("1"), true, &need).is_ok());
        for v in [None, Some(""), Some(" "), Some("0"), Some("off")] {
            assert!(refuse_explicit_on("NINFER_X", v, false, &need).is_ok(), "{v:?}");
        }
        let e = refuse_explicit_on("NINFER_X", Some("on"), false, &need).unwrap_err().to_string();
        assert!(e.contains("NINFER_X") && e.contains(&need), "{e}");
        assert!(refuse_explicit_on("NINFER_X", Some("maybe"), false, &need).unwrap_err().to_string().contains("maybe"));
    }

    #[test]
    fn a_misspelt_pdl_switch_is_an_error_naming_it_even_where_pdl_is_unavailable() {
        for cc in [(9, 0), (7, 0)] {
            let e = pdl_enabled(cc, Some("enable")).unwrap_err().to_string();
            assert!(e.contains("NINFER_PDL") && e.contains("enable"), "{e}");
        }
    }
}
