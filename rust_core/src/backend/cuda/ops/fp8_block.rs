//! The FP8 prefill route of HF block FP8 weights (128 x 128 blocks, the official "-FP8" Qwen
//! releases) where the device's cuBLASLt has block-scaled FP8 GEMMs (documented for sm_90;
//! checked at load, `CudaDevice::fp8_block_gemm_available`): each row of x quantized to E4M3FN
//! per 128-value group with its own f32 multiplier (cuda/fp8_gemm.cu `fp8_quantize_groups`,
//! `quant::fp8_groups`), then one cuBLASLt GEMM that applies the activations' group and the
//! weight's block multipliers inside its K loop (blaslt.rs, CUBLASLT_MATMUL_MATRIX_SCALE_
//! VEC128_32F / BLK128x128_32F) and writes the storage type, the bias added after. The weight is
//! read as stored (1 byte a value) where the dequantize route writes and reads a 2-byte
//! workspace copy, and the product runs at the FP8 tensor rate.
//!
//! Everything the route writes lives in the model's dequantization workspace (which this route
//! does not otherwise need): the weight's multipliers widened to cuBLASLt's layout where the
//! checkpoint's are not it already (BF16, or a K-block count not a multiple of 4), then a chunk
//! of rows' codes and multipliers. cuBLASLt takes row counts in multiples of 4: where x and y
//! hold the padded rows (a step's buffers), those run as scratch; where they do not, the last
//! 4 rows run once more as a chunk of their own (the same values again).
//! Numerics (`quant::fp8_groups`): x's quantization adds at most 2^-4 of a value plus 2^-10 of
//! its group's multiplier; the codes' products are summed in f32 and scaled per group by the
//! GEMM, the result rounded once to the storage type, then the bias added and rounded again.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, check_linear};
use crate::backend::cuda::blas::padded_rows;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::{KernelFamily, StorageDType};
use crate::backend::cuda::ops::DeviceQuantWeight;
use crate::quant::fp8_groups::{groups, GROUP};
use crate::{NinferError, Result};

/// Threads of a `fp8_quantize_groups` block (a row), of a `fp8_block_scales` block and of a
/// `fp8_bias_rows` block.
const BLOCK_THREADS: u32 = 256;

/// Alignment of each part of the route's workspace: cuBLASLt's 16 bytes for operands and
/// multipliers (the codes start the workspace, 256-aligned, where no multipliers are widened).
const PART_ALIGN: usize = 16;

/// Bytes of the weight's multipliers in cuBLASLt's layout, [ceil(n / 128)][L4] f32.
pub fn fp8_block_scale_bytes(n: usize, k: usize) -> usize {
    4 * n.div_ceil(GROUP) * groups(k).next_multiple_of(4)
}

/// Where a chunk of `rows` rows at K = `k` keeps its parts in the workspace after `head` bytes
/// (the widened weight multipliers, 0 where none): (codes offset, multipliers offset, end).
fn chunk_layout(head: usize, rows: usize, k: usize) -> (usize, usize, usize) {
    let codes = head.next_multiple_of(PART_ALIGN);
    let scales = (codes + rows * k).next_multiple_of(PART_ALIGN);
    (codes, scales, scales + 4 * groups(k) * rows)
}

/// Rows of x one chunk of the route takes (a multiple of 4, cuBLASLt's rule) in a workspace
/// of `ws_bytes` bytes whose first `head` bytes are taken, at K = `k`: its codes (`rows * k`
/// bytes) and multipliers (`4 * rows * ceil(k / 128)`), each part aligned.
pub fn fp8_block_chunk_rows(ws_bytes: usize, head: usize, k: usize) -> usize {
    let free = ws_bytes.saturating_sub(head.next_multiple_of(PART_ALIGN) + 2 * PART_ALIGN);
    (free / (k + 4 * groups(k))) / 4 * 4
}

