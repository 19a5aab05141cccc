//! Logits processors that depend on what a sequence has seen: logit bias, repetition penalty
//! (HF semantics) and presence / frequency penalties (OpenAI semantics).

use std::collections::{HashMap, HashSet};

use super::SamplingParams;

/// The token history the penalties need, kept incrementally so each step costs O(seen tokens).
#[derive(Clone, Debug, Default)]
pub struct PenaltyHistory {
    /// Every distinct token of the prompt and the output (repetition penalty scope).
    seen: HashSet<u32>,
    /// How often each token occurs in the output (presence / frequency penalty scope).
    output_counts: HashMap<u32, u32>,
}

impl PenaltyHistory {
    /// Start from the prompt tokens.
    pub fn new(prompt: &[u32]) -> Self {
        PenaltyHistory { seen: prompt.iter().copied().collect(), output_counts: HashMap::new() }
    }

    /// Record one generated token.
    pub fn push_output(&mut self, token: u32) {
        self.seen.insert(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    /// The tokens a penalty of `params` touches, as `(token, output count)` pairs in no
    /// particular order (each token once; the penalties of one token do not depend on the
    /// others): every seen token when the repetition penalty is on (count 0 for prompt-only
    /// tokens), else only the output tokens when a presence or frequency penalty is on, else
    /// none. This is what a `RowSampling` carries to the host or device sampler.
    pub fn penalized(&self, params: &SamplingParams) -> Vec<(u32, u32)> {
        let count = |t: &u32| self.output_counts.get(t).copied().unwrap_or(0);
        if params.repetition_penalty != 1.0 {
            self.seen.iter().map(|t| (*t, count(t))).collect()
        } else if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            self.output_counts.iter().map(|(&t, &n)| (t, n)).collect()
        } else {
            Vec::new()
        }
    }

    /// `penalized` with one more output occurrence of `token`, for a row built while `token`,
    /// the request's newest output, is still in flight (a step queued ahead under asynchronous
    /// scheduling: `RowSampling::count_input`). Equals `penalized(params)` after
    /// `push_output(token)` up to order, so the device sampler (cuda/sampling.cu) that counts
    /// its step's input token this way samples what the synchronous engine samples.
    pub fn with_pending_output(penalized: &[(u32, u32)], token: u32) -> Vec<(u32, u32)> {
        let mut pairs = penalized.to_vec();
        match pairs.iter_mut().find(|(t, _)| *t == token) {
            Some((_, n)) => *n += 1,
            None => pairs.push((token, 1)),
        }
        pairs
    }

    /// Apply logit bias, repetition, presence and frequency penalties to `logits` in place.
    pub fn apply(&self, params: &SamplingParams, logits: &mut [f32]) {
        let bias: Vec<(u32, f32)> = params.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
        let p = PenaltyParams::of(params);
        apply_penalties(logits, &p, &bias, &self.penalized(params));
    }
}

/// The three penalty strengths, as a sampler row carries them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PenaltyParams {
    /// HF repetition penalty (1.0 disables).
    pub repetition: f32,
    /// OpenAI presence penalty (0 disables).
    pub presence: f32,
    /// OpenAI frequency penalty (0 disables).
    pub frequency: f32,
}

impl PenaltyParams {
    /// The strengths a request asked for.
    pub fn of(params: &SamplingParams) -> Self {
        PenaltyParams { repetition: params.repetition_penalty, presence: params.presence_penalty, frequency: params.frequency_penalty }
    }
}

/// The one definition of the logits processors, in order: logit bias, then for each penalized
/// `(token, output count)` the repetition penalty (HF: a logit is divided by the penalty when
/// positive, multiplied when not), then presence / frequency (OpenAI: `logit -= count *
/// frequency + presence` for tokens with count > 0). Out-of-range ids are ignored. Every
/// operation is one rounded f32 op, so `cuda/sampling.cu` reproduces it bit for bit.
pub fn apply_penalties(logits: &mut [f32], p: &PenaltyParams, bias: &[(u32, f32)], penalized: &[(u32, u32)]) {
    for &(tok, b) in bias {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l += b;
        }
    }
    let pres_freq = p.presence != 0.0 || p.frequency != 0.0;
    for &(tok, n) in penalized {
        let Some(l) = logits.get_mut(tok as usize) else { continue };
        if p.repetition != 1.0 {
            *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
        }
        if pres_freq && n > 0 {
            *l -= n as f32 * p.frequency + p.presence;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() {
        let mut l = vec![2.0, -2.0, 3.0];
        let h = PenaltyHistory::new(&[0, 1]);
        let p = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        h.apply(&p, &mut l);
        assert_eq!(l, vec![1.0, -4.0, 3.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_only_output_tokens() {
        let mut l = vec![0.0; 4];
        let mut h = PenaltyHistory::new(&[3]);
        h.push_output(1);
        h.push_output(1);
        h.push_output(2);
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        h.apply(&p, &mut l);
        assert_eq!(l, vec![0.0, -1.0, -0.75, 0.0]);
    }

    /// Merging the pending token into the pairs gives the pairs after recording it, for every
    /// penalty scope and a token that is new, prompt-only (count 0) or already output.
    #[test]
    fn a_pending_output_merged_into_the_pairs_equals_recording_it() {
        let scopes = [
            SamplingParams { repetition_penalty: 1.3, ..Default::default() },
            SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() },
            SamplingParams { repetition_penalty: 0.8, frequency_penalty: -0.5, ..Default::default() },
            SamplingParams::default(),
        ];
        let mut h = PenaltyHistory::new(&[3, 4, 3]);
        h.push_output(5);
        h.push_output(5);
        h.push_output(6);
        for p in &scopes {
            for pending in [5, 6, 4, 9] {
                let mut after = h.clone();
                after.push_output(pending);
                let mut want = after.penalized(p);
                let mut got = PenaltyHistory::with_pending_output(&h.penalized(p), pending);
                if p.penalizes_history() {
                    want.sort_unstable();
                    got.sort_unstable();
                    assert_eq!(got, want, "pending {pending}, params {p:?}");
                }
                let logits: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
                let (mut a, mut b) = (logits.clone(), logits);
                apply_penalties(&mut a, &PenaltyParams::of(p), &[], &got);
                after.apply(p, &mut b);
                assert_eq!(a, b, "pending {pending}, params {p:?}: the same logits");
            }
        }
    }

    #[test]
    fn logit_bias_adds_to_named_tokens_and_ignores_out_of_range_ids() {
        let mut l = vec![1.0, 1.0];
        let h = PenaltyHistory::new(&[]);
        let p = SamplingParams { logit_bias: [(1, -3.0), (99, 5.0)].into_iter().collect(), ..Default::default() };
        h.apply(&p, &mut l);
        assert_eq!(l, vec![1.0, -2.0]);
    }
}
