//! Asynchronous scheduling (a runner that `overlaps_steps`): every request gets exactly the
//! tokens, text, finish reason and cache hits it gets from the synchronous engine; the lookahead
//! step is taken where it is safe, split where the next sampling row needs the token in flight
//! on the host (a grammar: the forward runs ahead, the sampling after the completion); rows
//! with penalties count it on the runner. The toy's hybrid
//! mode fails any step whose recurrent state disagrees with its KV history, so a snapshot taken
//! from a slot the lookahead already advanced is caught.

use super::*;

/// `setup` with and without overlap: the two runs' results and the overlapping engine.
fn both(setup: &Setup, reqs: &[(Vec<u32>, SamplingParams)]) -> (Vec<Collected>, Vec<Collected>, EngineCore) {
    let (sync, sync_core, _) = run_requests(setup, reqs);
    assert_eq!(sync_core.stats().lookahead_steps, 0);
    assert!(!sync_core.overlaps_steps());
    let (overlapped, core, _) = run_requests(&Setup { overlap: true, ..setup.clone() }, reqs);
    assert!(core.overlaps_steps());
    (sync, overlapped, core)
}

fn assert_same(sync: &[Collected], overlapped: &[Collected]) {
    for (i, (a, b)) in sync.iter().zip(overlapped).enumerate() {
        assert_eq!(a, b, "request {i}: synchronous vs overlapped");
    }
}

fn mixed_requests() -> Vec<(Vec<u32>, SamplingParams)> {
    let seeded = |seed| SamplingParams { temperature: 0.9, top_k: 20, max_tokens: 37, seed: Some(seed), logprobs: true, ..Default::default() };
    vec![
        (prompt(20, 1), greedy(40)),
        (prompt(33, 2), seeded(7)),
        (prompt(5, 3), greedy(1)),
        (prompt(17, 4), greedy(2)),
        (prompt(64, 5), seeded(9)),
        (prompt(16, 6), greedy(50)),
    ]
}

#[test]
fn overlapped_batches_give_the_synchronous_outputs_and_take_lookahead_steps() {
    for hybrid in [false, true] {
        let setup = Setup { hybrid, ..Default::default() };
        let reqs = mixed_requests();
        let (sync, overlapped, core) = both(&setup, &reqs);
        assert_same(&sync, &overlapped);
        let stats = core.stats();
        assert!(stats.lookahead_steps > 20, "hybrid {hybrid}: {} lookahead steps", stats.lookahead_steps);
        assert_eq!(stats.kv_blocks_used, 0, "hybrid {hybrid}: every block is freed");
        assert_eq!(stats.running + stats.waiting, 0);
    }
}

#[test]
fn async_scheduling_off_runs_an_overlapping_runner_step_by_step() {
    let reqs = mixed_requests();
    let (sync, _, _) = run_requests(&Setup::default(), &reqs);
    let off = Setup { overlap: true, cfg: EngineConfig { async_scheduling: false, ..Setup::default().cfg }, ..Default::default() };
    let (outputs, core, _) = run_requests(&off, &reqs);
    assert!(!core.overlaps_steps());
    assert_eq!(core.stats().lookahead_steps, 0);
    assert_same(&sync, &outputs);
}

#[test]
fn a_single_greedy_request_runs_every_decode_but_the_last_as_a_lookahead() {
    let (sync, overlapped, core) = both(&Setup::default(), &[(prompt(10, 1), greedy(30))]);
    assert_same(&sync, &overlapped);
    // Steps: the prompt, then 29 decodes; the first decode follows the prompt step (not all
    // decodes) and the one that reaches max_tokens is never taken ahead.
    let stats = core.stats();
    assert_eq!((stats.steps, stats.lookahead_steps), (30, 28));
}

