//! The prefill route of NVFP4 weights on FP4 tensor cores (cuda/fp4_gemm.cu, ops/fp4_linear.rs,
//! cuBLASLt's block-scaled FP4 GEMM): the activation quantization kernel equals the CPU encoder
//! (`quant::nvfp4::quantize_rows`) bit for bit on every GPU; `Linear` chooses the route on
//! sm_100 and newer with bf16 storage and the dequantize route elsewhere; and there the route's
//! output is within its roundings of the CPU product of the quantized activations and the
//! dequantized weight, for a stacked weight whose parts keep their own divisors.

use super::fp8_gemm::{activations, forward_guarded, matmul_bias, time_against_dequantize};
use super::harness::{check, gpu, rounded, tol16, upload, upload_raw, Out32, Rng, STORAGES};
use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};
use ninfer_core::model::cuda::linear::{Linear, LinearRoute, QuantPart, QuantPrefill, QuantWorkspace, WeightFormat};
use ninfer_core::quant::scalars::{e2m1_to_f32, e4m3_to_f32};
use ninfer_core::quant::{dequantize, nvfp4, quantize, QuantFormat, QuantWeight};

/// Whether `dev` runs the FP4 tensor-core route (what `QuantPrefill::choose` asks of it).
fn fp4_device(dev: &CudaDevice) -> bool {
    dev.compute_capability() >= (10, 0) && dev.storage() == StorageDType::Bf16
}

/// Activations with NVFP4's edge cases besides `activations`' (a zero row, an outlier row, a
/// row of 1e-30): a zero group inside a nonzero row, a row whose small values' groups round to
/// no E4M3 scale (the smallest subnormal word then) and, in bf16, a row of 1e-37 whose divisor
/// 2688 / amax overflows binary32.
fn nvfp4_activations(rng: &mut Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = activations(rng, m, k);
    x[16..32].iter_mut().for_each(|v| *v = 0.0);
    if m >= 6 {
        x[4 * k..5 * k].iter_mut().for_each(|v| *v *= 1e-6);
        x[4 * k + 7] = 3.0;
        x[5 * k..6 * k].iter_mut().for_each(|v| *v *= 1e-37);
    }
    x
}

#[test]
fn nvfp4_quantize_rows_equals_the_cpu_encoder_bit_for_bit() {
    for st in STORAGES {
        let Some(dev) = gpu("nvfp4_quantize_rows", st) else { return };
        let mut rng = Rng::new(100);
        for (m, k) in [(1, 64), (37, 1088), (130, 320)] {
            let x = rounded(&nvfp4_activations(&mut rng, m, k), st);
            let rows_ld = m.next_multiple_of(128);
            // Poisoned, so that a padding row or word left unwritten shows.
            let mut codes = upload_raw(&dev, &vec![0xa5u8; rows_ld * k / 2]);
            let mut scales = upload_raw(&dev, &vec![0xa5u8; rows_ld * k / 16]);
            let mut divisors = Out32::with(&dev, &vec![f32::NAN; rows_ld]);
            dev.nvfp4_quantize_rows(&upload(&dev, &x), &mut codes, &mut scales, &mut divisors.view(), m, rows_ld, k).unwrap();
            let (want_codes, want_scales, want_divisors) = nvfp4::quantize_rows(&x, m, rows_ld, k);
            let got_divisors = divisors.read(&dev, "nvfp4 divisors");
            for (t, (g, w)) in got_divisors.iter().zip(&want_divisors).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{st:?} m{m} k{k} row {t}: divisor {g:e}, want {w:e}");
            }
            let got_scales = dev.stream().clone_dtoh(&scales).unwrap();
            for t in 0..rows_ld {
                for g in 0..k / 16 {
                    let i = nvfp4::scale_index(t, g, k);
                    assert_eq!(got_scales[i], want_scales[i], "{st:?} m{m} k{k} row {t} group {g}: scale {:#04x}, want {:#04x}", got_scales[i], want_scales[i]);
                }
            }
            let got_codes = dev.stream().clone_dtoh(&codes).unwrap();
            for (i, (g, w)) in got_codes.iter().zip(&want_codes).enumerate() {
                let (t, c) = (i / (k / 2), 2 * (i % (k / 2)));
                assert_eq!(g, w, "{st:?} m{m} k{k} row {t} values {c}, {}: codes {g:#04x}, want {w:#04x}", c + 1);
            }
        }
    }
}

