//! Speculative decoding (`--spec ngram`): verified drafts never change what a request outputs.
//! The toy's tokens over a vocabulary of a few ids repeat often enough for prompt lookup to
//! propose drafts that are accepted and rejected alike.

use serde_json::json;

use super::*;
use crate::spec::SpecConfig;

fn with_spec(setup: &Setup, k: usize) -> Setup {
    with_method(setup, "ngram", k)
}

/// `setup` with `--spec method --draft-tokens k` (the toy's MTP head for mtp).
fn with_method(setup: &Setup, method: &str, k: usize) -> Setup {
    Setup { cfg: EngineConfig { spec: Some(SpecConfig::new(method, Some(k)).unwrap()), ..setup.cfg.clone() }, mtp: method == "mtp", ..setup.clone() }
}

fn small_vocab(hybrid: bool, vocab: usize) -> Setup {
    let cfg = EngineConfig { block_size: 4, prefill_chunk: 24, ..Setup::default().cfg };
    Setup { vocab, hybrid, cfg, ..Default::default() }
}

fn tiny_prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * i + salt * 3 + i / 3) % vocab).collect()
}

/// A batch of 8 with mixed prompt lengths (chunked under a 24-token budget), greedy and seeded
/// sampled rows, penalties and logit bias, max_tokens from 1 up.
fn mixed_batch(vocab: u32) -> Vec<(Vec<u32>, SamplingParams)> {
    (0..8u32)
        .map(|i| {
            let p = tiny_prompt(5 + 9 * i as usize, i, vocab);
            let params = match i % 4 {
                0 => greedy(1 + 7 * i as usize),
                1 => SamplingParams { max_tokens: 30, seed: Some(i as u64), ..Default::default() },
                2 => SamplingParams { frequency_penalty: 0.4, logit_bias: [(1, 0.7)].into_iter().collect(), ..greedy(25) },
                _ => SamplingParams { max_tokens: 40, seed: Some(7), top_k: 2, presence_penalty: 0.3, ..Default::default() },
            };
            (p, params)
        })
        .collect()
}

#[test]
fn greedy_and_seeded_outputs_with_ngram_drafts_equal_plain_decoding() {
    for hybrid in [false, true] {
        let base = small_vocab(hybrid, 3);
        let reqs = mixed_batch(3);
        let (plain, _, _) = run_requests(&base, &reqs);
        for k in [1, 3, 5] {
            let (spec, core, _) = run_requests(&with_spec(&base, k), &reqs);
            for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
                assert_eq!((&a.tokens, a.finish), (&b.tokens, b.finish), "hybrid {hybrid}, K {k}, request {i}");
                assert_eq!(b.tokens.len(), b.tokens.len().min(reqs[i].1.max_tokens), "max_tokens is never overshot");
            }
            let s = core.stats();
            assert!(s.spec.accepted > 0 && s.spec.accepted < s.spec.drafted, "hybrid {hybrid}, K {k}: both accepted and rejected drafts: {:?}", s.spec);
            assert_eq!(s.kv_blocks_used, 0, "every block is back in the pool");
            assert!(s.spec.mean_accepted_length() > 1.0);
            assert_eq!(s.spec.replayed_tokens > 0, hybrid, "only a recurrent state is replayed");
            assert_eq!(s.spec.rollback_tokens, 0, "the toy replays: no forward reruns tokens");
            if hybrid {
                // The recompute route (a runner without replay) outputs the same and reruns
                // the tokens replay replayed, less those replayed twice around a snapshot's
                // boundary (none: replay continues from the snapshot).
                let (recomputed, core, _) = run_requests(&Setup { recompute: true, ..with_spec(&base, k) }, &reqs);
                for (i, (a, b)) in spec.iter().zip(&recomputed).enumerate() {
                    assert_eq!((&a.tokens, a.finish), (&b.tokens, b.finish), "K {k}, request {i}: replay and recompute");
                }
                let r = core.stats();
                assert_eq!((r.spec.rollback_tokens, r.spec.replayed_tokens), (s.spec.replayed_tokens, 0), "K {k}");
            }
        }
    }
}