#[test]
fn eos_and_stop_strings_end_requests_whose_next_step_is_already_queued() {
    let p = prompt(10, 1);
    let (reference, _, _) = run_requests(&Setup::default(), &[(p.clone(), greedy(40))]);
    let eos = reference[0].tokens[12];
    for hybrid in [false, true] {
        let setup = Setup { eos: vec![eos], hybrid, ..Default::default() };
        let reqs = vec![(p.clone(), greedy(40)), (prompt(30, 2), greedy(25)), (prompt(12, 3), SamplingParams { ignore_eos: true, ..greedy(40) })];
        let (sync, overlapped, core) = both(&setup, &reqs);
        assert_same(&sync, &overlapped);
        assert_eq!(overlapped[0].finish, Some("stop"));
        assert_eq!(core.stats().kv_blocks_used, 0);
    }
    let text = Setup { vocab: 127, tokenizer: Some(byte_tokenizer()), ..Default::default() };
    let ascii: Vec<u32> = (0..9u32).map(|i| 32 + (i * 5) % 90).collect();
    let (free, _, _) = run_requests(&text, &[(ascii.clone(), greedy(60))]);
    let stop = free[0].text[20..23].to_string();
    let with_stop = SamplingParams { stop: vec![stop], ..greedy(60) };
    let (sync, overlapped, _) = both(&text, &[(ascii, with_stop)]);
    assert_same(&sync, &overlapped);
    assert_eq!(overlapped[0].finish, Some("stop"));
}

/// Requests with penalties run ahead: each row of a lookahead step counts the token in flight
/// (the step's input) on the runner, so the tokens are the synchronous engine's.
/// The toy samples a fed row on the host after `RowSampling::with_input`, the reference the
/// device sampler is tested against; a row that ignored the token in flight would penalize it
/// one occurrence short and pick other tokens here.
#[test]
fn penalties_run_ahead_and_count_the_token_in_flight() {
    let repetition = SamplingParams { temperature: 0.0, max_tokens: 40, repetition_penalty: 1.3, ..Default::default() };
    let pres_freq = SamplingParams { temperature: 0.8, seed: Some(3), max_tokens: 40, presence_penalty: 0.7, frequency_penalty: 0.9, logprobs: true, ..Default::default() };
    let all_three = SamplingParams {
        temperature: 0.0,
        max_tokens: 35,
        repetition_penalty: 0.9,
        presence_penalty: 1.5,
        frequency_penalty: 2.0,
        top_logprobs: 3,
        ..Default::default()
    };
    let seeded_top_k = SamplingParams { temperature: 1.1, top_k: 8, seed: Some(11), max_tokens: 33, frequency_penalty: 1.2, ..Default::default() };
    let reqs = vec![
        (prompt(12, 1), repetition),
        (prompt(9, 2), pres_freq),
        (prompt(20, 3), all_three),
        (prompt(7, 4), seeded_top_k),
        (prompt(15, 5), greedy(30)),
    ];
    for hybrid in [false, true] {
        let setup = Setup { hybrid, ..Default::default() };
        let (sync, overlapped, core) = both(&setup, &reqs);
        assert_same(&sync, &overlapped);
        assert!(core.stats().lookahead_steps > 20, "hybrid {hybrid}: {} lookahead steps", core.stats().lookahead_steps);
        let unpenalized: Vec<_> = reqs
            .iter()
            .map(|(p, params)| (p.clone(), SamplingParams { repetition_penalty: 1.0, presence_penalty: 0.0, frequency_penalty: 0.0, ..params.clone() }))
            .collect();
        let (plain, _, _) = run_requests(&setup, &unpenalized);
        for i in 0..4 {
            assert_ne!(sync[i].tokens, plain[i].tokens, "hybrid {hybrid}, request {i}: the penalties change the output");
        }
    }
}

fn json_setup(hybrid: bool) -> Setup {
    Setup { vocab: 256, tokenizer: Some(byte_tokenizer()), eos: vec![0], hybrid, ..Default::default() }
}

fn with_format(params: SamplingParams, format: serde_json::Value) -> SamplingParams {
    SamplingParams { response_format: Some(format), ..params }
}

