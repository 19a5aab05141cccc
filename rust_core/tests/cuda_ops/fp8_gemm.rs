//! The FP8 prefill route of FP8_E4M3FN_ROW_BF16S weights (cuda/fp8_gemm.cu, ops/fp8_linear.rs,
//! cuBLASLt's FP8 GEMM): the activation quantization kernel equals the CPU encoder bit for bit,
//! `Linear` chooses the route where the device and the shape allow it (sm_89+, bf16 storage, N
//! and K multiples of 16) and the dequantize route elsewhere, and the route's output is within
//! the error E4M3FN activations allow of the CPU matmul over the dequantized weights.

use super::harness::{check, from_bits, gpu, rounded, tol16, upload, Out32, Rng, STORAGES};
use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};
use ninfer_core::model::cuda::linear::{Linear, QuantPrefill, QuantWorkspace};
use ninfer_core::quant::scalars::{f32_to_e4m3, E4M3_MAX};
use ninfer_core::quant::{dequantize, quantize, QuantFormat, QuantWeight};

const FP8: QuantFormat = QuantFormat::Fp8E4m3fnRowBf16s;

/// Rows of activations with the edge cases of a row multiplier: uniform rows, a zero row (no
/// multiplier), a row with one outlier 300x the rest (most codes of the row subnormal) and a
/// row of tiny values.
pub(super) fn activations(rng: &mut Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = rng.vec(m * k, -1.0, 1.0);
    if m >= 4 {
        x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
        x[2 * k..3 * k].iter_mut().for_each(|v| *v *= 0.01);
        x[2 * k + 5] = 3.0;
        x[3 * k..4 * k].iter_mut().for_each(|v| *v *= 1e-30);
    }
    x
}

/// The CPU's quantization of one row as the kernel defines it: (codes, amax / 448).
fn quantize_row(x: &[f32]) -> (Vec<u8>, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = amax / E4M3_MAX;
    let codes = x.iter().map(|&v| if s == 0.0 { 0 } else { f32_to_e4m3(v / s) }).collect();
    (codes, s)
}

#[test]
fn fp8_quantize_rows_equals_the_cpu_encoder_bit_for_bit() {
    for st in STORAGES {
        let Some(dev) = gpu("fp8_quantize_rows", st) else { return };
        let mut rng = Rng::new(89);
        let (m, k) = (37, 208);
        let x = rounded(&activations(&mut rng, m, k), st);
        let xd = upload(&dev, &x);
        let mut codes: CudaSlice<u8> = dev.stream().alloc_zeros(m * k).unwrap();
        let mut scales = Out32::new(&dev, m);
        dev.fp8_quantize_rows(&xd, &mut codes, &mut scales.view(), m, k).unwrap();
        let got_scales = scales.read(&dev, "fp8 scales");
        let got_codes = dev.stream().clone_dtoh(&codes).unwrap();
        for t in 0..m {
            let (want, s) = quantize_row(&x[t * k..(t + 1) * k]);
            assert_eq!(got_scales[t].to_bits(), s.to_bits(), "{st:?} row {t}: multiplier {:e}, want {s:e}", got_scales[t]);
            for (i, (g, w)) in got_codes[t * k..(t + 1) * k].iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{st:?} row {t} value {i} ({:e}): code {g:#04x}, want {w:#04x}", x[t * k + i]);
            }
        }
    }
}

/// Whether `dev` runs FP8 tensor-core GEMMs (what `QuantPrefill::choose` asks of the device).
fn fp8_device(dev: &CudaDevice) -> bool {
    dev.compute_capability() >= (8, 9) && dev.storage() == StorageDType::Bf16
}

