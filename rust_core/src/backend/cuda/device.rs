//! One CUDA device as the engine uses it: context, the stream every op is queued on, the
//! storage type its kernels were built for, lazily loaded kernel modules and a lazily created
//! cuBLAS handle.
//!
//! The stream is a dedicated non-blocking stream, not the legacy default stream: CUDA graph
//! capture (decode steps are captured and replayed) is impossible on the legacy stream, and
//! cuBLAS gets a preallocated workspace so that a captured GEMM never allocates.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use rayon::prelude::*;

use super::kernels::{KernelFamily, StorageDType};
use super::nvrtc;
use crate::{NinferError, Result};

/// Maps a driver error to `NinferError::Device`, naming what was being done.
pub(crate) fn driver_err(what: &'static str) -> impl Fn(DriverError) -> NinferError {
    move |e| NinferError::Device(format!("{what}: {e}"))
}

/// A CUDA device with its stream and kernel modules. Ops (`ops::*`) are methods on it.
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    /// The capability every route sees: the GPU's own, or the one `NINFER_EMULATE_ARCH` names.
    compute_capability: (u32, u32),
    /// The GPU's own capability where `NINFER_EMULATE_ARCH` names another (emulate.rs): its
    /// kernels are then PTX for `compute_capability`, JIT-compiled by the driver.
    emulating: Option<(u32, u32)>,
    storage: StorageDType,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<HashMap<KernelFamily, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Dynamic shared memory each kernel was allowed (`function_with_smem`): the limit is raised
    /// once per kernel, not per launch (a driver call the launch does not need).
    smem_limits: Mutex<HashMap<&'static str, usize>>,
    /// Blocks of a kernel resident on one SM at a block size (`resident_blocks`): asked of the
    /// driver once per kernel and size, not per launch.
    resident: Mutex<HashMap<(&'static str, u32), usize>>,
    blas: Mutex<Option<Arc<CudaBlas>>>,
    /// cuBLAS workspace, bound to the handle for its whole life (capture forbids allocation).
    blas_workspace: Mutex<Option<cudarc::driver::CudaSlice<u8>>>,
    /// The persistent prefill attention's work counters (ops/flash_attention.rs): zero between
    /// launches (the last block of a launch zeroes them), allocated here so that no launch
    /// allocates. One stream orders every launch, so one pair serves them all.
    fa_work: cudarc::driver::CudaSlice<u32>,
    /// Kernels that wait on their predecessor are launched with Programmatic Dependent Launch
    /// (`ops::launch_pdl`): sm_90+ unless `NINFER_PDL` is off.
    pdl: bool,
    /// The decode GEMV form (`ops::gemv_form` of the compute capability, or the CUDA-core
    /// kernel when `NINFER_TC_GEMV` is off): read once, so every launch of a run agrees.
    gemv_form: super::ops::GemvForm,
    /// `NINFER_GEMV_SHAPES`: the kernel per weight shape in place of `GEMV_TC_RULES` under
    /// `GemvForm::ByShape` (a tuning tool, ops/gemv_tuning.rs); read once, like `gemv_form`.
    gemv_shapes: Option<super::ops::GemvShapeOverride>,
    /// k32 steps per block the tensor-core GEMV prefetches into L2 before its PDL wait
    /// (`NINFER_TC_PREFETCH_STEPS`, default 16). Settable later (`set_tc_prefetch_steps`): a
    /// prefetch never changes a value, so launches with different depths agree bit for bit.
    tc_prefetch_steps: AtomicU32,
    /// The CUDA-core GEMV's prefetch before its PDL wait (`NINFER_CC_PREFETCH`); read once.
    cc_prefetch: super::ops::CcPrefetchPlan,
    /// The CUDA-core GEMV's launch: warps a block and warps of a block that split one warp's
    /// K, the latter per weight shape where `NINFER_CC_KSPLIT` names shapes (`cc_ksplit_plan`),
    /// else `cc_ksplit`. `NINFER_CC_WARPS` / `NINFER_CC_KSPLIT` when set, else 8 and 1 until the
    /// model loader sets its defaults (`use_model_cc_launch`).
    cc_warps: AtomicUsize,
    cc_warps_set: bool,
    cc_ksplit: AtomicUsize,
    cc_ksplit_plan: super::ops::CcKsplitPlan,
    /// Fewest keys a warp of the scaled decode attention walks at every context
    /// (`NINFER_DA_MIN_WARP_KEYS`), or DECODE_DEFAULT_LAYOUT (0); read once.
    da_min_warp_keys: usize,
    /// Fewest 16-key tiles a warp of the tensor-core decode attention takes in a split
    /// (`NINFER_TC_DECODE_MIN_TILES`, default TC_MIN_WARP_TILES). Settable later
    /// (`set_tc_min_warp_tiles`, the op tests); a captured graph keeps the value it captured.
    tc_min_warp_tiles: AtomicUsize,
    /// `NINFER_BATCH_INVARIANT`: every kernel choice independent of the batch size (the GEMV
    /// form above, the decode attention form, ops/decode_attention.rs); read once.
    batch_invariant: bool,
    /// `NINFER_TC_DECODE_ATTN` (default on): batched decode attention on tensor cores where it
    /// fits (ops/decode_attention.rs `decode_attention_form`); read once.
    tc_decode_attn: bool,
    /// Fewest tokens a decode launch runs the tensor-core form for (`NINFER_TC_DECODE_MIN_TOKENS`,
    /// default TC_DECODE_MIN_TOKENS); read once.
    tc_decode_min_tokens: usize,
    /// `NINFER_TC_DECODE_DIRECT` (default on) and `NINFER_TC_DECODE_ATTN` on: decode launches
    /// run the direct tensor-core form where it fits (ops/decode_attention.rs
    /// `decode_attention_form`); read once.
    tc_decode_direct: bool,
    /// `NINFER_FA_WS` (default on): the warp-specialized prefill attention where it fits
    /// (ops/flash_attention.rs `flash_tile`); read once.
    fa_ws: bool,
    /// `NINFER_WG_GEMM=1` (default off; an error without sm_90a code): decode launches of 9-64 rows run
    /// `gemm_wg` (ops/gemm_wg.rs) instead of cuBLAS. Settable later (`set_wg_gemm`, the op
    /// tests); a captured graph keeps the kernels it captured.
    wg_gemm: AtomicBool,
    /// gemm_wg's plan per (instance, n, k, forced splits) (ops/gemm_wg.rs), worked out once each.
    wg_plans: super::ops::WgPlanCache,
    /// Major version of the NVRTC that compiles this device's kernels (0 where none loads):
    /// the warp-specialized prefill attention exists only in NVRTC 13's build.
    nvrtc_major: i32,
    /// Streaming multiprocessors (the direct decode attention sizes its launches by them).
    sm_count: usize,
    /// Dynamic shared memory one block may opt into, bytes (0 where the driver does not say):
    /// read once, since the prefill routes (flash tiling, GDN scan form) ask on every launch.
    smem_optin: usize,
    /// `NINFER_SMEM_CARVEOUT`: the preferred shared-memory carveout (percent of the unified
    /// L1 / shared memory) set on every kernel within the default 48 KiB of dynamic shared
    /// memory as it is loaded (those that opt into more keep the driver's), or None for the
    /// driver's choice everywhere.
    smem_carveout: Option<i32>,
}