#[test]
fn a_request_takes_fewer_steps_with_drafts_and_each_request_alone_matches_the_batch() {
    let base = small_vocab(true, 3);
    let spec = with_spec(&base, 4);
    let reqs = mixed_batch(3);
    let (together, _, _) = run_requests(&spec, &reqs);
    let long = [(tiny_prompt(9, 5, 3), greedy(80))];
    let (_, core, _) = run_requests(&spec, &long);
    let (_, plain_core, _) = run_requests(&base, &long);
    assert!(core.stats().steps < plain_core.stats().steps, "{} steps with drafts, {} without", core.stats().steps, plain_core.stats().steps);
    for (i, r) in reqs.iter().enumerate() {
        let (alone, _, _) = run_requests(&spec, std::slice::from_ref(r));
        assert_eq!(alone[0].tokens, together[i].tokens, "request {i}");
    }
}

#[test]
fn verify_chunks_share_a_step_with_prompt_chunks() {
    let base = small_vocab(true, 3);
    let (mut core, log) = with_spec(&base, 3).build();
    core.add_request("early", tiny_prompt(6, 1, 3), greedy(60)).unwrap();
    for _ in 0..8 {
        core.step().unwrap();
    }
    core.add_request("late", tiny_prompt(70, 2, 3), greedy(5)).unwrap();
    run_all(&mut core);
    let steps = log.lock().unwrap().steps.clone();
    let mixed = steps.iter().filter(|s| s.seqs.len() == 2 && s.seqs.iter().any(|q| q.tokens.len() > 1 && q.logits == crate::model::LogitsWanted::All));
    assert!(mixed.count() > 0, "a verify chunk ran beside a prompt chunk");
}

#[test]
fn prefix_cache_hits_with_drafts_equal_a_miss() {
    for (hybrid, method) in [(false, "ngram"), (true, "ngram"), (false, "mtp"), (true, "mtp")] {
        let base = small_vocab(hybrid, 3);
        let spec = with_method(&base, method, 3);
        let p1 = tiny_prompt(30, 4, 3);
        let (mut core, _) = spec.build();
        core.add_request("turn1", p1.clone(), greedy(40)).unwrap();
        let t1 = run_all(&mut core).remove("turn1").unwrap();
        let mut p2 = p1.clone();
        p2.extend(&t1.tokens);
        p2.extend(tiny_prompt(5, 9, 3));
        core.add_request("turn2", p2.clone(), greedy(20)).unwrap();
        let t2 = run_all(&mut core).remove("turn2").unwrap();
        assert!(t2.cached_tokens > 0, "hybrid {hybrid}, {method}: the second turn hit the cache");
        let no_reuse = Setup { cfg: EngineConfig { prefix_reuse: false, ..base.cfg.clone() }, ..base.clone() };
        let (fresh, _, _) = run_requests(&no_reuse, &[(p2, greedy(20))]);
        assert_eq!(t2.tokens, fresh[0].tokens, "hybrid {hybrid}, {method}");
        assert_eq!(core.stats().kv_blocks_used, 0);
    }
}

/// Requests of `reqs` (run on `base` with K = 5, outputs checked against plain decoding) whose
/// last token was an accepted draft token: they ended inside a verified draft.
fn ended_inside_a_draft(base: &Setup, reqs: &[(Vec<u32>, SamplingParams)]) -> usize {
    let (plain, _, _) = run_requests(base, reqs);
    let (spec, core, log) = run_requests(&with_spec(base, 5), reqs);
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!((&a.tokens, &a.text, a.finish), (&b.tokens, &b.text, b.finish), "request {i}");
    }
    assert!(core.stats().spec.accepted > 0);
    let steps = log.lock().unwrap().steps.clone();
    let mut inside = 0;
    for ((prompt, _), out) in reqs.iter().zip(&spec) {
        let mut history = prompt.clone();
        history.extend(&out.tokens);
        let last = history.len() - 1;
        let in_draft = steps.iter().flat_map(|s| &s.seqs).any(|q| {
            q.logits == crate::model::LogitsWanted::All
                && q.start_pos < last
                && last < q.start_pos + q.tokens.len()
                && q.tokens[..=last - q.start_pos] == history[q.start_pos..=last]
        });
        inside += usize::from(in_draft && out.finish == Some("stop"));
    }
    inside
}

