//! Quantized weights (cuda/quant*.cu, ops/quant.rs) against the CPU reference of
//! rust_core/src/quant, for every format: the dequantize kernel gives the CPU decoder's f32
//! values bit for bit (and their storage-type rounding bit for bit), the fused-dequantization
//! GEMV at M = 1, 2, 7, 16 is within f32-accumulation tolerance of `QuantLinear`, and the
//! prefill route (dequantize into the workspace, then cuBLAS) at M = 64 and 300 is within the
//! dense GEMM's tolerance of the matmul over the workspace's values. NInfer formats are made by
//! quant's encoders from random values; GGUF blocks are random bytes with finite scales; HF
//! tensors random words with the checkpoint's companion shapes and dtypes.

use super::harness::{check, gpu, rounded, tol16, upload, Out16, Out32, Rng, STORAGES};
use cudarc::driver::CudaSlice;
use ninfer_core::quant::{dequantize, quantize, OwnedRaw, QuantFormat, QuantLinear, QuantWeight, RawDtype};

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn raw(name: &str, dtype: RawDtype, shape: Vec<usize>, bytes: Vec<u8>) -> OwnedRaw {
    OwnedRaw { name: name.to_string(), dtype, shape, bytes }
}

/// `count` random 32-bit words as little-endian bytes.
fn words(rng: &mut Rng, count: usize) -> Vec<u8> {
    (0..count).flat_map(|_| ((rng.below(1 << 16) as u32) | ((rng.below(1 << 16) as u32) << 16)).to_le_bytes()).collect()
}

/// Scales as `dtype` (F32, F16 or BF16) bytes, `count` of them, positive and small.
fn scales(rng: &mut Rng, dtype: RawDtype, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|_| {
            let v = rng.range(0.001, 0.05);
            match dtype {
                RawDtype::F32 => v.to_le_bytes().to_vec(),
                RawDtype::F16 => f16_bytes(v).to_vec(),
                _ => half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            }
        })
        .collect()
}

