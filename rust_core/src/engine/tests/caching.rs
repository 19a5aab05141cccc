//! Prefix cache, recurrent-state snapshots and freeing: reuse must never change outputs.

use super::*;

#[test]
fn prefix_hit_gives_the_same_output_as_a_miss_and_computes_fewer_tokens() {
    let p = prompt(100, 7);
    let (mut core, log) = Setup::default().build();
    core.add_request("first", p.clone(), greedy(10)).unwrap();
    let first = run_all(&mut core).remove("first").unwrap();
    let computed_before = core.stats().prefill_tokens_computed;
    core.add_request("second", p.clone(), greedy(10)).unwrap();
    let second = run_all(&mut core).remove("second").unwrap();
    assert_eq!(first.tokens, second.tokens);
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(second.cached_tokens, 96, "six full blocks of 16");
    assert_eq!(core.stats().prefill_tokens_computed - computed_before, 4);
    assert_eq!(core.stats().prefix_hit_tokens, 96);
    let no_reuse = Setup { cfg: EngineConfig { prefix_reuse: false, ..Setup::default().cfg }, ..Default::default() };
    let (miss, _, _) = run_requests(&no_reuse, &[(p, greedy(10))]);
    assert_eq!(miss[0].tokens, first.tokens);
    let last = log.lock().unwrap().steps.iter().rev().find(|s| s.seqs[0].start_pos == 96).cloned();
    assert!(last.is_some(), "the second prompt started at position 96");
}

#[test]
fn a_prompt_extending_a_finished_conversation_reuses_its_prompt_and_output_blocks() {
    let p1 = prompt(40, 1);
    let (mut core, _) = Setup::default().build();
    core.add_request("turn1", p1.clone(), greedy(30)).unwrap();
    let t1 = run_all(&mut core).remove("turn1").unwrap();
    let mut p2 = p1.clone();
    p2.extend(&t1.tokens);
    p2.extend(prompt(9, 5));
    core.add_request("turn2", p2.clone(), greedy(10)).unwrap();
    let t2 = run_all(&mut core).remove("turn2").unwrap();
    assert_eq!(t2.cached_tokens, 64, "40 + 30 - 1 computed tokens hold four full blocks");
    let (fresh, _, _) = run_requests(&Setup::default(), &[(p2, greedy(10))]);
    assert_eq!(t2.tokens, fresh[0].tokens);
}

#[test]
fn hybrid_model_reuses_a_state_snapshot_only_at_its_exact_block_boundary() {
    let hybrid = Setup { hybrid: true, ..Default::default() };
    let p1 = prompt(70, 3);
    let (mut core, log) = hybrid.build();
    core.add_request("turn1", p1.clone(), greedy(5)).unwrap();
    let t1 = run_all(&mut core).remove("turn1").unwrap();
    let chunks: Vec<usize> = log.lock().unwrap().steps.iter().take(2).map(|s| s.num_tokens()).collect();
    assert_eq!(chunks, vec![64, 6], "the prompt is split at its last block boundary to snapshot there");
    assert!(!log.lock().unwrap().copies.is_empty(), "a snapshot was taken");

    let mut p2 = p1.clone();
    p2.extend(prompt(20, 8));
    core.add_request("turn2", p2.clone(), greedy(8)).unwrap();
    let t2 = run_all(&mut core).remove("turn2").unwrap();
    assert_eq!(t2.cached_tokens, 64, "resumed from the snapshot after block 4");
    let (fresh, _, _) = run_requests(&hybrid, &[(p2, greedy(8))]);
    assert_eq!(t2.tokens, fresh[0].tokens);
    assert_eq!(fresh[0].cached_tokens, 0);
    let (plain, _, _) = run_requests(&hybrid, &[(p1, greedy(5))]);
    assert_eq!(plain[0].tokens, t1.tokens);
}

#[test]
fn hybrid_model_without_a_snapshot_recomputes_from_the_start() {
    let hybrid = Setup { hybrid: true, cfg: EngineConfig { snapshot_slots: Some(0), ..Setup::default().cfg }, ..Default::default() };
    let p = prompt(50, 4);
    let (mut core, _) = hybrid.build();
    core.add_request("a", p.clone(), greedy(4)).unwrap();
    let a = run_all(&mut core).remove("a").unwrap();
    core.add_request("b", p, greedy(4)).unwrap();
    let b = run_all(&mut core).remove("b").unwrap();
    assert_eq!(b.cached_tokens, 0, "cached KV alone cannot restore a recurrent state");
    assert_eq!(a.tokens, b.tokens);
}

#[test]
fn abort_frees_blocks_in_the_next_step_and_emits_a_final_delta() {
    let (mut core, _) = Setup::default().build();
    core.add_request("keep", prompt(20, 1), greedy(50)).unwrap();
    core.add_request("drop", prompt(33, 2), greedy(50)).unwrap();
    for _ in 0..3 {
        core.step().unwrap();
    }
    let used_both = core.stats().kv_blocks_used;
    assert!(core.abort("drop"));
    let outs = core.step().unwrap();
    let fin = outs.iter().find(|o| o.request_id == "drop").expect("abort delta");
    assert_eq!(fin.finish_reason.map(|f| f.as_str()), Some("abort"));
    assert!(fin.token_ids.is_empty());
    assert!(core.stats().kv_blocks_used < used_both);
    assert!(!core.abort("drop"), "an aborted request is gone");
    core.abort("keep");
    core.step().unwrap();
    assert!(!core.has_unfinished());
    assert_eq!(core.stats().kv_blocks_used, 0);
    assert_eq!(core.stats().running, 0);
}

#[test]
fn aborting_a_waiting_request_removes_it_without_running_it() {
    let setup = Setup { cfg: EngineConfig { max_concurrency: 1, ..Setup::default().cfg }, ..Default::default() };
    let (mut core, log) = setup.build();
    core.add_request("a", prompt(8, 1), greedy(3)).unwrap();
    core.add_request("b", prompt(8, 2), greedy(3)).unwrap();
    core.step().unwrap();
    core.abort("b");
    let all = run_all(&mut core);
    assert_eq!(all["b"].finish, Some("abort"));
    assert_eq!(all["a"].finish, Some("length"));
    assert!(log.lock().unwrap().steps.iter().all(|s| s.seqs.len() == 1));
}

#[test]
fn hybrid_model_resumes_the_next_turn_from_a_snapshot_taken_while_decoding() {
    let hybrid = Setup { hybrid: true, ..Default::default() };
    let p1 = prompt(20, 6);
    let (mut core, _) = hybrid.build();
    core.add_request("turn1", p1.clone(), greedy(30)).unwrap();
    let t1 = run_all(&mut core).remove("turn1").unwrap();
    assert_eq!(core.sched_snapshots_held(), 2, "end of prompt (16) and the latest decode boundary (48)");
    let mut p2 = p1.clone();
    p2.extend(&t1.tokens);
    p2.extend(prompt(5, 7));
    core.add_request("turn2", p2.clone(), greedy(6)).unwrap();
    let t2 = run_all(&mut core).remove("turn2").unwrap();
    assert_eq!(t2.cached_tokens, 48);
    let (fresh, _, _) = run_requests(&hybrid, &[(p2, greedy(6))]);
    assert_eq!(t2.tokens, fresh[0].tokens);
}
