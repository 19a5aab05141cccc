//! The direct loader's packing against the host layouts of the CPU path (`ModelWeights`, the
//! source of the previous device upload): for tiny checkpoints in bf16 and f32, every packed
//! storage buffer must hold exactly the bits the old upload produced from those layouts.

use std::path::{Path, PathBuf};

use ::safetensors::tensor::{Dtype, TensorView};

use super::*;
use crate::backend::cuda::kernels::StorageDType;
use crate::backend::cuda::transfer::storage_bits_from_f32;
use crate::model::cpu::weights::{LayerWeights, Linear, Mixer, ModelWeights};
use super::super::linear::Linear as DevLinear;
use crate::model::cpu::quant_load::QuantSource;
use crate::model::test_checkpoint::{centered_noise, mtp_tensor_shapes, tensor_shapes, TinyDims};

/// Collects packed tensors into host vectors, filling in uneven pieces so that chunk
/// boundaries fall inside segments. Quantized weights are kept in `quant`; a quantized
/// `Linear`'s placeholder `w` holds its index there.
struct HostSink {
    storage: StorageDType,
    read: bool,
    /// Each weight's row-stacked parts (one payload but for NVFP4).
    quant: Vec<Vec<crate::quant::QuantWeight>>,
    /// The dense tail's storage bits of each of `quant` (empty: none).
    tails: Vec<Vec<u16>>,
}

impl HostSink {
    fn new(storage: StorageDType, read: bool) -> Self {
        HostSink { storage, read, quant: Vec::new(), tails: Vec::new() }
    }
}

impl Sink for HostSink {
    type W = Vec<u16>;
    type F = Vec<f32>;

    fn storage(&mut self, t: &Packed<'_>) -> Result<Vec<u16>> {
        let mut out = vec![0u16; t.numel()];
        let mut first = 0;
        for step in [7usize, 1, 33, 129].iter().cycle() {
            if first == out.len() {
                break;
            }
            let end = (first + step).min(out.len());
            t.fill_serial(first, &mut out[first..end], self.storage, self.read)?;
            first = end;
        }
        let mut whole = vec![0u16; t.numel()];
        t.fill(0, &mut whole, self.storage, self.read)?;
        same(&whole, &out, "chunked fill vs the whole fill");
        Ok(out)
    }

    fn f32(&mut self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(values.to_vec())
    }

    fn format(&self) -> WeightFormat {
        self.storage.into()
    }

    fn route(&self, _n: usize, k: usize) -> LinearRoute {
        LinearRoute::cuda_cores(k)
    }

    fn quant(&mut self, format: crate::quant::QuantFormat, shape: [usize; 2], encode: impl FnOnce() -> Result<Vec<crate::quant::QuantWeight>>, tail: Option<&Packed<'_>>) -> Result<(Vec<u16>, Option<QuantPart>)> {
        let parts = encode()?;
        let tail = match tail {
            Some(t) => self.storage(t)?,
            None => Vec::new(),
        };
        let rows: usize = parts.iter().map(|w| w.shape[0]).sum();
        for w in &parts {
            assert_eq!((w.format, w.shape[1]), (format, shape[1]), "the encoded weight is the one announced");
            crate::quant::validate(&w.view())?;
        }
        assert_eq!(rows + tail.len() / shape[1], shape[0], "the parts and the tail are the announced rows");
        assert!(parts.len() == 1 || format == crate::quant::QuantFormat::Nvfp4, "{format:?}: one payload");
        self.tails.push(tail);
        self.quant.push(parts);
        Ok((vec![(self.quant.len() - 1) as u16], None))
    }
}

fn rand_vec(len: usize, seed: u64) -> Vec<f32> {
    // Away from 0, so that the old path's `(1 + w) - 1` of a zero-centred norm is exact.
    centered_noise(len, seed).iter().map(|x| x * 0.6).map(|x| if x.abs() < 1e-3 { 1e-3 } else { x }).collect()
}

/// A tiny checkpoint of `arch` with every tensor in `dtype`, in two shards.
fn checkpoint(tag: &str, arch: &str, dtype: Dtype) -> PathBuf {
    checkpoint_with(tag, arch, dtype, false)
}

/// As `checkpoint`, with `biased` the projection biases of the architecture: Qwen2's q/k/v,
/// and for Llama `attention_bias` (q/k/v/o) and `mlp_bias` (gate/up/down).
fn checkpoint_with(tag: &str, arch: &str, dtype: Dtype, biased: bool) -> PathBuf {
    checkpoint_full(tag, arch, dtype, biased, false)
}

/// As `checkpoint_with`, with `mtp` a one-layer MTP head (`mtp.*`) declared in the config.
fn checkpoint_full(tag: &str, arch: &str, dtype: Dtype, biased: bool, mtp: bool) -> PathBuf {
    let dims = TinyDims { h: 32, v: 50, inter: 48, nh: 4, nkv: 2, hd: 8, nk: 2, nv: 4, kd: 8, vd: 8, kern: 4 };
    checkpoint_sized(tag, arch, dtype, biased, mtp, dims)
}

/// As `checkpoint_full`, of the sizes `dims`.
fn checkpoint_sized(tag: &str, arch: &str, dtype: Dtype, biased: bool, mtp: bool, dims: TinyDims) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ninfer_cuda_load_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let TinyDims { h, v, inter, nh, nkv, hd, nk, nv: nvh, kd, vd, kern } = dims;
    let qwen = arch == "Qwen3_5ForCausalLM";
    let types = if qwen { vec!["linear_attention", "full_attention", "linear_attention"] } else { vec!["full_attention"; 3] };
    let cfg = serde_json::json!({"architectures": [arch], "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": 3, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": v,
        "layer_types": types, "linear_num_key_heads": nk, "linear_num_value_heads": nvh, "linear_key_head_dim": kd,
        "linear_value_head_dim": vd, "linear_conv_kernel_dim": kern, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "attention_bias": biased, "mlp_bias": biased, "mtp_num_hidden_layers": if mtp { 1 } else { 0 }});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let prefix = if qwen { "model.language_model" } else { "model" };
    let mut t = tensor_shapes(&dims, prefix, &types, qwen, true);
    if biased {
        let mlp = arch == "LlamaForCausalLM";
        for i in 0..types.len() {
            let (a, m) = (format!("{prefix}.layers.{i}.self_attn"), format!("{prefix}.layers.{i}.mlp"));
            t.extend([(format!("{a}.q_proj.bias"), vec![nh * hd]), (format!("{a}.k_proj.bias"), vec![nkv * hd]), (format!("{a}.v_proj.bias"), vec![nkv * hd])]);
            if mlp {
                t.extend([(format!("{a}.o_proj.bias"), vec![h]), (format!("{m}.gate_proj.bias"), vec![inter]), (format!("{m}.up_proj.bias"), vec![inter]), (format!("{m}.down_proj.bias"), vec![h])]);
            }
        }
    }
    if mtp {
        t.extend(mtp_tensor_shapes(&dims));
    }
    let bufs: Vec<Vec<u8>> = t
        .iter()
        .enumerate()
        .map(|(i, (_, shape))| {
            let vals = rand_vec(shape.iter().product(), i as u64 + 3);
            match dtype {
                Dtype::BF16 => vals.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                Dtype::F16 => vals.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
                _ => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            }
        })
        .collect();
    let mut index = serde_json::Map::new();
    for (shard, range) in [(0usize, 0..t.len() / 2), (1, t.len() / 2..t.len())] {
        let file = format!("model-{shard}.safetensors");
        let views: Vec<(String, TensorView)> = range.map(|i| (t[i].0.clone(), TensorView::new(dtype, t[i].1.clone(), &bufs[i]).unwrap())).collect();
        for (name, _) in &views {
            index.insert(name.clone(), serde_json::Value::String(file.clone()));
        }
        ::safetensors::tensor::serialize_to_file(views, None, &dir.join(&file)).unwrap();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({"weight_map": index}).to_string()).unwrap();
    dir
}

/// What the previous upload sent for a host f32 tensor.
fn old_bits(values: &[f32], st: StorageDType) -> Vec<u16> {
    storage_bits_from_f32(values, st)
}

/// What it sent for a host norm weight (`1 + w` on zero-centred models, uploaded as `w`).
fn old_norm(w: &[f32], plus_one: bool, st: StorageDType) -> Vec<u16> {
    let raw: Vec<f32> = if plus_one { w.iter().map(|x| x - 1.0).collect() } else { w.to_vec() };
    old_bits(&raw, st)
}

