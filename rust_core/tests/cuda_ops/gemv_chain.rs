//! Where batch-1 decode loses bandwidth between kernels: the Llama-3-8B decoder's four weight
//! GEMVs (qkv, o, gate_up with SwiGLU, down) chained over 32 layers of distinct weights, as a
//! decode step launches them (PDL as the device sets it, x of each the output of the one
//! before), against a device-to-device copy and against one GEMV streaming 1 GiB. The gap
//! between the chain's rate and the single launch's, spread over the chain's launches, is
//! what each kernel boundary costs; no attention, norms or host work, so it bounds what
//! removing boundaries (fusion, a persistent kernel) could save. Then each projection's 32
//! weights chained alone: what a boundary costs after a launch of that size. A report
//! (--ignored, GPU).

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::GemvForm;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::harness::gpu;
use super::time_ms;

/// Llama-3-8B: hidden, intermediate, qkv rows, decoder layers.
const HIDDEN: usize = 4096;
const INTER: usize = 14336;
const QKV: usize = 6144;
const LAYERS: usize = 32;

/// The four projections of a decoder layer in launch order: name, weight rows (the fused gate_up
/// weight's 2 x inter), K.
const PROJECTIONS: [(&str, usize, usize); 4] =
    [("qkv", QKV, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up_swiglu", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)];

/// The activations the chain passes along.
struct Acts {
    hid: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    act: CudaSlice<u16>,
}

/// Launches projection `idx` of PROJECTIONS with weight `w`, x the output of the one before it
/// in a layer (o reads the first HIDDEN of qkv's output).
fn project(dev: &CudaDevice, form: GemvForm, idx: usize, w: &CudaSlice<u16>, a: &mut Acts) {
    match idx {
        0 => dev.gemv_with(form, &a.hid, w, &mut a.qkv, 1, QKV, HIDDEN),
        1 => dev.gemv_with(form, &a.qkv.slice(0..HIDDEN), w, &mut a.hid, 1, HIDDEN, HIDDEN),
        2 => dev.gemv_gateup_swiglu_with(form, &a.hid, w, &mut a.act, 1, INTER, HIDDEN),
        _ => dev.gemv_with(form, &a.act, w, &mut a.hid, 1, HIDDEN, INTER),
    }
    .unwrap();
}

#[test]
#[ignore]
fn report_gemv_chain_boundary_cost() {
    let Some(dev) = gpu("gemv_chain", StorageDType::Bf16) else { return };
    let s = dev.stream().clone();
    // Device copy rate (read + write), as gpu_bench.py measures its ceiling.
    let elems = 1usize << 30;
    let a = s.alloc_zeros::<u16>(elems).unwrap();
    let mut b = s.alloc_zeros::<u16>(elems).unwrap();
    let copy_ms = time_ms(&dev, 10, || s.memcpy_dtod(&a, &mut b).unwrap());
    let copy_rate = 2.0 * (elems * 2) as f64 / (copy_ms * 1e-3);
    drop((a, b));

    let layers: Vec<Vec<CudaSlice<u16>>> =
        (0..LAYERS).map(|_| PROJECTIONS.iter().map(|&(_, rows, k)| s.alloc_zeros::<u16>(rows * k).unwrap()).collect()).collect();
    let proj_bytes = |rows: usize, k: usize| (LAYERS * 2 * rows * k) as f64;
    let bytes: f64 = PROJECTIONS.iter().map(|&(_, rows, k)| proj_bytes(rows, k)).sum();
    let mut acts = Acts {
        hid: s.alloc_zeros::<u16>(HIDDEN).unwrap(),
        qkv: s.alloc_zeros::<u16>(QKV).unwrap(),
        act: s.alloc_zeros::<u16>(INTER).unwrap(),
    };
    let launches = PROJECTIONS.len() * LAYERS;
    for form in [GemvForm::Simt, GemvForm::TensorCores] {
        let chain_ms = time_ms(&dev, 5, || {
            for l in &layers {
                for (idx, w) in l.iter().enumerate() {
                    project(&dev, form, idx, w, &mut acts);
                }
            }
        });
        // One launch of 1 GiB of weights (2^19 rows of K 1024: the streaming rate without boundaries).
        let (rows, k) = (1usize << 19, 1024usize);
        let w = s.alloc_zeros::<u16>(rows * k).unwrap();
        let x = s.alloc_zeros::<u16>(k).unwrap();
        let mut y = s.alloc_zeros::<u16>(rows).unwrap();
        let single_ms = time_ms(&dev, 10, || dev.gemv_with(form, &x, &w, &mut y, 1, rows, k).unwrap());
        let single_rate = (rows * k * 2) as f64 / (single_ms * 1e-3);
        let chain_rate = bytes / (chain_ms * 1e-3);
        let per_boundary_us = (chain_ms - bytes / single_rate * 1e3) * 1e3 / launches as f64;
        println!(
            "PERF op=gemv_chain form={form:?} layers={LAYERS} launches={launches} pdl={} ms={chain_ms:.4} GBps={:.0} frac_of_copy={:.3} single_launch_GBps={:.0} single_frac_of_copy={:.3} chain_over_single={:.3} us_per_boundary={per_boundary_us:.2}",
            dev.pdl(),
            chain_rate / 1e9,
            chain_rate / copy_rate,
            single_rate / 1e9,
            single_rate / copy_rate,
            chain_ms / (bytes / single_rate * 1e3),
        );
        assert!(chain_ms > 0.0 && single_ms > 0.0);
        // Per projection: its 32 layers' weights chained alone (x of each launch the output of
        // the one before where the shapes allow, else a fixed vector), against the same bytes at
        // the single launch's rate: which boundary costs what (a launch of the 8B's o streams
        // 33.5 MB, of gate_up 235 MB).
        for (idx, &(name, rows, k)) in PROJECTIONS.iter().enumerate() {
            let ms = time_ms(&dev, 5, || {
                for l in &layers {
                    project(&dev, form, idx, &l[idx], &mut acts);
                }
            });
            let shape_bytes = proj_bytes(rows, k);
            let us = (ms - shape_bytes / single_rate * 1e3) * 1e3 / LAYERS as f64;
            println!(
                "PERF op=gemv_chain_shape form={form:?} shape={name} rows={rows} k={k} launches={LAYERS} ms={ms:.4} GBps={:.0} us_per_boundary={us:.2}",
                shape_bytes / (ms * 1e-3) / 1e9
            );
        }
    }
}
