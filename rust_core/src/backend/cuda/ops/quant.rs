//! Quantized weights on the device (cuda/quant.cuh and its three families): the packed bytes
//! uploaded as the checkpoint stores them (Q4G64_F16S repacked into the tiled layout of
//! quant_tiles.rs, which its mma.sync GEMV streams), the decode GEMV with fused dequantization for up to
//! QUANT_GEMV_MAX_M rows (GGUF Q4_K and IQ4_XS and NVFP4 through the chunk GEMV of
//! quant_chunks.rs, two rows a warp in 16-byte loads), and the prefill route: the weight
//! dequantized into a storage-type workspace, then cuBLAS. A quantized LM head has both in f32 output, its prefill route a
//! chunk of vocabulary rows at a time through the same workspace.
//!
//! The prefill route is the first one measured; the alternative to try on the GPU is the fused
//! tensor-core GEMM (dequantized tiles in shared memory before the MMA), which saves the
//! workspace's write and read (2 bytes a weight) per step. FP8_E4M3FN_ROW_BF16S weights take
//! the FP8 tensor-core GEMM instead on sm_89 and newer where their shape allows
//! (fp8_linear.rs; `Linear`'s route), HF block FP8 weights of 128 x 128 blocks cuBLASLt's
//! block-scaled FP8 GEMM where the device's cuBLASLt has one (fp8_block.rs).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{quant_chunks, quant_tiles};
use super::{as_i32, cfg, check_len, check_linear};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::{KernelFamily, StorageDType};
use crate::quant::{fp8_row, grouped::Grouped, validate, QuantFormat, QuantWeight, RawDtype};
use crate::{NinferError, Result};

/// Rows of x one GEMV launch takes; larger decode batches run the prefill route.
pub const QUANT_GEMV_MAX_M: usize = 16;

/// Threads per block of the quantized kernels (QUANT_WARPS warps).
pub(super) const QUANT_THREADS: u32 = 256;

