//! `Linear`: one projection's weight on the device with everything that decides how it runs,
//! fixed when the model is loaded: its storage format, its bias, and its decode GEMV route.
//! The step code calls `Linear::forward` and reads the route; it never asks the device again.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::backend::cuda::blaslt::fp8_gemm_fits;
use crate::backend::cuda::kernels::{KernelFamily, StorageDType};
use crate::backend::cuda::ops::{DeviceQuantWeight, GemvKernel, QUANT_GEMV_MAX_M};
use crate::backend::cuda::CudaDevice;
use crate::quant::{QuantFormat, QuantWeight};
use crate::{NinferError, Result};

/// How a weight's elements are stored: a dense matrix in the device's 16-bit storage type, or
/// one of the quantized formats (rust_core/src/quant), each with its arm in `Linear::forward`
/// (the match is exhaustive, so no projection can miss one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// bfloat16 (sm_80 and newer).
    Bf16,
    /// IEEE half (sm_7x, which has no bf16 arithmetic).
    F16,
    /// Packed in a quantized format (`Linear::quant` holds the bytes): the fused-dequantization
    /// GEMV up to QUANT_GEMV_MAX_M rows, beyond its `QuantPrefill` route.
    Quant(QuantFormat),
}

/// The storage-type buffer the prefill route dequantizes a weight into, one for all the
/// quantized projections of a model (steps run them one after another on one stream), sized
/// at load to the largest of them so that no step allocates (a captured CUDA graph cannot).
pub struct QuantWorkspace(Mutex<CudaSlice<u16>>);

impl QuantWorkspace {
    /// A workspace of `elems` storage elements (the largest quantized weight's N x K).
    pub fn new(dev: &CudaDevice, elems: usize) -> Result<Arc<Self>> {
        let buf = dev.stream().alloc_zeros::<u16>(elems.max(1)).map_err(|e| NinferError::Device(format!("allocating the dequantization workspace of {elems} elements: {e}")))?;
        Ok(Arc::new(QuantWorkspace(Mutex::new(buf))))
    }

    /// Storage elements it holds.
    pub fn elems(&self) -> usize {
        self.0.lock().expect("quant workspace poisoned").len()
    }
}

/// A quantized projection's device part: the packed weight, the workspace it shares and its
/// prefill route.
pub struct QuantPart {
    pub weight: DeviceQuantWeight,
    pub workspace: Arc<QuantWorkspace>,
    pub prefill: QuantPrefill,
}

impl QuantPart {
    /// The part of `weight` on `dev`, with the prefill route `QuantPrefill::choose` gives it;
    /// the FP8 routes' kernels and cuBLASLt handle (its workspace) are made here, so that no
    /// step compiles or allocates. Where the device's cuBLASLt has no FP8 GEMM for the shape
    /// (a CUDA 12 before FP8 support; block scaling before cuBLAS 12.9 or off sm_90), the
    /// weight dequantizes, and the load says so once per route.
    pub fn new(dev: &CudaDevice, weight: DeviceQuantWeight, workspace: Arc<QuantWorkspace>) -> Result<Self> {
        static SAID_ROWS: std::sync::Once = std::sync::Once::new();
        static SAID_BLOCKS: std::sync::Once = std::sync::Once::new();
        static SAID_NVFP4: std::sync::Once = std::sync::Once::new();
        let mut prefill = QuantPrefill::choose(dev, &weight);
        let available = match prefill {
            QuantPrefill::Dequantize => Ok(()),
            QuantPrefill::Fp8Gemm => dev.fp8_gemm_available(weight.n, weight.k),
            QuantPrefill::Fp8Block => dev.fp8_block_gemm_available(weight.n, weight.k, dev.storage() == StorageDType::F16),
            QuantPrefill::Nvfp4Gemm => weight.nvfp4_part_rows().iter().try_for_each(|&rows| dev.nvfp4_gemm_available(rows, weight.k, weight.n)),
        };
        if let Err(e) = available {
            let (said, what) = match prefill {
                QuantPrefill::Fp8Gemm => (&SAID_ROWS, "FP8"),
                QuantPrefill::Nvfp4Gemm => (&SAID_NVFP4, "NVFP4"),
                _ => (&SAID_BLOCKS, "FP8"),
            };
            said.call_once(|| eprintln!("ninfer: {} and the {what} weights like it dequantize for prefill: {e}", weight.name));
            prefill = QuantPrefill::Dequantize;
        }
        match prefill {
            QuantPrefill::Dequantize => {}
            QuantPrefill::Nvfp4Gemm => dev.load_kernel_families(&[KernelFamily::Fp4Gemm])?,
            _ => dev.load_kernel_families(&[KernelFamily::Fp8Gemm])?,
        }
        Ok(QuantPart { weight, workspace, prefill })
    }
}

