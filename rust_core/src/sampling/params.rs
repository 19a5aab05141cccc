//! Per-request sampling parameters, as they cross from Python (`_core.SamplingParams`).
//!
//! Field names follow the OpenAI / vLLM request fields so the server can forward them as they
//! come. `validate` is the one place that checks ranges; errors name the field and the value.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::ResponseFormat;
use crate::{NinferError, Result};

/// How to pick tokens and when to stop.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0 (or negative from clients, mapped to 0) disables.
    pub top_k: usize,
    /// 0 disables.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1.0 disables.
    pub repetition_penalty: f32,
    /// Token id -> additive bias.
    pub logit_bias: HashMap<u32, f32>,
    /// Same seed, same output. None: seeded from the engine's RNG.
    pub seed: Option<u64>,
    /// Stop strings; the matched text is not returned.
    pub stop: Vec<String>,
    /// Extra stop token ids (in addition to the model's EOS ids unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Return the sampled token's logprob.
    pub logprobs: bool,
    /// Also return this many most likely tokens per position.
    pub top_logprobs: usize,
    /// Skip special tokens in the returned text.
    pub skip_special_tokens: bool,
    /// OpenAI-style output format (`{"type": "json_object"}`, `{"type": "json_schema", ...}`,
    /// regex, lark) enforced by grammar-constrained decoding; None or `{"type": "text"}` for
    /// free text. Its shape is checked here, the schema itself when the engine compiles it.
    pub response_format: Option<serde_json::Value>,
    /// Most tokens the reasoning block may take (`<think>` ... `</think>` of a thinking
    /// model); when it runs out the engine forces the end of the reasoning and the answer
    /// follows, all within `max_tokens`. 0 closes the reasoning at once. None: unlimited.
    pub thinking_budget: Option<u32>,
    /// A sentence forced before the end-of-thinking tag when the budget runs out (None: the
    /// tag alone).
    pub thinking_budget_message: Option<String>,
    /// This request's draft length under speculative decoding (0: no drafts for it); None: the
    /// engine's `--draft-tokens`. Refused when the engine runs without `--spec`.
    pub draft_tokens: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 256,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: HashMap::new(),
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: false,
            top_logprobs: 0,
            skip_special_tokens: true,
            response_format: None,
            thinking_budget: None,
            thinking_budget_message: None,
            draft_tokens: None,
        }
    }
}

impl SamplingParams {
    /// Read the fields Python sends (a JSON object) and check every range.
    pub fn from_value(v: serde_json::Value) -> Result<Self> {
        let p: SamplingParams = serde_json::from_value(v).map_err(|e| NinferError::invalid("sampling_params", e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// True when a penalty reads the tokens generated so far (repetition, presence or
    /// frequency), so the next token's sampling row depends on the last one.
    pub fn penalizes_history(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Check every range; the error names the field and the offending value.
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &str, v: String, why: &str| Err(NinferError::invalid(f, format!("{v} {why}")));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature.to_string(), "must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p.to_string(), "must be in (0, 1]");
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", self.min_p.to_string(), "must be in [0, 1]");
        }
        if !(self.presence_penalty >= -2.0 && self.presence_penalty <= 2.0) {
            return bad("presence_penalty", self.presence_penalty.to_string(), "must be in [-2, 2]");
        }
        if !(self.frequency_penalty >= -2.0 && self.frequency_penalty <= 2.0) {
            return bad("frequency_penalty", self.frequency_penalty.to_string(), "must be in [-2, 2]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", self.repetition_penalty.to_string(), "must be > 0");
        }
        if self.top_logprobs > 20 {
            return bad("top_logprobs", self.top_logprobs.to_string(), "must be at most 20");
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "0".into(), "must be at least 1");
        }
        if let Some(k) = self.draft_tokens.filter(|&k| k > crate::spec::MAX_DRAFT_TOKENS) {
            return bad("draft_tokens", k.to_string(), "must be in 0..=8");
        }
        if let Some(format) = &self.response_format {
            ResponseFormat::parse(format)?;
        }
        for (tok, b) in &self.logit_bias {
            if !b.is_finite() || b.abs() > 100.0 {
                return bad("logit_bias", format!("{tok}: {b}"), "bias must be in [-100, 100]");
            }
        }
        Ok(())
    }
}