/// One weight of every format the GPU runs, named after its case.
fn cases(rng: &mut Rng) -> Vec<QuantWeight> {
    let mut out = Vec::new();
    // NInfer formats from the --quantize encoders: K = 200 pads the row to 256 (a wholly
    // padded group), N = 37 leaves a ragged last block of warps; NVFP4 needs [128x, 64x].
    for (f, [n, k]) in [
        (QuantFormat::W8G32F16S, [37, 200]),
        (QuantFormat::Q4G64F16S, [37, 200]),
        (QuantFormat::Q5G64F16S, [37, 200]),
        (QuantFormat::Q6G64F16S, [37, 200]),
        (QuantFormat::Fp8E4m3fnRowBf16s, [37, 200]),
        (QuantFormat::Nvfp4, [256, 192]),
    ] {
        let mut v = rng.vec(n * k, -1.0, 1.0);
        // Edge values: an all-zero row (scale +0) and one row of tiny values (subnormal scales).
        v[..k].iter_mut().for_each(|x| *x = 0.0);
        v[k..2 * k].iter_mut().for_each(|x| *x *= 1e-6);
        let data = quantize(f, f.name(), &v, [n, k]).expect("quantize");
        out.push(QuantWeight::packed(f.name(), f, [n, k], data));
    }
    // GGUF: random block bytes, each block's f16 scale fields set to finite values.
    for (f, bb, d_offsets) in [
        (QuantFormat::GgufQ8_0, 34usize, &[0usize][..]),
        (QuantFormat::GgufQ4K, 144, &[0, 2][..]),
        (QuantFormat::GgufQ5K, 176, &[0, 2][..]),
        (QuantFormat::GgufQ6K, 210, &[208][..]),
        (QuantFormat::GgufIq4Xs, 136, &[0][..]),
        (QuantFormat::GgufIq3S, 110, &[0][..]),
    ] {
        let (n, k) = (37, 512);
        let qk = if f == QuantFormat::GgufQ8_0 { 32 } else { 256 };
        let blocks = n * k / qk;
        let mut data: Vec<u8> = (0..blocks * bb).map(|_| rng.below(256) as u8).collect();
        for b in 0..blocks {
            for &o in d_offsets {
                data[b * bb + o..b * bb + o + 2].copy_from_slice(&f16_bytes(rng.range(-0.02, 0.02)));
            }
        }
        out.push(QuantWeight::packed(f.name(), f, [n, k], data));
    }
    // HF block FP8, ragged blocks, F32 and BF16 scales; codes avoid the NaN words.
    for dtype in [RawDtype::F32, RawDtype::BF16] {
        let (n, k, bn, bk) = (300, 200, 128, 128);
        let data: Vec<u8> = (0..n * k).map(|_| rng.below(256) as u8).map(|c| if c & 0x7f == 0x7f { c - 1 } else { c }).collect();
        let sh = vec![n.div_ceil(bn), k.div_ceil(bk)];
        let sc = scales(rng, dtype, sh[0] * sh[1]);
        let mut w = QuantWeight::packed(format!("fp8_block_{dtype:?}"), QuantFormat::HfFp8Block { block_n: bn, block_k: bk }, [n, k], data);
        w.scale = Some(raw("weight_scale_inv", dtype, sh, sc));
        out.push(w);
    }
    // AWQ and GPTQ (with and without g_idx), group 64.
    let (n, k, g) = (64, 256, 64);
    let groups = k / g;
    let mut awq = QuantWeight::packed("awq", QuantFormat::Awq4 { group: g }, [n, k], words(rng, k * n / 8));
    awq.scale = Some(raw("scales", RawDtype::F16, vec![groups, n], scales(rng, RawDtype::F16, groups * n)));
    awq.zero = Some(raw("qzeros", RawDtype::I32, vec![groups, n / 8], words(rng, groups * n / 8)));
    out.push(awq);
    for (zero_plus_one, with_g_idx) in [(true, false), (false, true)] {
        let mut w = QuantWeight::packed(format!("gptq_{with_g_idx}"), QuantFormat::Gptq4 { group: g, zero_plus_one }, [n, k], words(rng, k / 8 * n));
        w.scale = Some(raw("scales", RawDtype::F16, vec![groups, n], scales(rng, RawDtype::F16, groups * n)));
        w.zero = Some(raw("qzeros", RawDtype::I32, vec![groups, n / 8], words(rng, groups * n / 8)));
        if with_g_idx {
            let gi: Vec<u8> = (0..k).flat_map(|_| (rng.below(groups) as i32).to_le_bytes()).collect();
            w.g_idx = Some(raw("g_idx", RawDtype::I32, vec![k], gi));
        }
        out.push(w);
    }
    // compressed-tensors pack-quantized: asymmetric with BF16 scales, symmetric with F32 ones.
    for (symmetric, dtype) in [(false, RawDtype::BF16), (true, RawDtype::F32)] {
        let mut w = QuantWeight::packed(format!("pack4_{symmetric}"), QuantFormat::PackQuantized4 { group: g, symmetric }, [n, k], words(rng, n * k / 8));
        w.scale = Some(raw("weight_scale", dtype, vec![n, groups], scales(rng, dtype, n * groups)));
        if !symmetric {
            w.zero = Some(raw("weight_zero_point", RawDtype::I32, vec![n.div_ceil(8), groups], words(rng, n.div_ceil(8) * groups)));
        }
        out.push(w);
    }
    out
}

/// y = x W^T over f32 values, sequential sums.
fn matmul(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = x[i * k..(i + 1) * k].iter().zip(&w[j * k..(j + 1) * k]).fold(0.0f32, |s, (a, b)| s + a * b);
        }
    }
    y
}

#[test]
fn quant_dequantize_kernels_equal_the_cpu_decoders_bit_for_bit() {
    for st in STORAGES {
        let Some(dev) = gpu("quant_dequantize", st) else { return };
        let mut rng = Rng::new(48);
        for w in cases(&mut rng) {
            let [n, k] = w.shape;
            let want = dequantize(&w.view()).expect("valid case");
            let dw = dev.upload_quant(&w).unwrap_or_else(|e| panic!("{}: {e}", w.name));
            let mut got = Out32::new(&dev, n * k);
            dev.quant_dequantize_f32(&dw, &mut got.view()).unwrap();
            let got = got.read(&dev, &w.name);
            for (i, (g, c)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), c.to_bits(), "{} element [{}, {}]: GPU {g:e}, CPU {c:e}", w.name, i / k, i % k);
            }
            // The workspace: each value rounded once to the storage type.
            let mut ws = Out16::new(&dev, n * k);
            dev.quant_dequantize(&dw, &mut ws.view()).unwrap();
            let ws = ws.read(&dev, &w.name);
            for (i, (g, c)) in ws.iter().zip(rounded(&want, st)).enumerate() {
                assert_eq!(g.to_bits(), c.to_bits(), "{} {st:?} workspace element {i}: {g:e}, want {c:e}", w.name);
            }
        }
    }
}

