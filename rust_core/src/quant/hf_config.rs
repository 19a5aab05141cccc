//! Reading a Hugging Face `quantization_config` into the [`QuantFormat`] of the checkpoint's
//! linear weights and the names of the tensors each quantized module stores.
//!
//! Accepted: `quant_method: "fp8"` with `fmt: "e4m3"` and `weight_block_size` (the official
//! "-FP8" Qwen releases); `"awq"` 4-bit GEMM with zero points; `"gptq"` 4-bit
//! (`checkpoint_format` "gptq" or "gptq_v2"); `"compressed-tensors"` with one config group that is
//! either 4-bit int weights in "pack-quantized" format (group or channel strategy, no activation
//! quantization) or 8-bit float weights with block strategy in "float-quantized" format.
//! Anything else is refused as not supported yet, naming the field.
//!
//! Which modules are quantized is read from the checkpoint itself, not from the config's ignore
//! lists: a module is quantized when its data tensor (`qweight`, `weight_packed`, or an F8_E4M3
//! `weight`) is present, and loads as a dense weight otherwise.

use serde_json::Value;

use super::QuantFormat;
use crate::{NinferError, Result};

/// The quantization of a checkpoint's linear weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfQuantConfig {
    pub format: QuantFormat,
    /// Suffixes of the data, scale, zero-point and g_idx tensors after the module name (`None`
    /// where the format has no such tensor).
    pub suffixes: [Option<&'static str>; 4],
}

/// The names of the tensors one quantized module stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTensorNames {
    pub data: String,
    pub scale: String,
    pub zero: Option<String>,
    /// Optional even in formats that define it (present in act-order checkpoints).
    pub g_idx: Option<String>,
}

fn field<'a>(q: &'a Value, key: &str) -> Option<&'a Value> {
    q.get(key).filter(|v| !v.is_null())
}

fn unsupported(what: String) -> NinferError {
    NinferError::Unsupported(format!("quantization_config {what}"))
}

fn usize_field(q: &Value, key: &str, ctx: &str) -> Result<i64> {
    field(q, key)
        .and_then(Value::as_i64)
        .ok_or_else(|| NinferError::config(format!("quantization_config.{ctx}{key}"), "missing or not an integer"))
}

fn bits4(q: &Value, key: &str, ctx: &str) -> Result<()> {
    match usize_field(q, key, ctx)? {
        4 => Ok(()),
        b => Err(unsupported(format!("{ctx}{key}={b} (4-bit only)"))),
    }
}

fn group_size(q: &Value, ctx: &str) -> Result<usize> {
    match usize_field(q, "group_size", ctx)? {
        -1 => Ok(0),
        g if g > 0 && g % 8 == 0 => Ok(g as usize),
        g => Err(NinferError::config(format!("quantization_config.{ctx}group_size"), format!("{g} is not -1 or a positive multiple of 8"))),
    }
}