/// How a quantized projection runs steps of more than QUANT_GEMV_MAX_M rows (fewer run its
/// fused-dequantization GEMV), chosen at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantPrefill {
    /// The weight dequantized into the shared workspace, then cuBLAS in the storage type.
    Dequantize,
    /// x quantized to E4M3FN a row at a time, cuBLASLt's FP8 GEMM against the weight's codes,
    /// the row multipliers applied after (`CudaDevice::fp8_linear`).
    Fp8Gemm,
    /// x quantized to E4M3FN per 128-value group, cuBLASLt's block-scaled FP8 GEMM against an
    /// HF block FP8 weight's codes, both sets of multipliers applied inside it
    /// (`CudaDevice::fp8_block_linear`).
    Fp8Block,
    /// x quantized to NVFP4 a row at a time, cuBLASLt's block-scaled FP4 GEMM per part of an
    /// NVFP4 weight, the row divisors applied after (`CudaDevice::nvfp4_linear`).
    Nvfp4Gemm,
}

impl QuantPrefill {
    /// FP8 tensor cores (compute capability 8.9 and newer) for weights whose N and K are
    /// multiples of 16 (cuBLASLt's FP8 rule) and without dense rows: FP8_E4M3FN_ROW_BF16S on
    /// bf16 storage (which holds the GEMM's raw sums), HF block FP8 of 128 x 128 blocks (the
    /// GEMM scales inside, into either storage type). FP4 tensor cores (10.0 and newer) for
    /// NVFP4 weights without dense rows on bf16 storage. Whether this cuBLASLt has the GEMM on
    /// this device is asked at load (`QuantPart::new`); every other weight, device and shape
    /// dequantizes.
    pub fn choose(dev: &CudaDevice, w: &DeviceQuantWeight) -> Self {
        let tc = if w.is_fp8_rows() {
            Some(TensorCoreWeight::Fp8Rows)
        } else if w.is_fp8_block128() {
            Some(TensorCoreWeight::Fp8Blocks128)
        } else if w.is_nvfp4() {
            Some(TensorCoreWeight::Nvfp4)
        } else {
            None
        };
        Self::of(dev.compute_capability(), dev.storage(), tc, w.n, w.k)
    }

    /// `choose` for a device of compute capability `cc` and storage type `storage`, and an
    /// `[n, k]` weight of one of the forms with a tensor-core route, without dense rows (`tc`),
    /// or not.
    fn of(cc: (u32, u32), storage: StorageDType, tc: Option<TensorCoreWeight>, n: usize, k: usize) -> Self {
        let bf16 = storage == StorageDType::Bf16;
        match tc {
            Some(TensorCoreWeight::Nvfp4) if cc >= (10, 0) && bf16 => QuantPrefill::Nvfp4Gemm,
            Some(TensorCoreWeight::Nvfp4) => QuantPrefill::Dequantize,
            _ if cc < (8, 9) || !fp8_gemm_fits(n, k) => QuantPrefill::Dequantize,
            Some(TensorCoreWeight::Fp8Rows) if bf16 => QuantPrefill::Fp8Gemm,
            Some(TensorCoreWeight::Fp8Blocks128) => QuantPrefill::Fp8Block,
            _ => QuantPrefill::Dequantize,
        }
    }
}

