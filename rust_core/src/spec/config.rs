//! `SpecConfig`: the speculative-decoding flags (`--spec`, `--draft-tokens`, `--drafter`),
//! checked once.

use std::path::PathBuf;

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
    /// A DFlash block-diffusion drafter (`--drafter DIR`; the CPU backend).
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

    /// Draft tokens when `--draft-tokens` is not given. DFlash: 7, as the original ran its
    /// drafters (a block of 8); a drafter's block of `b` tokens allows at most `b - 1`.
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
    /// The DFlash drafter's directory (`--drafter`); only with `SpecMethod::Dflash`.
    pub drafter: Option<PathBuf>,
}

impl SpecConfig {
    /// The config of `--spec method --draft-tokens k` (k None: the method's default); an error
    /// naming the flag for a K out of range or a method not supported yet.
    pub fn new(method: &str, draft_tokens: Option<usize>) -> Result<Self> {
        Self::with_drafter(method, draft_tokens, None)
    }

    /// `new` with `--drafter DIR` (which `--spec dflash` needs and the other methods refuse).
    pub fn with_drafter(method: &str, draft_tokens: Option<usize>, drafter: Option<PathBuf>) -> Result<Self> {
        let method = SpecMethod::parse(method)?;
        let cfg = SpecConfig { method, draft_tokens: draft_tokens.unwrap_or(method.default_draft_tokens()), drafter };
        cfg.check()?;
        Ok(cfg)
    }

    /// K within range, and a drafter path exactly when the method reads one.
    pub fn check(&self) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.draft_tokens) {
            return Err(NinferError::config("draft_tokens (--draft-tokens)", format!("{} is outside 1..={MAX_DRAFT_TOKENS}", self.draft_tokens)));
        }
        match (self.method, &self.drafter) {
            (SpecMethod::Dflash, None) => Err(NinferError::config("drafter (--drafter)", "--spec dflash needs --drafter DIR (a DFlash drafter checkpoint)")),
            (SpecMethod::Ngram | SpecMethod::Mtp, Some(_)) => {
                Err(NinferError::config("drafter (--drafter)", format!("--drafter is read by --spec dflash only, not by --spec {}", self.method.name())))
            }
            _ => Ok(()),
        }
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
        assert_eq!(SpecConfig::new("NGRAM", None).unwrap(), SpecConfig { method: SpecMethod::Ngram, draft_tokens: 3, drafter: None });
    }

    #[test]
    fn dflash_needs_a_drafter_and_only_dflash_takes_one() {
        let e = SpecConfig::new("dflash", Some(3)).unwrap_err().to_string();
        assert!(e.contains("--drafter") && e.contains("--spec dflash"), "{e}");
        let d = SpecConfig::with_drafter("dflash", None, Some("d".into())).unwrap();
        assert_eq!((d.method, d.draft_tokens), (SpecMethod::Dflash, 7));
        let e = SpecConfig::with_drafter("mtp", None, Some("d".into())).unwrap_err().to_string();
        assert!(e.contains("--drafter") && e.contains("mtp"), "{e}");
        assert_eq!(SpecConfig::new("mtp", None).unwrap(), SpecConfig { method: SpecMethod::Mtp, draft_tokens: 3, drafter: None });
        assert!(SpecConfig::new("medusa", None).unwrap_err().to_string().contains("unknown method"));
    }
}
