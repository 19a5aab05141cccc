//! The HF `config.json` of a model directory, parsed into the one struct the model code reads.
//!
//! Every architecture we run maps onto the same decoder skeleton; the differences (biases, q/k
//! norms, the attention output gate, zero-centred norms, linear-attention layers) become flags
//! here, so that the layer code branches on data rather than on architecture names.

use std::path::Path;

use serde_json::{Map, Value};

use super::rope::RopeConfig;
use crate::{NinferError, Result};

/// HF architecture names this crate can run.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
];

/// Architecture family: decides the weight names and the layer variants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ArchFamily {
    /// Llama: optional attention/MLP biases, plain RMSNorm.
    #[default]
    Llama,
    /// Qwen2: q/k/v biases.
    Qwen2,
    /// Qwen3: per-head q/k RMSNorm.
    Qwen3,
    /// Hybrid Gated DeltaNet + gated attention (Qwen3.5 / Qwen3.6 dense).
    Qwen3_5,
}

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Softmax attention over the paged KV cache.
    FullAttention,
    /// Gated DeltaNet with a recurrent state slot.
    LinearAttention,
}

impl LayerType {
    /// The name transformers uses in `layer_types`.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerType::FullAttention => "full_attention",
            LayerType::LinearAttention => "linear_attention",
        }
    }
}

/// Shapes of the Gated DeltaNet layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    /// Query/key heads.
    pub num_key_heads: usize,
    /// Value heads (a multiple of the key heads).
    pub num_value_heads: usize,
    /// Width of a query/key head.
    pub key_head_dim: usize,
    /// Width of a value head.
    pub value_head_dim: usize,
    /// Depthwise causal conv kernel width.
    pub conv_kernel: usize,
}

impl LinearAttentionConfig {
    /// Total query (= key) width.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    /// Total value width.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
    /// Channels of the conv (q, k and v concatenated).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Values of one layer's conv state for one sequence (the last `conv_kernel - 1` inputs of
    /// every channel).
    pub fn conv_floats(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1)
    }
    /// Values of one layer's delta-rule state for one sequence: a dk x dv matrix per value head,
    /// the slot stride of every recurrent and chunked kernel.
    pub fn delta_floats(&self) -> usize {
        self.num_value_heads * self.key_head_dim * self.value_head_dim
    }
    /// Values of one layer's recurrent state for one sequence (conv + delta state): a size, not
    /// a slot stride (the two states live in separate buffers, strided by `conv_floats` and
    /// `delta_floats`).
    pub fn state_floats(&self) -> usize {
        self.conv_floats() + self.delta_floats()
    }
}

/// Parsed HF model config (the text model only).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelConfig {
    /// The HF architecture name from `architectures[0]`.
    pub architecture: String,
    /// Which weight names and layer variants apply.
    pub family: ArchFamily,
    /// Rows of the embedding and LM head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads of the attention layers.
    pub num_attention_heads: usize,
    /// KV heads (GQA) of the attention layers.
    pub num_kv_heads: usize,
    /// Width of an attention head.
    pub head_dim: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Longest context the model was configured for.
    pub max_position_embeddings: usize,
    /// lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// o_proj carries a bias.
    pub o_bias: bool,
    /// gate/up/down projections carry a bias.
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Qwen3.5).
    pub qk_norm: bool,
    /// q_proj also produces a sigmoid gate on the attention output (Qwen3.5).
    pub attn_output_gate: bool,
    /// RMSNorm weights are stored zero-centred and applied as `1 + w` (Qwen3.5).
    pub zero_centered_norm: bool,
    /// Token mixer per layer.
    pub layer_types: Vec<LayerType>,
    /// Rotary embedding parameters.
    pub rope: RopeConfig,
    /// Present when some layer is `LinearAttention`.
    pub linear_attention: Option<LinearAttentionConfig>,
    /// MTP layers the config declares (`mtp_num_hidden_layers`; 0 when absent).
    pub mtp_num_layers: usize,
    /// `eos_token_id` of config.json (int or list), a fallback for generation_config.json.
    pub eos_token_ids: Vec<u32>,
}

/// Typed accessors over one JSON object that name the missing/invalid field in errors.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| NinferError::config(self.name(key), format!("expected a non-negative integer, got {v}"))),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let n = self.opt_usize(key)?.ok_or_else(|| NinferError::config(self.name(key), "missing from config.json"))?;
        if n == 0 {
            return Err(NinferError::config(self.name(key), "must be positive, got 0"));
        }
        Ok(n)
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| NinferError::config(self.name(key), format!("expected a number, got {v}"))),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(NinferError::config(self.name(key), format!("expected a boolean, got {v}"))),
        }
    }
    fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::String(s)) => Ok(s.as_str()),
            Some(v) => Err(NinferError::config(self.name(key), format!("expected a string, got {v}"))),
        }
    }
}

