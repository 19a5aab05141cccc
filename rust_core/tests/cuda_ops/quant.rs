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

/// A random `[n, k]` weight of `format` named `name`: NInfer formats by quant's encoders from
/// `values` (uniform in [-1, 1) when None), GGUF blocks as random bytes with finite f16 scale
/// fields, HF tensors as random words with the checkpoint's companion shapes and dtypes
/// (`scale_dtype` for the forms that allow several; `g_idx` random groups where asked).
fn make(rng: &mut Rng, name: &str, format: QuantFormat, [n, k]: [usize; 2], values: Option<Vec<f32>>, scale_dtype: RawDtype, g_idx: bool) -> QuantWeight {
    let mut w = QuantWeight::packed(name, format, [n, k], Vec::new());
    let gguf_d: Option<(usize, usize, &[usize])> = match format {
        QuantFormat::GgufQ8_0 => Some((32, 34, &[0])),
        QuantFormat::GgufQ4K => Some((256, 144, &[0, 2])),
        QuantFormat::GgufQ5K => Some((256, 176, &[0, 2])),
        QuantFormat::GgufQ6K => Some((256, 210, &[208])),
        QuantFormat::GgufIq4Xs => Some((256, 136, &[0])),
        QuantFormat::GgufIq3S => Some((256, 110, &[0])),
        _ => None,
    };
    if let Some((qk, bb, d_offsets)) = gguf_d {
        let blocks = n * k / qk;
        let mut data: Vec<u8> = (0..blocks * bb).map(|_| rng.below(256) as u8).collect();
        for b in 0..blocks {
            for &o in d_offsets {
                data[b * bb + o..b * bb + o + 2].copy_from_slice(&f16_bytes(rng.range(-0.02, 0.02)));
            }
        }
        w.data = data;
        return w;
    }
    let group = |g: usize| if g == 0 { 1 } else { k.div_ceil(g) };
    match format {
        QuantFormat::HfFp8Block { block_n, block_k } => {
            // Codes avoid the NaN words.
            w.data = (0..n * k).map(|_| rng.below(256) as u8).map(|c| if c & 0x7f == 0x7f { c - 1 } else { c }).collect();
            let sh = vec![n.div_ceil(block_n), k.div_ceil(block_k)];
            w.scale = Some(raw("weight_scale_inv", scale_dtype, sh.clone(), scales(rng, scale_dtype, sh[0] * sh[1])));
        }
        QuantFormat::Awq4 { group: g } => {
            let gs = group(g);
            w.data = words(rng, k * n / 8);
            w.scale = Some(raw("scales", RawDtype::F16, vec![gs, n], scales(rng, RawDtype::F16, gs * n)));
            w.zero = Some(raw("qzeros", RawDtype::I32, vec![gs, n / 8], words(rng, gs * n / 8)));
        }
        QuantFormat::Gptq4 { group: g, .. } => {
            let gs = group(g);
            w.data = words(rng, k / 8 * n);
            w.scale = Some(raw("scales", RawDtype::F16, vec![gs, n], scales(rng, RawDtype::F16, gs * n)));
            w.zero = Some(raw("qzeros", RawDtype::I32, vec![gs, n / 8], words(rng, gs * n / 8)));
        }
        QuantFormat::PackQuantized4 { group: g, symmetric } => {
            let gs = group(g);
            w.data = words(rng, n * k / 8);
            w.scale = Some(raw("weight_scale", scale_dtype, vec![n, gs], scales(rng, scale_dtype, n * gs)));
            if !symmetric {
                w.zero = Some(raw("weight_zero_point", RawDtype::I32, vec![n.div_ceil(8), gs], words(rng, n.div_ceil(8) * gs)));
            }
        }
        f => {
            let v = values.unwrap_or_else(|| rng.vec(n * k, -1.0, 1.0));
            w.data = quantize(f, name, &v, [n, k]).expect("quantize");
        }
    }
    if g_idx {
        let gs = match format {
            QuantFormat::Gptq4 { group: g, .. } | QuantFormat::PackQuantized4 { group: g, .. } => group(g),
            _ => unreachable!("g_idx only for GPTQ and pack-quantized"),
        };
        let gi: Vec<u8> = (0..k).flat_map(|_| (rng.below(gs) as i32).to_le_bytes()).collect();
        w.g_idx = Some(raw("g_idx", RawDtype::I32, vec![k], gi));
    }
    w
}

