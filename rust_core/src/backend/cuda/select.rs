//! Device selection: turns the user's `device` string ("auto", "cpu", "cuda", "cuda:N") into
//! the device the engine runs on.
//!
//! Compiled in every build so that a CPU-only build can still answer `device="cuda"` with a
//! clear error instead of an unknown-option failure. `auto` takes GPU 0 when a driver and a GPU
//! are present and otherwise logs one line saying why it fell back to the CPU.

use crate::{NinferError, Result};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The GPU when one is usable, else the CPU (with a log line).
    Auto,
    /// The CPU backend.
    Cpu,
    /// CUDA device N (`cuda` means N = 0).
    Cuda(usize),
}

/// The device the engine will run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResolvedDevice {
    /// The CPU backend.
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Parses "auto", "cpu", "cuda", "cuda:N" (case-insensitive, surrounding spaces ignored).
    pub fn parse(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            _ => match t.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
                _ => Err(NinferError::config(
                    "device",
                    format!("`{s}` is not a device; use auto, cpu, cuda or cuda:N"),
                )),
            },
        }
    }
}

/// Number of CUDA devices, or why there are none usable (no driver, no GPU, a build without
/// the `cuda` feature).
pub fn cuda_device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::{result, sys};
        // SAFETY: only tries to dlopen libcuda by its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(NinferError::Device(
                "no CUDA driver found (libcuda.so.1 is not on the library path)".into(),
            ));
        }
        result::init().map_err(|e| NinferError::Device(format!("cuInit failed: {e}")))?;
        let n = result::device::get_count()
            .map_err(|e| NinferError::Device(format!("cuDeviceGetCount failed: {e}")))?;
        Ok(n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(NinferError::Device(
            "this build of ninfer has no CUDA backend (built without the `cuda` feature)".into(),
        ))
    }
}

/// Resolves a spec to a device. Asking for CUDA where there is none, or for an ordinal past the
/// last GPU, is a `NinferError::Device` that says which; `auto` never fails.
pub fn resolve_device(spec: DeviceSpec) -> Result<ResolvedDevice> {
    match spec {
        DeviceSpec::Cpu => Ok(ResolvedDevice::Cpu),
        DeviceSpec::Cuda(n) => {
            let count = cuda_device_count()
                .map_err(|e| NinferError::Device(format!("device cuda:{n} requested but {e}")))?;
            if n >= count {
                return Err(NinferError::Device(format!(
                    "device cuda:{n} requested but {count} CUDA device(s) are present"
                )));
            }
            Ok(ResolvedDevice::Cuda(n))
        }
        DeviceSpec::Auto => match cuda_device_count() {
            Ok(n) if n > 0 => Ok(ResolvedDevice::Cuda(0)),
            Ok(_) => {
                eprintln!("ninfer: device=auto: the CUDA driver reports no GPU; using the CPU");
                Ok(ResolvedDevice::Cpu)
            }
            Err(e) => {
                eprintln!("ninfer: device=auto: {e}; using the CPU");
                Ok(ResolvedDevice::Cpu)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_strings_parse_to_specs() {
        assert_eq!(DeviceSpec::parse("auto").unwrap(), DeviceSpec::Auto);
        assert_eq!(DeviceSpec::parse(" CPU ").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("cuda").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
    }

    #[test]
    fn malformed_device_strings_are_config_errors() {
        for bad in ["cuda:", "cuda:x", "tpu", "cuda:-1"] {
            match DeviceSpec::parse(bad) {
                Err(NinferError::Config { field, .. }) => assert_eq!(field, "device"),
                other => panic!("{bad}: expected a config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn cpu_and_auto_always_resolve() {
        assert_eq!(resolve_device(DeviceSpec::Cpu).unwrap(), ResolvedDevice::Cpu);
        assert!(resolve_device(DeviceSpec::Auto).is_ok());
    }

    #[test]
    fn cuda_past_the_last_gpu_is_a_device_error() {
        match resolve_device(DeviceSpec::Cuda(1 << 20)) {
            Err(NinferError::Device(msg)) => assert!(msg.contains("cuda:1048576"), "{msg}"),
            other => panic!("expected a device error, got {other:?}"),
        }
    }
}