/// A grammar's mask is computed on the host from the token sampled before, so a lookahead with
/// a `response_format` request is split: its forward pass is queued ahead, its rows are built
/// (masks from the advanced grammars) and sampled once the step in flight is completed. Every
/// request, constrained or not, gets the synchronous engine's outputs; requests whose grammar
/// completes, or fails, while the next forward is queued end as they do there.
#[test]
fn grammars_run_their_forward_ahead_and_sample_after_the_token_in_flight() {
    use serde_json::json;
    let schema = json!({"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object",
        "properties": {"label": {"type": "string", "maxLength": 6}, "x": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["label", "x"],
        "additionalProperties": false
    }}});
    let seeded = |seed| SamplingParams { temperature: 0.9, top_k: 30, seed: Some(seed), max_tokens: 120, logprobs: true, ..Default::default() };
    let reqs = vec![
        // A prompt whose greedy object closes after 61 tokens (JSON admits no free whitespace).
        (prompt(9, 3), with_format(SamplingParams { top_logprobs: 2, ..greedy(80) }, json!({"type": "json_object"}))),
        (prompt(6, 1), with_format(seeded(5), json!({"type": "json_object"}))),
        // Complete after a few tokens, in steps whose successor is queued.
        (prompt(5, 2), with_format(greedy(50), json!({"type": "regex", "regex": "[0-9]{4}"}))),
        (prompt(9, 4), with_format(seeded(6), json!({"type": "regex", "regex": "(yes|no)!"}))),
        (prompt(7, 5), with_format(seeded(7), schema.clone())),
        (prompt(4, 6), with_format(greedy(120), schema)),
        // Fails consuming its fourth byte (tests/grammar.rs).
        (prompt(5, 7), with_format(greedy(50), json!({"type": "regex", "regex": "[ab]{3}c{100000}"}))),
        (prompt(12, 8), seeded(8)),
        (prompt(10, 9), SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.5, ..greedy(60) }),
        (prompt(11, 10), greedy(45)),
    ];
    for hybrid in [false, true] {
        let (sync, overlapped, core) = both(&json_setup(hybrid), &reqs);
        assert_same(&sync, &overlapped);
        let stats = core.stats();
        assert!(stats.split_lookahead_steps > 20, "hybrid {hybrid}: {stats:?}");
        assert!(stats.lookahead_steps >= stats.split_lookahead_steps);
        assert_eq!(stats.kv_blocks_used, 0, "hybrid {hybrid}: every block is freed");
        for (i, c) in overlapped.iter().enumerate().take(6) {
            assert_eq!(c.finish, Some("stop"), "hybrid {hybrid}, request {i}: {c:?}");
        }
        assert_eq!((overlapped[2].text.len(), overlapped[6].finish, overlapped[6].tokens.len()), (4, Some("error"), 3));
    }
    // Without a grammar in the batch no lookahead is split.
    let (_, _, plain) = both(&json_setup(false), &reqs[7..]);
    assert_eq!(plain.stats().split_lookahead_steps, 0);
    assert!(plain.stats().lookahead_steps > 20);
}

/// A runner failure in a split lookahead, in its forward (the step before still in flight) or
/// in its sampling (the forward queued, the step before collected), drops every request and
/// leaves nothing launched behind: the next requests run as on a fresh engine.
#[test]
fn a_failed_split_lookahead_leaves_nothing_uncollected() {
    let constrained = with_format(greedy(60), serde_json::json!({"type": "json_object"}));
    let reqs = [(prompt(8, 3), constrained), (prompt(9, 4), greedy(40))];
    for (hybrid, in_sampling) in [(false, true), (false, false), (true, true)] {
        let setup = json_setup(hybrid);
        // Steps: 1 the warm-up, 2 the prompt step, 3 the first decode (after a prefill: not a
        // lookahead), 4 the first split lookahead, 5 the second.
        let inner = ToyRunner::new(setup.vocab, setup.max_pos, hybrid).overlapping();
        let runner = FailingRunner { inner, calls: 0, fail_at: 5, in_sampling };
        let mut core = EngineCore::new(Box::new(runner), &setup.cfg, setup.tokenizer.clone(), setup.eos.clone()).unwrap();
        for (i, (p, params)) in reqs.iter().enumerate() {
            core.add_request(&format!("r{i}"), p.clone(), params.clone()).unwrap();
        }
        let err = (0..10).find_map(|_| core.step().err()).expect("the injected failure happens");
        assert!(err.to_string().contains("injected failure"), "{err}");
        assert_eq!(core.stats().split_lookahead_steps, 1, "the failure is in the second split lookahead");
        assert!(!core.has_unfinished());
        assert_eq!(core.stats().kv_blocks_used, 0);
        for (i, (p, params)) in reqs.iter().enumerate() {
            core.add_request(&format!("again{i}"), p.clone(), params.clone()).unwrap();
        }
        let after = run_all(&mut core);
        let (fresh, _, _) = run_requests(&setup, &reqs);
        assert_eq!((&after["again0"], &after["again1"]), (&fresh[0], &fresh[1]), "hybrid {hybrid}, in sampling {in_sampling}");
    }
}

