//! `SpecConfig`: the speculative-decoding flags (`--spec`, `--draft-tokens`, `--drafter`,
//! `--spec-adaptive`, `--lm-head-draft`), checked once.

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
    /// Draft tokens per verify chunk (K), 1..=MAX_DRAFT_TOKENS; with `adaptive` the most a
    /// step may draft.
    pub draft_tokens: usize,
    /// The DFlash drafter's directory (`--drafter`); only with `SpecMethod::Dflash`.
    pub drafter: Option<PathBuf>,
    /// `--spec-adaptive`: K chosen per step and request from the measured step cost and the
    /// running acceptance (`spec::adaptive`).
    pub adaptive: bool,
    /// `--lm-head-draft`: MTP drafts over a reduced vocabulary (`spec::draft_vocab`).
    pub lm_head_draft: Option<LmHeadDraft>,
}

/// The reduced vocabulary MTP drafts over: the first `size` ids of the model's draft vocabulary
/// file, most frequent first (`token_ids`, filled when the model directory is known).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmHeadDraft {
    /// N (`--lm-head-draft-size`).
    pub size: usize,
    /// The ids the MTP head's logits are computed for; empty until read from the model
    /// directory (`draft_vocab::read`).
    pub token_ids: Vec<u32>,
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
        let cfg = SpecConfig { method, draft_tokens: draft_tokens.unwrap_or(method.default_draft_tokens()), adaptive: false, lm_head_draft: None, drafter };
        cfg.check()?;
        Ok(cfg)
    }

    /// With `--spec-adaptive`.
    pub fn with_adaptive(self, adaptive: bool) -> Self {
        SpecConfig { adaptive, ..self }
    }

    /// With `--lm-head-draft` over `size` ids (None: the default size); only MTP drafts from a
    /// head, so another method is refused naming both flags.
    pub fn with_lm_head_draft(self, size: Option<usize>) -> Result<Self> {
        let size = size.unwrap_or(super::draft_vocab::DEFAULT_DRAFT_VOCAB_SIZE);
        let cfg = SpecConfig { lm_head_draft: Some(LmHeadDraft { size, token_ids: Vec::new() }), ..self };
        cfg.check()?;
        Ok(cfg)
    }

    /// K within range, and a drafter path exactly when the method reads one.
    pub fn check(&self) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.draft_tokens) {
            return Err(NinferError::config("draft_tokens (--draft-tokens)", format!("{} is outside 1..={MAX_DRAFT_TOKENS}", self.draft_tokens)));
        }
        match (self.method, &self.drafter) {
            (SpecMethod::Dflash, None) => return Err(NinferError::config("drafter (--drafter)", "--spec dflash needs --drafter DIR (a DFlash drafter checkpoint)")),
            (SpecMethod::Ngram | SpecMethod::Mtp, Some(_)) => {
                return Err(NinferError::config("drafter (--drafter)", format!("--drafter is read by --spec dflash only, not by --spec {}", self.method.name())));
            }
            _ => {}
        }
        if let Some(d) = &self.lm_head_draft {
            if self.method != SpecMethod::Mtp {
                return Err(NinferError::config("lm_head_draft (--lm-head-draft)", format!("--lm-head-draft needs --spec mtp (the MTP head drafts over the reduced vocabulary), not --spec {}", self.method.name())));
            }
            if d.size == 0 {
                return Err(NinferError::config("lm_head_draft_size (--lm-head-draft-size)", "must be at least 1"));
            }
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
        assert_eq!(SpecConfig::new("NGRAM", None).unwrap(), SpecConfig { method: SpecMethod::Ngram, draft_tokens: 3, adaptive: false, lm_head_draft: None, drafter: None });
    }

    #[test]
    fn dflash_needs_a_drafter_and_only_dflash_takes_one() {
        let e = SpecConfig::new("dflash", Some(3)).unwrap_err().to_string();
        assert!(e.contains("--drafter") && e.contains("--spec dflash"), "{e}");
        let d = SpecConfig::with_drafter("dflash", None, Some("d".into())).unwrap();
        assert_eq!((d.method, d.draft_tokens), (SpecMethod::Dflash, 7));
        let e = SpecConfig::with_drafter("mtp", None, Some("d".into())).unwrap_err().to_string();
        assert!(e.contains("--drafter") && e.contains("mtp"), "{e}");
        assert_eq!(SpecConfig::new("mtp", None).unwrap(), SpecConfig { method: SpecMethod::Mtp, draft_tokens: 3, adaptive: false, lm_head_draft: None, drafter: None });
        assert!(SpecConfig::new("medusa", None).unwrap_err().to_string().contains("unknown method"));
    }

    #[test]
    fn a_reduced_draft_head_needs_mtp_and_names_both_flags() {
        let e = SpecConfig::new("ngram", None).unwrap().with_lm_head_draft(Some(64)).unwrap_err().to_string();
        assert!(e.contains("--lm-head-draft") && e.contains("--spec mtp"), "{e}");
        let e = SpecConfig::new("mtp", None).unwrap().with_lm_head_draft(Some(0)).unwrap_err().to_string();
        assert!(e.contains("--lm-head-draft-size"), "{e}");
        let c = SpecConfig::new("mtp", Some(2)).unwrap().with_adaptive(true).with_lm_head_draft(None).unwrap();
        assert!(c.adaptive && c.lm_head_draft.unwrap().size == crate::spec::draft_vocab::DEFAULT_DRAFT_VOCAB_SIZE);
    }
}