/// Equal slices, or a panic naming the first differing element (not the whole tensor).
fn same<T: PartialEq + std::fmt::Debug>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: element {i} of {} differs: {:?}, want {:?}", got.len(), got[i], want[i]);
    }
}

fn rows(l: &Linear, r0: usize, r1: usize, st: StorageDType) -> Vec<u16> {
    old_bits(&l.dense_weight().unwrap()[r0 * l.k..r1 * l.k], st)
}

fn check_layer(cfg: &ModelConfig, host: &LayerWeights, dev: &DevLayer<Vec<u16>, Vec<f32>>, st: StorageDType, li: usize) {
    let p1 = cfg.zero_centered_norm;
    same(&dev.input_norm, &old_norm(&host.input_norm, p1, st), &format!("layer {li} input_norm"));
    same(&dev.post_norm, &old_norm(&host.post_norm, p1, st), &format!("layer {li} post_norm"));
    same(&dev.gate_up.w, &old_bits(&host.gate_up.dense_weight().unwrap(), st), &format!("layer {li} gate_up"));
    assert_eq!((dev.gate_up.n, dev.gate_up.k), (host.gate_up.n, host.gate_up.k));
    assert_eq!((dev.gate_up.format, dev.down.format), (st.into(), st.into()), "layer {li} weight format");
    same(&dev.down.w, &old_bits(&host.down.dense_weight().unwrap(), st), &format!("layer {li} down"));
    assert_eq!(dev.gate_up.bias, host.gate_up.b.as_deref().map(|b| old_bits(b, st)), "layer {li} gate_up bias");
    assert_eq!(dev.down.bias, host.down.b.as_deref().map(|b| old_bits(b, st)), "layer {li} down bias");
    match (&host.mixer, &dev.mixer) {
        (Mixer::Attention(a), DevMixer::Attention(d)) => {
            same(&d.qkv.w, &old_bits(&a.qkv.dense_weight().unwrap(), st), &format!("layer {li} qkv"));
            assert_eq!((d.qkv.n, d.qkv.k, d.o.n, d.o.k), (a.qkv.n, a.qkv.k, a.o.n, a.o.k));
            same(&d.o.w, &old_bits(&a.o.dense_weight().unwrap(), st), &format!("layer {li} o"));
            assert_eq!(d.qkv.bias, a.qkv.b.as_deref().map(|b| old_bits(b, st)), "layer {li} qkv bias");
            assert_eq!(d.o.bias, a.o.b.as_deref().map(|b| old_bits(b, st)), "layer {li} o bias");
            assert_eq!(d.q_norm, a.q_norm.as_deref().map(|w| old_norm(w, p1, st)), "layer {li} q_norm");
            assert_eq!(d.k_norm, a.k_norm.as_deref().map(|w| old_norm(w, p1, st)), "layer {li} k_norm");
        }
        (Mixer::Gdn(g), DevMixer::Gdn(d)) => {
            let la = cfg.linear_attention.unwrap();
            let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
            same(&d.in_proj.w, &rows(&g.in_proj, 0, cd + vd + 2 * nv, st), &format!("layer {li} gdn in_proj"));
            assert_eq!((d.in_proj.n, d.in_proj.k, d.out.n, d.out.k), (cd + vd + 2 * nv, g.in_proj.k, g.out_proj.n, g.out_proj.k));
            same(&d.conv_w, &old_bits(&g.conv_w, st), &format!("layer {li} conv_w"));
            assert_eq!(d.conv_b, g.conv_b.as_deref().map(|b| old_bits(b, st)), "layer {li} conv_b");
            same(&d.dt_bias, &g.dt_bias, &format!("layer {li} dt_bias"));
            same(&d.norm, &old_bits(&g.norm, st), &format!("layer {li} gdn norm"));
            same(&d.out.w, &old_bits(&g.out_proj.dense_weight().unwrap(), st), &format!("layer {li} out_proj"));
            // The old path went A_log -> -exp(A_log) -> ln, the new one uploads A_log as stored.
            for (new, neg_a) in d.a_log.iter().zip(&g.neg_a) {
                assert!((new - (-neg_a).ln()).abs() <= 1e-6 * new.abs().max(1.0), "layer {li} A_log {new} vs {neg_a}");
            }
        }
        _ => panic!("layer {li}: mixer kinds differ"),
    }
}

fn check(dir: &Path, st: StorageDType, read: bool) {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let store = WeightStore::open(dir).unwrap();
    let host = ModelWeights::load(&store, &cfg, &QuantSource::dense(&store)).unwrap();
    let dev = build(&mut HostSink::new(st, read), &store, &cfg, &QuantLoad::default()).unwrap();
    assert_eq!(dev.layers.len(), host.layers.len());
    for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
        check_layer(&cfg, h, d, st, li);
    }
    same(&dev.embed, &old_bits(&host.embed, st), "embed");
    same(&dev.final_norm, &old_norm(&host.final_norm, cfg.zero_centered_norm, st), "final_norm");
    same(&dev.lm_head.as_ref().unwrap().w, &old_bits(&host.lm_head.as_ref().unwrap().dense_weight().unwrap(), st), "lm_head");
    assert_eq!(dev.norm_plus_one, cfg.zero_centered_norm);
    let f32_elems: usize = dev.layers.iter().map(|l| if let DevMixer::Gdn(g) = &l.mixer { g.a_log.len() + g.dt_bias.len() } else { 0 }).sum();
    let storage_elems = host.bytes() / 4 - f32_elems;
    assert_eq!(dev.bytes, 2 * storage_elems + 4 * f32_elems, "byte count");
    // The plan the device load checks against free memory first: the same bytes, no upload.
    assert_eq!(planned_weight_bytes(&cfg, &store, st.into(), &QuantLoad::default()).unwrap(), dev.bytes, "planned bytes");
    // `ninfer plan` (plan/inventory.rs) counts the same bytes from the headers.
    let tensors = crate::plan::model_tensors(&cfg, Some(&store)).unwrap();
    let input = gpu_plan(&cfg, &tensors);
    assert_eq!(crate::plan::ledger::weight_lines(&input).unwrap().1, dev.bytes as u64, "ninfer plan's bytes");
}

#[test]
fn bf16_hybrid_packs_like_the_host_layouts_in_both_storage_types() {
    let dir = checkpoint("q35_bf16", "Qwen3_5ForCausalLM", Dtype::BF16);
    for st in [StorageDType::Bf16, StorageDType::F16] {
        check(&dir, st, true);
        check(&dir, st, false);
    }
}

#[test]
fn f32_and_f16_llama_pack_like_the_host_layouts() {
    for (tag, dtype) in [("llama_f32", Dtype::F32), ("llama_f16", Dtype::F16)] {
        let dir = checkpoint(tag, "LlamaForCausalLM", dtype);
        for st in [StorageDType::Bf16, StorageDType::F16] {
            check(&dir, st, true);
        }
    }
}

#[test]
fn projection_biases_pack_like_the_host_layouts() {
    for (tag, arch) in [("qwen2_bias", "Qwen2ForCausalLM"), ("llama_bias", "LlamaForCausalLM")] {
        let dir = checkpoint_with(tag, arch, Dtype::BF16, true);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let llama = arch == "LlamaForCausalLM";
        assert_eq!((cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias), (true, llama, llama), "{arch}");
        for st in [StorageDType::Bf16, StorageDType::F16] {
            check(&dir, st, true);
        }
        let dev = build(&mut HostSink::new(StorageDType::Bf16, true), &WeightStore::open(&dir).unwrap(), &cfg, &QuantLoad::default()).unwrap();
        assert!(dev.layers.iter().all(|l| matches!(&l.mixer, DevMixer::Attention(a) if a.qkv.bias.is_some())), "{arch}: every qkv has its bias");
    }
}

#[test]
fn a_missing_bias_fails_naming_it_as_the_cpu_loader_does() {
    // A Qwen2 config always declares q/k/v biases; this checkpoint has none.
    let dir = checkpoint_with("qwen2_no_bias", "Qwen2ForCausalLM", Dtype::BF16, false);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let new = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::default()).err().expect("a missing bias must fail");
    let old = ModelWeights::load(&store, &cfg, &QuantSource::dense(&store)).err().expect("a missing bias must fail");
    assert!(matches!(new, NinferError::MissingTensor { .. }) && new.to_string().contains("q_proj.bias"), "{new}");
    assert_eq!(new.to_string(), old.to_string());
}

