//! One CUDA device as the engine uses it: context, the stream every op is queued on, the
//! storage type its kernels were built for, lazily loaded kernel modules, a lazily created
//! cuBLAS handle, and the route plan made for it when it was opened (backend/cuda/plan).
//!
//! The stream is a dedicated non-blocking stream, not the legacy default stream: CUDA graph
//! capture (decode steps are captured and replayed) is impossible on the legacy stream, and
//! cuBLAS gets a preallocated workspace so that a captured GEMM never allocates.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use rayon::prelude::*;

use super::kernels::{KernelFamily, StorageDType};
use super::nvrtc;
use super::plan::{DeviceFacts, ModelShape, Plan};
use crate::config::CudaOptions;
use crate::{NinferError, Result};

/// Maps a driver error to `NinferError::Device`, naming what was being done.
pub(crate) fn driver_err(what: &'static str) -> impl Fn(DriverError) -> NinferError {
    move |e| NinferError::Device(format!("{what}: {e}"))
}

/// A CUDA device with its stream and kernel modules, and the route plan every launch on it
/// follows (backend/cuda/plan). Ops (`ops::*`) are methods on it.
pub struct CudaDevice {
    ordinal: usize,
    /// The GPU's own capability where `NINFER_EMULATE_ARCH` names another (emulate.rs): its
    /// kernels are then PTX for the plan's capability, JIT-compiled by the driver.
    emulating: Option<(u32, u32)>,
    storage: StorageDType,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<HashMap<KernelFamily, Arc<CudaModule>>>,
    /// Loaded kernels by family and name: families may share a kernel name and not its code
    /// (quant_ninfer.cu compiles only Q4G64_F16S's form of the tiled GEMVs quant_hf.cu also has).
    functions: Mutex<HashMap<(KernelFamily, &'static str), CudaFunction>>,
    /// Dynamic shared memory each kernel was allowed (`function_with_smem`): the limit is raised
    /// once per kernel, not per launch (a driver call the launch does not need).
    smem_limits: Mutex<HashMap<(KernelFamily, &'static str), usize>>,
    /// Whether tiled 4-bit GEMVs run the ring form (`set_q4_ring`; the pass form by default).
    q4_ring: std::sync::atomic::AtomicBool,
    /// Blocks of a kernel resident on one SM at a block size (`resident_blocks`): asked of the
    /// driver once per kernel and size, not per launch.
    resident: Mutex<HashMap<(&'static str, u32), usize>>,
    blas: Mutex<Option<Arc<CudaBlas>>>,
    /// cuBLAS workspace, bound to the handle for its whole life (capture forbids allocation).
    blas_workspace: Mutex<Option<cudarc::driver::CudaSlice<u8>>>,
    /// The cuBLASLt handle of the FP8 GEMM (blaslt.rs), created on first use.
    pub(super) blas_lt: Mutex<Option<Arc<super::blaslt::BlasLt>>>,
    /// The persistent prefill attention's work counters (ops/flash_attention.rs): zero between
    /// launches (the last block of a launch zeroes them), allocated here so that no launch
    /// allocates. One stream orders every launch, so one pair serves them all.
    fa_work: cudarc::driver::CudaSlice<u32>,
    /// Every route decision, made once when the device is opened for a model.
    plan: Plan,
}

/// cuBLAS workspace bytes: what NVIDIA recommends for Hopper (32 MiB; 4 MiB is enough on older
/// GPUs, the difference is negligible next to the weights).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl CudaDevice {
    /// Opens device `ordinal` with the storage type its architecture suits (bf16 on sm_80+) and
    /// the default plan of a device without a model (the op tests).
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::open(ordinal, None, ModelShape::default(), &CudaOptions::default())
    }

    /// Opens device `ordinal` with an explicit storage type (tests run both).
    pub fn with_storage(ordinal: usize, storage: StorageDType) -> Result<Self> {
        Self::open(ordinal, Some(storage), ModelShape::default(), &CudaOptions::default())
    }

    /// Opens device `ordinal` for a model of shape `model` under `options`: the plan every
    /// launch of the model follows (`Plan::build`, which reads the options' device profile).
    pub fn for_model(ordinal: usize, model: ModelShape, options: &CudaOptions) -> Result<Self> {
        Self::open(ordinal, None, model, options)
    }

    /// Opens device `ordinal` with the storage type given (else its architecture's) and the plan
    /// of a model of shape `model` under `options`.
    pub fn open(ordinal: usize, storage: Option<StorageDType>, model: ModelShape, options: &CudaOptions) -> Result<Self> {
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
        // Every route sees the emulated capability (emulate.rs).
        let (major, minor) = emulated.unwrap_or(real);
        let nvrtc_major = super::nvrtc::nvrtc_version().map_or(0, |v| v.0);
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
        let name = ctx.name().map_err(driver_err("reading the device name"))?;
        let facts = DeviceFacts { name: name.clone(), compute_capability: (major, minor), sm_count, smem_optin, nvrtc_major };
        let plan = Plan::build(&facts, model, options)?;
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
            emulating: emulated.map(|_| real),
            storage: storage.unwrap_or_else(|| StorageDType::for_arch(major, minor)),
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            smem_limits: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
            q4_ring: std::sync::atomic::AtomicBool::new(false),
            blas: Mutex::new(None),
            blas_workspace: Mutex::new(None),
            blas_lt: Mutex::new(None),
            fa_work,
            plan,
        })
    }

    /// Device ordinal (N of cuda:N).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Name as the driver reports it ("NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.plan.facts.name
    }

    /// Compute capability (major, minor) every route sees.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.plan.facts.compute_capability
    }

    /// Dynamic shared memory one block may opt into, bytes (0 if the driver does not say).
    pub fn smem_optin(&self) -> usize {
        self.plan.facts.smem_optin
    }

    /// NVRTC architecture name the kernels are compiled for ("sm_90a" on an H200, "sm_86", ...;
    /// "compute_80" for PTX where `NINFER_EMULATE_ARCH` names 8.0).
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability();
        match self.emulating {
            Some(_) => super::emulate::ptx_arch((major, minor)),
            None => super::kernels::nvrtc_arch(major, minor),
        }
    }

    /// "cuda:N (name, arch)": the device as its refusals name it.
    pub fn describe(&self) -> String {
        format!("cuda:{} ({}, {})", self.ordinal(), self.name(), self.arch())
    }

    /// The GPU's own compute capability where `NINFER_EMULATE_ARCH` makes it run as another
    /// (`compute_capability`), else None.
    pub fn emulating(&self) -> Option<(u32, u32)> {
        self.emulating
    }

    /// Runs the tiled 4-bit GEMVs in the ring form (true) or the pass form (false): one form for
    /// every weight of the device, set by the model load (the plan's `q4_ring`, else
    /// `quant_tiles::q4t_ring` of its smallest quantized K); the two give the same bits.
    pub fn set_q4_ring(&self, ring: bool) {
        self.q4_ring.store(ring, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the tiled 4-bit GEMVs run the ring form (`set_q4_ring`).
    pub fn q4_ring(&self) -> bool {
        self.q4_ring.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The route plan every launch on this device follows.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether kernels that support it are launched with Programmatic Dependent Launch.
    pub fn pdl(&self) -> bool {
        self.plan.pdl
    }

    /// Whether every route is independent of the batch size: a sequence decoded in a batch
    /// equals it decoded alone bit for bit.
    pub fn batch_invariant(&self) -> bool {
        self.plan.batch_invariant
    }

    /// Major version of the loaded NVRTC (0 where none loads).
    pub fn nvrtc_major(&self) -> i32 {
        self.plan.facts.nvrtc_major
    }

    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> usize {
        self.plan.facts.sm_count
    }

    /// The persistent prefill attention's two work counters (zero between its launches).
    pub(crate) fn fa_work(&self) -> &cudarc::driver::CudaSlice<u32> {
        &self.fa_work
    }

    /// The GEMV form every decode projection of this device runs.
    pub fn gemv_form(&self) -> super::ops::GemvForm {
        self.plan.gemv_form
    }

    /// The kernel a weight of `rows` x `k` runs in GEMV form `form` for a launch of `m` rows
    /// under this device's plan: `ops::gemv_kernel` over the plan's table.
    pub fn gemv_kernel(&self, form: super::ops::GemvForm, rows: usize, k: usize, m: usize) -> super::ops::GemvKernel {
        super::ops::gemv_kernel(form, &self.plan.gemv_rules, rows, k, m)
    }

    /// k32 steps per block the tensor-core GEMV prefetches before its PDL wait.
    pub fn tc_prefetch_steps(&self) -> u32 {
        self.plan.tc_prefetch_steps
    }

    /// Warps a block of the CUDA-core GEMV.
    pub fn cc_warps(&self) -> usize {
        self.plan.cc_warps
    }

    /// Warps of a CUDA-core GEMV block that share one warp's columns for a weight of `rows` x
    /// `k`: one split for every weight of the model, so the fused forms sum as their unfused
    /// pairs.
    pub fn cc_ksplit_for(&self, _rows: usize, _k: usize) -> usize {
        self.plan.cc_ksplit
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

    /// Compiles (or reads from the disk cache) and loads every kernel family a dense model runs
    /// on this arch now, so that the first request does not pay for it; the quantized-weight
    /// families load with the first quantized weight (`upload_quant`).
    pub fn load_all_kernels(&self) -> Result<()> {
        let (major, minor) = self.compute_capability();
        let dense: Vec<KernelFamily> = KernelFamily::ALL.into_iter().filter(|f| !f.is_quant() && f.serves(major, minor)).collect();
        self.load_kernel_families(&dense)
    }

    /// Compiles (or reads from the disk cache) and loads `families` now.
    pub fn load_kernel_families(&self, families: &[KernelFamily]) -> Result<()> {
        // NVRTC compiles are independent and single-threaded: fill the disk cache for all
        // families in parallel first, so that a cold start costs the slowest one, not the sum.
        let arch = self.arch();
        families.par_iter().try_for_each(|&f| nvrtc::cached_image(f, &arch, self.storage).map(|_| ()))?;
        for &family in families {
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
        let (major, minor) = self.compute_capability();
        if !family.serves(major, minor) {
            return Err(NinferError::Device(format!("cuda/{} is built for sm_{}+ only; {arch} has no route to it", family.file_name(), family.min_arch())));
        }
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
        if let Some(f) = self.functions.lock().expect("function cache poisoned").get(&(family, name)) {
            return Ok(f.clone());
        }
        let module = self.module(family)?;
        let f = module.load_function(name).map_err(|e| {
            NinferError::Device(format!("kernel {name} missing from cuda/{}: {e}", family.file_name()))
        })?;
        if let Some(pct) = self.plan.smem_carveout {
            f.set_attribute(cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, pct)
                .map_err(|e| NinferError::Device(format!("setting the shared-memory carveout of {name} to {pct}%: {e}")))?;
        }
        self.functions.lock().expect("function cache poisoned").insert((family, name), f.clone());
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
        if self.smem_optin() > 0 && smem > self.smem_optin() {
            // The driver would refuse it on the GPU the device runs as (here too where it is
            // emulated on a larger one): a route that did not check the limit.
            return Err(NinferError::Device(format!(
                "{name} needs {smem} bytes of shared memory a block; cuda:{} (compute capability {}.{}) allows {}",
                self.ordinal, self.compute_capability().0, self.compute_capability().1, self.smem_optin()
            )));
        }
        let mut limits = self.smem_limits.lock().expect("smem limits poisoned");
        if limits.get(&(family, name)).is_none_or(|&have| have < smem) {
            if self.plan.smem_carveout.is_some() {
                // The plan's carveout is for the kernels within the default limit; one that
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
            limits.insert((family, name), smem);
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
