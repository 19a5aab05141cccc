//! Per-request postprocessing state: sampler, incremental detokenizer and stop checker, and the
//! rules that decide when a request is finished.

use super::{FinishReason, RequestOutput};
use crate::sampling::{GrammarConstraint, RequestSampler, RowSampling, SamplingParams, TokenLogprob};
use crate::tokenizer::detokenizer::IncrementalDetokenizer;
use crate::tokenizer::stop::StopChecker;
use crate::tokenizer::Tokenizer;
use crate::Result;

/// Everything the engine keeps about one request besides its scheduler `Sequence`.
pub struct RequestState {
    pub request_id: String,
    pub params: SamplingParams,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    sampler: RequestSampler,
    detok: IncrementalDetokenizer,
    stop: StopChecker,
    /// The `response_format` matcher; None for free text (no per-token cost then).
    grammar: Option<GrammarConstraint>,
    /// The grammar failed (a token it did not allow, or no token left): the request ends.
    grammar_failed: bool,
}

/// What happened when one token was accepted.
pub struct TokenEvent {
    pub output: RequestOutput,
    pub finished: bool,
}

impl RequestState {
    /// State for a new request; `fallback_seed` seeds requests without a seed.
    /// `grammar` constrains every sampled token to the request's `response_format`.
    pub fn new(request_id: String, prompt: &[u32], params: SamplingParams, fallback_seed: u64, grammar: Option<GrammarConstraint>) -> Self {
        RequestState {
            request_id,
            sampler: RequestSampler::new(&params, prompt, fallback_seed),
            detok: IncrementalDetokenizer::new(prompt, params.skip_special_tokens),
            stop: StopChecker::new(&params.stop),
            prompt_tokens: prompt.len(),
            completion_tokens: 0,
            params,
            grammar,
            grammar_failed: false,
        }
    }

    /// The sampling row of this request's next token over `vocab` logits (restricted to the
    /// tokens the grammar allows, when the request has one); takes the request's RNG draw.
    pub fn prepare_sampling(&mut self, vocab: usize) -> RowSampling {
        let mask = match self.grammar.as_mut().map(GrammarConstraint::compute_mask) {
            Some(Ok(mask)) => Some(mask),
            Some(Err(e)) => {
                eprintln!("ninfer: request {}: {e}; ending it", self.request_id);
                self.grammar_failed = true;
                None
            }
            None => None,
        };
        self.sampler.prepare(&self.params, mask.as_ref(), vocab)
    }

    /// Whether the row of the token after the next can be prepared before the next token is
    /// known (asynchronous scheduling): no penalty counts the output, no grammar advances on it,
    /// and the next token does not reach `max_tokens` (it surely ends the request).
    pub fn can_sample_ahead(&self) -> bool {
        self.grammar.is_none() && !self.params.penalizes_history() && self.completion_tokens + 1 < self.params.max_tokens
    }

    /// Advance the grammar past `token`; true when the constrained output is complete (or the
    /// grammar failed), which ends the request.
    fn grammar_done(&mut self, token: u32) -> bool {
        let Some(grammar) = self.grammar.as_mut() else {
            return false;
        };
        if self.grammar_failed {
            return true;
        }
        match grammar.consume(token) {
            Ok(()) => grammar.is_finished(),
            Err(e) => {
                eprintln!("ninfer: request {}: {e}; ending it", self.request_id);
                self.grammar_failed = true;
                true
            }
        }
    }

    /// Account for a sampled token: record it in the penalty history, detokenize, check stop
    /// conditions, build the delta.
    pub fn accept(
        &mut self,
        token: u32,
        logprob: Option<TokenLogprob>,
        tokenizer: Option<&Tokenizer>,
        eos_token_ids: &[u32],
        cached_tokens: usize,
    ) -> Result<TokenEvent> {
        self.sampler.record(token);
        self.completion_tokens += 1;
        let is_eos = !self.params.ignore_eos && eos_token_ids.contains(&token);
        let is_stop_token = self.params.stop_token_ids.contains(&token);
        let grammar_done = self.grammar_done(token);
        let mut text = String::new();
        let mut finish = None;
        let mut stop_string_matched = false;
        if is_eos || is_stop_token {
            finish = Some(FinishReason::Stop);
        } else if let Some(tok) = tokenizer {
            let delta = self.detok.push(tok, token)?;
            let out = self.stop.push(&delta);
            text = out.text;
            if out.matched.is_some() {
                finish = Some(FinishReason::Stop);
                stop_string_matched = true;
            }
        }
        if finish.is_none() && grammar_done {
            finish = Some(FinishReason::Stop);
        }
        if finish.is_none() && self.completion_tokens >= self.params.max_tokens {
            finish = Some(FinishReason::Length);
        }
        if let (Some(_), false, Some(tok)) = (finish, stop_string_matched, tokenizer) {
            let rest = self.detok.flush(tok)?;
            let out = self.stop.push(&rest);
            text.push_str(&out.text);
            if out.matched.is_some() {
                finish = Some(FinishReason::Stop);
            } else {
                text.push_str(&self.stop.flush());
            }
        }
        let output = RequestOutput {
            request_id: self.request_id.clone(),
            token_ids: vec![token],
            text,
            logprobs: logprob.map(|l| vec![l]),
            finish_reason: finish,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens,
        };
        Ok(TokenEvent { finished: finish.is_some(), output })
    }

    /// The final delta of an aborted request.
    pub fn aborted(&self, cached_tokens: usize) -> RequestOutput {
        RequestOutput {
            request_id: self.request_id.clone(),
            token_ids: Vec::new(),
            text: String::new(),
            logprobs: None,
            finish_reason: Some(FinishReason::Abort),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens,
        }
    }
}
