//! The per-request sampler: penalties, temperature, top-k, top-p, min-p, greedy, a seeded RNG
//! owned by the request, and logprobs of the raw model logits.
//!
//! The RNG belongs to the request (ChaCha8 seeded from `seed`, or from the engine's RNG when
//! absent), and exactly one uniform draw is taken per non-greedy token, so the same seed gives
//! the same tokens whatever else runs in the step, and also after a preemption (recompute).

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::penalties::PenaltyParams;
use super::{PenaltyHistory, RowSampling, SamplingParams, TokenMask};

/// Logprob of the sampled token and the most likely alternatives at one position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token_id: u32,
    /// Its log-probability under the raw model distribution.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// One sampling decision.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    /// The chosen token id.
    pub token: u32,
    /// Present when the request asked for logprobs or top_logprobs.
    pub logprob: Option<TokenLogprob>,
}

/// Sampling state of one request: its RNG and its penalty history.
#[derive(Clone, Debug)]
pub struct RequestSampler {
    rng: ChaCha8Rng,
    history: PenaltyHistory,
}

impl RequestSampler {
    /// `fallback_seed` is used when the request has no seed of its own.
    pub fn new(params: &SamplingParams, prompt: &[u32], fallback_seed: u64) -> Self {
        RequestSampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(fallback_seed)),
            history: PenaltyHistory::new(prompt),
        }
    }

    /// Pick the next token from one raw logits row and record it in the history.
    pub fn sample(&mut self, params: &SamplingParams, raw: &[f32]) -> SampledToken {
        self.sample_masked(params, raw, None)
    }

    /// `sample` restricted to the tokens a grammar `mask` allows (applied before penalties and
    /// warpers, so they only ever see allowed tokens). Logprobs still come from the raw row.
    pub fn sample_masked(&mut self, params: &SamplingParams, raw: &[f32], mask: Option<&TokenMask>) -> SampledToken {
        let row = self.prepare(params, mask, raw.len());
        let s = row.sample(raw);
        self.record(s.token);
        s
    }

    /// Everything the next token's sampler needs over a vocabulary of `vocab` tokens: the
    /// request's parameters, its penalty history, the grammar mask, and one uniform draw from
    /// the request's RNG when sampling is not greedy.
    pub fn prepare(&mut self, params: &SamplingParams, mask: Option<&TokenMask>, vocab: usize) -> RowSampling {
        let u = if params.is_greedy() { 0.0 } else { self.rng.random() };
        RowSampling {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            u,
            penalties: PenaltyParams::of(params),
            penalized: self.history.penalized(params),
            count_input: false,
            logit_bias: params.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
            allow: mask.map(|m| m.bitset(vocab)),
            logprobs: params.logprobs,
            top_logprobs: params.top_logprobs,
        }
    }

    /// One more uniform draw in [0, 1) from the request's RNG, beyond the one each row takes:
    /// what the speculative sampling rule draws a draft token or a residual token with.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random()
    }

    /// Record the token that was sampled from the row `prepare` returned.
    pub fn record(&mut self, token: u32) {
        self.history.push_output(token);
    }
}

/// Index of the largest logit (the lowest index among ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of the raw logits at `token`, plus the `top` most likely tokens.
pub fn raw_logprobs(raw: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + raw.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let lp = |t: u32| (raw[t as usize] as f64 - lse) as f32;
    let top = top_indices(raw, top).into_iter().map(|t| (t, lp(t))).collect();
    TokenLogprob { token_id: token, logprob: lp(token), top }
}

/// The `k` largest entries, largest first, lower index first among ties.
fn top_indices(values: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| values[*b as usize].total_cmp(&values[*a as usize]).then(a.cmp(b));
    let k = k.min(idx.len());
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

/// Temperature, then top-k, top-p and min-p (HF warper order), then inverse-CDF sampling with
/// the uniform draw `u` over the kept candidates in descending probability order (ties: lower
/// id first).
///
/// With no filter at all the draw walks the whole vocabulary in id order (same distribution,
/// no sort); otherwise over `filtered_candidates`.
pub(crate) fn sample_filtered(logits: &[f32], params: &RowSampling, u: f64) -> u32 {
    let n = logits.len();
    if !params.is_filtered(n) {
        let weight = tempered_weights(logits, params.temperature);
        let total: f64 = (0..n as u32).map(&weight).sum();
        let mut cum = 0.0;
        for i in 0..n as u32 {
            cum += weight(i) / total;
            if u < cum {
                return i;
            }
        }
        return argmax(logits);
    }
    let (cand, probs) = filtered_candidates(logits, params);
    let mut cum = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cum += p;
        if u < cum {
            return cand[i];
        }
    }
    *cand.last().expect("at least one candidate")
}

