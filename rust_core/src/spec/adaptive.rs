//! `--spec-adaptive`: the number of draft tokens K chosen per step and per request.
//!
//! A round with K drafts costs the step's time and outputs 1 + the accepted drafts. The engine
//! times its decode steps by their token count and fits `seconds = base + per_token * tokens`
//! online (`StepCost`); each request keeps an exponentially weighted estimate of the acceptance
//! rate at every draft position given all before it accepted (`AdaptiveK`). The K in 0..=max
//! with the most expected tokens per unit of time wins:
//! `(1 + sum_{j<K} prod_{i<=j} rate_i) / (base / batch + per_token * (1 + K))`, the step's fixed
//! cost shared by the requests it decodes. K = 0 turns drafting off for the request; every
//! `PROBE_EVERY` such steps it drafts one token anyway, so a request whose text turns
//! predictable gets its drafts back.

use std::collections::HashMap;

use super::MAX_DRAFT_TOKENS;

/// Weight of the newest round in a position's acceptance estimate.
const RATE_WEIGHT: f64 = 0.2;
/// Acceptance assumed at a position never measured: drafts start on.
const RATE_PRIOR: f64 = 0.6;
/// Steps at K = 0 between two one-token probes.
pub const PROBE_EVERY: u32 = 16;
/// Weight the cost fit keeps of its past per new step: it follows load and thread changes.
const COST_DECAY: f64 = 0.98;
/// The least a token costs, as a share of the fixed step cost: a draft is never free (drafting,
/// its KV, its sampling), so a position accepted almost never is never worth drafting.
const MIN_TOKEN_SHARE: f64 = 1.0 / 64.0;
/// The token cost assumed before the fit sees steps of different sizes, as a share of the
/// fixed step cost.
const PRIOR_TOKEN_SHARE: f64 = 1.0 / 8.0;

/// Online least-squares fit of a decode step's seconds against its token count, with
/// exponential forgetting.
#[derive(Clone, Debug, Default)]
pub struct StepCost {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl StepCost {
    /// Count one step of `tokens` tokens that took `seconds`.
    pub fn record(&mut self, tokens: usize, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = tokens as f64;
        self.w = self.w * COST_DECAY + 1.0;
        self.sx = self.sx * COST_DECAY + x;
        self.sy = self.sy * COST_DECAY + seconds;
        self.sxx = self.sxx * COST_DECAY + x * x;
        self.sxy = self.sxy * COST_DECAY + x * seconds;
    }

    /// (base seconds per step, seconds per token). Before any step: (1, 1/8), a unit scale
    /// (only the ratio matters to the choice). Until the steps differ in size the measured mean
    /// is split by the prior ratio.
    pub fn fit(&self) -> (f64, f64) {
        if self.w <= 0.0 || self.sy <= 0.0 {
            return (1.0, PRIOR_TOKEN_SHARE);
        }
        let (mx, my) = (self.sx / self.w, self.sy / self.w);
        let var = self.sxx / self.w - mx * mx;
        let split = |mean_y: f64| {
            let base = mean_y / (1.0 + PRIOR_TOKEN_SHARE * mx);
            (base, base * PRIOR_TOKEN_SHARE)
        };
        if var < 0.25 {
            return split(my);
        }
        let slope = (self.sxy / self.w - mx * my) / var;
        let base = my - slope * mx;
        if base <= 0.0 || slope <= 0.0 {
            return split(my);
        }
        (base, slope.max(base * MIN_TOKEN_SHARE))
    }
}

/// One request's acceptance estimates and its K choice.
#[derive(Clone, Debug)]
pub struct AdaptiveK {
    /// Estimated acceptance rate at each draft position, given all before it accepted.
    rate: [f64; MAX_DRAFT_TOKENS],
    /// Steps spent at K = 0 since drafting last ran.
    idle: u32,
}

impl Default for AdaptiveK {
    fn default() -> Self {
        AdaptiveK { rate: [RATE_PRIOR; MAX_DRAFT_TOKENS], idle: 0 }
    }
}

impl AdaptiveK {
    /// Expected tokens out of a round of `k` drafts: the target's token plus each draft position
    /// reached and accepted.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let mut reach = 1.0;
        let mut total = 1.0;
        for &r in &self.rate[..k.min(MAX_DRAFT_TOKENS)] {
            reach *= r;
            total += reach;
        }
        total
    }

    /// The K in 0..=max with the most expected tokens per second, where a step costs
    /// `base / batch + per_token * (1 + K)` for this request (`StepCost::fit`, `batch` requests
    /// decoding). A probe of one token replaces every `PROBE_EVERY`-th K = 0.
    pub fn choose(&mut self, max: usize, (base, per_token): (f64, f64), batch: usize) -> usize {
        let max = max.min(MAX_DRAFT_TOKENS);
        let share = base / batch.max(1) as f64;
        let value = |k: usize| self.expected_tokens(k) / (share + per_token * (1 + k) as f64);
        // Ties keep the shorter draft.
        let best = (1..=max).fold(0, |best, k| if value(k) > value(best) { k } else { best });
        if best > 0 || max == 0 {
            self.idle = 0;
            return best;
        }
        self.idle += 1;
        if self.idle >= PROBE_EVERY {
            self.idle = 0;
            return 1;
        }
        0
    }

    /// Count a verified round: `drafted` positions reached, the first `accepted` accepted.
    /// Positions after the first rejection were not tried and keep their estimates.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        for j in 0..drafted.min(accepted + 1).min(MAX_DRAFT_TOKENS) {
            let hit = if j < accepted { 1.0 } else { 0.0 };
            self.rate[j] += RATE_WEIGHT * (hit - self.rate[j]);
        }
    }

    /// The current estimate at each position.
    pub fn rates(&self) -> &[f64] {
        &self.rate
    }
}