/// The (first row, rows) segments the route runs over `run` rows in chunks of at most `chunk`
/// rows (a multiple of 4): every segment a multiple of 4 rows; where `run` is not, the last 4
/// rows once more as a segment of their own (`run` >= 4).
pub fn fp8_block_segments(run: usize, chunk: usize) -> Vec<(usize, usize)> {
    debug_assert!(chunk >= 4 && chunk.is_multiple_of(4) && run >= 4);
    let whole = run / 4 * 4;
    let mut out: Vec<(usize, usize)> = (0..whole).step_by(chunk).map(|r0| (r0, chunk.min(whole - r0))).collect();
    if whole < run {
        out.push((run - 4, 4));
    }
    out
}

/// Rows the route runs for `m` rows of x and y holding `x_len` and `y_len` elements: the dense
/// GEMM's padded count (blas.rs `padded_rows`) or m rounded up to 4 where both hold that many
/// (rows m.. then scratch), else m.
fn run_rows(m: usize, x_len: usize, y_len: usize, n: usize, k: usize) -> usize {
    let holds = |r: usize| x_len >= r * k && y_len >= r * n;
    let padded = padded_rows(m);
    if padded.is_multiple_of(4) && holds(padded) {
        padded
    } else if holds(m.next_multiple_of(4)) {
        m.next_multiple_of(4)
    } else {
        m
    }
}

impl CudaDevice {
    /// x [m, k] (storage type) into E4M3FN codes [rows_ld, k] and per-group multipliers
    /// [ceil(k / 128), rows_ld] (cuBLASLt's VEC128_32F layout, the rows contiguous), rows m ..
    /// rows_ld zero: `quant::fp8_groups::quantize_groups`, bit for bit. k a multiple of 8,
    /// rows_ld of 4 and at least m, x 16-byte aligned.
    pub fn fp8_quantize_groups(&self, x: &impl DevicePtr<u16>, codes: &mut impl DevicePtrMut<u8>, scales: &mut impl DevicePtrMut<f32>, m: usize, rows_ld: usize, k: usize) -> Result<()> {
        check_len("fp8_quantize_groups x", x.len(), m * k)?;
        check_len("fp8_quantize_groups codes", codes.len(), rows_ld * k)?;
        check_len("fp8_quantize_groups scales", scales.len(), rows_ld * groups(k))?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (cp, _b) = codes.device_ptr_mut(s);
        let (sp, _c) = scales.device_ptr_mut(s);
        self.fp8_quantize_groups_launch(xp, cp, sp, m, rows_ld, k)
    }

    fn fp8_quantize_groups_launch(&self, x: u64, codes: u64, scales: u64, m: usize, rows_ld: usize, k: usize) -> Result<()> {
        if !k.is_multiple_of(8) || !rows_ld.is_multiple_of(4) || m > rows_ld || !x.is_multiple_of(16) || !codes.is_multiple_of(8) || !scales.is_multiple_of(16) {
            return Err(NinferError::Device(format!(
                "fp8_quantize_groups: K = {k} must be a multiple of 8, the {rows_ld} rows of the codes a multiple of 4 holding the {m} of x, x and the multipliers 16-byte and the codes 8-byte aligned"
            )));
        }
        if rows_ld == 0 {
            return Ok(());
        }
        let f = self.function(KernelFamily::Fp8Gemm, "fp8_quantize_groups")?;
        let grid = rows_ld.min(1 << 16) as u32;
        let args = kargs![x, codes, scales, as_i32("fp8 rows", m)?, as_i32("fp8 rows_ld", rows_ld)?, as_i32("fp8 k", k)?];
        self.launch(&f, cfg((grid, 1, 1), BLOCK_THREADS), "fp8_quantize_groups", &args)
    }