/// x's rows as the route quantizes them (`quant::nvfp4::quantize_rows`), dequantized left to
/// right in binary32: e2m1(c) * e4m3(s) / d_x.
fn quantized_activations(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let rows_ld = m.next_multiple_of(128);
    let (codes, scales, divisors) = nvfp4::quantize_rows(x, m, rows_ld, k);
    let mut out = vec![0.0f32; m * k];
    for t in 0..m {
        for i in 0..k {
            let byte = codes[(t * k + i) / 2];
            let c = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
            let s = e4m3_to_f32(scales[nvfp4::scale_index(t, i / 16, k)]).unwrap();
            out[t * k + i] = e2m1_to_f32(c) * s / divisors[t];
        }
    }
    out
}

/// The route's output against `want` = xq W^T (+ bias) over the quantized activations and the
/// dequantized weight (f64 sums): each element within the GEMM's bf16 rounding of the sum and
/// the rounding of its division by the row's divisor (2^-8 of the output each, with the f32
/// steps' 2^-23), the bias's (2^-9 of it) and an accumulation slack of 2^-16 of sum |xq_i w_i|
/// (the products of codes and scales are exact in f32; the sums' order is the GEMM's).
#[allow(clippy::too_many_arguments)]
fn check_fp4_error(what: &str, got: &[f32], want: &[f32], xq: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, n: usize, k: usize) {
    let mut worst = 0.0f64;
    for t in 0..m {
        for j in 0..n {
            let abs_sum: f64 = xq[t * k..(t + 1) * k].iter().zip(&w[j * k..(j + 1) * k]).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let out = want[t * n + j].abs() as f64;
            let b = bias.map_or(0.0, |b| b[j].abs() as f64);
            let bound = (2f64.powi(-7) + 2f64.powi(-21)) * (out + b) + 2f64.powi(-9) * b + 2f64.powi(-16) * abs_sum;
            let err = (got[t * n + j] as f64 - want[t * n + j] as f64).abs();
            assert!(err <= bound, "{what}: [{t}, {j}] = {}, want {} (err {err:e} > {bound:e})", got[t * n + j], want[t * n + j]);
            if bound > 0.0 {
                worst = worst.max(err / bound);
            }
        }
    }
    println!("PARITY op={what} storage=bf16 max_err/bound={worst:.3}");
}

/// A `Linear` over NVFP4 parts stacked as a fused projection loads them (each its own divisor).
fn stacked_linear(dev: &CudaDevice, parts: &[QuantWeight], bias: Option<CudaSlice<u16>>, workspace_elems: usize) -> Linear {
    let weight = dev.upload_quant_parts(parts, &[]).unwrap();
    let (n, k) = (weight.n, weight.k);
    let quant = QuantPart::new(dev, weight, QuantWorkspace::new(dev, workspace_elems).unwrap()).unwrap();
    Linear { w: dev.stream().alloc_zeros::<u16>(1).unwrap(), n, k, format: WeightFormat::Quant(QuantFormat::Nvfp4), bias, route: LinearRoute::quantized(), quant: Some(quant) }
}

/// NVFP4 parts of `rows` rows each at K = `k`, their values of different magnitudes (so that
/// their divisors differ), and the dequantized rows of all of them.
fn nvfp4_parts(rng: &mut Rng, rows: &[usize], k: usize) -> (Vec<QuantWeight>, Vec<f32>) {
    let f = QuantFormat::Nvfp4;
    let mut dense = Vec::new();
    let parts = rows
        .iter()
        .zip([1.0f32, 0.01, 30.0, 0.5])
        .enumerate()
        .map(|(i, (&r, mag))| {
            let values: Vec<f32> = rng.vec(r * k, -mag, mag);
            let name = format!("model.layers.0.mlp.part{i}.weight");
            let w = QuantWeight::packed(name.as_str(), f, [r, k], quantize(f, &name, &values, [r, k]).unwrap());
            dense.extend(dequantize(&w.view()).unwrap());
            w
        })
        .collect();
    (parts, dense)
}