/// The FP8 route's output `got` against `want` = x W^T (+ bias) over x's storage values and the
/// dequantized weight, by two bounds from E4M3FN's precision (3 mantissa bits, round to nearest:
/// a value x_i / s of the normal range is off by at most 2^-4 of itself, one of the subnormal
/// range, below 2^-6, by at most half its step, 2^-10, times the row multiplier s):
/// - each element within the worst case: E = sum_i (2^-4 |x_i| + 2^-10 s) |w_i| for the codes
///   of x; the GEMM's accumulation, 2^-7 sum_i |x_i w_i| (Hopper's FP8 tensor cores keep about
///   14 bits of a running sum over the 128 values cuBLASLt adds before promoting to f32); the
///   two bf16 roundings of the sums and of the scaled result, 2^-8 of the output and of E, and
///   2^-9 of the bias;
/// - the errors' root mean square, each normalised by the standard deviation its element's
///   rounding errors can at most have (uniform errors of at most those sizes, independent
///   across i: 2^-4 / sqrt(3) sqrt(sum_i x_i^2 w_i^2) for x's codes, the same for the
///   subnormal steps, the bf16 roundings as above), at most 1. The worst case alone would pass
///   a product off by its own size (its sum of |x_i w_i| grows as K, the product as sqrt(K));
///   this bound fails such an error by ~30x.
#[allow(clippy::too_many_arguments)]
fn check_fp8_error(what: &str, got: &[f32], want: &[f32], x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, n: usize, k: usize) {
    let p = |e: i32| (2f64).powi(e);
    let (mut sq, mut worst) = (0.0f64, 0.0f64);
    for t in 0..m {
        let xr = &x[t * k..(t + 1) * k];
        let s = xr.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64 / 448.0;
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            let (mut abs_sum, mut sq_sum, mut w_abs, mut w_sq) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
            for (&a, &b) in xr.iter().zip(wr) {
                let (a, b) = (a as f64, b as f64);
                abs_sum += (a * b).abs();
                sq_sum += a * a * b * b;
                w_abs += b.abs();
                w_sq += b * b;
            }
            let b = bias.map_or(0.0, |b| b[j].abs() as f64);
            let out = want[t * n + j].abs() as f64;
            let codes = p(-4) * abs_sum + p(-10) * s * w_abs;
            let bound = codes * (1.0 + p(-8)) + p(-7) * abs_sum * (1.0 + p(-4)) + (p(-8) + p(-20)) * out + p(-9) * b;
            let sigma = p(-4) / 3f64.sqrt() * sq_sum.sqrt() + p(-10) * s / 3f64.sqrt() * w_sq.sqrt() + p(-8) * out + p(-9) * b;
            let err = (got[t * n + j] as f64 - want[t * n + j] as f64).abs();
            assert!(err <= bound, "{what}: [{t}, {j}] = {}, want {} (err {err:e} > worst case {bound:e})", got[t * n + j], want[t * n + j]);
            if bound > 0.0 {
                worst = worst.max(err / bound);
            }
            if sigma > 0.0 {
                sq += (err / sigma).powi(2);
            }
        }
    }
    let rms = (sq / (m * n) as f64).sqrt();
    println!("PARITY op={what} storage=bf16 rms_err/sigma={rms:.3} max_err/worst_case={worst:.3}");
    assert!(rms <= 1.0, "{what}: errors {rms:.3} standard deviations of E4M3FN rounding, more than 1");
}

/// y = x W^T (+ bias) over f32 values in f64, each result as f32.
pub(super) fn matmul_bias(x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    for t in 0..m {
        for j in 0..n {
            let s: f64 = x[t * k..(t + 1) * k].iter().zip(&w[j * k..(j + 1) * k]).map(|(&a, &b)| a as f64 * b as f64).sum();
            y[t * n + j] = (s + bias.map_or(0.0, |b| b[j] as f64)) as f32;
        }
    }
    y
}

