//! Per-request postprocessing state: sampler, incremental detokenizer and stop checker, and the
//! rules that decide when a request is finished.

use super::{FinishReason, RequestOutput, StopReason};
use crate::sampling::thinking::{ReasoningTracker, ThinkingTags};
use crate::sampling::{GrammarConstraint, RequestSampler, RowSampling, SamplingParams, TokenLogprob};
use crate::spec::SpecStats;
use crate::tokenizer::detokenizer::IncrementalDetokenizer;
use crate::tokenizer::stop::StopChecker;
use crate::tokenizer::Tokenizer;
use crate::{NinferError, Result};

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
    /// Why the grammar could not compute the last mask (too complex a lexer, no token left):
    /// the request ends with it when the token sampled without the mask comes back.
    grammar_error: Option<NinferError>,
    /// The reasoning block's count and the `thinking_budget` that closes it; None for a
    /// tokenizer without thinking tags.
    thinking: Option<(ReasoningTracker, ThinkingTags)>,
    /// This request's draft and acceptance counts; None without speculative decoding.
    pub spec: Option<SpecStats>,
}

/// Where the input token of a step stands when the step's sampling rows are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowInput {
    /// Accepted on the host: the step was scheduled after the step before it was updated.
    Accepted,
    /// In flight: the step (a lookahead) takes its input from the step launched before it,
    /// not updated yet; a row with penalties counts it on the runner
    /// (`RowSampling::count_input`).
    InFlight,
    /// Fed on the runner and accepted since: the sampling half of a split lookahead, built
    /// after the step before was updated.
    FedThenAccepted,
}

/// What happened when one token was accepted.
pub struct TokenEvent {
    pub output: RequestOutput,
    pub finished: bool,
}

impl RequestState {
    /// State for a new request; `fallback_seed` seeds requests without a seed.
    /// `grammar` constrains every sampled token to the request's `response_format`; `thinking`
    /// counts its reasoning and enforces its `thinking_budget`.
    pub fn new(
        request_id: String,
        prompt: &[u32],
        params: SamplingParams,
        fallback_seed: u64,
        grammar: Option<GrammarConstraint>,
        thinking: Option<(ReasoningTracker, ThinkingTags)>,
    ) -> Self {
        RequestState {
            thinking,
            request_id,
            sampler: RequestSampler::new(&params, prompt, fallback_seed),
            detok: IncrementalDetokenizer::new(prompt, params.skip_special_tokens),
            stop: StopChecker::new(&params.stop),
            prompt_tokens: prompt.len(),
            completion_tokens: 0,
            params,
            grammar,
            grammar_error: None,
            spec: None,
        }
    }

    /// The sampling row of this request's next token over `vocab` logits (restricted to the
    /// tokens the grammar allows, when the request has one); takes the request's RNG draw. When
    /// the grammar cannot compute a mask the row is left unconstrained and the error is kept:
    /// the token sampled from it is never output, `accept` ends the request with the error.
    /// `input`: under `RowInput::InFlight` the step's input token (this request's newest
    /// output) is not accepted yet, and a row with penalties counts it on the runner
    /// (`RowSampling::count_input`). When the thinking budget has run out the row allows only
    /// the next token of the closing sequence, if the grammar allows it too (the grammar owns
    /// the output's format: otherwise its mask stands and the budget gives way).
    pub fn prepare_sampling(&mut self, vocab: usize, input: RowInput) -> RowSampling {
        let mask = match self.grammar.as_mut().map(GrammarConstraint::compute_mask) {
            Some(Ok(mask)) => Some(mask),
            Some(Err(e)) => {
                self.grammar_error.get_or_insert(e);
                None
            }
            None => None,
        };
        // A row built before its input token is known is free: `samples_after_input` holds back
        // the rows that the token could force.
        let forced = match (&self.thinking, input) {
            (Some((tracker, _)), RowInput::Accepted | RowInput::FedThenAccepted) => tracker.forced(),
            _ => None,
        };
        let forced = forced.filter(|&t| (t as usize) < vocab && mask.as_ref().is_none_or(|m| m.is_allowed(t)));
        let mut row = self.sampler.prepare(&self.params, mask.as_ref(), vocab);
        if let Some(t) = forced {
            let mut words = vec![0u32; vocab.div_ceil(32)];
            words[t as usize / 32] = 1 << (t % 32);
            row.allow = Some(words);
        }
        row.count_input = input == RowInput::InFlight && self.params.penalizes_history();
        row
    }