#[test]
fn malformed_tensors_fail_with_the_cpu_loaders_errors() {
    let dir = checkpoint("bad_shape", "LlamaForCausalLM", Dtype::BF16);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let mut wrong = cfg.clone();
    wrong.intermediate_size += 1;
    let sink = &mut HostSink::new(StorageDType::Bf16, true);
    let new = build(sink, &store, &wrong, &QuantLoad::default()).err().expect("a shape mismatch must fail");
    let old = ModelWeights::load(&store, &wrong, &QuantSource::dense(&store)).err().expect("a shape mismatch must fail");
    assert!(matches!(new, NinferError::TensorShape { .. }), "{new}");
    assert_eq!(new.to_string(), old.to_string());
    assert_eq!(planned_weight_bytes(&wrong, &store, WeightFormat::Bf16, &QuantLoad::default()).expect_err("the plan checks shapes too").to_string(), old.to_string());
    let mut gdn = cfg.clone();
    gdn.layer_types[0] = LayerType::LinearAttention;
    let new = build(sink, &store, &gdn, &QuantLoad::default()).err().expect("a missing tensor must fail");
    assert!(matches!(new, NinferError::MissingTensor { .. } | NinferError::Config { .. }), "{new}");
}

#[test]
fn the_mtp_head_packs_like_the_host_layouts_and_only_where_the_checkpoint_has_one() {
    let dir = checkpoint_full("q35_mtp", "Qwen3_5ForCausalLM", Dtype::BF16, false, true);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let host = ModelWeights::load(&store, &cfg, &QuantSource::dense(&store)).unwrap();
    let hm = host.mtp.as_ref().expect("the checkpoint has mtp.*");
    let (h, p1) = (cfg.hidden_size, cfg.zero_centered_norm);
    for st in [StorageDType::Bf16, StorageDType::F16] {
        let dev = build_mtp(&mut HostSink::new(st, true), &store, &cfg, &QuantLoad::default()).unwrap().expect("the head is built");
        same(&dev.fc.w, &old_bits(hm.fc.dense_weight().unwrap(), st), "mtp fc");
        assert_eq!((dev.fc.n, dev.fc.k, dev.fc.bias.is_none()), (h, 2 * h, true));
        same(&dev.pre_fc_norm_embedding, &old_norm(&hm.pre_fc_norm_embedding, p1, st), "mtp pre_fc_norm_embedding");
        same(&dev.pre_fc_norm_hidden, &old_norm(&hm.pre_fc_norm_hidden, p1, st), "mtp pre_fc_norm_hidden");
        same(&dev.norm, &old_norm(&hm.norm, p1, st), "mtp norm");
        check_layer(&cfg, &hm.layers[0], &dev.layer, st, 0);
        assert!(matches!(&dev.layer.mixer, DevMixer::Attention(a) if a.q_norm.is_some()), "a gated full-attention layer with q/k norms");
        let planned = build_mtp(&mut PlanSink::new(st.into()), &store, &cfg, &QuantLoad::default()).unwrap().expect("planned").bytes;
        assert_eq!(planned, dev.bytes, "planned MTP bytes");
    }
    // The model's own weights load as without a head; a head of two layers is refused.
    let main = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::default()).unwrap();
    assert_eq!(main.layers.len(), host.layers.len());
    let mut two = cfg.clone();
    two.mtp_num_layers = 2;
    let e = build_mtp(&mut PlanSink::new(WeightFormat::Bf16), &store, &two, &QuantLoad::default()).err().expect("two MTP layers").to_string();
    assert!(e.contains("2 MTP layers"), "{e}");
    let plain = checkpoint("q35_no_mtp", "Qwen3_5ForCausalLM", Dtype::BF16);
    let (cfg, store) = (ModelConfig::from_dir(&plain).unwrap(), WeightStore::open(&plain).unwrap());
    assert!(build_mtp(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &QuantLoad::default()).unwrap().is_none());
}

/// A CPU projection's `[n, k]` values in output order, each block decoded as the format
/// defines it.
fn cpu_values(l: &Linear) -> Vec<f32> {
    let mut computed = Vec::with_capacity(l.n * l.k);
    for p in &l.parts {
        match p {
            crate::model::cpu::weights::Part::Dense(w) => computed.extend_from_slice(w),
            crate::model::cpu::weights::Part::Quant(q) => computed.extend(crate::quant::dequantize(&q.weight().view()).unwrap()),
        }
    }
    match &l.order {
        None => computed,
        Some(order) => order.iter().flat_map(|&src| computed[src as usize * l.k..(src as usize + 1) * l.k].to_vec()).collect(),
    }
}

/// A device projection built with `--quantize f`: quantized, of the CPU projection's shape, and
/// its packed bytes decode to exactly the values the CPU model holds. Returns its bytes.
fn same_quantized(sink: &HostSink, d: &super::Linear<Vec<u16>>, cpu: &Linear, f: crate::quant::QuantFormat, what: &str) -> usize {
    assert_eq!(d.format, WeightFormat::Quant(f), "{what}: format");
    assert_eq!((d.n, d.k), (cpu.n, cpu.k), "{what}: shape");
    assert_eq!(d.route, LinearRoute::quantized(), "{what}: the quantized route takes no dense fusions");
    let (parts, tail) = (&sink.quant[d.w[0] as usize], &sink.tails[d.w[0] as usize]);
    let rows: usize = parts.iter().map(|w| w.shape[0]).sum();
    assert_eq!([rows + tail.len() / cpu.k, parts[0].shape[1]], [cpu.n, cpu.k], "{what}: packed shape");
    let mut got = Vec::with_capacity(cpu.n * cpu.k);
    for w in parts {
        if let Some(Ok(payload)) = crate::quant::payload_bytes(f, w.shape) {
            assert_eq!(w.data.len(), payload, "{what}: payload bytes");
        }
        got.extend(crate::quant::dequantize(&w.view()).unwrap());
    }
    // The dense tail as the kernels read it: bf16 bits, exact in f32.
    got.extend(tail.iter().map(|b| f32::from_bits((*b as u32) << 16)));
    same(&got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), &cpu_values(cpu).iter().map(|x| x.to_bits()).collect::<Vec<_>>(), what);
    // What the upload holds: a single 4-bit part in the tiled layout (quant_tiles.rs), each
    // NVFP4 part padded.
    let held = parts.iter().map(|w| crate::plan::gpu::quant_device_bytes(w.format, w.shape, quant_bytes(w))).sum::<usize>();
    held + 2 * tail.len()
}

fn quantize_opts(mode: crate::quant::QuantizeMode) -> crate::model::LoadOptions {
    crate::model::LoadOptions { quantize: Some(mode), ..Default::default() }
}

/// Every projection of a layer built with `--quantize`, against the CPU model's; returns the
/// bytes the upload holds for them.
fn check_quant_layer(sink: &HostSink, host: &LayerWeights, dev: &DevLayer<Vec<u16>, Vec<f32>>, f: crate::quant::QuantFormat, li: usize) -> usize {
    let mut bytes = same_quantized(sink, &dev.gate_up, &host.gate_up, f, &format!("layer {li} gate_up"));
    bytes += same_quantized(sink, &dev.down, &host.down, f, &format!("layer {li} down"));
    match (&host.mixer, &dev.mixer) {
        (Mixer::Attention(a), DevMixer::Attention(d)) => {
            bytes += same_quantized(sink, &d.qkv, &a.qkv, f, &format!("layer {li} qkv"));
            bytes += same_quantized(sink, &d.o, &a.o, f, &format!("layer {li} o"));
        }
        (Mixer::Gdn(g), DevMixer::Gdn(d)) => {
            bytes += same_quantized(sink, &d.in_proj, &g.in_proj, f, &format!("layer {li} gdn in_proj"));
            bytes += same_quantized(sink, &d.out, &g.out_proj, f, &format!("layer {li} out_proj"));
        }
        _ => panic!("layer {li}: mixer kinds differ"),
    }
    bytes
}

