//! Thinking budgets through the engine: the reasoning stops at its budget with the closing
//! sequence forced, synchronous and overlapped engines agree, a grammar composes with the
//! budget, and output that never reasons is untouched.

use serde_json::json;

use super::*;

const OPEN: u32 = 256;
const CLOSE: u32 = 257;
/// `THINK_END_TEXT` in the byte tokenizer: "\n", the close tag, "\n", "\n".
const CLOSING: [u32; 4] = [10, CLOSE, 10, 10];

fn think_setup(overlap: bool) -> Setup {
    static TOK: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
    let tokenizer = TOK.get_or_init(|| build_byte_tokenizer_with(&["<think>", "</think>"])).clone();
    Setup { vocab: 258, tokenizer: Some(tokenizer), eos: vec![0], overlap, ..Default::default() }
}

/// A prompt of byte tokens, ending with the open tag when `in_reasoning`.
fn think_prompt(salt: u32, in_reasoning: bool) -> Vec<u32> {
    let mut p: Vec<u32> = (0..12u32).map(|i| 33 + (i * 7 + salt * 13) % 90).collect();
    if in_reasoning {
        p.push(OPEN);
    }
    p
}

fn seeded(seed: u64, budget: Option<u32>) -> SamplingParams {
    SamplingParams { temperature: 1.0, seed: Some(seed), max_tokens: 40, ignore_eos: true, thinking_budget: budget, ..Default::default() }
}

/// Where the model closed the reasoning itself (its close tag within the budget), or the
/// closing sequence sits right after `budget` reasoning tokens.
fn assert_closed_within(c: &Collected, budget: usize) {
    match c.tokens.iter().position(|&t| t == CLOSE) {
        Some(at) if at < budget => assert_eq!(c.reasoning_tokens, at, "{c:?}"),
        _ => {
            assert_eq!(&c.tokens[budget..budget + CLOSING.len()], &CLOSING, "{c:?}");
            assert!(!c.tokens[..budget].contains(&CLOSE));
            assert_eq!(c.reasoning_tokens, budget, "{c:?}");
        }
    }
}

#[test]
fn the_budget_closes_the_reasoning_and_overlap_agrees() {
    let mut reqs = Vec::new();
    for seed in 0..6u64 {
        reqs.push((think_prompt(seed as u32, true), seeded(seed, Some(seed as u32 * 3))));
    }
    // Never opens (the prompt did not): the budget is unused; and no budget: counted only.
    reqs.push((think_prompt(7, false), seeded(7, Some(0))));
    reqs.push((think_prompt(8, true), seeded(8, None)));
    let (sync, _, _) = run_requests(&think_setup(false), &reqs);
    let (overlapped, core, _) = run_requests(&think_setup(true), &reqs);
    for (i, (a, b)) in sync.iter().zip(&overlapped).enumerate() {
        assert_eq!(a, b, "request {i}: synchronous vs overlapped");
    }
    for (i, c) in sync.iter().enumerate().take(6) {
        assert_closed_within(c, i * 3);
        assert_eq!(c.tokens.len(), 40);
    }
    let unopened = &sync[6];
    if unopened.tokens[0] != OPEN {
        assert_eq!(unopened.reasoning_tokens, 0);
    }
    let unlimited = &sync[7];
    let close = unlimited.tokens.iter().position(|&t| t == CLOSE).unwrap_or(40);
    assert_eq!(unlimited.reasoning_tokens, close);
    let stats = core.stats();
    assert!(stats.lookahead_steps > stats.split_lookahead_steps, "rows far from the budget run ahead whole: {stats:?}");
    assert!(stats.split_lookahead_steps > 0, "{stats:?}");
}

#[test]
fn a_grammar_that_admits_the_closing_composes_with_the_budget() {
    // Reasoning of anything but '<', the close, then a short lowercase answer.
    let format = json!({"type": "regex", "regex": "(?s:[^<]*)\n</think>\n\n[a-z]{1,5}"});
    let reqs: Vec<_> = (0..4u64)
        .map(|seed| {
            let p = SamplingParams { ignore_eos: false, response_format: Some(format.clone()), max_tokens: 60, ..seeded(seed, Some(4)) };
            (think_prompt(seed as u32, true), p)
        })
        .collect();
    for overlap in [false, true] {
        let (out, _, _) = run_requests(&think_setup(overlap), &reqs);
        for c in &out {
            assert_eq!(c.finish, Some("stop"), "{c:?}");
            assert_closed_within(c, 4);
            let answer = c.text.rsplit("</think>\n\n").next().unwrap();
            assert!(!answer.is_empty() && answer.chars().all(|ch| ch.is_ascii_lowercase()), "{c:?}");
        }
    }
}

#[test]
fn a_grammar_that_refuses_the_closing_wins_and_reasoning_is_still_counted() {
    let format = json!({"type": "regex", "regex": "[a-z]{10}"});
    let p = SamplingParams { ignore_eos: false, response_format: Some(format), ..seeded(3, Some(2)) };
    let (out, _, _) = run_requests(&think_setup(false), &[(think_prompt(1, true), p)]);
    assert_eq!(out[0].finish, Some("stop"));
    assert_eq!(out[0].text.len(), 10);
    assert_eq!(out[0].reasoning_tokens, 10, "never closed: every token is reasoning");
}

#[test]
fn a_budget_with_no_room_for_an_answer_is_refused_naming_both_numbers() {
    let (mut core, _) = think_setup(false).build();
    let p = SamplingParams { max_tokens: 20, ..seeded(1, Some(16)) };
    let err = core.add_request("r", think_prompt(1, true), p).unwrap_err().to_string();
    assert!(err.contains("thinking_budget") && err.contains("16") && err.contains("max_tokens 20"), "{err}");
    core.add_request("ok", think_prompt(1, true), SamplingParams { max_tokens: 21, ..seeded(1, Some(16)) }).expect("room for one token");
}