    /// The row every position of a verify chunk is picked with, when one row serves them all
    /// and only the token is wanted: a greedy request without logprobs, grammar, penalties or
    /// thinking budget (those rows change with each accepted token). None otherwise.
    pub fn argmax_row(&mut self, vocab: usize) -> Option<RowSampling> {
        let p = &self.params;
        let alike = p.is_greedy() && !p.logprobs && p.top_logprobs == 0 && !p.penalizes_history() && p.thinking_budget.is_none();
        if !alike || self.grammar.is_some() || self.grammar_error.is_some() {
            return None;
        }
        Some(self.prepare_sampling(vocab, RowInput::Accepted))
    }

    /// One more uniform draw from the request's RNG (a sampled draft's, a residual token's).
    pub fn uniform(&mut self) -> f64 {
        self.sampler.uniform()
    }

    /// Tokens generated inside the reasoning so far (what the thinking budget counts).
    pub fn reasoning_tokens(&self) -> usize {
        self.thinking.as_ref().map_or(0, |(t, _)| t.reasoning_tokens())
    }

    /// Whether a step can be queued before the next token is known (asynchronous scheduling):
    /// the next token does not reach `max_tokens` (which surely ends the request).
    pub fn can_run_ahead(&self) -> bool {
        self.completion_tokens + 1 < self.params.max_tokens
    }

    /// Whether the row of the token after the next can only be prepared once the next token is
    /// accepted: a grammar's allow-mask is computed on the host from the state the token
    /// advances it to. A step queued ahead then waits for its rows before it samples (a split
    /// lookahead, `ModelRunner::launch_forward`). Penalties need no wait: a row built before
    /// the token counts it on the runner (`RowSampling::count_input`), which every overlapping
    /// runner's sampler does.
    /// A thinking budget about to run out (or closing) needs the same wait: whether the row is
    /// forced depends on the token before it.
    pub fn samples_after_input(&self) -> bool {
        self.grammar.is_some() || self.thinking.as_ref().is_some_and(|(t, _)| t.next_row_depends_on_token())
    }

    /// Advance the grammar past `token`: true when the constrained output is complete, which
    /// ends the request. An error when the grammar failed, now (it rejects the token) or while
    /// computing the mask `token` was sampled under: the token is then not valid output.
    fn advance_grammar(&mut self, token: u32) -> std::result::Result<bool, NinferError> {
        let Some(grammar) = self.grammar.as_mut() else {
            return Ok(false);
        };
        if let Some(e) = self.grammar_error.take() {
            return Err(e);
        }
        grammar.consume(token)?;
        Ok(grammar.is_finished())
    }