/// The variable that sets the preferred shared-memory carveout of every kernel within the default
/// 48 KiB of dynamic shared memory (a tuning tool).
pub const SMEM_CARVEOUT_VAR: &str = "NINFER_SMEM_CARVEOUT";

/// `value` of `NINFER_SMEM_CARVEOUT`: None (the driver picks per kernel) when unset, blank or
/// `auto`, else a percentage of 0..=100; an error naming the variable and the value otherwise.
/// Why it exists: a kernel whose shared memory needs a larger carveout than its neighbours' can
/// make the SM reconfigure between them, which waits for the running blocks to drain and so
/// cuts into the overlap that programmatic dependent launch buys.
pub fn parse_smem_carveout(value: Option<&str>) -> Result<Option<i32>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty() && !v.eq_ignore_ascii_case("auto")) else {
        return Ok(None);
    };
    v.parse::<i32>()
        .ok()
        .filter(|p| (0..=100).contains(p))
        .map(Some)
        .ok_or_else(|| NinferError::config(SMEM_CARVEOUT_VAR, format!("expected `auto` or a percentage of 0..=100, got {v:?}")))
}

/// cuBLAS workspace bytes: what NVIDIA recommends for Hopper (32 MiB; 4 MiB is enough on older
/// GPUs, the difference is negligible next to the weights).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl CudaDevice {
    /// Opens device `ordinal` with the storage type its architecture suits (bf16 on sm_80+).
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::open(ordinal, None)
    }

    /// Opens device `ordinal` with an explicit storage type (tests run both).
    pub fn with_storage(ordinal: usize, storage: StorageDType) -> Result<Self> {
        Self::open(ordinal, Some(storage))
    }

    fn open(ordinal: usize, storage: Option<StorageDType>) -> Result<Self> {
        let count = super::select::cuda_device_count()?;
        if ordinal >= count {
            return Err(NinferError::Device(format!(
                "device cuda:{ordinal} requested but {count} CUDA device(s) are present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating the CUDA context"))?;
        // One stream orders all work, so cudarc's per-buffer event tracking is pure overhead.
        // SAFETY: called before any buffer or stream exists on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("reading the compute capability"))?;
        let real = (major as u32, minor as u32);
        let emulated = super::emulate::parse_emulated_arch(real, std::env::var(super::emulate::EMULATE_ARCH_VAR).ok().as_deref())?;
        // Every route below sees the emulated capability (emulate.rs).
        let (major, minor) = emulated.unwrap_or(real);
        let pdl_switch = std::env::var(super::ops::PDL_SWITCH).ok();
        let pdl = super::ops::pdl_enabled((major, minor), pdl_switch.as_deref())?;
        let tc_switch = std::env::var(super::ops::TC_GEMV_SWITCH).ok();
        let invariant = std::env::var(super::ops::BATCH_INVARIANT_SWITCH).ok();
        let batch_invariant = crate::config::env_switch::parse_switch(super::ops::BATCH_INVARIANT_SWITCH, invariant.as_deref(), false)?;
        let gemv_form = super::ops::gemv_form_with_switch((major, minor), tc_switch.as_deref(), batch_invariant)?;
        let shapes = std::env::var(super::ops::GEMV_SHAPES_VAR).ok();
        let gemv_shapes = super::ops::gemv_shapes_for((major, minor), gemv_form, tc_switch.as_deref(), shapes.as_deref())?;
        let prefetch = std::env::var(super::ops::TC_PREFETCH_VAR).ok();
        let tc_prefetch_steps = AtomicU32::new(super::ops::parse_tc_prefetch_steps(prefetch.as_deref())?);
        let cc_prefetch = super::ops::parse_cc_prefetch(std::env::var(super::ops::CC_PREFETCH_VAR).ok().as_deref())?;
        let warps = super::ops::parse_cc_warps(std::env::var(super::ops::CC_WARPS_VAR).ok().as_deref())?;
        // Until a model sets its defaults: unsplit, the unsplit block.
        let unsplit_warps = super::ops::default_cc_warps(1);
        let cc_ksplit_plan = super::ops::parse_cc_ksplit(std::env::var(super::ops::CC_KSPLIT_VAR).ok().as_deref(), warps.unwrap_or(unsplit_warps))?;
        let (cc_warps, cc_ksplit) = (AtomicUsize::new(warps.unwrap_or(unsplit_warps)), AtomicUsize::new(cc_ksplit_plan.default.unwrap_or(1)));
        let cc_warps_set = warps.is_some();
        let da_min_warp_keys = super::ops::parse_da_min_warp_keys(std::env::var(super::ops::DA_MIN_WARP_KEYS_VAR).ok().as_deref())?;
        let min_tiles_var = std::env::var(super::ops::TC_MIN_WARP_TILES_VAR).ok();
        let tc_min_warp_tiles = AtomicUsize::new(super::ops::parse_tc_min_warp_tiles(min_tiles_var.as_deref())?);
        let attn_var = std::env::var(super::ops::TC_DECODE_ATTN_SWITCH).ok();
        let direct_var = std::env::var(super::ops::TC_DECODE_DIRECT_SWITCH).ok();
        let tc_decode_attn = crate::config::env_switch::parse_switch(super::ops::TC_DECODE_ATTN_SWITCH, attn_var.as_deref(), true)?;
        // Decode attention on tensor cores (both forms) is sm_80+ (ops/decode_attention.rs).
        let tc_attn_needs = super::ops::needs_cc("decode attention on tensor cores", (8, 0), (major, minor));
        for (switch, value) in [(super::ops::TC_DECODE_ATTN_SWITCH, &attn_var), (super::ops::TC_DECODE_DIRECT_SWITCH, &direct_var)] {
            super::ops::refuse_explicit_on(switch, value.as_deref(), major >= 8, &tc_attn_needs)?;
        }
        let min_tokens_var = std::env::var(super::ops::TC_DECODE_MIN_TOKENS_VAR).ok();
        let tc_decode_min_tokens = super::ops::parse_tc_decode_min_tokens(min_tokens_var.as_deref())?;
        // NINFER_TC_DECODE_ATTN=0 keeps decode attention off tensor cores altogether, so the
        // direct form named on beside it could only be ignored.
        let direct_needs = format!("the direct tensor-core decode attention is off under {}=0", super::ops::TC_DECODE_ATTN_SWITCH);
        super::ops::refuse_explicit_on(super::ops::TC_DECODE_DIRECT_SWITCH, direct_var.as_deref(), tc_decode_attn, &direct_needs)?;
        let tc_decode_direct = tc_decode_attn && crate::config::env_switch::parse_switch(super::ops::TC_DECODE_DIRECT_SWITCH, direct_var.as_deref(), true)?;
        super::ops::check_staged_tc_settings(tc_decode_attn && !tc_decode_direct, min_tokens_var.as_deref(), min_tiles_var.as_deref())?;
        let fa_ws = crate::config::env_switch::env_switch(super::ops::FA_WS_SWITCH, true)?;
        let nvrtc_major = super::nvrtc::nvrtc_version().map_or(0, |v| v.0);
        // The warp-specialized prefill attention exists in sm_90a code built by NVRTC 13.
        let has_ws = super::kernels::has_sm90a_code(major, minor) && nvrtc_major >= 13;
        let ws_needs = format!(
            "the warp-specialized prefill attention is sm_90a code built by NVRTC 13; this device is {major}.{minor} and NVRTC {}",
            if nvrtc_major > 0 { nvrtc_major.to_string() } else { "none".into() }
        );
        super::ops::refuse_explicit_on(super::ops::FA_WS_SWITCH, std::env::var(super::ops::FA_WS_SWITCH).ok().as_deref(), has_ws, &ws_needs)?;
        let wg_gemm = AtomicBool::new(super::ops::wg_gemm_enabled((major, minor), std::env::var(super::ops::WG_GEMM_SWITCH).ok().as_deref())?);
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("reading the multiprocessor count"))?
            .max(1) as usize;
        let mut smem_optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .unwrap_or(0)
            .max(0) as usize;
        if let Some(limit) = emulated.and_then(super::emulate::smem_optin_of) {
            smem_optin = smem_optin.min(limit);
        }
        let smem_carveout = parse_smem_carveout(std::env::var(SMEM_CARVEOUT_VAR).ok().as_deref())?;
        let name = ctx.name().map_err(driver_err("reading the device name"))?;
        if let Some(cc) = emulated {
            eprintln!(
                "ninfer: cuda:{ordinal} ({name}, compute capability {}.{}) runs as {}.{} ({}): kernels compiled to PTX \
                 for {} and JIT-compiled by the driver, {} KiB of shared memory a block; timings do not stand for that GPU",
                real.0,
                real.1,
                cc.0,
                cc.1,
                super::emulate::EMULATE_ARCH_VAR,
                super::emulate::ptx_arch(cc),
                smem_optin / 1024
            );
        }
        let stream = ctx.new_stream().map_err(driver_err("creating the device stream"))?;
        let fa_work = stream.alloc_zeros::<u32>(2).map_err(driver_err("allocating the attention work counters"))?;
        Ok(CudaDevice {
            ordinal,
            name,
            compute_capability: (major, minor),
            emulating: emulated.map(|_| real),
            storage: storage.unwrap_or_else(|| StorageDType::for_arch(major, minor)),
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            smem_limits: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            blas_workspace: Mutex::new(None),
            fa_work,
            pdl,
            gemv_form,
            gemv_shapes,
            tc_prefetch_steps,
            cc_prefetch,
            cc_warps,
            cc_warps_set,
            cc_ksplit,
            cc_ksplit_plan,
            da_min_warp_keys,
            tc_min_warp_tiles,
            batch_invariant,
            tc_decode_attn,
            tc_decode_min_tokens,
            tc_decode_direct,
            fa_ws,
            wg_gemm,
            wg_plans: Mutex::new(HashMap::new()),
            nvrtc_major,
            sm_count,
            smem_optin,
            smem_carveout,
        })
    }

    /// Device ordinal (N of cuda:N).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Name as the driver reports it ("NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// Dynamic shared memory one block may opt into, bytes (0 if the driver does not say).
    pub fn smem_optin(&self) -> usize {
        self.smem_optin
    }

    /// NVRTC architecture name the kernels are compiled for ("sm_90a" on an H200, "sm_86", ...;
    /// "compute_80" for PTX where `NINFER_EMULATE_ARCH` names 8.0).
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        match self.emulating {
            Some(_) => super::emulate::ptx_arch((major, minor)),
            None => super::kernels::nvrtc_arch(major, minor),
        }
    }

    /// The GPU's own compute capability where `NINFER_EMULATE_ARCH` makes it run as another
    /// (`compute_capability`), else None.
    pub fn emulating(&self) -> Option<(u32, u32)> {
        self.emulating
    }

    /// Whether kernels that support it are launched with Programmatic Dependent Launch.
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Whether `NINFER_BATCH_INVARIANT` is on: a sequence decoded in a batch equals it decoded
    /// alone bit for bit.
    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    /// Whether batched decode attention may run on tensor cores (`NINFER_TC_DECODE_ATTN`).
    pub fn tc_decode_attn(&self) -> bool {
        self.tc_decode_attn
    }

    /// Fewest tokens a decode launch runs the tensor-core form for (`NINFER_TC_DECODE_MIN_TOKENS`).
    pub fn tc_decode_min_tokens(&self) -> usize {
        self.tc_decode_min_tokens
    }

    /// Whether decode launches run the direct tensor-core form where it fits
    /// (`NINFER_TC_DECODE_DIRECT`, and not `NINFER_TC_DECODE_ATTN=0`).
    pub fn tc_decode_direct(&self) -> bool {
        self.tc_decode_direct
    }

    /// Whether prefill attention may take the warp-specialized wgmma form (`NINFER_FA_WS`).
    pub fn fa_ws(&self) -> bool {
        self.fa_ws
    }

    /// Whether decode launches of 9-64 rows run `gemm_wg` (`NINFER_WG_GEMM=1`, sm_90a).
    pub fn wg_gemm(&self) -> bool {
        self.wg_gemm.load(Ordering::Relaxed)
    }

    /// Routes decode launches of 9-64 rows to `gemm_wg` (`on`) or cuBLAS from now on:
    /// `NINFER_WG_GEMM` for a device already open (the op tests); on where the device has no
    /// sm_90a code is the same error as the variable's.
    pub fn set_wg_gemm(&self, on: bool) -> Result<()> {
        let on = super::ops::wg_gemm_enabled(self.compute_capability, Some(if on { "1" } else { "0" }))?;
        self.wg_gemm.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// gemm_wg's plans per (instance, n, k, forced splits).
    pub(crate) fn wg_plan_cache(&self) -> &super::ops::WgPlanCache {
        &self.wg_plans
    }

    /// Major version of the loaded NVRTC (0 where none loads).
    pub fn nvrtc_major(&self) -> i32 {
        self.nvrtc_major
    }

    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// The persistent prefill attention's two work counters (zero between its launches).
    pub(crate) fn fa_work(&self) -> &cudarc::driver::CudaSlice<u32> {
        &self.fa_work
    }

    /// The GEMV form every decode projection of this device runs.
    pub fn gemv_form(&self) -> super::ops::GemvForm {
        self.gemv_form
    }

    /// The kernel a weight of `rows` x `k` runs in GEMV form `form` for a launch of `m` rows on
    /// this device (its `NINFER_GEMV_SHAPES` override applied): `ops::gemv_kernel`.
    pub fn gemv_kernel(&self, form: super::ops::GemvForm, rows: usize, k: usize, m: usize) -> super::ops::GemvKernel {
        super::ops::gemv_kernel(form, self.gemv_shapes.as_ref(), rows, k, m)
    }

    /// The CUDA-core GEMV's prefetch before its PDL wait (`NINFER_CC_PREFETCH`).
    pub fn cc_prefetch(&self) -> &super::ops::CcPrefetchPlan {
        &self.cc_prefetch
    }

    /// Fewest keys a warp of the scaled decode attention walks at every context
    /// (`NINFER_DA_MIN_WARP_KEYS`), or DECODE_DEFAULT_LAYOUT (0: the default layout's, which
    /// depend on the context).
    pub fn da_min_warp_keys(&self) -> usize {
        self.da_min_warp_keys
    }

    /// Fewest 16-key tiles a warp of the tensor-core decode attention takes in a split
    /// (`NINFER_TC_DECODE_MIN_TILES`).
    pub fn tc_min_warp_tiles(&self) -> usize {
        self.tc_min_warp_tiles.load(Ordering::Relaxed)
    }

    /// Sets the tensor-core decode attention's fewest tiles a warp for the launches that follow
    /// (1..=TC_MAX_WARP_TILES_SETTING). A captured CUDA graph keeps the value it was captured
    /// with; every value keeps batch == alone.
    pub fn set_tc_min_warp_tiles(&self, tiles: usize) -> Result<()> {
        let tiles = super::ops::parse_tc_min_warp_tiles(Some(&tiles.to_string()))?;
        self.tc_min_warp_tiles.store(tiles, Ordering::Relaxed);
        Ok(())
    }

    /// k32 steps per block the tensor-core GEMV prefetches before its PDL wait.
    pub fn tc_prefetch_steps(&self) -> u32 {
        self.tc_prefetch_steps.load(Ordering::Relaxed)
    }

    /// Sets the tensor-core GEMV's prefetch depth for the launches that follow (0..=512; the
    /// tests compare depths bit for bit, the report times them). A captured CUDA graph keeps
    /// the depth it was captured with.
    pub fn set_tc_prefetch_steps(&self, steps: u32) -> Result<()> {
        let steps = super::ops::parse_tc_prefetch_steps(Some(&steps.to_string()))?;
        self.tc_prefetch_steps.store(steps, Ordering::Relaxed);
        Ok(())
    }

    /// Warps a block of the CUDA-core GEMV (`NINFER_CC_WARPS`).
    pub fn cc_warps(&self) -> usize {
        self.cc_warps.load(Ordering::Relaxed)
    }

    /// Warps of a CUDA-core GEMV block that share one warp's columns for a weight of `rows` x
    /// `k` (`NINFER_CC_KSPLIT`, per shape where it names the shape). Every kernel of a weight
    /// (the plain GEMV and its fused forms) asks with the weight's shape, so they sum alike.
    pub fn cc_ksplit_for(&self, rows: usize, k: usize) -> usize {
        self.cc_ksplit_plan.named(rows, k).unwrap_or_else(|| self.cc_ksplit.load(Ordering::Relaxed))
    }

    /// Takes the CUDA-core GEMV launch of a model of hidden size `hidden` (`default_cc_ksplit`
    /// for the shapes `NINFER_CC_KSPLIT` leaves, then `default_cc_warps` of that split, or the
    /// largest split named if more) where the variables set none. The loader calls it before the
    /// first launch, so every kernel of the model (and every captured graph) runs with one plan.
    pub fn use_model_cc_launch(&self, hidden: usize) {
        if self.cc_ksplit_plan.default.is_none() {
            // An explicit block of 2 or 4 warps still fits the default split of 2.
            self.cc_ksplit.store(super::ops::default_cc_ksplit(hidden), Ordering::Relaxed);
        }
        if !self.cc_warps_set {
            let base = self.cc_ksplit.load(Ordering::Relaxed);
            self.cc_warps.store(super::ops::default_cc_warps(base).max(self.cc_ksplit_plan.max_named()), Ordering::Relaxed);
        }
    }

    /// Storage type of activations and weights on this device.
    pub fn storage(&self) -> StorageDType {
        self.storage
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// (free, total) device memory in bytes, for the memory ledger.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(driver_err("reading free device memory"))
    }

    /// Waits until all queued work is done; surfaces asynchronous kernel faults.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronizing the stream"))
    }

    /// Compiles (or reads from the disk cache) and loads every kernel family now, so that the
    /// first request does not pay for it.
    pub fn load_all_kernels(&self) -> Result<()> {
        // NVRTC compiles are independent and single-threaded: fill the disk cache for all
        // families in parallel first, so that a cold start costs the slowest one, not the sum.
        let arch = self.arch();
        KernelFamily::ALL.par_iter().try_for_each(|&f| nvrtc::cached_image(f, &arch, self.storage).map(|_| ()))?;
        for family in KernelFamily::ALL {
            self.module(family)?;
        }
        Ok(())
    }

    fn module(&self, family: KernelFamily) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().expect("module cache poisoned");
        if let Some(m) = modules.get(&family) {
            return Ok(m.clone());
        }
        let arch = self.arch();
        let image = nvrtc::cached_image(family, &arch, self.storage)?;
        let image = if nvrtc::is_ptx_arch(&arch) {
            // PTX text: the driver JIT-compiles it for the GPU present.
            Ptx::from_src(String::from_utf8(image).map_err(|_| NinferError::Device(format!("cuda/{}: NVRTC's PTX for {arch} is not text", family.file_name())))?)
        } else {
            Ptx::from_binary(image)
        };
        let module = self.ctx.load_module(image).map_err(|e| {
            NinferError::Device(format!("loading cuda/{} for {arch}: {e}", family.file_name()))
        })?;
        modules.insert(family, module.clone());
        Ok(module)
    }

    /// The kernel `name` of `family`, loading its module on first use.
    pub(crate) fn function(&self, family: KernelFamily, name: &'static str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().expect("function cache poisoned").get(name) {
            return Ok(f.clone());
        }
        let module = self.module(family)?;
        let f = module.load_function(name).map_err(|e| {
            NinferError::Device(format!("kernel {name} missing from cuda/{}: {e}", family.file_name()))
        })?;
        if let Some(pct) = self.smem_carveout {
            f.set_attribute(cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, pct)
                .map_err(|e| NinferError::Device(format!("setting the shared-memory carveout of {name} to {pct}%: {e}")))?;
        }
        self.functions.lock().expect("function cache poisoned").insert(name, f.clone());
        Ok(f)
    }

    /// How many blocks of `threads` threads of kernel `name` (no dynamic shared memory) one SM
    /// holds at once: a grid-stride kernel launched with this many blocks an SM runs in one
    /// wave, where a fixed guess either leaves SMs idle or queues a second partial wave.
    pub(crate) fn resident_blocks(&self, f: &CudaFunction, name: &'static str, threads: u32) -> Result<usize> {
        if let Some(&n) = self.resident.lock().expect("occupancy cache poisoned").get(&(name, threads)) {
            return Ok(n);
        }
        let n = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(|e| NinferError::Device(format!("occupancy of {name} at {threads} threads: {e}")))?
            .max(1) as usize;
        self.resident.lock().expect("occupancy cache poisoned").insert((name, threads), n);
        Ok(n)
    }

    /// The kernel `name` of `family`, allowed at least `smem` bytes of dynamic shared memory a
    /// block (beyond the default 48 KiB needs the opt-in attribute, set once per kernel).
    pub(crate) fn function_with_smem(&self, family: KernelFamily, name: &'static str, smem: usize) -> Result<CudaFunction> {
        let f = self.function(family, name)?;
        if smem <= 48 * 1024 {
            return Ok(f); // within the default limit: nothing to raise, no lock on the launch path
        }
        if self.smem_optin > 0 && smem > self.smem_optin {
            // The driver would refuse it on the GPU the device runs as (here too where it is
            // emulated on a larger one): a route that did not check the limit.
            return Err(NinferError::Device(format!(
                "{name} needs {smem} bytes of shared memory a block; cuda:{} (compute capability {}.{}) allows {}",
                self.ordinal, self.compute_capability.0, self.compute_capability.1, self.smem_optin
            )));
        }
        let mut limits = self.smem_limits.lock().expect("smem limits poisoned");
        if limits.get(name).is_none_or(|&have| have < smem) {
            if self.smem_carveout.is_some() {
                // NINFER_SMEM_CARVEOUT is for the kernels within the default limit; one that
                // needs this much shared memory keeps the driver's carveout (its occupancy).
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    -1,
                )
                .map_err(|e| NinferError::Device(format!("resetting the shared-memory carveout of {name}: {e}")))?;
            }
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| NinferError::Device(format!("raising the shared-memory limit of {name} to {smem} bytes: {e}")))?;
            limits.insert(name, smem);
        }
        Ok(f)
    }

    /// The cuBLAS handle bound to this device's stream, created on first use.
    pub fn blas(&self) -> Result<Arc<CudaBlas>> {
        let mut slot = self.blas.lock().expect("cublas slot poisoned");
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        // SAFETY: only tries to dlopen libcublas by its candidate names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(NinferError::Device(
                "cuBLAS (libcublas.so.13 or .so.12) was not found on the library path".into(),
            ));
        }
        let b = Arc::new(
            CudaBlas::new(self.stream.clone())
                .map_err(|e| NinferError::Device(format!("creating the cuBLAS handle: {e:?}")))?,
        );
        // SAFETY: workspace bytes are only ever touched by cuBLAS.
        let ws = unsafe { self.stream.alloc::<u8>(BLAS_WORKSPACE_BYTES) }
            .map_err(driver_err("allocating the cuBLAS workspace"))?;
        let wp = cudarc::driver::DevicePtr::device_ptr(&ws, &self.stream).0;
        // SAFETY: the handle is live and the workspace outlives it (both dropped with the
        // device; the workspace is stored next to the handle).
        let st = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(*b.handle(), wp as *mut std::ffi::c_void, BLAS_WORKSPACE_BYTES)
        };
        if st != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(NinferError::Device(format!("cublasSetWorkspace: {st:?}")));
        }
        *self.blas_workspace.lock().expect("cublas workspace poisoned") = Some(ws);
        *slot = Some(b.clone());
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smem_carveout_setting_parses_or_names_the_bad_value() {
        assert_eq!(parse_smem_carveout(None).unwrap(), None);
        assert_eq!(parse_smem_carveout(Some(" auto ")).unwrap(), None);
        assert_eq!(parse_smem_carveout(Some("0")).unwrap(), Some(0));
        assert_eq!(parse_smem_carveout(Some("100")).unwrap(), Some(100));
        for bad in ["101", "-1", "half", "50%"] {
            let e = parse_smem_carveout(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(SMEM_CARVEOUT_VAR) && e.contains(bad), "{bad}: {e}");
        }
    }
}