/// The kernels of one format: its family, the dequantize kernel and the GEMV for
/// MT = 1, 2, 4, 8, 16 rows, into the storage type and into f32.
struct QuantKernels {
    family: KernelFamily,
    dequant: &'static str,
    gemv: [&'static str; 5],
    gemv_f32: [&'static str; 5],
}

macro_rules! quant_kernels {
    ($fam:ident, $s:literal) => {
        quant_kernels!($fam, $s, $s)
    };
    // The dequantize kernel of stem $d, the GEMVs of stem $s.
    ($fam:ident, $d:literal, $s:literal) => {
        QuantKernels {
            family: KernelFamily::$fam,
            dequant: concat!("quant_dequant_", $d),
            gemv: [
                concat!("quant_gemv_", $s, "_m1"),
                concat!("quant_gemv_", $s, "_m2"),
                concat!("quant_gemv_", $s, "_m4"),
                concat!("quant_gemv_", $s, "_m8"),
                concat!("quant_gemv_", $s, "_m16"),
            ],
            gemv_f32: [
                concat!("quant_gemv_f32_", $s, "_m1"),
                concat!("quant_gemv_f32_", $s, "_m2"),
                concat!("quant_gemv_f32_", $s, "_m4"),
                concat!("quant_gemv_f32_", $s, "_m8"),
                concat!("quant_gemv_f32_", $s, "_m16"),
            ],
        }
    };
}

/// The kernels of `format` as uploaded (Q4G64_F16S always in the tiled layout).
fn kernels_of(format: QuantFormat) -> QuantKernels {
    match format {
        QuantFormat::W8G32F16S => quant_kernels!(QuantNinfer, "w8g32"),
        QuantFormat::Q4G64F16S => quant_kernels!(QuantNinfer, "q4_tiles"),
        QuantFormat::Q5G64F16S => quant_kernels!(QuantNinfer, "q5g64"),
        QuantFormat::Q6G64F16S => quant_kernels!(QuantNinfer, "q6g64"),
        QuantFormat::Fp8E4m3fnRowBf16s => quant_kernels!(QuantNinfer, "fp8_row"),
        QuantFormat::Nvfp4 => quant_kernels!(QuantNinfer, "nvfp4"),
        QuantFormat::GgufQ8_0 => quant_kernels!(QuantGguf, "q8_0"),
        QuantFormat::GgufQ4K => quant_kernels!(QuantGguf, "q4_k"),
        QuantFormat::GgufQ5K => quant_kernels!(QuantGguf, "q5_k"),
        QuantFormat::GgufQ6K => quant_kernels!(QuantGguf, "q6_k"),
        QuantFormat::GgufIq4Xs => quant_kernels!(QuantGguf, "iq4_xs"),
        QuantFormat::GgufIq3S => quant_kernels!(QuantGguf, "iq3_s"),
        QuantFormat::HfFp8Block { .. } => quant_kernels!(QuantHf, "fp8_block"),
        QuantFormat::Awq4 { .. } => quant_kernels!(QuantHf, "awq4"),
        QuantFormat::Gptq4 { .. } => quant_kernels!(QuantHf, "gptq4"),
        QuantFormat::PackQuantized4 { .. } => quant_kernels!(QuantHf, "pack4"),
    }
}

/// The kernels of a weight: the tiled layout's in its format's family where it was uploaded
/// tiled (quant_tiles.rs), with the ring GEMVs where `ring` (the device's `q4_ring`; sm_80+),
/// else its format's.
fn weight_kernels(format: QuantFormat, tiled: bool, ring: bool) -> QuantKernels {
    match (tiled, ring, kernels_of(format).family) {
        (true, false, KernelFamily::QuantHf) => quant_kernels!(QuantHf, "q4_tiles"),
        (true, true, KernelFamily::QuantHf) => quant_kernels!(QuantHf, "q4_tiles", "q4_tiles_ring"),
        (true, true, KernelFamily::QuantNinfer) => quant_kernels!(QuantNinfer, "q4_tiles", "q4_tiles_ring"),
        _ => kernels_of(format),
    }
}

/// The kernel families a set of formats runs (loaded with the model, so that no step compiles).
pub fn quant_families(formats: impl IntoIterator<Item = QuantFormat>) -> Vec<KernelFamily> {
    let mut out: Vec<KernelFamily> = Vec::new();
    for f in formats {
        let fam = kernels_of(f).family;
        if !out.contains(&fam) {
            out.push(fam);
        }
    }
    out
}

/// A companion dtype as quant.cuh's `q_float_at` kind: 0 F32, 1 F16, 2 BF16.
fn float_kind(d: RawDtype) -> i64 {
    match d {
        RawDtype::F16 => 1,
        RawDtype::BF16 => 2,
        _ => 0,
    }
}

/// A quantized weight on the device: its bytes as stored and the kernels' format parameters,
/// and optionally dense rows after the quantized ones (a fused projection whose last parts a
/// quantized checkpoint keeps dense), decoded by the same kernels from the storage type.
pub struct DeviceQuantWeight {
    /// The checkpoint's tensor name (errors name it).
    pub name: String,
    pub format: QuantFormat,
    /// Output features: the quantized rows and the dense tail's.
    pub n: usize,
    /// Input features (a multiple of 8).
    pub k: usize,
    /// The quantized rows (`n` less the dense tail's).
    nq: usize,
    data: CudaSlice<u8>,
    scale: Option<CudaSlice<u8>>,
    zero: Option<CudaSlice<u8>>,
    g_idx: Option<CudaSlice<u8>>,
    /// `[n - nq, k]` in the storage type.
    tail: Option<CudaSlice<u16>>,
    params: [i64; 3],
    /// Whether `data` holds the tiled layout (quant_tiles.rs; no companions then).
    tiled: bool,
    /// An NVFP4 weight's parts: their rows and tensor divisors (read back from the payloads at
    /// upload: the FP4 GEMM takes 1 / d_w as a host scalar); empty for other formats.
    nvfp4_parts: Vec<(usize, f32)>,
}

impl DeviceQuantWeight {
    /// Bytes the weight takes on the device (data, companions and the dense tail).
    pub fn device_bytes(&self) -> usize {
        self.data.len() + [&self.scale, &self.zero, &self.g_idx].iter().map(|p| p.as_ref().map_or(0, |s| s.len())).sum::<usize>() + 2 * self.tail.as_ref().map_or(0, |t| t.len())
    }

    /// The device addresses of an FP8_E4M3FN_ROW_BF16S weight's code plane and bfloat16 row
    /// multipliers, the FP8 GEMM's operands (fp8_linear.rs); None for another format or with a
    /// dense tail.
    pub(crate) fn fp8_row_planes(&self, s: &std::sync::Arc<cudarc::driver::CudaStream>) -> Option<(u64, u64)> {
        if self.format != QuantFormat::Fp8E4m3fnRowBf16s || self.tail.is_some() {
            return None;
        }
        let base = self.data.device_ptr(s).0;
        Some((base, base + self.params[0] as u64))
    }

    /// Whether the weight is NVFP4 without a dense tail, the parts the FP4 GEMM takes
    /// (`nvfp4_planes`).
    pub fn is_nvfp4(&self) -> bool {
        self.format == QuantFormat::Nvfp4 && self.tail.is_none()
    }

    /// An NVFP4 weight's parts as the FP4 GEMM reads them: (first row, rows, the code plane's
    /// and the scale plane's device addresses, d_w), each part's payload starting at a
    /// multiple of NVFP4_PART_ALIGN; None unless `is_nvfp4`.
    pub(crate) fn nvfp4_planes(&self, s: &std::sync::Arc<cudarc::driver::CudaStream>) -> Option<Vec<Nvfp4Plane>> {
        if !self.is_nvfp4() {
            return None;
        }
        let base = self.data.device_ptr(s).0;
        let (mut r0, mut at) = (0usize, 0usize);
        let mut out = Vec::with_capacity(self.nvfp4_parts.len());
        for &(rows, d_w) in &self.nvfp4_parts {
            let (scale_offset, _, total) = crate::quant::nvfp4::planes(rows, self.k);
            out.push(Nvfp4Plane { r0, rows, codes: base + at as u64, scales: base + (at + scale_offset) as u64, d_w });
            r0 += rows;
            at += total.next_multiple_of(NVFP4_PART_ALIGN);
        }
        Some(out)
    }

    /// The rows of each NVFP4 part (empty for other formats).
    pub fn nvfp4_part_rows(&self) -> Vec<usize> {
        self.nvfp4_parts.iter().map(|p| p.0).collect()
    }

    /// Whether the weight is FP8_E4M3FN_ROW_BF16S without a dense tail (`fp8_row_planes`).
    pub fn is_fp8_rows(&self) -> bool {
        self.format == QuantFormat::Fp8E4m3fnRowBf16s && self.tail.is_none()
    }

    /// Whether the weight is HF block FP8 of 128 x 128 blocks without a dense tail, the blocks
    /// cuBLASLt's block scaling takes (`fp8_block_planes`).
    pub fn is_fp8_block128(&self) -> bool {
        self.format == (QuantFormat::HfFp8Block { block_n: 128, block_k: 128 }) && self.tail.is_none() && self.scale.is_some()
    }

    /// The device addresses of an HF block FP8 weight's codes [n, k] and its multipliers
    /// [ceil(n / 128), ceil(k / 128)] with their dtype as quant.cuh's float kind (0 F32, 1 F16,
    /// 2 BF16): the block-scaled GEMM's operands (fp8_block.rs); None unless
    /// `is_fp8_block128`.
    pub(crate) fn fp8_block_planes(&self, s: &std::sync::Arc<cudarc::driver::CudaStream>) -> Option<(u64, u64, i64)> {
        if !self.is_fp8_block128() {
            return None;
        }
        Some((self.data.device_ptr(s).0, self.scale.as_ref()?.device_ptr(s).0, self.params[2]))
    }
}

/// The GEMV launches of an m-row step: (first row, rows, kernel slot of [1, 2, 4, 8, 16] rows),
/// QUANT_GEMV_MAX_M rows at most a launch.
fn gemv_launches(m: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..m).step_by(QUANT_GEMV_MAX_M).map(move |row| {
        let mm = (m - row).min(QUANT_GEMV_MAX_M);
        (row, mm, [1, 2, 4, 8, 16].iter().position(|&t| t >= mm).expect("mm <= 16"))
    })
}

/// Blocks of a GEMV launch over `n_all` rows, `nq` of them quantized: one warp a row
/// (QUANT_THREADS / 32 rows a block), except a tiled weight on sm_80+ (cuda/quant.cuh
/// `quant_tiled_gemv`): one block a tile of 16 quantized rows, then one warp a dense tail row;
/// and a weight whose GEMV is the chunk GEMV (`chunk`, cuda/quant_chunk.cuh): QC_ROWS rows a
/// warp.
fn quant_gemv_grid(tiled: bool, chunk: bool, nq: usize, n_all: usize, mma: bool) -> usize {
    let warps = QUANT_THREADS as usize / 32;
    if tiled && mma {
        nq.div_ceil(quant_tiles::TILE_ROWS) + (n_all - nq).div_ceil(warps)
    } else if chunk {
        n_all.div_ceil(warps * quant_chunks::QC_ROWS)
    } else {
        n_all.div_ceil(warps)
    }
}

/// Parts an NVFP4 weight may be stacked from (dec_nvfp4 reads the first rows of parts 1 .. 4).
pub const NVFP4_MAX_PARTS: usize = 5;

pub use crate::plan::gpu::NVFP4_PART_ALIGN;

/// One NVFP4 part of a weight on the device (`DeviceQuantWeight::nvfp4_planes`).
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Plane {
    /// Its first row in the weight, and its rows.
    pub r0: usize,
    pub rows: usize,
    /// Device addresses of its code plane and swizzled scale plane.
    pub codes: u64,
    pub scales: u64,
    /// Its tensor divisor.
    pub d_w: f32,
}

/// dec_nvfp4's parameters: the first row of each part after the first, two to a word (low half
/// first), the rows of the whole weight where there is no such part.
fn nvfp4_part_starts(rows: impl Iterator<Item = usize>) -> [i64; 3] {
    let rows: Vec<usize> = rows.collect();
    let total: usize = rows.iter().sum();
    let mut starts = [total as i64; 4];
    let mut r0 = 0;
    for (i, r) in rows.iter().take(NVFP4_MAX_PARTS - 1).enumerate() {
        r0 += r;
        if i + 1 < rows.len() {
            starts[i] = r0 as i64;
        }
    }
    [starts[0] | (starts[1] << 32), starts[2] | (starts[3] << 32), 0]
}

impl CudaDevice {
    /// Where `w` cannot run on this device, the reason, naming the tensor, the format and the
    /// device: K not a multiple of 8 (the kernels decode and load 8 values at a time), and on
    /// f16-storage devices (sm_7x) an FP8 / NVFP4 weight whose scales let values exceed
    /// binary16's range (the prefill route's f16 workspace would hold infinities).
    pub fn check_quant_weight(&self, w: &QuantWeight) -> Result<()> {
        let [_, k] = w.shape;
        let device = self.describe();
        if !k.is_multiple_of(8) {
            let reason = format!("K = {k} is not a multiple of 8, the values the GPU kernels decode at a time: {device} cannot run it");
            return Err(NinferError::QuantTensor { name: w.name.clone(), format: w.format.name().to_string(), reason });
        }
        if self.storage() == StorageDType::F16 {
            if let Some(e) = crate::quant::f16_range_error(&w.view(), &device) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Validates `w` (refusing it naming the tensor), checks that this device runs it
    /// (`check_quant_weight`) and uploads its bytes; loads its kernel family.
    pub fn upload_quant(&self, w: &QuantWeight) -> Result<DeviceQuantWeight> {
        self.upload_quant_parts(std::slice::from_ref(w), &[])
    }

    /// `upload_quant`, with `tail` (storage-type bits, whole rows of `w`'s K) the dense rows
    /// that follow `w`'s in the projection.
    pub fn upload_quant_with_tail(&self, w: &QuantWeight, tail: &[u16]) -> Result<DeviceQuantWeight> {
        self.upload_quant_parts(std::slice::from_ref(w), tail)
    }

    /// One weight from row-stacked `parts` of one format and K (each validated and checked as
    /// `upload_quant` does), then the dense `tail`. Several parts only for NVFP4, whose fused
    /// projections keep each part's tensor divisor (up to NVFP4_MAX_PARTS, stored one after the
    /// other as their payloads are); every other format's fused projection is one payload.
    pub fn upload_quant_parts(&self, parts: &[QuantWeight], tail: &[u16]) -> Result<DeviceQuantWeight> {
        let w = parts.first().ok_or_else(|| NinferError::Device("a quantized weight of no parts".into()))?;
        for p in parts {
            validate(&p.view())?;
            self.check_quant_weight(p)?;
        }
        let k = w.shape[1];
        let name = parts.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join("|");
        if parts.len() > 1 {
            let odd = parts.iter().find(|p| p.format != QuantFormat::Nvfp4 || p.shape[1] != k);
            if odd.is_some() || parts.len() > NVFP4_MAX_PARTS {
                return Err(NinferError::Device(format!("{name}: row-stacked parts are NVFP4 parts of one K, at most {NVFP4_MAX_PARTS} of them")));
            }
        }
        let n: usize = parts.iter().map(|p| p.shape[0]).sum();
        let tiles = if parts.len() == 1 { quant_tiles::to_tiles(w) } else { None };
        let params: [i64; 3] = match w.format {
            _ if tiles.is_some() => tiles.as_ref().unwrap().params,
            f if Grouped::of(f).is_some() => {
                let p = Grouped::of(f).unwrap().planes(n, k);
                [p.high_offset as i64, p.scale_offset as i64, 0]
            }
            QuantFormat::Fp8E4m3fnRowBf16s => [fp8_row::planes(n, k).0 as i64, 0, 0],
            QuantFormat::Nvfp4 => nvfp4_part_starts(parts.iter().map(|p| p.shape[0])),
            QuantFormat::HfFp8Block { block_n, block_k } => {
                [block_n as i64, block_k as i64, w.scale.as_ref().map_or(0, |s| float_kind(s.dtype))]
            }
            QuantFormat::Awq4 { group } => [group as i64, 0, 0],
            QuantFormat::Gptq4 { group, zero_plus_one } => [group as i64, zero_plus_one as i64, 0],
            QuantFormat::PackQuantized4 { group, .. } => [group as i64, w.scale.as_ref().map_or(0, |s| float_kind(s.dtype)), 0],
            _ => [0, 0, 0],
        };
        let s = self.stream();
        let up = |b: &[u8], what: &str| s.clone_htod(b).map_err(|e| NinferError::Device(format!("uploading {name} ({what}): {e}")));
        let tiled = tiles.is_some();
        let data = if let Some(t) = &tiles {
            up(&t.bytes, "data")?
        } else if w.format == QuantFormat::Nvfp4 {
            // Each part's payload padded to NVFP4_PART_ALIGN, so that every part's planes are
            // aligned as the FP4 GEMM and the chunk GEMV's 16-byte loads need.
            let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.data.len().next_multiple_of(NVFP4_PART_ALIGN)).sum());
            for p in parts {
                bytes.extend_from_slice(&p.data);
                bytes.resize(bytes.len().next_multiple_of(NVFP4_PART_ALIGN), 0);
            }
            up(&bytes, "data")?
        } else if parts.len() == 1 {
            up(&w.data, "data")?
        } else {
            return Err(NinferError::Device(format!("{name}: row-stacked parts are NVFP4 parts")));
        };
        // The tiled layout carries its scales and zeros; the stored form reads the companions.
        let companion = |t: &Option<crate::quant::OwnedRaw>, what: &str| if tiled { Ok(None) } else { t.as_ref().map(|t| up(&t.bytes, what)).transpose() };
        let scale = companion(&w.scale, "scale")?;
        let zero = companion(&w.zero, "zero")?;
        let g_idx = companion(&w.g_idx, "g_idx")?;
        if !tail.len().is_multiple_of(k) {
            return Err(NinferError::Device(format!("{name}: a dense tail of {} values is not whole rows of {k}", tail.len())));
        }
        let tail_dev = if tail.is_empty() { None } else { Some(s.clone_htod(tail).map_err(|e| NinferError::Device(format!("uploading {name} (dense rows): {e}")))?) };
        self.load_kernel_families(&[kernels_of(w.format).family])?;
        let nvfp4_parts = if w.format == QuantFormat::Nvfp4 { parts.iter().map(|p| (p.shape[0], crate::quant::nvfp4::divisor(&p.data, p.shape[0], k))).collect() } else { Vec::new() };
        Ok(DeviceQuantWeight { name, format: w.format, n: n + tail.len() / k, k, nq: n, data, scale, zero, g_idx, tail: tail_dev, params, tiled, nvfp4_parts })
    }

