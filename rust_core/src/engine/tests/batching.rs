//! Batching invariants: a request's output does not depend on what else runs, how its prompt
//! is chunked, or whether it was preempted.

use super::*;
use crate::model::LogitsWanted;

fn mixed_requests() -> Vec<(Vec<u32>, SamplingParams)> {
    vec![(prompt(5, 1), greedy(30)), (prompt(40, 2), greedy(12)), (prompt(17, 3), greedy(25)), (prompt(90, 4), greedy(8))]
}

#[test]
fn batched_greedy_outputs_equal_each_request_alone() {
    let setup = Setup::default();
    let reqs = mixed_requests();
    let (together, _, log) = run_requests(&setup, &reqs);
    for (i, r) in reqs.iter().enumerate() {
        let (alone, _, _) = run_requests(&setup, std::slice::from_ref(r));
        assert_eq!(together[i].tokens, alone[0].tokens, "request {i}");
        assert_eq!(together[i].tokens.len(), r.1.max_tokens);
        assert_eq!(together[i].finish, Some("length"));
    }
    let max_batch = log.lock().unwrap().steps.iter().map(|s| s.seqs.len()).max().unwrap();
    assert_eq!(max_batch, 4, "all four requests must share steps");
}

#[test]
fn chunked_prefill_of_a_long_prompt_equals_one_whole_prefill() {
    let long = vec![(prompt(300, 9), greedy(10))];
    let whole = Setup { cfg: EngineConfig { prefill_chunk: 1024, ..Setup::default().cfg }, ..Default::default() };
    let chunked = Setup { cfg: EngineConfig { prefill_chunk: 64, ..Setup::default().cfg }, ..Default::default() };
    let (a, _, log_a) = run_requests(&whole, &long);
    let (b, core_b, log_b) = run_requests(&chunked, &long);
    assert_eq!(a[0].tokens, b[0].tokens);
    assert_eq!(log_a.lock().unwrap().steps[0].num_tokens(), 300);
    let steps = &log_b.lock().unwrap().steps;
    assert!(steps.iter().all(|s| s.num_tokens() <= 64));
    assert_eq!(steps.iter().take(5).map(|s| s.seqs[0].logits).collect::<Vec<_>>(), vec![LogitsWanted::None; 4].into_iter().chain([LogitsWanted::Last]).collect::<Vec<_>>());
    assert_eq!(core_b.stats().prefill_tokens_computed, 300);
}

#[test]
fn decodes_are_scheduled_before_prefill_chunks_within_the_token_budget() {
    let setup = Setup { cfg: EngineConfig { prefill_chunk: 32, ..Setup::default().cfg }, ..Default::default() };
    let (mut core, log) = setup.build();
    core.add_request("short", prompt(4, 1), greedy(20)).unwrap();
    core.step().unwrap();
    core.add_request("long", prompt(100, 2), greedy(2)).unwrap();
    core.step().unwrap();
    let steps = &log.lock().unwrap().steps;
    let second = &steps[1];
    assert_eq!(second.seqs.len(), 2);
    assert_eq!(second.seqs[0].tokens.len(), 1, "the decode comes first");
    assert_eq!(second.seqs[1].tokens.len(), 31, "the prefill chunk takes the rest of the budget");
}

#[test]
fn max_concurrency_bounds_the_running_sequences() {
    let setup = Setup { cfg: EngineConfig { max_concurrency: 2, ..Setup::default().cfg }, ..Default::default() };
    let reqs = mixed_requests();
    let (out, core, log) = run_requests(&setup, &reqs);
    assert!(log.lock().unwrap().steps.iter().all(|s| s.seqs.len() <= 2));
    assert_eq!(core.stats().max_batch_size_seen, 2);
    let (free, _, _) = run_requests(&Setup::default(), &reqs);
    for (a, b) in out.iter().zip(&free) {
        assert_eq!(a.tokens, b.tokens);
    }
}

