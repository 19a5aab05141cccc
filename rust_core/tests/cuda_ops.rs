//! CUDA kernels: NVRTC compilation for every CI architecture (no GPU needed), and op parity
//! against CPU references on the GPU (skipped with a printed reason where no GPU is present).
#![cfg(feature = "cuda")]

use ninfer_core::backend::cuda::kernels::{nvrtc_arch, KernelFamily, StorageDType, CI_ARCHES};
use ninfer_core::backend::cuda::nvrtc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Set by .ci/compile-kernels so that a missing NVRTC fails instead of skipping.
fn nvrtc_required() -> bool {
    std::env::var("NINFER_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// The arches to compile: CI_ARCHES, or those named in NINFER_CI_ARCHES (e.g. "90"; how
/// .ci/compile-kernels keeps its NVRTC 13 pass to the arch whose code differs between 12 and 13).
fn ci_arches() -> Vec<u32> {
    match std::env::var("NINFER_CI_ARCHES") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .map(|a| {
                let a: u32 = a.trim().parse().unwrap_or_else(|_| panic!("NINFER_CI_ARCHES: {a:?} is not an arch like 90"));
                assert!(CI_ARCHES.contains(&a), "NINFER_CI_ARCHES: {a} is not one of {CI_ARCHES:?}");
                a
            })
            .collect(),
        _ => CI_ARCHES.to_vec(),
    }
}

/// Whether NVRTC loads; where it does not, says that `test` skips (or fails it, under
/// NINFER_REQUIRE_NVRTC=1).
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc::nvrtc_available() {
        return true;
    }
    assert!(!nvrtc_required(), "NINFER_REQUIRE_NVRTC=1 but libnvrtc was not found");
    eprintln!("SKIP {test}: libnvrtc not found");
    false
}

/// The families whose compiles take most of NVRTC 12.9's time, costliest first (measured: the
/// three quant families are 60% of it, 22-65 s of one core per compile); the rest follow in
/// KernelFamily::ALL's order.
const COSTLIEST_FAMILIES: [KernelFamily; 7] = [
    KernelFamily::QuantHf,
    KernelFamily::QuantGguf,
    KernelFamily::QuantNinfer,
    KernelFamily::DecodeAttention,
    KernelFamily::Gemv,
    KernelFamily::GemvTc,
    KernelFamily::GdnChunked,
];

/// The storage types compiled for `arch` under NVRTC `major`: the one a GPU of that arch runs
/// (`StorageDType::for_arch`: f16 on sm_7x, bf16 from sm_80), and under NVRTC 13, the GPU
/// machines' compiler, both: their op tests run the f16 storage on an sm_90 as well
/// (`CudaDevice::with_storage`). No device of sm_80 or newer runs f16 storage in a model.
fn ci_storages(major: i32, arch: u32) -> Vec<StorageDType> {
    if major >= 13 {
        vec![StorageDType::Bf16, StorageDType::F16]
    } else {
        vec![StorageDType::for_arch(arch / 10, arch % 10)]
    }
}

/// Each (family, arch, storage) compile is one item of a queue that one thread per core pulls
/// from (NVRTC is thread-safe), costliest first: the wall time is the total over the cores, not
/// the slowest family's, and no long compile starts last while the other cores idle.
#[test]
fn every_kernel_compiles_for_every_ci_arch() {
    if !nvrtc_or_skip("every_kernel_compiles_for_every_ci_arch") {
        return;
    }
    let (major, minor) = nvrtc::nvrtc_version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    let mut items = Vec::new();
    for family in KernelFamily::ALL {
        for arch in ci_arches() {
            if (major >= 13 && arch < 75) || !family.serves(arch / 10, arch % 10) {
                continue;
            }
            for storage in ci_storages(major, arch) {
                items.push((family, arch, storage));
            }
        }
    }
    items.sort_by_key(|&(family, _, _)| {
        COSTLIEST_FAMILIES
            .iter()
            .position(|&f| f == family)
            .unwrap_or(COSTLIEST_FAMILIES.len())
    });
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let (mut compiled, mut failures, mut times) = (0, Vec::new(), Vec::new());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(family, arch, storage)) = items.get(i) else {
                            break;
                        };
                        let arch_name = nvrtc_arch(arch / 10, arch % 10);
                        let start = Instant::now();
                        match nvrtc::compile_image(family, &arch_name, storage) {
                            Ok(cubin) if cubin.len() > 64 => compiled += 1,
                            Ok(_) => failures.push((
                                i,
                                format!("{} {arch_name}: empty cubin", family.file_name()),
                            )),
                            Err(e) => failures.push((i, e.to_string())),
                        }
                        let what = format!("{} {arch_name} {}", family.file_name(), storage.name());
                        times.push((start.elapsed(), what));
                    }
                    (compiled, failures, times)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("compile thread panicked"))
            .collect()
    });
    if major >= 13 {
        eprintln!("NVRTC {major}.{minor} cannot target sm_70; CI uses NVRTC 12.x for it");
    }
    let compiled: usize = results.iter().map(|r| r.0).sum();
    let mut times: Vec<&(Duration, String)> = results.iter().flat_map(|r| &r.2).collect();
    times.sort_by(|a, b| b.0.cmp(&a.0));
    let slowest: Vec<String> = times
        .iter()
        .take(5)
        .map(|(t, what)| format!("{what} {:.1} s", t.as_secs_f64()))
        .collect();
    eprintln!("slowest compiles: {}", slowest.join(", "));
    let mut failures: Vec<(usize, String)> = results.into_iter().flat_map(|r| r.1).collect();
    failures.sort();
    let failures: Vec<String> = failures.into_iter().map(|f| f.1).collect();
    assert!(
        failures.is_empty(),
        "{} compile failures:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    eprintln!("compiled {compiled} (family, arch, storage) combinations");
}

/// What `NINFER_EMULATE_ARCH` loads (ninfer_core::backend::cuda::emulate): the kernels as PTX
/// for a virtual architecture, text the driver JIT-compiles, targeting that architecture.
#[test]
fn kernels_compile_to_ptx_for_a_virtual_arch() {
    if !nvrtc_or_skip("kernels_compile_to_ptx_for_a_virtual_arch") {
        return;
    }
    for (arch, storage) in [("compute_80", StorageDType::Bf16), ("compute_75", StorageDType::F16)] {
        let ptx = nvrtc::compile_image(KernelFamily::ALL[0], arch, storage).unwrap();
        let text = String::from_utf8(ptx).expect("PTX is text");
        let target = format!(".target sm_{}", &arch["compute_".len()..]);
        assert!(text.contains(&target) && text.contains(".entry"), "{arch}: no {target} / .entry in the PTX");
        assert!(!text.ends_with('\0'), "{arch}: the PTX keeps NVRTC's terminating NUL");
    }
}

#[path = "cuda_ops/harness.rs"]
mod harness;
#[path = "cuda_ops/reference.rs"]
mod reference;
#[path = "cuda_ops/sampling.rs"]
mod sampling;
#[path = "cuda_ops/gdn_gated.rs"]
mod gdn_gated;
#[path = "cuda_ops/gemv_tc.rs"]
mod gemv_tc;
#[path = "cuda_ops/rounding_points.rs"]
mod rounding_points;
#[path = "cuda_ops/logits_round.rs"]
mod logits_round;
#[path = "cuda_ops/linear_bias.rs"]
mod linear_bias;
#[path = "cuda_ops/decode_attention.rs"]
mod decode_attention;
#[path = "cuda_ops/decode_attention_rope.rs"]
mod decode_attention_rope;
#[path = "cuda_ops/decode_attention_gate.rs"]
mod decode_attention_gate;
#[path = "cuda_ops/gemv_qkv_rope.rs"]
mod gemv_qkv_rope;
#[path = "cuda_ops/rope_kv_normed.rs"]
mod rope_kv_normed;
#[path = "cuda_ops/gemv_chain.rs"]
mod gemv_chain;
#[path = "cuda_ops/prefill_vec.rs"]
mod prefill_vec;
#[path = "cuda_ops/quant.rs"]
mod quant;
#[path = "cuda_ops/fp8_gemm.rs"]
mod fp8_gemm;
#[path = "cuda_ops/fp8_block.rs"]
mod fp8_block;
#[path = "cuda_ops/fp4_gemm.rs"]
mod fp4_gemm;
#[path = "cuda_ops/gdn_replay.rs"]
mod gdn_replay;

use harness::*;
use ninfer_core::backend::cuda::ops::{decode_scratch_len, two_kernel_decode_scratch_len, AttnScratch, ConvShape, DecodeAttentionForm, FlashTile, PagedAttentionShape, RecurrentShape, PrepForm, RopeKvShape, ScanForm, GemvForm};
use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::CudaDevice;
use ninfer_core::NinferError;

#[test]
fn embedding_gather_copies_rows_exactly() {
    for st in STORAGES {
        let Some(dev) = gpu("embedding", st) else { return };
        let mut rng = Rng::new(1);
        for (vocab, hidden, n) in [(1000, 64, 5), (517, 100, 33), (4099, 2048, 1)] {
            let table = rounded(&rng.vec(vocab * hidden, -1.0, 1.0), st);
            let ids: Vec<i32> = (0..n).map(|_| rng.below(vocab) as i32).collect();
            let mut out = Out16::new(&dev, n * hidden);
            dev.embedding(&upload(&dev, &table), &upload_raw(&dev, &ids), &mut out.view(), vocab, hidden)
                .unwrap();
            let got = out.read(&dev, "embedding");
            let want: Vec<f32> =
                ids.iter().flat_map(|&i| table[i as usize * hidden..(i as usize + 1) * hidden].to_vec()).collect();
            check("embedding", st, &format!("v{vocab}xh{hidden}xt{n}"), &got, &want, 0.0);
        }
    }
}

#[test]
fn rmsnorm_matches_reference_for_both_weight_conventions_and_strides() {
    for st in STORAGES {
        let Some(dev) = gpu("rmsnorm", st) else { return };
        let mut rng = Rng::new(2);
        // Past 32768 (40000) some chunks are past the register cache and read twice; 1003 and the
        // stride 4100 take the scalar path (dim or rows not 16-byte aligned).
        for (rows, dim, x_stride) in [(1, 64, 64), (7, 1000, 1000), (33, 4096, 4096), (12, 128, 384), (1, 4096, 4096), (3, 5120, 5120), (2, 2048, 2048), (5, 1003, 1003), (4, 4096, 4100), (2, 40000, 40000)] {
            for plus_one in [false, true] {
                let x = rounded(&rng.vec(rows * x_stride, -2.0, 2.0), st);
                let w = rounded(&rng.vec(dim, -1.0, 1.0), st);
                let mut out = Out16::new(&dev, rows * dim);
                dev.rmsnorm(&upload(&dev, &x), &upload(&dev, &w), &mut out.view(), rows, dim, x_stride, dim, 1e-6, plus_one)
                    .unwrap();
                let want = reference::rmsnorm(&x, &w, rows, dim, x_stride, 1e-6, plus_one);
                let shape = format!("{rows}x{dim}/s{x_stride}/p{}", plus_one as u8);
                check("rmsnorm", st, &shape, &out.read(&dev, "rmsnorm"), &want, tol16(st));
            }
        }
    }
}

/// Per-head norm of q/k heads read inside a fused projection row (stride > heads * dim), one
/// launch: each (token, head) must match the reference norm of that head.
#[test]
fn rmsnorm_heads_normalises_every_head_of_every_row_in_place_of_the_projection() {
    for st in STORAGES {
        let Some(dev) = gpu("rmsnorm_heads", st) else { return };
        let mut rng = Rng::new(5);
        for (rows, heads, dim, x_stride) in [(1, 8, 64, 512), (5, 4, 128, 1024), (3, 2, 256, 700)] {
            let x = rounded(&rng.vec(rows * x_stride, -2.0, 2.0), st);
            let w = rounded(&rng.vec(dim, -1.0, 1.0), st);
            let mut out = Out16::new(&dev, rows * heads * dim);
            dev.rmsnorm_heads(&upload(&dev, &x), &upload(&dev, &w), &mut out.view(), rows, heads, dim, x_stride, heads * dim, 1e-6, true)
                .unwrap();
            // The heads of a row as rows of their own: row (r, h) starts at r * x_stride + h * dim.
            let per_head: Vec<f32> = (0..rows * heads).flat_map(|i| x[(i / heads) * x_stride + (i % heads) * dim..][..dim].to_vec()).collect();
            let want = reference::rmsnorm(&per_head, &w, rows * heads, dim, dim, 1e-6, true);
            check("rmsnorm_heads", st, &format!("{rows}x{heads}x{dim}/s{x_stride}"), &out.read(&dev, "rmsnorm_heads"), &want, tol16(st));
        }
    }
}

#[test]
fn add_rmsnorm_updates_residual_and_normalises_the_sum() {
    for st in STORAGES {
        let Some(dev) = gpu("add_rmsnorm", st) else { return };
        let mut rng = Rng::new(3);
        for (rows, dim) in [(1, 64), (5, 2048), (64, 1000), (1, 4096), (3, 5120), (4, 1003), (2, 40000)] {
            for plus_one in [false, true] {
                let res = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
                let x = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
                let w = rounded(&rng.vec(dim, -1.0, 1.0), st);
                let mut residual = Out16::with(&dev, &res);
                let mut out = Out16::new(&dev, rows * dim);
                dev.add_rmsnorm(&mut residual.view(), &upload(&dev, &x), &upload(&dev, &w), &mut out.view(), rows, dim, 1e-6, plus_one)
                    .unwrap();
                let sum: Vec<f32> = rounded(&res.iter().zip(&x).map(|(a, b)| a + b).collect::<Vec<_>>(), st);
                let want = reference::rmsnorm(&sum, &w, rows, dim, dim, 1e-6, plus_one);
                let shape = format!("{rows}x{dim}/p{}", plus_one as u8);
                check("add_rmsnorm.residual", st, &shape, &residual.read(&dev, "residual"), &sum, tol16(st));
                check("add_rmsnorm.out", st, &shape, &out.read(&dev, "add_rmsnorm"), &want, tol16(st));
            }
        }
    }
}

/// The f32 sum order of rmsnorm / add_rmsnorm depends on `dim` only: a row normalised in a batch
/// of 8 equals the same row alone, read from a buffer one element off 16-byte alignment (the
/// scalar path), bit for bit. Decode's batch == alone guarantee rests on this.
#[test]
fn rmsnorm_rows_are_bitwise_independent_of_batch_and_alignment() {
    for st in STORAGES {
        let Some(dev) = gpu("rmsnorm_bitwise", st) else { return };
        let mut rng = Rng::new(21);
        let rows = 8;
        for dim in [4096, 5120, 2048, 128, 1003, 40000] {
            let x = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
            let res = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
            let w = upload(&dev, &rounded(&rng.vec(dim, -1.0, 1.0), st));
            let mut norm = Out16::new(&dev, rows * dim);
            dev.rmsnorm(&upload(&dev, &x), &w, &mut norm.view(), rows, dim, dim, dim, 1e-6, false).unwrap();
            let norm = norm.read(&dev, "rmsnorm batch");
            let mut residual = Out16::with(&dev, &res);
            let mut added = Out16::new(&dev, rows * dim);
            dev.add_rmsnorm(&mut residual.view(), &upload(&dev, &x), &w, &mut added.view(), rows, dim, 1e-6, true).unwrap();
            let added = added.read(&dev, "add_rmsnorm batch");
            let residual = residual.read(&dev, "add_rmsnorm residual batch");
            for r in [0, 5] {
                let row = r * dim..(r + 1) * dim;
                let shifted: Vec<f32> = std::iter::once(0.0).chain(x[row.clone()].iter().copied()).collect();
                let shifted = upload(&dev, &shifted);
                let mut alone = Out16::new(&dev, dim);
                dev.rmsnorm(&shifted.slice(1..), &w, &mut alone.view(), 1, dim, dim, dim, 1e-6, false).unwrap();
                let what = format!("{st:?} dim {dim} row {r}");
                assert_bitwise(&alone.read(&dev, "rmsnorm alone"), &norm[row.clone()], &format!("rmsnorm {what}"));
                let mut res_alone = Out16::with(&dev, &res[row.clone()]);
                let mut alone = Out16::new(&dev, dim);
                dev.add_rmsnorm(&mut res_alone.view(), &shifted.slice(1..), &w, &mut alone.view(), 1, dim, 1e-6, true).unwrap();
                assert_bitwise(&alone.read(&dev, "add_rmsnorm alone"), &added[row.clone()], &format!("add_rmsnorm {what}"));
                assert_bitwise(&res_alone.read(&dev, "residual alone"), &residual[row.clone()], &format!("add_rmsnorm residual {what}"));
            }
        }
    }
}

