//! How much memory a plan may use: a GPU's free and total memory, asked from the device without
//! loading anything, or the host's available memory for the CPU backend.

use crate::{NinferError, Result};

/// Memory of the device a plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free now (what the plan may take).
    pub free: u64,
    /// Bytes of the whole device (sizes the reserve).
    pub total: u64,
    /// The CUDA device asked (None for the host and `--gpu-memory`, whose architecture the plan
    /// does not know, so it cannot refuse what only an f16-storage device would).
    pub cuda: Option<CudaArch>,
}

/// A CUDA device's ordinal and the compute capability its routes see (`NINFER_EMULATE_ARCH`'s
/// where set), which picks its storage type (`StorageDType::for_arch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaArch {
    pub ordinal: usize,
    pub compute_capability: (u32, u32),
}

impl CudaArch {
    /// The device as a plan's refusals name it.
    pub fn describe(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("cuda:{} (compute capability {major}.{minor})", self.ordinal)
    }
}

/// Free and total memory and the compute capability of CUDA device `ordinal`, from its driver (the context it creates is
/// the primary one a later load reuses). Without a GPU or a CUDA build, a `Device` error saying
/// why.
pub fn device_memory(ordinal: usize) -> Result<DeviceMemory> {
    let count = crate::backend::cuda::select::cuda_device_count().map_err(|e| {
        let why = match e {
            NinferError::Device(m) => m,
            e => e.to_string(),
        };
        NinferError::Device(format!("cuda:{ordinal} requested but {why}"))
    })?;
    if ordinal >= count {
        return Err(NinferError::Device(format!("device cuda:{ordinal} requested but {count} CUDA device(s) are present")));
    }
    query(ordinal)
}

#[cfg(feature = "cuda")]
fn query(ordinal: usize) -> Result<DeviceMemory> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| NinferError::Device(format!("cuda:{ordinal}: creating the CUDA context: {e}")))?;
    let (free, total) = ctx.mem_get_info().map_err(|e| NinferError::Device(format!("cuda:{ordinal}: reading free device memory: {e}")))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| NinferError::Device(format!("cuda:{ordinal}: reading the compute capability: {e}")))?;
    let real = (major as u32, minor as u32);
    let var = std::env::var(crate::backend::cuda::emulate::EMULATE_ARCH_VAR).ok();
    let compute_capability = crate::backend::cuda::emulate::parse_emulated_arch(real, var.as_deref())?.unwrap_or(real);
    Ok(DeviceMemory { free: free as u64, total: total as u64, cuda: Some(CudaArch { ordinal, compute_capability }) })
}

#[cfg(not(feature = "cuda"))]
fn query(ordinal: usize) -> Result<DeviceMemory> {
    Err(NinferError::Device(format!("cuda:{ordinal}: this build of ninfer has no CUDA backend (built without the `cuda` feature)")))
}

/// The host's available memory (`MemAvailable` of /proc/meminfo) as the CPU backend's
/// `DeviceMemory`; None where the system does not say.
pub fn host_available_bytes() -> Option<DeviceMemory> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        let kib: u64 = line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    };
    Some(DeviceMemory { free: field("MemAvailable:")?, total: field("MemTotal:")?, cuda: None })
}