/// The engine's side of `--spec-adaptive`: the step cost fit and each running request's
/// estimates, by sequence id.
#[derive(Clone, Debug, Default)]
pub struct AdaptiveSpec {
    pub cost: StepCost,
    pub requests: HashMap<u64, AdaptiveK>,
}

impl AdaptiveSpec {
    /// K for request `id` this step, at most `max`, with `batch` requests decoding.
    pub fn choose(&mut self, id: u64, max: usize, batch: usize) -> usize {
        let fit = self.cost.fit();
        self.requests.entry(id).or_default().choose(max, fit, batch)
    }

    /// Count request `id`'s verified round.
    pub fn record(&mut self, id: u64, drafted: usize, accepted: usize) {
        self.requests.entry(id).or_default().record(drafted, accepted);
    }

    /// Drop the estimates of requests no longer running.
    pub fn retain(&mut self, running: impl Fn(u64) -> bool) {
        self.requests.retain(|&id, _| running(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulated rounds against a drafter whose tokens are accepted when `hit(step, j)`, with a
    /// step cost of `base + per_token * tokens` seconds fed back to the fit. Returns each K.
    fn simulate(steps: usize, max: usize, base: f64, per_token: f64, hit: impl Fn(usize, usize) -> bool) -> Vec<usize> {
        let (mut cost, mut a) = (StepCost::default(), AdaptiveK::default());
        (0..steps)
            .map(|s| {
                let k = a.choose(max, cost.fit(), 1);
                let accepted = (0..k).take_while(|&j| hit(s, j)).count();
                if k > 0 {
                    a.record(k, accepted);
                }
                cost.record(1 + k, base + per_token * (1 + k) as f64);
                k
            })
            .collect()
    }

    #[test]
    fn a_drafter_that_always_misses_is_turned_off_and_probed() {
        let ks = simulate(200, 5, 0.010, 0.001, |_, _| false);
        let tail = &ks[100..];
        let probes: Vec<usize> = tail.iter().enumerate().filter(|(_, &k)| k > 0).map(|(i, _)| i).collect();
        assert!(tail.iter().all(|&k| k <= 1), "only probes draft: {tail:?}");
        assert!(!probes.is_empty() && tail.iter().filter(|&&k| k == 0).count() > 80, "mostly off: {tail:?}");
        // Probes come every PROBE_EVERY steps.
        assert!(probes.windows(2).all(|w| w[1] - w[0] == PROBE_EVERY as usize), "{probes:?}");
    }

    #[test]
    fn a_drafter_that_always_hits_rises_to_the_max() {
        let ks = simulate(60, 6, 0.010, 0.001, |_, _| true);
        assert!(ks[20..].iter().all(|&k| k == 6), "{ks:?}");
    }

    #[test]
    fn a_probe_brings_drafts_back_when_the_text_turns_predictable() {
        // Misses for 100 steps, then every draft hits.
        let ks = simulate(260, 4, 0.010, 0.001, |s, _| s >= 100);
        assert_eq!(ks[90..100].iter().filter(|&&k| k > 0).count(), ks[90..100].iter().filter(|&&k| k == 1).count());
        assert!(ks[100..].iter().filter(|&&k| k == 0).count() < 40 && ks[220..].iter().all(|&k| k == 4), "{:?}", &ks[100..]);
    }

    #[test]
    fn expensive_tokens_shorten_the_draft_cheap_ones_lengthen_it() {
        // Acceptance 0.6 at every position.
        let a = AdaptiveK::default();
        let pick = |base: f64, per: f64| a.clone().choose(8, (base, per), 1);
        assert_eq!(pick(1.0, 0.001), 8);
        assert!(pick(1.0, 0.2) < pick(1.0, 0.02));
        // A large batch shares the fixed cost: drafting is worth less per request.
        assert!(a.clone().choose(8, (1.0, 0.05), 32) < a.clone().choose(8, (1.0, 0.05), 1));
        // max caps it; max 0 is off without probes.
        assert_eq!(a.clone().choose(2, (1.0, 0.001), 1), 2);
        let mut off = a.clone();
        assert!((0..3 * PROBE_EVERY).all(|_| off.choose(0, (1.0, 0.001), 1) == 0));
    }

    #[test]
    fn the_cost_fit_recovers_base_and_per_token_seconds() {
        let mut c = StepCost::default();
        for t in [1usize, 4, 2, 8, 3, 1, 6] {
            c.record(t, 0.02 + 0.005 * t as f64);
        }
        let (base, per) = c.fit();
        assert!((base - 0.02).abs() < 1e-9 && (per - 0.005).abs() < 1e-9, "{base} {per}");
        // Steps all of one size: the measured mean is split by the prior ratio.
        let mut one = StepCost::default();
        one.record(1, 0.9);
        let (b, p) = one.fit();
        assert!((b + p - 0.9).abs() < 1e-9 && (p / b - PRIOR_TOKEN_SHARE).abs() < 1e-9);
    }

    #[test]
    fn estimates_move_only_at_positions_tried() {
        let mut a = AdaptiveK::default();
        a.record(3, 1);
        assert!(a.rates()[0] > RATE_PRIOR && a.rates()[1] < RATE_PRIOR && a.rates()[2] == RATE_PRIOR);
        assert!((a.expected_tokens(0) - 1.0).abs() < 1e-12);
    }
}