fn assert_bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", got[i], want[i]);
    }
}

#[test]
fn gated_rmsnorm_multiplies_by_silu_of_the_gate() {
    for st in STORAGES {
        let Some(dev) = gpu("rmsnorm_gated", st) else { return };
        let mut rng = Rng::new(4);
        // (tokens, heads, dim, z row stride): contiguous z, and z as a column range of wider
        // rows (the fused GDN input projection: the kernel must skip the other columns).
        // dim 80: the block-per-row kernel (not whole warps); 700 x 48: a prefill's rows, more
        // than one wave of the warp-per-row kernels' grid; 32, 96, 256: one, three and eight
        // warps' parts; an odd row count (9, 15): a pair's second row past the end.
        for (tokens, heads, dim, z_stride) in [(1, 1, 128, 128), (3, 8, 128, 1024), (9, 1, 64, 64), (5, 6, 128, 6 * 128 + 40), (1, 48, 128, 16480), (4, 3, 80, 240), (700, 48, 128, 16480), (37, 2, 256, 520), (5, 3, 96, 300), (7, 1, 32, 32)] {
            let rows = tokens * heads;
            let x = rounded(&rng.vec(rows * dim, -2.0, 2.0), st);
            let z_wide = rounded(&rng.vec((tokens - 1) * z_stride + heads * dim, -4.0, 4.0), st);
            let z: Vec<f32> = (0..tokens).flat_map(|t| z_wide[t * z_stride..t * z_stride + heads * dim].to_vec()).collect();
            let w = rounded(&rng.vec(dim, 0.5, 1.5), st);
            let mut out = Out16::new(&dev, rows * dim);
            dev.rmsnorm_gated(&upload(&dev, &x), &upload(&dev, &z_wide), z_stride, &upload(&dev, &w), &mut out.view(), tokens, heads, dim, 1e-6)
                .unwrap();
            let want = reference::rmsnorm_gated(&x, &z, &w, rows, dim, 1e-6);
            check("rmsnorm_gated", st, &format!("{tokens}x{heads}x{dim}/zs{z_stride}"), &out.read(&dev, "rmsnorm_gated"), &want, tol16(st));
        }
        // A z row stride shorter than a token's heads would make tokens overlap: a typed error.
        let (x, z, w) = (upload(&dev, &[0.5; 2 * 64]), upload(&dev, &[0.5; 2 * 64]), upload(&dev, &[1.0; 64]));
        let mut out = Out16::new(&dev, 2 * 64);
        let short = dev.rmsnorm_gated(&x, &z, 32, &w, &mut out.view(), 2, 1, 64, 1e-6);
        assert!(matches!(short, Err(NinferError::Device(ref m)) if m.contains("stride 32")), "{short:?}");
    }
}

#[test]
fn rope_rotates_full_and_partial_heads_at_per_token_positions() {
    for st in STORAGES {
        let Some(dev) = gpu("rope", st) else { return };
        let mut rng = Rng::new(5);
        // (tokens, q heads, kv heads, head_dim, rotary_dim, fused qkv layout)
        for (t, hq, hk, d, rot, fused) in
            [(1, 8, 2, 128, 128, false), (5, 4, 4, 64, 64, true), (37, 16, 2, 256, 64, true), (3, 2, 1, 128, 32, false), (1, 32, 8, 128, 128, true), (2, 40, 8, 128, 128, false), (3000, 4, 2, 128, 128, true), (2500, 24, 4, 256, 64, false)]
        {
            let theta: f32 = 1_000_000.0;
            let inv_freq: Vec<f32> = (0..rot / 2).map(|i| theta.powf(-(2.0 * i as f32) / rot as f32)).collect();
            let positions: Vec<i32> = (0..t).map(|_| rng.below(8000) as i32).collect();
            let (qw, kw) = (hq * d, hk * d);
            let stride = if fused { qw + 2 * kw } else { 0 };
            let (q_stride, k_stride) = if fused { (stride, stride) } else { (qw, kw) };
            let mut q_host = rounded(&rng.vec(t * q_stride.max(qw), -1.0, 1.0), st);
            let mut k_host = rounded(&rng.vec(t * k_stride.max(kw), -1.0, 1.0), st);
            let mut q = Out16::with(&dev, &q_host);
            let mut k = Out16::with(&dev, &k_host);
            dev.rope_neox(&mut q.view(), &mut k.view(), &upload_raw(&dev, &positions), &upload_raw(&dev, &inv_freq), hq, hk, d, q_stride, k_stride, 1.0)
                .unwrap();
            reference::rope(&mut q_host, &positions, q_stride, hq, d, &inv_freq, 1.0);
            reference::rope(&mut k_host, &positions, k_stride, hk, d, &inv_freq, 1.0);
            let shape = format!("t{t}/hq{hq}/hk{hk}/d{d}/rot{rot}/fused{}", fused as u8);
            check("rope.q", st, &shape, &q.read(&dev, "rope q"), &q_host, tol16(st));
            check("rope.k", st, &shape, &k.read(&dev, "rope k"), &k_host, tol16(st));
        }
    }
}

/// RoPE over a prefill's q and k moves its bytes at a copy's pace: at the Llama-3-8B shape
/// (2k tokens, 32 + 8 heads of 128, fused qkv rows) and the Qwen3.5-27B one (8k tokens, 24 + 4
/// heads of 256 rotating 64), the rotation takes at most 3x a device-to-device copy of the bytes
/// it reads and writes. A block per (token, head) took ~10x at the 8B shape (block scheduling).
#[test]
fn rope_prefill_timing_against_a_copy_of_its_bytes() {
    let Some(dev) = gpu("rope timing", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    for (name, t, hq, hk, d, rot) in [("llama-3-8b", 2048, 32, 8, 128, 128), ("qwen3_5-27b", 8192, 24, 4, 256, 64)] {
        let width = (hq + 2 * hk) * d;
        let inv_freq: Vec<f32> = (0..rot / 2).map(|i| 10_000f32.powf(-(2.0 * i as f32) / rot as f32)).collect();
        let positions: Vec<i32> = (0..t as i32).collect();
        let (pos_dev, freq_dev) = (upload_raw(&dev, &positions), upload_raw(&dev, &inv_freq));
        let mut qkv = s.alloc_zeros::<u16>(t * width).unwrap();
        let mut dummy = s.alloc_zeros::<u16>(1).unwrap();
        let ms = time_ms(&dev, 20, || {
            dev.rope_neox(&mut qkv, &mut dummy, &pos_dev, &freq_dev, hq + hk, 0, d, width, 0, 1.0).unwrap()
        });
        // Bytes touched: the rotated elements of every q and k head, read and written.
        let moved = 2 * t * (hq + hk) * rot * 2;
        assert_copy_pace(&dev, &format!("rope_neox {name} t{t} hq{hq} hk{hk} d{d} rot{rot}"), ms, moved, 3.0);
    }
}

/// The GDN output norm of a prefill moves its bytes at a copy's pace: at the Qwen3.5-27B shape
/// (8k tokens, 48 value heads of 128) rmsnorm_gated takes at most 2.5x a device-to-device copy
/// of the bytes it reads and writes (x, z, out). A block per row took ~7x (block scheduling), a
/// warp per row with 2-byte loads 2.67x (195.8 us), the 16-byte form 2.18x (159.6 us, H200).
#[test]
fn rmsnorm_gated_prefill_timing_against_a_copy_of_its_bytes() {
    let Some(dev) = gpu("rmsnorm_gated timing", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    let (t, heads, dim) = (8192, 48, 128);
    let z_stride = 2 * heads * dim + 2 * 16 * dim;
    let x = s.alloc_zeros::<u16>(t * heads * dim).unwrap();
    let z = s.alloc_zeros::<u16>(t * z_stride).unwrap();
    let w = s.alloc_zeros::<u16>(dim).unwrap();
    let mut out = s.alloc_zeros::<u16>(t * heads * dim).unwrap();
    let ms = time_ms(&dev, 20, || dev.rmsnorm_gated(&x, &z, z_stride, &w, &mut out, t, heads, dim, 1e-6).unwrap());
    let moved = 3 * t * heads * dim * 2;
    assert_copy_pace(&dev, &format!("rmsnorm_gated t{t} heads{heads} dim{dim}"), ms, moved, 2.5);
}

/// The tiled prefill conv moves its bytes at a copy's pace: at the Qwen3.5-27B shape (8k tokens
/// of one sequence, 10240 channels read from 16480-wide projection rows, kernel 4) it takes at
/// most 3x a device-to-device copy of the bytes it reads and writes (x's channels, out): 2.77x
/// (226.2 us) on the H200; a form with 8 channels a thread and 16-byte loads took 4.6x (378 us).
#[test]
fn causal_conv1d_prefill_timing_against_a_copy_of_its_bytes() {
    let Some(dev) = gpu("conv1d timing", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    let (t, c, stride, k) = (8192, 10240, 16480, 4);
    let x = s.alloc_zeros::<u16>(t * stride).unwrap();
    let mut state = s.alloc_zeros::<u16>(2 * c * (k - 1)).unwrap();
    let w = s.alloc_zeros::<u16>(c * k).unwrap();
    let (cu, slots) = (upload_raw(&dev, &[0i32, t as i32]), upload_raw(&dev, &[0i32]));
    let mut out = s.alloc_zeros::<u16>(t * c).unwrap();
    let shape = ConvShape { n_tokens: t, channels: c, x_stride: stride, kernel_size: k, n_slots: 2 };
    let ms = time_ms(&dev, 20, || dev.causal_conv1d(&x, &mut state, &w, None, &cu, &slots, &mut out, &shape).unwrap());
    let moved = 2 * t * c * 2;
    assert_copy_pace(&dev, &format!("causal_conv1d t{t} channels{c} k{k} (tiled + state)"), ms, moved, 3.0);
}

/// The residual add + RMSNorm of a prefill at the Qwen3.5-27B shape (8k rows of 5120) and the
/// Llama-3-8B one (8k rows of 4096) against a device-to-device copy of the bytes it reads and
/// writes (x and the residual read, the residual and the normed rows written). A figure first:
/// the profile of a 27B 16-layer 8k prefill put it at 148 us a call (under PDL, whose waits
/// the profiler counts); alone on the H200 151.5 us, 1.86x (8B shape 86.9 us, 1.30x) with a
/// block a row, 91.8 us, 1.13x (8B 74.5 us, 1.13x) with a warp a row (`add_rmsnorm_rows_g*`).
/// Bound 1.5x: the block-per-row form fails it.
#[test]
fn add_rmsnorm_prefill_timing_against_a_copy_of_its_bytes() {
    let Some(dev) = gpu("add_rmsnorm timing", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    for (name, rows, dim) in [("qwen3_5-27b", 8192, 5120), ("llama-3-8b", 8192, 4096)] {
        let mut residual = s.alloc_zeros::<u16>(rows * dim).unwrap();
        let x = s.alloc_zeros::<u16>(rows * dim).unwrap();
        let w = s.alloc_zeros::<u16>(dim).unwrap();
        let mut out = s.alloc_zeros::<u16>(rows * dim).unwrap();
        let ms = time_ms(&dev, 20, || dev.add_rmsnorm(&mut residual, &x, &w, &mut out, rows, dim, 1e-6, false).unwrap());
        let moved = 4 * rows * dim * 2;
        assert_copy_pace(&dev, &format!("add_rmsnorm {name} rows{rows} dim{dim}"), ms, moved, 1.5);
    }
}

#[test]
fn swiglu_and_sigmoid_gate_match_reference() {
    for st in STORAGES {
        let Some(dev) = gpu("swiglu", st) else { return };
        let mut rng = Rng::new(6);
        // n a multiple of 8: the 16-byte chunk kernels; 1001: the scalar ones.
        for (rows, n) in [(1, 64), (9, 1000), (130, 3072), (5, 1001)] {
            // fused gate_up: [rows, 2n], gate first.
            let gu = rounded(&rng.vec(rows * 2 * n, -4.0, 4.0), st);
            let gu_dev = upload(&dev, &gu);
            let mut out = Out16::new(&dev, rows * n);
            dev.swiglu(&gu_dev, &gu_dev.slice(n..), &mut out.view(), rows, n, 2 * n, 2 * n).unwrap();
            let want = reference::swiglu(&gu, rows, n);
            check("swiglu", st, &format!("{rows}x{n}"), &out.read(&dev, "swiglu"), &want, tol16(st));

            let x = rounded(&rng.vec(rows * n, -2.0, 2.0), st);
            let mut xo = Out16::with(&dev, &x);
            dev.sigmoid_gate_mul(&mut xo.view(), &gu_dev, rows, n, 2 * n).unwrap();
            let want: Vec<f32> =
                (0..rows * n).map(|e| x[e] * reference::sigmoid(gu[(e / n) * 2 * n + e % n])).collect();
            check("sigmoid_gate_mul", st, &format!("{rows}x{n}"), &xo.read(&dev, "gate"), &want, tol16(st));
        }
    }
}

/// The chunked (`_v8`) and scalar forms of swiglu and sigmoid_gate_mul agree bit for bit: the
/// same operands read once from aligned rows (chunked) and once one element past a 16-byte
/// boundary (the launcher falls back to the scalar kernel).
#[test]
fn swiglu_and_sigmoid_gate_chunked_equal_scalar_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("swiglu chunked vs scalar", st) else { return };
        let mut rng = Rng::new(61);
        let (rows, n) = (33, 2048);
        let gu = rounded(&rng.vec(rows * 2 * n, -6.0, 6.0), st);
        let shifted: Vec<f32> = std::iter::once(0.0).chain(gu.iter().copied()).collect();
        let (aligned, skewed) = (upload(&dev, &gu), upload(&dev, &shifted));
        let skewed = skewed.slice(1..);
        let mut a = Out16::new(&dev, rows * n);
        dev.swiglu(&aligned, &aligned.slice(n..), &mut a.view(), rows, n, 2 * n, 2 * n).unwrap();
        let mut b = Out16::new(&dev, rows * n);
        dev.swiglu(&skewed, &skewed.slice(n..), &mut b.view(), rows, n, 2 * n, 2 * n).unwrap();
        assert_bitwise(&a.read(&dev, "swiglu chunked"), &b.read(&dev, "swiglu scalar"), &format!("swiglu {st:?}"));

        let x = rounded(&rng.vec(rows * n, -3.0, 3.0), st);
        let mut xa = Out16::with(&dev, &x);
        dev.sigmoid_gate_mul(&mut xa.view(), &aligned, rows, n, 2 * n).unwrap();
        let mut xb = Out16::with(&dev, &x);
        dev.sigmoid_gate_mul(&mut xb.view(), &skewed, rows, n, 2 * n).unwrap();
        assert_bitwise(&xa.read(&dev, "gate chunked"), &xb.read(&dev, "gate scalar"), &format!("sigmoid_gate_mul {st:?}"));
    }
}

#[test]
fn gemv_matches_reference_for_small_m_in_both_output_types() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv", st) else { return };
        let mut rng = Rng::new(7);
        for ((m, n, k), hidden) in [(1, 1, 64), (1, 4096, 1024), (1, 333, 4104), (3, 1000, 2056), (8, 257, 512), (11, 300, 4096)]
            .into_iter()
            .flat_map(|case| HIDDEN_PER_KSPLIT.map(|h| (case, h)))
        {
            let dev = model_device(&dev, hidden);
            let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
            let w = rounded(&rng.vec(n * k, -1.0, 1.0), st);
            let (xd, wd) = (upload(&dev, &x), upload(&dev, &w));
            let want = reference::matmul_nt(&x, &w, m, n, k);
            let shape = format!("m{m}n{n}k{k} ksplit {}", dev.cc_ksplit_for(n, k));
            let mut y = Out16::new(&dev, m * n);
            dev.gemv(&xd, &wd, &mut y.view(), m, n, k).unwrap();
            check("gemv", st, &shape, &y.read(&dev, "gemv"), &want, tol16(st));
            let mut y32 = Out32::new(&dev, m * n);
            dev.gemv_f32_out(&xd, &wd, &mut y32.view(), m, n, k).unwrap();
            check("gemv_f32out", st, &shape, &y32.read(&dev, "gemv f32"), &want, TOL32);
        }
    }
}

