//! `response_format` through the engine: every sampled token obeys the grammar, the request
//! stops when the output is complete, and unconstrained requests in the same batch are untouched.

use serde_json::{json, Value as Json};

use super::*;
use crate::NinferError;

/// The byte tokenizer over all 256 bytes, with the NUL byte as the model's EOS.
fn json_setup() -> Setup {
    Setup { vocab: 256, tokenizer: Some(byte_tokenizer()), eos: vec![0], ..Default::default() }
}

fn point_schema() -> Json {
    json!({
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 8},
            "x": {"type": "integer", "minimum": -50, "maximum": 50},
            "ok": {"type": "boolean"}
        },
        "required": ["label", "x", "ok"],
        "additionalProperties": false
    })
}

fn check_point(text: &str) -> std::result::Result<(), String> {
    let value: Json = serde_json::from_str(text).map_err(|e| format!("{e}: {text:?}"))?;
    let object = value.as_object().ok_or(format!("not an object: {text:?}"))?;
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort();
    let label_ok = object.get("label").and_then(Json::as_str).is_some_and(|s| s.chars().count() <= 8);
    let x_ok = object.get("x").and_then(Json::as_i64).is_some_and(|x| (-50..=50).contains(&x));
    let ok_ok = object.get("ok").is_some_and(Json::is_boolean);
    if keys == ["label", "ok", "x"] && label_ok && x_ok && ok_ok {
        Ok(())
    } else {
        Err(format!("does not validate: {text:?}"))
    }
}

fn with_format(params: SamplingParams, format: Json) -> SamplingParams {
    SamplingParams { response_format: Some(format), ..params }
}

#[test]
fn json_schema_requests_stop_with_output_that_validates() {
    let format = json!({"type": "json_schema", "json_schema": {"name": "point", "schema": point_schema()}});
    let mut reqs = Vec::new();
    for seed in 0..6 {
        reqs.push((prompt(5, seed as u32), with_format(SamplingParams { seed: Some(seed), max_tokens: 400, ..Default::default() }, format.clone())));
    }
    reqs.push((prompt(5, 9), with_format(greedy(400), format)));
    let (out, _, _) = run_requests(&json_setup(), &reqs);
    for (i, c) in out.iter().enumerate() {
        assert_eq!(c.finish, Some("stop"), "request {i}: {:?}", c.text);
        check_point(&c.text).unwrap_or_else(|e| panic!("request {i}: {e}"));
    }
}

#[test]
fn json_object_requests_produce_objects() {
    let reqs: Vec<_> = (0..4u64)
        .map(|seed| (prompt(4, seed as u32), with_format(SamplingParams { seed: Some(seed), max_tokens: 500, ..Default::default() }, json!({"type": "json_object"}))))
        .collect();
    let (out, _, _) = run_requests(&json_setup(), &reqs);
    for c in &out {
        if c.finish == Some("stop") {
            serde_json::from_str::<serde::de::IgnoredAny>(&c.text).unwrap_or_else(|e| panic!("{e}: {:?}", c.text));
        }
        assert!(c.text.trim_start().starts_with('{'), "{:?}", c.text);
    }
    assert!(out.iter().filter(|c| c.finish == Some("stop")).count() >= 2, "most objects close within 500 tokens: {out:?}");
}

#[test]
fn unconstrained_requests_are_unchanged_by_a_constrained_neighbour() {
    let free = (prompt(6, 3), SamplingParams { seed: Some(11), max_tokens: 40, ..Default::default() });
    let (alone, _, _) = run_requests(&json_setup(), std::slice::from_ref(&free));
    let constrained = (prompt(6, 4), with_format(greedy(200), json!({"type": "json_object"})));
    let (together, _, _) = run_requests(&json_setup(), &[free, constrained]);
    assert_eq!(together[0].tokens, alone[0].tokens);
}

#[test]
fn text_format_is_free_decoding() {
    let p = prompt(6, 2);
    let (free, _, _) = run_requests(&json_setup(), &[(p.clone(), greedy(30))]);
    let (text, _, _) = run_requests(&json_setup(), &[(p, with_format(greedy(30), json!({"type": "text"})))]);
    assert_eq!(free[0].tokens, text[0].tokens);
}