    /// The weight operands of a quantized kernel (QUANT_W_PARAMS' order: the decoders' rows,
    /// then the dense tail and all the rows).
    fn quant_w_args(&self, w: &DeviceQuantWeight) -> Result<[super::KArg; 11]> {
        let s = self.stream();
        let ptr = |b: &Option<CudaSlice<u8>>| b.as_ref().map_or(0u64, |b| b.device_ptr(s).0);
        Ok(kargs![
            self.data_ptr(&w.data),
            ptr(&w.scale),
            ptr(&w.zero),
            ptr(&w.g_idx),
            as_i32("quant n", w.nq)?,
            as_i32("quant k", w.k)?,
            w.params[0],
            w.params[1],
            w.params[2],
            w.tail.as_ref().map_or(0u64, |t| t.device_ptr(s).0),
            as_i32("quant rows", w.n)?
        ])
    }

    /// Whether `w`'s GEMV runs the tiled layout's ring form (the device's `q4_ring`): sm_80+
    /// only, where the tiled GEMVs run mma.sync.
    fn q4t_ring(&self, w: &DeviceQuantWeight) -> bool {
        w.tiled && self.compute_capability().0 >= 8 && self.q4_ring()
    }

    /// Blocks of a GEMV launch (`quant_gemv_grid`'s rule at this device's capability).
    fn quant_gemv_grid(&self, w: &DeviceQuantWeight) -> u32 {
        let chunk = !w.tiled && quant_chunks::chunk_gemv(w.format);
        quant_gemv_grid(w.tiled, chunk, w.nq, w.n, self.compute_capability().0 >= 8) as u32
    }