/// One weight of every format the GPU runs, named after its case.
fn cases(rng: &mut Rng) -> Vec<QuantWeight> {
    let mut out = Vec::new();
    // NInfer formats from the --quantize encoders: K = 200 pads the row to 256 (a wholly
    // padded group), N = 37 leaves a ragged last block of warps; NVFP4 needs [128x, 64x].
    for (f, shape) in [
        (QuantFormat::W8G32F16S, [37, 200]),
        (QuantFormat::Q4G64F16S, [37, 200]),
        (QuantFormat::Q5G64F16S, [37, 200]),
        (QuantFormat::Q6G64F16S, [37, 200]),
        (QuantFormat::Fp8E4m3fnRowBf16s, [37, 200]),
        (QuantFormat::Nvfp4, [256, 192]),
    ] {
        let [n, k] = shape;
        let mut v = rng.vec(n * k, -1.0, 1.0);
        // Edge values: an all-zero row (scale +0) and one row of tiny values (subnormal scales).
        v[..k].iter_mut().for_each(|x| *x = 0.0);
        v[k..2 * k].iter_mut().for_each(|x| *x *= 1e-6);
        out.push(make(rng, f.name(), f, shape, Some(v), RawDtype::F16, false));
    }
    for f in [QuantFormat::GgufQ8_0, QuantFormat::GgufQ4K, QuantFormat::GgufQ5K, QuantFormat::GgufQ6K, QuantFormat::GgufIq4Xs, QuantFormat::GgufIq3S] {
        out.push(make(rng, f.name(), f, [37, 512], None, RawDtype::F16, false));
    }
    // HF block FP8 with ragged blocks and F32 / BF16 scales; AWQ; GPTQ with and without g_idx;
    // pack-quantized asymmetric with BF16 scales and symmetric with F32 ones. The 4-bit forms
    // with groups of 64-value runs upload in the tiled layout (ops/quant_tiles.rs: AWQ, GPTQ
    // without g_idx, pack4_asym, awq_g128 over a K padded past its last block); random act-order
    // g_idx and random F32 scales keep the stored layout and its decoders.
    let fp8 = QuantFormat::HfFp8Block { block_n: 128, block_k: 128 };
    out.push(make(rng, "fp8_block_f32", fp8, [300, 200], None, RawDtype::F32, false));
    out.push(make(rng, "fp8_block_bf16", fp8, [300, 200], None, RawDtype::BF16, false));
    let g = 64;
    out.push(make(rng, "awq", QuantFormat::Awq4 { group: g }, [64, 256], None, RawDtype::F16, false));
    out.push(make(rng, "gptq", QuantFormat::Gptq4 { group: g, zero_plus_one: true }, [64, 256], None, RawDtype::F16, false));
    out.push(make(rng, "gptq_v2_g_idx", QuantFormat::Gptq4 { group: g, zero_plus_one: false }, [64, 256], None, RawDtype::F16, true));
    out.push(make(rng, "pack4_asym", QuantFormat::PackQuantized4 { group: g, symmetric: false }, [64, 256], None, RawDtype::BF16, false));
    out.push(make(rng, "pack4_sym_g_idx", QuantFormat::PackQuantized4 { group: g, symmetric: true }, [64, 256], None, RawDtype::F32, true));
    out.push(make(rng, "awq_g128", QuantFormat::Awq4 { group: 128 }, [40, 384], None, RawDtype::F16, false));
    out.push(make(rng, "gptq_g64_k320", QuantFormat::Gptq4 { group: 64, zero_plus_one: false }, [24, 320], None, RawDtype::F16, false));
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
            for m in [1, 2, 5, 7, 16, 64, 300] {
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

/// NVFP4 row-stacked parts (a fused projection whose parts keep their own tensor divisors, as
/// `--quantize nvfp4` and handed-in NVFP4 tensors load on CUDA) with a dense tail: the
/// dequantize kernel gives each part's CPU values bit for bit, then the tail's; the GEMV and the
/// prefill route multiply by those values.
#[test]
fn nvfp4_stacked_parts_keep_each_parts_divisor() {
    for st in STORAGES {
        let Some(dev) = gpu("nvfp4_stacked_parts", st) else { return };
        let mut rng = Rng::new(4804);
        let k = 192;
        let f = QuantFormat::Nvfp4;
        // Three parts of different magnitudes (so different divisors), then 3 dense rows.
        let parts: Vec<QuantWeight> = [(128, 1.0f32), (256, 0.01), (128, 30.0)]
            .iter()
            .enumerate()
            .map(|(i, &(n, amp))| {
                let v = rng.vec(n * k, -amp, amp);
                make(&mut rng, &format!("part{i}"), f, [n, k], Some(v), RawDtype::F16, false)
            })
            .collect();
        let tail = rounded(&rng.vec(3 * k, -0.5, 0.5), st);
        let dw = dev.upload_quant_parts(&parts, &super::harness::to_bits(&tail, st)).unwrap();
        let n = 128 + 256 + 128 + 3;
        assert_eq!((dw.n, dw.k), (n, k));
        let mut want: Vec<f32> = parts.iter().flat_map(|w| dequantize(&w.view()).unwrap()).collect();
        want.extend(&tail);
        let mut got = Out32::new(&dev, n * k);
        dev.quant_dequantize_f32(&dw, &mut got.view()).unwrap();
        let got = got.read(&dev, "nvfp4 parts");
        for (i, (g, c)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), c.to_bits(), "{st:?} element [{}, {}]: GPU {g:e}, CPU {c:e}", i / k, i % k);
        }
        let mut workspace: CudaSlice<u16> = dev.stream().alloc_zeros(n * k).unwrap();
        for m in [1, 5, 16, 40] {
            let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
            let xd = upload(&dev, &x);
            let w = if m <= 16 { want.clone() } else { rounded(&want, st) };
            let sums = matmul(&x, &w, m, n, k);
            let mut y = Out16::new(&dev, m * n);
            let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(m * n).unwrap();
            dev.quant_linear(&xd, &dw, None, &mut workspace, &mut lin32, &mut y.view(), m).unwrap();
            check("quant_linear nvfp4 parts", st, &format!("m{m} n{n} k{k}"), &y.read(&dev, "nvfp4 parts y"), &rounded(&sums, st), tol16(st));
        }
        // Parts of another format are one payload each: refused.
        let q4 = make(&mut rng, "q4", QuantFormat::Q4G64F16S, [128, k], None, RawDtype::F16, false);
        let e = dev.upload_quant_parts(&[q4.clone(), q4], &[]).err().expect("Q4 parts").to_string();
        assert!(e.contains("NVFP4 parts"), "{e}");
    }
}

