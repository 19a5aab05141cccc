//! Each layer's route against the conditions the step code tested before routes existed: which
//! projections fuse RoPE and SwiGLU, how q and k reach attention, and which GDN kernels a step
//! runs.

use super::*;
use crate::backend::cuda::ops::{gemv_tc_config, GemvKernel, GemvTcConfig};
use crate::model::cuda::linear::{Linear, LinearRoute, WeightFormat};
use crate::model::cuda::weights::DevGdn;

const DEFAULTS: Fusions = Fusions { rope_in_gemv: true, rope_in_attention: true };

fn config(arch: &str, extra: serde_json::Value) -> ModelConfig {
    let mut v = serde_json::json!({"architectures": [arch], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256});
    v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    ModelConfig::from_json_str(&v.to_string(), std::path::Path::new("config.json")).unwrap()
}

/// A `[n, k]` weight whose one-row GEMV runs `m1` (no buffers: routes read shapes only).
fn linear(n: usize, k: usize, bias: bool, m1: GemvKernel) -> Linear<()> {
    Linear { w: (), n, k, format: WeightFormat::Bf16, bias: bias.then_some(()), route: LinearRoute::new(m1, k), quant: None }
}

/// An attention layer of `cfg` as the loader packs it, every weight's one-row GEMV on `m1`.
fn attention_layer(cfg: &ModelConfig, m1: GemvKernel) -> DevLayer<(), ()> {
    let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
    let q_rows = nh * hd * if cfg.attn_output_gate { 2 } else { 1 };
    let norm = cfg.qk_norm.then_some(());
    let a = DevAttention { qkv: linear(q_rows + 2 * nkv * hd, h, cfg.qkv_bias, m1), o: linear(h, nh * hd, cfg.o_bias, m1), q_norm: norm, k_norm: norm };
    mlp_layer(cfg, DevMixer::Attention(Box::new(a)), m1)
}

fn mlp_layer(cfg: &ModelConfig, mixer: DevMixer<(), ()>, m1: GemvKernel) -> DevLayer<(), ()> {
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    DevLayer { input_norm: (), post_norm: (), mixer, gate_up: linear(2 * inter, h, cfg.mlp_bias, m1), down: linear(h, inter, cfg.mlp_bias, m1) }
}

fn attention_route(cfg: &ModelConfig, m1: GemvKernel, fusions: Fusions) -> (AttentionRoute, MlpRoute) {
    let rotary = cfg.rope.rotary_dim(cfg.head_dim);
    let route = LayerRoute::choose(cfg, &attention_layer(cfg, m1), rotary, false, fusions);
    match route.mixer {
        MixerRoute::Attention(a) => (a, route.mlp),
        MixerRoute::Gdn(_) => panic!("an attention layer got a GDN route"),
    }
}

/// A tensor-core GEMV instance.
const TC: GemvKernel = GemvKernel::TensorCores(GemvTcConfig { warps: 4, unroll: 2, hold: false });

#[test]
fn batch_1_decode_fuses_rope_into_a_plain_qkv_gemv_on_cuda_cores_only() {
    let llama = config("LlamaForCausalLM", serde_json::json!({}));
    let (a, mlp) = attention_route(&llama, GemvKernel::CudaCores, DEFAULTS);
    assert_eq!(a, AttentionRoute { query: QueryLayout::Plain, qk: QkRoute::InPlace, rope_in_gemv: true, rope_in_attention: true, flash_prefill: true });
    assert_eq!(mlp, MlpRoute { swiglu_in_gemv: true });
    // The shape's own tensor-core instance, as a device would route it: no fused RoPE.
    let tc = GemvKernel::TensorCores(gemv_tc_config(6144, 4096));
    assert!(!attention_route(&llama, tc, DEFAULTS).0.rope_in_gemv);
    assert!(!attention_route(&llama, TC, DEFAULTS).0.rope_in_gemv);
    assert!(!attention_route(&llama, GemvKernel::CudaCores, Fusions { rope_in_gemv: false, ..DEFAULTS }).0.rope_in_gemv, "the plan's fusion off");
}