#[test]
fn stop_strings_and_eos_inside_accepted_drafts_end_the_request_there() {
    let base = Setup { tokenizer: Some(byte_tokenizer()), eos: vec![3], ..small_vocab(false, 4) };
    // EOS (3) occurs in the prompts, so prompt lookup can draft it.
    let eos: Vec<_> = (0..24u32).map(|i| (tiny_prompt(8 + i as usize, i, 4), greedy(50))).collect();
    let by_eos = ended_inside_a_draft(&base, &eos);
    let stop = SamplingParams { stop: vec!["\u{1}\u{1}\u{2}".to_string()], ignore_eos: true, ..greedy(60) };
    let stops: Vec<_> = (0..24u32).map(|i| (tiny_prompt(8 + i as usize, i, 4), stop.clone())).collect();
    let by_stop = ended_inside_a_draft(&base, &stops);
    assert!(by_eos > 0 && by_stop > 0, "EOS inside a draft {by_eos} times, a stop string {by_stop} times");
}

#[test]
fn a_json_schema_grammar_cuts_drafts_it_rejects_and_outputs_match() {
    let base = Setup { vocab: 256, tokenizer: Some(byte_tokenizer()), eos: vec![0], ..Default::default() };
    let schema = json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 12}}, "required": ["a"], "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "list", "schema": schema}});
    let reqs: Vec<_> = (0..4u64)
        .map(|seed| (prompt(6, seed as u32), SamplingParams { seed: Some(seed), max_tokens: 200, response_format: Some(format.clone()), ..Default::default() }))
        .collect();
    let (plain, _, _) = run_requests(&base, &reqs);
    let (spec, core, _) = run_requests(&with_spec(&base, 4), &reqs);
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!((&a.text, a.finish), (&b.text, b.finish), "request {i}");
        serde_json::from_str::<serde_json::Value>(&b.text).unwrap_or_else(|e| panic!("request {i}: {e}: {:?}", b.text));
    }
    assert!(core.stats().spec.drafted > 0);
}

#[test]
fn bad_speculation_flags_are_refused_naming_the_flag() {
    let mut setup = Setup::default();
    setup.cfg.spec = Some(SpecConfig { method: crate::spec::SpecMethod::Ngram, draft_tokens: 0, adaptive: false, lm_head_draft: None, drafter: None });
    let e = EngineCore::new(Box::new(ToyRunner::new(VOCAB, 4096, false)), &setup.cfg, None, Vec::new()).err().unwrap().to_string();
    assert!(e.contains("--draft-tokens"), "{e}");
    setup.cfg.spec = Some(SpecConfig { method: crate::spec::SpecMethod::Mtp, draft_tokens: 9, adaptive: false, lm_head_draft: None, drafter: None });
    let e = EngineCore::new(Box::new(ToyRunner::new(VOCAB, 4096, false)), &setup.cfg, None, Vec::new()).err().unwrap().to_string();
    assert!(e.contains("--draft-tokens"), "{e}");
    setup.cfg.spec = Some(SpecConfig { method: crate::spec::SpecMethod::Dflash, draft_tokens: 3, adaptive: false, lm_head_draft: None, drafter: None });
    let e = EngineCore::new(Box::new(ToyRunner::new(VOCAB, 4096, false)), &setup.cfg, None, Vec::new()).err().unwrap().to_string();
    assert!(e.contains("--spec dflash needs --drafter"), "{e}");
    // The toy runner has no DFlash drafting.
    setup.cfg.spec = Some(SpecConfig { method: crate::spec::SpecMethod::Dflash, draft_tokens: 3, adaptive: false, lm_head_draft: None, drafter: Some("drafter".into()) });
    let e = EngineCore::new(Box::new(ToyRunner::new(VOCAB, 4096, false)), &setup.cfg, None, Vec::new()).err().unwrap().to_string();
    assert!(e.contains("--spec dflash is not supported on this backend yet"), "{e}");
    // The toy runner has no MTP head to draft with.
    setup.cfg.spec = Some(SpecConfig { method: crate::spec::SpecMethod::Mtp, draft_tokens: 3, adaptive: false, lm_head_draft: None, drafter: None });
    let e = EngineCore::new(Box::new(ToyRunner::new(VOCAB, 4096, false)), &setup.cfg, None, Vec::new()).err().unwrap().to_string();
    assert!(e.contains("--spec mtp is not supported on this backend yet"), "{e}");
}