    fn data_ptr(&self, b: &CudaSlice<u8>) -> u64 {
        b.device_ptr(self.stream()).0
    }

    /// The f32 values of `w`, row-major `[n, k]`, into `out`: exactly the CPU decoder's
    /// (`quant::dequantize`), bit for bit.
    pub fn quant_dequantize_f32(&self, w: &DeviceQuantWeight, out: &mut impl DevicePtrMut<f32>) -> Result<()> {
        check_len("quant_dequantize_f32 out", out.len(), w.n * w.k)?;
        let (op, _g) = out.device_ptr_mut(self.stream());
        self.quant_dequant_launch(w, op, 1, 0, w.n)
    }

    /// The values of `w` rounded to the storage type (round to nearest even), row-major
    /// `[n, k]`, into `out`: the prefill route's workspace.
    pub fn quant_dequantize(&self, w: &DeviceQuantWeight, out: &mut impl DevicePtrMut<u16>) -> Result<()> {
        check_len("quant_dequantize out", out.len(), w.n * w.k)?;
        let (op, _g) = out.device_ptr_mut(self.stream());
        self.quant_dequant_launch(w, op, 0, 0, w.n)
    }

    /// Rows `row0 .. row0 + rows` of `w` rounded to the storage type, row-major `[rows, k]`, into
    /// the start of `out`: a chunk of a quantized LM head's vocabulary rows.
    pub fn quant_dequantize_rows(&self, w: &DeviceQuantWeight, row0: usize, rows: usize, out: &mut impl DevicePtrMut<u16>) -> Result<()> {
        if row0 + rows > w.n {
            return Err(NinferError::Device(format!("{}: rows {row0}..{} of {}", w.name, row0 + rows, w.n)));
        }
        check_len("quant_dequantize_rows out", out.len(), rows * w.k)?;
        let (op, _g) = out.device_ptr_mut(self.stream());
        self.quant_dequant_launch(w, op, 0, row0, rows)
    }