/// The weight forms with a tensor-core prefill route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TensorCoreWeight {
    /// FP8_E4M3FN_ROW_BF16S.
    Fp8Rows,
    /// HF block FP8 of 128 x 128 blocks.
    Fp8Blocks128,
    /// NVFP4 (its parts each in the layout's 128-row tiles).
    Nvfp4,
}

impl From<StorageDType> for WeightFormat {
    fn from(s: StorageDType) -> Self {
        match s {
            StorageDType::Bf16 => WeightFormat::Bf16,
            StorageDType::F16 => WeightFormat::F16,
        }
    }
}

/// The decode GEMV route of one weight shape on one device, chosen at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearRoute {
    /// Steps of up to GEMV_ROUTE_MAX_M rows run the decode GEMV (K a multiple of 8, its 16-byte
    /// loads), and so may take the GEMV's epilogue fusions; other steps, and every step of a
    /// weight whose K is not, run the GEMM.
    pub gemv: bool,
    /// The kernel the GEMV runs for a one-row step: the device's GEMV form applied to this
    /// shape (`CudaDevice::gemv_kernel` at M = 1). Batch-1 decode fuses RoPE into the qkv
    /// projection only where this is the CUDA-core kernel.
    pub gemv_m1: GemvKernel,
}

impl LinearRoute {
    /// The route of a `[n, k]` weight whose one-row GEMV runs `gemv_m1`.
    pub fn new(gemv_m1: GemvKernel, k: usize) -> Self {
        LinearRoute { gemv: k.is_multiple_of(8), gemv_m1 }
    }

    /// The route of a device whose GEMV runs on CUDA cores at every shape (sm_7x); also what
    /// the loader's sinks that run nothing (the memory plan, the packing test) give.
    pub fn cuda_cores(k: usize) -> Self {
        Self::new(GemvKernel::CudaCores, k)
    }

    /// The route of a quantized weight: its own GEMV (`Linear::forward`), none of the dense
    /// GEMV's fusions (the fused SwiGLU and RoPE epilogues read a dense `w`).
    pub fn quantized() -> Self {
        LinearRoute { gemv: false, gemv_m1: GemvKernel::CudaCores }
    }

    /// The route `dev` gives a `[n, k]` weight.
    pub fn on_device(dev: &CudaDevice, n: usize, k: usize) -> Self {
        Self::new(dev.gemv_kernel(dev.gemv_form(), n, k, 1), k)
    }
}

/// A projection `y = x · Wᵀ (+ bias)` with `w` as `[n, k]`.
///
/// Tensor parallelism adds a `shard` field here: which rows (column-parallel) or columns
/// (row-parallel) of the full matrix this device holds and the collective that joins the
/// partial outputs; `n` and `k` then describe this device's part.
pub struct Linear<W = CudaSlice<u16>> {
    /// The dense weight; for a quantized one a one-element placeholder (the bytes are in
    /// `quant`, and its route takes none of the dense GEMV's fusions that read `w`).
    pub w: W,
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
    pub format: WeightFormat,
    /// `[n]` in storage type, where the checkpoint has one (Qwen2's q/k/v, Llama's
    /// `attention_bias` / `mlp_bias`), packed in the order of `w`'s rows.
    pub bias: Option<W>,
    pub route: LinearRoute,
    /// The packed weight where `format` is `Quant`.
    pub quant: Option<QuantPart>,
}

