//! `RequestValidator`: the checks a request passes once, where it enters the engine
//! (`EngineCore::add_request` inline, `EngineHandle::submit` on the submitting thread), so that
//! bad input is reported to the caller at once.

use crate::sampling::thinking::{ReasoningTracker, ThinkingTags};
use crate::sampling::{GrammarConstraint, SamplingParams, SharedGrammarCompiler};
use crate::{NinferError, Result};

/// The checks a request must pass before it is queued; cheap and shareable, so a submitting
/// thread can reject bad input at once while the core runs elsewhere.
#[derive(Clone, Debug)]
pub struct RequestValidator {
    pub max_context: usize,
    /// 0 when unknown.
    pub vocab_size: usize,
    /// Compiles `response_format` into a grammar constraint (built on first use).
    pub grammar: SharedGrammarCompiler,
    /// The tokenizer's `<think>` / `</think>` ids: reasoning is counted and budgets enforced;
    /// None (no tags) leaves every request's output unconstrained by `thinking_budget`.
    pub thinking: Option<ThinkingTags>,
    /// The engine runs speculative decoding (`--spec`): a request may set its `draft_tokens`.
    pub speculation: bool,
}

impl RequestValidator {
    /// Reject an empty prompt, out-of-vocabulary ids, bad params and context overflow.
    pub fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        if prompt.is_empty() {
            return Err(NinferError::EmptyPrompt);
        }
        if self.vocab_size > 0 {
            if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
                return Err(NinferError::invalid("prompt_token_ids", format!("token id {bad} is outside the vocabulary of {} tokens", self.vocab_size)));
            }
            // A bias on a token the model has no logit for would be ignored: say so instead (a
            // mistyped id), as the OpenAI API does.
            if let Some(&bad) = params.logit_bias.keys().filter(|&&t| t as usize >= self.vocab_size).min() {
                return Err(NinferError::invalid("logit_bias", format!("token id {bad} is outside the vocabulary of {} tokens", self.vocab_size)));
            }
        }
        params.validate()?;
        if params.draft_tokens.is_some_and(|k| k > 0) && !self.speculation {
            return Err(NinferError::invalid("draft_tokens", "needs an engine started with --spec"));
        }
        // Saturating: a max_tokens near usize::MAX (JSON allows 2^64 - 1) must not wrap past the check.
        if prompt.len().saturating_add(params.max_tokens) > self.max_context {
            return Err(NinferError::ContextOverflow { prompt_tokens: prompt.len(), max_tokens: params.max_tokens, max_context: self.max_context });
        }
        self.check_thinking_budget(params)
    }

    /// A thinking budget must leave room for an answer: the budget plus the closing sequence
    /// it forces must stay under `max_tokens`.
    fn check_thinking_budget(&self, params: &SamplingParams) -> Result<()> {
        let (Some(budget), Some(tags)) = (params.thinking_budget, &self.thinking) else {
            return Ok(());
        };
        let closing = tags.closing(params.thinking_budget_message.as_deref())?.len();
        if budget as usize + closing >= params.max_tokens {
            return Err(NinferError::invalid(
                "thinking_budget",
                format!(
                    "{budget} plus the {closing} tokens that close the reasoning leave no room for an answer within max_tokens {}: \
                     raise max_tokens above {} or lower the budget",
                    params.max_tokens,
                    budget as usize + closing
                ),
            ));
        }
        Ok(())
    }

    /// The reasoning tracker of a checked request (None when the tokenizer has no thinking
    /// tags), with the tags it reads blank tokens with.
    pub fn thinking_tracker(&self, prompt: &[u32], params: &SamplingParams) -> Option<(ReasoningTracker, ThinkingTags)> {
        let tags = self.thinking.as_ref()?;
        // The closing sequence tokenized in `check` already: it cannot fail here.
        let tracker = tags.tracker(prompt, params.thinking_budget, params.thinking_budget_message.as_deref()).ok()?;
        Some((tracker, tags.clone()))
    }

    /// Every check of a request about to be queued (`check`, then its `response_format`
    /// compiled): its grammar constraint, None without one.
    pub fn validate(&self, prompt: &[u32], params: &SamplingParams) -> Result<Option<GrammarConstraint>> {
        self.check(prompt, params)?;
        self.grammar(params)
    }

    /// The grammar constraint of a request with a `response_format` (None without one). A schema
    /// the compiler rejects is an `InvalidRequest` on `response_format`, reported at submit.
    pub fn grammar(&self, params: &SamplingParams) -> Result<Option<GrammarConstraint>> {
        self.grammar.constraint_for(params.response_format.as_ref())
    }
}