#[test]
fn a_bad_schema_is_rejected_at_submit_naming_response_format() {
    let (mut core, _) = json_setup().build();
    let bad = with_format(greedy(10), json!({"type": "json_schema", "json_schema": {"schema": {"type": "banana"}}}));
    let err = core.add_request("r", prompt(3, 1), bad.clone()).unwrap_err();
    assert!(matches!(&err, NinferError::InvalidRequest { field, .. } if field == "response_format"), "{err}");
    let handle = crate::engine::EngineHandle::start(json_setup().build().0).unwrap();
    let err = handle.submit("r", prompt(3, 1), bad).unwrap_err();
    assert!(matches!(&err, NinferError::InvalidRequest { field, .. } if field == "response_format"), "{err}");
    handle.shutdown();
}

#[test]
fn response_format_needs_a_tokenizer() {
    let (mut core, _) = Setup { eos: vec![0], ..Default::default() }.build();
    let err = core.add_request("r", prompt(3, 1), with_format(greedy(10), json!({"type": "json_object"}))).unwrap_err();
    assert!(matches!(err, NinferError::Unsupported(_)), "{err}");
}


/// A regex llguidance compiles but whose lexer grows too complex once the output reaches the
/// `c`s: whatever the model picks for the first three bytes, consuming the fourth fails.
fn fails_after_three_bytes() -> Json {
    json!({"type": "regex", "regex": "[ab]{3}c{100000}"})
}

#[test]
fn a_grammar_that_fails_midway_ends_its_request_with_the_error() {
    for overlap in [false, true] {
        let setup = Setup { overlap, ..json_setup() };
        let free = (prompt(6, 3), SamplingParams { seed: Some(11), max_tokens: 40, ..Default::default() });
        let (alone, _, _) = run_requests(&setup, std::slice::from_ref(&free));
        let failing = (prompt(5, 1), with_format(greedy(50), fails_after_three_bytes()));
        let fine = (prompt(5, 2), with_format(greedy(50), json!({"type": "regex", "regex": "[0-9]{4}"})));
        let (out, core, _) = run_requests(&setup, &[failing, free, fine]);
        let failed = &out[0];
        assert_eq!(failed.finish, Some("error"), "overlap {overlap}: {failed:?}");
        let error = failed.error.as_deref().unwrap_or_default();
        assert!(error.contains("field `response_format`") && error.contains("too many expressions"), "{error}");
        assert!(!error.contains('\n'), "one line, without llguidance's state dump: {error:?}");
        // The token the grammar failed on is not output: only the three it accepted.
        assert_eq!(failed.tokens.len(), 3, "{failed:?}");
        assert!(failed.text.len() == 3 && failed.text.bytes().all(|b| b == b'a' || b == b'b'), "{failed:?}");
        assert_eq!(out[1].tokens, alone[0].tokens, "a neighbour in the batch is untouched");
        assert_eq!(out[1].finish, alone[0].finish);
        assert_eq!((out[2].finish, out[2].text.len()), (Some("stop"), 4), "{:?}", out[2]);
        assert!(out[1..].iter().all(|c| c.error.is_none()));
        assert!(!core.has_unfinished());
    }
}

#[test]
fn a_grammar_failure_reaches_the_poller_of_the_engine_thread() {
    let handle = crate::engine::EngineHandle::start(json_setup().build().0).unwrap();
    handle.submit("bad", prompt(5, 1), with_format(greedy(50), fails_after_three_bytes())).unwrap();
    handle.submit("ok", prompt(5, 2), greedy(8)).unwrap();
    // Until both final deltas are polled: `has_unfinished` turns false once they are queued,
    // which can be before this thread has polled the last of them.
    let mut all: HashMap<String, Collected> = HashMap::new();
    let done = |all: &HashMap<String, Collected>| ["bad", "ok"].iter().all(|id| all.get(*id).is_some_and(|c| c.finish.is_some()));
    for _ in 0..1000 {
        if done(&all) {
            break;
        }
        collect_into(&mut all, handle.poll(std::time::Duration::from_secs(5)).unwrap());
    }
    assert!(!handle.has_unfinished());
    assert_eq!(all["bad"].finish, Some("error"));
    assert!(all["bad"].error.as_deref().is_some_and(|e| e.contains("response_format")));
    assert_eq!((all["ok"].finish, all["ok"].tokens.len()), (Some("length"), 8));
    handle.shutdown();
}