    fn quant_dequant_launch(&self, w: &DeviceQuantWeight, out: u64, f32_out: i32, row0: usize, rows: usize) -> Result<()> {
        let kern = weight_kernels(w.format, w.tiled, false);
        let f = self.function(kern.family, kern.dequant)?;
        let slices = rows * (w.k / 8);
        // A few waves of blocks; the kernel strides past them.
        let grid = slices.div_ceil(QUANT_THREADS as usize).clamp(1, 1 << 16) as u32;
        let mut args = self.quant_w_args(w)?.to_vec();
        args.extend(kargs![out, f32_out, as_i32("quant row0", row0)?, as_i32("quant rows", rows)?]);
        self.launch(&f, cfg((grid, 1, 1), QUANT_THREADS), kern.dequant, &args)
    }

    /// y[m, n] (storage type) = x[m, k] W^T (+ bias[n], added to each f32 sum before its one
    /// rounding) with W decoded as it streams, in launches of up to QUANT_GEMV_MAX_M rows of x.
    /// x must be 16-byte aligned.
    pub fn quant_gemv(
        &self,
        x: &impl DevicePtr<u16>,
        w: &DeviceQuantWeight,
        bias: Option<&CudaSlice<u16>>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
    ) -> Result<()> {
        let (n, k) = (w.n, w.k);
        check_linear("quant_gemv", x.len(), y.len(), bias.map(|b| b.len()), [m, n, k])?;
        let kern = weight_kernels(w.format, w.tiled, self.q4t_ring(w));
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (yp, _b) = y.device_ptr_mut(s);
        let bp = bias.map_or(0u64, |b| b.device_ptr(s).0);
        let wargs = self.quant_w_args(w)?;
        let grid = self.quant_gemv_grid(w);
        for (row, mm, slot) in gemv_launches(m) {
            let name = kern.gemv[slot];
            let f = self.function(kern.family, name)?;
            let mut args = kargs![xp + (row * k * 2) as u64].to_vec();
            args.extend(wargs);
            args.extend(kargs![yp + (row * n * 2) as u64, bp, mm as i32]);
            self.launch_pdl(&f, cfg((grid, 1, 1), QUANT_THREADS), name, &args)?;
        }
        Ok(())
    }

