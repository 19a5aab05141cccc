//! Test harness for the CUDA op parity tests: device acquisition (skip with a reason where
//! there is none), seeded random inputs, storage-type rounding, poisoned and guarded output
//! buffers, and the normalised error every test reports.

use cudarc::driver::{CudaSlice, CudaViewMut};
use ninfer_core::backend::cuda::{cuda_device_count, CudaDevice, StorageDType};

/// Elements after every output that must stay untouched (catches out-of-bounds writes).
pub const GUARD: usize = 97;
/// Guard pattern for 16-bit outputs (a NaN payload no kernel produces).
const GUARD16: u16 = 0x7fa5;
/// Guard pattern for 32-bit outputs.
const GUARD32: u32 = 0x7fc0_beef;

/// Both storage types, bf16 first (the H200 path), f16 (the V100 path) second.
pub const STORAGES: [StorageDType; 2] = [StorageDType::Bf16, StorageDType::F16];

/// Opens GPU 0 with `storage`, or prints why the test is skipped and returns None.
pub fn gpu(test: &str, storage: StorageDType) -> Option<CudaDevice> {
    match cuda_device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            eprintln!("SKIP {test}: the CUDA driver reports no GPU");
            return None;
        }
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            return None;
        }
    }
    if !ninfer_core::backend::cuda::nvrtc::nvrtc_available() {
        eprintln!("SKIP {test}: a GPU is present but libnvrtc was not found");
        return None;
    }
    Some(CudaDevice::with_storage(0, storage).expect("opening cuda:0"))
}

/// Model hidden sizes whose default CUDA-core GEMV K split (`default_cc_ksplit`) is 1 and 2: a
/// GEMV test sets each on its device in turn (`use_model_cc_launch`), since the batch-1 loop
/// differs by split (cuda/gemv.cu `gemv_stream4`; the Qwen3.5-27B runs 1, the Llama-3-8B 2).
pub const HIDDEN_PER_KSPLIT: [usize; 2] = [5120, 4096];

/// Small deterministic generator (xorshift64*), so failures reproduce from the seed.
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (v >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.unit() as f64) * n as f64) as usize % n.max(1)
    }
    /// `n` values uniform in [lo, hi).
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.range(lo, hi)).collect()
    }
    /// A random permutation of 0..n.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

/// f32 -> storage bits.
pub fn to_bits(v: &[f32], st: StorageDType) -> Vec<u16> {
    match st {
        StorageDType::Bf16 => v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect(),
        StorageDType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect(),
    }
}

/// storage bits -> f32.
pub fn from_bits(v: &[u16], st: StorageDType) -> Vec<f32> {
    match st {
        StorageDType::Bf16 => v.iter().map(|&x| half::bf16::from_bits(x).to_f32()).collect(),
        StorageDType::F16 => v.iter().map(|&x| half::f16::from_bits(x).to_f32()).collect(),
    }
}

/// Rounds f32 values to the storage type (the values the GPU sees), back as f32.
pub fn rounded(v: &[f32], st: StorageDType) -> Vec<f32> {
    from_bits(&to_bits(v, st), st)
}

/// Uploads f32 values as storage bits.
pub fn upload(dev: &CudaDevice, v: &[f32]) -> CudaSlice<u16> {
    dev.stream().clone_htod(&to_bits(v, dev.storage())).expect("upload")
}

/// Uploads any plain values.
pub fn upload_raw<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, v: &[T]) -> CudaSlice<T> {
    dev.stream().clone_htod(v).expect("upload")
}

/// A 16-bit output of `n` elements, poisoned with NaN and followed by a guard region.
pub struct Out16 {
    buf: CudaSlice<u16>,
    n: usize,
}

impl Out16 {
    /// Allocates and poisons.
    pub fn new(dev: &CudaDevice, n: usize) -> Self {
        let mut host = vec![0x7fc0u16; n];
        host.extend(std::iter::repeat_n(GUARD16, GUARD));
        Out16 { buf: dev.stream().clone_htod(&host).expect("alloc"), n }
    }
    /// Like `new` but starting from `init` (in-place ops), then the guard.
    pub fn with(dev: &CudaDevice, init: &[f32]) -> Self {
        let mut host = to_bits(init, dev.storage());
        host.extend(std::iter::repeat_n(GUARD16, GUARD));
        Out16 { buf: dev.stream().clone_htod(&host).expect("alloc"), n: init.len() }
    }
    /// The first `n` elements, as the op's output argument.
    pub fn view(&mut self) -> CudaViewMut<'_, u16> {
        let n = self.n;
        self.buf.slice_mut(0..n)
    }
    /// Reads back, checks the guard and that nothing is left poisoned (NaN), returns f32.
    pub fn read(&self, dev: &CudaDevice, what: &str) -> Vec<f32> {
        dev.synchronize().expect("synchronize");
        let host = dev.stream().clone_dtoh(&self.buf).expect("download");
        let (data, guard) = host.split_at(self.n);
        assert!(guard.iter().all(|&g| g == GUARD16), "{what}: write past the end of the output");
        let v = from_bits(data, dev.storage());
        if let Some(i) = v.iter().position(|x| x.is_nan()) {
            panic!("{what}: element {i} of {} left unwritten (NaN)", self.n);
        }
        v
    }
}

