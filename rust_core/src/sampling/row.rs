//! `RowSampling`: everything needed to pick one token from one logits row, with no reference
//! to the request it came from, so that the same decision can run on the host (here, the
//! reference) or on a device (`cuda/sampling.cu`, which implements these exact semantics).
//!
//! The request keeps what persists between tokens (its RNG, its penalty history, its grammar
//! matcher); per token it hands a sampler one `RowSampling`, which carries the uniform draw
//! already taken from the request's RNG, so that a seed gives the same tokens wherever the
//! row is sampled.

use super::penalties::{apply_penalties, PenaltyHistory, PenaltyParams};
use super::sampler::{argmax, filtered_distribution, raw_logprobs, sample_filtered, SampledToken};

/// One row's sampling decision, fully specified.
#[derive(Clone, Debug, PartialEq)]
pub struct RowSampling {
    /// 0 is greedy (argmax of the processed logits, lowest id on ties).
    pub temperature: f32,
    /// 0 disables; a value >= the vocabulary size disables too.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// The uniform draw in [0, 1) from the request's RNG (unused when greedy).
    pub u: f64,
    /// Repetition, presence and frequency penalty strengths.
    pub penalties: PenaltyParams,
    /// `(token, output count)` of every token a penalty touches (see `PenaltyHistory::penalized`).
    pub penalized: Vec<(u32, u32)>,
    /// The token this row's step takes as input is the request's newest output and is not in
    /// `penalized` yet: a decode step queued before the step that samples its input has
    /// returned (asynchronous scheduling), whose input the device takes from that step's
    /// sampler output. The sampler counts it as one more output occurrence
    /// (`PenaltyHistory::with_pending_output`); the host sampler needs it resolved first
    /// (`with_input`). Set only on rows with a penalty.
    pub count_input: bool,
    /// `(token, additive bias)`, each token at most once.
    pub logit_bias: Vec<(u32, f32)>,
    /// Grammar allow-mask: bit `t % 32` of word `t / 32` set when token `t` may be sampled;
    /// tokens past the last word are not allowed. None: every token is allowed.
    pub allow: Option<Vec<u32>>,
    /// Whether the sampled token's logprob is wanted.
    pub logprobs: bool,
    /// How many most likely tokens (of the raw logits) to return, at most 20.
    pub top_logprobs: usize,
}