    /// y[m, n] (f32) = x[m, k] W^T with W decoded as it streams, in launches of up to
    /// QUANT_GEMV_MAX_M rows of x; with `round`, each output rounded to the storage type and
    /// kept as f32 (the logits' rounding, as `gemv_f32_out_round_with`). x 16-byte aligned.
    pub fn quant_gemv_f32_out(&self, x: &impl DevicePtr<u16>, w: &DeviceQuantWeight, y: &mut impl DevicePtrMut<f32>, m: usize, round: bool) -> Result<()> {
        let (n, k) = (w.n, w.k);
        check_len("quant_gemv_f32_out x", x.len(), m * k)?;
        check_len("quant_gemv_f32_out y", y.len(), m * n)?;
        let kern = weight_kernels(w.format, w.tiled, self.q4t_ring(w));
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (yp, _b) = y.device_ptr_mut(s);
        let wargs = self.quant_w_args(w)?;
        let grid = self.quant_gemv_grid(w);
        for (row, mm, slot) in gemv_launches(m) {
            let name = kern.gemv_f32[slot];
            let f = self.function(kern.family, name)?;
            let mut args = kargs![xp + (row * k * 2) as u64].to_vec();
            args.extend(wargs);
            args.extend(kargs![yp + (row * n * 4) as u64, mm as i32, round as i32]);
            self.launch_pdl(&f, cfg((grid, 1, 1), QUANT_THREADS), name, &args)?;
        }
        Ok(())
    }