impl HfQuantConfig {
    /// The quantization a model `config.json` declares; `None` when it has no
    /// `quantization_config` (a dense checkpoint).
    pub fn from_model_config(config: &Value) -> Result<Option<HfQuantConfig>> {
        let Some(q) = field(config, "quantization_config") else { return Ok(None) };
        let method = field(q, "quant_method").and_then(Value::as_str).unwrap_or("");
        let cfg = match method {
            "fp8" => {
                if let Some(fmt) = field(q, "fmt").and_then(Value::as_str).filter(|f| *f != "e4m3") {
                    return Err(unsupported(format!("fp8 fmt={fmt:?} (e4m3 only)")));
                }
                let Some(block) = field(q, "weight_block_size").and_then(Value::as_array) else {
                    return Err(unsupported("fp8 without weight_block_size (per-tensor FP8)".into()));
                };
                let dims: Vec<usize> = block.iter().filter_map(Value::as_u64).map(|d| d as usize).filter(|&d| d > 0).collect();
                if dims.len() != 2 || block.len() != 2 {
                    return Err(NinferError::config("quantization_config.weight_block_size", format!("{block:?} is not two positive integers")));
                }
                HfQuantConfig { format: QuantFormat::HfFp8Block { block_n: dims[0], block_k: dims[1] }, suffixes: [Some("weight"), Some("weight_scale_inv"), None, None] }
            }
            "awq" => {
                bits4(q, "bits", "")?;
                if let Some(v) = field(q, "version").and_then(Value::as_str).filter(|v| !v.eq_ignore_ascii_case("gemm")) {
                    return Err(unsupported(format!("awq version={v:?} (GEMM packing only)")));
                }
                if field(q, "zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(unsupported("awq zero_point=false".into()));
                }
                HfQuantConfig { format: QuantFormat::Awq4 { group: group_size(q, "")? }, suffixes: [Some("qweight"), Some("scales"), Some("qzeros"), None] }
            }
            "gptq" => {
                bits4(q, "bits", "")?;
                let zero_plus_one = match field(q, "checkpoint_format").and_then(Value::as_str).unwrap_or("gptq") {
                    "gptq" => true,
                    "gptq_v2" => false,
                    other => return Err(unsupported(format!("gptq checkpoint_format={other:?}"))),
                };
                HfQuantConfig {
                    format: QuantFormat::Gptq4 { group: group_size(q, "")?, zero_plus_one },
                    suffixes: [Some("qweight"), Some("scales"), Some("qzeros"), Some("g_idx")],
                }
            }
            "compressed-tensors" => compressed_tensors(q)?,
            other => return Err(unsupported(format!("quant_method={other:?}; supported: fp8, awq, gptq, compressed-tensors"))),
        };
        Ok(Some(cfg))
    }

    /// Tensor names of the quantized module `module` (e.g. `model.layers.0.mlp.down_proj`).
    pub fn tensor_names(&self, module: &str) -> HfTensorNames {
        let name = |s: Option<&str>| s.map(|s| format!("{module}.{s}"));
        HfTensorNames {
            data: name(self.suffixes[0]).unwrap(),
            scale: name(self.suffixes[1]).unwrap(),
            zero: name(self.suffixes[2]),
            g_idx: name(self.suffixes[3]),
        }
    }
}