#[test]
fn a_backend_without_draft_verification_is_refused_at_load() {
    let mut setup = Setup::default();
    setup.cfg.spec = Some(SpecConfig::new("ngram", Some(2)).unwrap());
    let runner = FailingRunner { inner: ToyRunner::new(VOCAB, 4096, false), calls: 0, fail_at: usize::MAX, in_sampling: false };
    let e = EngineCore::new(Box::new(runner), &setup.cfg, None, Vec::new()).err().unwrap().to_string();
    assert!(e.contains("--spec") && e.contains("not supported on this backend yet"), "{e}");
}

#[test]
fn drafts_never_cause_a_preemption_and_a_tight_pool_gives_the_plain_output() {
    for hybrid in [false, true] {
        // 8 requests of up to 75 + 40 tokens in a pool of 100 blocks of 4 tokens: decodes preempt.
        let tight = EngineConfig { kv_capacity_tokens: Some(400), max_context: Some(160), ..small_vocab(hybrid, 3).cfg };
        let base = Setup { cfg: tight, ..small_vocab(hybrid, 3) };
        let reqs: Vec<_> = (0..8u32).map(|i| (tiny_prompt(20 + 8 * i as usize, i, 3), greedy(40))).collect();
        let (plain, plain_core, _) = run_requests(&base, &reqs);
        let (spec, core, _) = run_requests(&with_spec(&base, 5), &reqs);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(a.tokens, b.tokens, "hybrid {hybrid}, request {i}");
        }
        assert!(plain_core.stats().preemptions > 0, "the pool is tight enough to preempt");
        assert!(core.stats().preemptions <= plain_core.stats().preemptions, "{} > {}", core.stats().preemptions, plain_core.stats().preemptions);
        assert_eq!(core.stats().kv_blocks_used, 0);
    }
}

#[test]
fn per_request_draft_lengths_mix_in_one_batch_and_zero_turns_drafts_off() {
    let base = small_vocab(true, 3);
    let mut reqs = mixed_batch(3);
    for (i, r) in reqs.iter_mut().enumerate() {
        r.1.draft_tokens = Some(i % 4);
    }
    let (plain, _, _) = run_requests(&base, &mixed_batch(3));
    let (spec, _, log) = run_requests(&with_spec(&base, 8), &reqs);
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(a.tokens, b.tokens, "request {i}");
    }
    let longest = log.lock().unwrap().steps.iter().flat_map(|s| s.seqs.iter().filter(|q| q.logits == crate::model::LogitsWanted::All).map(|q| q.tokens.len())).max();
    assert_eq!(longest, Some(4), "at most 3 drafts after the input token");
    // Without --spec a request's draft_tokens is refused; 0 (off) is accepted.
    let (mut core, _) = base.build();
    let e = core.add_request("r", vec![1, 2], SamplingParams { draft_tokens: Some(2), ..greedy(3) }).unwrap_err().to_string();
    assert!(e.contains("draft_tokens") && e.contains("--spec"), "{e}");
    core.add_request("off", vec![1, 2], SamplingParams { draft_tokens: Some(0), ..greedy(3) }).unwrap();
    let e = SamplingParams { draft_tokens: Some(9), ..greedy(3) }.validate().unwrap_err().to_string();
    assert!(e.contains("draft_tokens") && e.contains('9'), "{e}");
}