/// The f32-output routes a quantized LM head runs, for every format: the f32 GEMV (decode, up
/// to 16 rows) within f32-accumulation tolerance of `QuantLinear`, and above it the chunked
/// route (a few rows dequantized into a workspace too small for the whole weight, cuBLAS into
/// those columns of y, a ragged last chunk) within the dense GEMM's tolerance of the matmul
/// over the workspace's values; with `round`, every output a storage-type value.
#[test]
fn quant_f32_out_routes_match_quant_linear() {
    for st in STORAGES {
        let Some(dev) = gpu("quant_f32_out", st) else { return };
        let mut rng = Rng::new(4849);
        for w in cases(&mut rng) {
            let [n, k] = w.shape;
            let dw = dev.upload_quant(&w).unwrap();
            let lin = QuantLinear::new(w.clone()).unwrap();
            let dense = rounded(&dequantize(&w.view()).unwrap(), st);
            // Three full chunks of n / 3 rows and a ragged one.
            let chunk = (n / 3).max(1);
            let mut workspace: CudaSlice<u16> = dev.stream().alloc_zeros(chunk * k + k / 2).unwrap();
            for m in [1, 7, 16, 40] {
                let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
                let xd = upload(&dev, &x);
                let sums = if m <= 16 { lin.forward(&x, m).unwrap() } else { matmul(&x, &dense, m, n, k) };
                for round in [false, true] {
                    let mut y = Out32::new(&dev, m * n);
                    dev.quant_linear_f32_out(&xd, &dw, &mut workspace, &mut y.view(), m, round).unwrap();
                    let got = y.read(&dev, &w.name);
                    let want = if round { rounded(&sums, st) } else { sums.clone() };
                    check(&format!("quant_linear_f32_out {} round={round}", w.name), st, &format!("m{m} n{n} k{k}"), &got, &want, tol16(st));
                    if round {
                        assert_eq!(rounded(&got, st), got, "{} m{m}: rounded logits are storage-type values", w.name);
                    }
                }
            }
        }
        // A workspace that holds no row is an error, not a silent skip.
        let w = make(&mut rng, "tiny", QuantFormat::Q4G64F16S, [16, 256], None, RawDtype::F16, false);
        let dw = dev.upload_quant(&w).unwrap();
        let mut small: CudaSlice<u16> = dev.stream().alloc_zeros(100).unwrap();
        let xd = upload(&dev, &vec![0.0; 20 * 256]);
        let mut y = Out32::new(&dev, 20 * 16);
        let e = dev.quant_linear_f32_out(&xd, &dw, &mut small, &mut y.view(), 20, false).err().expect("no row fits").to_string();
        assert!(e.contains("holds no row"), "{e}");
    }
}

