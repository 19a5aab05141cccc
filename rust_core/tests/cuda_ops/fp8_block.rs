//! The block-scaled FP8 prefill route of HF block FP8 weights (cuda/fp8_gemm.cu, ops/fp8_block.rs,
//! cuBLASLt's block scaling): the per-group activation quantization kernel equals the CPU
//! encoder (`quant::fp8_groups`) bit for bit in cuBLASLt's multiplier layout, `Linear` takes the
//! route where the device's cuBLASLt has it (sm_90; a device without it dequantizes, a finding
//! on sm_90) and the shape allows it, and the route's output is within its derived bounds of
//! both the exact product over the quantized activations and the matmul over the dequantized
//! weight, for K with a partial last block and row counts that are not multiples of 4.

use super::fp8_gemm::{activations, forward_guarded, forward_padded17, matmul_bias, time_against_dequantize};
use super::harness::{check, gpu, rounded, tol16, upload, Out32, Rng, STORAGES};
use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};
use ninfer_core::model::cuda::linear::{Linear, QuantPrefill, QuantWorkspace};
use ninfer_core::quant::fp8_groups::{block_route_reference, group_error_bound, groups, quantize_groups, GROUP};
use ninfer_core::quant::scalars::e4m3_table;
use ninfer_core::quant::{dequantize, OwnedRaw, QuantFormat, QuantWeight, RawDtype};

const BLOCKS: QuantFormat = QuantFormat::HfFp8Block { block_n: 128, block_k: 128 };

#[test]
fn fp8_quantize_groups_equals_the_cpu_encoder_bit_for_bit() {
    for st in STORAGES {
        let Some(dev) = gpu("fp8_quantize_groups", st) else { return };
        let mut rng = Rng::new(128);
        // K = 320: a partial last group of 64; 37 rows padded to 40, rows 37.. zero.
        for (m, rows_ld, k) in [(37, 40, 320), (6, 8, 4096), (4, 4, 48)] {
            let l = groups(k);
            let x = rounded(&activations(&mut rng, m, k), st);
            let xd = upload(&dev, &x);
            let mut codes: CudaSlice<u8> = dev.stream().clone_htod(&vec![0xabu8; rows_ld * k]).unwrap();
            let mut scales = Out32::new(&dev, rows_ld * l);
            dev.fp8_quantize_groups(&xd, &mut codes, &mut scales.view(), m, rows_ld, k).unwrap();
            let got_scales = scales.read(&dev, "fp8 group scales");
            let got_codes = dev.stream().clone_dtoh(&codes).unwrap();
            let (want_codes, want_scales) = quantize_groups(&x, m, k);
            for t in 0..rows_ld {
                for g in 0..l {
                    let want = if t < m { want_scales[t * l + g] } else { 0.0 };
                    let got = got_scales[g * rows_ld + t];
                    assert_eq!(got.to_bits(), want.to_bits(), "{st:?} k {k} row {t} group {g}: multiplier {got:e}, want {want:e} (at [group][row])");
                }
                for i in 0..k {
                    let want = if t < m { want_codes[t * k + i] } else { 0 };
                    let got = got_codes[t * k + i];
                    assert_eq!(got, want, "{st:?} k {k} row {t} value {i}: code {got:#04x}, want {want:#04x}");
                }
            }
        }
    }
}

/// A random HF block FP8 weight `[n, k]`: codes without the NaN words, multipliers in
/// [0.001, 0.05) stored as `scale_dtype` (F32 or BF16).
fn block_weight(rng: &mut Rng, name: &str, [n, k]: [usize; 2], scale_dtype: RawDtype) -> QuantWeight {
    let data: Vec<u8> = (0..n * k).map(|_| rng.below(256) as u8).map(|c| if c & 0x7f == 0x7f { c - 1 } else { c }).collect();
    let shape = vec![n.div_ceil(128), groups(k)];
    let bytes = (0..shape[0] * shape[1])
        .flat_map(|_| {
            let v = rng.range(0.001, 0.05);
            match scale_dtype {
                RawDtype::F32 => v.to_le_bytes().to_vec(),
                _ => half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            }
        })
        .collect();
    let scale = OwnedRaw { name: format!("{name}_scale_inv"), dtype: scale_dtype, shape, bytes };
    QuantWeight { scale: Some(scale), ..QuantWeight::packed(name, BLOCKS, [n, k], data) }
}