impl Linear {
    /// A projection of the quantized weight `w` (`[n, k]`) with its bias (storage type, `[n]`):
    /// validated, checked against the device (refused naming the tensor, the format and the
    /// device where it cannot run there) and uploaded packed. Its route runs none of the dense
    /// GEMV's fusions (the fused SwiGLU and RoPE epilogues read a dense `w`).
    pub fn quantized(dev: &CudaDevice, w: &QuantWeight, bias: Option<CudaSlice<u16>>, workspace: Arc<QuantWorkspace>) -> Result<Self> {
        let weight = dev.upload_quant(w)?;
        let placeholder = dev.stream().alloc_zeros::<u16>(1).map_err(|e| NinferError::Device(format!("allocating {}: {e}", w.name)))?;
        let [n, k] = w.shape;
        Ok(Linear {
            w: placeholder,
            n,
            k,
            format: WeightFormat::Quant(w.format),
            bias,
            route: LinearRoute::quantized(),
            quant: Some(QuantPart::new(dev, weight, workspace)?),
        })
    }

    /// `y = x · Wᵀ (+ bias)` for `rows` rows (GEMV up to 8 rows, GEMM above; a quantized weight
    /// its own GEMV up to QUANT_GEMV_MAX_M rows, its `QuantPrefill` above); a bias is added to
    /// the f32 sums in `lin32` and rounded once (`CudaDevice::linear_bias`), on the FP8 row route
    /// to the scaled sums, on the FP8 block route to the GEMM's rounded output.
    pub fn forward(&self, dev: &CudaDevice, x: &CudaSlice<u16>, y: &mut CudaSlice<u16>, lin32: &mut CudaSlice<f32>, rows: usize) -> Result<()> {
        match self.format {
            WeightFormat::Bf16 | WeightFormat::F16 => match &self.bias {
                None => dev.linear(x, &self.w, y, rows, self.n, self.k),
                Some(b) => dev.linear_bias(x, &self.w, b, lin32, y, rows, self.n, self.k),
            },
            WeightFormat::Quant(_) => {
                let q = self.quant.as_ref().ok_or_else(|| NinferError::Device(format!("a quantized projection [{}, {}] without its packed weight", self.n, self.k)))?;
                let mut ws = q.workspace.0.lock().expect("quant workspace poisoned");
                match q.prefill {
                    QuantPrefill::Fp8Gemm if rows > QUANT_GEMV_MAX_M => dev.fp8_linear(x, &q.weight, self.bias.as_ref(), &mut ws, y, rows),
                    QuantPrefill::Fp8Block if rows > QUANT_GEMV_MAX_M => dev.fp8_block_linear(x, &q.weight, self.bias.as_ref(), &mut ws, y, rows),
                    QuantPrefill::Nvfp4Gemm if rows > QUANT_GEMV_MAX_M => dev.nvfp4_linear(x, &q.weight, self.bias.as_ref(), &mut ws, y, rows),
                    _ => dev.quant_linear(x, &q.weight, self.bias.as_ref(), &mut ws, lin32, y, rows),
                }
            }
        }
    }