/// `lin.forward` of `rows` rows into an output poisoned with NaN, then `scratch` rows the
/// route may write (a step buffer's rows past the step's), then a guard region: the rows'
/// values, once every one was written and nothing past the scratch rows.
pub(super) fn forward_guarded(dev: &CudaDevice, lin: &Linear, x: &CudaSlice<u16>, lin32: &mut CudaSlice<f32>, rows: usize, scratch: usize) -> Vec<f32> {
    const GUARD: u16 = 0x7fa5;
    let (len, end) = (rows * lin.n, (rows + scratch) * lin.n);
    let mut host = vec![0x7fc0u16; end];
    host.extend([GUARD; 97]);
    let mut y = dev.stream().clone_htod(&host).unwrap();
    lin.forward(dev, x, &mut y, lin32, rows).unwrap();
    dev.synchronize().unwrap();
    let back = dev.stream().clone_dtoh(&y).unwrap();
    assert!(back[end..].iter().all(|&g| g == GUARD), "[{}, {}] at {rows} rows: write past the end of the output", lin.n, lin.k);
    let v = from_bits(&back[..len], dev.storage());
    assert!(v.iter().all(|x| !x.is_nan()), "[{}, {}] at {rows} rows: an output left unwritten", lin.n, lin.k);
    v
}

/// `lin.forward` of the 17 rows `x` through buffers of 32 rows (`padded_rows(17)`, which the
/// routes run, rows 17.. scratch holding random values): the 17 rows' outputs.
pub(super) fn forward_padded17(dev: &CudaDevice, lin: &Linear, x: &[f32], rng: &mut Rng) -> Vec<f32> {
    let mut xp = x.to_vec();
    xp.extend(rounded(&rng.vec(15 * lin.k, -1.0, 1.0), dev.storage()));
    let mut lin32p: CudaSlice<f32> = dev.stream().alloc_zeros(32 * lin.n).unwrap();
    forward_guarded(dev, lin, &upload(dev, &xp), &mut lin32p, 17, 15)
}

/// `lin.forward` at `m` random rows (its route, named `route`) and the dequantize route of the
/// same weight, timed, printed as `TIMING {tag} route=.. proj={what} m= n= k= ms= tflops=`.
pub(super) fn time_against_dequantize(dev: &CudaDevice, lin: &Linear, rng: &mut Rng, tag: &str, route: &str, what: &str, m: usize) {
    let (n, k) = (lin.n, lin.k);
    let xd = upload(dev, &rng.vec(m * k, -1.0, 1.0));
    let mut y: CudaSlice<u16> = dev.stream().alloc_zeros(m * n).unwrap();
    let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(1).unwrap();
    let mut ws = dev.stream().alloc_zeros::<u16>(n * k).unwrap();
    let q = lin.quant.as_ref().unwrap();
    let route_ms = super::time_ms(dev, 10, || lin.forward(dev, &xd, &mut y, &mut lin32, m).unwrap());
    let deq_ms = super::time_ms(dev, 10, || dev.quant_linear(&xd, &q.weight, None, &mut ws, &mut lin32, &mut y, m).unwrap());
    let flop = 2.0 * (m * n * k) as f64;
    for (r, ms) in [(route, route_ms), ("dequantize", deq_ms)] {
        println!("TIMING {tag} route={r} proj={what} m={m} n={n} k={k} ms={ms:.3} tflops={:.1}", flop / (ms * 1e-3) / 1e12);
    }
    assert!(route_ms > 0.0 && deq_ms > 0.0);
}

