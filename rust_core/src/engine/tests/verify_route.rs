//! The verify step's routes (`ModelRunner::forward_verify`): a greedy request whose rows are
//! alike at every draft position is picked by argmax on the runner (only ids come back, on
//! CUDA), every other request gets its logits rows and is picked on the host; either way the
//! outputs are those of plain decoding.

use serde_json::json;

use super::*;
use crate::model::LogitsWanted;
use crate::spec::SpecConfig;

fn ngram(hybrid: bool, vocab: usize, k: usize) -> Setup {
    let cfg = EngineConfig { block_size: 4, prefill_chunk: 24, spec: Some(SpecConfig::new("ngram", Some(k)).unwrap()), ..Setup::default().cfg };
    Setup { vocab, hybrid, cfg, ..Default::default() }
}

fn plain(setup: &Setup) -> Setup {
    Setup { cfg: EngineConfig { spec: None, ..setup.cfg.clone() }, ..setup.clone() }
}

fn tiny_prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * i + salt * 3 + i / 3) % vocab).collect()
}

/// What a request output, whatever the steps it took (a verified draft merges deltas).
fn outputs(c: &[Collected]) -> Vec<(Vec<u32>, String, Option<&'static str>)> {
    c.iter().map(|c| (c.tokens.clone(), c.text.clone(), c.finish)).collect()
}

/// Every verify call's (wanted logits, picked by argmax) per sequence.
fn routes(log: &Arc<Mutex<ToyLog>>) -> Vec<Vec<(LogitsWanted, bool)>> {
    log.lock().unwrap().verify_routes.clone()
}

/// Whether some verify call ran a verify chunk (logits at every position) by `picked`.
fn verified_by(routes: &[Vec<(LogitsWanted, bool)>], picked: bool) -> bool {
    routes.iter().flatten().any(|&(w, p)| w == LogitsWanted::All && p == picked)
}

#[test]
fn greedy_requests_are_verified_by_argmax_on_the_runner_with_plain_outputs() {
    for hybrid in [false, true] {
        let spec = ngram(hybrid, 3, 3);
        let bias = SamplingParams { logit_bias: [(1, 0.7)].into_iter().collect(), ..greedy(40) };
        let reqs: Vec<_> = (0..6u32).map(|i| (tiny_prompt(5 + 7 * i as usize, i, 3), if i % 2 == 0 { greedy(30 + i as usize) } else { bias.clone() })).collect();
        let (want, _, _) = run_requests(&plain(&spec), &reqs);
        let (got, core, log) = run_requests(&spec, &reqs);
        assert_eq!(outputs(&want), outputs(&got), "hybrid {hybrid}");
        let r = routes(&log);
        assert!(verified_by(&r, true), "hybrid {hybrid}: verify chunks were picked on the runner");
        for call in &r {
            for &(w, p) in call {
                assert_eq!(p, w != LogitsWanted::None, "hybrid {hybrid}: every sequence with logits is picked on the runner: {call:?}");
            }
        }
        assert!(core.stats().spec.accepted > 0 && core.stats().spec.accepted < core.stats().spec.drafted);
    }
}