    /// `y = x · Wᵀ` in f32 for `rows` rows, each output rounded to the storage type (kept as
    /// f32) with `round`: the LM head's logits. Dense: `CudaDevice::linear_f32_out`; quantized:
    /// the f32 GEMV up to QUANT_GEMV_MAX_M rows, above it the weight dequantized a chunk of
    /// rows at a time into the shared workspace and multiplied by cuBLAS
    /// (`CudaDevice::quant_linear_f32_out`). A head has no bias.
    pub fn forward_f32_out(&self, dev: &CudaDevice, x: &impl DevicePtr<u16>, y: &mut impl DevicePtrMut<f32>, rows: usize, round: bool) -> Result<()> {
        match self.format {
            WeightFormat::Bf16 | WeightFormat::F16 => dev.linear_f32_out(x, &self.w, y, rows, self.n, self.k, round),
            WeightFormat::Quant(_) => {
                let q = self.quant.as_ref().ok_or_else(|| NinferError::Device(format!("a quantized projection [{}, {}] without its packed weight", self.n, self.k)))?;
                let mut ws = q.workspace.0.lock().expect("quant workspace poisoned");
                dev.quant_linear_f32_out(x, &q.weight, &mut ws, y, rows, round)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_row_weights_take_fp8_tensor_cores_from_sm_89_where_the_shape_allows() {
        use QuantPrefill::{Dequantize, Fp8Gemm};
        let (bf16, rows) = (StorageDType::Bf16, Some(TensorCoreWeight::Fp8Rows));
        for cc in [(8, 9), (9, 0), (10, 0), (12, 0)] {
            assert_eq!(QuantPrefill::of(cc, bf16, rows, 4096, 14336), Fp8Gemm, "{cc:?}");
        }
        for cc in [(7, 0), (7, 5), (8, 0), (8, 6), (8, 7)] {
            assert_eq!(QuantPrefill::of(cc, bf16, rows, 4096, 14336), Dequantize, "{cc:?}: no FP8 tensor cores");
        }
        assert_eq!(QuantPrefill::of((9, 0), StorageDType::F16, rows, 4096, 4096), Dequantize, "f16 storage cannot hold the raw sums");
        assert_eq!(QuantPrefill::of((9, 0), bf16, None, 4096, 4096), Dequantize, "another format, or dense rows after the FP8 ones");
        assert_eq!(QuantPrefill::of((9, 0), bf16, rows, 776, 256), Dequantize, "N = 776 (a GDN in_proj with its b / a rows)");
        assert_eq!(QuantPrefill::of((9, 0), bf16, rows, 256, 200), Dequantize, "K = 200");
    }

    #[test]
    fn hf_block_fp8_weights_take_the_block_scaled_route_from_sm_89_where_the_shape_allows() {
        use QuantPrefill::{Dequantize, Fp8Block};
        let blocks = Some(TensorCoreWeight::Fp8Blocks128);
        for cc in [(8, 9), (9, 0), (10, 0), (12, 0)] {
            for st in [StorageDType::Bf16, StorageDType::F16] {
                // The candidate; whether cuBLASLt has it on the device is asked at load.
                assert_eq!(QuantPrefill::of(cc, st, blocks, 4096, 4096), Fp8Block, "{cc:?} {st:?}");
                assert_eq!(QuantPrefill::of(cc, st, blocks, 2048, 320), Fp8Block, "{cc:?} {st:?}: K = 320, a partial last block");
            }
        }
        for cc in [(7, 0), (8, 0), (8, 6)] {
            assert_eq!(QuantPrefill::of(cc, StorageDType::Bf16, blocks, 4096, 4096), Dequantize, "{cc:?}: no FP8 tensor cores");
        }
        assert_eq!(QuantPrefill::of((9, 0), StorageDType::Bf16, blocks, 300, 4096), Dequantize, "N = 300");
        assert_eq!(QuantPrefill::of((9, 0), StorageDType::Bf16, blocks, 256, 200), Dequantize, "K = 200");
    }

    #[test]
    fn nvfp4_weights_take_fp4_tensor_cores_from_sm_100_on_bf16_storage() {
        use QuantPrefill::{Dequantize, Nvfp4Gemm};
        let nvfp4 = Some(TensorCoreWeight::Nvfp4);
        for cc in [(10, 0), (10, 3), (12, 0), (12, 1)] {
            // The candidate; whether cuBLASLt has it on the device is asked at load.
            assert_eq!(QuantPrefill::of(cc, StorageDType::Bf16, nvfp4, 34816, 5120), Nvfp4Gemm, "{cc:?}");
        }
        for cc in [(7, 0), (8, 0), (8, 9), (9, 0)] {
            assert_eq!(QuantPrefill::of(cc, StorageDType::Bf16, nvfp4, 34816, 5120), Dequantize, "{cc:?}: no FP4 tensor cores");
        }
        assert_eq!(QuantPrefill::of((12, 0), StorageDType::F16, nvfp4, 4096, 4096), Dequantize, "f16 storage cannot hold the scaled sums");
    }
}