#[test]
fn hybrid_conversations_resume_from_snapshots_taken_under_overlap() {
    for block in [4, 16] {
        let setup = Setup { hybrid: true, overlap: true, cfg: EngineConfig { block_size: block, ..Setup::default().cfg }, ..Default::default() };
        let sync_setup = Setup { overlap: false, ..setup.clone() };
        // Output lengths that end on, just before and just after a block boundary.
        for (len, max_tokens) in [(40, 24), (40, 23), (40, 25), (37, 27)] {
            let p1 = prompt(len, 3);
            let turn = |s: &Setup| {
                let (mut core, _) = s.build();
                core.add_request("t1", p1.clone(), greedy(max_tokens)).unwrap();
                let t1 = run_all(&mut core).remove("t1").unwrap();
                let mut p2 = p1.clone();
                p2.extend(&t1.tokens);
                p2.extend(prompt(7, 9));
                core.add_request("t2", p2, greedy(12)).unwrap();
                let t2 = run_all(&mut core).remove("t2").unwrap();
                (t1, t2, core.stats())
            };
            let (a1, a2, _) = turn(&sync_setup);
            let (b1, b2, stats) = turn(&setup);
            assert_eq!((&a1, &a2), (&b1, &b2), "block {block}, prompt {len}, max_tokens {max_tokens}");
            assert!(b2.cached_tokens > 0, "the second turn resumes from a snapshot");
            assert!(stats.lookahead_steps > 0);
        }
    }
}

#[test]
fn preemption_under_a_tiny_pool_gives_the_synchronous_outputs() {
    for hybrid in [false, true] {
        let tiny = Setup {
            hybrid,
            cfg: EngineConfig { max_context: Some(64), kv_capacity_tokens: Some(64), block_size: 4, max_concurrency: 4, prefill_chunk: 64, ..Default::default() },
            ..Default::default()
        };
        let reqs: Vec<_> = (0..3).map(|i| (prompt(10 + i, i as u32), greedy(40))).collect();
        let (sync, overlapped, core) = both(&tiny, &reqs);
        assert_same(&sync, &overlapped);
        assert!(core.stats().preemptions > 0);
        assert_eq!(core.stats().kv_blocks_used, 0);
    }
}

#[test]
fn requests_arriving_and_aborted_mid_run_leave_nothing_behind() {
    for hybrid in [false, true] {
        let setup = Setup { hybrid, overlap: true, ..Default::default() };
        let (mut core, _) = setup.build();
        let mut all = HashMap::new();
        core.add_request("long", prompt(20, 1), greedy(60)).unwrap();
        core.add_request("doomed", prompt(25, 2), greedy(60)).unwrap();
        for i in 0..40 {
            if i == 5 {
                core.add_request("late", prompt(30, 3), greedy(20)).unwrap();
            }
            if i == 12 {
                assert!(core.abort("doomed"));
            }
            collect_into(&mut all, core.step().unwrap());
        }
        while core.has_unfinished() {
            collect_into(&mut all, core.step().unwrap());
        }
        let stats = core.stats();
        assert!(stats.lookahead_steps > 0);
        assert_eq!((stats.kv_blocks_used, stats.running, stats.waiting), (0, 0, 0), "hybrid {hybrid}");
        let (alone, _, _) = run_requests(&Setup { hybrid, ..Default::default() }, &[(prompt(20, 1), greedy(60)), (prompt(30, 3), greedy(20)), (prompt(25, 2), greedy(60))]);
        assert_eq!(all["long"].tokens, alone[0].tokens);
        assert_eq!(all["late"].tokens, alone[1].tokens);
        let doomed = &all["doomed"];
        assert_eq!(doomed.finish, Some("abort"));
        assert!(doomed.tokens.len() < 60 && alone[2].tokens.starts_with(&doomed.tokens), "an aborted request's tokens are a prefix of its full output");
    }
}

