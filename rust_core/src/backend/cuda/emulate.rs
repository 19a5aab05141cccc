//! `NINFER_EMULATE_ARCH`: run a GPU as an older one, so that the code an A100, an RTX 30/40 or a
//! T4 runs can be executed and tested on the one GPU kind at hand (an H200).
//!
//! Why: every route below sm_90a (the mma.sync prefill attention, the CUDA-core and mma.sync
//! decode forms, the f16 storage of sm_7x, launches without programmatic dependent launch) is
//! chosen by the compute capability, so on an H200 it is compiled but never run. With the
//! variable set, the device reports the named capability to every route, its kernels are
//! compiled by NVRTC to PTX for that architecture (`compute_XY`: the same source paths, the same
//! `__CUDA_ARCH__`, as the real GPU compiles) and the driver JIT-compiles the PTX for the GPU
//! present (PTX runs on any newer GPU), and the shared memory a block may opt into is that GPU's
//! (`smem_optin_of`), so the routes that size tiles by it pick what they pick there.
//!
//! What it does not emulate: the SM count, the L2 size, clocks and bandwidth (timings mean
//! nothing for the named GPU), and instructions the older GPU lacks but the PTX never uses.
//! A testing tool: docs/kernels.md, "Running older architectures' code on a newer GPU".

use super::kernels::CI_ARCHES;
use crate::{NinferError, Result};

/// The variable naming the compute capability to run as (`80`, `8.0` or `sm_80`).
pub const EMULATE_ARCH_VAR: &str = "NINFER_EMULATE_ARCH";

/// The capability `value` of `NINFER_EMULATE_ARCH` names on a device of capability `real`:
/// None when unset or blank. It must be an architecture the kernels are built for
/// (`CI_ARCHES`) and older than the device, whose driver then JIT-compiles PTX of that
/// architecture; anything else is an error naming the variable, the value and the device.
pub fn parse_emulated_arch(real: (u32, u32), value: Option<&str>) -> Result<Option<(u32, u32)>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(None) };
    let digits: String = v.trim_start_matches("sm_").chars().filter(|c| *c != '.').collect();
    let cc = digits
        .parse::<u32>()
        .ok()
        .filter(|n| CI_ARCHES.contains(n))
        .map(|n| (n / 10, n % 10))
        .ok_or_else(|| {
            NinferError::config(EMULATE_ARCH_VAR, format!("expected a compute capability of {CI_ARCHES:?} (e.g. 80, 8.0 or sm_80), got {v:?}"))
        })?;
    if cc >= real {
        return Err(NinferError::config(
            EMULATE_ARCH_VAR,
            format!("{v:?} is not older than the device's own compute capability {}.{}: a GPU runs the PTX of its own or older architectures only", real.0, real.1),
        ));
    }
    Ok(Some(cc))
}

/// Dynamic shared memory one block may opt into on a GPU of capability `cc`, bytes (the CUDA
/// programming guide's table of compute capabilities), or None for one not in it.
pub fn smem_optin_of(cc: (u32, u32)) -> Option<usize> {
    Some(match cc {
        (7, 0) | (7, 2) => 96 * 1024,
        (7, 5) => 64 * 1024,
        (8, 0) | (8, 7) => 163 * 1024,
        (8, 6) | (8, 9) => 99 * 1024,
        (9, 0) => 227 * 1024,
        _ => return None,
    })
}

/// The NVRTC target for PTX of capability `cc` ("compute_80"): the image `nvrtc` compiles for a
/// device that runs as `cc` and the driver JIT-compiles.
pub fn ptx_arch(cc: (u32, u32)) -> String {
    format!("compute_{}{}", cc.0, cc.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_or_blank_runs_the_device_as_itself() {
        assert_eq!(parse_emulated_arch((9, 0), None).unwrap(), None);
        assert_eq!(parse_emulated_arch((9, 0), Some("  ")).unwrap(), None);
    }

    #[test]
    fn the_three_spellings_name_an_older_architecture() {
        for v in ["80", "8.0", "sm_80", " 8.0 "] {
            assert_eq!(parse_emulated_arch((9, 0), Some(v)).unwrap(), Some((8, 0)), "{v}");
        }
        assert_eq!(parse_emulated_arch((9, 0), Some("7.5")).unwrap(), Some((7, 5)));
        assert_eq!(parse_emulated_arch((8, 9), Some("86")).unwrap(), Some((8, 6)));
    }

    #[test]
    fn an_unknown_or_unbuilt_architecture_is_an_error_naming_the_variable_and_value() {
        for v in ["ampere", "81", "sm_101", "6.1"] {
            let e = parse_emulated_arch((9, 0), Some(v)).unwrap_err().to_string();
            assert!(e.contains(EMULATE_ARCH_VAR) && e.contains(v.trim()), "{e}");
            assert!(e.contains("[70, 75, 80, 86, 89, 90, 100, 120]"), "{e}");
        }
    }

    #[test]
    fn the_device_itself_or_a_newer_architecture_is_refused_naming_the_device() {
        for v in ["90", "9.0"] {
            let e = parse_emulated_arch((9, 0), Some(v)).unwrap_err().to_string();
            assert!(e.contains("not older than the device's own compute capability 9.0"), "{e}");
        }
        let e = parse_emulated_arch((8, 0), Some("86")).unwrap_err().to_string();
        assert!(e.contains("8.0") && e.contains(EMULATE_ARCH_VAR), "{e}");
    }

    #[test]
    fn shared_memory_limits_follow_the_named_gpu() {
        assert_eq!(smem_optin_of((8, 0)), Some(166_912));
        assert_eq!(smem_optin_of((8, 6)), Some(101_376));
        assert_eq!(smem_optin_of((7, 5)), Some(65_536));
        assert_eq!(smem_optin_of((9, 0)), Some(232_448));
        assert_eq!(smem_optin_of((6, 1)), None);
        assert_eq!(ptx_arch((8, 6)), "compute_86");
    }
}