#[test]
fn a_bias_a_norm_or_a_partial_rotary_keeps_rope_out_of_the_gemv() {
    let qwen2 = config("Qwen2ForCausalLM", serde_json::json!({}));
    assert!(qwen2.qkv_bias);
    let (a, mlp) = attention_route(&qwen2, GemvKernel::CudaCores, DEFAULTS);
    assert_eq!((a.qk, a.rope_in_gemv), (QkRoute::InPlace, false));
    assert!(mlp.swiglu_in_gemv, "Qwen2's MLP has no bias");

    let qwen3 = config("Qwen3ForCausalLM", serde_json::json!({"head_dim": 128}));
    let (a, _) = attention_route(&qwen3, GemvKernel::CudaCores, DEFAULTS);
    assert_eq!((a.qk, a.rope_in_gemv, a.flash_prefill), (QkRoute::HeadNorm, false, true));

    let partial = config("LlamaForCausalLM", serde_json::json!({"partial_rotary_factor": 0.5}));
    assert!(partial.rope.rotary_dim(partial.head_dim) < partial.head_dim);
    assert!(!attention_route(&partial, GemvKernel::CudaCores, DEFAULTS).0.rope_in_gemv);
}

#[test]
fn a_gated_query_rotates_q_and_k_apart_and_gates_the_output() {
    let mut gated = config("LlamaForCausalLM", serde_json::json!({}));
    gated.attn_output_gate = true;
    let (a, _) = attention_route(&gated, GemvKernel::CudaCores, DEFAULTS);
    assert_eq!((a.query, a.qk, a.rope_in_gemv), (QueryLayout::Gated, QkRoute::InPlace, false));
}