#[test]
fn quantize_packs_fused_projections_that_decode_to_the_cpu_models_values() {
    // The hybrid (gated q_proj reordered, GDN in_proj of four parts, MTP head), a plain model
    // with projection biases.
    let hybrid = checkpoint_full("q35_quant", "Qwen3_5ForCausalLM", Dtype::BF16, false, true);
    let llama = checkpoint_with("llama_quant", "LlamaForCausalLM", Dtype::BF16, true);
    for dir in [&hybrid, &llama] {
        let cfg = ModelConfig::from_dir(dir).unwrap();
        let store = WeightStore::open(dir).unwrap();
        let dense = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::default()).unwrap();
        for flag in ["w8", "q4", "q5", "q6", "fp8"] {
            let plan_format = crate::plan::QuantFormat::parse(flag).unwrap();
            let mode = plan_format.mode;
            let f = mode.format();
            assert!(super::super::CudaModel::supports(f), "{f:?}");
            let opts = quantize_opts(mode);
            let host = ModelWeights::load(&store, &cfg, &QuantSource::new(dir, &store, &opts).unwrap()).unwrap();
            let mut sink = HostSink::new(StorageDType::Bf16, true);
            let dev = build(&mut sink, &store, &cfg, &QuantLoad::quantize(Some(f))).unwrap();
            let mut packed = 0;
            for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
                packed += check_quant_layer(&sink, h, d, f, li);
                // Biases stay in storage type beside the packed weight.
                assert_eq!(d.gate_up.bias, h.gate_up.b.as_deref().map(|b| old_bits(b, StorageDType::Bf16)), "layer {li} gate_up bias");
            }
            // The LM head and everything that is not a projection stay as the dense load has them.
            let lm = dev.lm_head.as_ref().unwrap();
            assert_eq!(lm.format, WeightFormat::Bf16, "{f:?}: the LM head stays dense");
            same(&lm.w, &dense.lm_head.as_ref().unwrap().w, "lm_head");
            same(&dev.embed, &dense.embed, "embed");
            // The bytes held: the dense load's, less the projections' dense weights, plus the payloads.
            assert_eq!(dev.bytes, dense.bytes - dense_projection_bytes(&dense) + packed, "{f:?}: bytes held");
            let planned = plan(&cfg, &store, WeightFormat::Bf16, &QuantLoad::quantize(Some(f))).unwrap();
            assert_eq!(planned.bytes, dev.bytes, "{f:?}: the plan's bytes are the load's");
            let largest = sink.quant.iter().zip(&sink.tails).map(|(p, t)| p.iter().map(|w| w.shape[0]).sum::<usize>() * p[0].shape[1] + t.len()).max().unwrap();
            assert_eq!(planned.quant_elems, largest, "{f:?}: the workspace fits the largest projection");
            let smallest_k = sink.quant.iter().map(|p| p[0].shape[1]).min();
            assert_eq!(planned.min_quant_k, smallest_k, "{f:?}: the smallest K of the quantized projections");
            // `ninfer plan --quantize` counts the same bytes from the headers.
            let tensors = crate::plan::model_tensors(&cfg, Some(&store)).unwrap();
            let input = crate::plan::PlanInput {
                cfg: &cfg,
                tensors: &tensors,
                target: crate::plan::Target::Gpu,
                engine: Default::default(),
                quantize: Some(plan_format),
                quantize_lm_head: false,
                memory: None,
                pool: crate::plan::PoolRule::OneContext,
            };
            let (lines, total) = crate::plan::ledger::weight_lines(&input).unwrap();
            assert_eq!(total, dev.bytes as u64, "{f:?}: ninfer plan's bytes are the load's");
            assert_eq!(lines.iter().find(|l| l.format == f.name()).map(|l| l.bytes as usize), Some(packed), "{f:?}: the plan's {} line", f.name());
            assert_eq!(crate::plan::ledger::quant_workspace_bytes(&input), 2 * planned.quant_elems as u64, "{f:?}: the plan's dequantization workspace");
            // The MTP head quantizes as the CPU's does.
            if let (Some(hm), Some(dm)) = (&host.mtp, build_mtp(&mut sink, &store, &cfg, &QuantLoad::quantize(Some(f))).unwrap()) {
                same_quantized(&sink, &dm.fc, &hm.fc, f, "mtp fc");
                check_quant_layer(&sink, &hm.layers[0], &dm.layer, f, 0);
            } else {
                assert!(dir == &llama, "the hybrid checkpoint has an MTP head");
            }
        }
    }
}

/// Sizes where NVFP4's layout (rows a multiple of 128, K of 64) holds some parts of each fused
/// projection and not others: q (gated or not) but not k / v, the GDN qkv and z but not b / a.
fn nvfp4_dims() -> TinyDims {
    TinyDims { h: 128, v: 128, inter: 128, nh: 4, nkv: 2, hd: 32, nk: 2, nv: 4, kd: 32, vd: 32, kern: 4 }
}

#[test]
fn quantize_nvfp4_stacks_each_parts_own_payload_and_decodes_to_the_cpu_models_values() {
    use crate::quant::{QuantFormat, QuantizeMode};
    let f = QuantFormat::Nvfp4;
    assert!(super::super::CudaModel::supports(f));
    let hybrid = checkpoint_sized("q35_nvfp4", "Qwen3_5ForCausalLM", Dtype::BF16, false, true, nvfp4_dims());
    let llama = checkpoint_sized("llama_nvfp4", "LlamaForCausalLM", Dtype::BF16, true, false, nvfp4_dims());
    let opts = quantize_opts(QuantizeMode::Nvfp4);
    crate::model::cpu::quant_load::refuse_unsupported(&llama, &opts, "cuda:0", super::super::CudaModel::supports).unwrap();
    for dir in [&hybrid, &llama] {
        let cfg = ModelConfig::from_dir(dir).unwrap();
        let store = WeightStore::open(dir).unwrap();
        let host = ModelWeights::load(&store, &cfg, &QuantSource::new(dir, &store, &opts).unwrap()).unwrap();
        let quant = QuantLoad::quantize(Some(f));
        let mut sink = HostSink::new(StorageDType::Bf16, true);
        let dev = build(&mut sink, &store, &cfg, &quant).unwrap();
        let dense = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::default()).unwrap();
        let mut packed = 0;
        for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
            packed += check_quant_layer(&sink, h, d, f, li);
        }
        // q|k|v: q's payload, then k and v as the dense tail; the GDN in_proj: qkv's and z's
        // payloads (each its own divisor), then b and a.
        let stacked: Vec<(usize, usize)> = sink.quant.iter().zip(&sink.tails).map(|(p, t)| (p.len(), t.len() / 128)).collect();
        assert!(stacked.contains(&(1, 128)), "q with k|v as the dense tail: {stacked:?}");
        if dir == &hybrid {
            assert!(stacked.contains(&(2, 8)), "the GDN in_proj's two payloads and b|a: {stacked:?}");
            let (Some(hm), Some(dm)) = (&host.mtp, build_mtp(&mut sink, &store, &cfg, &quant).unwrap()) else { panic!("an MTP head") };
            same_quantized(&sink, &dm.fc, &hm.fc, f, "mtp fc");
            check_quant_layer(&sink, &hm.layers[0], &dm.layer, f, 0);
        }
        assert_eq!(dev.bytes, dense.bytes - dense_projection_bytes(&dense) + packed, "bytes held");
        let planned = plan(&cfg, &store, WeightFormat::Bf16, &quant).unwrap();
        assert_eq!(planned.bytes, dev.bytes, "the plan's bytes are the load's");
        // `ninfer plan --quantize nvfp4` counts the same bytes and workspace from the headers.
        let tensors = crate::plan::model_tensors(&cfg, Some(&store)).unwrap();
        let mut input = gpu_plan(&cfg, &tensors);
        input.quantize = Some(crate::plan::QuantFormat::parse("nvfp4").unwrap());
        let (lines, total) = crate::plan::ledger::weight_lines(&input).unwrap();
        assert_eq!(total, dev.bytes as u64, "{lines:?}");
        assert_eq!(crate::plan::ledger::quant_workspace_bytes(&input), 2 * planned.quant_elems as u64);
    }
}

#[test]
fn nvfp4_holds_leading_parts_its_layout_takes_and_the_rest_as_the_dense_tail() {
    assert_eq!(nvfp4_held_parts(&[256, 64, 64], 128), Some(1));
    assert_eq!(nvfp4_held_parts(&[256, 128, 4, 4], 128), Some(2));
    assert_eq!(nvfp4_held_parts(&[128, 128, 128], 128), Some(3));
    // None held, K not a multiple of 64, or a part it cannot hold before one it can: dense.
    assert_eq!(nvfp4_held_parts(&[64, 64], 128), None);
    assert_eq!(nvfp4_held_parts(&[128, 128], 96), None);
    assert_eq!(nvfp4_held_parts(&[64, 128], 128), None);
    assert_eq!(nvfp4_held_parts(&[128, 64, 128], 128), None);
}