/// The probability of every token under temperature and the filters `params` holds, exactly
/// the distribution `sample_filtered` draws from (greedy: all mass on the argmax).
pub(crate) fn filtered_distribution(logits: &[f32], params: &RowSampling) -> Vec<f64> {
    let n = logits.len();
    let mut p = vec![0.0; n];
    if params.is_greedy() {
        p[argmax(logits) as usize] = 1.0;
    } else if !params.is_filtered(n) {
        let weight = tempered_weights(logits, params.temperature);
        let total: f64 = (0..n as u32).map(&weight).sum();
        for (i, x) in p.iter_mut().enumerate() {
            *x = weight(i as u32) / total;
        }
    } else {
        let (cand, probs) = filtered_candidates(logits, params);
        for (&t, &q) in cand.iter().zip(&probs) {
            p[t as usize] = q;
        }
    }
    p
}

/// Unnormalized weight of each token at temperature `t`: `exp((logit - max) / t)`.
fn tempered_weights(logits: &[f32], t: f32) -> impl Fn(u32) -> f64 + '_ {
    let inv_t = 1.0 / t as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    move |i: u32| ((logits[i as usize] as f64 - max) * inv_t).exp()
}

/// The candidates top-k, top-p and min-p keep (at least one), in descending probability order
/// (ties: lower id first), with their renormalized probabilities.
///
/// Only the candidates a filter can keep are sorted: the top-k set, a growing top slice until
/// it holds `top_p` of the mass, or the tokens above the min-p floor.
fn filtered_candidates(logits: &[f32], params: &RowSampling) -> (Vec<u32>, Vec<f64>) {
    let weight = tempered_weights(logits, params.temperature);
    let n = logits.len();
    // `z`: the mass top-p takes its share of. Top-k renormalizes over the kept set (HF order);
    // without top-k it is the whole vocabulary's, NOT the sorted slice's: that slice is only
    // what must be sorted to hold the nucleus, and renormalizing over it shrank the nucleus.
    let (mut cand, z) = if params.top_k > 0 && params.top_k < n {
        let c = top_indices(logits, params.top_k);
        let z: f64 = c.iter().map(|&i| weight(i)).sum();
        (c, z)
    } else if params.top_p < 1.0 {
        let total: f64 = (0..n as u32).map(&weight).sum();
        let mut k = 64.min(n);
        loop {
            let c = top_indices(logits, k);
            let mass: f64 = c.iter().map(|&i| weight(i)).sum::<f64>() / total;
            if mass >= params.top_p as f64 || k == n {
                break (c, total);
            }
            k = (k * 4).min(n);
        }
    } else {
        let floor = params.min_p as f64;
        let mut c: Vec<u32> = (0..n as u32).filter(|&i| weight(i) >= floor).collect();
        c.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
        let z: f64 = c.iter().map(|&i| weight(i)).sum();
        (c, z)
    };
    let mut probs: Vec<f64> = cand.iter().map(|&i| weight(i) / z).collect();
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if cum >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep);
        probs.truncate(keep);
        normalize(&mut probs);
    }
    if params.min_p > 0.0 {
        let floor = probs[0] * params.min_p as f64;
        let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        cand.truncate(keep);
        probs.truncate(keep);
        normalize(&mut probs);
    }
    (cand, probs)
}

/// Inverse-CDF draw with `u` in [0, 1) over `probs` walked in id order; the last token with
/// mass when rounding leaves `u` past the total.
pub fn draw(probs: &[f64], u: f64) -> u32 {
    let mut cum = 0.0;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cum += p;
            last = i;
            if u < cum {
                return i as u32;
            }
        }
    }
    last as u32
}