    /// y[m, n] (f32) = x W^T by the route for `m`: the f32 GEMV up to QUANT_GEMV_MAX_M rows;
    /// beyond, W a chunk of rows at a time (as many as `workspace` holds) dequantized into
    /// `workspace` and multiplied by cuBLAS into those columns of y: a quantized LM head, whose
    /// whole dequantized matrix (vocab x hidden) would be the largest buffer of the model. With
    /// `round`, the outputs rounded to the storage type and kept as f32.
    pub fn quant_linear_f32_out(&self, x: &impl DevicePtr<u16>, w: &DeviceQuantWeight, workspace: &mut CudaSlice<u16>, y: &mut impl DevicePtrMut<f32>, m: usize, round: bool) -> Result<()> {
        if m <= QUANT_GEMV_MAX_M {
            return self.quant_gemv_f32_out(x, w, y, m, round);
        }
        let (n, k) = (w.n, w.k);
        check_len("quant_linear_f32_out x", x.len(), m * k)?;
        check_len("quant_linear_f32_out y", y.len(), m * n)?;
        let chunk = (workspace.len() / k).min(n);
        if chunk == 0 {
            return Err(NinferError::Device(format!("{}: a dequantization workspace of {} elements holds no row of {k}", w.name, workspace.len())));
        }
        {
            let s = self.stream();
            let (xp, _a) = x.device_ptr(s);
            let (yp, _b) = y.device_ptr_mut(s);
            let mut r0 = 0;
            while r0 < n {
                let rows = chunk.min(n - r0);
                let mut ws = workspace.slice_mut(0..rows * k);
                self.quant_dequantize_rows(w, r0, rows, &mut ws)?;
                let (wp, _c) = ws.device_ptr(s);
                self.gemm_raw(xp, wp, yp + (r0 * 4) as u64, cudarc::cublas::sys::cudaDataType::CUDA_R_32F, m, rows, k, n)?;
                r0 += rows;
            }
        }
        if round {
            self.round_f32_to_storage(y, m * n)?;
        }
        Ok(())
    }