/// Rows that change with each accepted draft (penalties, a grammar), a distribution the
/// speculative sampling rule needs, or logprobs: the host route, outputs unchanged.
#[test]
fn sampled_logprob_penalized_and_grammar_requests_keep_the_host_route() {
    let base = ngram(true, 3, 3);
    let kinds = [
        ("sampled", SamplingParams { max_tokens: 30, seed: Some(3), ..Default::default() }),
        ("logprobs", SamplingParams { logprobs: true, ..greedy(30) }),
        ("top_logprobs", SamplingParams { logprobs: true, top_logprobs: 2, ..greedy(30) }),
        ("frequency penalty", SamplingParams { frequency_penalty: 0.4, ..greedy(30) }),
        ("repetition penalty", SamplingParams { repetition_penalty: 1.3, ..greedy(30) }),
    ];
    for (name, params) in kinds {
        let reqs: Vec<_> = (0..3u32).map(|i| (tiny_prompt(6 + 5 * i as usize, i, 3), params.clone())).collect();
        let (want, _, _) = run_requests(&plain(&base), &reqs);
        let (got, core, log) = run_requests(&base, &reqs);
        assert_eq!(outputs(&want), outputs(&got), "{name}");
        let r = routes(&log);
        assert!(verified_by(&r, false), "{name}: verify chunks ran");
        assert!(!r.iter().flatten().any(|&(_, p)| p), "{name}: nothing picked on the runner");
        assert!(core.stats().spec.drafted > 0, "{name}");
    }
    // A json_schema grammar: its mask changes with every accepted token.
    let schema = json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 12}}, "required": ["a"], "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "list", "schema": schema}});
    let base = Setup { vocab: 256, tokenizer: Some(byte_tokenizer()), eos: vec![0], cfg: EngineConfig { spec: Some(SpecConfig::new("ngram", Some(4)).unwrap()), ..Setup::default().cfg }, ..Default::default() };
    let reqs: Vec<_> = (0..3u32).map(|i| (prompt(6, i), SamplingParams { response_format: Some(format.clone()), ..greedy(200) })).collect();
    let (want, _, _) = run_requests(&plain(&base), &reqs);
    let (got, _, log) = run_requests(&base, &reqs);
    assert_eq!(outputs(&want), outputs(&got), "grammar");
    let r = routes(&log);
    assert!(verified_by(&r, false) && !r.iter().flatten().any(|&(_, p)| p), "grammar requests keep the host route: {r:?}");
}

/// A greedy request verified on the runner and the same request verified on the host (its
/// logprobs asked for, which keeps it there) output the same tokens and accept the same drafts,
/// alone and in one batch with sampled requests (both routes in one verify call).
#[test]
fn both_routes_accept_the_same_drafts_and_share_a_step() {
    for hybrid in [false, true] {
        let spec = ngram(hybrid, 3, 4);
        let p = tiny_prompt(9, 5, 3);
        let (by_id, core_id, log_id) = run_requests(&spec, &[(p.clone(), greedy(60))]);
        let (by_host, core_host, log_host) = run_requests(&spec, &[(p.clone(), SamplingParams { logprobs: true, ..greedy(60) })]);
        assert_eq!(by_id[0].tokens, by_host[0].tokens, "hybrid {hybrid}");
        let (a, b) = (core_id.stats().spec, core_host.stats().spec);
        assert_eq!((a.drafted, a.accepted), (b.drafted, b.accepted), "hybrid {hybrid}: the same drafts accepted");
        assert!(verified_by(&routes(&log_id), true) && !verified_by(&routes(&log_id), false));
        assert!(verified_by(&routes(&log_host), false) && !verified_by(&routes(&log_host), true));

        let sampled = SamplingParams { max_tokens: 40, seed: Some(1), ..Default::default() };
        let reqs = vec![(p.clone(), greedy(60)), (tiny_prompt(12, 2, 3), sampled), (tiny_prompt(7, 4, 3), SamplingParams { logprobs: true, ..greedy(50) })];
        let (want, _, _) = run_requests(&plain(&spec), &reqs);
        let (got, _, log) = run_requests(&spec, &reqs);
        assert_eq!(outputs(&want), outputs(&got), "hybrid {hybrid}: the mixed batch");
        assert_eq!(got[0].tokens, by_id[0].tokens, "hybrid {hybrid}: the batch does not change a request");
        let mixed = routes(&log).iter().any(|call| verified_by(std::slice::from_ref(call), true) && verified_by(std::slice::from_ref(call), false));
        assert!(mixed, "hybrid {hybrid}: one verify call picked some chunks on the runner and sent others' logits");
    }
}
