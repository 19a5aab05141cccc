//! The plan against what the loaders hold and the engine allocates.

use std::path::PathBuf;

use ::safetensors::tensor::{Dtype, TensorView};

use super::*;
use crate::config::ModelConfig;
use crate::engine::EngineConfig;
use crate::model::cpu::CpuModel;
use crate::model::test_checkpoint::{centered_noise, mtp_tensor_shapes, tensor_shapes, TinyDims};
use crate::model::{LoadOptions, ModelRunner};
use crate::quant::QuantizeMode;
use crate::spec::{SpecConfig, SpecMethod};

/// A tiny bf16 Qwen3.5 checkpoint (2 GDN layers, 1 attention layer, conv bias), with an MTP head
/// when `mtp`.
fn checkpoint(tag: &str, mtp: bool) -> PathBuf {
    checkpoint_of(tag, mtp, TinyDims { h: 32, v: 70, inter: 64, nh: 4, nkv: 2, hd: 8, nk: 2, nv: 4, kd: 8, vd: 8, kern: 4 })
}

/// `checkpoint` with the sizes `d`.
fn checkpoint_of(tag: &str, mtp: bool, d: TinyDims) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ninfer_plan_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let types = ["linear_attention", "full_attention", "linear_attention"];
    let cfg = serde_json::json!({"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": d.h, "intermediate_size": d.inter,
        "num_hidden_layers": 3, "num_attention_heads": d.nh, "num_key_value_heads": d.nkv, "head_dim": d.hd, "vocab_size": d.v,
        "layer_types": types, "linear_num_key_heads": d.nk, "linear_num_value_heads": d.nv, "linear_key_head_dim": d.kd,
        "linear_value_head_dim": d.vd, "linear_conv_kernel_dim": d.kern, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "mtp_num_hidden_layers": usize::from(mtp)});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut t = tensor_shapes(&d, "model", &types, true, true);
    if mtp {
        t.extend(mtp_tensor_shapes(&d));
    }
    let bufs: Vec<Vec<u8>> = t
        .iter()
        .enumerate()
        .map(|(i, (_, s))| centered_noise(s.iter().product(), i as u64 + 5).iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = t.iter().zip(&bufs).map(|((n, s), b)| (n.clone(), TensorView::new(Dtype::BF16, s.clone(), b).unwrap())).collect();
    ::safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

fn input<'a>(cfg: &'a ModelConfig, tensors: &'a [PlannedTensor], target: Target, engine: EngineConfig) -> PlanInput<'a> {
    PlanInput { cfg, tensors, target, engine, quantize: None, quantize_lm_head: false, memory: None, pool: PoolRule::PerSequence }
}

#[test]
fn cpu_plan_counts_the_bytes_and_caches_the_cpu_backend_holds() {
    for mtp in [false, true] {
        let dir = checkpoint(if mtp { "cpu_mtp" } else { "cpu" }, mtp);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let store = crate::artifact::WeightStore::open(&dir).unwrap();
        let tensors = model_tensors(&cfg, Some(&store)).unwrap();
        assert_eq!(tensors.iter().any(|t| t.mtp), mtp);
        let mut model = CpuModel::load(&dir, &LoadOptions { device: "cpu".into(), num_threads: Some(1), ..Default::default() }).unwrap();
        let engine = if mtp { EngineConfig { spec: Some(SpecConfig { method: SpecMethod::Mtp, draft_tokens: 2, adaptive: false, lm_head_draft: None, drafter: None }), ..Default::default() } } else { EngineConfig::default() };
        if mtp {
            model.enable_mtp().unwrap();
        }
        let p = plan(&input(&cfg, &tensors, Target::Cpu, engine)).unwrap();
        assert_eq!(p.spec, model.cache_spec(), "mtp {mtp}");
        assert_eq!(p.weights, vec![WeightLine { format: "F32".into(), tensors: tensors.len(), bytes: model.cache_spec().weight_bytes as u64 }]);
    }
}

#[test]
fn a_config_only_directory_plans_the_same_tensors_as_its_checkpoint() {
    let dir = checkpoint("config_only", true);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = crate::artifact::WeightStore::open(&dir).unwrap();
    let with = model_tensors(&cfg, Some(&store)).unwrap();
    let without = model_tensors(&cfg, None).unwrap();
    // The config cannot tell the optional conv bias; everything else is the same list.
    let no_bias: Vec<_> = with.iter().filter(|t| !t.name.ends_with("conv1d.bias")).cloned().collect();
    assert_eq!(no_bias, without);
    // A header that disagrees with the config is refused as the loader refuses it.
    let mut wrong = cfg.clone();
    wrong.intermediate_size += 1;
    let e = model_tensors(&wrong, Some(&store)).unwrap_err().to_string();
    assert!(e.contains("gate_proj") && e.contains("65"), "{e}");
}

#[test]
fn quantized_projections_keep_the_head_and_embedding_dense_unless_asked() {
    let dir = checkpoint("quant", false);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let nvfp4 = QuantFormat::parse("nvfp4").unwrap();
    // NVFP4 tiles rows by 128 and columns by 64: no matrix of h = 32 can be held, so all stay
    // dense.
    let mut i = input(&cfg, &tensors, Target::Gpu, EngineConfig::default());
    i.quantize = Some(nvfp4);
    assert!(plan(&i).unwrap().weights.iter().all(|w| w.format != "NVFP4"));
    let w8 = QuantFormat::parse("w8").unwrap();
    i.quantize = Some(w8);
    let p = plan(&i).unwrap();
    let by = |name: &str| p.weights.iter().find(|w| w.format == name).map_or(0, |w| w.bytes);
    let mut matrices = 0;
    let mut dense = 0;
    let mut f32s = 0;
    // W8G32_F16S pads each row to whole 128-value tiles (4 groups of 32): the code plane (one
    // byte a value) aligned to 256 bytes, then an f16 scale per group. A fused projection
    // (q|k|v, gate|up) is one matrix on the GPU: its rows are counted together.
    let w8_bytes = |rows: u64, cols: u64| {
        let groups = rows * cols.div_ceil(128) * 4;
        (groups * 32).div_ceil(256) * 256 + groups * 2
    };
    let mut fused: Option<(u64, u64)> = None;
    for t in &tensors {
        match t.role {
            Role::Matrix => {
                let (rows, cols) = (t.shape[0] as u64, t.shape[1] as u64);
                match fused.as_mut() {
                    Some((r, _)) if t.fused => *r += rows,
                    _ => {
                        if let Some((r, c)) = fused.replace((rows, cols)) {
                            matrices += w8_bytes(r, c);
                        }
                    }
                }
            }
            Role::DenseF32 => f32s += 4 * t.numel(),
            _ => dense += 2 * t.numel(),
        }
    }
    matrices += fused.map_or(0, |(r, c)| w8_bytes(r, c));
    assert!(tensors.iter().any(|t| t.fused), "the model has fused projections");
    assert_eq!((by("W8G32_F16S"), by("BF16"), by("F32")), (matrices, dense, f32s));
    i.quantize_lm_head = true;
    let head = plan(&i).unwrap();
    // The untied head, [70, 32]; the embedding stays dense (the step reads its rows).
    let embed = |rows: u64| (rows * 4 * 32).div_ceil(256) * 256 + rows * 4 * 2;
    assert_eq!(head.weights.iter().find(|w| w.format == "W8G32_F16S").unwrap().bytes, matrices + embed(70));
    assert_eq!(head.weights.iter().find(|w| w.format == "BF16").unwrap().bytes, dense - 2 * 70 * 32);
}

#[test]
fn cpu_quantize_plan_counts_the_bytes_the_cpu_loader_packs() {
    // 128-row gate/up, q_proj and GDN qkv over h = 64: NVFP4 holds those, the rest stay f32.
    let d = TinyDims { h: 64, v: 70, inter: 128, nh: 4, nkv: 2, hd: 16, nk: 2, nv: 4, kd: 16, vd: 16, kern: 4 };
    let dir = checkpoint_of("cpu_quant", true, d);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = crate::artifact::WeightStore::open(&dir).unwrap();
    let tensors = model_tensors(&cfg, Some(&store)).unwrap();
    for mode in crate::quant::QUANTIZE_MODES {
        for head in [false, true] {
            let opts = LoadOptions { device: "cpu".into(), num_threads: Some(1), quantize: Some(QuantizeMode::parse(mode).unwrap()), quantize_lm_head: head, ..Default::default() };
            let model = CpuModel::load(&dir, &opts).unwrap();
            let mut i = input(&cfg, &tensors, Target::Cpu, EngineConfig::default());
            i.quantize = Some(QuantFormat::parse(mode).unwrap());
            i.quantize_lm_head = head;
            let p = plan(&i).unwrap();
            let what = format!("--quantize {mode} (lm head {head})");
            assert_eq!(p.ledger.weight_bytes as usize, model.cache_spec().weight_bytes, "{what}: {:?}", p.weights);
            let format = i.quantize.unwrap().name();
            let line = p.weights.iter().find(|w| w.format == format).unwrap_or_else(|| panic!("{what}: {:?}", p.weights));
            // The MTP head is loaded on the CPU: its matrices are quantized too.
            let matrices = tensors.iter().filter(|t| t.role == Role::Matrix).count();
            let held = if mode == "nvfp4" { tensors.iter().filter(|t| t.role == Role::Matrix && t.shape[0] % 128 == 0 && t.shape[1] % 64 == 0).count() } else { matrices + usize::from(head) };
            assert!(held > 0 && (mode != "nvfp4" || held < matrices), "{what}");
            assert_eq!(line.tensors, held, "{what}");
            // The quantized gated q_proj of the model's and the head's attention layers keeps an output order.
            assert_eq!(p.weights.iter().find(|w| w.format == "U32").map(|w| w.tensors), Some(2), "{what}");
        }
    }
}

#[test]
fn the_verdict_says_how_many_bytes_are_short_and_what_fits() {
    let dir = checkpoint("fit", false);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let engine = EngineConfig { max_context: Some(256), max_concurrency: 4, ..Default::default() };
    let base = plan(&input(&cfg, &tensors, Target::Cpu, engine.clone())).unwrap();
    // Every sequence gets a full context; state slots: 4 running + 1 score + 4 snapshots.
    assert_eq!(base.config.kv_capacity_tokens, 1024);
    assert_eq!(base.ledger.kv_bytes, 1024 * base.spec.kv_bytes_per_token as u64);
    assert_eq!(base.ledger.state_slots, 9);
    assert_eq!(base.needed_bytes, base.ledger.weight_bytes + base.ledger.kv_bytes + base.ledger.state_bytes + base.ledger.workspace_bytes);
    let short = 1000;
    let mut i = input(&cfg, &tensors, Target::Cpu, engine);
    i.memory = Some(DeviceMemory { free: base.needed_bytes - short, total: 1 << 40, cuda: None });
    let p = plan(&i).unwrap();
    let f = p.fit.clone().unwrap();
    assert!(!f.fits && f.short == short);
    assert!(f.largest_context < 256 && f.largest_context > 0 && f.largest_concurrency == 3, "{f:?}");
    // Each suggestion fits, one more does not.
    let at = |c: usize, ctx: usize| {
        let e = EngineConfig { max_context: Some(ctx), max_concurrency: c, ..Default::default() };
        plan(&PlanInput { memory: None, ..input(&cfg, &tensors, Target::Cpu, e) }).unwrap().needed_bytes
    };
    assert!(at(4, f.largest_context) <= base.needed_bytes - short && at(4, f.largest_context + 1) > base.needed_bytes - short);
    assert!(at(3, 256) <= base.needed_bytes - short);
    let hint = p.fit_hint();
    assert!(hint.contains(&format!("--max-context {}", f.largest_context)) && hint.contains("--max-concurrency 3"), "{hint}");
    i.memory = Some(DeviceMemory { free: base.needed_bytes, total: 1 << 40, cuda: None });
    assert!(plan(&i).unwrap().fit.unwrap().fits);
    i.memory = Some(DeviceMemory { free: 10, total: 1 << 40, cuda: None });
    assert!(plan(&i).unwrap().fit_hint().contains("nothing fits"));
}

#[test]
fn the_startup_check_refuses_before_loading_what_cannot_fit() {
    let dir = checkpoint("startup", false);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    // The host has room for a tiny model: the plan is returned, one full context of KV.
    let p = check_startup(&dir, &cfg, "cpu", &EngineConfig { max_concurrency: 8, ..Default::default() }, (None, false)).unwrap();
    assert_eq!(p.config.kv_capacity_tokens, 256);
    // With --quantize the weights are counted as the load will pack them.
    let q4 = check_startup(&dir, &cfg, "cpu", &EngineConfig::default(), (Some(QuantizeMode::Q4), true)).unwrap();
    let opts = LoadOptions { device: "cpu".into(), num_threads: Some(1), quantize: Some(QuantizeMode::Q4), quantize_lm_head: true, ..Default::default() };
    assert_eq!(q4.ledger.weight_bytes as usize, CpuModel::load(&dir, &opts).unwrap().cache_spec().weight_bytes);
    assert!(q4.weights.iter().any(|w| w.format == "Q4G64_F16S") && q4.ledger.weight_bytes < p.ledger.weight_bytes);
    // A pool larger than any host is refused with the bytes and the settings that fit.
    let e = check_startup(&dir, &cfg, "cpu", &EngineConfig { kv_capacity_tokens: Some(1 << 40), ..Default::default() }, (None, false)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, crate::NinferError::OutOfMemory { .. }) && msg.contains("before loading") && msg.contains("--max-context"), "{msg}");
    // The largest --kv-capacity that fits is named, and fits.
    let kv: usize = msg.split("at most --kv-capacity ").nth(1).and_then(|t| t.split(' ').next()).and_then(|n| n.parse().ok()).expect(&msg);
    let host = host_available_bytes().unwrap();
    let at = |kv| {
        let e = EngineConfig { kv_capacity_tokens: Some(kv), ..Default::default() };
        let tensors = model_tensors(&cfg, None).unwrap();
        let with_bias = model_tensors(&cfg, Some(&crate::artifact::WeightStore::open(&dir).unwrap())).unwrap();
        assert!(with_bias.len() > tensors.len());
        plan(&PlanInput { pool: PoolRule::OneContext, ..input(&cfg, &with_bias, Target::Cpu, e) }).unwrap().needed_bytes
    };
    // The host's free memory moves between the two reads: allow it a little slack.
    assert!(at(kv) <= host.free + (64 << 20) && at(kv + 1 + (1 << 20)) > host.free.saturating_sub(64 << 20), "{kv}");
}