#[test]
fn quant_gemv_and_prefill_route_match_quant_linear() {
    for st in STORAGES {
        let Some(dev) = gpu("quant_gemv", st) else { return };
        let mut rng = Rng::new(4848);
        for w in cases(&mut rng) {
            let [n, k] = w.shape;
            let dw = dev.upload_quant(&w).unwrap();
            let lin = QuantLinear::new(w.clone()).unwrap();
            let dense = dequantize(&w.view()).unwrap();
            let bias_host = rounded(&rng.vec(n, -0.5, 0.5), st);
            let bias = upload(&dev, &bias_host);
            let mut workspace: CudaSlice<u16> = dev.stream().alloc_zeros(n * k).unwrap();
            for m in [1, 2, 7, 16, 64, 300] {
                let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
                let xd = upload(&dev, &x);
                for with_bias in [false, true] {
                    let b = with_bias.then_some(&bias);
                    // GEMV rows: QuantLinear's sums (plus the bias); the prefill route: the matmul
                    // over the workspace's storage-type values (what cuBLAS multiplies).
                    let sums = if m <= 16 { lin.forward(&x, m).unwrap() } else { matmul(&x, &rounded(&dense, st), m, n, k) };
                    let want: Vec<f32> = sums.iter().enumerate().map(|(i, s)| if with_bias { s + bias_host[i % n] } else { *s }).collect();
                    let mut y = Out16::new(&dev, m * n);
                    let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(m * n).unwrap();
                    dev.quant_linear(&xd, &dw, b, &mut workspace, &mut lin32, &mut y.view(), m).unwrap();
                    let got = y.read(&dev, &w.name);
                    check(&format!("quant_linear {} bias={with_bias}", w.name), st, &format!("m{m} n{n} k{k}"), &got, &rounded(&want, st), tol16(st));
                }
            }
        }
    }
}

#[test]
fn quant_weights_the_gpu_cannot_run_are_refused_naming_tensor_format_and_device() {
    for st in STORAGES {
        let Some(dev) = gpu("quant_refusal", st) else { return };
        // K = 100 fits W8G32's layout (padded to 128) but not the kernels' 8-value slices.
        let (n, k) = (4, 100);
        let v = vec![0.5f32; n * k];
        let w = QuantWeight::packed("model.layers.0.mlp.down_proj.weight", QuantFormat::W8G32F16S, [n, k], quantize(QuantFormat::W8G32F16S, "x", &v, [n, k]).unwrap());
        let e = dev.upload_quant(&w).err().expect("K = 100 is refused").to_string();
        assert!(e.contains("model.layers.0.mlp.down_proj.weight") && e.contains("W8G32_F16S") && e.contains(dev.name()) && e.contains("cuda:0"), "{e}");
        // On f16 storage, an FP8 row whose scale lets values pass 65504 is refused too.
        let big: Vec<f32> = (0..8 * 64).map(|i| if i % 64 == 0 { 1e6 } else { 1.0 }).collect();
        let w = QuantWeight::packed("lm.fp8", QuantFormat::Fp8E4m3fnRowBf16s, [8, 64], quantize(QuantFormat::Fp8E4m3fnRowBf16s, "x", &big, [8, 64]).unwrap());
        let r = dev.upload_quant(&w);
        if st == ninfer_core::backend::cuda::StorageDType::F16 {
            let e = r.err().expect("refused on f16 storage").to_string();
            assert!(e.contains("lm.fp8") && e.contains("FP8_E4M3FN_ROW_BF16S") && e.contains("65504"), "{e}");
        } else {
            assert!(r.is_ok(), "bf16 storage holds the values: {:?}", r.err());
        }
    }
}
