//! Rotary position embedding parameters and their inverse frequencies.
//!
//! transformers 5 writes these under `rope_parameters` (older checkpoints: `rope_scaling` plus a
//! top-level `rope_theta`); both spellings parse to one `RopeConfig`. The frequency formulas
//! follow `transformers.modeling_rope_utils` so that logits match the oracle.

use serde_json::{Map, Value};

use crate::{NinferError, Result};

/// How the base frequencies are rescaled for longer contexts.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    #[default]
    Default,
    /// Positions divided by `factor` (frequencies divided by it).
    Linear { factor: f64 },
    /// Llama 3.1 piecewise scaling by wavelength.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// YaRN: ramp between interpolated and extrapolated frequencies, plus an attention factor.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
    },
}

/// Everything needed to build the cos/sin tables of one model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RopeConfig {
    /// Base wavelength (`rope_theta`).
    pub theta: f64,
    /// Fraction of the head dimension that is rotated (Qwen3.5: 0.25).
    pub partial_rotary_factor: f64,
    /// Frequency rescaling.
    pub scaling: RopeScaling,
}

fn num(obj: &Map<String, Value>, key: &str) -> Option<f64> {
    obj.get(key).and_then(Value::as_f64)
}

fn required(obj: &Map<String, Value>, key: &str, kind: &str) -> Result<f64> {
    num(obj, key).ok_or_else(|| NinferError::config(format!("rope_parameters.{key}"), format!("required for rope_type {kind}")))
}

impl RopeConfig {
    /// Parse from a (text) config object. `default_partial` is the architecture's default
    /// rotary fraction when the config does not say.
    pub fn from_config(cfg: &Map<String, Value>, max_position_embeddings: usize, default_partial: f64) -> Result<Self> {
        let empty = Map::new();
        let params = match cfg.get("rope_parameters").filter(|v| !v.is_null()).or_else(|| cfg.get("rope_scaling").filter(|v| !v.is_null())) {
            Some(Value::Object(m)) => m,
            Some(_) => return Err(NinferError::config("rope_parameters", "expected an object")),
            None => &empty,
        };
        let theta = num(params, "rope_theta").or_else(|| num(cfg, "rope_theta")).unwrap_or(10_000.0);
        if theta.is_nan() || theta <= 0.0 {
            return Err(NinferError::config("rope_theta", format!("must be positive, got {theta}")));
        }
        let partial = num(params, "partial_rotary_factor").or_else(|| num(cfg, "partial_rotary_factor")).unwrap_or(default_partial);
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(NinferError::config("partial_rotary_factor", format!("must be in (0, 1], got {partial}")));
        }
        let kind = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str).unwrap_or("default");
        let original = num(params, "original_max_position_embeddings")
            .or_else(|| num(cfg, "original_max_position_embeddings"))
            .unwrap_or(max_position_embeddings as f64);
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: required(params, "factor", kind)? },
            "llama3" => RopeScaling::Llama3 {
                factor: required(params, "factor", kind)?,
                low_freq_factor: required(params, "low_freq_factor", kind)?,
                high_freq_factor: required(params, "high_freq_factor", kind)?,
                original_max_position_embeddings: original,
            },
            "yarn" => RopeScaling::Yarn {
                factor: num(params, "factor").unwrap_or(max_position_embeddings as f64 / original),
                original_max_position_embeddings: original,
                attention_factor: num(params, "attention_factor"),
                mscale: num(params, "mscale"),
                mscale_all_dim: num(params, "mscale_all_dim"),
                beta_fast: num(params, "beta_fast").filter(|v| *v != 0.0).unwrap_or(32.0),
                beta_slow: num(params, "beta_slow").filter(|v| *v != 0.0).unwrap_or(1.0),
                truncate: params.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            },
            other => {
                return Err(NinferError::config(
                    "rope_parameters.rope_type",
                    format!("`{other}` is not supported; supported: default, linear, llama3, yarn"),
                ))
            }
        };
        Ok(RopeConfig { theta, partial_rotary_factor: partial, scaling })
    }

    /// Number of rotated dimensions of a head (`int(head_dim * partial_rotary_factor)`).
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        (head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Inverse frequencies (`rotary_dim / 2` of them) and the factor cos/sin are multiplied by.
    pub fn inv_freq(&self, head_dim: usize) -> (Vec<f32>, f32) {
        let dim = self.rotary_dim(head_dim);
        let base: Vec<f64> = (0..dim / 2).map(|i| 1.0 / self.theta.powf((2 * i) as f64 / dim as f64)).collect();
        match &self.scaling {
            RopeScaling::Default => (base.iter().map(|&f| f as f32).collect(), 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|&f| (f / factor) as f32).collect(), 1.0),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let out = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        #[allow(clippy::neg_cmp_op_on_partial_ord)] // as transformers writes it
                        let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                        if medium {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                        } else {
                            scaled as f32
                        }
                    })
                    .collect();
                (out, 1.0)
            }
            RopeScaling::Yarn { factor, original_max_position_embeddings, attention_factor, mscale, mscale_all_dim, beta_fast, beta_slow, truncate } => {
                let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attn = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => get_mscale(*factor, *m) / get_mscale(*factor, *ma),
                    _ => get_mscale(*factor, 1.0),
                });
                let correction_dim = |rot: f64| {
                    (dim as f64 * (original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let out = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        ((f / factor) * (1.0 - extrapolation) + f * extrapolation) as f32
                    })
                    .collect();
                (out, attn as f32)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<RopeConfig> {
        RopeConfig::from_config(v.as_object().unwrap(), 4096, 1.0)
    }

    #[test]
    fn old_style_rope_scaling_and_theta_parse() {
        let r = parse(serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})).unwrap();
        assert_eq!(r.theta, 500000.0);
        assert_eq!(r.scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn linear_scaling_divides_frequencies() {
        let plain = parse(serde_json::json!({})).unwrap().inv_freq(8).0;
        let lin = parse(serde_json::json!({"rope_parameters": {"rope_type": "linear", "factor": 4.0}})).unwrap().inv_freq(8).0;
        for (a, b) in plain.iter().zip(&lin) {
            assert!((a / 4.0 - b).abs() < 1e-7);
        }
        assert_eq!(plain[0], 1.0);
    }

    #[test]
    fn unknown_rope_type_names_the_field() {
        let e = parse(serde_json::json!({"rope_parameters": {"rope_type": "weird"}})).unwrap_err();
        assert!(e.to_string().contains("rope_type"), "{e}");
    }

    #[test]
    fn partial_rotary_factor_limits_rotary_dim() {
        let r = RopeConfig::from_config(serde_json::json!({}).as_object().unwrap(), 64, 0.25).unwrap();
        assert_eq!(r.rotary_dim(256), 64);
        assert_eq!(r.inv_freq(256).0.len(), 32);
    }
}