/// The weight's multipliers as f32, [ceil(n / 128), groups(k)] row-major.
fn weight_scales(w: &QuantWeight) -> Vec<f32> {
    let s = w.scale.as_ref().unwrap();
    match s.dtype {
        RawDtype::F32 => s.bytes.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        _ => s.bytes.chunks(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect(),
    }
}

/// Whether `dev` has FP8 tensor cores (the route's candidates; cuBLASLt is asked at load).
fn fp8_device(dev: &CudaDevice) -> bool {
    dev.compute_capability() >= (8, 9)
}

/// The route's output `got` ([m, n]) against the exact product over x's quantized groups
/// (`quant::fp8_groups::block_route_reference`, plus the bias) and against x W^T (+ bias) over
/// x's storage values and the dequantized weight `w`. With u the storage type's rounding (2^-8
/// bf16, 2^-11 f16, relative), A = sum_i |xq_i w_i| over x's quantized values:
/// - against the exact route product r, each element within e + u (|r| + e) + u (|r| + e +
///   |bias|) (1 + u) + 2^-25: e = 2^-7 A the GEMM's accumulation (Hopper's FP8 tensor cores keep
///   about 14 bits of a running sum within a 128-value block before cuBLASLt promotes it to
///   f32 and scales it), then the output's rounding and the bias's rounding after it, and
///   f16's subnormal step;
/// - against the dequantized matmul, that plus the quantization's sum_i |w_i| (2^-4 |x_i| +
///   2^-10 s_g(i)) (`group_error_bound`, each value within its group's bound);
/// - the route's own errors (the GEMM's and the roundings, `got - r`) in RMS at most half the
///   quantization's (`r - x W^T`): they are ~0.1-0.2% of an output where E4M3's rounding is
///   ~2-3%, so a misread multiplier layout (a permutation of plausible multipliers, which the
///   worst case can pass) fails it.
#[allow(clippy::too_many_arguments)]
fn check_block_route(what: &str, st: StorageDType, got: &[f32], x: &[f32], w: &QuantWeight, dense: &[f32], bias: Option<&[f32]>, m: usize) {
    let [n, k] = w.shape;
    let p = |e: i32| (2f64).powi(e);
    let u = if st == StorageDType::F16 { p(-11) } else { p(-8) };
    let table = e4m3_table();
    let (codes, xs) = quantize_groups(x, m, k);
    let l = groups(k);
    let r = block_route_reference(&codes, &xs, &w.data, &weight_scales(w), m, n, k);
    let (mut route_sq, mut quant_sq, mut worst) = (0.0f64, 0.0f64, 0.0f64);
    for t in 0..m {
        let xq: Vec<f64> = (0..k).map(|i| table[codes[t * k + i] as usize] as f64 * xs[t * l + i / GROUP] as f64).collect();
        for j in 0..n {
            let wr = &dense[j * k..(j + 1) * k];
            let (mut a, mut exact, mut quant) = (0.0f64, 0.0f64, 0.0f64);
            for i in 0..k {
                let (xi, wi) = (x[t * k + i], wr[i] as f64);
                a += (xq[i] * wi).abs();
                exact += xi as f64 * wi;
                quant += wi.abs() * group_error_bound(xi, xs[t * l + i / GROUP]) + p(-24) * (xi as f64 * wi).abs();
            }
            let b = bias.map_or(0.0, |b| b[j] as f64);
            let e = p(-7) * a;
            let route_bound = e + u * (r[t * n + j].abs() + e) + u * (r[t * n + j].abs() + e + b.abs()) * (1.0 + u) + p(-25);
            let g = got[t * n + j] as f64;
            let (route_err, want_err) = ((g - (r[t * n + j] + b)).abs(), (g - (exact + b)).abs());
            assert!(route_err <= route_bound, "{what}: [{t}, {j}] = {g}, route product {} (err {route_err:e} > {route_bound:e})", r[t * n + j] + b);
            assert!(want_err <= route_bound + quant, "{what}: [{t}, {j}] = {g}, want {} (err {want_err:e} > {:e})", exact + b, route_bound + quant);
            worst = worst.max(want_err / (route_bound + quant));
            route_sq += (g - (r[t * n + j] + b)).powi(2);
            quant_sq += (r[t * n + j] - exact).powi(2);
        }
    }
    let ratio = (route_sq / quant_sq.max(f64::MIN_POSITIVE)).sqrt();
    println!("PARITY op={what} storage={st:?} route_rms/quant_rms={ratio:.3} max_err/bound={worst:.3}");
    assert!(ratio <= 0.5, "{what}: the route's own errors are {ratio:.3} of E4M3 quantization's in RMS (at most 0.5)");
}

/// Whether `Linear` gave `[n, k]` the route it should have on `dev`: the block route where the
/// device has FP8 tensor cores and N, K are multiples of 16 and cuBLASLt has the GEMM; where
/// cuBLASLt has none, a failure on sm_90 with bf16 storage (the route's target: a finding),
/// else the dequantize route with the reason printed. Returns whether the block route runs.
fn expect_route(dev: &CudaDevice, st: StorageDType, lin: &Linear, n: usize, k: usize) -> bool {
    let route = lin.quant.as_ref().unwrap().prefill;
    let fits = n.is_multiple_of(16) && k.is_multiple_of(16) && fp8_device(dev);
    if !fits {
        assert_eq!(route, QuantPrefill::Dequantize, "[{n}, {k}] on {st:?}");
        return false;
    }
    match dev.fp8_block_gemm_available(n, k, st == StorageDType::F16) {
        Ok(()) => {
            assert_eq!(route, QuantPrefill::Fp8Block, "[{n}, {k}] on {st:?}: cuBLASLt has the GEMM");
            true
        }
        Err(e) => {
            let (major, minor) = dev.compute_capability();
            assert!(!((major, minor) == (9, 0) && st == StorageDType::Bf16), "cuBLASLt has no block-scaled FP8 GEMM for [{n}, {k}] on sm_90 (bf16 output): {e}");
            eprintln!("SKIP part of fp8_block_prefill_linear ([{n}, {k}], {st:?}, compute capability {major}.{minor}): {e}; checking that it dequantizes");
            assert_eq!(route, QuantPrefill::Dequantize, "[{n}, {k}] on {st:?} without the GEMM");
            false
        }
    }
}

/// `Linear::forward` over HF block FP8 weights at prefill sizes (rows 17, 128 and 1000; 17 also
/// in buffers of 32 rows, which the route runs padded), with and without a bias: [256, 512]
/// with F32 multipliers (cuBLASLt's layout as stored; 1000 rows in three workspace chunks),
/// [48, 4096] with BF16 ones (widened; N's one block partial), [144, 320] (K's last block of 64 values, N's of 16;
/// 3 K blocks widened to 4) on the block route within `check_block_route`'s bounds; [40, 200]
/// (K and N not multiples of 16) on the dequantize route within the dense GEMM's tolerance, as
/// every shape on devices without the GEMM.
#[test]
fn fp8_block_prefill_linear_is_within_its_bounds_of_the_dequantized_matmul() {
    for st in STORAGES {
        let Some(dev) = gpu("fp8_block_prefill_linear", st) else { return };
        if !fp8_device(&dev) {
            let (major, minor) = dev.compute_capability();
            eprintln!("SKIP part of fp8_block_prefill_linear ({st:?}): compute capability {major}.{minor} has no FP8 tensor cores; checking that it dequantizes");
        }
        let mut rng = Rng::new(1280);
        for (n, k, scale_dtype) in [(256, 512, RawDtype::F32), (48, 4096, RawDtype::BF16), (144, 320, RawDtype::F32), (40, 200, RawDtype::F32)] {
            let w = block_weight(&mut rng, "model.layers.0.mlp.down_proj.weight", [n, k], scale_dtype);
            let dense = dequantize(&w.view()).unwrap();
            let bias_host = rounded(&rng.vec(n, -0.5, 0.5), st);
            for with_bias in [false, true] {
                let bias = with_bias.then(|| upload(&dev, &bias_host));
                let lin = Linear::quantized(&dev, &w, bias, QuantWorkspace::new(&dev, n * k).unwrap()).unwrap();
                let block = expect_route(&dev, st, &lin, n, k);
                for rows in [17, 128, 1000] {
                    let x = rounded(&activations(&mut rng, rows, k), st);
                    let xd = upload(&dev, &x);
                    let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(rows * n).unwrap();
                    let got = forward_guarded(&dev, &lin, &xd, &mut lin32, rows, 0);
                    let b = with_bias.then_some(&bias_host[..]);
                    let shape = format!("rows{rows} n{n} k{k} scales={scale_dtype:?} bias={with_bias}");
                    if block {
                        check_block_route(&format!("fp8_block_linear {shape}"), st, &got, &x, &w, &dense, b, rows);
                        if rows == 17 {
                            // Buffers of 32 rows: the route runs padded_rows(17) = 32 rows, 17..
                            // scratch; the first 17 within the same bounds.
                            let padded = forward_padded17(&dev, &lin, &x, &mut rng);
                            check_block_route(&format!("fp8_block_linear padded {shape}"), st, &padded, &x, &w, &dense, b, rows);
                        }
                    } else {
                        let want = matmul_bias(&x, &rounded(&dense, st), b, rows, n, k);
                        check("hf fp8 block weight, dequantize route", st, &shape, &got, &rounded(&want, st), tol16(st));
                    }
                }
            }
        }
    }
}

/// The block route against the dequantize route on a Llama-3-8B layer's gate_up
/// ([28672, 4096]) and down ([4096, 14336]) as HF block FP8 weights at 8192 rows: time per call
/// and the TFLOP/s each reaches, printed as `TIMING fp8_block_prefill ...` lines in the FP8 row
/// route's format (`fp8_prefill_timing`). A device without the GEMM skips (sm_90: fails).
#[test]
fn fp8_block_prefill_timing() {
    let Some(dev) = gpu("fp8_block_prefill_timing", StorageDType::Bf16) else { return };
    if !fp8_device(&dev) {
        eprintln!("SKIP fp8_block_prefill_timing: no FP8 tensor cores on this device");
        return;
    }
    let mut rng = Rng::new(9);
    let m = 8192;
    for (what, n, k) in [("gate_up", 28672, 4096), ("down", 4096, 14336)] {
        let w = block_weight(&mut rng, what, [n, k], RawDtype::F32);
        let lin = Linear::quantized(&dev, &w, None, QuantWorkspace::new(&dev, n * k).unwrap()).unwrap();
        if !expect_route(&dev, StorageDType::Bf16, &lin, n, k) {
            eprintln!("SKIP fp8_block_prefill_timing: no block-scaled FP8 GEMM on this device");
            return;
        }
        time_against_dequantize(&dev, &lin, &mut rng, "fp8_block_prefill", "fp8_block", what, m);
    }
}
