//! `generation_config.json`: the model's end-of-sequence ids and default sampling values.
//!
//! The file is optional (many converted checkpoints lack it); when absent, the EOS ids come from
//! config.json so that generation still stops where the model was trained to stop.

use std::path::Path;

use serde_json::Value;

use super::model_config::token_id_list;
use crate::{NinferError, Result};

/// Defaults from generation_config.json.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Default sampling temperature, if the model ships one.
    pub temperature: Option<f32>,
    /// Default nucleus threshold, if the model ships one.
    pub top_p: Option<f32>,
    /// Default top-k, if the model ships one (0 disables).
    pub top_k: Option<usize>,
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

    /// Parse generation_config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| NinferError::malformed(path, e.to_string()))?;
        let obj = root.as_object().ok_or_else(|| NinferError::malformed(path, "not a JSON object"))?;
        let float = |key: &str| -> Result<Option<f32>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| NinferError::config(format!("generation_config.{key}"), format!("expected a number, got {v}"))),
            }
        };
        let top_k = match obj.get("top_k") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_i64().ok_or_else(|| NinferError::config("generation_config.top_k", format!("expected an integer, got {v}")))?.max(0) as usize),
        };
        Ok(GenerationConfig {
            eos_token_ids: token_id_list(obj.get("eos_token_id"), "generation_config.eos_token_id")?,
            temperature: float("temperature")?,
            top_p: float("top_p")?,
            top_k,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eos_accepts_int_or_list_and_reads_sampling_defaults() {
        let g = GenerationConfig::from_json_str(r#"{"eos_token_id": 7, "temperature": 0.6, "top_k": 20}"#, Path::new("g")).unwrap();
        assert_eq!(g.eos_token_ids, vec![7]);
        assert_eq!(g.temperature, Some(0.6));
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.top_p, None);
        let g = GenerationConfig::from_json_str(r#"{"eos_token_id": [1, 2]}"#, Path::new("g")).unwrap();
        assert_eq!(g.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn bad_eos_names_the_field() {
        let e = GenerationConfig::from_json_str(r#"{"eos_token_id": "x"}"#, Path::new("g")).unwrap_err();
        assert!(e.to_string().contains("eos_token_id"), "{e}");
    }
}