/// Decode snapshots of a hybrid model are taken on steps with drafts, at the block boundaries
/// the accepted tokens reach, holding the state after accepted tokens only (the toy fails a
/// step whose restored state disagrees with the KV history): a second turn resumes from the
/// last boundary of the first, as it does without drafts.
#[test]
fn snapshots_on_steps_with_drafts_hold_accepted_tokens_and_serve_the_next_turn() {
    let base = small_vocab(true, 3);
    let p1 = tiny_prompt(30, 4, 3);
    let turns = |setup: &Setup, k: Option<usize>| {
        let (mut core, log) = setup.build();
        core.add_request("turn1", p1.clone(), SamplingParams { draft_tokens: k.filter(|_| setup.cfg.spec.is_some()), ..greedy(41) }).unwrap();
        let t1 = run_all(&mut core).remove("turn1").unwrap();
        let mut p2 = p1.clone();
        p2.extend(&t1.tokens);
        p2.extend(tiny_prompt(5, 9, 3));
        core.add_request("turn2", p2.clone(), SamplingParams { draft_tokens: k.filter(|_| setup.cfg.spec.is_some()), ..greedy(20) }).unwrap();
        let t2 = run_all(&mut core).remove("turn2").unwrap();
        let drafted = core.stats().spec.drafted;
        let steps = log.lock().unwrap().steps.clone();
        (t1, t2, drafted, steps)
    };
    let (plain1, plain2, _, _) = turns(&base, Some(3));
    let last_boundary = (p1.len() + plain1.tokens.len() - 1) / 4 * 4;
    assert_eq!(plain2.cached_tokens, last_boundary, "without drafts the second turn resumes from the first one's last boundary");
    for method in ["ngram", "mtp"] {
        // A request that drafts nothing (its draft_tokens 0) decodes plainly beside them.
        let (t1, t2, drafted, _) = turns(&with_method(&base, method, 3), Some(0));
        assert_eq!((drafted, &t1.tokens, &t2.tokens, t2.cached_tokens), (0, &plain1.tokens, &plain2.tokens, last_boundary), "{method}, no drafts");
        for k in [1, 3, 6] {
            let (t1, t2, drafted, steps) = turns(&with_method(&base, method, k), None);
            assert!(drafted > 0, "{method} K {k}");
            // Every block boundary of turn 1's decoding fell on a step with drafts.
            let verify_boundary = |b: usize| steps.iter().flat_map(|s| &s.seqs).any(|q| q.logits == crate::model::LogitsWanted::All && q.start_pos < b && b <= q.start_pos + q.tokens.len());
            assert!(verify_boundary(last_boundary), "{method} K {k}: the last boundary was reached inside a verify chunk");
            assert_eq!((&t1.tokens, &t2.tokens), (&plain1.tokens, &plain2.tokens), "{method} K {k}");
            assert_eq!(t2.cached_tokens, last_boundary, "{method} K {k}: the snapshot at the last boundary serves the next turn");
        }
    }
}

/// With --spec mtp a cached block's MTP row at its last position reads the token after the
/// block: a request whose token after a shared block differs does not take that block from the
/// cache (the toy fails a draft that reads a stale MTP row), one whose token agrees does.
#[test]
fn mtp_prefix_hits_match_the_token_after_the_hit() {
    let base = small_vocab(false, 5);
    let spec = with_method(&base, "mtp", 3);
    let shared: Vec<u32> = vec![1, 2, 3, 4, 0, 1, 2, 3];
    let prompt = |next: u32| {
        let mut p = shared.clone();
        p.extend([next, 2, 4, 1, 0, 3]);
        p
    };
    let (mut core, _) = spec.build();
    let mut outputs = Vec::new();
    for (name, next) in [("a", 4), ("b", 0), ("c", 4)] {
        core.add_request(name, prompt(next), greedy(30)).unwrap();
        outputs.push(run_all(&mut core).remove(name).unwrap());
    }
    assert_eq!(outputs.iter().map(|o| o.cached_tokens).collect::<Vec<_>>(), [0, 4, 12], "b shares 8 tokens with a but not the token after them");
    let (plain, _, _) = run_requests(&base, &[(prompt(4), greedy(30)), (prompt(0), greedy(30)), (prompt(4), greedy(30))]);
    for (i, (a, b)) in plain.iter().zip(&outputs).enumerate() {
        assert_eq!(a.tokens, b.tokens, "request {i}");
    }
    assert!(core.stats().spec.accepted > 0);
}