#[test]
fn preemption_under_a_tiny_kv_pool_still_gives_the_same_outputs() {
    let tiny = Setup {
        cfg: EngineConfig { max_context: Some(64), kv_capacity_tokens: Some(64), block_size: 4, max_concurrency: 4, prefill_chunk: 64, ..Default::default() },
        ..Default::default()
    };
    let reqs: Vec<_> = (0..3).map(|i| (prompt(10 + i, i as u32), greedy(40))).collect();
    let (out, core, _) = run_requests(&tiny, &reqs);
    assert!(core.stats().preemptions > 0, "the pool is too small for all three at once");
    assert_eq!(core.stats().kv_blocks_used, 0);
    for (i, r) in reqs.iter().enumerate() {
        let (alone, _, _) = run_requests(&Setup::default(), std::slice::from_ref(r));
        assert_eq!(out[i].tokens, alone[0].tokens, "request {i}");
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_independent_of_the_batch() {
    let seeded = |seed| SamplingParams { temperature: 1.0, top_p: 0.95, max_tokens: 40, seed: Some(seed), ..Default::default() };
    let target = (prompt(12, 5), seeded(42));
    let (alone, _, _) = run_requests(&Setup::default(), std::slice::from_ref(&target));
    let (again, _, _) = run_requests(&Setup::default(), std::slice::from_ref(&target));
    assert_eq!(alone[0].tokens, again[0].tokens);
    let crowd = vec![(prompt(30, 1), seeded(1)), target.clone(), (prompt(3, 2), SamplingParams { max_tokens: 50, ..Default::default() })];
    let (together, _, _) = run_requests(&Setup::default(), &crowd);
    assert_eq!(together[1].tokens, alone[0].tokens);
    let (other, _, _) = run_requests(&Setup::default(), &[(prompt(12, 5), seeded(43))]);
    assert_ne!(other[0].tokens, alone[0].tokens, "a different seed should sample differently");
}

#[test]
fn score_returns_all_position_logits_matching_generation_and_chunking() {
    let p = prompt(50, 3);
    let (mut core, _) = Setup::default().build();
    let scores = core.score(&p).unwrap();
    assert_eq!(scores.len(), 50 * VOCAB);
    let (gen, _, _) = run_requests(&Setup::default(), &[(p.clone(), greedy(1))]);
    assert_eq!(crate::sampling::sampler::argmax(&scores[49 * VOCAB..]), gen[0].tokens[0]);
    let chunked = Setup { cfg: EngineConfig { prefill_chunk: 16, ..Setup::default().cfg }, ..Default::default() };
    assert_eq!(chunked.build().0.score(&p).unwrap(), scores);
    assert_eq!(core.stats().kv_blocks_used, 0, "score frees its blocks");
}

#[test]
fn logprobs_come_with_each_token_when_asked() {
    let sp = SamplingParams { temperature: 0.0, max_tokens: 3, logprobs: true, top_logprobs: 2, ..Default::default() };
    let (mut core, _) = Setup::default().build();
    core.add_request("a", prompt(6, 1), sp).unwrap();
    let mut seen = 0;
    while core.has_unfinished() {
        for o in core.step().unwrap() {
            let lp = o.logprobs.expect("logprobs");
            assert_eq!(lp.len(), 1);
            assert_eq!(lp[0].token_id, o.token_ids[0]);
            assert_eq!(lp[0].top[0].0, o.token_ids[0], "greedy picks the top token");
            assert!(lp[0].logprob <= 0.0 && lp[0].top.len() == 2);
            seen += 1;
        }
    }
    assert_eq!(seen, 3);
}

#[test]
fn preemption_of_a_hybrid_model_restarts_its_recurrent_state_correctly() {
    let tiny = Setup {
        hybrid: true,
        cfg: EngineConfig { max_context: Some(64), kv_capacity_tokens: Some(64), block_size: 4, max_concurrency: 4, prefill_chunk: 64, ..Default::default() },
        ..Default::default()
    };
    let reqs: Vec<_> = (0..3).map(|i| (prompt(9 + i, i as u32 + 3), greedy(40))).collect();
    let (out, core, _) = run_requests(&tiny, &reqs);
    assert!(core.stats().preemptions > 0);
    let alone_setup = Setup { hybrid: true, ..Default::default() };
    for (i, r) in reqs.iter().enumerate() {
        let (alone, _, _) = run_requests(&alone_setup, std::slice::from_ref(r));
        assert_eq!(out[i].tokens, alone[0].tokens, "request {i}");
    }
}

#[test]
fn startup_runs_one_warm_up_step_of_a_full_chunk_then_the_kernel_warm_up_and_leaves_nothing_allocated() {
    let setup = Setup { cfg: EngineConfig { prefill_chunk: 48, ..Setup::default().cfg }, hybrid: true, ..Default::default() };
    let runner = crate::engine::toy_runner::ToyRunner::new(setup.vocab, setup.max_pos, true);
    let log = runner.log.clone();
    let mut core = EngineCore::new(Box::new(runner), &setup.cfg, None, setup.eos.clone()).unwrap();
    let warm = log.lock().unwrap().steps.clone();
    assert_eq!(warm.len(), 1);
    assert_eq!((warm[0].seqs.len(), warm[0].num_tokens(), warm[0].seqs[0].start_pos), (1, 48, 0));
    assert_eq!(warm[0].seqs[0].logits, LogitsWanted::Last);
    assert_eq!(log.lock().unwrap().kernel_warm_ups, vec![1], "the runner warms its kernels once, after the step");
    let stats = core.stats();
    assert_eq!((stats.kv_blocks_used, stats.steps, stats.prefill_tokens_computed), (0, 0, 0));
    assert_eq!(core.sched_snapshots_held(), 0);
    core.add_request("a", prompt(30, 3), greedy(5)).unwrap();
    while core.has_unfinished() {
        core.step().unwrap();
    }
    assert_eq!(log.lock().unwrap().steps[1].seqs[0].start_pos, 0, "the request prefilled from scratch");
}