#[test]
fn handed_in_nvfp4_parts_stack_with_the_gated_query_reordered() {
    use std::sync::Arc;
    let f = crate::quant::QuantFormat::Nvfp4;
    let dir = checkpoint_sized("q35_nvfp4_given", "Qwen3_5ForCausalLM", Dtype::BF16, false, false, nvfp4_dims());
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    // Every projection NVFP4 holds, as the CPU's encoder writes it from the checkpoint values.
    let names: Vec<String> = store
        .names()
        .into_iter()
        .filter(|n| n.contains("_proj") && n.ends_with(".weight"))
        .filter(|n| matches!(crate::quant::payload_bytes(f, [store.info(n).unwrap().shape[0], store.info(n).unwrap().shape[1]]), Some(Ok(_))))
        .map(str::to_string)
        .collect();
    // Only fused projections whose every part is handed in: not q|k|v (k, v are 64 rows), not
    // the GDN in_proj (b, a are 4).
    let names: Vec<String> = names.into_iter().filter(|n| !n.contains("q_proj") && !n.contains("in_proj")).collect();
    let given: std::collections::HashMap<String, crate::quant::QuantWeight> = names
        .iter()
        .map(|n| {
            let shape = store.info(n).unwrap().shape.clone();
            let v = store.load_f32(n, &shape).unwrap();
            (n.clone(), crate::quant::QuantWeight::packed(n.as_str(), f, [shape[0], shape[1]], crate::quant::quantize(f, n, &v, [shape[0], shape[1]]).unwrap()))
        })
        .collect();
    let given = Arc::new(given);
    let opts = crate::model::LoadOptions { quant_tensors: Some(given.clone()), ..Default::default() };
    let host = ModelWeights::load(&store, &cfg, &QuantSource::new(&dir, &store, &opts).unwrap()).unwrap();
    let quant = QuantLoad { given: Some(given.clone()), ..Default::default() };
    let mut sink = HostSink::new(StorageDType::Bf16, true);
    let dev = build(&mut sink, &store, &cfg, &quant).unwrap();
    for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
        same_quantized(&sink, &d.gate_up, &h.gate_up, f, &format!("layer {li} gate_up"));
        same_quantized(&sink, &d.down, &h.down, f, &format!("layer {li} down"));
    }
    assert!(sink.quant.iter().any(|p| p.len() == 2), "gate|up stacks two payloads");
    // A gated q_proj (4 heads of 32 query rows and 32 gate rows) as the loader reorders it:
    // each destination block of 32 rows is its source block, codes and scale words moved
    // inside the payload (so across the 128-row scale tiles), the divisor kept.
    let k = 128;
    let q_name = format!("{}.layers.1.self_attn.q_proj.weight", names::decoder_prefix(&store));
    let v: Vec<f32> = (0..256 * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let q = crate::quant::QuantWeight::packed(q_name.as_str(), f, [256, k], crate::quant::quantize(f, &q_name, &v, [256, k]).unwrap());
    let t = Packed::single(store.raw(&q_name, &[256, k]).unwrap()).permute_first_part(8, |d| names::gated_query_source_block(d, 4));
    let stacked = t.concat_rows(&[&q], k).unwrap();
    assert_eq!(stacked.len(), 1);
    let want = crate::quant::dequantize(&q.view()).unwrap();
    let got = crate::quant::dequantize(&stacked[0].view()).unwrap();
    assert_ne!(got, want, "the blocks moved");
    for d in 0..8 {
        let s = names::gated_query_source_block(d, 4);
        assert_eq!(got[d * 32 * k..(d + 1) * 32 * k], want[s * 32 * k..(s + 1) * 32 * k], "block {d} from {s}");
    }
}

/// The plan pass for an f16-storage device refuses a handed-in NVFP4 weight whose tensor
/// divisor lets values exceed binary16's range, naming it, device and bound as the device's
/// upload does (`quant::f16_range_error`); a bf16 plan, and a divisor within range, plan.
#[test]
fn an_f16_plan_refuses_nvfp4_weights_whose_scales_exceed_binary16() {
    use crate::quant::{QuantFormat, QuantWeight};
    use std::sync::Arc;
    let f = QuantFormat::Nvfp4;
    let dir = checkpoint_sized("q35_f16_range", "Qwen3_5ForCausalLM", Dtype::BF16, false, false, nvfp4_dims());
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let down = format!("{}.layers.0.mlp.down_proj.weight", names::decoder_prefix(&store));
    let [n, k] = [128, 128];
    let v = store.load_f32(&down, &[n, k]).unwrap();
    let device = "cuda:0 (Tesla V100-SXM2-16GB, sm_70)";
    let plan_on = |w: &QuantWeight, f16: bool| {
        let quant = QuantLoad { given: Some(Arc::new(std::collections::HashMap::from([(down.clone(), w.clone())]))), ..Default::default() };
        let sink = PlanSink { format: if f16 { WeightFormat::F16 } else { WeightFormat::Bf16 }, f16_device: f16.then(|| device.to_string()) };
        super::plan_with(sink, &cfg, &store, &quant)
    };
    let w = QuantWeight::packed(down.as_str(), f, [n, k], crate::quant::quantize(f, &down, &v, [n, k]).unwrap());
    // A tensor divisor of 0.01 lets values reach 6 * 448 / 0.01 = 268800.
    let mut wide = w.clone();
    let off = crate::quant::nvfp4::planes(n, k).1;
    wide.data[off..off + 4].copy_from_slice(&0.01f32.to_le_bytes());
    for (w, f16) in [(&w, true), (&w, false), (&wide, false)] {
        plan_on(w, f16).unwrap_or_else(|e| panic!("f16 {f16}: {e}"));
    }
    let e = plan_on(&wide, true).err().expect("refused").to_string();
    assert!(e.contains(&down) && e.contains("NVFP4") && e.contains("2.688e5") && e.contains("f16 storage") && e.contains(device), "{e}");
}

/// Random GGUF Q8_0 payloads (a finite f16 scale and 32 codes a block) for the projections
/// named, of the shapes the checkpoint gives them.
fn gguf_q8_0(store: &WeightStore, names: &[String]) -> std::collections::HashMap<String, crate::quant::QuantWeight> {
    use crate::quant::{QuantFormat, QuantWeight};
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    names
        .iter()
        .map(|name| {
            let shape = store.info(name).unwrap().shape.clone();
            let (n, k) = (shape[0], shape[1]);
            let mut data = Vec::with_capacity(n * k / 32 * 34);
            for _ in 0..n * k / 32 {
                data.extend(half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5).to_le_bytes());
                data.extend((0..32).map(|_| next() as u8));
            }
            (name.clone(), QuantWeight::packed(name.as_str(), QuantFormat::GgufQ8_0, [n, k], data))
        })
        .collect()
}