    /// y = x W^T (+ bias) for `m` rows of x through the block route (module doc): `w` an HF
    /// block FP8 weight of 128 x 128 blocks without a dense tail (`is_fp8_block128`), N and K
    /// multiples of 16, x and y 16-byte aligned; `workspace` the model's dequantization
    /// workspace. Where `x` and `y` hold more rows than `m` (`run_rows`), the extra rows of `y`
    /// are written too, so they must be scratch, as `CudaDevice::gemm`.
    pub fn fp8_block_linear(
        &self,
        x: &impl DevicePtr<u16>,
        w: &DeviceQuantWeight,
        bias: Option<&CudaSlice<u16>>,
        workspace: &mut CudaSlice<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
    ) -> Result<()> {
        let (n, k) = (w.n, w.k);
        check_linear("fp8_block_linear", x.len(), y.len(), bias.map(|b| b.len()), [m, n, k])?;
        if m == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (w_codes, w_scales, kind) = w
            .fp8_block_planes(s)
            .ok_or_else(|| NinferError::Device(format!("{}: the block-scaled FP8 route takes HF block FP8 weights of 128 x 128 blocks without dense rows, not {}", w.name, w.format.name())))?;
        let (nb, l) = (n.div_ceil(GROUP), groups(k));
        let l4 = l.next_multiple_of(4);
        // The checkpoint's F32 multipliers are cuBLASLt's layout where L is a multiple of 4.
        let widen = kind != 0 || l != l4;
        let head = if widen { fp8_block_scale_bytes(n, k) } else { 0 };
        let chunk = fp8_block_chunk_rows(2 * workspace.len(), head, k);
        let run = run_rows(m, x.len(), y.len(), n, k);
        if chunk < 4 || run < 4 {
            return Err(NinferError::Device(format!("{}: the block-scaled FP8 route runs 4 rows or more, in a workspace of {} elements that holds 4 rows of K = {k} codes ({m} rows, chunks of {chunk})", w.name, workspace.len())));
        }
        let f16_out = self.storage() == StorageDType::F16;
        let (xp, _a) = x.device_ptr(s);
        let (yp, _b) = y.device_ptr_mut(s);
        let bp = bias.map(|b| b.device_ptr(s).0);
        let (wsp, _c) = workspace.device_ptr_mut(s);
        let ws_scales = if widen {
            let f = self.function(KernelFamily::Fp8Gemm, "fp8_block_scales")?;
            let grid = ((nb * l4).div_ceil(BLOCK_THREADS as usize) as u32, 1, 1);
            let args = kargs![w_scales, kind as i32, wsp, as_i32("fp8 blocks", nb)?, as_i32("fp8 l", l)?, as_i32("fp8 l4", l4)?];
            self.launch(&f, cfg(grid, BLOCK_THREADS), "fp8_block_scales", &args)?;
            wsp
        } else {
            w_scales
        };
        for (r0, r) in fp8_block_segments(run, chunk) {
            let (codes_off, scales_off, _) = chunk_layout(head, r, k);
            let (codes, xs) = (wsp + codes_off as u64, wsp + scales_off as u64);
            let (xr, yr) = (xp + (r0 * k * 2) as u64, yp + (r0 * n * 2) as u64);
            self.fp8_quantize_groups_launch(xr, codes, xs, m.saturating_sub(r0).min(r), r, k)?;
            self.fp8_block_gemm_raw(codes, xs, w_codes, ws_scales, yr, r, n, k, f16_out)?;
            if let Some(bp) = bp {
                let f = self.function(KernelFamily::Fp8Gemm, "fp8_bias_rows")?;
                let grid = ((n / 8).div_ceil(BLOCK_THREADS as usize) as u32, r.min(65_535) as u32, 1);
                let args = kargs![yr, bp, as_i32("fp8 rows", r)?, as_i32("fp8 n", n)?];
                self.launch(&f, cfg(grid, BLOCK_THREADS), "fp8_bias_rows", &args)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_their_codes_and_multipliers_after_the_weight_multipliers() {
        for (ws, head, k) in [(2 * 256 * 64, 0, 64), (2 * 4096 * 14336, fp8_block_scale_bytes(4096, 14336), 14336), (2 * 16 * 320, 64, 320), (1 << 20, 0, 5120)] {
            let r = fp8_block_chunk_rows(ws, head, k);
            assert!(r >= 4 && r.is_multiple_of(4), "ws {ws} k {k}: {r} rows");
            assert!(chunk_layout(head, r, k).2 <= ws, "ws {ws} k {k}: {r} rows overflow");
            assert!(chunk_layout(head, r, k).0 >= head && chunk_layout(head, r, k).0.is_multiple_of(PART_ALIGN) && chunk_layout(head, r, k).1.is_multiple_of(PART_ALIGN));
            assert!(chunk_layout(head, r + 4, k).2 > ws - 3 * PART_ALIGN, "ws {ws} k {k}: {r} rows leave 4 rows' room");
        }
        // A Llama-3-8B-shaped workspace (its gate_up, [28672, 4096]) takes an 8k-token prefill
        // in one chunk at every K of the model.
        for k in [4096, 14336] {
            assert!(fp8_block_chunk_rows(2 * 28672 * 4096, fp8_block_scale_bytes(28672, k), k) >= 8192);
        }
        assert_eq!(fp8_block_chunk_rows(100, 0, 16), 0);
        // The dequantization workspace of any weight the route takes (its N x K in the storage
        // type) holds 4 rows beside the widened multipliers (the plan counts nothing more).
        for (n, k) in [(16, 16), (16, 4096), (4096, 16), (144, 336), (28672, 4096)] {
            assert!(fp8_block_chunk_rows(2 * n * k, fp8_block_scale_bytes(n, k), k) >= 4, "[{n}, {k}]");
        }
        // [n, k] = [130, 320]: 2 blocks of rows, 3 K blocks widened to 4.
        assert_eq!(fp8_block_scale_bytes(130, 320), 4 * 2 * 4);
    }

    #[test]
    fn segments_cover_every_row_in_multiples_of_4() {
        assert_eq!(fp8_block_segments(1000, 1 << 20), [(0, 1000)]);
        assert_eq!(fp8_block_segments(1000, 400), [(0, 400), (400, 400), (800, 200)]);
        assert_eq!(fp8_block_segments(17, 1 << 20), [(0, 16), (13, 4)]);
        assert_eq!(fp8_block_segments(17, 8), [(0, 8), (8, 8), (13, 4)]);
        assert_eq!(fp8_block_segments(6, 8), [(0, 4), (2, 4)]);
        for (run, chunk) in [(17, 4), (1001, 64), (4, 4), (130, 12)] {
            let segs = fp8_block_segments(run, chunk);
            let mut hit = vec![false; run];
            for (r0, r) in segs {
                assert!(r.is_multiple_of(4) && r <= chunk && r0 + r <= run, "run {run} chunk {chunk}: ({r0}, {r})");
                hit[r0..r0 + r].iter_mut().for_each(|h| *h = true);
            }
            assert!(hit.iter().all(|&h| h), "run {run} chunk {chunk}");
        }
    }

    #[test]
    fn padded_rows_run_where_the_buffers_hold_them() {
        let (n, k) = (256, 512);
        // 17 rows: 32 (padded_rows) where both hold 32 rows, 20 where both hold 20, else 17.
        assert_eq!(run_rows(17, 32 * k, 32 * n, n, k), 32);
        assert_eq!(run_rows(17, 20 * k, 20 * n, n, k), 20);
        assert_eq!(run_rows(17, 32 * k, 17 * n, n, k), 17);
        assert_eq!(run_rows(1000, 1000 * k, 1000 * n, n, k), 1000);
        // Past the padded sizes, m rounded up to 4 where the buffers hold it.
        assert_eq!(run_rows(100_001, 100_004 * k, 100_004 * n, n, k), 100_004);
    }
}