/// Sizes the CUDA kernels take (head_dim 64, GDN key head dim 64, value head dim a multiple of
/// 32) and NVFP4 holds in part (rows a multiple of 128, K of 64).
fn cuda_dims() -> TinyDims {
    TinyDims { h: 128, v: 70, inter: 256, nh: 2, nkv: 1, hd: 64, nk: 1, nv: 2, kd: 64, vd: 32, kern: 4 }
}

fn gpu_input<'a>(cfg: &'a ModelConfig, tensors: &'a [PlannedTensor], quantize: Option<&str>, engine: EngineConfig) -> PlanInput<'a> {
    PlanInput { quantize: quantize.map(|q| QuantFormat::parse(q).unwrap()), ..input(cfg, tensors, Target::Gpu, engine) }
}

fn mtp_engine() -> EngineConfig {
    EngineConfig { spec: Some(SpecConfig::new("mtp", None).unwrap()), ..Default::default() }
}

#[test]
fn a_gpu_plan_refuses_a_quantized_shape_the_cuda_kernels_cannot_run() {
    // down_proj's K = 68 is not a multiple of 8: the GPU kernels cannot decode it packed.
    let d = TinyDims { inter: 68, ..cuda_dims() };
    let dir = checkpoint_of("k_mod_8", false, d);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let e = plan(&gpu_input(&cfg, &tensors, Some("w8"), EngineConfig::default())).unwrap_err().to_string();
    assert!(e.contains("layers.0.mlp.down_proj.weight") && e.contains("W8G32_F16S") && e.contains("K = 68") && e.contains("CUDA"), "{e}");
    // Dense on the GPU, or quantized on the CPU, it plans.
    assert!(plan(&gpu_input(&cfg, &tensors, None, EngineConfig::default())).is_ok());
    assert!(plan(&PlanInput { quantize: Some(QuantFormat::parse("w8").unwrap()), ..input(&cfg, &tensors, Target::Cpu, EngineConfig::default()) }).is_ok());
    // The loader refuses it with the same words, before reading any weight (its plan pass).
    #[cfg(feature = "cuda")]
    {
        use crate::model::cuda::load::{check_load, QuantLoad};
        let store = crate::artifact::WeightStore::open(&dir).unwrap();
        let quant = QuantLoad::quantize(Some(crate::quant::QuantFormat::W8G32F16S));
        let loader = check_load(&cfg, Some(&store), &quant, false, None).err().expect("refused").to_string();
        assert!(loader.contains("down_proj") && loader.contains("W8G32_F16S") && loader.contains("K = 68"), "{loader}");
    }
}

