//! The reasoning tracker: counting, the forced closing sequence, budget 0, output that never
//! opens a reasoning block, and a grammar that refuses the forced token.

use super::*;

const OPEN: u32 = 90;
const CLOSE: u32 = 91;
const CLOSING: [u32; 3] = [10, CLOSE, 11];
const BLANK: u32 = 32;

fn tracker(in_reasoning: bool, budget: Option<u32>) -> ReasoningTracker {
    ReasoningTracker::new(OPEN, CLOSE, in_reasoning, budget, CLOSING.to_vec())
}

/// Feed `tokens`, taking the forced token instead whenever there is one; the output.
fn run(t: &mut ReasoningTracker, free: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut free = free.iter().copied();
    loop {
        let token = match t.forced() {
            Some(f) => f,
            None => match free.next() {
                Some(x) => x,
                None => return out,
            },
        };
        t.accept(token, |x| x == BLANK);
        out.push(token);
    }
}

#[test]
fn the_budget_forces_the_closing_sequence_then_the_answer_is_free() {
    let mut t = tracker(false, Some(3));
    let out = run(&mut t, &[BLANK, OPEN, 1, 2, 3, 4, 5, 6]);
    assert_eq!(out, [BLANK, OPEN, 1, 2, 3, 10, CLOSE, 11, 4, 5, 6]);
    assert_eq!(t.reasoning_tokens(), 3);
    assert_eq!(t.phase(), Phase::After);
}

#[test]
fn reasoning_opened_by_the_prompt_counts_from_the_first_token() {
    let mut t = tracker(true, Some(2));
    assert_eq!(run(&mut t, &[1, 2, 3]), [1, 2, 10, CLOSE, 11, 3]);
    assert_eq!(t.reasoning_tokens(), 2);
}

#[test]
fn budget_zero_closes_the_reasoning_at_once() {
    let mut t = tracker(true, Some(0));
    assert_eq!(t.forced(), Some(10));
    assert_eq!(run(&mut t, &[7]), [10, CLOSE, 11, 7]);
    let mut t = tracker(false, Some(0));
    assert!(t.next_row_depends_on_token(), "an open tag next would force the row after it");
    assert_eq!(run(&mut t, &[OPEN, 7]), [OPEN, 10, CLOSE, 11, 7]);
    assert_eq!(t.reasoning_tokens(), 0);
}

#[test]
fn output_that_never_opens_reasoning_is_untouched() {
    let mut t = tracker(false, Some(0));
    assert_eq!(run(&mut t, &[5, OPEN, 1, 2, 3]), [5, OPEN, 1, 2, 3], "an open tag after the answer began is text");
    assert_eq!(t.reasoning_tokens(), 0);
    assert_eq!(t.phase(), Phase::After);
    assert!(!t.next_row_depends_on_token());
}

#[test]
fn a_model_that_closes_within_its_budget_is_not_forced() {
    let mut t = tracker(false, Some(5));
    assert_eq!(run(&mut t, &[OPEN, 1, 2, CLOSE, 3, 4, 5, 6, 7]), [OPEN, 1, 2, CLOSE, 3, 4, 5, 6, 7]);
    assert_eq!(t.reasoning_tokens(), 2);
}

#[test]
fn without_a_budget_reasoning_is_counted_and_never_forced() {
    let mut t = tracker(false, None);
    assert_eq!(run(&mut t, &[OPEN, 1, 2, 3, 4, CLOSE, 5]), [OPEN, 1, 2, 3, 4, CLOSE, 5]);
    assert_eq!(t.reasoning_tokens(), 4);
    assert!(!tracker(true, None).next_row_depends_on_token());
}

#[test]
fn only_rows_the_next_token_may_force_wait_for_it() {
    let mut t = tracker(true, Some(3));
    let mut waits = Vec::new();
    for token in [1, 2, 3, 10, CLOSE, 11, 4] {
        waits.push(t.next_row_depends_on_token());
        t.accept(token, |_| false);
    }
    // Once two reasoning tokens are in, the next one (the third) makes the row after it forced.
    assert_eq!(waits, [false, false, true, true, true, true, false]);
}

#[test]
fn a_refused_forced_token_gives_the_budget_up_and_counting_goes_on() {
    let mut t = tracker(true, Some(1));
    t.accept(1, |_| false);
    assert_eq!(t.forced(), Some(10));
    t.accept(2, |_| false);
    assert_eq!(t.forced(), None);
    assert_eq!(t.phase(), Phase::Reasoning);
    assert_eq!(t.reasoning_tokens(), 2);
    t.accept(CLOSE, |_| false);
    assert_eq!(t.phase(), Phase::After);
    // Past the close tag a refused token ends the closing: the answer has begun.
    let mut t = tracker(true, Some(0));
    t.accept(10, |_| false);
    t.accept(CLOSE, |_| false);
    t.accept(4, |_| false);
    assert_eq!(t.phase(), Phase::After);
}