fn compressed_tensors(q: &Value) -> Result<HfQuantConfig> {
    let groups = field(q, "config_groups").and_then(Value::as_object).ok_or_else(|| NinferError::config("quantization_config.config_groups", "missing"))?;
    if groups.len() != 1 {
        return Err(unsupported(format!("compressed-tensors with {} config groups (one only)", groups.len())));
    }
    let (gname, group) = groups.iter().next().unwrap();
    let ctx = format!("config_groups.{gname}.weights.");
    if field(group, "input_activations").is_some() {
        return Err(unsupported(format!("compressed-tensors config_groups.{gname}.input_activations (activation quantization)")));
    }
    let w = field(group, "weights").ok_or_else(|| NinferError::config(format!("quantization_config.config_groups.{gname}.weights"), "missing"))?;
    let format = field(group, "format").or_else(|| field(q, "format")).and_then(Value::as_str).unwrap_or("");
    let kind = field(w, "type").and_then(Value::as_str).unwrap_or("int");
    let strategy = field(w, "strategy").and_then(Value::as_str).unwrap_or("");
    match (format, kind) {
        ("pack-quantized", "int") => {
            bits4(w, "num_bits", &ctx)?;
            let group = match strategy {
                "group" => group_size(w, &ctx)?,
                "channel" => 0,
                other => return Err(unsupported(format!("{ctx}strategy={other:?} for pack-quantized (group or channel)"))),
            };
            let symmetric = field(w, "symmetric").and_then(Value::as_bool).unwrap_or(true);
            Ok(HfQuantConfig {
                format: QuantFormat::PackQuantized4 { group, symmetric },
                suffixes: [Some("weight_packed"), Some("weight_scale"), (!symmetric).then_some("weight_zero_point"), Some("weight_g_idx")],
            })
        }
        ("float-quantized", "float") => {
            if usize_field(w, "num_bits", &ctx)? != 8 || strategy != "block" {
                return Err(unsupported(format!("{ctx}: float-quantized other than 8-bit block strategy")));
            }
            let block = field(w, "block_structure").and_then(Value::as_array).map(|b| b.iter().filter_map(Value::as_u64).map(|d| d as usize).collect::<Vec<_>>());
            match block.as_deref() {
                Some(&[bn, bk]) if bn > 0 && bk > 0 => Ok(HfQuantConfig {
                    format: QuantFormat::HfFp8Block { block_n: bn, block_k: bk },
                    suffixes: [Some("weight"), Some("weight_scale"), None, None],
                }),
                _ => Err(NinferError::config(format!("quantization_config.{ctx}block_structure"), "missing or not two positive integers")),
            }
        }
        (f, k) => Err(unsupported(format!("compressed-tensors format={f:?} with {k} weights (pack-quantized int4 or float-quantized fp8 block only)"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(q: Value) -> Result<Option<HfQuantConfig>> {
        HfQuantConfig::from_model_config(&json!({ "quantization_config": q }))
    }

    #[test]
    fn qwen_fp8_release_config_reads_as_128x128_blocks() {
        let c = parse(json!({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]})).unwrap().unwrap();
        assert_eq!(c.format, QuantFormat::HfFp8Block { block_n: 128, block_k: 128 });
        let names = c.tensor_names("model.layers.0.mlp.up_proj");
        assert_eq!(names.scale, "model.layers.0.mlp.up_proj.weight_scale_inv");
        assert_eq!(names.zero, None);
    }

    #[test]
    fn awq_and_gptq_configs_read_group_and_zero_convention() {
        let c = parse(json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"})).unwrap().unwrap();
        assert_eq!(c.format, QuantFormat::Awq4 { group: 128 });
        assert_eq!(c.tensor_names("m").data, "m.qweight");
        let c = parse(json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": true, "sym": true})).unwrap().unwrap();
        assert_eq!(c.format, QuantFormat::Gptq4 { group: 0, zero_plus_one: true });
        let c = parse(json!({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"})).unwrap().unwrap();
        assert_eq!(c.format, QuantFormat::Gptq4 { group: 32, zero_plus_one: false });
        let e = parse(json!({"quant_method": "gptq", "bits": 3, "group_size": 128})).unwrap_err().to_string();
        assert!(e.contains("bits=3") && e.contains("not supported yet"), "{e}");
    }

    #[test]
    fn compressed_tensors_pack_quantized_and_fp8_block_configs() {
        let c = parse(json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                "weights": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group", "group_size": 128}}}
        }))
        .unwrap()
        .unwrap();
        assert_eq!(c.format, QuantFormat::PackQuantized4 { group: 128, symmetric: false });
        assert_eq!(c.tensor_names("m").zero.as_deref(), Some("m.weight_zero_point"));
        let c = parse(json!({
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}
        }))
        .unwrap()
        .unwrap();
        assert_eq!(c.format, QuantFormat::HfFp8Block { block_n: 128, block_k: 128 });
        assert_eq!(c.tensor_names("m").scale, "m.weight_scale");
        let e = parse(json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"input_activations": {"num_bits": 8},
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}
        }))
        .unwrap_err()
        .to_string();
        assert!(e.contains("input_activations"), "{e}");
    }

    #[test]
    fn dense_config_has_no_quantization_and_unknown_methods_are_refused() {
        assert_eq!(HfQuantConfig::from_model_config(&json!({"hidden_size": 8})).unwrap(), None);
        let e = parse(json!({"quant_method": "bitsandbytes"})).unwrap_err().to_string();
        assert!(e.contains("bitsandbytes") && e.contains("not supported yet"), "{e}");
    }
}
