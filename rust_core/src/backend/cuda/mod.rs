//! CUDA backend: device layer, NVRTC kernel pipeline and typed launchers for every GPU op.
//!
//! Everything here loads the CUDA libraries with dlopen at first use (cudarc's dynamic
//! loading), so a build with the `cuda` feature links and runs on machines without CUDA and
//! reports a typed `NinferError::Device` where a GPU is asked for but absent. Device selection
//! (`select`) is compiled in every build. Buffers in storage precision (bf16, or f16 on sm_7x)
//! are `CudaSlice<u16>` holding the raw bits; math in the kernels is f32.

pub mod select;

#[cfg(feature = "cuda")]
pub mod arena;
#[cfg(feature = "cuda")]
pub mod blas;
#[cfg(feature = "cuda")]
pub mod blaslt;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod emulate;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod plan;
#[cfg(feature = "cuda")]
pub mod transfer;

pub use select::{cuda_device_count, resolve_device, DeviceSpec, ResolvedDevice};

#[cfg(feature = "cuda")]
pub use device::CudaDevice;
#[cfg(feature = "cuda")]
pub use kernels::{KernelFamily, StorageDType};