/// An f32 output, poisoned with NaN and followed by a guard region.
pub struct Out32 {
    buf: CudaSlice<f32>,
    n: usize,
}

impl Out32 {
    /// Allocates and poisons.
    pub fn new(dev: &CudaDevice, n: usize) -> Self {
        Self::with(dev, &vec![f32::NAN; n])
    }
    /// Starts from `init` (in-place state), then the guard.
    pub fn with(dev: &CudaDevice, init: &[f32]) -> Self {
        let mut host = init.to_vec();
        host.extend(std::iter::repeat_n(f32::from_bits(GUARD32), GUARD));
        Out32 { buf: dev.stream().clone_htod(&host).expect("alloc"), n: init.len() }
    }
    /// The first `n` elements.
    pub fn view(&mut self) -> CudaViewMut<'_, f32> {
        let n = self.n;
        self.buf.slice_mut(0..n)
    }
    /// Reads back, checks guard and poison.
    pub fn read(&self, dev: &CudaDevice, what: &str) -> Vec<f32> {
        dev.synchronize().expect("synchronize");
        let host = dev.stream().clone_dtoh(&self.buf).expect("download");
        let (data, guard) = host.split_at(self.n);
        assert!(
            guard.iter().all(|g| g.to_bits() == GUARD32),
            "{what}: write past the end of the output"
        );
        if let Some(i) = data.iter().position(|x| x.is_nan()) {
            panic!("{what}: element {i} of {} left unwritten (NaN)", self.n);
        }
        data.to_vec()
    }
}

/// An i32 output poisoned with i32::MIN and followed by a guard region.
pub struct OutI32 {
    buf: CudaSlice<i32>,
    n: usize,
}

impl OutI32 {
    /// Allocates and poisons.
    pub fn new(dev: &CudaDevice, n: usize) -> Self {
        let mut host = vec![i32::MIN; n];
        host.extend(std::iter::repeat_n(0x5eed, GUARD));
        OutI32 { buf: dev.stream().clone_htod(&host).expect("alloc"), n }
    }
    /// The first `n` elements.
    pub fn view(&mut self) -> CudaViewMut<'_, i32> {
        let n = self.n;
        self.buf.slice_mut(0..n)
    }
    /// Reads back, checks guard and poison.
    pub fn read(&self, dev: &CudaDevice, what: &str) -> Vec<i32> {
        dev.synchronize().expect("synchronize");
        let host = dev.stream().clone_dtoh(&self.buf).expect("download");
        let (data, guard) = host.split_at(self.n);
        assert!(guard.iter().all(|&g| g == 0x5eed), "{what}: write past the end of the output");
        assert!(!data.contains(&i32::MIN), "{what}: output left unwritten");
        data.to_vec()
    }
}

/// max |got - want| / max |want|: the error relative to the output's scale.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    let diff = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// Asserts `rel_err <= tol` and prints a PARITY line that the GPU run's summary collects.
pub fn check(op: &str, st: StorageDType, shape: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    println!("PARITY op={op} storage={} shape={shape} rel_err={e:.3e} tol={tol:.0e}", st.name());
    assert!(e <= tol, "{op} ({}, {shape}): rel err {e:.3e} > {tol:.0e}", st.name());
}

/// Tolerance for outputs in storage precision.
pub fn tol16(st: StorageDType) -> f32 {
    match st {
        StorageDType::Bf16 => 1e-2,
        StorageDType::F16 => 5e-3,
    }
}

/// Tolerance for f32 outputs.
pub const TOL32: f32 = 1e-4;

/// `dev`'s GPU opened again with the plan of a model of hidden size `hidden` (its CUDA-core
/// GEMV K split and block, plan/defaults.rs), after `dev`'s queued work: the GEMV tests run each
/// of HIDDEN_PER_KSPLIT on the buffers `dev` uploaded.
pub fn model_device(dev: &CudaDevice, hidden: usize) -> CudaDevice {
    use ninfer_core::backend::cuda::plan::ModelShape;
    dev.synchronize().expect("synchronizing cuda:0");
    CudaDevice::open(dev.ordinal(), Some(dev.storage()), ModelShape { hidden_size: Some(hidden) }, &Default::default()).expect("opening cuda:0 for a model")
}

/// `dev`'s GPU opened again with a device profile whose `plan` object is `plan_json` (plan/
/// profile.rs), after `dev`'s queued work: tests of the routes a profile may set.
pub fn profile_device(dev: &CudaDevice, plan_json: &str) -> CudaDevice {
    use ninfer_core::backend::cuda::plan::ModelShape;
    use ninfer_core::config::CudaOptions;
    dev.synchronize().expect("synchronizing cuda:0");
    let (major, minor) = dev.compute_capability();
    let path = std::env::temp_dir().join(format!("ninfer_profile_{}_{}.json", std::process::id(), plan_json.len()));
    let text = format!(r#"{{"version": 1, "device": {:?}, "compute_capability": "{major}.{minor}", "plan": {plan_json}}}"#, dev.name());
    std::fs::write(&path, text).expect("writing the test profile");
    let options = CudaOptions { profile: Some(path.clone()), ..CudaOptions::default() };
    let d = CudaDevice::open(dev.ordinal(), Some(dev.storage()), ModelShape::default(), &options).expect("opening cuda:0 with a profile");
    let _ = std::fs::remove_file(path);
    d
}
