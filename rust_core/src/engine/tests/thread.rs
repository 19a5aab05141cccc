//! The engine thread delivers every delta, in order, and stays responsive.

use std::time::Duration;

use super::*;
use crate::engine::EngineHandle;

#[test]
fn the_thread_handle_delivers_all_deltas_like_the_inline_core() {
    let reqs: Vec<_> = (0..4).map(|i| (prompt(6 + 9 * i, i as u32), greedy(15 + i))).collect();
    let (inline, _, _) = run_requests(&Setup::default(), &reqs);
    let (core, _) = Setup::default().build();
    let mut handle = EngineHandle::start(core).unwrap();
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
        assert_eq!(all[&format!("r{i}")].tokens, c.tokens);
    }
    assert!(!handle.has_unfinished());
    assert_eq!(handle.stats().kv_blocks_used, 0);
    handle.shutdown();
}

#[test]
fn the_thread_handle_rejects_bad_input_at_once_and_aborts() {
    let (core, _) = Setup::default().build();
    let handle = EngineHandle::start(core).unwrap();
    assert!(handle.submit("x", vec![], greedy(3)).is_err());
    handle.submit("long", prompt(10, 1), greedy(400)).unwrap();
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
