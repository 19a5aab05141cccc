//! What the engine hands back per request per step: a delta of tokens and text.

use crate::sampling::TokenLogprob;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Aborted by the client (or the engine failed).
    Abort,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
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
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl RequestOutput {
    /// Whether this is the request's last delta.
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}