/// Token ids from an `eos_token_id` value (int, list of ints, or null).
pub(crate) fn token_id_list(v: Option<&Value>, field: &str) -> Result<Vec<u32>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Number(n)) => n.as_u64().map(|i| vec![i as u32]).ok_or_else(|| NinferError::config(field, format!("expected a token id, got {n}"))),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_u64().map(|i| i as u32).ok_or_else(|| NinferError::config(field, format!("expected token ids, got {i}"))))
            .collect(),
        Some(other) => Err(NinferError::config(field, format!("expected an int or a list of ints, got {other}"))),
    }
}

impl ModelConfig {
    /// For each layer, its index among the layers of its own type: the KV cache is indexed by
    /// attention layers and the recurrent state by linear-attention layers.
    pub fn cache_index(&self) -> Vec<usize> {
        let (mut n_attn, mut n_lin) = (0, 0);
        self.layer_types
            .iter()
            .map(|t| {
                let n = match t {
                    LayerType::FullAttention => &mut n_attn,
                    LayerType::LinearAttention => &mut n_lin,
                };
                *n += 1;
                *n - 1
            })
            .collect()
    }

    /// Read `config.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(NinferError::MissingFile { path, what: "the HF model config (config.json)".into() });
        }
        let text = std::fs::read_to_string(&path).map_err(|e| NinferError::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    /// Parse config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| NinferError::malformed(path, e.to_string()))?;
        let root = root.as_object().ok_or_else(|| NinferError::malformed(path, "config.json is not a JSON object"))?;
        let architecture = match root.get("architectures") {
            Some(Value::Array(a)) if !a.is_empty() => {
                a[0].as_str().ok_or_else(|| NinferError::config("architectures", "expected a list of strings"))?.to_string()
            }
            _ => return Err(NinferError::config("architectures", "missing from config.json (expected e.g. [\"LlamaForCausalLM\"])")),
        };
        let family = match architecture.as_str() {
            "LlamaForCausalLM" => ArchFamily::Llama,
            "Qwen2ForCausalLM" => ArchFamily::Qwen2,
            "Qwen3ForCausalLM" => ArchFamily::Qwen3,
            "Qwen3_5ForCausalLM" | "Qwen3_5ForConditionalGeneration" => ArchFamily::Qwen3_5,
            _ => {
                return Err(NinferError::UnsupportedArchitecture {
                    name: architecture,
                    supported: SUPPORTED_ARCHITECTURES.iter().map(|s| s.to_string()).collect(),
                })
            }
        };
        let (text_cfg, prefix) = match root.get("text_config") {
            Some(Value::Object(t)) if architecture == "Qwen3_5ForConditionalGeneration" => (t, "text_config."),
            None | Some(Value::Null) if architecture == "Qwen3_5ForConditionalGeneration" => {
                return Err(NinferError::config("text_config", "missing from config.json"))
            }
            _ => (root, ""),
        };
        let f = Fields { obj: text_cfg, prefix };
        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_kv_heads == 0 || num_attention_heads % num_kv_heads != 0 {
            return Err(NinferError::config(
                f.name("num_key_value_heads"),
                format!("{num_kv_heads} does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) if d > 0 => d,
            _ => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(NinferError::config(f.name("head_dim"), "missing and hidden_size is not a multiple of num_attention_heads"));
                }
                hidden_size / num_attention_heads
            }
        };
        let num_layers = f.usize("num_hidden_layers")?;
        let max_position_embeddings = f.opt_usize("max_position_embeddings")?.unwrap_or(match family {
            ArchFamily::Llama => 2048,
            _ => 32768,
        });
        let act = match f.obj.get("hidden_activation") {
            Some(Value::String(s)) => s.as_str(),
            _ => f.str_or("hidden_act", "silu")?,
        };
        if act != "silu" && act != "swish" {
            return Err(NinferError::config(f.name("hidden_act"), format!("`{act}` is not supported; only silu")));
        }
        if f.bool_or("use_sliding_window", false)? {
            return Err(NinferError::Unsupported(format!("{}use_sliding_window=true (sliding-window attention)", prefix)));
        }
        let is_qwen35 = family == ArchFamily::Qwen3_5;
        let layer_types = match f.obj.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v.as_str() {
                    Some("full_attention") => Ok(LayerType::FullAttention),
                    Some("linear_attention") if is_qwen35 => Ok(LayerType::LinearAttention),
                    _ => Err(NinferError::config(f.name("layer_types"), format!("unsupported layer type {v}"))),
                })
                .collect::<Result<Vec<_>>>()?,
            None | Some(Value::Null) if is_qwen35 => {
                let interval = f.opt_usize("full_attention_interval")?.unwrap_or(4).max(1);
                (0..num_layers)
                    .map(|i| if (i + 1) % interval != 0 { LayerType::LinearAttention } else { LayerType::FullAttention })
                    .collect()
            }
            None | Some(Value::Null) => vec![LayerType::FullAttention; num_layers],
            Some(v) => return Err(NinferError::config(f.name("layer_types"), format!("expected a list, got {v}"))),
        };
        if layer_types.len() != num_layers {
            return Err(NinferError::config(
                f.name("layer_types"),
                format!("has {} entries but num_hidden_layers is {num_layers}", layer_types.len()),
            ));
        }
        let linear_attention = if layer_types.contains(&LayerType::LinearAttention) {
            let la = LinearAttentionConfig {
                num_key_heads: f.usize("linear_num_key_heads")?,
                num_value_heads: f.usize("linear_num_value_heads")?,
                key_head_dim: f.usize("linear_key_head_dim")?,
                value_head_dim: f.usize("linear_value_head_dim")?,
                conv_kernel: f.usize("linear_conv_kernel_dim")?,
            };
            if !la.num_value_heads.is_multiple_of(la.num_key_heads) {
                return Err(NinferError::config(
                    f.name("linear_num_value_heads"),
                    format!("{} is not a multiple of linear_num_key_heads {}", la.num_value_heads, la.num_key_heads),
                ));
            }
            if la.conv_kernel < 2 {
                return Err(NinferError::config(f.name("linear_conv_kernel_dim"), "must be at least 2"));
            }
            Some(la)
        } else {
            None
        };
        let rope = RopeConfig::from_config(f.obj, max_position_embeddings, if is_qwen35 { 0.25 } else { 1.0 })?;
        let rot = rope.rotary_dim(head_dim);
        if rot == 0 || rot % 2 != 0 {
            return Err(NinferError::config(
                f.name("partial_rotary_factor"),
                format!("gives {rot} rotary dims of head_dim {head_dim}; must be even and positive"),
            ));
        }
        let eps = f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        let attention_bias = f.bool_or("attention_bias", false)?;
        let tie = match root.get("tie_word_embeddings") {
            Some(Value::Bool(b)) => *b,
            _ => Fields { obj: f.obj, prefix }.bool_or("tie_word_embeddings", false)?,
        };
        let eos_token_ids = match text_cfg.get("eos_token_id") {
            Some(v) if !v.is_null() => token_id_list(Some(v), &f.name("eos_token_id"))?,
            _ => token_id_list(root.get("eos_token_id"), "eos_token_id")?,
        };
        Ok(ModelConfig {
            architecture,
            family,
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_layers,
            num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: eps as f32,
            max_position_embeddings,
            tie_word_embeddings: tie,
            qkv_bias: family == ArchFamily::Qwen2 || attention_bias,
            o_bias: family != ArchFamily::Qwen2 && attention_bias,
            mlp_bias: family == ArchFamily::Llama && f.bool_or("mlp_bias", false)?,
            qk_norm: matches!(family, ArchFamily::Qwen3 | ArchFamily::Qwen3_5),
            attn_output_gate: is_qwen35,
            zero_centered_norm: is_qwen35,
            layer_types,
            rope,
            linear_attention,
            mtp_num_layers: f.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0),
            eos_token_ids,
        })
    }

    /// Number of layers with a KV cache.
    pub fn num_attention_layers(&self) -> usize {
        self.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count()
    }

    /// Number of Gated DeltaNet layers (with a recurrent state).
    pub fn num_linear_layers(&self) -> usize {
        self.layer_types.iter().filter(|t| **t == LayerType::LinearAttention).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<ModelConfig> {
        ModelConfig::from_json_str(&v.to_string(), Path::new("/m/config.json"))
    }

    fn llama() -> serde_json::Value {
        serde_json::json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 100,
            "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 300,
            "eos_token_id": [2, 5]})
    }

    #[test]
    fn llama_config_fills_defaults() {
        let c = parse(llama()).unwrap();
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.family, ArchFamily::Llama);
        assert_eq!(c.layer_types, vec![LayerType::FullAttention; 2]);
        assert_eq!(c.eos_token_ids, vec![2, 5]);
        assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
    }

    #[test]
    fn unknown_architecture_lists_supported_ones() {
        let mut v = llama();
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("GPT2LMHeadModel") && e.contains("Qwen3_5ForCausalLM"), "{e}");
    }

    #[test]
    fn missing_field_is_named() {
        let mut v = llama();
        v.as_object_mut().unwrap().remove("intermediate_size");
        let e = parse(v).unwrap_err();
        assert!(matches!(&e, NinferError::Config { field, .. } if field == "intermediate_size"), "{e}");
    }

    #[test]
    fn qwen3_5_text_config_is_read_under_text_config() {
        let v = serde_json::json!({"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": false,
            "text_config": {"hidden_size": 40, "intermediate_size": 70, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "mrope_section": [1,1,0]}}});
        let c = parse(v).unwrap();
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.layer_types[0], LayerType::LinearAttention);
        assert_eq!(c.rope.rotary_dim(16), 4);
        assert!(c.attn_output_gate && c.zero_centered_norm);
        assert_eq!(c.linear_attention.unwrap().conv_dim(), 2 * 16 + 48);
    }
}