#[test]
fn score_between_overlapped_steps_leaves_running_requests_untouched() {
    let setup = Setup { overlap: true, ..Default::default() };
    let (mut core, _) = setup.build();
    let mut all = HashMap::new();
    core.add_request("a", prompt(20, 1), greedy(30)).unwrap();
    for _ in 0..6 {
        collect_into(&mut all, core.step().unwrap());
    }
    let p = prompt(40, 4);
    let scores = core.score(&p).unwrap();
    while core.has_unfinished() {
        collect_into(&mut all, core.step().unwrap());
    }
    let (alone, _, _) = run_requests(&Setup::default(), &[(prompt(20, 1), greedy(30))]);
    assert_eq!(all["a"].tokens, alone[0].tokens);
    let (mut fresh, _) = Setup::default().build();
    assert_eq!(fresh.score(&p).unwrap(), scores);
}

#[test]
fn a_request_ending_on_a_block_boundary_under_lookahead_takes_no_stale_snapshot() {
    // One snapshot slot: B's decode-boundary snapshot evicts A's in the step where A ends (EOS),
    // so A's finish would snapshot again, from a slot the queued lookahead already advanced. A
    // later prompt extending A's output would then resume from that stale state (the toy fails
    // the step); without the snapshot it recomputes.
    let cfg = EngineConfig { block_size: 4, snapshot_slots: Some(1), ..Setup::default().cfg };
    let base = Setup { hybrid: true, cfg, ..Default::default() };
    let (pa, pb) = (prompt(10, 1), prompt(10, 2));
    let (free, _, _) = run_requests(&base, &[(pa.clone(), greedy(40))]);
    let out = free[0].tokens.clone();
    let k = (2..39).find(|&k| (10 + k) % 4 == 0 && !out[..k].contains(&out[k])).expect("an EOS position on a block boundary");
    let setup = Setup { eos: vec![out[k]], overlap: true, ..base.clone() };
    let (mut core, _) = setup.build();
    core.add_request("a", pa.clone(), greedy(40)).unwrap();
    // B runs in A's last step and ends before its next block boundary, so nothing evicts the
    // snapshot A's finish would take.
    core.add_request("b", pb, SamplingParams { ignore_eos: true, ..greedy(k + 3) }).unwrap();
    let first = run_all(&mut core);
    assert_eq!(first["a"].tokens, out[..=k].to_vec());
    assert!(core.stats().lookahead_steps > 0);
    let mut pc = pa;
    pc.extend(&out[..k]);
    pc.extend(prompt(5, 3));
    core.add_request("c", pc.clone(), greedy(8)).unwrap();
    let c = run_all(&mut core).remove("c").unwrap();
    let (fresh, _, _) = run_requests(&Setup { eos: vec![out[k]], ..base }, &[(pc, greedy(8))]);
    assert_eq!(c.tokens, fresh[0].tokens);
}

/// The runner contract's order: a sampling with no forward queued before it is an error (it
/// would sample the logits of a step already sampled), not a second draw from them.
#[test]
fn a_sampling_with_no_forward_queued_is_refused() {
    use crate::model::ModelRunner;
    let mut runner = ToyRunner::new(64, 256, false).overlapping();
    let e = runner.launch_sampling(&[]).unwrap_err().to_string();
    assert!(e.contains("no forward queued"), "{e}");
}