/// `quant_gemv` (with a bias) and `quant_gemv_f32_out` of `dw` (`w`'s rows, then the dense
/// rows `tail`) at every kernel size of M and rows past it, against `QuantLinear` over `w` and
/// the f32 matmul over the tail: within f32-accumulation tolerance. (The chunk GEMV's bits
/// depend on m: one row of x takes Q4_K's minimum through x's chunk sums, several rows one fma
/// a value; cuda/quant_chunk.cuh.)
fn check_gemv_with_tail(dev: &ninfer_core::backend::cuda::CudaDevice, rng: &mut Rng, what: &str, w: &QuantWeight, dw: &ninfer_core::backend::cuda::ops::DeviceQuantWeight, tail: &[f32]) {
    check_gemv_forms(dev, rng, what, w, dw, tail, &[dev.q4_ring()], false);
}

/// `check_gemv_with_tail` with the tiled 4-bit GEMVs in each form of `ring_forms` in turn
/// (`CudaDevice::set_q4_ring`), every form's outputs equal to the first's bit for bit and, with
/// `m_invariant`, the rows of an m-row step equal to the same rows run one at a time (the bits
/// never depend on m); the device is left in the form it had.
#[allow(clippy::too_many_arguments)]
fn check_gemv_forms(dev: &ninfer_core::backend::cuda::CudaDevice, rng: &mut Rng, what: &str, w: &QuantWeight, dw: &ninfer_core::backend::cuda::ops::DeviceQuantWeight, tail: &[f32], ring_forms: &[bool], m_invariant: bool) {
    let (st, [n, k]) = (dev.storage(), w.shape);
    let tail_rows = tail.len() / k;
    let n_all = n + tail_rows;
    let lin = QuantLinear::new(w.clone()).unwrap();
    let bias_host = rounded(&rng.vec(n_all, -0.5, 0.5), st);
    let bias = upload(dev, &bias_host);
    let before = dev.q4_ring();
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for m in [1, 2, 3, 4, 5, 8, 9, 16] {
        let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
        let xd = upload(dev, &x);
        let q = lin.forward(&x, m).unwrap();
        let t = matmul(&x, tail, m, tail_rows, k);
        let sums: Vec<f32> = (0..m * n_all).map(|i| if i % n_all < n { q[i / n_all * n + i % n_all] } else { t[i / n_all * tail_rows + i % n_all - n] }).collect();
        let shape = format!("m{m} n{n}+{tail_rows} k{k}");
        let want: Vec<f32> = sums.iter().enumerate().map(|(i, s)| s + bias_host[i % n_all]).collect();
        let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
        for &ring in ring_forms {
            dev.set_q4_ring(ring);
            let form = if ring_forms.len() > 1 { if ring { " (ring form)" } else { " (pass form)" } } else { "" };
            let mut y = Out16::new(dev, m * n_all);
            dev.quant_gemv(&xd, dw, Some(&bias), &mut y.view(), m).unwrap();
            let y = y.read(dev, "y");
            check(&format!("{what} quant_gemv{form}"), st, &shape, &y, &rounded(&want, st), tol16(st));
            let mut y32 = Out32::new(dev, m * n_all);
            dev.quant_gemv_f32_out(&xd, dw, &mut y32.view(), m, false).unwrap();
            let y32 = y32.read(dev, "y32");
            check(&format!("{what} quant_gemv_f32_out{form}"), st, &shape, &y32, &sums, super::harness::TOL32);
            if m_invariant && m > 1 {
                for r in 0..m {
                    let xr = upload(dev, &x[r * k..(r + 1) * k]);
                    let mut y1 = Out16::new(dev, n_all);
                    dev.quant_gemv(&xr, dw, Some(&bias), &mut y1.view(), 1).unwrap();
                    let mut y1_32 = Out32::new(dev, n_all);
                    dev.quant_gemv_f32_out(&xr, dw, &mut y1_32.view(), 1, false).unwrap();
                    let rows = r * n_all..(r + 1) * n_all;
                    assert!(
                        same(&y[rows.clone()], &y1.read(dev, "y1")) && same(&y32[rows], &y1_32.read(dev, "y1_32")),
                        "{what}{form} {shape}: row {r} of the step differs in its bits from the row alone"
                    );
                }
            }
            match &first {
                None => first = Some((y, y32)),
                Some((y0, y32_0)) => assert!(same(y0, &y) && same(y32_0, &y32), "{what} {shape}: the tiled GEMV's forms differ in their bits"),
            }
        }
    }
    dev.set_q4_ring(before);
}