#[test]
fn a_gpu_plan_with_spec_mtp_refuses_a_head_of_two_layers() {
    let dir = checkpoint_of("two_mtp", true, cuda_dims());
    let mut cfg = ModelConfig::from_dir(&dir).unwrap();
    cfg.mtp_num_layers = 2;
    let tensors = model_tensors(&cfg, None).unwrap();
    let e = plan(&gpu_input(&cfg, &tensors, None, mtp_engine())).unwrap_err().to_string();
    assert!(e.contains("2 MTP layers"), "{e}");
    // Without --spec mtp the head is not loaded on a GPU.
    assert!(plan(&gpu_input(&cfg, &tensors, None, EngineConfig::default())).is_ok());
}

/// The plan's GPU figures are the CUDA loader's own plan pass (`check_load`, no device): the
/// weights for every `--quantize` mode, with and without the LM head and the MTP head, and the
/// dequantization workspace; the loader's refusals of the configuration come through it.
#[cfg(feature = "cuda")]
#[test]
fn the_gpu_plan_counts_what_the_cuda_loader_plans_and_refuses_what_it_refuses() {
    use crate::model::cuda::load::{check_load, QuantLoad};
    let dir = checkpoint_of("cuda_loader", true, cuda_dims());
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = crate::artifact::WeightStore::open(&dir).unwrap();
    let tensors = model_tensors(&cfg, Some(&store)).unwrap();
    for mode in std::iter::once(None).chain(crate::quant::QUANTIZE_MODES.map(Some)) {
        for head in [false, mode.is_some()] {
            for mtp in [false, true] {
                let engine = if mtp { mtp_engine() } else { EngineConfig::default() };
                let i = PlanInput { quantize_lm_head: head, ..gpu_input(&cfg, &tensors, mode, engine) };
                let quant = QuantLoad { quantize_lm_head: head, ..QuantLoad::quantize(mode.map(|m| QuantizeMode::parse(m).unwrap().format())) };
                let loader = check_load(&cfg, Some(&store), &quant, mtp, None).unwrap();
                let what = format!("--quantize {mode:?} (lm head {head}, mtp {mtp})");
                assert_eq!(crate::plan::ledger::weight_lines(&i).unwrap().1, loader.bytes as u64, "{what}");
                assert_eq!(crate::plan::ledger::quant_workspace_bytes(&i), 2 * loader.quant_elems as u64, "{what}");
                check_gpu_load(&dir, Some(&store), &i).unwrap();
            }
        }
    }
    // The kernels' head_dim: refused by the plan as by the load, config.json alone or not.
    let small = checkpoint("cuda_head_dim", false);
    let cfg = ModelConfig::from_dir(&small).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let e = check_gpu_load(&small, None, &gpu_input(&cfg, &tensors, None, EngineConfig::default())).unwrap_err().to_string();
    assert!(e.contains("head_dim 8") && e.contains("CUDA"), "{e}");
}