#[test]
fn decode_attention_rotates_and_norms_wherever_its_direct_form_takes_the_heads() {
    let rope_in_attention = |arch: &str, extra: serde_json::Value, fusions: Fusions| attention_route(&config(arch, extra), TC, fusions).0.rope_in_attention;
    let none = serde_json::json!({});
    // Llama-3-8B, its biased and gated forms, Qwen3 (q/k norms), a partial rotary, heads of 64
    // and 256, the Qwen3.5-27B attention shape (gated, normed, 256 dims of which 64 rotate).
    assert!(rope_in_attention("LlamaForCausalLM", none.clone(), DEFAULTS));
    assert!(rope_in_attention("LlamaForCausalLM", serde_json::json!({"attention_bias": true}), DEFAULTS));
    assert!(rope_in_attention("Qwen3ForCausalLM", serde_json::json!({"head_dim": 128}), DEFAULTS));
    assert!(rope_in_attention("LlamaForCausalLM", serde_json::json!({"partial_rotary_factor": 0.5}), DEFAULTS));
    assert!(rope_in_attention("LlamaForCausalLM", serde_json::json!({"num_attention_heads": 64, "num_key_value_heads": 16}), DEFAULTS));
    assert!(rope_in_attention("LlamaForCausalLM", serde_json::json!({"num_attention_heads": 16, "num_key_value_heads": 2}), DEFAULTS));
    let qwen3_5_27b = serde_json::json!({"hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "partial_rotary_factor": 0.25, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4});
    let cfg = config("Qwen3_5ForCausalLM", qwen3_5_27b);
    assert_eq!((cfg.head_dim, cfg.rope.rotary_dim(cfg.head_dim), cfg.attn_output_gate, cfg.qk_norm), (256, 64, true, true));
    let (a, _) = attention_route(&cfg, TC, DEFAULTS);
    assert_eq!((a.query, a.qk, a.rope_in_gemv, a.rope_in_attention), (QueryLayout::Gated, QkRoute::HeadNorm, false, true));
    // Not: heads of 96 (no direct form), groups of 16 q heads, the plan's fusion off.
    assert!(!rope_in_attention("LlamaForCausalLM", serde_json::json!({"hidden_size": 3072, "head_dim": 96}), DEFAULTS));
    assert!(!rope_in_attention("LlamaForCausalLM", serde_json::json!({"num_key_value_heads": 2}), DEFAULTS));
    assert!(!rope_in_attention("LlamaForCausalLM", none, Fusions { rope_in_attention: false, ..DEFAULTS }));
}

/// The flash route of an attention layer of `arch` with `heads` query heads of `head_dim` over
/// one KV head.
fn flash(arch: &str, heads: usize, head_dim: usize) -> bool {
    let cfg = config(arch, serde_json::json!({"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": head_dim}));
    attention_route(&cfg, GemvKernel::CudaCores, DEFAULTS).0.flash_prefill
}

#[test]
fn flash_prefill_needs_the_row_stride_of_the_queries_attention_reads_a_multiple_of_8() {
    // Rotated in place, attention reads the packed q | k | v rows: 6 * 2 + 2 * 2 = 16 columns,
    // 3 * 4 + 2 * 4 = 20.
    assert!(flash("LlamaForCausalLM", 6, 2));
    assert!(!flash("LlamaForCausalLM", 3, 4));
    // With q/k norm it reads the normed queries alone: 4 * 2 = 8 columns (rows of 12), 6 * 2 = 12
    // (rows of 16).
    assert!(flash("Qwen3ForCausalLM", 4, 2));
    assert!(!flash("Qwen3ForCausalLM", 6, 2));
}

#[test]
fn biased_projections_keep_swiglu_and_rope_out_of_the_gemv() {
    let llama = config("LlamaForCausalLM", serde_json::json!({}));
    let (a, mlp) = attention_route(&llama, GemvKernel::CudaCores, DEFAULTS);
    assert!(a.rope_in_gemv && mlp.swiglu_in_gemv);

    let mlp_bias = config("LlamaForCausalLM", serde_json::json!({"mlp_bias": true}));
    let (a, mlp) = attention_route(&mlp_bias, GemvKernel::CudaCores, DEFAULTS);
    assert!(a.rope_in_gemv && !mlp.swiglu_in_gemv);

    let attention_bias = config("LlamaForCausalLM", serde_json::json!({"attention_bias": true}));
    let (a, mlp) = attention_route(&attention_bias, GemvKernel::CudaCores, DEFAULTS);
    assert!(!a.rope_in_gemv && mlp.swiglu_in_gemv);
}

#[test]
fn swiglu_leaves_the_gemv_where_k_is_not_a_multiple_of_8() {
    let narrow = config("LlamaForCausalLM", serde_json::json!({"hidden_size": 12, "num_attention_heads": 3, "num_key_value_heads": 1, "intermediate_size": 16}));
    let (a, mlp) = attention_route(&narrow, GemvKernel::CudaCores, DEFAULTS);
    assert!(!mlp.swiglu_in_gemv);
    assert!(!a.rope_in_gemv, "the fused qkv kernel needs K % 8 == 0 too");
}

fn qwen3_5(value_head_dim: usize) -> ModelConfig {
    config("Qwen3_5ForCausalLM", serde_json::json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": value_head_dim, "linear_conv_kernel_dim": 4}))
}

fn gdn_route(cfg: &ModelConfig, chunked: bool) -> GdnRoute {
    let la = cfg.linear_attention.unwrap();
    let h = cfg.hidden_size;
    let g = DevGdn { in_proj: linear(la.conv_dim() + la.value_dim() + 2 * la.num_value_heads, h, false, TC), conv_w: (), conv_b: None, a_log: (), dt_bias: (), norm: (), out: linear(h, la.value_dim(), false, TC) };
    let layer = mlp_layer(cfg, DevMixer::Gdn(Box::new(g)), TC);
    match LayerRoute::choose(cfg, &layer, cfg.rope.rotary_dim(cfg.head_dim), chunked, DEFAULTS).mixer {
        MixerRoute::Gdn(r) => r,
        MixerRoute::Attention(_) => panic!("a GDN layer got an attention route"),
    }
}

#[test]
fn gdn_steps_run_the_chunked_kernel_from_a_chunk_of_64_tokens_where_the_device_has_it() {
    let cfg = qwen3_5(128);
    let r = gdn_route(&cfg, true);
    assert_eq!((r.chunked, r.gated_recurrent), (true, true));
    assert_eq!(r.kernels(1, 1), GdnKernels::ConvRecurrentGated);
    assert_eq!(r.kernels(GDN_CHUNK - 1, 1), GdnKernels::ConvRecurrentGated);
    assert_eq!(r.kernels(GDN_CHUNK, 1), GdnKernels::Chunked);
    // A device without the chunked kernel's shared memory stays recurrent at every length.
    let r = gdn_route(&cfg, false);
    assert_eq!(r.kernels(4 * GDN_CHUNK, 1), GdnKernels::ConvRecurrentGated);
}

#[test]
fn gdn_steps_of_many_sequences_run_the_conv_apart() {
    let r = gdn_route(&qwen3_5(128), true);
    assert_eq!(r.kernels(1, GDN_FUSED_CONV_MAX_SEQS), GdnKernels::ConvRecurrentGated);
    assert_eq!(r.kernels(1, GDN_FUSED_CONV_MAX_SEQS + 1), GdnKernels::Recurrent);
    assert_eq!(r.kernels(GDN_CHUNK, GDN_FUSED_CONV_MAX_SEQS + 1), GdnKernels::Chunked);
    // Without the chunked kernel a long step of many sequences calls `gdn_chunked`, which runs
    // the recurrent rule itself.
    assert_eq!(gdn_route(&qwen3_5(128), false).kernels(4 * GDN_CHUNK, 64), GdnKernels::Chunked);
}

#[test]
fn gdn_value_heads_past_the_gated_kernel_run_gates_recurrent_and_norm_apart() {
    let r = gdn_route(&qwen3_5(GATED_MAX_DV + 32), true);
    assert!(!r.gated_recurrent);
    assert_eq!(r.kernels(1, 1), GdnKernels::Recurrent);
    assert_eq!(r.kernels(GDN_CHUNK, 1), GdnKernels::Chunked);
    // Without the chunked kernel a long step still calls `gdn_chunked`, which falls back to
    // the recurrent rule itself, as the step did before routes.
    assert_eq!(gdn_route(&qwen3_5(GATED_MAX_DV + 32), false).kernels(GDN_CHUNK, 1), GdnKernels::Chunked);
}

#[test]
fn the_plan_enables_rope_in_attention_where_decode_runs_the_direct_form() {
    use crate::backend::cuda::plan::{DeviceFacts, ModelShape, Plan};
    use crate::config::CudaOptions;
    let plan = |cc: (u32, u32), batch_invariant: bool| {
        let f = DeviceFacts { name: format!("sm_{}{}", cc.0, cc.1), compute_capability: cc, sm_count: 132, smem_optin: 232448, nvrtc_major: 13 };
        Plan::build(&f, ModelShape { hidden_size: Some(4096) }, &CudaOptions { batch_invariant, ..Default::default() }).unwrap()
    };
    for cc in [(8, 0), (8, 9), (9, 0), (12, 0)] {
        assert_eq!(Fusions::of(&plan(cc, false), cc), DEFAULTS, "sm_{}{}", cc.0, cc.1);
        // Batch invariance runs every decode attention in the scaled form.
        assert_eq!(Fusions::of(&plan(cc, true), cc), Fusions { rope_in_gemv: true, rope_in_attention: false });
    }
    // Below sm_80 there is no direct form.
    assert_eq!(Fusions::of(&plan((7, 5), false), (7, 5)), Fusions { rope_in_gemv: true, rope_in_attention: false });
    let mut off = plan((9, 0), false);
    off.fused_rope = false;
    assert_eq!(Fusions::of(&off, (9, 0)), Fusions::NONE);
}