#[test]
fn handed_in_gguf_rows_fuse_and_decode_to_the_cpu_models_values() {
    use std::sync::Arc;
    let f = crate::quant::QuantFormat::GgufQ8_0;
    assert!(super::super::CudaModel::supports(f));
    for (tag, arch) in [("q35_gguf", "Qwen3_5ForCausalLM"), ("llama_gguf", "LlamaForCausalLM")] {
        let dir = checkpoint(tag, arch, Dtype::BF16);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let store = WeightStore::open(&dir).unwrap();
        // Every projection Q8_0's 32-value blocks fit (down_proj's 48 columns do not: it stays dense).
        let names: Vec<String> = store.names().into_iter().filter(|n| (n.ends_with("_proj.weight") || n.contains(".in_proj_")) && !n.contains("down_proj")).map(str::to_string).collect();
        let given = Arc::new(gguf_q8_0(&store, &names));
        let opts = crate::model::LoadOptions { quant_tensors: Some(given.clone()), ..Default::default() };
        let host = ModelWeights::load(&store, &cfg, &QuantSource::new(&dir, &store, &opts).unwrap()).unwrap();
        let quant = QuantLoad { given: Some(given.clone()), ..Default::default() };
        let mut sink = HostSink::new(StorageDType::Bf16, true);
        let dev = build(&mut sink, &store, &cfg, &quant).unwrap();
        let dense = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::default()).unwrap();
        for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
            same_quantized(&sink, &d.gate_up, &h.gate_up, f, &format!("{tag} layer {li} gate_up"));
            same(&d.down.w, &dense.layers[li].down.w, &format!("{tag} layer {li} down stays dense"));
            match (&h.mixer, &d.mixer) {
                (Mixer::Attention(a), DevMixer::Attention(dm)) => {
                    same_quantized(&sink, &dm.qkv, &a.qkv, f, &format!("{tag} layer {li} qkv"));
                    same_quantized(&sink, &dm.o, &a.o, f, &format!("{tag} layer {li} o"));
                }
                (Mixer::Gdn(g), DevMixer::Gdn(dm)) => {
                    same_quantized(&sink, &dm.in_proj, &g.in_proj, f, &format!("{tag} layer {li} in_proj"));
                    same_quantized(&sink, &dm.out, &g.out_proj, f, &format!("{tag} layer {li} out_proj"));
                }
                _ => panic!("mixer kinds differ"),
            }
        }
        assert_eq!(plan(&cfg, &store, WeightFormat::Bf16, &quant).unwrap().bytes, dev.bytes, "{tag}: planned bytes");
        // A fused projection handed in only in part, a name the load has no projection for, and a
        // format whose rows are not runs of bytes: each refused naming the tensor.
        let qkv_part = names.iter().find(|n| n.ends_with("k_proj.weight")).unwrap();
        let mut part = (*given).clone();
        part.remove(qkv_part);
        let e = build(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &QuantLoad { given: Some(Arc::new(part)), ..Default::default() }).err().expect("a part missing").to_string();
        assert!(e.contains("only some parts") && e.contains(&qkv_part.replace("k_proj", "q_proj")), "{e}");
        let mut extra = (*given).clone();
        let embed = names::decoder_prefix(&store).to_string() + ".embed_tokens.weight";
        extra.insert(embed.clone(), gguf_q8_0(&store, std::slice::from_ref(&embed)).remove(&embed).unwrap());
        let e = build(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &QuantLoad { given: Some(Arc::new(extra)), ..Default::default() }).err().expect("a packed embedding").to_string();
        assert!(e.contains(&embed) && e.contains("stay dense"), "{e}");
        let mut w8 = (*given).clone();
        let o = names.iter().find(|n| n.ends_with("o_proj.weight") || n.ends_with("out_proj.weight")).unwrap();
        let [n, k] = w8[o].shape;
        let values = rand_vec(n * k, 1);
        let q = crate::quant::QuantFormat::W8G32F16S;
        w8.insert(o.clone(), crate::quant::QuantWeight::packed(o.as_str(), q, [n, k], crate::quant::quantize(q, o, &values, [n, k]).unwrap()));
        let e = build(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &QuantLoad { given: Some(Arc::new(w8)), ..Default::default() }).err().expect("a W8 tensor handed in").to_string();
        assert!(e.contains(o.as_str()) && e.contains("W8G32_F16S") && e.contains("only GGUF rows"), "{e}");
    }
}

/// A copy of the dense checkpoint `src` at `tag` whose projections (`*_proj*.weight`, but those
/// `keep_dense` names) are random HF `format` weights stored as such a checkpoint stores them,
/// under `qcfg` (a `quantization_config`); `g_idx`: the input groups every weight stores.
fn hf_checkpoint(src: &Path, tag: &str, format: crate::quant::QuantFormat, qcfg: serde_json::Value, keep_dense: &[&str], g_idx: Option<&[i32]>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ninfer_cuda_load_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = qcfg;
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let store = WeightStore::open(src).unwrap();
    let c = crate::quant::HfQuantConfig::from_model_config(&config).unwrap().unwrap();
    assert_eq!(c.format, format);
    let dtype = |d: crate::quant::RawDtype| match d {
        crate::quant::RawDtype::U8 | crate::quant::RawDtype::F8E4M3 => Dtype::F8_E4M3,
        crate::quant::RawDtype::F16 => Dtype::F16,
        crate::quant::RawDtype::BF16 => Dtype::BF16,
        crate::quant::RawDtype::F32 => Dtype::F32,
        crate::quant::RawDtype::I32 => Dtype::I32,
    };
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, name) in store.names().into_iter().enumerate() {
        let (info, bytes) = store.stored(name).unwrap();
        let quantize = name.contains("_proj") && name.ends_with(".weight") && !keep_dense.iter().any(|k| name.contains(k));
        if !quantize {
            let d = match info.dtype.as_str() { "BF16" => Dtype::BF16, "F16" => Dtype::F16, _ => Dtype::F32 };
            out.push((name.to_string(), d, info.shape.clone(), bytes.to_vec()));
            continue;
        }
        let module = name.trim_end_matches(".weight");
        let (n, k) = (info.shape[0], info.shape[1]);
        let w = super::hf_rows::random(format, module, n, k, i as u64 + 11, g_idx);
        let names = c.tensor_names(module);
        let specs = crate::quant::hf::part_specs(format, n, k, g_idx.is_some());
        let data_dtype = if matches!(format, crate::quant::QuantFormat::HfFp8Block { .. }) { Dtype::F8_E4M3 } else { Dtype::I32 };
        out.push((names.data, data_dtype, specs[0].as_ref().unwrap().1.clone(), w.data.clone()));
        for (part, name) in [(&w.scale, Some(names.scale)), (&w.zero, names.zero), (&w.g_idx, names.g_idx)] {
            if let (Some(r), Some(name)) = (part, name) {
                out.push((name, dtype(r.dtype), r.shape.clone(), r.bytes.clone()));
            }
        }
    }
    let views: Vec<(String, TensorView)> = out.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    ::safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// The HF formats with their `quantization_config`s (group 16, FP8 blocks of 8 x 16).
fn hf_formats() -> Vec<(crate::quant::QuantFormat, serde_json::Value)> {
    use crate::quant::QuantFormat;
    let ct = |symmetric: bool| serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 16}}}});
    vec![
        (QuantFormat::HfFp8Block { block_n: 8, block_k: 16 }, serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 16]})),
        (QuantFormat::Awq4 { group: 16 }, serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": true, "version": "gemm"})),
        (QuantFormat::Gptq4 { group: 16, zero_plus_one: true }, serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": false, "sym": false})),
        (QuantFormat::PackQuantized4 { group: 16, symmetric: true }, ct(true)),
        (QuantFormat::PackQuantized4 { group: 16, symmetric: false }, ct(false)),
    ]
}

#[test]
fn quantized_hf_checkpoints_fuse_into_weights_that_decode_to_the_cpu_models_values() {
    let llama = checkpoint_with("llama_hf_src", "LlamaForCausalLM", Dtype::BF16, true);
    for (i, (f, qcfg)) in hf_formats().into_iter().enumerate() {
        assert!(super::super::CudaModel::supports(f), "{f:?}");
        // GPTQ with a g_idx each weight shares (desc_act off stores the trivial one).
        let groups: Vec<i32> = (0..48).map(|k| k / 16).collect();
        let g_idx = matches!(f, crate::quant::QuantFormat::Gptq4 { .. }).then_some(&groups[..32]);
        let dir = hf_checkpoint(&llama, &format!("llama_hf_{i}"), f, qcfg, &["down_proj"], g_idx);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let store = WeightStore::open(&dir).unwrap();
        let opts = crate::model::LoadOptions::default();
        let host = ModelWeights::load(&store, &cfg, &QuantSource::new(&dir, &store, &opts).unwrap()).unwrap();
        let quant = QuantLoad::new(&dir, &opts).unwrap();
        assert_eq!(quant.hf.map(|c| c.format), Some(f));
        let mut sink = HostSink::new(StorageDType::Bf16, true);
        let dev = build(&mut sink, &store, &cfg, &quant).unwrap();
        let dense = build(&mut HostSink::new(StorageDType::Bf16, true), &WeightStore::open(&llama).unwrap(), &cfg, &QuantLoad::default()).unwrap();
        let mut packed = 0;
        for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
            packed += same_quantized(&sink, &d.gate_up, &h.gate_up, f, &format!("{f:?} layer {li} gate_up"));
            let (Mixer::Attention(a), DevMixer::Attention(dm)) = (&h.mixer, &d.mixer) else { panic!("llama layers attend") };
            packed += same_quantized(&sink, &dm.qkv, &a.qkv, f, &format!("{f:?} layer {li} qkv"));
            packed += same_quantized(&sink, &dm.o, &a.o, f, &format!("{f:?} layer {li} o"));
            // The dense down_proj and the biases are the dense load's.
            same(&d.down.w, &dense.layers[li].down.w, "down stays dense");
            assert_eq!(d.gate_up.bias, dense.layers[li].gate_up.bias, "gate_up bias");
            assert_eq!(dm.qkv.bias, match &dense.layers[li].mixer { DevMixer::Attention(a) => a.qkv.bias.clone(), _ => None }, "qkv bias");
        }
        // The bytes held: the stored tensors (one g_idx a fused projection), as the plan pass counts them.
        let dense_proj: usize = dense.layers.iter().map(|l| match &l.mixer {
            DevMixer::Attention(a) => 2 * (a.qkv.w.len() + a.o.w.len() + l.gate_up.w.len()),
            _ => unreachable!(),
        }).sum();
        assert_eq!(dev.bytes, dense.bytes - dense_proj + packed, "{f:?}: bytes held");
        assert_eq!(plan(&cfg, &store, WeightFormat::Bf16, &quant).unwrap().bytes, dev.bytes, "{f:?}: planned bytes");
    }
}