fn normalize(p: &mut [f64]) {
    let s: f64 = p.iter().sum();
    if s > 0.0 {
        p.iter_mut().for_each(|x| *x /= s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_picks_the_largest_processed_logit() {
        let p = params(|p| p.temperature = 0.0);
        let mut s = RequestSampler::new(&p, &[], 0);
        assert_eq!(s.sample(&p, &[0.1, 3.0, 2.0]).token, 1);
        let p = params(|p| {
            p.temperature = 0.0;
            p.logit_bias = [(2, 5.0)].into_iter().collect();
        });
        assert_eq!(s.sample(&p, &[0.1, 3.0, 2.0]).token, 2);
    }

    /// bf16 logits (logits_dtype "auto") turn near-ties into exact ties: greedy (and top-k 1)
    /// must take the lowest id among equal maxima, as torch.argmax does.
    #[test]
    fn greedy_takes_the_lowest_id_among_tied_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0, 3.0]), 1);
        assert_eq!(argmax(&[2.5; 9]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, 0.5, 0.5]), 1);
        let raw: Vec<f32> = (0..5000).map(|i| half::bf16::from_f32(((i * 7919) % 1000) as f32 / 1000.0).to_f32()).collect();
        let best = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let first = raw.iter().position(|&x| x == best).unwrap() as u32;
        assert!(raw.iter().filter(|&&x| x == best).count() > 1, "the row must hold tied maxima");
        let greedy = params(|p| p.temperature = 0.0);
        assert_eq!(RequestSampler::new(&greedy, &[], 0).sample(&greedy, &raw).token, first);
        let top1 = params(|p| {
            p.top_k = 1;
            p.seed = Some(3);
        });
        assert_eq!(RequestSampler::new(&top1, &[], 0).sample(&top1, &raw).token, first);
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_seed() {
        let raw = [0.5, 0.1, 0.9, 0.3];
        for seed in 0..20 {
            let p = params(|p| {
                p.top_k = 1;
                p.seed = Some(seed);
            });
            assert_eq!(RequestSampler::new(&p, &[], 0).sample(&p, &raw).token, 2);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let raw = [5.0, 4.9, -10.0, -10.0];
        for seed in 0..50 {
            let p = params(|p| {
                p.top_p = 0.9;
                p.seed = Some(seed);
            });
            assert!(RequestSampler::new(&p, &[], 0).sample(&p, &raw).token < 2);
        }
    }

    /// The token an exact nucleus gives: sort the whole vocabulary (lower id first on ties), keep
    /// the shortest prefix holding `top_p` of the WHOLE mass, inverse CDF over it.
    fn exact_nucleus_token(raw: &[f32], top_p: f64, u: f64) -> u32 {
        let mut order: Vec<usize> = (0..raw.len()).collect();
        order.sort_by(|&a, &b| raw[b].total_cmp(&raw[a]).then(a.cmp(&b)));
        let max = raw[order[0]] as f64;
        let w = |i: usize| (raw[i] as f64 - max).exp();
        let z: f64 = raw.iter().enumerate().map(|(i, _)| w(i)).sum();
        let (mut cum, mut len) = (0.0, 0);
        while len < order.len() && cum < top_p {
            cum += w(order[len]) / z;
            len += 1;
        }
        let nz: f64 = order[..len].iter().map(|&i| w(i)).sum();
        let mut c = 0.0;
        for &i in &order[..len] {
            c += w(i) / nz;
            if u < c {
                return i as u32;
            }
        }
        order[len - 1] as u32
    }

    /// Top-p without top-k takes its share of the whole vocabulary's mass, although only a top
    /// slice is sorted: renormalizing over that slice cut the nucleus short (the device sampler,
    /// which selects over the whole row, caught it). Exact tokens, not just nucleus membership.
    #[test]
    fn top_p_over_a_large_vocabulary_matches_the_exact_nucleus() {
        // Five tokens per value: ties go lower id first.
        let raw: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
        for top_p in [0.5f32, 0.9, 0.3] {
            for j in 0..200 {
                let u = (j as f64 + 0.5) / 200.0;
                let row = RowSampling { top_p, u, ..Default::default() };
                assert_eq!(row.sample(&raw).token, exact_nucleus_token(&raw, top_p as f64, u), "top_p {top_p}, u {u}");
            }
        }
        // A flat row: the nucleus of 0.5 is 50_002 of 100_003 tokens, walked in id order.
        let flat = vec![0.5f32; 100_003];
        for (u, want) in [(0.0, 0), (0.2, 10_000), (0.6, 30_001), (0.99, 49_501)] {
            assert_eq!(RowSampling { top_p: 0.5, u, ..Default::default() }.sample(&flat).token, want, "flat row, u {u}");
        }
        // With top-k the share is of the top-k mass (HF order: top-k, then top-p renormalized).
        let row = RowSampling { top_k: 4, top_p: 0.5, u: 0.99, ..Default::default() };
        assert_eq!(row.sample(&[0.0; 5]).token, 1, "half of the top-k 4 is ids 0 and 1 (of the vocabulary: 0, 1, 2)");
    }

    #[test]
    fn min_p_drops_tokens_below_the_fraction_of_the_top_probability() {
        let raw = [3.0, 2.9, 0.0, 0.0];
        for seed in 0..50 {
            let p = params(|p| {
                p.min_p = 0.5;
                p.seed = Some(seed);
            });
            assert!(RequestSampler::new(&p, &[], 0).sample(&p, &raw).token < 2);
        }
    }

    #[test]
    fn same_seed_gives_same_tokens_and_sampling_follows_the_distribution() {
        let raw = [0.0f32, 1.0, 2.0];
        let p = params(|p| p.seed = Some(7));
        let run = || {
            let mut s = RequestSampler::new(&p, &[], 0);
            (0..2000).map(|_| s.sample(&p, &raw).token).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        let z: f64 = raw.iter().map(|&l| (l as f64).exp()).sum();
        for t in 0..3 {
            let freq = a.iter().filter(|&&x| x == t).count() as f64 / a.len() as f64;
            let expect = (raw[t as usize] as f64).exp() / z;
            assert!((freq - expect).abs() < 0.04, "token {t}: {freq} vs {expect}");
        }
    }

    #[test]
    fn logprobs_are_log_softmax_of_raw_logits_with_sorted_top() {
        let raw = [1.0f32, 3.0, 2.0];
        let p = params(|p| {
            p.temperature = 0.0;
            p.logprobs = true;
            p.top_logprobs = 2;
            p.logit_bias = [(0, 50.0)].into_iter().collect();
        });
        let out = RequestSampler::new(&p, &[], 0).sample(&p, &raw);
        assert_eq!(out.token, 0);
        let lp = out.logprob.unwrap();
        let z: f64 = raw.iter().map(|&l| (l as f64).exp()).sum();
        assert!((lp.logprob as f64 - (1.0 - z.ln())).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((lp.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-5);
    }
}