/// `Linear::forward` over NVFP4 weights at prefill sizes: one part [256, 1088] and three
/// stacked parts [256 + 128 + 128, 512] with their own divisors, with and without a bias, at
/// 17, 128 and 300 rows (300 also through a workspace of one 128-row chunk: three chunks). On
/// sm_100+ with bf16 storage the FP4 route, within its roundings of the CPU product over the
/// quantized activations; elsewhere the dequantize route, within the dense GEMM's tolerance of
/// the product over the storage-type weight.
#[test]
fn nvfp4_prefill_linear_is_within_its_roundings_of_the_quantized_product() {
    for st in STORAGES {
        let Some(dev) = gpu("nvfp4_prefill_linear", st) else { return };
        let fp4 = fp4_device(&dev);
        if !fp4 {
            let (major, minor) = dev.compute_capability();
            eprintln!("SKIP part of nvfp4_prefill_linear ({st:?}): compute capability {major}.{minor} has no FP4 tensor-core route; checking that it dequantizes");
        }
        let mut rng = Rng::new(1004);
        for (rows_of_parts, k) in [(&[256][..], 1088), (&[256, 128, 128][..], 512)] {
            let (parts, dense) = nvfp4_parts(&mut rng, rows_of_parts, k);
            let n: usize = rows_of_parts.iter().sum();
            let bias_host = rounded(&rng.vec(n, -0.5, 0.5), st);
            let one_chunk = (128 * (k / 2 + k / 16 + 4) + 512).div_ceil(2);
            // The one-chunk workspace only where the route chunks (the dequantize route needs N x K).
            let workspaces: &[(bool, usize)] = if fp4 { &[(false, n * k), (true, n * k), (true, one_chunk)] } else { &[(false, n * k), (true, n * k)] };
            for &(with_bias, ws) in workspaces {
                let lin = stacked_linear(&dev, &parts, with_bias.then(|| upload(&dev, &bias_host)), ws);
                let route = lin.quant.as_ref().unwrap().prefill;
                assert_eq!(route, if fp4 { QuantPrefill::Nvfp4Gemm } else { QuantPrefill::Dequantize }, "{rows_of_parts:?} x {k} on {st:?}");
                for rows in [17, 128, 300] {
                    let x = rounded(&nvfp4_activations(&mut rng, rows, k), st);
                    let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(rows * n).unwrap();
                    let got = forward_guarded(&dev, &lin, &upload(&dev, &x), &mut lin32, rows, 0);
                    let b = with_bias.then_some(&bias_host[..]);
                    let shape = format!("rows{rows} parts{rows_of_parts:?} k{k} bias={with_bias} workspace={ws}");
                    if fp4 {
                        let xq = quantized_activations(&x, rows, k);
                        let want = matmul_bias(&xq, &dense, b, rows, n, k);
                        check_fp4_error(&format!("nvfp4_linear {shape}"), &got, &want, &xq, &dense, b, rows, n, k);
                    } else {
                        let want = matmul_bias(&x, &rounded(&dense, st), b, rows, n, k);
                        check("nvfp4 weight, dequantize route", st, &shape, &got, &rounded(&want, st), tol16(st));
                    }
                }
            }
        }
    }
}

/// The FP4 route against the dequantize route on a Qwen3.5-27B layer's gate_up ([2 x 17408,
/// 5120], two parts) and down ([5120, 17408]) at 8192 rows: time per call and the TFLOP/s each
/// reaches. Prints `TIMING nvfp4_prefill ...` lines (sm_100 and newer).
#[test]
fn nvfp4_prefill_timing() {
    let Some(dev) = gpu("nvfp4_prefill_timing", StorageDType::Bf16) else { return };
    if !fp4_device(&dev) {
        eprintln!("SKIP nvfp4_prefill_timing: no FP4 tensor-core route on this device");
        return;
    }
    let mut rng = Rng::new(27);
    for (what, rows, k) in [("gate_up", &[17408, 17408][..], 5120), ("down", &[5120][..], 17408)] {
        let (parts, _) = nvfp4_parts(&mut rng, rows, k);
        let n: usize = rows.iter().sum();
        let lin = stacked_linear(&dev, &parts, None, n * k);
        assert_eq!(lin.quant.as_ref().unwrap().prefill, QuantPrefill::Nvfp4Gemm);
        time_against_dequantize(&dev, &lin, &mut rng, "nvfp4_prefill", "nvfp4_gemm", what, 8192);
    }
}
