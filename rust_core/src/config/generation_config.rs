//! `generation_config.json`: the model's end-of-sequence ids and default sampling values.
//!
//! The file is optional (many converted checkpoints lack it); when absent, the EOS ids come from
//! config.json so that generation still stops where the model was trained to stop. This is the
//! one parser of the file: `LLM`, the async engine and `ninfer serve` read its sampling defaults
//! from here (through `_core`), so a model samples the same way from Python and over HTTP.

use std::path::Path;

use serde_json::Value;

use super::model_config::token_id_list;
use crate::{NinferError, Result};

/// Defaults from generation_config.json.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// The sampling fields the file sets (the ones vLLM honours), for requests that set none.
    pub sampling: SamplingDefaults,
}

/// Sampling fields a model ships as defaults, under the request's field names. Numbers stay f64
/// so that `0.7` in the file is `0.7` in Python, not its f32 rounding.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    /// `temperature`; 0 when the file says `do_sample: false` (greedy, as in transformers).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// `top_k`; a negative value means none (0).
    pub top_k: Option<u64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// `max_new_tokens`: the request's `max_tokens` default.
    pub max_tokens: Option<u64>,
}

impl GenerationConfig {
    /// Read `generation_config.json` from a model directory; when it is missing, fall back to
    /// config.json's `eos_token_id` (top level or `text_config`), and when that is missing too,
    /// return empty defaults.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if path.exists() {
            let text = std::fs::read_to_string(&path).map_err(|e| NinferError::io(&path, e))?;
            return Self::from_json_str(&text, &path);
        }
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            return Ok(GenerationConfig::default());
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| NinferError::io(&cfg_path, e))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| NinferError::malformed(&cfg_path, e.to_string()))?;
        let eos = match root.get("eos_token_id") {
            Some(v) if !v.is_null() => token_id_list(Some(v), "eos_token_id")?,
            _ => token_id_list(root.get("text_config").and_then(|t| t.get("eos_token_id")), "text_config.eos_token_id")?,
        };
        Ok(GenerationConfig { eos_token_ids: eos, ..Default::default() })
    }

    /// Parse generation_config.json text; `path` names the file in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| NinferError::malformed(path, e.to_string()))?;
        let obj = root.as_object().ok_or_else(|| NinferError::malformed(path, "not a JSON object"))?;
        let bad = |key: &str, want: &str, v: &Value| NinferError::malformed(path, format!("`{key}` must be {want}, got {v}"));
        let float = |key: &str| -> Result<Option<f64>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(key, "a number", v)),
            }
        };
        let top_k = match obj.get("top_k") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_i64().ok_or_else(|| bad("top_k", "an integer", v))?.max(0) as u64),
        };
        let max_tokens = match obj.get("max_new_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&n| n >= 1).ok_or_else(|| bad("max_new_tokens", "a positive integer", v))?),
        };
        let mut temperature = float("temperature")?;
        if obj.get("do_sample") == Some(&Value::Bool(false)) {
            temperature = Some(0.0);
        }
        Ok(GenerationConfig {
            eos_token_ids: token_id_list(obj.get("eos_token_id"), "generation_config.eos_token_id")?,
            sampling: SamplingDefaults {
                temperature,
                top_p: float("top_p")?,
                top_k,
                min_p: float("min_p")?,
                repetition_penalty: float("repetition_penalty")?,
                max_tokens,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<GenerationConfig> {
        GenerationConfig::from_json_str(text, Path::new("m/generation_config.json"))
    }

    #[test]
    fn eos_accepts_int_or_list_and_reads_sampling_defaults() {
        let g = parse(r#"{"eos_token_id": 7, "temperature": 0.6, "top_k": 20, "max_new_tokens": 512}"#).unwrap();
        assert_eq!(g.eos_token_ids, vec![7]);
        assert_eq!(g.sampling.temperature, Some(0.6));
        assert_eq!(g.sampling.top_k, Some(20));
        assert_eq!(g.sampling.top_p, None);
        assert_eq!(g.sampling.max_tokens, Some(512));
        let g = parse(r#"{"eos_token_id": [1, 2]}"#).unwrap();
        assert_eq!(g.eos_token_ids, vec![1, 2]);
        assert_eq!(g.sampling, SamplingDefaults::default());
    }

    #[test]
    fn do_sample_false_is_greedy_and_a_negative_top_k_is_none() {
        let g = parse(r#"{"do_sample": false, "temperature": 0.7, "top_k": -1, "repetition_penalty": 1.05}"#).unwrap();
        let want = SamplingDefaults { temperature: Some(0.0), top_k: Some(0), repetition_penalty: Some(1.05), ..Default::default() };
        assert_eq!(g.sampling, want);
    }

    #[test]
    fn bad_values_name_the_file_and_the_field() {
        let e = parse(r#"{"eos_token_id": "x"}"#).unwrap_err();
        assert!(e.to_string().contains("eos_token_id"), "{e}");
        for (text, field) in [(r#"{"temperature": "hot"}"#, "temperature"), (r#"{"max_new_tokens": 0}"#, "max_new_tokens"), ("[1]", "not a JSON object")] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("generation_config.json"), "{e}");
        }
    }
}