#[test]
fn linear_routes_by_m_and_matches_reference() {
    for st in STORAGES {
        let Some(dev) = gpu("linear", st) else { return };
        let mut rng = Rng::new(16);
        for (m, n, k) in [(1, 300, 256), (2, 300, 256), (5, 300, 256), (64, 300, 260)] {
            let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
            let w = rounded(&rng.vec(n * k, -1.0, 1.0), st);
            let mut y = Out16::new(&dev, m * n);
            dev.linear(&upload(&dev, &x), &upload(&dev, &w), &mut y.view(), m, n, k).unwrap();
            let want = reference::matmul_nt(&x, &w, m, n, k);
            check("linear", st, &format!("m{m}n{n}k{k}"), &y.read(&dev, "linear"), &want, tol16(st));
        }
    }
}

/// Row r of an M-row GEMV must be bit-identical to the one-row GEMV of that row, for every
/// M the kernel serves and both output types, in each batch-invariant form (one kernel for
/// every M: `Simt`, and `TensorCores` from sm_80 on; `CudaOptions::batch_invariant` picks the latter):
/// the batch == alone guarantee of decode.
#[test]
fn multi_row_gemv_rows_equal_single_row_gemv_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_rows", st) else { return };
        let mut rng = Rng::new(23);
        let (n, k) = (333, 4096 + 8);
        let w = upload(&dev, &rounded(&rng.vec(n * k, -1.0, 1.0), st));
        for (form, hidden) in invariant_gemv_forms(&dev).into_iter().flat_map(|f| HIDDEN_PER_KSPLIT.map(|h| (f, h))) {
            let dev = model_device(&dev, hidden);
            let split = dev.cc_ksplit_for(n, k);
            for m in 2..=8 {
                let x = rounded(&rng.vec(m * k, -2.0, 2.0), st);
                let xd = upload(&dev, &x);
                let mut y = Out16::new(&dev, m * n);
                dev.gemv_with(form, &xd, &w, &mut y.view(), m, n, k).unwrap();
                let mut y32 = Out32::new(&dev, m * n);
                dev.gemv_f32_out_with(form, &xd, &w, &mut y32.view(), m, n, k).unwrap();
                let (many, many32) = (y.read(&dev, "gemv rows"), y32.read(&dev, "gemv rows f32"));
                for r in 0..m {
                    let xr = upload(&dev, &x[r * k..(r + 1) * k]);
                    let mut one = Out16::new(&dev, n);
                    dev.gemv_with(form, &xr, &w, &mut one.view(), 1, n, k).unwrap();
                    let mut one32 = Out32::new(&dev, n);
                    dev.gemv_f32_out_with(form, &xr, &w, &mut one32.view(), 1, n, k).unwrap();
                    let (one, one32) = (one.read(&dev, "gemv one"), one32.read(&dev, "gemv one f32"));
                    let row = &many[r * n..(r + 1) * n];
                    let row32 = &many32[r * n..(r + 1) * n];
                    assert!(row.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()), "{st:?} {form:?} ksplit {split} m={m} row {r}: storage output differs from M=1");
                    assert!(row32.iter().zip(&one32).all(|(a, b)| a.to_bits() == b.to_bits()), "{st:?} {form:?} ksplit {split} m={m} row {r}: f32 output differs from M=1");
                }
            }
        }
    }
}

/// The GEMV forms that run one kernel per shape for every M (batch == alone bit for bit).
fn invariant_gemv_forms(dev: &CudaDevice) -> Vec<GemvForm> {
    if dev.compute_capability().0 >= 8 {
        vec![GemvForm::Simt, GemvForm::TensorCores]
    } else {
        vec![GemvForm::Simt]
    }
}

/// The decode MLP's gate_up projection with SwiGLU in its epilogue (`gemv_gateup_swiglu`) must
/// give exactly what the GEMV into a [M, 2 * inter] buffer followed by the swiglu kernel gives,
/// bit for bit, for every M the GEMV serves (and M = 11, two launches): decode results stay
/// those of the unfused path. inter ragged against the warp's pairs and the block's columns
/// (333, 37, 1027), K = 1000 / 8 / 4096; weights scaled so the sums spread over silu's curve.
/// Also checked against the CPU reference (gate_up rounded to storage as the GPU rounds it), and
/// row r of an M-row launch against the one-row launch (batch == alone) in each invariant form.
#[test]
fn gemv_gateup_swiglu_equals_gemv_then_swiglu_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gemv_gateup_swiglu", st) else { return };
        let mut rng = Rng::new(29);
        for ((inter, k), hidden) in [(333, 1000), (37, 8), (1027, 4096)].into_iter().flat_map(|case| HIDDEN_PER_KSPLIT.map(|h| (case, h))) {
            let dev = model_device(&dev, hidden);
            let s = 3.0 / (k as f32).sqrt();
            let w = rounded(&rng.vec(2 * inter * k, -s, s), st);
            let wd = upload(&dev, &w);
            for m in (1..=8).chain([11]) {
                let x = rounded(&rng.vec(m * k, -1.0, 1.0), st);
                let xd = upload(&dev, &x);
                let shape = format!("m{m}inter{inter}k{k} ksplit {}", dev.cc_ksplit_for(2 * inter, k));
                let mut fused = Out16::new(&dev, m * inter);
                dev.gemv_gateup_swiglu(&xd, &wd, &mut fused.view(), m, inter, k).unwrap();
                let fused = fused.read(&dev, "gemv_gateup_swiglu");
                let mut gu = Out16::new(&dev, m * 2 * inter);
                dev.gemv(&xd, &wd, &mut gu.view(), m, 2 * inter, k).unwrap();
                let gu_host = gu.read(&dev, "gate_up gemv");
                let gud = upload(&dev, &gu_host);
                let mut act = Out16::new(&dev, m * inter);
                dev.swiglu(&gud, &gud.slice(inter..), &mut act.view(), m, inter, 2 * inter, 2 * inter).unwrap();
                assert_bitwise(&fused, &act.read(&dev, "swiglu"), &format!("gemv_gateup_swiglu {st:?} {shape} vs gemv + swiglu"));
                let want = reference::swiglu(&rounded(&reference::matmul_nt(&x, &w, m, 2 * inter, k), st), m, inter);
                check("gemv_gateup_swiglu", st, &shape, &fused, &want, tol16(st));
                // Batch == alone in each batch-invariant form.
                for form in invariant_gemv_forms(&dev).into_iter().filter(|_| m > 1) {
                    let mut many = Out16::new(&dev, m * inter);
                    dev.gemv_gateup_swiglu_with(form, &xd, &wd, &mut many.view(), m, inter, k).unwrap();
                    let many = many.read(&dev, "gemv_gateup_swiglu rows");
                    for r in [0, m - 1] {
                        let mut one = Out16::new(&dev, inter);
                        dev.gemv_gateup_swiglu_with(form, &upload(&dev, &x[r * k..(r + 1) * k]), &wd, &mut one.view(), 1, inter, k).unwrap();
                        assert_bitwise(&many[r * inter..(r + 1) * inter], &one.read(&dev, "gemv_gateup_swiglu one"), &format!("gemv_gateup_swiglu {st:?} {form:?} {shape} row {r} vs M=1"));
                    }
                }
            }
        }
        // K the 16-byte loads cannot serve, and a weight shorter than 2 * inter rows, are typed
        // errors, not wrong results.
        let (x, w) = (upload(&dev, &[0.0; 64]), upload(&dev, &[0.0; 64]));
        let mut act = Out16::new(&dev, 16);
        assert!(matches!(dev.gemv_gateup_swiglu(&x, &w, &mut act.view(), 1, 2, 12), Err(NinferError::Device(_))));
        assert!(dev.gemv_gateup_swiglu(&x, &w, &mut act.view(), 1, 5, 8).is_err());
    }
}

#[test]
fn gemv_rejects_k_not_a_multiple_of_8() {
    let Some(dev) = gpu("gemv_k", StorageDType::Bf16) else { return };
    let x = upload(&dev, &[0.0; 12]);
    let w = upload(&dev, &[0.0; 12]);
    let mut y = Out16::new(&dev, 1);
    assert!(matches!(dev.gemv(&x, &w, &mut y.view(), 1, 1, 12), Err(NinferError::Device(_))));
}

/// cuBLAS GEMM against the host product, into buffers of exactly m rows and into buffers that
/// hold `padded_rows(m)`, where it runs that many (blas.rs: one kernel a bucket of row counts,
/// all run at startup, instead of one per count): the padded rows are the product too (of x's
/// rows beyond m), written rather than left poisoned, and the guard after them stays whole; in
/// exact buffers nothing past m rows is written.
#[test]
fn cublas_gemm_matches_reference_in_both_output_types() {
    use ninfer_core::backend::cuda::blas::padded_rows;
    for st in STORAGES {
        let Some(dev) = gpu("gemm", st) else { return };
        let mut rng = Rng::new(8);
        for (m, n, k, padded) in [(17, 256, 512, false), (128, 1000, 1024, false), (1, 64, 64, false), (17, 256, 512, true), (100, 320, 256, true), (300, 64, 128, true)] {
            let rows = if padded { padded_rows(m) } else { m };
            assert!(!padded || rows > m, "m {m} pads");
            let x = rounded(&rng.vec(rows * k, -1.0, 1.0), st);
            let w = rounded(&rng.vec(n * k, -1.0, 1.0), st);
            let (xd, wd) = (upload(&dev, &x), upload(&dev, &w));
            let want = reference::matmul_nt(&x, &w, rows, n, k);
            let shape = format!("m{m}n{n}k{k} in {rows} rows");
            let mut y = Out16::new(&dev, rows * n);
            dev.gemm(&xd, &wd, &mut y.view(), m, n, k).unwrap();
            check("gemm", st, &shape, &y.read(&dev, "gemm"), &want, tol16(st));
            let mut y32 = Out32::new(&dev, rows * n);
            dev.gemm_f32_out(&xd, &wd, &mut y32.view(), m, n, k).unwrap();
            check("gemm_f32out", st, &shape, &y32.read(&dev, "gemm f32"), &want, TOL32);
        }
    }
}

#[test]
fn buffers_too_small_for_the_shape_are_device_errors() {
    let Some(dev) = gpu("check_len", StorageDType::Bf16) else { return };
    let x = upload(&dev, &[1.0; 63]);
    let w = upload(&dev, &[1.0; 64]);
    let mut out = Out16::new(&dev, 64);
    match dev.rmsnorm(&x, &w, &mut out.view(), 1, 64, 64, 64, 1e-6, false) {
        Err(NinferError::Device(msg)) => assert!(msg.contains("63") && msg.contains("64"), "{msg}"),
        other => panic!("expected a device error, got {other:?}"),
    }
}

/// A paged cache and block tables for `contexts`, with blocks scattered at random.
struct PagedCase {
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    tables: Vec<i32>,
    max_blocks: usize,
    num_blocks: usize,
}

fn paged_case(rng: &mut Rng, st: StorageDType, contexts: &[usize], hk: usize, d: usize, bs: usize) -> PagedCase {
    let need: Vec<usize> = contexts.iter().map(|c| c.div_ceil(bs)).collect();
    let max_blocks = need.iter().copied().max().unwrap_or(1).max(1);
    let num_blocks = need.iter().sum::<usize>() + 5;
    let perm = rng.permutation(num_blocks);
    let mut tables = vec![0i32; contexts.len() * max_blocks];
    let mut next = 0;
    for (s, &nb) in need.iter().enumerate() {
        for b in 0..nb {
            tables[s * max_blocks + b] = perm[next] as i32;
            next += 1;
        }
    }
    let n = num_blocks * bs * hk * d;
    PagedCase {
        k_cache: rounded(&rng.vec(n, -1.0, 1.0), st),
        v_cache: rounded(&rng.vec(n, -1.0, 1.0), st),
        tables,
        max_blocks,
        num_blocks,
    }
}

/// Runs paged attention for query tokens (seq, pos) and compares with the reference.
#[allow(clippy::too_many_arguments)]
fn attention_case(dev: &CudaDevice, rng: &mut Rng, op: &str, contexts: &[usize], tokens: &[(usize, usize)], d: usize, partition: usize, heads: (usize, usize)) {
    let st = dev.storage();
    let ((hq, hk), bs) = (heads, 16);
    let case = paged_case(rng, st, contexts, hk, d, bs);
    let t = tokens.len();
    let q = rounded(&rng.vec(t * hq * d, -1.0, 1.0), st);
    let token_seq: Vec<i32> = tokens.iter().map(|&(s, _)| s as i32).collect();
    let token_pos: Vec<i32> = tokens.iter().map(|&(_, p)| p as i32).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let shape = PagedAttentionShape {
        n_q_heads: hq,
        n_kv_heads: hk,
        head_dim: d,
        q_stride: hq * d,
        block_size: bs,
        num_blocks: case.num_blocks,
        max_blocks_per_seq: case.max_blocks,
        scale,
        max_context: contexts.iter().copied().max().unwrap(),
        partition,
    };
    let mut out = Out16::new(dev, t * hq * d);
    dev.paged_attention(
        &upload(dev, &q),
        &upload(dev, &case.k_cache),
        &upload(dev, &case.v_cache),
        &upload_raw(dev, &case.tables),
        &upload_raw(dev, &token_seq),
        &upload_raw(dev, &token_pos),
        &mut out.view(),
        &shape,
    )
    .unwrap();
    // The CPU op takes one sequence's run of consecutive positions at a time.
    let mut want = Vec::with_capacity(t * hq * d);
    let mut i = 0;
    while i < t {
        let (s, p0) = tokens[i];
        let mut j = i + 1;
        while j < t && tokens[j] == (s, p0 + (j - i)) {
            j += 1;
        }
        let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
        let qs = &q[i * hq * d..j * hq * d];
        want.extend(reference::attention_seq(qs, j - i, hq, &case.k_cache, &case.v_cache, table, p0, hk, d, bs, scale));
        i = j;
    }
    let label = format!("ctx{contexts:?}/t{t}/d{d}/hq{hq}hk{hk}/part{partition}").replace(' ', "");
    check(op, st, &label, &out.read(dev, op), &want, tol16(st));
    // The decode entry points (per-token splits into caller scratch, fixed grid) on the same
    // case: the one-kernel form and the two-kernel form (attention + attention_combine).
    let scratch = decode_scratch(dev, t, &shape);
    let mut out = Out16::new(dev, t * hq * d);
    dev.paged_attention_decode_as(
        DecodeAttentionForm::Scaled,
        &upload(dev, &q),
        &upload(dev, &case.k_cache),
        &upload(dev, &case.v_cache),
        &upload_raw(dev, &case.tables),
        &upload_raw(dev, &token_seq),
        &upload_raw(dev, &token_pos),
        &mut out.view(),
        None,
        &shape,
        &scratch,
    )
    .unwrap();
    check(&format!("{op}/decode_one_kernel"), st, &label, &out.read(dev, op), &want, tol16(st));
    assert_arrivals_reset(dev, &scratch, &label);
    let scratch = two_kernel_scratch(dev, t, &shape);
    let mut out = Out16::new(dev, t * hq * d);
    dev.paged_attention_decode_two_kernels(
        &upload(dev, &q),
        &upload(dev, &case.k_cache),
        &upload(dev, &case.v_cache),
        &upload_raw(dev, &case.tables),
        &upload_raw(dev, &token_seq),
        &upload_raw(dev, &token_pos),
        &mut out.view(),
        &shape,
        &scratch,
    )
    .unwrap();
    check(&format!("{op}/decode_two_kernels"), st, &label, &out.read(dev, op), &want, tol16(st));
}

