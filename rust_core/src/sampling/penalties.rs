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

    #[test]
    fn logit_bias_adds_to_named_tokens_and_ignores_out_of_range_ids() {
        let mut l = vec![1.0, 1.0];
        let h = PenaltyHistory::new(&[]);
        let p = SamplingParams { logit_bias: [(1, -3.0), (99, 5.0)].into_iter().collect(), ..Default::default() };
        h.apply(&p, &mut l);
        assert_eq!(l, vec![1.0, -2.0]);
    }
}