#[test]
fn an_hf_fused_projection_with_dense_last_parts_holds_them_as_its_dense_tail() {
    use crate::quant::QuantFormat;
    let hybrid = checkpoint_full("q35_hf_tail_src", "Qwen3_5ForCausalLM", Dtype::BF16, false, true);
    let f = QuantFormat::HfFp8Block { block_n: 8, block_k: 16 };
    let qcfg = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 16]});
    // As the official Qwen3.5 FP8 releases: the GDN in_proj_b / in_proj_a stay bf16.
    let dir = hf_checkpoint(&hybrid, "q35_hf_tail", f, qcfg, &["in_proj_b", "in_proj_a"], None);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let quant = QuantLoad::new(&dir, &Default::default()).unwrap();
    let host = ModelWeights::load(&store, &cfg, &QuantSource::new(&dir, &store, &Default::default()).unwrap()).unwrap();
    let mut sink = HostSink::new(StorageDType::Bf16, true);
    let dev = build(&mut sink, &store, &cfg, &quant).unwrap();
    let mut packed = 0;
    for (li, (h, d)) in host.layers.iter().zip(&dev.layers).enumerate() {
        // The gated q_proj reordered by 8-row blocks; in_proj's b and a its dense tail.
        packed += check_quant_layer(&sink, h, d, f, li);
    }
    assert!(sink.tails.iter().any(|t| !t.is_empty()), "in_proj has a dense tail");
    let planned = plan(&cfg, &store, WeightFormat::Bf16, &quant).unwrap();
    assert_eq!(planned.bytes, dev.bytes);
    // `ninfer plan` counts the same bytes for a GPU, and the workspace of the largest projection.
    let tensors = crate::plan::checkpoint_tensors(&dir, &cfg, Some(&store)).unwrap();
    let input = gpu_plan(&cfg, &tensors);
    let (lines, total) = crate::plan::ledger::weight_lines(&input).unwrap();
    assert_eq!(total, dev.bytes as u64, "{lines:?}");
    assert_eq!(lines.iter().find(|l| l.format == f.name()).map(|l| l.bytes as usize), Some(packed - 2 * sink.tails.iter().map(Vec::len).sum::<usize>()));
    assert_eq!(crate::plan::ledger::quant_workspace_bytes(&input), 2 * planned.quant_elems as u64);
    // The MTP head's layer (in FP8; its fc stays dense) loads as the CPU's.
    let (Some(hm), Some(dm)) = (&host.mtp, build_mtp(&mut sink, &store, &cfg, &quant).unwrap()) else { panic!("an MTP head") };
    assert_eq!(dm.fc.format, WeightFormat::Bf16);
    check_quant_layer(&sink, &hm.layers[0], &dm.layer, f, 0);
}

#[test]
fn hf_fused_projections_the_gpu_cannot_hold_as_one_are_refused_as_not_supported_yet() {
    use crate::quant::QuantFormat;
    let hybrid = checkpoint("q35_hf_src", "Qwen3_5ForCausalLM", Dtype::BF16);
    let (f, qcfg) = (QuantFormat::HfFp8Block { block_n: 8, block_k: 16 }, serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 16]}));
    // A dense part before a quantized one: the attention's q|k|v with k_proj dense (the GDN
    // in_proj's b and a dense too, its valid dense tail).
    let dir = hf_checkpoint(&hybrid, "q35_hf_middle", f, qcfg.clone(), &["k_proj", "in_proj_b", "in_proj_a"], None);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let quant = QuantLoad::new(&dir, &Default::default()).unwrap();
    let e = build(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &quant).err().expect("dense k_proj").to_string();
    assert!(e.contains("HF_FP8_BLOCK") && e.contains("k_proj.weight") && e.contains("not supported yet"), "{e}");
    // Every in_proj part in FP8: b (4 rows) would share an 8-row scale block with a.
    let dir = hf_checkpoint(&hybrid, "q35_hf_blocks", f, qcfg, &[], None);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let quant = QuantLoad::new(&dir, &Default::default()).unwrap();
    // Refused by the plan pass, before any weight is read.
    let e = build(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &quant).err().expect("unaligned parts").to_string();
    assert!(e.contains("in_proj_b rows 0..4") && e.contains("multiples of 8") && e.contains("not supported yet"), "{e}");
    // GPTQ act-order parts with different g_idx, likewise.
    let (g, gcfg) = (QuantFormat::Gptq4 { group: 16, zero_plus_one: true }, serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": true, "sym": false}));
    let llama = checkpoint("llama_hf_gidx_src", "LlamaForCausalLM", Dtype::BF16);
    let groups: Vec<i32> = (0..32).map(|k| k / 16).collect();
    let dir = hf_checkpoint(&llama, "llama_hf_gidx", g, gcfg, &["down_proj"], Some(&groups));
    let file = std::fs::read(dir.join("model.safetensors")).unwrap();
    let mut t = ::safetensors::SafeTensors::deserialize(&file).unwrap().tensors();
    // k_proj's inputs in other groups than q_proj's.
    let other: Vec<u8> = groups.iter().rev().flat_map(|v| v.to_le_bytes()).collect();
    let k_gidx = "model.layers.0.self_attn.k_proj.g_idx";
    let mut views: Vec<(String, TensorView)> = t.drain(..).filter(|(n, _)| n != k_gidx).collect();
    views.push((k_gidx.to_string(), TensorView::new(Dtype::I32, vec![32], &other).unwrap()));
    let bytes = ::safetensors::tensor::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let quant = QuantLoad::new(&dir, &Default::default()).unwrap();
    let e = build(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &quant).err().expect("different g_idx").to_string();
    assert!(e.contains("HF_GPTQ4") && e.contains("k_proj.weight") && e.contains("g_idx") && e.contains("not supported yet"), "{e}");
    // --quantize on a quantized checkpoint is refused as on the CPU.
    let e = QuantLoad::new(&dir, &quantize_opts(crate::quant::QuantizeMode::Q4)).err().expect("already quantized").to_string();
    assert!(e.contains("already quantized") && e.contains("HF_GPTQ4"), "{e}");
}

/// `ninfer plan`'s input for a GPU with the default engine and no quantization.
fn gpu_plan<'a>(cfg: &'a crate::config::ModelConfig, tensors: &'a [crate::plan::PlannedTensor]) -> crate::plan::PlanInput<'a> {
    crate::plan::PlanInput {
        cfg,
        tensors,
        target: crate::plan::Target::Gpu,
        engine: Default::default(),
        quantize: None,
        quantize_lm_head: false,
        memory: None,
        pool: crate::plan::PoolRule::OneContext,
    }
}