/// Scratch for `paged_attention_decode` of `t` tokens: NaN partials (a partial read before it
/// is written shows), zeroed arrival counters (as the model allocates them).
fn decode_scratch(dev: &CudaDevice, t: usize, shape: &PagedAttentionShape) -> AttnScratch {
    let len = decode_scratch_len(t, shape);
    AttnScratch {
        acc: upload_raw(dev, &vec![f32::NAN; len.acc]),
        ml: upload_raw(dev, &vec![f32::NAN; len.ml]),
        arrivals: upload_raw(dev, &vec![0u32; len.arrivals]),
    }
}

/// Scratch for `paged_attention_decode_two_kernels` of `t` tokens (NaN partials).
fn two_kernel_scratch(dev: &CudaDevice, t: usize, shape: &PagedAttentionShape) -> AttnScratch {
    let (acc, ml) = two_kernel_decode_scratch_len(t, shape);
    AttnScratch {
        acc: upload_raw(dev, &vec![f32::NAN; acc]),
        ml: upload_raw(dev, &vec![f32::NAN; ml]),
        arrivals: upload_raw(dev, &[0u32]),
    }
}

/// Every arrival counter of a completed one-kernel decode attention is back at 0.
fn assert_arrivals_reset(dev: &CudaDevice, scratch: &AttnScratch, what: &str) {
    let counts = dev.stream().clone_dtoh(&scratch.arrivals).unwrap();
    assert!(counts.iter().all(|&c| c == 0), "{what}: arrival counters left at {counts:?}");
}

/// The one-kernel decode attention (`paged_attention_decode_as`, the scaled form) over a wide range of contexts (up
/// to 40000 keys: 32 block splits of 157-key warps) and group sizes: against the CPU op, a batch
/// of mixed contexts against each token alone bit for bit (on one scratch reused token after
/// token), a second launch on the same scratch bit for bit (the arrival counters reset
/// themselves), and the two-kernel form within tolerance. The layout's own edges are in
/// cuda_ops/decode_attention.rs.
#[test]
fn one_kernel_decode_attention_matches_reference_alone_and_on_relaunch() {
    for st in STORAGES {
        let Some(dev) = gpu("decode_attention_one_kernel", st) else { return };
        let mut rng = Rng::new(19);
        let contexts = [1, 15, 16, 17, 127, 128, 129, 1000, 5000, 40000];
        // Llama-3-8B (group 4), Qwen3.5-27B attention (group 6: one head a block), a group of 8.
        for ((hq, hk), d) in [((32, 8), 128), ((24, 4), 256), ((16, 2), 64)] {
            let bs = 16;
            let case = paged_case(&mut rng, st, &contexts, hk, d, bs);
            let t = contexts.len();
            let q = rounded(&rng.vec(t * hq * d, -1.0, 1.0), st);
            let scale = 1.0 / (d as f32).sqrt();
            let shape = PagedAttentionShape {
                n_q_heads: hq,
                n_kv_heads: hk,
                head_dim: d,
                q_stride: hq * d,
                block_size: bs,
                num_blocks: case.num_blocks,
                max_blocks_per_seq: case.max_blocks,
                scale,
                max_context: 0,
                partition: 0,
            };
            let (qd, kd, vd, tables) =
                (upload(&dev, &q), upload(&dev, &case.k_cache), upload(&dev, &case.v_cache), upload_raw(&dev, &case.tables));
            let token_seq: Vec<i32> = (0..t as i32).collect();
            let token_pos: Vec<i32> = contexts.iter().map(|&c| c as i32 - 1).collect();
            let (seq_d, pos_d) = (upload_raw(&dev, &token_seq), upload_raw(&dev, &token_pos));
            let label = format!("hq{hq}hk{hk}/d{d}");
            let scratch = decode_scratch(&dev, t, &shape);
            let run = |out: &mut Out16| {
                dev.paged_attention_decode_as(DecodeAttentionForm::Scaled, &qd, &kd, &vd, &tables, &seq_d, &pos_d, &mut out.view(), None, &shape, &scratch).unwrap();
                out.read(&dev, "decode attention")
            };
            let batch = run(&mut Out16::new(&dev, t * hq * d));
            assert_arrivals_reset(&dev, &scratch, &label);
            let again = run(&mut Out16::new(&dev, t * hq * d));
            assert_bitwise(&again, &batch, &format!("decode attention {label}: second launch"));
            let mut want = Vec::with_capacity(t * hq * d);
            for (s, &c) in contexts.iter().enumerate() {
                let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
                let qs = &q[s * hq * d..(s + 1) * hq * d];
                want.extend(reference::attention_seq(qs, 1, hq, &case.k_cache, &case.v_cache, table, c - 1, hk, d, bs, scale));
            }
            for (s, &c) in contexts.iter().enumerate() {
                let rows = s * hq * d..(s + 1) * hq * d;
                check("decode_attention_one_kernel", st, &format!("{label}/ctx{c}"), &batch[rows.clone()], &want[rows], tol16(st));
            }
            let alone_scratch = decode_scratch(&dev, 1, &shape);
            for (s, &c) in contexts.iter().enumerate() {
                let (seq1, pos1) = (upload_raw(&dev, &[s as i32]), upload_raw(&dev, &[c as i32 - 1]));
                let q1 = upload(&dev, &q[s * hq * d..(s + 1) * hq * d]);
                let mut out = Out16::new(&dev, hq * d);
                dev.paged_attention_decode_as(DecodeAttentionForm::Scaled, &q1, &kd, &vd, &tables, &seq1, &pos1, &mut out.view(), None, &shape, &alone_scratch).unwrap();
                let alone = out.read(&dev, "decode attention alone");
                assert_bitwise(&alone, &batch[s * hq * d..(s + 1) * hq * d], &format!("decode attention {label}: ctx {c} alone vs batch"));
            }
            assert_arrivals_reset(&dev, &alone_scratch, &label);
            let two = two_kernel_scratch(&dev, t, &shape);
            let mut out = Out16::new(&dev, t * hq * d);
            dev.paged_attention_decode_two_kernels(&qd, &kd, &vd, &tables, &seq_d, &pos_d, &mut out.view(), &shape, &two).unwrap();
            check("decode_attention_two_kernels", st, &label, &out.read(&dev, "two-kernel decode"), &want, tol16(st));
        }
    }
}

#[test]
fn paged_decode_attention_matches_reference_with_and_without_splits() {
    for st in STORAGES {
        let Some(dev) = gpu("attention_decode", st) else { return };
        let mut rng = Rng::new(9);
        for d in [64, 96, 128, 256] {
            let contexts = [1, 17, 700];
            let tokens: Vec<(usize, usize)> = contexts.iter().enumerate().map(|(s, &c)| (s, c - 1)).collect();
            for partition in [0, 64, 1 << 20] {
                attention_case(&dev, &mut rng, "attention_decode", &contexts, &tokens, d, partition, (8, 2));
            }
        }
        // Every group size: 1 (MHA), 3 (no grouped instance: one head per warp), 2, 8.
        for heads in [(4, 4), (6, 2), (4, 2), (8, 1)] {
            for d in [64, 128, 256] {
                attention_case(&dev, &mut rng, "attention_decode", &[33, 900], &[(0, 32), (1, 899)], d, 0, heads);
            }
        }
        let contexts = [3000];
        attention_case(&dev, &mut rng, "attention_decode", &contexts, &[(0, 2999)], 128, 0, (8, 2));
        // Llama-3-8B heads at contexts around the 512-key point where decode splits start to
        // grow beyond 8 keys (decode_partition), and short ones split 8 keys at a time.
        let contexts = [170, 512, 513, 1025, 1500];
        let tokens: Vec<(usize, usize)> = contexts.iter().enumerate().map(|(s, &c)| (s, c - 1)).collect();
        attention_case(&dev, &mut rng, "attention_decode", &contexts, &tokens, 128, 0, (32, 8));
        // Past 4096 keys the decode splits grow beyond 64 keys (decode_partition).
        attention_case(&dev, &mut rng, "attention_decode", &[5000, 9], &[(0, 4999), (1, 8)], 128, 0, (8, 2));
    }
}

#[test]
fn paged_prefill_attention_is_causal_over_cached_prefix_and_new_tokens() {
    for st in STORAGES {
        let Some(dev) = gpu("attention_prefill", st) else { return };
        let mut rng = Rng::new(10);
        // seq 0: fresh prompt of 40; seq 1: 275 cached tokens then a chunk of 25.
        let contexts = [40, 300];
        let mut tokens: Vec<(usize, usize)> = (0..40).map(|p| (0, p)).collect();
        tokens.extend((275..300).map(|p| (1, p)));
        for d in [64, 128] {
            for partition in [0, 128, 1 << 20] {
                attention_case(&dev, &mut rng, "attention_prefill", &contexts, &tokens, d, partition, (8, 2));
            }
            attention_case(&dev, &mut rng, "attention_prefill", &contexts, &tokens, d, 0, (6, 2));
            attention_case(&dev, &mut rng, "attention_prefill", &contexts, &tokens, d, 0, (8, 1));
        }
    }
}

/// Flash attention tolerance. The outputs lie in [-1, 1] (convex combinations of V) and each
/// case has a row at position 0 (output = one V row), so the output's scale is ~1 and rounding
/// the output to storage costs up to 2^-9 (bf16) or 2^-12 (f16). P V runs with f16 P (each
/// weight off by at most 2^-11 relative, so the output by at most 2^-11 = 4.9e-4 as |v| <= 1),
/// so the worst error is below 2.5e-3 (bf16) and 1e-3 (f16). With bf16 P (each weight off by
/// at most 2^-9 relative) the bound is 2^-9 + 2^-9 = 3.9e-3: 3.2e-3 and 3.03e-3 were measured.
fn flash_tol(st: StorageDType, tile: FlashTile) -> f32 {
    match (st, tile) {
        // Built by NVRTC 13, the wgmma tiling multiplies P V with P in bf16 (as FlashAttention
        // and sdpa do; the other tilings round P to f16): bound 3.9e-3 above, 3.03e-3 measured
        // on a 128-token case; 1e-2 is allowed.
        (StorageDType::Bf16, FlashTile::Rows128Wgmma | FlashTile::Rows128WgmmaWs) => 6e-3,
        (StorageDType::Bf16, _) => 3e-3,
        (StorageDType::F16, _) => 2e-3,
    }
}

/// Every flash tiling this device runs for head size `d` (FlashTile::ALL that fit here): the
/// 64-row blocks everywhere, the 128-row cp.async blocks on sm_80/sm_90, the 128-key and the
/// wgmma ones at d 128 on sm_90.
fn flash_tiles(dev: &CudaDevice, d: usize) -> Vec<FlashTile> {
    FlashTile::ALL
        .into_iter()
        .filter(|&t| dev.flash_tile_fits(d, t))
        .collect()
}

/// Runs flash attention for sequences given as (cached prefix, chunk length) in every tiling
/// the device runs for `d` and compares every query row with the CPU paged attention (on
/// sm_70/sm_75 the launcher computes it with the scalar kernel).
fn flash_case(dev: &CudaDevice, rng: &mut Rng, seqs: &[(usize, usize)], heads: (usize, usize), d: usize, bs: usize) {
    let st = dev.storage();
    let (hq, hk) = heads;
    let contexts: Vec<usize> = seqs.iter().map(|&(p, n)| p + n).collect();
    let case = paged_case(rng, st, &contexts, hk, d, bs);
    let t: usize = seqs.iter().map(|s| s.1).sum();
    // q rows inside a wider fused row (stride > width), as the qkv projection hands them over.
    let q_stride = hq * d + 2 * hk * d;
    let q = rounded(&rng.vec(t * q_stride, -1.0, 1.0), st);
    let (mut token_seq, mut token_pos, mut cu) = (Vec::new(), Vec::new(), vec![0i32]);
    for (s, &(p, n)) in seqs.iter().enumerate() {
        token_seq.extend(std::iter::repeat_n(s as i32, n));
        token_pos.extend((p..p + n).map(|x| x as i32));
        cu.push(cu.last().unwrap() + n as i32);
    }
    let scale = 1.0 / (d as f32).sqrt();
    let shape = PagedAttentionShape {
        n_q_heads: hq,
        n_kv_heads: hk,
        head_dim: d,
        q_stride,
        block_size: bs,
        num_blocks: case.num_blocks,
        max_blocks_per_seq: case.max_blocks,
        scale,
        max_context: contexts.iter().copied().max().unwrap(),
        partition: 0,
    };
    let max_rows = seqs.iter().map(|s| s.1).max().unwrap();
    let (qd, kd, vd) = (upload(dev, &q), upload(dev, &case.k_cache), upload(dev, &case.v_cache));
    let (tables, seq_d, pos_d, cu_d) =
        (upload_raw(dev, &case.tables), upload_raw(dev, &token_seq), upload_raw(dev, &token_pos), upload_raw(dev, &cu));
    let mut want = Vec::with_capacity(t * hq * d);
    for (s, &(p, n)) in seqs.iter().enumerate() {
        let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
        let r0 = cu[s] as usize;
        let qs: Vec<f32> = (r0..r0 + n).flat_map(|r| q[r * q_stride..r * q_stride + hq * d].to_vec()).collect();
        want.extend(reference::attention_seq(&qs, n, hq, &case.k_cache, &case.v_cache, table, p, hk, d, bs, scale));
    }
    let mut first: Option<Vec<f32>> = None;
    let mut wgmma: Option<Vec<f32>> = None;
    for tile in flash_tiles(dev, d) {
        let mut out = Out16::new(dev, t * hq * d);
        dev.flash_attention_tiled(&qd, &kd, &vd, &tables, &seq_d, &pos_d, &cu_d, &mut out.view(), &shape, max_rows, tile)
            .unwrap();
        let got = out.read(dev, "flash attention");
        let label = format!("seqs{seqs:?}/d{d}/hq{hq}hk{hk}/bs{bs}/{tile:?}").replace(' ', "");
        check("flash_attention", st, &label, &got, &want, flash_tol(st, tile));
        // The warp-specialized forms run the wgmma form's arithmetic in its order: required
        // bit for bit (FlashTile::ALL lists the wgmma form first).
        if tile == FlashTile::Rows128Wgmma {
            wgmma = Some(got.clone());
        } else if tile.warp_specialized() {
            let w = wgmma.as_ref().expect("the wgmma form fits wherever a warp-specialized one does");
            let diff = got.iter().zip(w).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(diff, 0, "flash attention {label}: {diff} elements differ from Rows128Wgmma");
            // Persistent: its last block zeroed the work counters for the next launch.
            assert_eq!(dev.flash_work_counters().unwrap(), [0, 0], "flash attention {label}: work counters left set");
        }
        // Each warp runs the same key tiles in the same order in either tiling, so they are
        // expected to agree bit for bit; reported, not required (the contract is the tolerance).
        match &first {
            None => first = Some(got),
            Some(f) => {
                let diff = got.iter().zip(f).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                println!("PARITY op=flash_attention_tilings storage={} shape={label} differing_elements={diff}", st.name());
            }
        }
    }
}

