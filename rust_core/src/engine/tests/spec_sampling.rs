//! Sampled requests under `--spec mtp` (drafts drawn from the head's distribution q, verified
//! by the speculative sampling rule) output what plain sampling outputs in distribution: over a
//! fixed set of seeds on a 4-token vocabulary, a chi-square test of homogeneity between the
//! output sequences with and without drafts passes, and fails when the rule is broken.

use super::*;
use crate::sampling::draw;
use crate::spec::{speculative_rule, DraftRule, SpecConfig};

const VOCAB4: usize = 4;
const TOKENS_OUT: usize = 4;

fn base() -> Setup {
    let cfg = EngineConfig { block_size: 4, max_concurrency: 64, prefill_chunk: 512, kv_capacity_tokens: Some(64 * 64), ..Setup::default().cfg };
    Setup { vocab: VOCAB4, cfg, ..Default::default() }
}

fn with_mtp(k: usize) -> Setup {
    let mut s = base();
    s.cfg.spec = Some(SpecConfig::new("mtp", Some(k)).unwrap());
    s.mtp = true;
    s
}

/// The output of one request per seed of `seeds` (the same prompt and settings), run with
/// `rule` verifying sampled drafts; the engine's draft counters.
fn outputs(setup: &Setup, rule: DraftRule, params: &SamplingParams, seeds: std::ops::Range<u64>) -> (Vec<Vec<u32>>, crate::spec::SpecStats) {
    let (mut core, _) = setup.build();
    core.draft_rule = rule;
    let prompt = vec![1, 2, 3, 0, 1, 2];
    for seed in seeds.clone() {
        core.add_request(&format!("s{seed}"), prompt.clone(), SamplingParams { seed: Some(seed), max_tokens: TOKENS_OUT, ..params.clone() }).unwrap();
    }
    let all = run_all(&mut core);
    let out = seeds.map(|s| all[&format!("s{s}")].tokens.clone()).collect();
    (out, core.stats().spec)
}

/// Pearson's chi-square statistic of homogeneity of two equally large samples of sequences,
/// with its degrees of freedom: cells with fewer than 10 observations in both samples together
/// are pooled into one.
fn chi_square(a: &[Vec<u32>], b: &[Vec<u32>]) -> (f64, usize) {
    let mut cells: HashMap<&[u32], (f64, f64)> = HashMap::new();
    for s in a {
        cells.entry(s).or_default().0 += 1.0;
    }
    for s in b {
        cells.entry(s).or_default().1 += 1.0;
    }
    let (mut stat, mut n, mut rest) = (0.0, 0, (0.0, 0.0));
    for &(x, y) in cells.values() {
        if x + y < 10.0 {
            rest = (rest.0 + x, rest.1 + y);
        } else {
            stat += (x - y) * (x - y) / (x + y);
            n += 1;
        }
    }
    if rest.0 + rest.1 > 0.0 {
        stat += (rest.0 - rest.1) * (rest.0 - rest.1) / (rest.0 + rest.1);
        n += 1;
    }
    (stat, n - 1)
}

/// The chi-square quantile at 1 - 1e-3 for `df` degrees of freedom (Wilson-Hilferty).
fn critical(df: usize) -> f64 {
    let (d, z) = (df as f64, 3.090);
    let c = 2.0 / (9.0 * d);
    d * (1.0 - c + z * c.sqrt()).powi(3)
}

/// Accept with min(1, p/q) but redraw a rejected position from p itself, not from the residual.
fn redraw_from_p(p: &[f64], q: &[f32], x: u32, r: f64, more: &mut dyn FnMut() -> f64) -> u32 {
    if r * (q[x as usize] as f64) < p[x as usize] {
        return x;
    }
    draw(p, more())
}

/// Accept every draft token the target could sample (p > 0), whatever its probability.
fn accept_what_p_allows(p: &[f64], q: &[f32], x: u32, r: f64, more: &mut dyn FnMut() -> f64) -> u32 {
    if p[x as usize] > 0.0 {
        return x;
    }
    speculative_rule(p, q, x, r, more)
}

/// Treat the draft as a point mass (the n-gram's rule): accept with p(x), else redraw from p
/// without x. Exact for any draft drawn independently of the target's draws, only accepted less
/// often: not a broken rule, and the test must not flag it.
fn point_mass(p: &[f64], _q: &[f32], x: u32, r: f64, more: &mut dyn FnMut() -> f64) -> u32 {
    if r < p[x as usize] {
        return x;
    }
    let mut rest = p.to_vec();
    rest[x as usize] = 0.0;
    let mass: f64 = rest.iter().sum();
    if mass <= 0.0 {
        return x;
    }
    rest.iter_mut().for_each(|v| *v /= mass);
    draw(&rest, more())
}

#[test]
fn sampled_mtp_drafts_follow_plain_sampling_by_a_chi_square_test_that_catches_a_broken_rule() {
    let n = 3000u64;
    // Penalties and a logit bias: the target's p at every draft position is the full row
    // processing over the tokens accepted before it. And temperature with top-k / top-p, which
    // shape q too.
    let settings = [
        SamplingParams { temperature: 1.0, frequency_penalty: 0.6, logit_bias: [(2, 0.8)].into_iter().collect(), ..Default::default() },
        SamplingParams { temperature: 0.8, top_k: 3, top_p: 0.95, ..Default::default() },
    ];
    for (c, params) in settings.iter().enumerate() {
        let (plain, _) = outputs(&base(), speculative_rule, params, 0..n);
        // A second seed set of plain sampling: what the statistic is between two samples of the
        // same distribution.
        let (plain2, _) = outputs(&base(), speculative_rule, params, n..2 * n);
        let (spec, stats) = outputs(&with_mtp(3), speculative_rule, params, n..2 * n);
        assert!(stats.accepted > 0 && stats.accepted < stats.drafted, "settings {c}: drafts accepted and rejected: {stats:?}");
        let (again, _) = outputs(&with_mtp(3), speculative_rule, params, n..n + 200);
        assert_eq!(again[..], spec[..200], "settings {c}: seeded runs with drafts are reproducible");
        let check = |name: &str, other: &[Vec<u32>]| {
            let (stat, df) = chi_square(&plain, other);
            eprintln!("settings {c}, {name}: chi-square {stat:.1} on {df} df (critical {:.1})", critical(df));
            stat < critical(df)
        };
        assert!(check("plain", &plain2), "settings {c}: two plain samples");
        assert!(check("speculative rule", &spec), "settings {c}: the speculative sampling rule follows plain sampling");
        assert!(check("point mass", &outputs(&with_mtp(3), point_mass, params, n..2 * n).0), "settings {c}: the point-mass rule is exact too");
        for (name, broken) in [("redraw from p", redraw_from_p as DraftRule), ("accept what p allows", accept_what_p_allows)] {
            let (out, _) = outputs(&with_mtp(3), broken, params, n..2 * n);
            assert!(!check(name, &out), "settings {c}: the test catches the broken rule {name:?}");
        }
    }
}
