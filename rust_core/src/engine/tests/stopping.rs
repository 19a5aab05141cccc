//! Finish reasons, stop strings across token boundaries, incremental text and request checks.

use super::*;
use crate::tokenizer::detokenizer::IncrementalDetokenizer;
use crate::NinferError;

/// Setup with the byte tokenizer and a vocabulary of printable ASCII bytes only.
fn text_setup() -> Setup {
    Setup { vocab: 127, tokenizer: Some(byte_tokenizer()), ..Default::default() }
}

fn ascii_prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 32 + (i * 5) % 90).collect()
}

#[test]
fn eos_token_ends_with_stop_unless_ignore_eos() {
    let p = prompt(10, 1);
    let (reference, _, _) = run_requests(&Setup::default(), &[(p.clone(), greedy(30))]);
    let eos = reference[0].tokens[5];
    let k = reference[0].tokens.iter().position(|&t| t == eos).unwrap();
    let with_eos = Setup { eos: vec![eos], ..Default::default() };
    let (out, _, _) = run_requests(&with_eos, &[(p.clone(), greedy(30))]);
    assert_eq!((out[0].finish, &out[0].stop_reason), (Some("stop"), &None), "EOS is no stop reason");
    assert_eq!(out[0].tokens, reference[0].tokens[..=k].to_vec(), "the EOS token is the last token");
    let ignoring = SamplingParams { ignore_eos: true, ..greedy(30) };
    let (out, _, _) = run_requests(&with_eos, &[(p.clone(), ignoring)]);
    assert_eq!(out[0].finish, Some("length"));
    assert_eq!(out[0].tokens, reference[0].tokens);
    let stop_ids = SamplingParams { stop_token_ids: vec![eos], ..greedy(30) };
    let (out, _, _) = run_requests(&Setup::default(), &[(p, stop_ids)]);
    assert_eq!((out[0].finish, out[0].tokens.len()), (Some("stop"), k + 1));
    assert_eq!(out[0].stop_reason, Some(StopReason::Token(eos)), "the stop token id is reported");
}

#[test]
fn max_tokens_ends_with_length() {
    let (out, _, _) = run_requests(&Setup::default(), &[(prompt(3, 1), greedy(7))]);
    assert_eq!((out[0].finish, out[0].tokens.len(), &out[0].stop_reason), (Some("length"), 7, &None));
}

#[test]
fn streamed_text_equals_the_decode_of_all_tokens() {
    let setup = text_setup();
    let (out, _, _) = run_requests(&setup, &[(ascii_prompt(8), greedy(60))]);
    let tok = setup.tokenizer.unwrap();
    assert_eq!(out[0].text, tok.decode(&out[0].tokens, true).unwrap());
    assert!(out[0].text.len() >= 60);
}

#[test]
fn stop_string_spanning_tokens_cuts_the_text_before_it() {
    let setup = text_setup();
    let p = ascii_prompt(8);
    let (reference, _, _) = run_requests(&setup, &[(p.clone(), greedy(60))]);
    let text = reference[0].text.clone();
    let stop = text[20..23].to_string();
    let cut = text.find(&stop).unwrap();
    let sp = SamplingParams { stop: vec!["never there".into(), stop.clone()], ..greedy(60) };
    let (out, _, _) = run_requests(&setup, &[(p, sp)]);
    assert_eq!(out[0].finish, Some("stop"));
    assert_eq!(out[0].stop_reason, Some(StopReason::Text(stop.clone())), "the stop string that matched is reported");
    assert_eq!(out[0].text, text[..cut]);
    assert_eq!(out[0].tokens.len(), cut + stop.len(), "one byte per token: generation ends at the token completing the match");
}

#[test]
fn detokenizer_never_emits_a_broken_character_split_over_byte_tokens() {
    let tok = byte_tokenizer();
    let text = "añb€c😀 d";
    let ids: Vec<u32> = text.bytes().map(u32::from).collect();
    let mut d = IncrementalDetokenizer::new(&[104, 105], true);
    let mut out = String::new();
    for &id in &ids {
        let delta = d.push(&tok, id).unwrap();
        assert!(!delta.contains('\u{FFFD}'), "delta {delta:?}");
        out.push_str(&delta);
    }
    out.push_str(&d.flush(&tok).unwrap());
    assert_eq!(out, text);
}

#[test]
fn random_bytes_stream_to_the_same_text_as_one_decode() {
    let setup = Setup { vocab: 256, tokenizer: Some(byte_tokenizer()), ..Default::default() };
    let (out, _, _) = run_requests(&setup, &[(prompt(5, 2), greedy(80))]);
    let tok = setup.tokenizer.unwrap();
    assert_eq!(out[0].text, tok.decode(&out[0].tokens, true).unwrap());
}

#[test]
fn bad_requests_are_rejected_with_typed_errors() {
    let (mut core, _) = Setup::default().build();
    assert!(matches!(core.add_request("a", vec![], greedy(4)), Err(NinferError::EmptyPrompt)));
    match core.add_request("a", prompt(500, 1), greedy(20)) {
        Err(NinferError::ContextOverflow { prompt_tokens: 500, max_tokens: 20, max_context: 512 }) => {}
        other => panic!("{other:?}"),
    }
    // max_tokens near usize::MAX (JSON allows 2^64 - 1) is an overflow, not a wrap past the check
    // (it ran past the context and filled the KV pool before).
    match core.add_request("a", prompt(4, 1), greedy(usize::MAX)) {
        Err(NinferError::ContextOverflow { prompt_tokens: 4, max_tokens: usize::MAX, max_context: 512 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(core.add_request("a", vec![VOCAB as u32], greedy(4)), Err(NinferError::InvalidRequest { .. })));
    let biased = |t: u32| SamplingParams { logit_bias: [(t, 1.0)].into_iter().collect(), ..greedy(4) };
    match core.add_request("a", prompt(4, 1), biased(VOCAB as u32)) {
        Err(NinferError::InvalidRequest { field, .. }) => assert_eq!(field, "logit_bias"),
        other => panic!("{other:?}"),
    }
    core.add_request("b", prompt(4, 1), biased(VOCAB as u32 - 1)).expect("the last vocabulary id takes a bias");
    core.abort("b");
    assert!(matches!(core.add_request("a", prompt(4, 1), SamplingParams { top_p: 0.0, ..greedy(4) }), Err(NinferError::InvalidRequest { .. })));
    core.add_request("a", prompt(4, 1), greedy(4)).unwrap();
    assert!(matches!(core.add_request("a", prompt(4, 1), greedy(4)), Err(NinferError::Request(..))));
    run_all(&mut core);
    core.add_request("a", prompt(4, 1), greedy(4)).expect("a finished id can be reused");
}