#[test]
fn flash_attention_matches_reference_for_chunks_prefixes_and_gqa() {
    for st in STORAGES {
        let Some(dev) = gpu("flash_attention", st) else { return };
        if !dev.has_flash_attention() {
            eprintln!("NOTE flash_attention: {} has no sm_80 tensor cores; the scalar route is tested", dev.arch());
        }
        let mut rng = Rng::new(21);
        for d in [64, 128, 256] {
            for bs in [16, 32] {
                // One fresh prompt per chunk length.
                for n in [1, 17, 128, 300] {
                    flash_case(&dev, &mut rng, &[(0, n)], (8, 2), d, bs);
                }
                // Three sequences: a chunk after a cached prefix, a decode row, a fresh prompt.
                flash_case(&dev, &mut rng, &[(275, 128), (40, 1), (0, 17)], (8, 2), d, bs);
            }
            // GQA groups 1, 4, 6 with a cached prefix and a 1-row sequence in the same step.
            for heads in [(4, 4), (8, 2), (12, 2)] {
                flash_case(&dev, &mut rng, &[(33, 300), (100, 1), (0, 128)], heads, d, 16);
            }
        }
        flash_case(&dev, &mut rng, &[(0, 200)], (8, 2), 96, 16);
        // Ten and more 128-key tiles: the warp-specialized form's three buffers each refilled
        // three times (both parities of its "full" and "empty" barriers), one sequence after a
        // cached prefix beside a fresh one.
        flash_case(&dev, &mut rng, &[(0, 1200)], (8, 2), 128, 16);
        flash_case(&dev, &mut rng, &[(900, 300), (0, 700)], (8, 2), 128, 16);
        // A block size that is not a power of two (the 128-row kernel indexes the table with a
        // shift for powers of two and divides otherwise).
        for d in [128, 256] {
            flash_case(&dev, &mut rng, &[(275, 128), (40, 1), (0, 300)], (12, 2), d, 24);
        }
    }
}

/// A sequence's attention must not depend on the other sequences of the step: 20 sequences of
/// 24 rows (after different cached prefixes) in one launch give, bit for bit, what each gives
/// launched alone; so do they with a 150-row prompt added to the step (three row tiles in the
/// grid, max_rows 150). Batched prefill then differs from a prompt run alone only through the
/// other ops, never through attention.
#[test]
fn flash_attention_of_a_sequence_is_bitwise_independent_of_the_batch() {
    for st in STORAGES {
        let Some(dev) = gpu("flash_attention_batch", st) else { return };
        let mut rng = Rng::new(22);
        for (d, (hq, hk), bs) in [(128, (8, 2), 16), (64, (4, 4), 32), (256, (8, 1), 16)] {
            // (cached prefix, rows): prefixes 0, 7, ..., 133 give different kv lengths and
            // block-boundary offsets; the last sequence is the long prompt.
            let mut seqs: Vec<(usize, usize)> = (0..20).map(|s| (7 * s, 24)).collect();
            seqs.push((0, 150));
            let contexts: Vec<usize> = seqs.iter().map(|&(p, n)| p + n).collect();
            let case = paged_case(&mut rng, st, &contexts, hk, d, bs);
            let q_stride = hq * d + 2 * hk * d;
            let mut first = vec![0usize];
            for &(_, n) in &seqs {
                first.push(first.last().unwrap() + n);
            }
            let q = rounded(&rng.vec(first[seqs.len()] * q_stride, -1.0, 1.0), st);
            let shape = PagedAttentionShape {
                n_q_heads: hq,
                n_kv_heads: hk,
                head_dim: d,
                q_stride,
                block_size: bs,
                num_blocks: case.num_blocks,
                max_blocks_per_seq: case.max_blocks,
                scale: 1.0 / (d as f32).sqrt(),
                max_context: contexts.iter().copied().max().unwrap(),
                partition: 0,
            };
            let (kd, vd) = (upload(&dev, &case.k_cache), upload(&dev, &case.v_cache));
            let (width, mb) = (hq * d, case.max_blocks);
            // One launch over the sequences `ids` (rows packed in that order); output bits per
            // sequence.
            let run = |ids: &[usize]| -> Vec<Vec<u32>> {
                let (mut rows, mut tables, mut token_seq, mut token_pos, mut cu) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new(), vec![0i32]);
                for (i, &s) in ids.iter().enumerate() {
                    let (p, n) = seqs[s];
                    rows.extend_from_slice(&q[first[s] * q_stride..first[s + 1] * q_stride]);
                    tables.extend_from_slice(&case.tables[s * mb..(s + 1) * mb]);
                    token_seq.extend(std::iter::repeat_n(i as i32, n));
                    token_pos.extend((p..p + n).map(|x| x as i32));
                    cu.push(cu.last().unwrap() + n as i32);
                }
                let t = token_pos.len();
                let max_rows = ids.iter().map(|&s| seqs[s].1).max().unwrap();
                let mut out = Out16::new(&dev, t * width);
                dev.flash_attention(
                    &upload(&dev, &rows),
                    &kd,
                    &vd,
                    &upload_raw(&dev, &tables),
                    &upload_raw(&dev, &token_seq),
                    &upload_raw(&dev, &token_pos),
                    &upload_raw(&dev, &cu),
                    &mut out.view(),
                    &shape,
                    max_rows,
                )
                .unwrap();
                let bits: Vec<u32> = out.read(&dev, "flash attention").iter().map(|x| x.to_bits()).collect();
                (0..ids.len()).map(|i| bits[cu[i] as usize * width..cu[i + 1] as usize * width].to_vec()).collect()
            };
            let alone: Vec<Vec<u32>> = (0..seqs.len()).map(|s| run(&[s]).remove(0)).collect();
            let short: Vec<usize> = (0..20).collect();
            let every: Vec<usize> = (0..seqs.len()).collect();
            for ids in [&short, &every] {
                let batched = run(ids);
                for (&s, got) in ids.iter().zip(&batched) {
                    let diff = got.iter().zip(&alone[s]).filter(|(a, b)| a != b).count();
                    assert_eq!(
                        diff,
                        0,
                        "flash attention ({}, d{d} hq{hq} hk{hk} bs{bs}): sequence {s} of a {}-sequence launch differs from alone in {diff} of {} elements",
                        st.name(),
                        ids.len(),
                        got.len()
                    );
                }
            }
            println!("PARITY op=flash_attention_batch storage={} shape=d{d}/hq{hq}hk{hk}/bs{bs} bitwise=ok", st.name());
        }
    }
}

/// Prefill attention speed at the shapes of the issue: one 8192-token prompt of the Qwen3.5-27B
/// attention layers (24 q / 4 kv heads, d 256) in every tiling the device runs, and of
/// Llama-3-8B (32 / 8 heads, d 128), then the same at 2048 tokens. Prints `TIMING
/// flash_attention ...` with ms and causal TFLOP/s (4 * heads * d * n^2 / 2); at 8k the routed
/// tiling must be the fastest (2k: figures only).
#[test]
fn flash_attention_prefill_timing_at_2k_and_8k() {
    let Some(dev) = gpu("flash_attention_timing", StorageDType::Bf16) else { return };
    if !dev.has_flash_attention() {
        eprintln!("SKIP flash_attention_timing: {} has no sm_80 tensor cores", dev.arch());
        return;
    }
    let mut rng = Rng::new(23);
    let bs = 16usize;
    for (n, d, hq, hk) in [(8192usize, 256usize, 24usize, 4usize), (8192, 128, 32, 8), (2048, 256, 24, 4), (2048, 128, 32, 8)] {
        let st = dev.storage();
        let case = paged_case(&mut rng, st, &[n], hk, d, bs);
        let q_stride = hq * d + 2 * hk * d;
        let q = upload(&dev, &rng.vec(n * q_stride, -1.0, 1.0));
        let (kd, vd) = (upload(&dev, &case.k_cache), upload(&dev, &case.v_cache));
        let tables = upload_raw(&dev, &case.tables);
        let seq_d = upload_raw(&dev, &vec![0i32; n]);
        let pos_d = upload_raw(&dev, &(0..n as i32).collect::<Vec<i32>>());
        let cu_d = upload_raw(&dev, &[0i32, n as i32]);
        let shape = PagedAttentionShape {
            n_q_heads: hq,
            n_kv_heads: hk,
            head_dim: d,
            q_stride,
            block_size: bs,
            num_blocks: case.num_blocks,
            max_blocks_per_seq: case.max_blocks,
            scale: 1.0 / (d as f32).sqrt(),
            max_context: n,
            partition: 0,
        };
        let mut out = Out16::new(&dev, n * hq * d);
        let flop = 4.0 * (hq * d) as f64 * (n as f64) * (n as f64) / 2.0;
        let mut ms = Vec::new();
        for tile in flash_tiles(&dev, d) {
            let t = time_ms(&dev, 10, || {
                dev.flash_attention_tiled(&q, &kd, &vd, &tables, &seq_d, &pos_d, &cu_d, &mut out.view(), &shape, n, tile)
                    .unwrap()
            });
            println!(
                "TIMING flash_attention d{d} hq{hq} hk{hk} n{n} {tile:?}{}: {t:.3} ms, {:.1} TFLOP/s",
                if tile == dev.flash_tile(d) { " (routed)" } else { "" },
                flop / t / 1e9
            );
            ms.push(t);
        }
        if n != 8192 {
            continue; // 2k: figures only (short causal loops weigh the prologue more)
        }
        let tiles = flash_tiles(&dev, d);
        let routed = ms[tiles.iter().position(|&t| t == dev.flash_tile(d)).expect("the routed tiling is among those that fit")];
        for (t, m) in tiles.iter().zip(&ms) {
            assert!(routed <= *m, "d{d}: the routed tiling ({routed:.3} ms) is slower than {t:?} ({m:.3} ms)");
        }
    }
}

/// The chunked GDN kernels against the CPU recurrent rule and the GPU recurrent kernel, from
/// a nonzero state: single and several chunks, ragged sequences ending mid-chunk, and every
/// workspace element written exactly inside its bounds.
#[test]
fn gdn_chunked_matches_recurrent_reference_from_nonzero_state() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_chunked", st) else { return };
        let mut rng = Rng::new(22);
        for (lens, dk, dv) in [
            (vec![1], 128, 128),
            (vec![63], 128, 128),
            (vec![64], 128, 64),
            (vec![200, 3], 128, 128),
            (vec![1000], 128, 128),
            (vec![130, 64, 1], 64, 64),
            (vec![65, 300, 127, 64], 128, 128),
            (vec![513, 2], 64, 96),
        ] {
            let (nk, nv, n_slots) = (2, 4, 5);
            let slots: Vec<i32> = [3, 0, 4, 1][..lens.len()].to_vec();
            let t: usize = lens.iter().sum();
            let stride = 2 * nk * dk + nv * dv;
            let qkv = rounded(&rng.vec(t * stride, -1.0, 1.0), st);
            // Decays from near 1 to strong, as the gates produce them.
            let g = rng.vec(t * nv, -1.0, 0.0).iter().map(|x| x * x * x * 2.0).collect::<Vec<f32>>();
            let beta = rng.vec(t * nv, 0.0, 1.0);
            let state0 = rng.vec(n_slots * nv * dk * dv, -0.3, 0.3);
            let mut cu = vec![0i32];
            for l in &lens {
                cu.push(cu.last().unwrap() + *l as i32);
            }
            let qkv_dev = upload(&dev, &qkv);
            let shape = RecurrentShape { n_tokens: t, n_k_heads: nk, n_v_heads: nv, dk, dv, qk_stride: stride, v_stride: stride, n_slots };
            let (g_dev, beta_dev, cu_dev, slots_dev) = (upload_raw(&dev, &g), upload_raw(&dev, &beta), upload_raw(&dev, &cu), upload_raw(&dev, &slots));
            // The same call through the recurrent kernel.
            let mut state_rec = Out32::with(&dev, &state0);
            let mut out_rec = Out16::new(&dev, t * nv * dv);
            dev.gdn_recurrent(
                &qkv_dev,
                &qkv_dev.slice(nk * dk..),
                &qkv_dev.slice(2 * nk * dk..),
                &g_dev,
                &beta_dev,
                &mut state_rec.view(),
                &cu_dev,
                &slots_dev,
                &mut out_rec.view(),
                &shape,
            )
            .unwrap();
            let mut state_want = state0.clone();
            let mut out_want = vec![0.0f32; t * nv * dv];
            for (s, &slot) in slots.iter().enumerate() {
                let toks = cu[s] as usize..cu[s + 1] as usize;
                let cols = |from: usize, len: usize| -> Vec<f32> {
                    toks.clone().flat_map(|i| qkv[i * stride + from..i * stride + from + len].to_vec()).collect()
                };
                let (q, kk, v) = (cols(0, nk * dk), cols(nk * dk, nk * dk), cols(2 * nk * dk, nv * dv));
                let so = slot as usize * nv * dk * dv;
                let o = reference::gdn_recurrent_seq(
                    &q,
                    &kk,
                    &v,
                    &g[toks.start * nv..toks.end * nv],
                    &beta[toks.start * nv..toks.end * nv],
                    &mut state_want[so..so + nv * dk * dv],
                    toks.len(),
                    nk,
                    nv,
                    dk,
                    dv,
                );
                out_want[toks.start * nv * dv..toks.end * nv * dv].copy_from_slice(&o);
            }
            // Every scan form with every prep form; the tensor-core scans round their product
            // operands to tf32, so their outputs and state are held to 1e-2 relative (the SIMT
            // scan: storage precision and 1e-3 on the f32 state). The preps' products are exact
            // (tensor cores: storage-type operands) or f32 (SIMT) with f32 sums, so the tensor-
            // core prep keeps each scan's tolerance, and its workspace (W, U, M, scales) is held
            // to 1e-4 of the SIMT prep's.
            // The eight-warp scan runs the pipelined scan's mmas on the same operands in the
            // same order: its output and state equal the pipelined scan's bit for bit.
            let mut work_simt: Option<Vec<f32>> = None;
            let mut pipelined: Vec<(PrepForm, Vec<f32>, Vec<f32>)> = Vec::new();
            for (form, prep) in [ScanForm::Simt, ScanForm::TensorCores, ScanForm::Pipelined, ScanForm::Wide]
                .into_iter()
                .flat_map(|f| [(f, PrepForm::Simt), (f, PrepForm::TensorCores)])
            {
                let (tol_out, tol_state) = match form {
                    ScanForm::Simt => (tol16(st), 1e-3),
                    ScanForm::TensorCores | ScanForm::Pipelined | ScanForm::Wide => (tol16(st).max(1e-2), 1e-2),
                };
                let mut state = Out32::with(&dev, &state0);
                let mut out = Out16::new(&dev, t * nv * dv);
                let mut work = Out32::new(&dev, RecurrentShape::chunked_workspace_len(t, nv, dk, dv));
                dev.gdn_chunked_forms(
                    form,
                    prep,
                    &qkv_dev,
                    &qkv_dev.slice(nk * dk..),
                    &qkv_dev.slice(2 * nk * dk..),
                    &g_dev,
                    &beta_dev,
                    &mut state.view(),
                    &cu_dev,
                    &slots_dev,
                    &mut out.view(),
                    &mut work.view(),
                    &shape,
                )
                .unwrap();
                let label = format!("lens{lens:?}/dk{dk}/dv{dv}/chunked{}/{form:?}/prep{prep:?}", dev.has_gdn_chunked(dk)).replace(' ', "");
                check("gdn_chunked.out", st, &label, &out.read(&dev, "gdn out"), &out_want, tol_out);
                check("gdn_chunked.state", st, &label, &state.read(&dev, "gdn state"), &state_want, tol_state);
                let out_got = out.read(&dev, "gdn out");
                check("gdn_chunked.out_vs_recurrent", st, &label, &out_got, &out_rec.read(&dev, "gdn recurrent out"), tol_out);
                check("gdn_chunked.state_vs_recurrent", st, &label, &state.read(&dev, "gdn state"), &state_rec.read(&dev, "gdn recurrent state"), tol_state);
                match form {
                    ScanForm::Pipelined => pipelined.push((prep, out_got, state.read(&dev, "gdn state"))),
                    ScanForm::Wide => {
                        let (_, want_out, want_state) = pipelined.iter().find(|(p, ..)| *p == prep).expect("the pipelined scan runs first");
                        assert_bitwise(&out_got, want_out, &format!("{label}: eight-warp scan output vs the pipelined scan's"));
                        assert_bitwise(&state.read(&dev, "gdn state"), want_state, &format!("{label}: eight-warp scan state vs the pipelined scan's"));
                    }
                    _ => {}
                }
                if dev.has_gdn_chunked(dk) {
                    let w = work.read(&dev, "gdn chunk workspace");
                    match (prep, &work_simt) {
                        (PrepForm::Simt, _) => work_simt = Some(w),
                        (PrepForm::TensorCores, Some(want)) => check("gdn_chunked.work_tc_prep_vs_simt_prep", st, &label, &w, want, 1e-4),
                        (PrepForm::TensorCores, None) => unreachable!("the SIMT prep runs first"),
                    }
                }
            }
        }
    }
}