#[test]
fn quantize_lm_head_packs_the_head_as_the_cpu_model_and_a_tied_one_as_a_copy() {
    use crate::quant::QuantizeMode;
    let untied = checkpoint_sized("llama_qhead", "LlamaForCausalLM", Dtype::BF16, false, false, nvfp4_dims());
    // The same tensors with the head tied to the embedding (lm_head.weight is then not read).
    let tied = std::env::temp_dir().join(format!("ninfer_cuda_load_llama_qhead_tied_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tied);
    std::fs::create_dir_all(&tied).unwrap();
    for f in std::fs::read_dir(&untied).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, tied.join(f.file_name().unwrap())).unwrap();
    }
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tied.join("config.json")).unwrap()).unwrap();
    c["tie_word_embeddings"] = serde_json::Value::Bool(true);
    std::fs::write(tied.join("config.json"), c.to_string()).unwrap();
    for (dir, flag) in [(&untied, "q4"), (&tied, "q4"), (&untied, "nvfp4")] {
        let mode = QuantizeMode::parse(flag).unwrap();
        let f = mode.format();
        let what = format!("{} {f:?}", dir.display());
        let cfg = ModelConfig::from_dir(dir).unwrap();
        let store = WeightStore::open(dir).unwrap();
        let opts = crate::model::LoadOptions { quantize: Some(mode), quantize_lm_head: true, ..Default::default() };
        let host = ModelWeights::load(&store, &cfg, &QuantSource::new(dir, &store, &opts).unwrap()).unwrap();
        let quant = QuantLoad::new(dir, &opts).unwrap();
        assert!(quant.quantize_lm_head);
        let mut sink = HostSink::new(StorageDType::Bf16, true);
        let dev = build(&mut sink, &store, &cfg, &quant).unwrap();
        let head = same_quantized(&sink, dev.lm_head.as_ref().expect("a quantized head"), host.lm_head.as_ref().unwrap(), f, &format!("{what} lm_head"));
        assert!(dev.lm_head().is_none(), "{what}: no dense head matrix");
        // The embedding stays dense.
        let dense = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::default()).unwrap();
        same(&dev.embed, &dense.embed, "embed");
        let body = build(&mut HostSink::new(StorageDType::Bf16, true), &store, &cfg, &QuantLoad::quantize(Some(f))).unwrap();
        let dense_head = if cfg.tie_word_embeddings { 0 } else { 2 * 128 * 128 };
        assert_eq!(dev.bytes, body.bytes - dense_head + head, "{what}: bytes held");
        let planned = plan(&cfg, &store, WeightFormat::Bf16, &quant).unwrap();
        assert_eq!(planned.bytes, dev.bytes, "{what}: planned bytes");
        // `ninfer plan --quantize-lm-head` counts the same bytes and workspace.
        let tensors = crate::plan::model_tensors(&cfg, Some(&store)).unwrap();
        let mut input = gpu_plan(&cfg, &tensors);
        input.quantize = Some(crate::plan::QuantFormat::parse(flag).unwrap());
        input.quantize_lm_head = true;
        let (lines, total) = crate::plan::ledger::weight_lines(&input).unwrap();
        assert_eq!(total, dev.bytes as u64, "{what}: {lines:?}");
        assert_eq!(crate::plan::ledger::quant_workspace_bytes(&input), 2 * planned.quant_elems as u64, "{what}");
    }
    // Without --quantize it is refused, as on the CPU.
    let opts = crate::model::LoadOptions { quantize_lm_head: true, ..Default::default() };
    let e = QuantLoad::new(&untied, &opts).err().expect("needs --quantize").to_string();
    assert!(e.contains("needs --quantize"), "{e}");
}

#[test]
fn a_quantized_heads_workspace_is_a_chunk_of_vocabulary_rows() {
    let lin = |n: usize, k: usize, q: bool| DevLinear::<()> {
        w: (),
        n,
        k,
        format: if q { WeightFormat::Quant(crate::quant::QuantFormat::Q4G64F16S) } else { WeightFormat::Bf16 },
        bias: None,
        route: LinearRoute::quantized(),
        quant: None,
    };
    let chunk = crate::plan::ledger::QUANT_HEAD_CHUNK_ROWS;
    let body = [lin(3000, 512, true), lin(9000, 512, false)];
    // The body's largest quantized projection; a head larger than a chunk counts one chunk.
    assert_eq!(workspace_elems(&body, None), 3000 * 512);
    assert_eq!(workspace_elems(&body, Some(&lin(248320, 512, true))), chunk * 512);
    assert_eq!(workspace_elems(&body, Some(&lin(2000, 512, true))), 3000 * 512);
    assert_eq!(workspace_elems(&body, Some(&lin(248320, 512, false))), 3000 * 512);
}

/// The bytes of a dense load's projection weights (attention or GDN in/out, gate_up, down): what
/// a quantized load holds as payloads instead.
fn dense_projection_bytes(dense: &DevWeights<Vec<u16>, Vec<f32>>) -> usize {
    dense.layers.iter().map(|l| {
        let m = match &l.mixer {
            DevMixer::Attention(a) => a.qkv.w.len() + a.o.w.len(),
            DevMixer::Gdn(g) => g.in_proj.w.len() + g.out.w.len(),
        };
        2 * (m + l.gate_up.w.len() + l.down.w.len())
    }).sum()
}

/// The demo's DFlash drafter packs as the CPU drafter reads it: every tensor dense in the
/// storage type, norms as stored (a Qwen3 drafter: no `1 + w`), k|v and gate|up stacked in that
/// order, no biases; the plan counts the bytes the load sends. A drafter missing a tensor is
/// refused naming it.
#[test]
fn the_dflash_drafter_packs_dense_with_its_fused_projections_in_the_cpu_drafters_order() {
    use crate::model::cpu::dflash::DflashConfig;
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/ninfer/demo");
    let (target, dir) = (demo.join("model"), demo.join("dflash"));
    if !dir.join("model.safetensors").exists() {
        eprintln!("skipped: no demo drafter at {}", dir.display());
        return;
    }
    let cfg = ModelConfig::from_dir(&target).unwrap();
    let d = DflashConfig::from_dir(&dir).unwrap();
    let store = WeightStore::open(&dir).unwrap();
    let (h, hd, inter) = (d.hidden_size, d.head_dim, d.intermediate_size);
    let (qd, kvd) = (d.num_heads * hd, d.num_kv_heads * hd);
    let vals = |name: &str, shape: &[usize]| store.load_f32(name, shape).unwrap();
    let cat = |a: Vec<f32>, b: Vec<f32>| a.into_iter().chain(b).collect::<Vec<f32>>();
    for st in [StorageDType::Bf16, StorageDType::F16] {
        let w = build_dflash(&mut HostSink::new(st, true), &store, &cfg, &d).unwrap();
        let dense = |l: &super::Linear<Vec<u16>>, want: &[f32], n: usize, k: usize, what: &str| {
            assert_eq!((l.n, l.k, l.bias.is_none(), l.format), (n, k, true, WeightFormat::from(st)), "{what}");
            same(&l.w, &old_bits(want, st), what);
        };
        dense(&w.fc, &vals("fc.weight", &[h, d.target_layer_ids.len() * h]), h, d.target_layer_ids.len() * h, "fc");
        same(&w.hidden_norm, &old_bits(&vals("hidden_norm.weight", &[h]), st), "hidden_norm");
        same(&w.norm, &old_bits(&vals("norm.weight", &[h]), st), "norm");
        assert_eq!(w.layers.len(), d.num_layers);
        for (i, l) in w.layers.iter().enumerate() {
            let p = format!("layers.{i}");
            let a = format!("{p}.self_attn");
            same(&l.input_norm, &old_bits(&vals(&format!("{p}.input_layernorm.weight"), &[h]), st), "input_layernorm");
            same(&l.post_norm, &old_bits(&vals(&format!("{p}.post_attention_layernorm.weight"), &[h]), st), "post_attention_layernorm");
            same(&l.q_norm, &old_bits(&vals(&format!("{a}.q_norm.weight"), &[hd]), st), "q_norm");
            same(&l.k_norm, &old_bits(&vals(&format!("{a}.k_norm.weight"), &[hd]), st), "k_norm");
            dense(&l.q, &vals(&format!("{a}.q_proj.weight"), &[qd, h]), qd, h, "q_proj");
            dense(&l.kv, &cat(vals(&format!("{a}.k_proj.weight"), &[kvd, h]), vals(&format!("{a}.v_proj.weight"), &[kvd, h])), 2 * kvd, h, "k|v");
            dense(&l.o, &vals(&format!("{a}.o_proj.weight"), &[h, qd]), h, qd, "o_proj");
            let gate_up = cat(vals(&format!("{p}.mlp.gate_proj.weight"), &[inter, h]), vals(&format!("{p}.mlp.up_proj.weight"), &[inter, h]));
            dense(&l.gate_up, &gate_up, 2 * inter, h, "gate|up");
            dense(&l.down, &vals(&format!("{p}.mlp.down_proj.weight"), &[h, inter]), h, inter, "down_proj");
        }
        let planned = build_dflash(&mut PlanSink::new(st.into()), &store, &cfg, &d).unwrap().bytes;
        assert_eq!(planned, w.bytes, "planned drafter bytes");
        assert_eq!(w.bytes, 2 * store.names().iter().map(|n| store.info(n).unwrap().shape.iter().product::<usize>()).sum::<usize>(), "every tensor, 2 bytes an element");
    }
    let mut more = d.clone();
    more.num_layers += 1;
    let e = build_dflash(&mut PlanSink::new(WeightFormat::Bf16), &store, &cfg, &more).err().expect("a layer the checkpoint lacks").to_string();
    assert!(e.contains(&format!("layers.{}", d.num_layers)), "{e}");
}