/// `Linear::forward` over an FP8 row weight at prefill sizes: the FP8 route where the device
/// has FP8 tensor cores and N, K are multiples of 16 (rows 17, 128 and 1000, the last in two
/// workspace chunks at [256, 512]; 17 also in buffers of 32 rows, which the route runs padded),
/// with and without a bias, within E4M3FN's error of the CPU
/// matmul over the dequantized weight; [40, 200] takes the dequantize route (within the dense
/// GEMM's tolerance of the same matmul over the storage-type weight), as every shape does on
/// devices without FP8 tensor cores and on f16 storage.
#[test]
fn fp8_prefill_linear_is_within_e4m3_error_of_the_dequantized_matmul() {
    for st in STORAGES {
        let Some(dev) = gpu("fp8_prefill_linear", st) else { return };
        if !fp8_device(&dev) {
            let (major, minor) = dev.compute_capability();
            eprintln!("SKIP part of fp8_prefill_linear ({st:?}): compute capability {major}.{minor} has no FP8 tensor-core route; checking that it dequantizes");
        }
        let mut rng = Rng::new(1789);
        for (n, k) in [(256, 512), (48, 4096), (40, 200)] {
            let fits = n % 16 == 0 && k % 16 == 0;
            let values = rng.vec(n * k, -1.0, 1.0);
            let w = QuantWeight::packed("model.layers.0.mlp.down_proj.weight", FP8, [n, k], quantize(FP8, "w", &values, [n, k]).unwrap());
            let dense = dequantize(&w.view()).unwrap();
            let bias_host = rounded(&rng.vec(n, -0.5, 0.5), st);
            for with_bias in [false, true] {
                let bias = with_bias.then(|| upload(&dev, &bias_host));
                let lin = Linear::quantized(&dev, &w, bias, QuantWorkspace::new(&dev, n * k).unwrap()).unwrap();
                let route = lin.quant.as_ref().unwrap().prefill;
                let fp8 = fits && fp8_device(&dev);
                assert_eq!(route, if fp8 { QuantPrefill::Fp8Gemm } else { QuantPrefill::Dequantize }, "[{n}, {k}] on {st:?}");
                for rows in [17, 128, 1000] {
                    let x = rounded(&activations(&mut rng, rows, k), st);
                    let xd = upload(&dev, &x);
                    let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(rows * n).unwrap();
                    let got = forward_guarded(&dev, &lin, &xd, &mut lin32, rows, 0);
                    let b = with_bias.then_some(&bias_host[..]);
                    let shape = format!("rows{rows} n{n} k{k} bias={with_bias}");
                    if fp8 {
                        let want = matmul_bias(&x, &dense, b, rows, n, k);
                        check_fp8_error(&format!("fp8_linear {shape}"), &got, &want, &x, &dense, b, rows, n, k);
                        if rows == 17 {
                            // Buffers of 32 rows (a step's buffers are larger than its rows): the
                            // route runs the 32 rows of padded_rows(17), rows 17.. scratch; the
                            // first 17 within the same bounds.
                            let padded = forward_padded17(&dev, &lin, &x, &mut rng);
                            check_fp8_error(&format!("fp8_linear padded {shape}"), &padded, &want, &x, &dense, b, rows, n, k);
                        }
                    } else {
                        let want = matmul_bias(&x, &rounded(&dense, st), b, rows, n, k);
                        check("fp8 weight, dequantize route", st, &shape, &got, &rounded(&want, st), tol16(st));
                    }
                }
            }
        }
    }
}

/// The FP8 route against the dequantize route on a Llama-3-8B layer's gate_up ([28672, 4096])
/// and down ([4096, 14336]) at 8192 rows: time per call and the TFLOP/s each reaches. Prints
/// `TIMING fp8_prefill ...` lines (the target, measured by the GPU run: the FP8 route
/// at >= 0.5 of the device's FP8 tensor rate at 8k tokens).
#[test]
fn fp8_prefill_timing() {
    let Some(dev) = gpu("fp8_prefill_timing", StorageDType::Bf16) else { return };
    if !fp8_device(&dev) {
        eprintln!("SKIP fp8_prefill_timing: no FP8 tensor-core route on this device");
        return;
    }
    let mut rng = Rng::new(8);
    let m = 8192;
    for (what, n, k) in [("gate_up", 28672, 4096), ("down", 4096, 14336)] {
        let w = QuantWeight::packed(what, FP8, [n, k], quantize(FP8, what, &rng.vec(n * k, -1.0, 1.0), [n, k]).unwrap());
        let lin = Linear::quantized(&dev, &w, None, QuantWorkspace::new(&dev, n * k).unwrap()).unwrap();
        time_against_dequantize(&dev, &lin, &mut rng, "fp8_prefill", "fp8_gemm", what, m);
    }
}