/// The chunked GDN scan at Qwen3.5-27B's shape (16 k heads, 48 v heads, dk = dv = 128) over
/// one 8192-token sequence (128 chunks): each tensor-core scan form against the recurrent
/// kernel from a nonzero state, the eight-warp form bit for bit against the pipelined one,
/// then the scan alone timed per form. The pipelined scan must be faster than the plain
/// tensor-core one by 5x at least (9.0 against 0.90 ms on the H200; its first version, 1.48 ms,
/// would pass), and the eight-warp scan faster than the pipelined one (0.737 against 0.861 ms;
/// its first version, 0.976 against 0.905, failed).
#[test]
fn gdn_chunked_scan_forms_timing_at_27b_shape_agree_and_eight_warps_are_fastest() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gdn_chunked 27B shape", st) else { return };
    let (t, nk, nv, dk, dv) = (8192usize, 16usize, 48usize, 128usize, 128usize);
    if !dev.has_gdn_chunked(dk) {
        eprintln!("SKIP gdn_chunked 27B shape: no chunked kernels for dk {dk} here");
        return;
    }
    let mut rng = Rng::new(27);
    let stride = 2 * nk * dk + nv * dv;
    let qkv_dev = upload(&dev, &rng.vec(t * stride, -1.0, 1.0));
    let g = rng.vec(t * nv, -1.0, 0.0).iter().map(|x| x * x * x * 2.0).collect::<Vec<f32>>();
    let (g_dev, beta_dev) = (upload_raw(&dev, &g), upload_raw(&dev, &rng.vec(t * nv, 0.0, 1.0)));
    let state0 = rng.vec(nv * dk * dv, -0.3, 0.3);
    let (cu_dev, slots_dev) = (upload_raw(&dev, &[0i32, t as i32]), upload_raw(&dev, &[0i32]));
    let shape = RecurrentShape { n_tokens: t, n_k_heads: nk, n_v_heads: nv, dk, dv, qk_stride: stride, v_stride: stride, n_slots: 1 };
    let (q, k, v) = (qkv_dev.slice(0..), qkv_dev.slice(nk * dk..), qkv_dev.slice(2 * nk * dk..));
    let mut state_rec = Out32::with(&dev, &state0);
    let mut out_rec = Out16::new(&dev, t * nv * dv);
    dev.gdn_recurrent(&q, &k, &v, &g_dev, &beta_dev, &mut state_rec.view(), &cu_dev, &slots_dev, &mut out_rec.view(), &shape).unwrap();
    let (out_want, state_want) = (out_rec.read(&dev, "gdn recurrent out"), state_rec.read(&dev, "gdn recurrent state"));
    let mut work = Out32::new(&dev, RecurrentShape::chunked_workspace_len(t, nv, dk, dv));
    let (mut ms, mut pipelined) = (Vec::new(), None);
    for form in [ScanForm::TensorCores, ScanForm::Pipelined, ScanForm::Wide] {
        let label = format!("t{t}/nk{nk}/nv{nv}/dk{dk}/dv{dv}/{form:?}");
        let mut state = Out32::with(&dev, &state0);
        let mut out = Out16::new(&dev, t * nv * dv);
        dev.gdn_chunked_via(form, &q, &k, &v, &g_dev, &beta_dev, &mut state.view(), &cu_dev, &slots_dev, &mut out.view(), &mut work.view(), &shape)
            .unwrap();
        let (out_got, state_got) = (out.read(&dev, "gdn out"), state.read(&dev, "gdn state"));
        check("gdn_chunked_27b.out_vs_recurrent", st, &label, &out_got, &out_want, 1e-2);
        check("gdn_chunked_27b.state_vs_recurrent", st, &label, &state_got, &state_want, 1e-2);
        match (form, &pipelined) {
            (ScanForm::Pipelined, _) => pipelined = Some((out_got, state_got)),
            (ScanForm::Wide, Some((want_out, want_state))) => {
                assert_bitwise(&out_got, want_out, &format!("{label}: eight-warp scan output vs the pipelined scan's"));
                assert_bitwise(&state_got, want_state, &format!("{label}: eight-warp scan state vs the pipelined scan's"));
            }
            _ => {}
        }
        // The scan alone, over the workspace just filled (the state moves on; the timing does
        // not depend on its values).
        let mut scan = || {
            dev.gdn_chunked_scan_only(form, &q, &k, &v, &g_dev, &beta_dev, &mut state.view(), &cu_dev, &slots_dev, &mut out.view(), &mut work.view(), &shape)
                .unwrap()
        };
        scan();
        dev.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            scan();
        }
        dev.synchronize().unwrap();
        ms.push(t0.elapsed().as_secs_f64() / 10.0 * 1e3);
    }
    let (ms_tc, ms_pipe, ms_wide) = (ms[0], ms[1], ms[2]);
    println!("TIMING gdn_chunk_scan 27B shape (48 v heads, dk=dv=128, 8192 tokens, 1 sequence): tensor-cores {ms_tc:.3} ms, pipelined {ms_pipe:.3} ms, eight-warp {ms_wide:.3} ms per call");
    assert!(ms_pipe * 5.0 < ms_tc, "pipelined scan {ms_pipe:.3} ms not 5x faster than the tensor-core scan {ms_tc:.3} ms");
    assert!(ms_wide < ms_pipe, "eight-warp scan {ms_wide:.3} ms not faster than the pipelined scan {ms_pipe:.3} ms");
}

/// The chunked GDN prep at Qwen3.5-27B's shape (16 k heads, 48 v heads, dk = dv = 128) over
/// one 8192-token sequence (128 chunks): both prep forms under the default scan against the
/// recurrent kernel from a nonzero state, their workspaces against each other, then the prep
/// alone timed per form. The tensor-core prep must be faster than the SIMT one (the round-4
/// 8k profile had the latter at 2.37 ms per GDN layer).
#[test]
fn gdn_chunk_prep_forms_timing_at_27b_shape_agree_and_tensor_cores_are_faster() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gdn_chunk_prep 27B shape", st) else { return };
    let (t, nk, nv, dk, dv) = (8192usize, 16usize, 48usize, 128usize, 128usize);
    if !dev.has_gdn_chunked(dk) || dev.gdn_prep_form() != PrepForm::TensorCores {
        eprintln!("SKIP gdn_chunk_prep 27B shape: no tensor-core prep for dk {dk} here");
        return;
    }
    let mut rng = Rng::new(28);
    let stride = 2 * nk * dk + nv * dv;
    let qkv_dev = upload(&dev, &rng.vec(t * stride, -1.0, 1.0));
    let g = rng.vec(t * nv, -1.0, 0.0).iter().map(|x| x * x * x * 2.0).collect::<Vec<f32>>();
    let (g_dev, beta_dev) = (upload_raw(&dev, &g), upload_raw(&dev, &rng.vec(t * nv, 0.0, 1.0)));
    let state0 = rng.vec(nv * dk * dv, -0.3, 0.3);
    let (cu_dev, slots_dev) = (upload_raw(&dev, &[0i32, t as i32]), upload_raw(&dev, &[0i32]));
    let shape = RecurrentShape { n_tokens: t, n_k_heads: nk, n_v_heads: nv, dk, dv, qk_stride: stride, v_stride: stride, n_slots: 1 };
    let (q, k, v) = (qkv_dev.slice(0..), qkv_dev.slice(nk * dk..), qkv_dev.slice(2 * nk * dk..));
    let mut state_rec = Out32::with(&dev, &state0);
    let mut out_rec = Out16::new(&dev, t * nv * dv);
    dev.gdn_recurrent(&q, &k, &v, &g_dev, &beta_dev, &mut state_rec.view(), &cu_dev, &slots_dev, &mut out_rec.view(), &shape).unwrap();
    let (out_want, state_want) = (out_rec.read(&dev, "gdn recurrent out"), state_rec.read(&dev, "gdn recurrent state"));
    let scan = dev.gdn_scan_form(dk);
    let mut work = Out32::new(&dev, RecurrentShape::chunked_workspace_len(t, nv, dk, dv));
    let (mut ms, mut work_simt) = (Vec::new(), Vec::new());
    for prep in [PrepForm::Simt, PrepForm::TensorCores] {
        let label = format!("t{t}/nk{nk}/nv{nv}/dk{dk}/dv{dv}/{scan:?}/prep{prep:?}");
        let mut state = Out32::with(&dev, &state0);
        let mut out = Out16::new(&dev, t * nv * dv);
        dev.gdn_chunked_forms(scan, prep, &q, &k, &v, &g_dev, &beta_dev, &mut state.view(), &cu_dev, &slots_dev, &mut out.view(), &mut work.view(), &shape)
            .unwrap();
        check("gdn_chunk_prep_27b.out_vs_recurrent", st, &label, &out.read(&dev, "gdn out"), &out_want, 1e-2);
        check("gdn_chunk_prep_27b.state_vs_recurrent", st, &label, &state.read(&dev, "gdn state"), &state_want, 1e-2);
        let w = work.read(&dev, "gdn chunk workspace");
        match prep {
            PrepForm::Simt => work_simt = w,
            PrepForm::TensorCores => check("gdn_chunk_prep_27b.work_tc_vs_simt", st, &label, &w, &work_simt, 1e-4),
        }
        let mut run = || {
            dev.gdn_chunked_prep_only(prep, &q, &k, &v, &g_dev, &beta_dev, &mut state.view(), &cu_dev, &slots_dev, &mut out.view(), &mut work.view(), &shape)
                .unwrap()
        };
        run();
        dev.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            run();
        }
        dev.synchronize().unwrap();
        ms.push(t0.elapsed().as_secs_f64() / 10.0 * 1e3);
    }
    let (ms_simt, ms_tc) = (ms[0], ms[1]);
    println!("TIMING gdn_chunk_prep 27B shape (48 v heads, 16 k heads, dk=dv=128, 8192 tokens, 1 sequence): simt {ms_simt:.3} ms, tensor-cores {ms_tc:.3} ms per call ({:.2}x)", ms_simt / ms_tc);
    assert!(ms_tc < ms_simt, "tensor-core prep {ms_tc:.3} ms not faster than the SIMT prep {ms_simt:.3} ms");
}

#[test]
fn kv_cache_write_fills_mapped_slots_and_skips_negative_ones() {
    for st in STORAGES {
        let Some(dev) = gpu("kv_cache_write", st) else { return };
        let mut rng = Rng::new(11);
        // 10 new tokens at positions 20..30 of a sequence whose 4 blocks of 8 are scattered.
        let (t, hk, d, bs, start) = (10, 2, 64, 8, 20);
        let (row, stride, n_slots) = (hk * d, 3 * hk * d, 8 * bs);
        let kv = rounded(&rng.vec(t * stride, -1.0, 1.0), st);
        let kv_dev = upload(&dev, &kv);
        let table: Vec<i32> = rng.permutation(8)[..4].iter().map(|&b| b as i32).collect();
        let mut slots: Vec<i64> = (start..start + t)
            .map(|p| (table[p / bs] as usize * bs + p % bs) as i64)
            .collect();
        slots[4] = -1;
        let k0 = rounded(&rng.vec(n_slots * row, -1.0, 1.0), st);
        let v0 = rounded(&rng.vec(n_slots * row, -1.0, 1.0), st);
        let (mut kc, mut vc) = (Out16::with(&dev, &k0), Out16::with(&dev, &v0));
        dev.kv_cache_write(&kv_dev, &kv_dev.slice(row..), &mut kc.view(), &mut vc.view(), &upload_raw(&dev, &slots), row, stride, stride)
            .unwrap();
        let (mut k_want, mut v_want) = (k0.clone(), v0.clone());
        for (i, &s) in slots.iter().enumerate() {
            if s >= 0 {
                let (k_row, v_row) = (&kv[i * stride..i * stride + row], &kv[i * stride + row..i * stride + 2 * row]);
                reference::write_kv(&mut k_want, &mut v_want, k_row, v_row, &table, start + i, hk, d, bs);
            }
        }
        check("kv_cache_write.k", st, "t10", &kc.read(&dev, "k cache"), &k_want, 0.0);
        check("kv_cache_write.v", st, "t10", &vc.read(&dev, "v cache"), &v_want, 0.0);
    }
}