/// `checkpoint_of(cuda_dims())` with its MLP projections stored as HF block FP8 (128 x 128
/// blocks, every code 1.0) of block scales `scale`.
#[cfg(feature = "cuda")]
fn hf_fp8_checkpoint(tag: &str, scale: f32) -> PathBuf {
    let dir = checkpoint_of(tag, false, cuda_dims());
    let store = crate::artifact::WeightStore::open(&dir).unwrap();
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in store.names() {
        let (info, bytes) = store.stored(name).unwrap();
        if name.contains(".mlp.") && name.ends_with("_proj.weight") {
            let (n, k) = (info.shape[0], info.shape[1]);
            out.push((name.to_string(), Dtype::F8_E4M3, info.shape.clone(), vec![0x38; n * k]));
            let blocks = [n.div_ceil(128), k.div_ceil(128)];
            out.push((format!("{name}_scale_inv"), Dtype::F32, blocks.to_vec(), scale.to_le_bytes().repeat(blocks[0] * blocks[1])));
        } else {
            out.push((name.to_string(), Dtype::BF16, info.shape.clone(), bytes.to_vec()));
        }
    }
    drop(store);
    let views: Vec<(String, TensorView)> = out.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    ::safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// A plan for an sm_7x device (f16 storage) refuses, as its load would, a stored FP8 weight
/// whose scales let values exceed binary16's range; sm_80 (bf16) and `--gpu-memory` (no
/// architecture) plan it, and scales within range plan everywhere.
#[cfg(feature = "cuda")]
#[test]
fn a_plan_for_an_f16_storage_gpu_refuses_fp8_weights_whose_scales_exceed_binary16() {
    let memory = |cc: Option<(u32, u32)>| Some(DeviceMemory { free: 1 << 40, total: 1 << 40, cuda: cc.map(|compute_capability| CudaArch { ordinal: 0, compute_capability }) });
    // 448 x 200 = 89600 > 65504.
    for (scale, wide) in [(1.0f32, false), (200.0, true)] {
        let dir = hf_fp8_checkpoint(if wide { "fp8_wide" } else { "fp8_narrow" }, scale);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let store = crate::artifact::WeightStore::open(&dir).unwrap();
        let tensors = checkpoint_tensors(&dir, &cfg, Some(&store)).unwrap();
        let base = gpu_input(&cfg, &tensors, None, EngineConfig::default());
        let v100 = check_gpu_load(&dir, Some(&store), &PlanInput { memory: memory(Some((7, 0))), ..base.clone() });
        if wide {
            let e = v100.unwrap_err().to_string();
            assert!(e.contains("layers.0.mlp.gate_proj.weight") && e.contains("FP8") && e.contains("8.96e4") && e.contains("f16 storage") && e.contains("cuda:0 (compute capability 7.0)"), "{e}");
        } else {
            v100.unwrap();
        }
        for cc in [Some((8, 0)), None] {
            check_gpu_load(&dir, Some(&store), &PlanInput { memory: memory(cc), ..base.clone() }).unwrap_or_else(|e| panic!("{cc:?}: {e}"));
        }
    }
}

#[test]
fn fp8_weights_on_fp8_tensor_core_shapes_count_the_cublaslt_workspace() {
    use crate::plan::gpu::LT_WORKSPACE_BYTES;
    use crate::plan::ledger::{lt_workspace_bytes, quant_workspace_bytes, workspace_estimate};
    let dir = checkpoint_of("lt", false, cuda_dims());
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let fp8 = gpu_input(&cfg, &tensors, Some("fp8"), EngineConfig::default());
    assert_eq!(lt_workspace_bytes(&fp8), LT_WORKSPACE_BYTES as u64);
    let p = plan(&fp8).unwrap();
    // The workspace line: step buffers (256 rows: the model's 256-token context caps the
    // 512-token chunk), the dequantization workspace and cuBLASLt's.
    assert_eq!(p.ledger.workspace_bytes, workspace_estimate(&cfg, Target::Gpu, 256, 64, None) + quant_workspace_bytes(&fp8) + (32 << 20));
    // Other formats, the CPU, and shapes cuBLASLt's FP8 GEMM cannot take (K = 72) have none.
    assert_eq!(lt_workspace_bytes(&gpu_input(&cfg, &tensors, Some("q4"), EngineConfig::default())), 0);
    assert_eq!(lt_workspace_bytes(&PlanInput { target: Target::Cpu, ..fp8.clone() }), 0);
    let odd = checkpoint_of("lt_odd", false, TinyDims { h: 72, inter: 136, ..cuda_dims() });
    let cfg = ModelConfig::from_dir(&odd).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let i = gpu_input(&cfg, &tensors, Some("fp8"), EngineConfig::default());
    assert_eq!(lt_workspace_bytes(&i), 0);
    // Its LM head [70, 72] does not fit either; a quantized LM head of [vocab 80, 128] would.
    assert_eq!(lt_workspace_bytes(&PlanInput { quantize_lm_head: true, ..i }), 0);
}

/// `--quantize nvfp4` counts the cuBLASLt workspace of the FP4 route wherever a part's shape
/// takes it, unless the plan names a device older than sm_100; shapes NVFP4 cannot hold (K =
/// 72: no part is packed) count none.
#[test]
fn nvfp4_parts_count_the_cublaslt_workspace_unless_the_device_has_no_fp4_tensor_cores() {
    use crate::plan::gpu::LT_WORKSPACE_BYTES;
    use crate::plan::ledger::lt_workspace_bytes;
    use crate::plan::memory::{CudaArch, DeviceMemory};
    let dir = checkpoint_of("lt_nvfp4", false, cuda_dims());
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let nvfp4 = gpu_input(&cfg, &tensors, Some("nvfp4"), EngineConfig::default());
    assert_eq!(lt_workspace_bytes(&nvfp4), LT_WORKSPACE_BYTES as u64, "no device named");
    let on = |cc: (u32, u32)| PlanInput { memory: Some(DeviceMemory { free: 80 << 30, total: 80 << 30, cuda: Some(CudaArch { ordinal: 0, compute_capability: cc }) }), ..nvfp4.clone() };
    assert_eq!(lt_workspace_bytes(&on((10, 0))), LT_WORKSPACE_BYTES as u64);
    assert_eq!(lt_workspace_bytes(&on((12, 0))), LT_WORKSPACE_BYTES as u64);
    assert_eq!(lt_workspace_bytes(&on((9, 0))), 0, "an H100 dequantizes NVFP4 for prefill");
    assert_eq!(lt_workspace_bytes(&PlanInput { target: Target::Cpu, ..nvfp4.clone() }), 0);
    let odd = checkpoint_of("lt_nvfp4_odd", false, TinyDims { h: 72, inter: 136, ..cuda_dims() });
    let cfg = ModelConfig::from_dir(&odd).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    assert_eq!(lt_workspace_bytes(&gpu_input(&cfg, &tensors, Some("nvfp4"), EngineConfig::default())), 0);
}

/// A checkpoint's HF block FP8 projections of 128 x 128 blocks count the cuBLASLt workspace of
/// their block-scaled route where a fused shape's N and K are multiples of 16; other block
/// sizes (the dequantize route) and shapes cuBLASLt cannot take (K = 72) count none.
#[test]
fn stored_hf_block_fp8_weights_count_the_cublaslt_workspace() {
    use crate::plan::gpu::LT_WORKSPACE_BYTES;
    use crate::plan::inventory::StoredQuant;
    use crate::plan::ledger::lt_workspace_bytes;
    let stored = |tensors: &[PlannedTensor], block: usize| -> Vec<PlannedTensor> {
        let format = crate::quant::QuantFormat::HfFp8Block { block_n: block, block_k: block };
        tensors.iter().cloned().map(|mut t| {
            if t.role == Role::Matrix {
                t.stored = Some(StoredQuant { format, bytes: t.numel(), g_idx_bytes: 0 });
            }
            t
        }).collect()
    };
    let dir = checkpoint_of("lt_hf_fp8", false, cuda_dims());
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    assert_eq!(lt_workspace_bytes(&gpu_input(&cfg, &tensors, None, EngineConfig::default())), 0, "a dense checkpoint");
    let b128 = stored(&tensors, 128);
    assert_eq!(lt_workspace_bytes(&gpu_input(&cfg, &b128, None, EngineConfig::default())), LT_WORKSPACE_BYTES as u64);
    assert_eq!(lt_workspace_bytes(&PlanInput { target: Target::Cpu, ..gpu_input(&cfg, &b128, None, EngineConfig::default()) }), 0);
    let b64 = stored(&tensors, 64);
    assert_eq!(lt_workspace_bytes(&gpu_input(&cfg, &b64, None, EngineConfig::default())), 0, "64 x 64 blocks dequantize");
    let odd = checkpoint_of("lt_hf_fp8_odd", false, TinyDims { h: 72, inter: 136, ..cuda_dims() });
    let cfg = ModelConfig::from_dir(&odd).unwrap();
    let tensors = stored(&model_tensors(&cfg, None).unwrap(), 128);
    assert_eq!(lt_workspace_bytes(&gpu_input(&cfg, &tensors, None, EngineConfig::default())), 0);
}

#[test]
fn speculation_counts_the_largest_verify_step_and_its_logits() {
    use crate::plan::ledger::workspace_estimate;
    // 4 sequences of up to 8 drafts in a 256-token step: a uniform verify step of 9 tokens a
    // sequence runs 4 sequences padded to 8, 72 rows; 36 rows want logits, padded 72 wins.
    let pad = |n: usize| n.next_power_of_two().max(8);
    assert_eq!(verify_rows(256, 4, 8, pad), (72, 72));
    // 64 sequences: the budget caps a step of 7-token chunks at 36 sequences, padded to 64:
    // 448 rows, more than the budget's 256.
    assert_eq!(verify_rows(256, 64, 8, pad), (448, 448));
    assert_eq!(verify_rows(256, 64, 2, pad), (64 * 3, 192));
    // A DFlash block of 16 (15 drafts): uniform steps are at most 9 tokens a sequence (56
    // sequences of 9 in 512, padded to 64: 576 rows); an eager step's logits rows stay
    // within the budget.
    assert_eq!(verify_rows(512, 64, 15, pad), (576, 576));
    assert_eq!(verify_rows(512, 4, 15, |n| n), (36, 64));
    let dir = checkpoint("verify", false);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let tensors = model_tensors(&cfg, None).unwrap();
    let base = EngineConfig { max_concurrency: 4, ..Default::default() };
    let plain = plan(&input(&cfg, &tensors, Target::Gpu, base.clone())).unwrap();
    let ngram = plan(&input(&cfg, &tensors, Target::Gpu, EngineConfig { spec: Some(SpecConfig::new("ngram", Some(2)).unwrap()), ..base })).unwrap();
    // Activations of 256 rows either way; the logits and the sampler's copy of 72 rows (padded
    // to 128) instead of 4 (padded to 8): f32 over the vocabulary of 70.
    assert_eq!(ngram.ledger.workspace_bytes - plain.ledger.workspace_bytes, 2 * (128 - 8) * 70 * 4);
    assert_eq!(ngram.ledger.workspace_bytes, workspace_estimate(&cfg, Target::Gpu, 256, 4, Some(SpecRows { max_drafts: 8, mtp: false })));
    // The MTP head's buffers: its kept hidden rows and its inputs (h) and halves (2h), bf16.
    let with = |mtp| workspace_estimate(&cfg, Target::Gpu, 256, 4, Some(SpecRows { max_drafts: 8, mtp }));
    assert_eq!(with(true) - with(false), (256 + 3 * 256) * 32 * 2);
}
