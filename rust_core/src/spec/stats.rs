//! `SpecStats`: draft and acceptance counters, per request and for the engine.

use super::MAX_DRAFT_TOKENS;

/// Drafted and accepted tokens, per draft position.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verify rounds (decode steps that carried a draft).
    pub verify_steps: u64,
    /// Draft tokens proposed and verified.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Tokens output by verify rounds (accepted drafts plus the target's token).
    pub emitted: u64,
    /// Per draft position j (0-based): rounds whose draft reached position j.
    pub drafted_at: [u64; MAX_DRAFT_TOKENS],
    /// Per draft position j: rounds that accepted the draft token at position j.
    pub accepted_at: [u64; MAX_DRAFT_TOKENS],
    /// Tokens run through a second forward to roll a recurrent state back past rejected drafts
    /// (hybrid models on a runner without state replay; the cost of rollback by recompute).
    pub rollback_tokens: u64,
    /// Tokens whose recurrence alone was replayed to roll a recurrent state back (hybrid
    /// models on a runner with state replay; no forward runs).
    pub replayed_tokens: u64,
    /// `--spec-adaptive`: K choices made (one per decoding request per step, 0 included).
    pub k_choices: u64,
    /// `--spec-adaptive`: the sum of the K chosen.
    pub k_chosen: u64,
}

impl SpecStats {
    /// Count one verify round of `drafted` tokens that accepted `accepted` and output `emitted`.
    pub fn record(&mut self, drafted: usize, accepted: usize, emitted: usize) {
        self.verify_steps += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.emitted += emitted as u64;
        for j in 0..drafted.min(MAX_DRAFT_TOKENS) {
            self.drafted_at[j] += 1;
            self.accepted_at[j] += u64::from(j < accepted);
        }
    }

    /// Tokens output per verify round (1.0 = nothing gained); 0 before any round.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.verify_steps == 0 {
            0.0
        } else {
            self.emitted as f64 / self.verify_steps as f64
        }
    }

    /// Count one `--spec-adaptive` choice of `k` drafts.
    pub fn record_choice(&mut self, k: usize) {
        self.k_choices += 1;
        self.k_chosen += k as u64;
    }

    /// Mean K chosen per request and step by `--spec-adaptive`; None without its choices.
    pub fn mean_k_chosen(&self) -> Option<f64> {
        (self.k_choices > 0).then(|| self.k_chosen as f64 / self.k_choices as f64)
    }

    /// Acceptance rate at each draft position that was ever drafted.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.drafted_at.iter().zip(&self.accepted_at).take_while(|(d, _)| **d > 0).map(|(&d, &a)| a as f64 / d as f64).collect()
    }

    /// Add another's counts.
    pub fn add(&mut self, o: &SpecStats) {
        self.verify_steps += o.verify_steps;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.emitted += o.emitted;
        self.rollback_tokens += o.rollback_tokens;
        self.replayed_tokens += o.replayed_tokens;
        self.k_choices += o.k_choices;
        self.k_chosen += o.k_chosen;
        for j in 0..MAX_DRAFT_TOKENS {
            self.drafted_at[j] += o.drafted_at[j];
            self.accepted_at[j] += o.accepted_at[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_per_draft_position_and_the_mean_counts_the_targets_token() {
        let mut s = SpecStats::default();
        s.record(3, 2, 3);
        s.record(2, 0, 1);
        assert_eq!((s.drafted, s.accepted, s.verify_steps), (5, 2, 2));
        assert_eq!(s.acceptance_by_position(), vec![0.5, 0.5, 0.0]);
        assert_eq!(s.mean_accepted_length(), 2.0);
        assert_eq!(s.mean_k_chosen(), None);
        s.record_choice(3);
        s.record_choice(0);
        let mut t = SpecStats::default();
        t.add(&s);
        assert_eq!(t.mean_k_chosen(), Some(1.5));
    }
}