/// Decode's fused RoPE + KV cache write (`rope_kv_write`) must leave q, k and both caches
/// exactly as `rope_neox` followed by `kv_cache_write` leave them, in both layouts of
/// AttnCtx::run: q and k in their own buffers (models with q/k norm, v read from the projection)
/// and q, k, v packed in the qkv projection rows (keys right after the queries, where one
/// rope_neox launch rotates both, or after the output gate, two launches). Partial rotary, a
/// rope attn_scale, GQA and MHA, head sizes 64..256, and a negative slot (padding row) that
/// must leave the caches untouched.
#[test]
fn rope_kv_write_equals_rope_then_kv_cache_write_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("rope_kv_write", st) else { return };
        let mut rng = Rng::new(31);
        // (tokens, q heads, kv heads, head_dim, rotary_dim, packed, output gate)
        let cases = [
            (1, 32, 8, 128, 128, false, false),
            (1, 32, 8, 128, 128, true, false),
            (5, 16, 2, 256, 64, true, true),
            (3, 8, 8, 64, 64, false, false),
            (4, 8, 2, 128, 32, true, false),
            (1, 40, 8, 128, 128, true, true),
            (6, 4, 1, 256, 256, false, false),
            // Prefill lengths: rope_neox's threads then loop over groups of several heads.
            (1500, 8, 2, 128, 128, true, false),
            (1200, 24, 4, 256, 64, true, true),
            (700, 16, 4, 128, 128, false, false),
        ];
        for (t, hq, hk, d, rot, packed, gate) in cases {
            let (qd, kvd) = (hq * d, hk * d);
            let k_off = if gate { 2 * qd } else { qd };
            let (v_off, width) = (k_off + kvd, k_off + 2 * kvd);
            let inv_freq: Vec<f32> = (0..rot / 2).map(|i| 500_000f32.powf(-(2.0 * i as f32) / rot as f32)).collect();
            let freq = upload_raw(&dev, &inv_freq);
            let pos = upload_raw(&dev, &(0..t).map(|_| rng.below(9000) as i32).collect::<Vec<_>>());
            let n_slots = (16 * 8).max(t);
            let mut slots: Vec<i64> = rng.permutation(n_slots)[..t].iter().map(|&x| x as i64).collect();
            if t > 2 {
                slots[1] = -1;
            }
            let sl = upload_raw(&dev, &slots);
            let proj = rounded(&rng.vec(t * width, -2.0, 2.0), st);
            let (qn, kn) = (rounded(&rng.vec(t * qd, -2.0, 2.0), st), rounded(&rng.vec(t * kvd, -2.0, 2.0), st));
            let (k0, v0) = (rounded(&rng.vec(n_slots * kvd, -1.0, 1.0), st), rounded(&rng.vec(n_slots * kvd, -1.0, 1.0), st));
            let scale = 1.25;
            let label = format!("t{t}/hq{hq}/hk{hk}/d{d}/rot{rot}/packed{}/gate{}", packed as u8, gate as u8);
            // [proj, q, k, k cache, v cache] for the two kernels, then for the fused one.
            let outs = || [&proj, &qn, &kn, &k0, &v0].map(|init| Out16::with(&dev, init));
            let (mut two, mut one) = (outs(), outs());
            let mut dummy = Out16::new(&dev, 1);
            {
                let [p, q, k, kc, vc] = &mut two;
                let (mut kc, mut vc) = (kc.view(), vc.view());
                if packed {
                    let mut pv = p.view();
                    if gate {
                        dev.rope_neox(&mut pv, &mut dummy.view(), &pos, &freq, hq, 0, d, width, 0, scale).unwrap();
                        dev.rope_neox(&mut pv.slice_mut(k_off..), &mut dummy.view(), &pos, &freq, hk, 0, d, width, 0, scale).unwrap();
                    } else {
                        dev.rope_neox(&mut pv, &mut dummy.view(), &pos, &freq, hq + hk, 0, d, width, 0, scale).unwrap();
                    }
                    dev.kv_cache_write(&pv.slice(k_off..), &pv.slice(v_off..), &mut kc, &mut vc, &sl, kvd, width, width).unwrap();
                } else {
                    let mut kv = k.view();
                    dev.rope_neox(&mut q.view(), &mut kv, &pos, &freq, hq, hk, d, qd, kvd, scale).unwrap();
                    dev.kv_cache_write(&kv, &p.view().slice(v_off..), &mut kc, &mut vc, &sl, kvd, kvd, width).unwrap();
                }
            }
            {
                let [p, q, k, kc, vc] = &mut one;
                let (mut kc, mut vc) = (kc.view(), vc.view());
                let shape = |q_stride, k_stride| RopeKvShape { n_q_heads: hq, n_kv_heads: hk, head_dim: d, q_stride, k_stride, v_stride: width, attn_scale: scale };
                if packed {
                    dev.rope_kv_write_packed(&mut p.view(), k_off, v_off, &mut kc, &mut vc, &pos, &sl, &freq, &shape(width, width)).unwrap();
                } else {
                    let pv = p.view();
                    dev.rope_kv_write(&mut q.view(), &mut k.view(), &pv.slice(v_off..), &mut kc, &mut vc, &pos, &sl, &freq, &shape(qd, kvd)).unwrap();
                }
            }
            for (i, what) in ["proj", "q", "k", "k cache", "v cache"].iter().enumerate() {
                let (want, got) = (two[i].read(&dev, what), one[i].read(&dev, what));
                assert_bitwise(&got, &want, &format!("rope_kv_write {st:?} {label} {what}"));
            }
            // The fused kernel did write: the cached rows differ from the initial cache.
            let kc = one[3].read(&dev, "k cache");
            let s0 = slots[0] as usize * kvd;
            assert!(kc[s0..s0 + kvd] != k0[s0..s0 + kvd], "rope_kv_write {st:?} {label}: slot {} not written", slots[0]);
            println!("PARITY op=rope_kv_write storage={} shape={label} bitwise=1", st.name());
        }
    }
}

#[test]
fn causal_conv1d_carries_state_across_decode_and_prefill() {
    for st in STORAGES {
        let Some(dev) = gpu("conv1d", st) else { return };
        let mut rng = Rng::new(12);
        for (lens, k, with_bias) in [(vec![1, 1, 1], 4, true), (vec![5, 1, 13], 4, false), (vec![7, 2], 3, true), (vec![4], 2, true)] {
            let c = 200;
            let n_slots = 6;
            let slots: Vec<i32> = [4, 0, 2][..lens.len()].to_vec();
            let t: usize = lens.iter().sum();
            let stride = c + 24;
            let x = rounded(&rng.vec(t * stride, -2.0, 2.0), st);
            let w = rounded(&rng.vec(c * k, -1.0, 1.0), st);
            let bias = rounded(&rng.vec(c, -0.5, 0.5), st);
            let state0 = rounded(&rng.vec(n_slots * (k - 1) * c, -2.0, 2.0), st);
            let mut cu = vec![0i32];
            for l in &lens {
                cu.push(cu.last().unwrap() + *l as i32);
            }
            let mut state = Out16::with(&dev, &state0);
            let mut out = Out16::new(&dev, t * c);
            let bias_dev = upload(&dev, &bias);
            let shape = ConvShape { n_tokens: t, channels: c, x_stride: stride, kernel_size: k, n_slots };
            dev.causal_conv1d(
                &upload(&dev, &x),
                &mut state.view(),
                &upload(&dev, &w),
                if with_bias { Some(&bias_dev) } else { None },
                &upload_raw(&dev, &cu),
                &upload_raw(&dev, &slots),
                &mut out.view(),
                &shape,
            )
            .unwrap();
            let mut state_want = state0.clone();
            let mut out_want = Vec::new();
            for (s, &slot) in slots.iter().enumerate() {
                let (a, b) = (cu[s] as usize, cu[s + 1] as usize);
                let xs: Vec<f32> = (a..b).flat_map(|i| x[i * stride..i * stride + c].to_vec()).collect();
                let sl = slot as usize * (k - 1) * c;
                let mut st_slot = state_want[sl..sl + (k - 1) * c].to_vec();
                out_want.extend(reference::conv1d_seq(&xs, &mut st_slot, &w, with_bias.then_some(&bias[..]), b - a, c, k));
                state_want[sl..sl + (k - 1) * c].copy_from_slice(&rounded(&st_slot, st));
            }
            let label = format!("lens{lens:?}/k{k}/bias{}", with_bias as u8).replace(' ', "");
            check("conv1d.out", st, &label, &out.read(&dev, "conv out"), &out_want, tol16(st));
            check("conv1d.state", st, &label, &state.read(&dev, "conv state"), &state_want, 0.0);
        }
    }
}

/// The tiled prefill conv (parallel over time, state written by a second kernel) gives the
/// bytes of the per-sequence kernel, outputs and state: token tiles of 32 that start inside a
/// sequence, hold several sequences or cross their ends, sequences shorter than the kernel's
/// history (state partly old), empty ones, and a 4k-token prompt over 10240 channels (the
/// 27B shape's conv dim). Both are also checked against the CPU op.
#[test]
fn causal_conv1d_tiled_equals_per_sequence_bit_for_bit() {
    use ninfer_core::backend::cuda::ops::ConvPath;
    for st in STORAGES {
        let Some(dev) = gpu("conv1d_tiled", st) else { return };
        let mut rng = Rng::new(21);
        let cases: [(Vec<usize>, usize, usize, bool); 8] = [
            (vec![100, 1, 0, 2, 37], 4, 200, true),
            (vec![33], 4, 130, false),
            (vec![1, 1, 31, 64, 2], 3, 64, true),
            (vec![0, 70, 0], 2, 96, false),
            (vec![2, 2, 2, 2, 2, 2, 2, 2], 4, 300, true),
            (vec![31, 1, 32, 1], 4, 128, false),
            (vec![1, 1, 1], 4, 200, true),
            (vec![4096], 4, 10240, false),
        ];
        for (lens, k, c, with_bias) in cases {
            let n_slots = lens.len() + 3;
            let slots: Vec<i32> = rng.permutation(n_slots)[..lens.len()].iter().map(|&v| v as i32).collect();
            let t: usize = lens.iter().sum();
            let stride = c + 8;
            let x = rounded(&rng.vec(t * stride, -2.0, 2.0), st);
            let w = rounded(&rng.vec(c * k, -1.0, 1.0), st);
            let bias = rounded(&rng.vec(c, -0.5, 0.5), st);
            let state0 = rounded(&rng.vec(n_slots * (k - 1) * c, -2.0, 2.0), st);
            let mut cu = vec![0i32];
            for l in &lens {
                cu.push(cu.last().unwrap() + *l as i32);
            }
            let (x_dev, w_dev, bias_dev) = (upload(&dev, &x), upload(&dev, &w), upload(&dev, &bias));
            let (cu_dev, slots_dev) = (upload_raw(&dev, &cu), upload_raw(&dev, &slots));
            let shape = ConvShape { n_tokens: t, channels: c, x_stride: stride, kernel_size: k, n_slots };
            let run = |path: ConvPath| {
                let mut state = Out16::with(&dev, &state0);
                let mut out = Out16::new(&dev, t * c);
                let b = if with_bias { Some(&bias_dev as &dyn ninfer_core::backend::cuda::ops::DevicePtrDyn) } else { None };
                dev.causal_conv1d_via(path, &x_dev, &mut state.view(), &w_dev, b, &cu_dev, &slots_dev, &mut out.view(), &shape)
                    .unwrap();
                (out.read(&dev, "conv out"), state.read(&dev, "conv state"))
            };
            let (out_seq, state_seq) = run(ConvPath::PerSequence);
            let (out_tiled, state_tiled) = run(ConvPath::Tiled);
            let label = format!("{:?} lens{lens:?}/k{k}/c{c}/bias{}", st, with_bias as u8).replace(' ', "");
            assert_bitwise(&out_tiled, &out_seq, &format!("conv1d tiled out {label}"));
            assert_bitwise(&state_tiled, &state_seq, &format!("conv1d tiled state {label}"));
            let mut state_want = state0.clone();
            let mut out_want = Vec::new();
            for (s, &slot) in slots.iter().enumerate() {
                let (a, b) = (cu[s] as usize, cu[s + 1] as usize);
                let xs: Vec<f32> = (a..b).flat_map(|i| x[i * stride..i * stride + c].to_vec()).collect();
                let sl = slot as usize * (k - 1) * c;
                let mut st_slot = state_want[sl..sl + (k - 1) * c].to_vec();
                out_want.extend(reference::conv1d_seq(&xs, &mut st_slot, &w, with_bias.then_some(&bias[..]), b - a, c, k));
                state_want[sl..sl + (k - 1) * c].copy_from_slice(&rounded(&st_slot, st));
            }
            check("conv1d_tiled.out", st, &label, &out_tiled, &out_want, tol16(st));
            check("conv1d_tiled.state", st, &label, &state_tiled, &state_want, 0.0);
            if t >= 4096 {
                // The point of the tiled form: a long prompt no longer walks time in one thread.
                let mut state = Out16::with(&dev, &state0);
                let mut out = Out16::new(&dev, t * c);
                let b = if with_bias { Some(&bias_dev as &dyn ninfer_core::backend::cuda::ops::DevicePtrDyn) } else { None };
                let mut time = |path: ConvPath| {
                    let mut launch = || {
                        dev.causal_conv1d_via(path, &x_dev, &mut state.view(), &w_dev, b, &cu_dev, &slots_dev, &mut out.view(), &shape)
                            .unwrap()
                    };
                    launch();
                    dev.synchronize().unwrap();
                    let t0 = std::time::Instant::now();
                    for _ in 0..10 {
                        launch();
                    }
                    dev.synchronize().unwrap();
                    t0.elapsed().as_secs_f64() / 10.0 * 1e3
                };
                let (ms_seq, ms_tiled) = (time(ConvPath::PerSequence), time(ConvPath::Tiled));
                println!("TIMING conv1d {label}: per-sequence {ms_seq:.3} ms, tiled {ms_tiled:.3} ms per call");
                assert!(ms_tiled < ms_seq, "{label}: tiled {ms_tiled:.3} ms not faster than per-sequence {ms_seq:.3} ms");
            }
        }
    }
}

#[test]
fn gdn_gates_match_softplus_and_sigmoid() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_gates", st) else { return };
        let mut rng = Rng::new(13);
        // Contiguous a / b, and a / b as column ranges of wider rows (the fused GDN input
        // projection's output: b at column off, a at off + h, rows `stride` wide).
        for (t, h, stride, off) in [(7, 8, 8, 0), (5, 48, 16480, 16384), (3, 8, 40, 7)] {
            let wide_a = rounded(&rng.vec((t - 1) * stride + h + off + h, -30.0, 30.0), st);
            let wide_b = rounded(&rng.vec((t - 1) * stride + h + off, -6.0, 6.0), st);
            let pick = |v: &[f32], at: usize| -> Vec<f32> { (0..t).flat_map(|r| v[r * stride + at..r * stride + at + h].to_vec()).collect() };
            let (a, b) = (pick(&wide_a, off + h), pick(&wide_b, off));
            let a_log = rng.vec(h, -1.0, 1.0);
            let dt_bias = rng.vec(h, -1.0, 1.0);
            let (mut g, mut beta) = (Out32::new(&dev, t * h), Out32::new(&dev, t * h));
            let (da, db) = (upload(&dev, &wide_a), upload(&dev, &wide_b));
            dev.gdn_gates(&da.slice(off + h..), &db.slice(off..), stride, &upload_raw(&dev, &a_log), &upload_raw(&dev, &dt_bias), &mut g.view(), &mut beta.view(), t, h)
                .unwrap();
            let g_want: Vec<f32> = (0..t * h)
                .map(|e| -a_log[e % h].exp() * reference::softplus(a[e] + dt_bias[e % h]))
                .collect();
            // beta is rounded to storage, as transformers' b.sigmoid() on a bf16 tensor.
            let beta_want: Vec<f32> = rounded(&b.iter().map(|&x| reference::sigmoid(x)).collect::<Vec<_>>(), st);
            let shape = format!("t{t}h{h}/s{stride}");
            check("gdn_gates.g", st, &shape, &g.read(&dev, "g"), &g_want, TOL32);
            // A storage ulp: the device's expf may put a sigmoid on the other side of a rounding
            // boundary (rounding_points.rs checks the rounding itself, element by element).
            check("gdn_gates.beta", st, &shape, &beta.read(&dev, "beta"), &beta_want, tol16(st));
        }
        // A row stride below the head count would read one token's gates as another's: a typed error.
        let (ab, f) = (upload(&dev, &[0.5; 16]), upload_raw(&dev, &[0.0f32; 8]));
        let (mut g, mut beta) = (Out32::new(&dev, 16), Out32::new(&dev, 16));
        let short = dev.gdn_gates(&ab, &ab, 4, &f, &f, &mut g.view(), &mut beta.view(), 2, 8);
        assert!(matches!(short, Err(NinferError::Device(ref m)) if m.contains("stride 4")), "{short:?}");
    }
}

