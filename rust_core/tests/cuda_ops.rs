//! CUDA kernels: NVRTC compilation for every CI architecture (no GPU needed), and op parity
//! against CPU references on the GPU (skipped with a printed reason where no GPU is present).
#![cfg(feature = "cuda")]

use ninfer_core::backend::cuda::kernels::{KernelFamily, StorageDType, CI_ARCHES};
use ninfer_core::backend::cuda::nvrtc;

/// Set by .ci/compile-kernels so that a missing NVRTC fails instead of skipping.
fn nvrtc_required() -> bool {
    std::env::var("NINFER_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn every_kernel_compiles_for_every_ci_arch() {
    if !nvrtc::nvrtc_available() {
        assert!(!nvrtc_required(), "NINFER_REQUIRE_NVRTC=1 but libnvrtc was not found");
        eprintln!("SKIP every_kernel_compiles_for_every_ci_arch: libnvrtc not found");
        return;
    }
    let (major, minor) = nvrtc::nvrtc_version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    let mut failures = Vec::new();
    let mut compiled = 0;
    for arch in CI_ARCHES {
        if major >= 13 && arch < 75 {
            eprintln!("NVRTC {major}.{minor} cannot target sm_{arch}; CI uses NVRTC 12.x for it");
            continue;
        }
        for family in KernelFamily::ALL {
            for storage in [StorageDType::Bf16, StorageDType::F16] {
                let arch_name = format!("sm_{arch}");
                match nvrtc::compile_cubin(family, &arch_name, storage) {
                    Ok(cubin) => {
                        assert!(cubin.len() > 64, "{} {arch_name}: empty cubin", family.file_name());
                        compiled += 1;
                    }
                    Err(e) => failures.push(e.to_string()),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} compile failures:\n{}", failures.len(), failures.join("\n\n"));
    eprintln!("compiled {compiled} (family, arch, storage) combinations");
}
