//! Quantized projections in the CPU model: a `Linear` of dense and packed row blocks with an
//! output order equals the dense matmul of the values its blocks decode to, on both the decode
//! (few rows) and the prefill (many rows) path; `--quantize` keeps the step invariants; a backend
//! that cannot run a format refuses the load naming the tensor, the format and the device.

use safetensors::tensor::{Dtype, TensorView};

use super::quant_load::refuse_unsupported;
use super::tests::{max_rel, seq, write_hybrid};
use super::weights::{Linear, Part};
use crate::backend::cpu::matmul::linear;
use crate::model::test_checkpoint::centered_noise;
use crate::model::*;
use crate::quant::{self, QuantFormat, QuantLinear, QuantWeight, QuantizeMode};

fn packed(name: &str, f: QuantFormat, n: usize, k: usize, seed: u64) -> (QuantLinear, Vec<f32>) {
    let values = centered_noise(n * k, seed);
    let data = quant::quantize(f, name, &values, [n, k]).unwrap();
    let w = QuantWeight::packed(name, f, [n, k], data);
    let deq = quant::dequantize(&w.view()).unwrap();
    (QuantLinear::new(w).unwrap(), deq)
}

#[test]
fn mixed_blocks_with_an_output_order_equal_the_dense_matmul_of_their_values() {
    let k = 96;
    let dense_a = centered_noise(5 * k, 1);
    let (q, q_values) = packed("q", QuantFormat::Q4G64F16S, 70, k, 2);
    let dense_b = centered_noise(3 * k, 3);
    let n = 5 + 70 + 3;
    let order: Vec<u32> = (0..n as u32).map(|j| (j * 7 + 3) % n as u32).collect();
    let bias = centered_noise(n, 4);
    let l = Linear { parts: vec![Part::Dense(dense_a.clone()), Part::Quant(q), Part::Dense(dense_b.clone())], order: Some(order.clone()), b: Some(bias.clone()), n, k };
    let computed: Vec<f32> = [dense_a, q_values, dense_b].concat();
    let mut w = vec![0f32; n * k];
    for (j, &src) in order.iter().enumerate() {
        w[j * k..(j + 1) * k].copy_from_slice(&computed[src as usize * k..(src as usize + 1) * k]);
    }
    for rows in [1usize, 3, 20] {
        let x = centered_noise(rows * k, 5 + rows as u64);
        let mut want = vec![0f32; rows * n];
        linear(&x, rows, k, &w, n, Some(&bias), &mut want);
        let mut got = vec![0f32; rows * n];
        l.forward(&x, rows, &mut got);
        assert!(max_rel(&got, &want) < 1e-5, "rows {rows}: rel err {}", max_rel(&got, &want));
    }
}

/// `--quantize q4` on the hybrid checkpoint (Qwen3.5 layout: the gated q_proj keeps its
/// checkpoint row order): chunked prefill and token-by-token decode (the GEMV path) equal one
/// whole-prompt forward (the tiled prefill path), and the logits are not the dense model's.
#[test]
fn quantized_model_keeps_chunked_prefill_and_decode_equal_to_the_whole_prompt() {
    let dir = write_hybrid("quant_chunks", Dtype::F32, false);
    let opts = |quantize| LoadOptions { device: "cpu".into(), num_threads: Some(2), logits_dtype: LogitsDtype::Float32, quantize, ..Default::default() };
    let prompt: Vec<u32> = vec![3, 17, 99, 4, 56, 23, 8, 71, 100, 0, 42, 5, 64];
    let table: Vec<u32> = vec![7, 2, 9, 30];
    let mut dense = CpuModel::load(&dir, &opts(None)).unwrap();
    dense.allocate_caches(32, 4, 4).unwrap();
    let dense_logits = dense.forward(&StepBatch { seqs: vec![seq(&prompt, 0, &table, 0, LogitsWanted::All)] }).unwrap().data;
    let mut m = CpuModel::load(&dir, &opts(Some(QuantizeMode::Q4))).unwrap();
    m.allocate_caches(32, 4, 4).unwrap();
    assert!(m.cache_spec().weight_bytes < dense.cache_spec().weight_bytes);
    let full = m.forward(&StepBatch { seqs: vec![seq(&prompt, 0, &table, 0, LogitsWanted::All)] }).unwrap().data;
    let mut got = Vec::new();
    let mut pos = 0;
    for len in [9usize, 1, 1, 1, 1] {
        got.extend(m.forward(&StepBatch { seqs: vec![seq(&prompt[pos..pos + len], pos, &table, 1, LogitsWanted::All)] }).unwrap().data);
        pos += len;
    }
    assert!(max_rel(&got, &full) < 1e-4, "rel err {}", max_rel(&got, &full));
    assert!(max_rel(&full, &dense_logits) > 1e-3, "q4 weights changed nothing");
}

#[test]
fn a_backend_that_cannot_run_a_format_refuses_naming_tensor_format_and_device() {
    let dir = write_hybrid("quant_refuse", Dtype::F32, false);
    let q4 = LoadOptions { quantize: Some(QuantizeMode::Q4), ..Default::default() };
    let e = refuse_unsupported(&dir, &q4, "cuda:0", |_| false).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("model.layers.0.mlp.down_proj.weight") && e.contains("Q4G64_F16S") && e.contains("cannot run yet"), "{e}");
    assert!(refuse_unsupported(&dir, &q4, "cuda:0", |f| f == QuantFormat::Q4G64F16S).is_ok());
    assert!(refuse_unsupported(&dir, &LoadOptions::default(), "cuda:0", |_| false).is_ok());
    // An AWQ checkpoint, found by its packed tensor without reading any weight.
    let awq = std::env::temp_dir().join(format!("ninfer_quant_awq_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&awq);
    std::fs::create_dir_all(&awq).unwrap();
    let cfg = serde_json::json!({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}});
    std::fs::write(awq.join("config.json"), cfg.to_string()).unwrap();
    let bytes = vec![0u8; 16 * 2 * 4];
    let views = vec![("model.layers.3.mlp.up_proj.qweight".to_string(), TensorView::new(Dtype::I32, vec![16, 2], &bytes).unwrap())];
    safetensors::tensor::serialize_to_file(views, None, &awq.join("model.safetensors")).unwrap();
    let e = refuse_unsupported(&awq, &LoadOptions::default(), "cuda:1", |_| false).unwrap_err().to_string();
    assert!(e.contains("cuda:1") && e.contains("model.layers.3.mlp.up_proj.qweight") && e.contains("HF_AWQ4"), "{e}");
    #[cfg(feature = "cuda")]
    assert!(crate::model::CudaModel::supports(QuantFormat::Q4G64F16S) && crate::model::CudaModel::supports(QuantFormat::Nvfp4));
}
