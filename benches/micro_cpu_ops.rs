//! CPU backend micro benchmarks: the decode GEMV (memory bound, reported in GB/s of weights),
//! the prefill GEMM (GFLOP/s), and, when `NINFER_BENCH_MODEL` names a HF model directory,
//! whole-model decode tok/s at batch 1 and 8.
//!
//! Run: `cargo bench --manifest-path rust_core/Cargo.toml --bench micro_cpu_ops`
//! (`NINFER_BENCH_THREADS` sets the pool size, default all cores).

use std::path::PathBuf;
use std::time::Instant;

use ninfer_core::backend::cpu::matmul::linear;
use ninfer_core::model::{load_model, LoadOptions, LogitsWanted, SeqChunk, StepBatch};

fn time<F: FnMut()>(iters: usize, mut f: F) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() / iters as f64
}

fn main() {
    let threads = std::env::var("NINFER_BENCH_THREADS").ok().and_then(|s| s.parse().ok());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.unwrap_or(0)).build().unwrap();
    println!("threads: {}", pool.current_num_threads());
    pool.install(|| {
        for &(m, k, n) in &[(1usize, 512usize, 32000usize), (1, 512, 1376), (4, 512, 2752), (8, 1376, 512)] {
            let x = vec![0.5f32; m * k];
            let w = vec![0.25f32; n * k];
            let mut out = vec![0f32; m * n];
            let s = time(50, || linear(&x, m, k, &w, n, None, &mut out));
            println!("gemv m={m} k={k} n={n}: {:.3} ms, {:.1} GB/s", s * 1e3, (n * k * 4) as f64 / s / 1e9);
        }
        for &(m, k, n) in &[(128usize, 512usize, 1376usize), (512, 512, 512)] {
            let x = vec![0.5f32; m * k];
            let w = vec![0.25f32; n * k];
            let mut out = vec![0f32; m * n];
            let s = time(10, || linear(&x, m, k, &w, n, None, &mut out));
            println!("gemm m={m} k={k} n={n}: {:.3} ms, {:.1} GFLOP/s", s * 1e3, (2 * m * n * k) as f64 / s / 1e9);
        }
    });
    let Some(dir) = std::env::var_os("NINFER_BENCH_MODEL").map(PathBuf::from) else {
        println!("set NINFER_BENCH_MODEL=<hf dir> for whole-model decode");
        return;
    };
    let mut model = load_model(&dir, &LoadOptions { device: "cpu".into(), num_threads: threads, ..Default::default() }).unwrap();
    let bs = 16;
    let (prompt, steps) = (16usize, 64usize);
    for batch_size in [1usize, 8] {
        let per_seq = (prompt + steps).div_ceil(bs);
        model.allocate_caches(per_seq * batch_size, bs, batch_size).unwrap();
        let tables: Vec<Vec<u32>> = (0..batch_size).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
        let prefill = StepBatch {
            seqs: (0..batch_size)
                .map(|s| SeqChunk { tokens: (0..prompt as u32).map(|t| 3 + t + s as u32).collect(), start_pos: 0, block_table: tables[s].clone(), state_slot: s, logits: LogitsWanted::Last })
                .collect(),
        };
        // The first forward also grows the workspace; time the second (same positions again).
        model.forward(&prefill).unwrap();
        let t0 = Instant::now();
        model.forward(&prefill).unwrap();
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for i in 0..steps {
            let step = StepBatch {
                seqs: (0..batch_size)
                    .map(|s| SeqChunk { tokens: vec![5 + (i as u32 % 50)], start_pos: prompt + i, block_table: tables[s].clone(), state_slot: s, logits: LogitsWanted::Last })
                    .collect(),
            };
            model.forward(&step).unwrap();
        }
        let decode_s = t1.elapsed().as_secs_f64();
        println!(
            "model batch={batch_size}: prefill {:.1} tok/s, decode {:.1} ms/step, {:.1} tok/s",
            (prompt * batch_size) as f64 / prefill_s,
            decode_s / steps as f64 * 1e3,
            (steps * batch_size) as f64 / decode_s
        );
    }
}
