//! Placeholder: the model owner replaces this with the generation_config.json reader.
//! `from_dir` is the minimal form the engine needs until then (EOS ids only).

use std::path::Path;

use crate::{NinferError, Result};

/// Defaults from generation_config.json.
#[derive(Clone, Debug, Default)]
pub struct GenerationConfig {
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
}

impl GenerationConfig {
    /// Read `eos_token_id` (an int or a list) from generation_config.json, else config.json;
    /// neither file present gives no EOS ids.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        for name in ["generation_config.json", "config.json"] {
            let path = dir.join(name);
            if !path.exists() {
                continue;
            }
            let text = std::fs::read_to_string(&path).map_err(|e| NinferError::io(&path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| NinferError::malformed(&path, e.to_string()))?;
            let ids: Vec<u32> = match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
                _ => continue,
            };
            return Ok(GenerationConfig { eos_token_ids: ids });
        }
        Ok(GenerationConfig::default())
    }
}
