//! NVRTC compilation of the kernel families to cubin (or to PTX for a device that runs as an
//! older architecture, `emulate.rs`), with an on-disk cache.
//!
//! Compiling at first use on the target (rather than in build.rs) means the wheel needs no CUDA
//! toolkit to build and each GPU gets machine code for its exact architecture from the NVRTC it
//! has. The cubin is cached under `$NINFER_KERNEL_CACHE` (default `~/.cache/ninfer/kernels`)
//! keyed by a hash of the sources, options and NVRTC version, so only the first start pays.

use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys;

use super::kernels::{KernelFamily, StorageDType, HEADERS};
use crate::{NinferError, Result};

/// True when an NVRTC library can be loaded (libnvrtc.so.13 or .so.12 on the loader path).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

fn check(what: &str, family: KernelFamily, arch: &str, r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(NinferError::Device(format!(
            "NVRTC {what} failed for cuda/{} ({arch}): {r:?}",
            family.file_name()
        )))
    }
}

/// The loaded NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_available() {
        return Err(no_nvrtc());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(NinferError::Device(format!("nvrtcVersion failed: {r:?}")));
    }
    Ok((major, minor))
}

fn no_nvrtc() -> NinferError {
    NinferError::Device(
        "NVRTC (libnvrtc.so.13 or libnvrtc.so.12) was not found on the library path; install \
         nvidia-cuda-nvrtc-cu12 (or the CUDA toolkit) and add its lib folder to LD_LIBRARY_PATH"
            .into(),
    )
}

/// The NVRTC options for one family compiled for `arch` (e.g. "sm_90") with `storage`.
fn options(arch: &str, storage: StorageDType) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    o.extend(storage.defines().iter().map(|d| d.to_string()));
    o
}

/// Compiles one family for `arch` without the cache: to cubin for a real architecture ("sm_70"
/// ... "sm_90a"), to PTX text for a virtual one ("compute_80", which the driver JIT-compiles for
/// the GPU present: `emulate.rs`). A compile error carries NVRTC's log, which names the file
/// and line.
pub fn compile_image(family: KernelFamily, arch: &str, storage: StorageDType) -> Result<Vec<u8>> {
    if !nvrtc_available() {
        return Err(no_nvrtc());
    }
    let src = CString::new(family.source()).expect("kernel sources contain no NUL");
    let name = CString::new(family.file_name()).expect("file names contain no NUL");
    let texts: Vec<CString> = HEADERS.iter().map(|(_, text)| CString::new(*text).expect("headers contain no NUL")).collect();
    let names: Vec<CString> = HEADERS.iter().map(|(name, _)| CString::new(*name).expect("header names contain no NUL")).collect();
    let headers: Vec<*const c_char> = texts.iter().map(|t| t.as_ptr()).collect();
    let header_names: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let opts: Vec<CString> = options(arch, storage)
        .into_iter()
        .map(|o| CString::new(o).expect("options contain no NUL"))
        .collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: all strings are NUL-terminated and outlive the program; the program is destroyed
    // before returning on every path below.
    unsafe {
        check(
            "create",
            family,
            arch,
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                headers.len() as c_int,
                headers.as_ptr(),
                header_names.as_ptr(),
            ),
        )?;
        let compiled = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
        let result = if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
            Err(NinferError::Device(format!(
                "NVRTC could not compile cuda/{} for {arch} ({}): {compiled:?}\n{}",
                family.file_name(),
                storage.name(),
                program_log(prog)
            )))
        } else {
            read_image(prog, family, arch)
        };
        sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// # Safety
/// `prog` must be a live NVRTC program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut buf = vec![0u8; size.max(1)];
    sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char);
    String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string()
}

/// Whether `arch` is a virtual architecture ("compute_80"), compiled to PTX rather than cubin.
pub fn is_ptx_arch(arch: &str) -> bool {
    arch.starts_with("compute_")
}

/// # Safety
/// `prog` must be a successfully compiled NVRTC program.
unsafe fn read_image(prog: sys::nvrtcProgram, family: KernelFamily, arch: &str) -> Result<Vec<u8>> {
    let mut size = 0usize;
    if is_ptx_arch(arch) {
        check("PTX size", family, arch, sys::nvrtcGetPTXSize(prog, &mut size))?;
        let mut buf = vec![0u8; size];
        check("PTX", family, arch, sys::nvrtcGetPTX(prog, buf.as_mut_ptr() as *mut c_char))?;
        // The driver takes PTX as a C string: the text without its terminating NUL.
        while buf.last() == Some(&0) {
            buf.pop();
        }
        return Ok(buf);
    }
    check("cubin size", family, arch, sys::nvrtcGetCUBINSize(prog, &mut size))?;
    let mut buf = vec![0u8; size];
    check("cubin", family, arch, sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char))?;
    Ok(buf)
}

/// FNV-1a, 64 bit: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Folder of cached cubins: `$NINFER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ninfer/kernels`,
/// else `~/.cache/ninfer/kernels`, else a folder under the system temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NINFER_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("ninfer").join("kernels");
    }
    if let Some(d) = std::env::var_os("HOME") {
        return PathBuf::from(d).join(".cache").join("ninfer").join("kernels");
    }
    std::env::temp_dir().join("ninfer-kernels")
}

/// The cubin (PTX for a `compute_XY` arch) of `family` for `arch`, from the disk cache or
/// compiled (and then cached). A cache that cannot be written is not an error: the image is
/// simply rebuilt next time.
pub fn cached_image(family: KernelFamily, arch: &str, storage: StorageDType) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let version = format!("{major}.{minor}");
    let opts = options(arch, storage).join(" ");
    let mut parts: Vec<&[u8]> = vec![family.source().as_bytes()];
    parts.extend(HEADERS.iter().map(|(_, text)| text.as_bytes()));
    parts.extend([opts.as_bytes(), version.as_bytes()]);
    let key = fnv1a(&parts);
    let stem = family.file_name().trim_end_matches(".cu");
    let ext = if is_ptx_arch(arch) { "ptx" } else { "cubin" };
    let path = cache_dir().join(format!("{stem}-{}-{arch}-{key:016x}.{ext}", storage.name()));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok(bytes);
        }
    }
    let image = compile_image(family, arch, storage)?;
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &image).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(image)
}
