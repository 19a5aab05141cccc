//! `SpecConfig`: the speculative-decoding flags (`--spec`, `--draft-tokens`), checked once.

use crate::{NinferError, Result};

/// The most draft tokens one verify chunk carries (`--draft-tokens`).
pub const MAX_DRAFT_TOKENS: usize = 8;

/// Which drafter proposes the tokens (`--spec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup over the request's own tokens; no weights.
    Ngram,
    /// The model's multi-token-prediction head (`mtp.*` weights; the CPU backend).
    Mtp,
    /// A DFlash block-diffusion drafter (not supported yet).
    Dflash,
}

impl SpecMethod {
    /// The method a `--spec` value names.
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "ngram" => Ok(SpecMethod::Ngram),
            "mtp" => Ok(SpecMethod::Mtp),
            "dflash" => Ok(SpecMethod::Dflash),
            other => Err(NinferError::config("spec (--spec)", format!("unknown method {other:?}: give ngram, mtp or dflash"))),
        }
    }

    /// The `--spec` spelling.
    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Mtp => "mtp",
            SpecMethod::Dflash => "dflash",
        }
    }

    /// Draft tokens when `--draft-tokens` is not given.
    pub fn default_draft_tokens(self) -> usize {
        match self {
            SpecMethod::Ngram => 3,
            SpecMethod::Mtp => 3,
            SpecMethod::Dflash => 7,
        }
    }
}

/// Speculative decoding as the engine runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Draft tokens per verify chunk (K), 1..=MAX_DRAFT_TOKENS.
    pub draft_tokens: usize,
}

impl SpecConfig {
    /// The config of `--spec method --draft-tokens k` (k None: the method's default); an error
    /// naming the flag for a K out of range or a method not supported yet.
    pub fn new(method: &str, draft_tokens: Option<usize>) -> Result<Self> {
        let method = SpecMethod::parse(method)?;
        let cfg = SpecConfig { method, draft_tokens: draft_tokens.unwrap_or(method.default_draft_tokens()) };
        cfg.check()?;
        Ok(cfg)
    }

    /// K within range and a method that runs.
    pub fn check(&self) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.draft_tokens) {
            return Err(NinferError::config("draft_tokens (--draft-tokens)", format!("{} is outside 1..={MAX_DRAFT_TOKENS}", self.draft_tokens)));
        }
        if self.method == SpecMethod::Dflash {
            return Err(NinferError::config("spec (--spec)", format!("--spec {} is not supported yet (only ngram and mtp)", self.method.name())));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_tokens_out_of_range_name_the_flag() {
        for k in [0, 9] {
            let e = SpecConfig::new("ngram", Some(k)).unwrap_err().to_string();
            assert!(e.contains("--draft-tokens") && e.contains(&k.to_string()), "{e}");
        }
        assert_eq!(SpecConfig::new("NGRAM", None).unwrap(), SpecConfig { method: SpecMethod::Ngram, draft_tokens: 3 });
    }

    #[test]
    fn methods_not_built_yet_are_refused_by_name() {
        let e = SpecConfig::new("dflash", Some(3)).unwrap_err().to_string();
        assert!(e.contains("--spec") && e.contains("dflash") && e.contains("not supported yet"), "{e}");
        assert_eq!(SpecConfig::new("mtp", None).unwrap(), SpecConfig { method: SpecMethod::Mtp, draft_tokens: 3 });
        assert!(SpecConfig::new("medusa", None).unwrap_err().to_string().contains("unknown method"));
    }
}