#[test]
fn gdn_recurrent_rule_matches_reference_and_updates_state() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_recurrent", st) else { return };
        let mut rng = Rng::new(14);
        for (lens, dk, dv) in [(vec![1, 1], 128, 128), (vec![3, 9, 1], 64, 64), (vec![16], 128, 64)] {
            let (nk, nv, n_slots) = (2, 4, 5);
            let slots: Vec<i32> = [3, 0, 4, 1][..lens.len()].to_vec();
            let t: usize = lens.iter().sum();
            let stride = 2 * nk * dk + nv * dv;
            let qkv = rounded(&rng.vec(t * stride, -1.0, 1.0), st);
            let g = rng.vec(t * nv, -2.0, 0.0);
            let beta = rng.vec(t * nv, 0.0, 1.0);
            let state0 = rng.vec(n_slots * nv * dk * dv, -0.1, 0.1);
            let mut cu = vec![0i32];
            for l in &lens {
                cu.push(cu.last().unwrap() + *l as i32);
            }
            let qkv_dev = upload(&dev, &qkv);
            let mut state = Out32::with(&dev, &state0);
            let mut out = Out16::new(&dev, t * nv * dv);
            let shape = RecurrentShape { n_tokens: t, n_k_heads: nk, n_v_heads: nv, dk, dv, qk_stride: stride, v_stride: stride, n_slots };
            dev.gdn_recurrent(
                &qkv_dev,
                &qkv_dev.slice(nk * dk..),
                &qkv_dev.slice(2 * nk * dk..),
                &upload_raw(&dev, &g),
                &upload_raw(&dev, &beta),
                &mut state.view(),
                &upload_raw(&dev, &cu),
                &upload_raw(&dev, &slots),
                &mut out.view(),
                &shape,
            )
            .unwrap();
            let mut state_want = state0.clone();
            let mut out_want = vec![0.0f32; t * nv * dv];
            for (s, &slot) in slots.iter().enumerate() {
                let toks = cu[s] as usize..cu[s + 1] as usize;
                let cols = |from: usize, len: usize| -> Vec<f32> {
                    toks.clone().flat_map(|i| qkv[i * stride + from..i * stride + from + len].to_vec()).collect()
                };
                let (q, kk, v) = (cols(0, nk * dk), cols(nk * dk, nk * dk), cols(2 * nk * dk, nv * dv));
                let so = slot as usize * nv * dk * dv;
                let o = reference::gdn_recurrent_seq(
                    &q,
                    &kk,
                    &v,
                    &g[toks.start * nv..toks.end * nv],
                    &beta[toks.start * nv..toks.end * nv],
                    &mut state_want[so..so + nv * dk * dv],
                    toks.len(),
                    nk,
                    nv,
                    dk,
                    dv,
                );
                out_want[toks.start * nv * dv..toks.end * nv * dv].copy_from_slice(&o);
            }
            let label = format!("lens{lens:?}/dk{dk}/dv{dv}").replace(' ', "");
            check("gdn_recurrent.out", st, &label, &out.read(&dev, "gdn out"), &out_want, tol16(st));
            check("gdn_recurrent.state", st, &label, &state.read(&dev, "gdn state"), &state_want, TOL32);
        }
    }
}

#[test]
fn argmax_picks_the_first_maximum_and_logsumexp_matches() {
    let Some(dev) = gpu("argmax", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(15);
    for (rows, vocab) in [(1, 1000), (4, 151_936), (3, 7)] {
        let mut logits = rng.vec(rows * vocab, -10.0, 10.0);
        // Row 0: a tie between two maxima; the lower index must win.
        let (i, j) = (vocab / 3, vocab - 1);
        logits[i] = 20.0;
        logits[j] = 20.0;
        let (mut ids, mut lse) = (OutI32::new(&dev, rows), Out32::new(&dev, rows));
        dev.argmax_logsumexp(&upload_raw(&dev, &logits), &mut ids.view(), &mut lse.view(), rows, vocab).unwrap();
        let got_ids = ids.read(&dev, "argmax ids");
        let mut want_lse = Vec::new();
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut best = 0;
            for (c, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = c;
                }
            }
            assert_eq!(got_ids[r], best as i32, "row {r} of {rows}x{vocab}");
            let mx = row[best] as f64;
            want_lse.push((mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln()) as f32);
        }
        assert_eq!(got_ids[0], i as i32, "ties go to the lowest index");
        check("logsumexp", StorageDType::Bf16, &format!("{rows}x{vocab}"), &lse.read(&dev, "lse"), &want_lse, TOL32);
    }
}

#[test]
fn arena_regions_are_aligned_disjoint_and_bounded() {
    use cudarc::driver::DevicePtr;
    use ninfer_core::backend::cuda::arena::{ActivationArena, ARENA_ALIGN};
    let Some(dev) = gpu("arena", StorageDType::Bf16) else { return };
    let mut arena = ActivationArena::new(&dev, 1 << 20).unwrap();
    {
        let mut regions = arena.regions::<u16>(&dev, &[100, 1000, 3]).unwrap();
        let ptrs: Vec<u64> = regions.iter().map(|r| r.device_ptr(dev.stream()).0).collect();
        assert!(ptrs.iter().all(|p| p % ARENA_ALIGN as u64 == 0));
        assert!(ptrs[0] + 200 <= ptrs[1] && ptrs[1] + 2000 <= ptrs[2]);
        let x = upload(&dev, &vec![3.0; 100]);
        let w = upload(&dev, &vec![1.0; 100]);
        dev.rmsnorm(&x, &w, &mut *regions[0], 1, 100, 100, 100, 0.0, false).unwrap();
        dev.synchronize().unwrap();
        let back = from_bits(&dev.stream().clone_dtoh(&*regions[0]).unwrap(), dev.storage());
        assert!(back.iter().all(|&v| (v - 1.0).abs() < 1e-2), "{back:?}");
    }
    assert!(matches!(arena.regions::<f32>(&dev, &[1 << 20]), Err(NinferError::OutOfMemory { .. })));
}

/// A decode-attention timing case: `batch` sequences of `ctx` keys each over contiguous block
/// tables (block size 16), every token at its last position, random q and K/V, and as many
/// distinct K/V cache pairs as pass `min_bytes` (at least one): a timing loop that reads the
/// next pair each call keeps L2 (50 MB on an H200) from holding a call's K/V from an earlier
/// call, as in the model, where a layer's weights pass between two calls.
struct AttnTimingCase {
    caches: Vec<(CudaSlice<u16>, CudaSlice<u16>)>,
    tables: CudaSlice<i32>,
    seq: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    q: CudaSlice<u16>,
    out: CudaSlice<u16>,
    shape: PagedAttentionShape,
    /// K and V bytes one call reads.
    kv_bytes: usize,
}

impl AttnTimingCase {
    fn new(dev: &CudaDevice, (hq, hk, d): (usize, usize, usize), batch: usize, ctx: usize, min_bytes: usize) -> Self {
        let bs = 16;
        let blocks_per = ctx.div_ceil(bs);
        let num_blocks = batch * blocks_per;
        let n = num_blocks * bs * hk * d;
        let kv_bytes = 2 * batch * ctx * hk * d * 2;
        let mut rng = Rng::new(23);
        // Distinct buffers (their contents may repeat: L2 keeps addresses, not values).
        let (kh, vh) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
        let copies = min_bytes.div_ceil(kv_bytes).max(1);
        let caches = (0..copies).map(|_| (upload(dev, &kh), upload(dev, &vh))).collect();
        AttnTimingCase {
            caches,
            tables: upload_raw(dev, &(0..num_blocks as i32).collect::<Vec<_>>()),
            seq: upload_raw(dev, &(0..batch as i32).collect::<Vec<_>>()),
            pos: upload_raw(dev, &vec![ctx as i32 - 1; batch]),
            q: upload(dev, &rng.vec(batch * hq * d, -1.0, 1.0)),
            out: dev.stream().alloc_zeros::<u16>(batch * hq * d).unwrap(),
            shape: PagedAttentionShape {
                n_q_heads: hq,
                n_kv_heads: hk,
                head_dim: d,
                q_stride: hq * d,
                block_size: bs,
                num_blocks,
                max_blocks_per_seq: blocks_per,
                scale: 1.0 / (d as f32).sqrt(),
                max_context: ctx,
                partition: 0,
            },
            kv_bytes,
        }
    }

    /// Milliseconds a call of `call(case, k_cache, v_cache, out)` over `iters` calls, each on
    /// the next cache pair.
    fn time(&mut self, dev: &CudaDevice, iters: usize, mut call: impl FnMut(&Self, &CudaSlice<u16>, &CudaSlice<u16>, &mut CudaSlice<u16>)) -> f64 {
        let mut out = std::mem::replace(&mut self.out, dev.stream().alloc_zeros::<u16>(1).unwrap());
        let mut i = 0;
        let t = time_ms(dev, iters, || {
            let (kc, vc) = &self.caches[i % self.caches.len()];
            i += 1;
            call(self, kc, vc, &mut out);
        });
        self.out = out;
        t
    }
}

/// Mean milliseconds of `f` over `iters` runs after 3 warm-ups, timed with CUDA events.
/// The pace check of the memory-bound prefill kernels: times a device-to-device copy that reads
/// and writes `moved` bytes in all (half each way), prints `what`'s TIMING line against it and
/// asserts that `ms` is at most `max_ratio` times the copy.
fn assert_copy_pace(dev: &CudaDevice, what: &str, ms: f64, moved: usize, max_ratio: f64) {
    let s = dev.stream().clone();
    let src = s.alloc_zeros::<u16>(moved / 4).unwrap();
    let mut dst = s.alloc_zeros::<u16>(moved / 4).unwrap();
    let copy = time_ms(dev, 20, || s.memcpy_dtod(&src, &mut dst).unwrap());
    println!(
        "TIMING {what}: {:.1} us, copy of the same bytes {:.1} us ({:.2}x), {:.0} GB/s read + written",
        ms * 1e3,
        copy * 1e3,
        ms / copy,
        moved as f64 / ms / 1e6
    );
    assert!(ms <= max_ratio * copy, "{what}: {ms:.4} ms against a copy of its bytes {copy:.4} ms (bound {max_ratio}x)");
}

fn time_ms(dev: &CudaDevice, iters: usize, mut f: impl FnMut()) -> f64 {
    use cudarc::driver::sys::CUevent_flags;
    for _ in 0..3 {
        f();
    }
    let start = dev.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    let end = dev.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    start.record(dev.stream()).unwrap();
    for _ in 0..iters {
        f();
    }
    end.record(dev.stream()).unwrap();
    end.synchronize().unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / iters as f64
}

/// Throughput report (run with --ignored on the GPU): decode GEMV bandwidth against a
/// device-to-device copy of the same bytes, GEMM TFLOP/s, and split-K decode attention.
#[test]
#[ignore]
fn report_decode_op_throughput() {
    let Some(dev) = gpu("throughput", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    let (n, k) = (14336, 4096);
    let w = s.alloc_zeros::<u16>(n * k).unwrap();
    let mut w2 = s.alloc_zeros::<u16>(n * k).unwrap();
    let bytes = (n * k * 2) as f64;
    let copy = time_ms(&dev, 20, || s.memcpy_dtod(&w, &mut w2).unwrap());
    println!("PERF op=copy bytes={bytes} ms={copy:.4} GBps={:.0}", 2.0 * bytes / copy / 1e6);
    for m in [1, 2, 4, 8] {
        let x = s.alloc_zeros::<u16>(m * k).unwrap();
        let mut y = s.alloc_zeros::<u16>(m * n).unwrap();
        let t = time_ms(&dev, 20, || dev.gemv(&x, &w, &mut y, m, n, k).unwrap());
        let gbps = bytes / t / 1e6;
        println!("PERF op=gemv m={m} n={n} k={k} ms={t:.4} GBps={gbps:.0} frac_of_copy_read={:.2}", t.recip() * copy / 2.0);
        let tg = time_ms(&dev, 20, || dev.gemm(&x, &w, &mut y, m, n, k).unwrap());
        println!("PERF op=cublas_small_m m={m} ms={tg:.4} GBps={:.0}", bytes / tg / 1e6);
    }
    // The two GEMV forms against cuBLAS: weight read rate of the tensor-core GEMV (the route on
    // sm_80+), the SIMT GEMV and cuBLAS, at the 8B gate/up shape for M = 1, 2, 4, 8, and at M = 1
    // for a 4096 x 4096 projection and the 8B lm_head (128256 x 4096, f32 logits).
    for (m, n, k, f32_out) in [(1, 14336, 4096, false), (2, 14336, 4096, false), (4, 14336, 4096, false), (8, 14336, 4096, false), (1, 4096, 4096, false), (1, 128256, 4096, true)] {
        let w = s.alloc_zeros::<u16>(n * k).unwrap();
        let x = s.alloc_zeros::<u16>(m * k).unwrap();
        let wbytes = (n * k * 2) as f64;
        let time = |form: Option<GemvForm>| {
            if f32_out {
                let mut y = s.alloc_zeros::<f32>(m * n).unwrap();
                match form {
                    Some(form) => time_ms(&dev, 20, || dev.gemv_f32_out_with(form, &x, &w, &mut y, m, n, k).unwrap()),
                    None => time_ms(&dev, 20, || dev.gemm_f32_out(&x, &w, &mut y, m, n, k).unwrap()),
                }
            } else {
                let mut y = s.alloc_zeros::<u16>(m * n).unwrap();
                match form {
                    Some(form) => time_ms(&dev, 20, || dev.gemv_with(form, &x, &w, &mut y, m, n, k).unwrap()),
                    None => time_ms(&dev, 20, || dev.gemm(&x, &w, &mut y, m, n, k).unwrap()),
                }
            }
        };
        let (tc, simt, cublas) = (time(Some(GemvForm::TensorCores)), time(Some(GemvForm::Simt)), time(None));
        println!(
            "PERF op=gemv_forms m={m} n={n} k={k} out={} tc_GBps={:.0} simt_GBps={:.0} cublas_GBps={:.0} tc_over_simt={:.3} tc_frac_of_copy_read={:.2}",
            if f32_out { "f32" } else { "storage" },
            wbytes / tc / 1e6,
            wbytes / simt / 1e6,
            wbytes / cublas / 1e6,
            simt / tc,
            (wbytes / tc) / (2.0 * bytes / copy)
        );
    }
    // The decode MLP's gate_up projection (Llama-3-8B: 2 x 14336 x 4096): the GEMV into
    // [m, 2 * 14336] then swiglu, against the GEMV with SwiGLU in its epilogue.
    let inter = n;
    let wgu = s.alloc_zeros::<u16>(2 * inter * k).unwrap();
    for m in [1, 2, 4, 8] {
        let x = s.alloc_zeros::<u16>(m * k).unwrap();
        let mut gu = s.alloc_zeros::<u16>(m * 2 * inter).unwrap();
        let mut act = s.alloc_zeros::<u16>(m * inter).unwrap();
        let unfused = time_ms(&dev, 20, || {
            dev.gemv(&x, &wgu, &mut gu, m, 2 * inter, k).unwrap();
            dev.swiglu(&gu, &gu.slice(inter..), &mut act, m, inter, 2 * inter, 2 * inter).unwrap();
        });
        let fused = time_ms(&dev, 20, || dev.gemv_gateup_swiglu(&x, &wgu, &mut act, m, inter, k).unwrap());
        println!("PERF op=gate_up m={m} n={} k={k} gemv_swiglu_ms={unfused:.4} fused_ms={fused:.4} GBps={:.0}", 2 * inter, 2.0 * bytes / fused / 1e6);
    }
    let m = 4096;
    let x = s.alloc_zeros::<u16>(m * k).unwrap();
    let mut y = s.alloc_zeros::<u16>(m * n).unwrap();
    let t = time_ms(&dev, 10, || dev.gemm(&x, &w, &mut y, m, n, k).unwrap());
    println!("PERF op=gemm m={m} n={n} k={k} ms={t:.4} TFLOPs={:.0}", 2.0 * (m * n * k) as f64 / t / 1e9);

    for (batch, ctx) in [(1, 4096), (32, 2048), (1, 32768)] {
        let mut case = AttnTimingCase::new(&dev, (32, 8, 128), batch, ctx, 0);
        let t = case.time(&dev, 20, |c, kc, vc, out| dev.paged_attention(&c.q, kc, vc, &c.tables, &c.seq, &c.pos, out, &c.shape).unwrap());
        println!("PERF op=attention_decode batch={batch} ctx={ctx} ms={t:.4} kv_GBps={:.0}", case.kv_bytes as f64 / t / 1e6);
    }
}
