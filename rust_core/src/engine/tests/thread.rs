//! The engine thread delivers every delta, in order, and stays responsive.

use std::time::Duration;

use super::*;
use crate::engine::EngineHandle;

#[test]
fn the_thread_handle_delivers_all_deltas_like_the_inline_core() {
    let reqs: Vec<_> = (0..4).map(|i| (prompt(6 + 9 * i, i as u32), greedy(15 + i))).collect();
    let (inline, _, _) = run_requests(&Setup::default(), &reqs);
    // Also with a step in flight between polls (asynchronous scheduling).
    for overlap in [false, true] {
        let (core, _) = Setup { overlap, ..Default::default() }.build();
        let handle = EngineHandle::start(core).unwrap();
        for (i, (p, sp)) in reqs.iter().enumerate() {
            handle.submit(&format!("r{i}"), p.clone(), sp.clone()).unwrap();
        }
        let mut all = HashMap::new();
        let mut polls = 0;
        while all.values().filter(|c: &&Collected| c.finish.is_some()).count() < reqs.len() {
            collect_into(&mut all, handle.poll(Duration::from_secs(5)).unwrap());
            polls += 1;
            assert!(polls < 10_000);
        }
        for (i, c) in inline.iter().enumerate() {
            assert_eq!(all[&format!("r{i}")].tokens, c.tokens, "overlap {overlap}");
        }
        assert!(!handle.has_unfinished());
        assert_eq!(handle.stats().kv_blocks_used, 0);
        assert_eq!(handle.stats().lookahead_steps > 0, overlap);
        handle.shutdown();
    }
}

#[test]
fn the_thread_handle_rejects_bad_input_at_once_and_aborts() {
    let (core, _) = Setup::default().build();
    let handle = EngineHandle::start(core).unwrap();
    assert!(handle.submit("x", vec![], greedy(3)).is_err());
    handle.submit("long", prompt(10, 1), greedy(500)).unwrap();
    assert!(handle.submit("long", prompt(10, 1), greedy(4)).is_err(), "duplicate id");
    handle.abort("long").unwrap();
    let mut fin = None;
    for _ in 0..1000 {
        for o in handle.poll(Duration::from_secs(5)).unwrap() {
            if o.finished() {
                fin = o.finish_reason;
            }
        }
        if fin.is_some() {
            break;
        }
    }
    assert_eq!(fin.map(|f| f.as_str()), Some("abort"));
    let t = std::time::Instant::now();
    assert!(handle.poll(Duration::from_millis(50)).unwrap().is_empty());
    assert!(t.elapsed() >= Duration::from_millis(45), "an idle poll waits for its timeout");
}

#[test]
fn an_id_stays_taken_until_its_final_delta_is_drained() {
    let (core, _) = Setup::default().build();
    let handle = EngineHandle::start(core).unwrap();
    handle.submit("a", prompt(4, 1), greedy(3)).unwrap();
    // Finished on the engine thread (its final delta queued), not yet polled: still taken.
    let t = std::time::Instant::now();
    while handle.has_unfinished() {
        assert!(t.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(1));
    }
    let e = handle.submit("a", prompt(4, 2), greedy(3)).expect_err("reused before its final delta was drained").to_string();
    assert!(e.contains("has not been polled yet"), "{e}");
    let outs = handle.poll(Duration::from_secs(5)).unwrap();
    assert!(outs.iter().any(|o| o.request_id == "a" && o.finished()));
    handle.submit("a", prompt(4, 2), greedy(3)).unwrap();
    let mut finals = 0;
    while finals == 0 {
        finals += handle.poll(Duration::from_secs(5)).unwrap().iter().filter(|o| o.finished()).count();
    }
    assert_eq!(finals, 1);
}

#[test]
fn an_idle_engine_thread_does_not_step() {
    let (core, _) = Setup::default().build();
    let handle = EngineHandle::start(core).unwrap();
    handle.submit("a", prompt(4, 1), greedy(3)).unwrap();
    while handle.has_unfinished() {
        handle.poll(Duration::from_secs(1)).unwrap();
    }
    let steps = handle.stats().steps;
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(handle.stats().steps, steps);
    assert_eq!(steps, 3, "one prefill step that samples the first token, then two decodes");
}

#[test]
fn a_runner_failure_aborts_every_request_and_the_engine_keeps_serving() {
    for overlap in [false, true] {
        a_runner_failure_aborts_every_request(overlap);
    }
}

/// Synchronous: the first decode step fails. Overlapping: the first lookahead fails (after the
/// prompt step and the first decode, which is in flight then and must be dropped with it).
fn a_runner_failure_aborts_every_request(overlap: bool) {
    let toy = ToyRunner::new(VOCAB, 4096, false);
    let (inner, fail_at) = if overlap { (toy.overlapping(), 4) } else { (toy, 3) };
    let runner = FailingRunner { inner, calls: 0, fail_at, in_sampling: false };
    let mut core = EngineCore::new(Box::new(runner), &Setup::default().cfg, None, Vec::new()).unwrap();
    core.add_request("a", prompt(4, 1), greedy(10)).unwrap();
    core.add_request("b", prompt(5, 2), greedy(10)).unwrap();
    let handle = EngineHandle::start(core).unwrap();
    let mut finished = HashMap::new();
    let mut error = None;
    for _ in 0..100 {
        match handle.poll(Duration::from_secs(1)) {
            Ok(outs) => {
                for o in outs.into_iter().filter(|o| o.finished()) {
                    finished.insert(o.request_id, o.finish_reason.unwrap().as_str());
                }
            }
            Err(e) => error = Some(e.to_string()),
        }
        if error.is_some() && finished.len() == 2 {
            break;
        }
    }
    assert!(error.unwrap().contains("injected failure"));
    assert_eq!(finished.values().copied().collect::<Vec<_>>(), vec!["abort", "abort"], "requests queued before the thread started are aborted too");
    assert_eq!(handle.stats().kv_blocks_used, 0);
    handle.submit("c", prompt(4, 3), greedy(2)).unwrap();
    let mut c = HashMap::new();
    for _ in 0..100 {
        collect_into(&mut c, handle.poll(Duration::from_secs(1)).unwrap());
        if c.get("c").is_some_and(|c| c.finish.is_some()) {
            break;
        }
    }
    let (alone, _, _) = run_requests(&Setup::default(), &[(prompt(4, 3), greedy(2))]);
    assert_eq!(c["c"].tokens, alone[0].tokens, "a later request runs normally (overlap {overlap})");
}