    /// y = x W^T (+ bias) by the route for `m`: the fused GEMV up to QUANT_GEMV_MAX_M rows;
    /// beyond, W dequantized into `workspace` (at least n * k) and the dense `linear` /
    /// `linear_bias` (cuBLAS at these sizes; a bias through `lin32`, at least m * n).
    #[allow(clippy::too_many_arguments)]
    pub fn quant_linear(
        &self,
        x: &impl DevicePtr<u16>,
        w: &DeviceQuantWeight,
        bias: Option<&CudaSlice<u16>>,
        workspace: &mut CudaSlice<u16>,
        lin32: &mut impl DevicePtrMut<f32>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
    ) -> Result<()> {
        if m <= QUANT_GEMV_MAX_M {
            return self.quant_gemv(x, w, bias, y, m);
        }
        let (n, k) = (w.n, w.k);
        check_len("quant_linear workspace", workspace.len(), n * k)?;
        let mut ws = workspace.slice_mut(0..n * k);
        self.quant_dequantize(w, &mut ws)?;
        match bias {
            None => self.linear(x, &ws, y, m, n, k),
            Some(b) => self.linear_bias(x, &ws, b, lin32, y, m, n, k),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::gguf::KVALUES_IQ4NL;
    use crate::quant::iq3s_grid::IQ3S_GRID;

    #[test]
    fn gemv_launches_cover_every_row_once_with_the_smallest_kernel_that_fits() {
        assert_eq!(gemv_launches(1).collect::<Vec<_>>(), [(0, 1, 0)]);
        assert_eq!(gemv_launches(5).collect::<Vec<_>>(), [(0, 5, 3)]);
        assert_eq!(gemv_launches(16).collect::<Vec<_>>(), [(0, 16, 4)]);
        assert_eq!(gemv_launches(35).collect::<Vec<_>>(), [(0, 16, 4), (16, 16, 4), (32, 3, 2)]);
        assert_eq!(gemv_launches(0).count(), 0);
    }

    /// Every format of the table.
    fn all_formats() -> Vec<QuantFormat> {
        let mut f: Vec<QuantFormat> = crate::quant::FORMATS.iter().filter_map(|s| QuantFormat::from_name(s.name)).collect();
        f.extend([
            QuantFormat::HfFp8Block { block_n: 128, block_k: 128 },
            QuantFormat::Awq4 { group: 128 },
            QuantFormat::Gptq4 { group: 128, zero_plus_one: true },
            QuantFormat::PackQuantized4 { group: 128, symmetric: true },
        ]);
        f
    }

    #[test]
    fn every_format_names_kernels_its_family_source_defines() {
        let formats = all_formats();
        assert_eq!(formats.len(), crate::quant::FORMATS.len());
        for f in formats {
            let kern = kernels_of(f);
            let src = kern.family.source();
            let stem = kern.dequant.trim_start_matches("quant_dequant_");
            let macro_ = if f == QuantFormat::Q4G64F16S {
                "QUANT_TILED_KERNELS"
            } else if quant_chunks::chunk_gemv(f) {
                "QUANT_CHUNK_KERNELS"
            } else {
                "QUANT_KERNELS"
            };
            assert!(src.contains(&format!("\n{macro_}({stem}, ")), "{f:?}: no {macro_}({stem}, ..) in cuda/{}", kern.family.file_name());
            // A 4-bit weight uploaded tiled runs its family's tiled kernels, in both forms
            // (QUANT_TILED_KERNELS defines the ring GEMVs beside the pass GEMVs).
            for ring in [false, true] {
                let tiled = weight_kernels(f, true, ring);
                assert_eq!(tiled.family, kern.family);
                if tiled.dequant != kern.dequant {
                    assert!(src.contains("\nQUANT_TILED_KERNELS(q4_tiles, dec_q4_tiles)"), "{f:?}: no tiled kernels in cuda/{}", kern.family.file_name());
                    let gemv = if ring { "q4_tiles_ring" } else { "q4_tiles" };
                    assert_eq!(tiled.dequant, "quant_dequant_q4_tiles");
                    for ((g, g32), mt) in tiled.gemv.iter().zip(&tiled.gemv_f32).zip([1, 2, 4, 8, 16]) {
                        assert_eq!(*g, format!("quant_gemv_{gemv}_m{mt}"));
                        assert_eq!(*g32, format!("quant_gemv_f32_{gemv}_m{mt}"));
                    }
                }
            }
            for ((g, g32), mt) in kern.gemv.iter().zip(&kern.gemv_f32).zip([1, 2, 4, 8, 16]) {
                assert_eq!(*g, format!("quant_gemv_{stem}_m{mt}"));
                assert_eq!(*g32, format!("quant_gemv_f32_{stem}_m{mt}"));
            }
        }
    }

    /// The numbers of a C array initializer `name[...] = { ... };` in `src`.
    fn c_array(src: &str, name: &str) -> Vec<i64> {
        let start = src.find(&format!("{name}[")).unwrap_or_else(|| panic!("no array {name}"));
        let body = &src[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        body.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| match t.strip_prefix("0x") {
                Some(h) => i64::from_str_radix(h, 16).unwrap(),
                None => t.parse().unwrap(),
            })
            .collect()
    }

    #[test]
    fn the_gguf_kernels_tables_equal_the_cpu_decoders() {
        let src = KernelFamily::QuantGguf.source();
        let grid = c_array(src, "iq3s_grid");
        assert_eq!(grid, IQ3S_GRID.iter().map(|&w| w as i64).collect::<Vec<_>>());
        let kv = c_array(src, "iq4nl_kvalues");
        assert_eq!(kv, KVALUES_IQ4NL.iter().map(|&v| v as i64).collect::<Vec<_>>());
    }

    #[test]
    fn tiled_gemv_grids_take_a_block_a_tile_on_sm80_and_a_warp_a_row_before() {
        // 37 quantized rows: 3 tiles; 5 dense tail rows: one block of 8 warps.
        assert_eq!(quant_gemv_grid(true, false, 37, 42, true), 3 + 1);
        assert_eq!(quant_gemv_grid(true, false, 4096, 4096, true), 256);
        assert_eq!(quant_gemv_grid(true, false, 37, 42, false), 6);
        assert_eq!(quant_gemv_grid(false, false, 37, 42, true), 6);
    }

    #[test]
    fn chunk_gemv_grids_take_two_rows_a_warp() {
        // 42 rows: 21 pairs, 3 blocks of 8 warps (the last pairs past n_all run no row).
        assert_eq!(quant_gemv_grid(false, true, 37, 42, true), 3);
        assert_eq!(quant_gemv_grid(false, true, 4096, 4096, false), 256);
        assert_eq!(quant_gemv_grid(false, true, 16, 17, true), 2);
        for f in [QuantFormat::GgufQ4K, QuantFormat::GgufIq4Xs, QuantFormat::Nvfp4] {
            assert!(quant_chunks::chunk_gemv(f));
        }
        assert!(!quant_chunks::chunk_gemv(QuantFormat::GgufQ5K));
    }

    #[test]
    fn nvfp4_parts_pass_their_first_rows_two_to_a_word() {
        let word = |lo: i64, hi: i64| lo | (hi << 32);
        assert_eq!(nvfp4_part_starts([256].into_iter()), [word(256, 256), word(256, 256), 0]);
        assert_eq!(nvfp4_part_starts([128, 256, 128].into_iter()), [word(128, 384), word(512, 512), 0]);
        assert_eq!(nvfp4_part_starts([128; 5].into_iter()), [word(128, 256), word(384, 512), 0]);
    }

    #[test]
    fn families_are_listed_once_each() {
        let fams = quant_families(all_formats());
        assert_eq!(fams, vec![KernelFamily::QuantNinfer, KernelFamily::QuantGguf, KernelFamily::QuantHf]);
        assert!(fams.iter().all(|f| f.is_quant()));
    }
}
