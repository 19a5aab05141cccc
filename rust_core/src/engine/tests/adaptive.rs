//! `--spec-adaptive`: K chosen per step and request never changes what a request outputs, a
//! drafter that is always right drafts the most, and the mean K chosen is counted.

use super::*;
use crate::spec::{Drafter, SpecConfig};

fn adaptive(setup: &Setup, k: usize) -> Setup {
    let spec = SpecConfig::new("ngram", Some(k)).unwrap().with_adaptive(true);
    Setup { cfg: EngineConfig { spec: Some(spec), ..setup.cfg.clone() }, ..setup.clone() }
}

fn small_vocab(hybrid: bool, vocab: usize) -> Setup {
    let cfg = EngineConfig { block_size: 4, prefill_chunk: 24, ..Setup::default().cfg };
    Setup { vocab, hybrid, cfg, ..Default::default() }
}

#[test]
fn adaptive_draft_lengths_leave_greedy_and_seeded_outputs_unchanged() {
    for hybrid in [false, true] {
        let base = small_vocab(hybrid, 3);
        let reqs: Vec<_> = (0..8u32)
            .map(|i| {
                let p: Vec<u32> = (0..5 + 7 * i).map(|j| (j * j + i * 3 + j / 3) % 3).collect();
                let params = if i % 2 == 0 { greedy(30 + i as usize) } else { SamplingParams { max_tokens: 25, seed: Some(i as u64), ..Default::default() } };
                (p, params)
            })
            .collect();
        let (plain, _, _) = run_requests(&base, &reqs);
        let (spec, core, _) = run_requests(&adaptive(&base, 5), &reqs);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!((&a.tokens, a.finish), (&b.tokens, b.finish), "hybrid {hybrid}, request {i}");
        }
        let s = &core.stats().spec;
        let mean = s.mean_k_chosen().expect("choices were made");
        assert!((0.0..=5.0).contains(&mean) && s.drafted > 0, "{s:?}");
        assert_eq!(core.stats().kv_blocks_used, 0);
    }
}

/// Drafts `token` every time, up to K.
struct Constant(u32);

impl Drafter for Constant {
    fn propose(&self, _tokens: &[u32], k: usize) -> Vec<u32> {
        vec![self.0; k]
    }
}

/// One greedy request of `n` tokens on a 2-token toy whose output is forced to token 1 (logit
/// bias), drafted by `drafter` with --spec-adaptive up to `max`: (the verify chunks' draft
/// lengths in step order, the engine's counts).
fn forced_run(drafter: u32, max: usize, n: usize) -> (Vec<usize>, crate::spec::SpecStats) {
    let (mut core, log) = adaptive(&small_vocab(false, 2), max).build();
    core.speculation.as_mut().unwrap().1 = Box::new(Constant(drafter));
    let params = SamplingParams { logit_bias: [(1, 100.0)].into_iter().collect(), ..greedy(n) };
    core.add_request("r", vec![0, 1, 0], params).unwrap();
    let out = run_all(&mut core).remove("r").unwrap();
    assert_eq!(out.tokens, vec![1; n]);
    let steps = log.lock().unwrap().steps.clone();
    let drafts = steps.iter().skip(1).flat_map(|s| s.seqs.iter().map(|q| q.tokens.len() - 1)).collect();
    (drafts, core.stats().spec.clone())
}

#[test]
fn a_drafter_that_always_misses_falls_to_k_0_and_probes() {
    let (drafts, s) = forced_run(0, 4, 300);
    assert_eq!(s.accepted, 0);
    // The warm-up step and the prompt come first; then the decode steps.
    let tail = &drafts[drafts.len() - 150..];
    assert!(tail.iter().all(|&k| k <= 1), "only one-token probes late on: {tail:?}");
    let probes = tail.iter().filter(|&&k| k == 1).count();
    assert!((150 / crate::spec::adaptive::PROBE_EVERY as usize - 1..=150 / crate::spec::adaptive::PROBE_EVERY as usize + 1).contains(&probes), "{tail:?}");
    assert!(s.mean_k_chosen().unwrap() < 1.0, "{s:?}");
}

#[test]
fn a_drafter_that_always_hits_rises_to_the_max() {
    let (drafts, s) = forced_run(1, 4, 300);
    assert_eq!(s.accepted, s.drafted);
    // The last rounds are capped by max_tokens only.
    let tail = &drafts[drafts.len() - 30..drafts.len() - 2];
    assert!(tail.iter().all(|&k| k == 4), "{drafts:?}");
    assert!(s.mean_k_chosen().unwrap() > 3.0, "{s:?}");
}