    /// Account for a sampled token: record it in the penalty history, detokenize, check stop
    /// conditions, build the delta. A token the grammar fails on ends the request with
    /// `FinishReason::Error` instead (`failed`).
    pub fn accept(
        &mut self,
        token: u32,
        logprob: Option<TokenLogprob>,
        tokenizer: Option<&Tokenizer>,
        eos_token_ids: &[u32],
        cached_tokens: usize,
    ) -> Result<TokenEvent> {
        let grammar_done = match self.advance_grammar(token) {
            Ok(done) => done,
            Err(e) => return self.failed(e, tokenizer, cached_tokens),
        };
        self.sampler.record(token);
        self.completion_tokens += 1;
        let is_eos = !self.params.ignore_eos && eos_token_ids.contains(&token);
        let is_stop_token = self.params.stop_token_ids.contains(&token);
        if let (Some((tracker, tags)), false) = (self.thinking.as_mut(), is_eos || is_stop_token) {
            tracker.accept(token, |t| tags.is_blank(t));
        }
        let mut text = String::new();
        let mut finish = None;
        let mut stop_reason = None;
        if is_eos || is_stop_token {
            finish = Some(FinishReason::Stop);
            stop_reason = is_stop_token.then_some(StopReason::Token(token));
        } else if let Some(tok) = tokenizer {
            let delta = self.detok.push(tok, token)?;
            let out = self.stop.push(&delta);
            text = out.text;
            if let Some(s) = out.matched {
                finish = Some(FinishReason::Stop);
                stop_reason = Some(StopReason::Text(s));
            }
        }
        if finish.is_none() && grammar_done {
            finish = Some(FinishReason::Stop);
        }
        if finish.is_none() && self.completion_tokens >= self.params.max_tokens {
            finish = Some(FinishReason::Length);
        }
        if let (Some(_), false, Some(tok)) = (finish, matches!(stop_reason, Some(StopReason::Text(_))), tokenizer) {
            let (rest, matched) = self.flush_text(tok)?;
            text.push_str(&rest);
            if let Some(s) = matched {
                finish = Some(FinishReason::Stop);
                stop_reason = Some(StopReason::Text(s));
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
            reasoning_tokens: self.reasoning_tokens(),
            cached_tokens,
            error: None,
            stop_reason,
            spec: finish.and(self.spec.clone()),
        };
        Ok(TokenEvent { finished: finish.is_some(), output })
    }

    /// The text held back at the end of a request (an incomplete UTF-8 sequence, a possible
    /// start of a stop string), cut at a stop string it completes, which comes with it.
    fn flush_text(&mut self, tokenizer: &Tokenizer) -> Result<(String, Option<String>)> {
        let rest = self.detok.flush(tokenizer)?;
        let mut out = self.stop.push(&rest);
        if out.matched.is_none() {
            out.text.push_str(&self.stop.flush());
        }
        Ok((out.text, out.matched))
    }

    /// The final delta of a request that failed on `error`: the text of the tokens already
    /// accepted that was still held back, no new token (the one sampled is not valid output, so
    /// it is neither output nor counted), finish reason `Error` and the error's message.
    fn failed(&mut self, error: NinferError, tokenizer: Option<&Tokenizer>, cached_tokens: usize) -> Result<TokenEvent> {
        let text = match tokenizer {
            Some(tok) => self.flush_text(tok)?.0,
            None => String::new(),
        };
        let output = RequestOutput {
            text,
            finish_reason: Some(FinishReason::Error),
            error: Some(error.to_string()),
            ..self.aborted(cached_tokens)
        };
        Ok(TokenEvent { finished: true, output })
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
            reasoning_tokens: self.reasoning_tokens(),
            cached_tokens,
            error: None,
            stop_reason: None,
            spec: self.spec.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a greedy request whose row is the same at every draft position and that wants no
    /// logprobs is verified by argmax on the runner; its row carries the logit bias.
    #[test]
    fn only_alike_greedy_rows_without_logprobs_are_verified_by_argmax() {
        let greedy = SamplingParams { temperature: 0.0, max_tokens: 8, ..Default::default() };
        let state = |params: &SamplingParams| RequestState::new("r".into(), &[1, 2, 3], params.clone(), 0, None, None);
        let biased = SamplingParams { logit_bias: [(2, 1.5)].into_iter().collect(), ..greedy.clone() };
        let row = state(&biased).argmax_row(16).expect("a greedy request is picked by argmax");
        assert!(row.is_greedy() && !row.wants_logprobs() && row.allow.is_none() && row.penalized.is_empty());
        assert_eq!(row.logit_bias, vec![(2, 1.5)]);
        let host = [
            ("sampled", SamplingParams { temperature: 0.7, ..greedy.clone() }),
            ("logprobs", SamplingParams { logprobs: true, ..greedy.clone() }),
            ("top_logprobs", SamplingParams { top_logprobs: 3, ..greedy.clone() }),
            ("presence penalty", SamplingParams { presence_penalty: 0.5, ..greedy.clone() }),
            ("repetition penalty", SamplingParams { repetition_penalty: 1.2, ..greedy.clone() }),
            ("thinking budget", SamplingParams { thinking_budget: Some(4), ..greedy.clone() }),
        ];
        for (name, params) in host {
            assert!(state(&params).argmax_row(16).is_none(), "{name}: picked on the host");
        }
    }
}
