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

    /// Apply logit bias, repetition, presence and frequency penalties to `logits` in place.
    pub fn apply(&self, params: &SamplingParams, logits: &mut [f32]) {
        for (&tok, &bias) in &params.logit_bias {
            if let Some(l) = logits.get_mut(tok as usize) {
                *l += bias;
            }
        }
        apply_repetition_penalty(logits, params.repetition_penalty, &self.seen);
        apply_presence_frequency(logits, params.presence_penalty, params.frequency_penalty, &self.output_counts);
    }
}

/// HF `RepetitionPenaltyLogitsProcessor`: a seen token's logit is divided by the penalty when
/// positive and multiplied by it when negative.
pub fn apply_repetition_penalty(logits: &mut [f32], penalty: f32, seen: &HashSet<u32>) {
    if penalty == 1.0 {
        return;
    }
    for &tok in seen {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// OpenAI penalties over the output tokens: `logit -= count * frequency + (count > 0) * presence`.
pub fn apply_presence_frequency(logits: &mut [f32], presence: f32, frequency: f32, counts: &HashMap<u32, u32>) {
    if presence == 0.0 && frequency == 0.0 {
        return;
    }
    for (&tok, &n) in counts {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l -= n as f32 * frequency + presence;
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