impl Default for RowSampling {
    fn default() -> Self {
        RowSampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            u: 0.0,
            penalties: PenaltyParams { repetition: 1.0, presence: 0.0, frequency: 0.0 },
            penalized: Vec::new(),
            count_input: false,
            logit_bias: Vec::new(),
            allow: None,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl RowSampling {
    /// True when the token is the argmax of the processed logits.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// True when top-k, top-p or min-p restricts the candidates over a vocabulary of `vocab`
    /// tokens; without a filter the draw walks the vocabulary in id order.
    pub fn is_filtered(&self, vocab: usize) -> bool {
        (self.top_k > 0 && self.top_k < vocab) || self.top_p < 1.0 || self.min_p > 0.0
    }

    /// Whether a logprob entry is returned.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }

    /// This row once its step's input token is known to be `input`: with `count_input`, `input`
    /// merged into the penalized pairs (the reference of what the device sampler does with the
    /// token it reads on the device); else the row unchanged.
    pub fn with_input(&self, input: u32) -> RowSampling {
        let mut row = self.clone();
        if row.count_input {
            row.penalized = PenaltyHistory::with_pending_output(&row.penalized, input);
            row.count_input = false;
        }
        row
    }

    /// Grammar mask, then bias and penalties, applied to a copy of `raw`. The row must not
    /// `count_input` (its pairs would lack the input token; resolve it with `with_input`).
    pub fn processed(&self, raw: &[f32]) -> Vec<f32> {
        debug_assert!(!self.count_input, "a row that counts its input token is sampled on the host before with_input");
        let mut logits = raw.to_vec();
        if let Some(words) = &self.allow {
            for (i, l) in logits.iter_mut().enumerate() {
                let bits = words.get(i / 32).copied().unwrap_or(0);
                if bits & (1 << (i % 32)) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        apply_penalties(&mut logits, &self.penalties, &self.logit_bias, &self.penalized);
        logits
    }

    /// The host reference sampler: pick a token from one raw logits row; logprobs come from
    /// the raw row.
    pub fn sample(&self, raw: &[f32]) -> SampledToken {
        let logits = self.processed(raw);
        let token = if self.is_greedy() { argmax(&logits) } else { sample_filtered(&logits, self, self.u) };
        self.picked(raw, token)
    }

    /// The probability `sample` gives each token of one raw logits row: the grammar mask,
    /// bias and penalties, then temperature and the filters (greedy: all mass on the argmax).
    /// The target distribution p of the speculative sampling rule.
    pub fn distribution(&self, raw: &[f32]) -> Vec<f64> {
        filtered_distribution(&self.processed(raw), self)
    }

    /// `token`, picked from the raw row `raw` by other means than `sample` (a verified draft),
    /// with the logprobs this row asks for.
    pub fn picked(&self, raw: &[f32], token: u32) -> SampledToken {
        let logprob = self.wants_logprobs().then(|| raw_logprobs(raw, token, self.top_logprobs));
        SampledToken { token, logprob }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_mask_restricts_the_draw_and_logprobs_stay_raw() {
        let raw = [4.0f32, 1.0, 0.5, 0.0, -1.0, 2.0];
        let row = RowSampling { allow: Some(vec![0b10_1000]), logprobs: true, top_logprobs: 1, ..Default::default() };
        for u in [0.0, 0.3, 0.999] {
            let s = RowSampling { u, ..row.clone() }.sample(&raw);
            assert!(s.token == 3 || s.token == 5, "u {u}: token {} is masked out", s.token);
            let lp = s.logprob.unwrap();
            assert_eq!(lp.top[0].0, 0, "top logprobs come from the raw row, mask or not");
        }
        assert_eq!(RowSampling { u: 0.0, ..row.clone() }.sample(&raw).token, 3, "no filter: the draw walks ids in order");
    }

    #[test]
    fn with_input_counts_the_input_only_on_a_row_that_asks() {
        let row = RowSampling {
            temperature: 0.0,
            penalties: PenaltyParams { repetition: 1.0, presence: 1.0, frequency: 2.0 },
            penalized: vec![(1, 1), (2, 0)],
            ..Default::default()
        };
        assert_eq!(row.with_input(1), row, "a row without count_input is unchanged");
        let counting = RowSampling { count_input: true, ..row.clone() };
        let raw = [0.0f32, 6.0, 2.5];
        assert_eq!(RowSampling { penalized: vec![(1, 2), (2, 0)], ..row.clone() }, counting.with_input(1));
        assert_eq!(RowSampling { penalized: vec![(1, 1), (2, 1)], ..row.clone() }, counting.with_input(2));
        assert_eq!(RowSampling { penalized: vec![(1, 1), (2, 0), (0, 1)], ..row.clone() }, counting.with_input(0));
        assert_eq!(row.sample(&raw).token, 1, "6 - 3 beats 2.5");
        assert_eq!(counting.with_input(1).sample(&raw).token, 2, "6 - 5 loses to 2.5");
    }

    /// `distribution` is what `sample` draws from: for every filter, each token's mass is the
    /// share of uniform draws that pick it (draws on a fine grid).
    #[test]
    fn the_distribution_is_what_the_sampler_draws_from() {
        let raw = [0.3f32, 2.0, -1.0, 2.0, 0.9, 1.5, -0.2];
        let rows = [
            RowSampling::default(),
            RowSampling { temperature: 0.7, top_k: 4, ..Default::default() },
            RowSampling { temperature: 1.3, top_p: 0.8, ..Default::default() },
            RowSampling { min_p: 0.3, ..Default::default() },
            RowSampling { top_k: 5, top_p: 0.9, min_p: 0.1, logit_bias: vec![(2, 3.0)], allow: Some(vec![0b101_1110]), ..Default::default() },
            RowSampling { temperature: 0.0, ..Default::default() },
        ];
        let n = 20_000;
        for (r, row) in rows.iter().enumerate() {
            let p = row.distribution(&raw);
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9, "row {r}");
            let mut counts = [0usize; 7];
            for j in 0..n {
                counts[RowSampling { u: (j as f64 + 0.5) / n as f64, ..row.clone() }.sample(&raw).token as usize] += 1;
            }
            for t in 0..7 {
                assert!((counts[t] as f64 / n as f64 - p[t]).abs() < 2.0 / n as f64, "row {r}, token {t}: {} vs {}", counts[t], p[t]);
            }
        }
    }

    #[test]
    fn filtered_draw_walks_candidates_in_descending_order() {
        let raw = [0.0f32, 3.0, 3.0, 1.0];
        let row = RowSampling { top_k: 3, ..Default::default() };
        assert_eq!(RowSampling { u: 0.0, ..row.clone() }.sample(&raw).token, 1, "ties: lower id first");
        assert_eq!(RowSampling { u: 0.999, ..row.clone() }.sample(&raw).token, 3);
        assert_eq!(RowSampling { temperature: 0.0, ..row }.sample(&raw).token, 1);
    }
}