/// Q4G64_F16S in the tiled device layout (ops/quant_tiles.rs; the mma.sync GEMV on sm_80+, in
/// its pass form and its ring form, `CudaDevice::set_q4_ring`): shapes with a ragged last tile,
/// K below one 128-value block (warps with no K block), K padded past a group, more K blocks
/// than the block has warps (a warp takes several), one pass of the block's warps (K = 4096)
/// and more (the ring refilled: K 4224 with one block past the ring's stages, 9216 and 16512),
/// more tiles than blocks fit the multiprocessors of an H100 (9000 and 4300 rows: a second wave
/// of blocks) and a dense tail after the quantized rows; every M up to
/// 16 that changes the kernel's B fragments (x staged in
/// shared memory up to 4 rows, with rows past M; one or two column blocks of 8 from global,
/// columns past M); storage-type and f32 outputs, with bias: within f32-accumulation tolerance
/// of `QuantLinear` (the tail: the f32 matmul over its rows), the two forms equal bit for bit,
/// their bits independent of m, and the dequantize kernel the CPU decoder's values bit for bit.
#[test]
fn q4_tiled_gemv_covers_tiles_k_blocks_and_a_dense_tail() {
    for st in STORAGES {
        let Some(dev) = gpu("q4_tiled_gemv", st) else { return };
        let mut rng = Rng::new(4864);
        let f = QuantFormat::Q4G64F16S;
        for (n, k, tail_rows) in [(1, 8, 0), (37, 200, 0), (300, 1152, 5), (16, 2176, 3), (64, 4096, 0), (16, 4224, 2), (20, 9216, 0), (24, 16512, 0), (9000, 256, 3), (4300, 4224, 0)] {
            let w = make(&mut rng, "q4_tiled", f, [n, k], None, RawDtype::F16, false);
            let tail = rounded(&rng.vec(tail_rows * k, -0.5, 0.5), st);
            let dw = dev.upload_quant_with_tail(&w, &super::harness::to_bits(&tail, st)).unwrap();
            let n_all = n + tail_rows;
            let mut values = dequantize(&w.view()).unwrap();
            values.extend(&tail);
            let mut got = Out32::new(&dev, n_all * k);
            dev.quant_dequantize_f32(&dw, &mut got.view()).unwrap();
            for (i, (g, c)) in got.read(&dev, "q4 tiles").iter().zip(&values).enumerate() {
                assert_eq!(g.to_bits(), c.to_bits(), "[{n}, {k}] element [{}, {}]: GPU {g:e}, CPU {c:e}", i / k, i % k);
            }
            check_gemv_forms(&dev, &mut rng, "q4 tiled", &w, &dw, &tail, &[false, true], true);
        }
    }
}

