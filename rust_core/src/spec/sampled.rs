//! The speculative sampling rule for drafts drawn from a distribution (MTP and DFlash drafts
//! of sampled requests): the draft token x ~ q is accepted with probability min(1, p(x) / q(x)); on
//! rejection the token is drawn from the residual normalize(max(0, p - q)). Whatever q is, the
//! token out follows p exactly, and a draft close to the target is accepted often.
//!
//! The draft distribution q is the drafter's logits under the request's temperature, top-k,
//! top-p and min-p (`draft_warpers`): the plain sampler's shape, so that a drafter that agrees
//! with the target proposes what the target samples. Penalties, logit bias, the grammar mask and
//! thinking-budget forcing are left out of q: they depend on the tokens drafted before at each
//! depth (a matcher and a history advanced speculatively) and the rule is exact for any q; p
//! has all of them, so a token they forbid has p = 0 and is rejected where it was drafted.
//!
//! A deterministic draft (n-gram prompt lookup) is q = a point mass, for which the rule reduces
//! to drawing the target's token and accepting the draft when they agree (`accept_draft`);
//! that path keeps a seeded request's tokens those of plain decoding.

use crate::sampling::{draw, RowSampling, SamplingParams};

/// The row that shapes an MTP or DFlash draft distribution q from the drafter's logits: the request's
/// temperature, top-k, top-p and min-p only.
pub fn draft_warpers(params: &SamplingParams) -> RowSampling {
    RowSampling { temperature: params.temperature, top_k: params.top_k, top_p: params.top_p, min_p: params.min_p, ..Default::default() }
}

/// A draft token drawn with the uniform `u` from the drafter's raw `logits` under `warpers`,
/// and the distribution q it was drawn from (what verification reads).
pub fn draw_draft(logits: &[f32], warpers: &RowSampling, u: f64) -> (u32, Vec<f32>) {
    let q: Vec<f32> = warpers.distribution(logits).into_iter().map(|x| x as f32).collect();
    let wide: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    (draw(&wide, u), q)
}

/// The verification of one draft token `x` drawn from `q`, with `p` the target's distribution
/// at its position: a rule gets the acceptance draw `r` and takes a second uniform from
/// `more` only when it needs one (a residual draw), and returns the token output there (x when
/// accepted).
pub type DraftRule = fn(p: &[f64], q: &[f32], x: u32, r: f64, more: &mut dyn FnMut() -> f64) -> u32;

/// The speculative sampling rule (the engine's `DraftRule`): accept `x` when `r < p(x) / q(x)`,
/// else draw from normalize(max(0, p - q)). When rounding leaves the residual without mass (p
/// and q equal to float precision) the token is drawn from p.
pub fn speculative_rule(p: &[f64], q: &[f32], x: u32, r: f64, more: &mut dyn FnMut() -> f64) -> u32 {
    let (px, qx) = (p[x as usize], q[x as usize] as f64);
    if r * qx < px {
        return x;
    }
    let mut residual: Vec<f64> = p.iter().zip(q).map(|(&a, &b)| (a - b as f64).max(0.0)).collect();
    let mass: f64 = residual.iter().sum();
    if mass <= 0.0 {
        return draw(p, more());
    }
    residual.iter_mut().for_each(|v| *v /= mass);
    draw(&residual, more())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The output distribution of `rule` for one position, over its draws on a grid (exact for
    /// the dyadic probabilities below).
    fn output_distribution(rule: DraftRule, p: &[f64], q: &[f32]) -> Vec<f64> {
        let n = 64;
        let mut out = vec![0.0; p.len()];
        let qw: Vec<f64> = q.iter().map(|&x| x as f64).collect();
        for i in 0..n {
            let x = draw(&qw, (i as f64 + 0.5) / n as f64);
            for j in 0..n {
                let r = (j as f64 + 0.5) / n as f64;
                for k in 0..n {
                    let mut once = Some((k as f64 + 0.5) / n as f64);
                    let t = rule(p, q, x, r, &mut || once.take().expect("one residual draw"));
                    out[t as usize] += 1.0 / (n * n * n) as f64;
                }
            }
        }
        out
    }

    #[test]
    fn the_rule_outputs_the_target_distribution_whatever_the_draft() {
        let p = [0.5, 0.25, 0.125, 0.125, 0.0];
        for q in [[0.125f32, 0.125, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]] {
            let out = output_distribution(speculative_rule, &p, &q);
            for t in 0..5 {
                assert!((out[t] - p[t]).abs() < 1e-9, "q {q:?}: token {t} out {} vs p {}", out[t], p[t]);
            }
        }
    }

    #[test]
    fn a_draft_equal_to_the_target_is_always_accepted_and_a_forbidden_one_never() {
        let p = [0.25, 0.75, 0.0];
        let q = [0.25f32, 0.75, 0.0];
        let mut no_draw = || -> f64 { panic!("an accepted draft takes no residual draw") };
        assert_eq!(speculative_rule(&p, &q, 1, 0.9999, &mut no_draw), 1);
        // Token 2 has p = 0 (a grammar forbids it): rejected, the residual has no mass on it.
        let q = [0.0f32, 0.0, 1.0];
        for u in [0.0, 0.5, 0.99] {
            let t = speculative_rule(&p, &q, 2, 0.0, &mut || u);
            assert_ne!(t, 2);
        }
    }

    #[test]
    fn draft_warpers_shape_q_like_the_plain_sampler_and_leave_penalties_out() {
        let params = SamplingParams { temperature: 0.5, top_k: 2, frequency_penalty: 1.0, logit_bias: [(0, 9.0)].into_iter().collect(), ..Default::default() };
        let w = draft_warpers(&params);
        let (t, q) = draw_draft(&[1.0, 3.0, 2.0, 0.0], &w, 0.0);
        assert_eq!(t, 1);
        assert_eq!(q[0], 0.0, "no logit bias in q");
        assert_eq!(q[3], 0.0, "top-k 2 keeps ids 1 and 2");
        let e = (-2.0f64).exp();
        assert!((q[1] as f64 - 1.0 / (1.0 + e)).abs() < 1e-6, "temperature 0.5: {q:?}");
    }
}
