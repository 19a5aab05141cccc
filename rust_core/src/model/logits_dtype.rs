//! The `logits_dtype` option: whether the lm_head's f32 sums are rounded to the model's 16-bit
//! dtype before anything (sampling, logprobs, `Model.logits`) sees them.
//!
//! Why round: transformers' lm_head returns logits in the model dtype (bf16 for a bf16
//! checkpoint) and vLLM's likewise (logits in the model dtype, widened to f32 for sampling), so
//! greedy decoding there is argmax over bf16 values, where near-ties collapse into exact ties
//! that argmax resolves to the lowest index. Our f32 logits resolve those near-ties by the
//! f32 value instead: on the demo model that alone made 3 of 20 prompts diverge from
//! transformers within 64 greedy tokens (where argmax of our logits rounded to bf16 agrees on
//! 20/20). "float32" keeps the unrounded sums.

use crate::artifact::WeightStore;
use crate::config::ModelConfig;
use crate::{NinferError, Result};

use super::names;

/// What the user asked for (`logits_dtype=` / `--logits-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogitsDtype {
    /// The dtype the model runs in, kept as f32: on CUDA the device's 16-bit storage type
    /// (bf16; f16 below sm_80) for every checkpoint; on the CPU the lm_head's stored dtype
    /// (bf16 / f16 rounded, an f32 checkpoint unrounded).
    #[default]
    Auto,
    /// The lm_head's f32 sums as they are.
    Float32,
}

/// The accepted spellings, for error messages and the CLI's choices.
pub const LOGITS_DTYPE_CHOICES: [&str; 2] = ["auto", "float32"];

impl LogitsDtype {
    /// "auto" or "float32" (also "f32"); anything else is an `Unsupported` error naming the
    /// value and the choices (as a misspelt `device=`).
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(LogitsDtype::Auto),
            "float32" | "f32" => Ok(LogitsDtype::Float32),
            _ => Err(NinferError::Unsupported(format!("logits_dtype `{text}` (available: {})", LOGITS_DTYPE_CHOICES.join(", ")))),
        }
    }

    /// Whether logits are rounded to the 16-bit type the lm_head weight is stored in
    /// (`stored`: the safetensors dtype name, "BF16", "F16" or "F32").
    pub fn rounds(self, stored: &str) -> bool {
        self == LogitsDtype::Auto && matches!(stored, "BF16" | "F16")
    }

    /// The 16-bit type the logits of the model in `store` are rounded to, or None for f32
    /// logits: the stored dtype of the lm_head weight (the embedding when tied).
    pub fn resolve(self, store: &WeightStore, cfg: &ModelConfig) -> Result<Option<LogitsRound>> {
        let name = if cfg.tie_word_embeddings { format!("{}.embed_tokens.weight", names::decoder_prefix(store)) } else { "lm_head.weight".to_string() };
        let stored = store.info(&name)?.dtype;
        Ok(match stored.as_str() {
            _ if !self.rounds(&stored) => None,
            "F16" => Some(LogitsRound::F16),
            _ => Some(LogitsRound::Bf16),
        })
    }
}

/// The 16-bit type CPU logits are rounded to (the CUDA kernels round to the device's storage
/// type, whatever the checkpoint's dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsRound {
    Bf16,
    F16,
}

impl LogitsRound {
    /// Rounds every logit to this type, round-to-nearest-even (as torch's `.to(bfloat16)` and
    /// the kernels' `round_st`), keeping it as f32.
    pub fn apply(self, logits: &mut [f32]) {
        match self {
            LogitsRound::Bf16 => logits.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
            LogitsRound::F16 => logits.iter_mut().for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_choices_and_names_a_bad_value() {
        assert_eq!(LogitsDtype::parse("auto").unwrap(), LogitsDtype::Auto);
        assert_eq!(LogitsDtype::parse("Float32").unwrap(), LogitsDtype::Float32);
        assert_eq!(LogitsDtype::parse("f32").unwrap(), LogitsDtype::Float32);
        let e = LogitsDtype::parse("bfloat16").unwrap_err().to_string();
        assert!(e.contains("logits_dtype") && e.contains("bfloat16") && e.contains("auto, float32"), "{e}");
    }

    #[test]
    fn auto_rounds_16_bit_checkpoints_only() {
        assert!(LogitsDtype::Auto.rounds("BF16") && LogitsDtype::Auto.rounds("F16"));
        assert!(!LogitsDtype::Auto.rounds("F32"));
        assert!(!LogitsDtype::Float32.rounds("BF16"));
    }

    #[test]
    fn bf16_rounding_is_nearest_even_and_keeps_the_low_half_zero() {
        // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties go to the even 1.0; just above
        // it rounds up.
        let mut v = [1.0 + 2f32.powi(-8), 1.0 + 2f32.powi(-8) + 2f32.powi(-20), -3.3, f32::INFINITY];
        LogitsRound::Bf16.apply(&mut v);
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], 1.0 + 2f32.powi(-7));
        assert!(v.iter().all(|x| x.to_bits() & 0xffff == 0), "{v:?}");
        assert_eq!(v[3], f32::INFINITY);
    }
}