/// The chunk GEMV (cuda/quant_chunk.cuh: GGUF Q4_K and IQ4_XS, NVFP4; two rows a warp, K in
/// chunks of 32 values, lane l taking chunks l, l + 32, ..., two or one of them in flight a
/// row): K of one GGUF super-block (8 chunks: most lanes idle) or one NVFP4 scale tile (2),
/// K whose chunks end inside a lane's unrolled step (96, 160 and 34 chunks), K past 32 chunks a
/// lane; an odd N (its last row through the row-per-warp body) and a dense tail after the
/// quantized rows (pairs reaching into it take that body too); every kernel size of M, storage
/// and f32 outputs with bias: within f32-accumulation tolerance of `QuantLinear` (the tail:
/// the f32 matmul over its rows).
#[test]
fn chunk_gemv_covers_k_tails_odd_rows_and_a_dense_tail() {
    for st in STORAGES {
        let Some(dev) = gpu("chunk_gemv", st) else { return };
        let mut rng = Rng::new(4865);
        let shapes: [(QuantFormat, usize, usize, usize); 11] = [
            (QuantFormat::GgufQ4K, 2, 256, 0),
            (QuantFormat::GgufQ4K, 37, 3072, 0),
            (QuantFormat::GgufQ4K, 16, 5120, 3),
            (QuantFormat::GgufQ4K, 6, 8192, 1),
            (QuantFormat::GgufIq4Xs, 2, 256, 0),
            (QuantFormat::GgufIq4Xs, 37, 3072, 0),
            (QuantFormat::GgufIq4Xs, 16, 5120, 3),
            (QuantFormat::GgufIq4Xs, 5, 2560, 0),
            (QuantFormat::Nvfp4, 128, 64, 0),
            (QuantFormat::Nvfp4, 256, 1088, 5),
            (QuantFormat::Nvfp4, 128, 4096, 0),
        ];
        for (f, n, k, tail_rows) in shapes {
            let w = make(&mut rng, f.name(), f, [n, k], None, RawDtype::F16, false);
            let tail = rounded(&rng.vec(tail_rows * k, -0.5, 0.5), st);
            let dw = dev.upload_quant_with_tail(&w, &super::harness::to_bits(&tail, st)).unwrap();
            check_gemv_with_tail(&dev, &mut rng, &format!("chunk {}", f.name()), &w, &dw, &tail);
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

/// The decode timing tests' layers: (model, [n, k] of qkv, o, gate_up, down).
const LAYER_SHAPES: [(&str, [[usize; 2]; 4]); 2] = [
    ("llama3-8b", [[6144, 4096], [4096, 4096], [28672, 4096], [4096, 14336]]),
    ("qwen3.5-27b", [[14336, 5120], [5120, 6144], [34816, 5120], [5120, 17408]]),
];

/// Sets the tiled 4-bit GEMVs' form the model load picks for a layer of `shapes` (from its
/// smallest K).
fn set_layer_form(dev: &ninfer_core::backend::cuda::CudaDevice, shapes: &[[usize; 2]; 4]) {
    dev.set_q4_ring(ninfer_core::backend::cuda::ops::quant_tiles::q4t_ring(shapes.iter().map(|s| s[1]).min().unwrap()));
}

/// Batch-1 decode GEMV per format at the Llama-3-8B and Qwen3.5-27B projection shapes: per-call
/// time and the bytes it reads (packed weight with its companions, x, y) against a
/// device-to-device copy of 1 GiB on the same GPU, as the fraction of the copy rate (read plus
/// written bytes a second) the GEMV's read bytes reach. A layer's four projections run in turn
/// (at 4 bits 110 MB and more: beyond the L2 of an H100 / H200), so the weights stream from
/// memory. Prints one
/// `TIMING quant_gemv weights=<format> ...` line per (format, model, m) for m = 1, 2, 4, 8, 16
/// (x and y counted m times); benches/gpu_quant.py records them. The target: >= 0.80
/// for the 4-bit formats at m = 1.
#[test]
fn quant_gemv_decode_timing() {
    let Some(dev) = gpu("quant_gemv_timing", ninfer_core::backend::cuda::StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    let copy_bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(copy_bytes / 2).unwrap();
    let mut dst = s.alloc_zeros::<u8>(copy_bytes / 2).unwrap();
    let copy_ms = super::time_ms(&dev, 10, || s.memcpy_dtod(&src, &mut dst).unwrap());
    let copy_rate = copy_bytes as f64 / (copy_ms * 1e-3);
    let mut rng = Rng::new(7);
    let formats = [
        QuantFormat::Q4G64F16S,
        QuantFormat::GgufQ4K,
        QuantFormat::GgufIq4Xs,
        QuantFormat::Nvfp4,
        QuantFormat::Awq4 { group: 128 },
        QuantFormat::Gptq4 { group: 128, zero_plus_one: true },
        QuantFormat::PackQuantized4 { group: 128, symmetric: true },
        QuantFormat::W8G32F16S,
        QuantFormat::Fp8E4m3fnRowBf16s,
    ];
    for (model, shapes) in LAYER_SHAPES {
        set_layer_form(&dev, &shapes);
        for f in formats {
            let layer: Vec<_> = shapes.iter().map(|&sh| dev.upload_quant(&make(&mut rng, model, f, sh, None, RawDtype::BF16, false)).unwrap()).collect();
            let kmax = shapes.iter().map(|s| s[1]).max().unwrap();
            let nmax = shapes.iter().map(|s| s[0]).max().unwrap();
            let x = upload(&dev, &rounded(&rng.vec(16 * kmax, -1.0, 1.0), dev.storage()));
            let mut y: CudaSlice<u16> = s.alloc_zeros(16 * nmax).unwrap();
            for m in [1, 2, 4, 8, 16] {
                let read: usize = layer.iter().map(|w| w.device_bytes() + 2 * m * (w.k + w.n)).sum();
                let ms = super::time_ms(&dev, 20, || {
                    for w in &layer {
                        dev.quant_gemv(&x, w, None, &mut y, m).unwrap();
                    }
                });
                let rate = read as f64 / (ms * 1e-3);
                println!(
                    "TIMING quant_gemv weights={} model={model} m={m} bytes={read} us={:.1} read_gbps={:.0} copy_gbps={:.0} fraction={:.3}",
                    f.name(),
                    ms * 1e3,
                    rate / 1e9,
                    copy_rate / 1e9,
                    rate / copy_rate
                );
                assert!(rate > 0.0 && rate.is_finite(), "{}: no time measured", f.name());
            }
            // Each projection alone at m = 1 (its launch's own ramp and tail, which the layer's
            // sum hides), for the stored 4-bit formats whose target the layer's fraction is.
            if !matches!(f, QuantFormat::Q4G64F16S | QuantFormat::GgufQ4K | QuantFormat::GgufIq4Xs | QuantFormat::Nvfp4) {
                continue;
            }
            for (proj, w) in ["qkv", "o", "gate_up", "down"].iter().zip(&layer) {
                let read = w.device_bytes() + 2 * (w.k + w.n);
                let ms = super::time_ms(&dev, 20, || dev.quant_gemv(&x, w, None, &mut y, 1).unwrap());
                println!(
                    "TIMING quant_gemv_proj weights={} model={model} proj={proj} n={} k={} us={:.1} fraction={:.3}",
                    f.name(),
                    w.n,
                    w.k,
                    ms * 1e3,
                    read as f64 / (ms * 1e-3) / copy_rate
                );
            }
        }
    }
}

/// What the small kernels between a layer's 4-bit GEMVs cost at batch 1 (Q4G64, the
/// Llama-3-8B and Qwen3.5-27B layer shapes): the four GEMVs back to back, then with three of the
/// model's small kernels between them as the decode layer runs them (add_rmsnorm before qkv and
/// before gate_up, swiglu between gate_up and down), each launch after a GEMV waiting on it as
/// in the model. Prints `TIMING q4_layer_boundaries ...` with both times and the cost a
/// boundary; the model's layer also runs RoPE and attention.
#[test]
fn q4_layer_timing_with_the_models_small_kernels() {
    let Some(dev) = gpu("q4_layer_boundaries", ninfer_core::backend::cuda::StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    let mut rng = Rng::new(8);
    for (model, shapes) in LAYER_SHAPES {
        set_layer_form(&dev, &shapes);
        let layer: Vec<_> = shapes.iter().map(|&sh| dev.upload_quant(&make(&mut rng, model, QuantFormat::Q4G64F16S, sh, None, RawDtype::BF16, false)).unwrap()).collect();
        let (hidden, inter) = (shapes[1][0], shapes[2][0] / 2);
        let mut vec = |n: usize| upload(&dev, &rounded(&rng.vec(n, -1.0, 1.0), dev.storage()));
        let (norm_w, attn) = (vec(hidden), vec(shapes[1][1]));
        let mut residual = vec(hidden);
        let mut h: CudaSlice<u16> = vec(hidden);
        let mut qkv: CudaSlice<u16> = s.alloc_zeros(shapes[0][0]).unwrap();
        let mut o: CudaSlice<u16> = s.alloc_zeros(hidden).unwrap();
        let mut gu: CudaSlice<u16> = s.alloc_zeros(2 * inter).unwrap();
        let mut act: CudaSlice<u16> = vec(inter);
        let mut down: CudaSlice<u16> = s.alloc_zeros(hidden).unwrap();
        let mut times = [0.0f64; 2];
        for round in 0..2 {
            for (with, t) in times.iter_mut().enumerate() {
                let ms = super::time_ms(&dev, 20, || {
                    if with == 1 {
                        dev.add_rmsnorm(&mut residual, &down, &norm_w, &mut h, 1, hidden, 1e-5, false).unwrap();
                    }
                    dev.quant_gemv(&h, &layer[0], None, &mut qkv, 1).unwrap();
                    dev.quant_gemv(&attn, &layer[1], None, &mut o, 1).unwrap();
                    if with == 1 {
                        dev.add_rmsnorm(&mut residual, &o, &norm_w, &mut h, 1, hidden, 1e-5, false).unwrap();
                    }
                    dev.quant_gemv(&h, &layer[2], None, &mut gu, 1).unwrap();
                    if with == 1 {
                        dev.swiglu(&gu.slice(0..), &gu.slice(inter..), &mut act, 1, inter, 2 * inter, 2 * inter).unwrap();
                    }
                    dev.quant_gemv(&act, &layer[3], None, &mut down, 1).unwrap();
                });
                assert!(ms > 0.0 && ms.is_finite(), "{model}: no time measured");
                *t = ms * 1e3;
            }
            println!(
                "TIMING q4_layer_boundaries model={model} round={round} gemvs_us={:.1} with_small_kernels_us={:.1} us_a_boundary={:.2}",
                times[0],
                times[1],
                (times[1] - times[0]) / 3.0
            );
        }
    }
}

/// The model's `Linear` over a quantized weight: its format names the weight's, its route takes
/// none of the dense GEMV's fusions, and `forward` runs the GEMV for a decode step and the
/// workspace route for a prefill step, with the bias, within tolerance of `QuantLinear`.
#[test]
fn a_quantized_linear_forwards_through_both_routes() {
    use ninfer_core::model::cuda::linear::{Linear, QuantWorkspace, WeightFormat};
    for st in STORAGES {
        let Some(dev) = gpu("quant_linear_forward", st) else { return };
        let mut rng = Rng::new(480);
        let (n, k) = (96, 256);
        let w = make(&mut rng, "model.layers.0.mlp.down_proj.weight", QuantFormat::Q4G64F16S, [n, k], None, RawDtype::F16, false);
        let bias_host = rounded(&rng.vec(n, -0.5, 0.5), st);
        let lin = Linear::quantized(&dev, &w, Some(upload(&dev, &bias_host)), QuantWorkspace::new(&dev, n * k).unwrap()).unwrap();
        assert_eq!(lin.format, WeightFormat::Quant(QuantFormat::Q4G64F16S));
        assert!(!lin.route.gemv, "a quantized weight takes none of the dense GEMV's fusions");
        let reference = QuantLinear::new(w.clone()).unwrap();
        let dense = rounded(&dequantize(&w.view()).unwrap(), st);
        for rows in [3, 40] {
            let x = rounded(&rng.vec(rows * k, -1.0, 1.0), st);
            let xd = upload(&dev, &x);
            let mut y: CudaSlice<u16> = dev.stream().alloc_zeros(rows * n).unwrap();
            let mut lin32: CudaSlice<f32> = dev.stream().alloc_zeros(rows * n).unwrap();
            lin.forward(&dev, &xd, &mut y, &mut lin32, rows).unwrap();
            dev.synchronize().unwrap();
            let got = super::harness::from_bits(&dev.stream().clone_dtoh(&y).unwrap(), st);
            let sums = if rows <= 16 { reference.forward(&x, rows).unwrap() } else { matmul(&x, &dense, rows, n, k) };
            let want: Vec<f32> = sums.iter().enumerate().map(|(i, s)| s + bias_host[i % n]).collect();
            check("quant Linear::forward", st, &format!("rows{rows} n{n} k{k}"), &got, &rounded(&want, st), tol16(st));
        }
    }
}
