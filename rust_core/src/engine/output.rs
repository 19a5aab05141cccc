//! What the engine hands back per request per step: a delta of tokens and text.

use crate::sampling::TokenLogprob;
use crate::spec::SpecStats;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Aborted by the client, or dropped because the engine failed (every request then ends,
    /// and the engine reports the failure itself).
    Abort,
    /// This request failed after it was accepted (its grammar could not go on midway):
    /// `RequestOutput::error` says why. Distinct from `Abort` so that a caller reports a
    /// failure instead of handing out a truncated answer as if it were complete.
    Error,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// What ended a request with `FinishReason::Stop`, when it was not an EOS token or a finished
/// grammar: servers report it (Anthropic's `stop_sequence`, vLLM's `stop_reason`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// One of the request's stop strings (cut from the text).
    Text(String),
    /// One of the request's stop token ids.
    Token(u32),
}

/// One request's progress in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    pub request_id: String,
    /// Tokens generated in this step.
    pub token_ids: Vec<u32>,
    /// New text: complete UTF-8, stop strings removed.
    pub text: String,
    /// One entry per token in `token_ids` when the request asked for logprobs.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// Set on the last delta of the request.
    pub finish_reason: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Of `completion_tokens`, those generated inside the reasoning block that a thinking
    /// budget counts (not the think tags, not a closing sequence the engine forced).
    pub reasoning_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Why the request failed: set only on the last delta of a request that ends with
    /// `FinishReason::Error`. The message of the `NinferError` that ended it, which names the
    /// request field at fault (`response_format` for a grammar), so that the caller can report it
    /// as an invalid request.
    pub error: Option<String>,
    /// The stop string or stop token id that ended the request, on its last delta.
    pub stop_reason: Option<StopReason>,
    /// The request's draft and acceptance counts, on its last delta when speculative decoding
    /// is on.
    pub spec: Option<SpecStats>,
}

impl RequestOutput {
    /// Whether this is the request's last delta.
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Append the delta that followed this one in the same step (the tokens of a verified
    /// draft after the first): its tokens, text and logprobs, and its counts and ending.
    pub fn merge(&mut self, next: RequestOutput) {
        self.token_ids.extend(next.token_ids);
        self.text.push_str(&next.text);
        if let (Some(a), Some(b)) = (self.logprobs.as_mut(), next.logprobs) {
            a.extend(b);
        }
        self.finish_reason = next.finish_reason;
        self.completion_tokens = next.completion_tokens;
        self.error = next.error;
        self.spec = next.spec;
    }
}
