//! Where batch-1 decode loses bandwidth between kernels: the Llama-3-8B decoder's four weight
//! GEMVs (qkv, o, gate_up with SwiGLU, down) chained over 32 layers of distinct weights, as a
//! decode step launches them (PDL as the device sets it, x of each the output of the one
//! before), against a device-to-device copy and against one GEMV streaming 1 GiB. The gap
//! between the chain's rate and the single launch's, spread over the chain's launches, is
//! what each kernel boundary costs; no attention, norms or host work, so it bounds what
//! removing boundaries (fusion, a persistent kernel) could save. Then each projection's 32
//! weights chained alone: what a boundary costs after a launch of that size. A report
//! (--ignored, GPU).

use ninfer_core::backend::cuda::ops::GemvForm;

use super::harness::gpu;
use super::time_ms;
use ninfer_core::backend::cuda::StorageDType;

/// Llama-3-8B: hidden, intermediate, qkv rows, decoder layers.
const HIDDEN: usize = 4096;
const INTER: usize = 14336;
const QKV: usize = 6144;
const LAYERS: usize = 32;

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

    let layers: Vec<[cudarc::driver::CudaSlice<u16>; 4]> = (0..LAYERS)
        .map(|_| {
            [
                s.alloc_zeros::<u16>(QKV * HIDDEN).unwrap(),
                s.alloc_zeros::<u16>(HIDDEN * HIDDEN).unwrap(),
                s.alloc_zeros::<u16>(2 * INTER * HIDDEN).unwrap(),
                s.alloc_zeros::<u16>(HIDDEN * INTER).unwrap(),
            ]
        })
        .collect();
    let bytes = (LAYERS * 2 * (QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER)) as f64;
    let mut hid = s.alloc_zeros::<u16>(HIDDEN).unwrap();
    let mut qkv = s.alloc_zeros::<u16>(QKV).unwrap();
    let mut act = s.alloc_zeros::<u16>(INTER).unwrap();
    let launches = 4 * LAYERS;
    for form in [GemvForm::Simt, GemvForm::TensorCores] {
        let chain_ms = time_ms(&dev, 5, || {
            for [wqkv, wo, wgu, wd] in &layers {
                dev.gemv_with(form, &hid, wqkv, &mut qkv, 1, QKV, HIDDEN).unwrap();
                dev.gemv_with(form, &qkv.slice(0..HIDDEN), wo, &mut hid, 1, HIDDEN, HIDDEN).unwrap();
                dev.gemv_gateup_swiglu_with(form, &hid, wgu, &mut act, 1, INTER, HIDDEN).unwrap();
                dev.gemv_with(form, &act, wd, &mut hid, 1, HIDDEN, INTER).unwrap();
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
        // Per weight shape: the 32 layers' weights of one projection chained alone (x of each
        // launch is the output of the one before where the shapes allow, else a fixed vector),
        // against the same bytes at the single launch's rate: which boundary costs what (a
        // launch of the 8B's o streams 33.5 MB, of gate_up 235 MB).
        let shapes: [(&str, usize, usize, usize); 4] =
            [("qkv", 0, QKV, HIDDEN), ("o", 1, HIDDEN, HIDDEN), ("gate_up_swiglu", 2, INTER, HIDDEN), ("down", 3, HIDDEN, INTER)];
        for (name, idx, n, k) in shapes {
            let shape_bytes = (LAYERS * 2 * k * if idx == 2 { 2 * n } else { n }) as f64;
            let ms = time_ms(&dev, 5, || {
                for l in &layers {
                    match idx {
                        0 => dev.gemv_with(form, &hid, &l[0], &mut qkv, 1, n, k).unwrap(),
                        1 => dev.gemv_with(form, &qkv.slice(0..HIDDEN), &l[1], &mut hid, 1, n, k).unwrap(),
                        2 => dev.gemv_gateup_swiglu_with(form, &hid, &l[2], &mut act, 1, n, k).unwrap(),
                        _ => dev.gemv_with(form, &act, &l[3], &mut hid, 1, n, k).unwrap(),
                    }
                }
            });
            let us = (ms - shape_bytes / single_rate * 1e3) * 1e3 / LAYERS as f64;
            println!(
                "PERF op=gemv_chain_shape form={form:?} shape={name} rows={n} k={k} launches={LAYERS} ms={ms:.4} GBps={:.0} us_per_boundary={us:.2}",
                shape_bytes / (ms * 1e-3) / 1e9
            );
        }
    }
}
