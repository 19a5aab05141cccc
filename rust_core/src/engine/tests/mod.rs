//! Engine behaviour tests over `ToyRunner`: each test states one invariant of the engine.

mod adaptive;
mod batching;
mod caching;
mod grammar;
mod overlap;
mod sampling;
mod spec_sampling;
mod speculation;
mod stopping;
mod thinking;
mod thread;
mod verify_route;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::toy_runner::ToyLog;
use super::{EngineConfig, EngineCore, FinishReason, RequestOutput, StopReason, ToyRunner};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;

/// Vocabulary of the toy model in tests that need no tokenizer.
const VOCAB: usize = 64;

/// What one request produced, gathered from its deltas.
#[derive(Clone, Debug, Default, PartialEq)]
struct Collected {
    tokens: Vec<u32>,
    text: String,
    finish: Option<&'static str>,
    cached_tokens: usize,
    deltas: usize,
    /// The error of a request that failed (finish "error").
    error: Option<String>,
    /// The reasoning tokens its last delta counted.
    reasoning_tokens: usize,
    /// The stop string or stop token id that ended the request.
    stop_reason: Option<StopReason>,
}

/// Engine settings for a test.
#[derive(Clone)]
struct Setup {
    cfg: EngineConfig,
    vocab: usize,
    max_pos: usize,
    hybrid: bool,
    tokenizer: Option<Arc<Tokenizer>>,
    eos: Vec<u32>,
    /// The toy overlaps steps (asynchronous scheduling, `ToyRunner::overlapping`).
    overlap: bool,
    /// The toy has an MTP head (`ToyRunner::with_mtp_head`).
    mtp: bool,
    /// The toy rolls states back by recompute, not replay (`ToyRunner::recomputing`).
    recompute: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            cfg: EngineConfig { max_context: Some(512), kv_capacity_tokens: Some(4096), max_concurrency: 8, prefill_chunk: 128, ..Default::default() },
            vocab: VOCAB,
            max_pos: 4096,
            hybrid: false,
            tokenizer: None,
            eos: Vec::new(),
            overlap: false,
            mtp: false,
            recompute: false,
        }
    }
}

impl Setup {
    fn build(&self) -> (EngineCore, Arc<Mutex<ToyLog>>) {
        let runner = ToyRunner::new(self.vocab, self.max_pos, self.hybrid);
        let runner = if self.overlap { runner.overlapping() } else { runner };
        let runner = if self.mtp { runner.with_mtp_head() } else { runner };
        let runner = if self.recompute { runner.recomputing() } else { runner };
        let log = runner.log.clone();
        let core = EngineCore::new(Box::new(runner), &self.cfg, self.tokenizer.clone(), self.eos.clone()).expect("engine");
        // Tests look at the steps requests cause; the warm-up step has its own test.
        log.lock().expect("toy log").steps.clear();
        (core, log)
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens, ..Default::default() }
}

/// Deterministic prompt of `len` tokens, different for each `salt`.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + salt * 13 + 1) % VOCAB as u32).collect()
}

fn collect_into(all: &mut HashMap<String, Collected>, outs: Vec<RequestOutput>) {
    for o in outs {
        let c = all.entry(o.request_id.clone()).or_default();
        c.tokens.extend(&o.token_ids);
        c.text.push_str(&o.text);
        c.deltas += 1;
        c.cached_tokens = o.cached_tokens;
        c.reasoning_tokens = o.reasoning_tokens;
        assert_eq!(o.error.is_some(), o.finish_reason == Some(FinishReason::Error), "{}: an error comes with finish reason error, on the last delta", o.request_id);
        c.error = o.error;
        assert!(o.stop_reason.is_none() || o.finish_reason == Some(FinishReason::Stop), "{}: a stop reason comes with finish reason stop", o.request_id);
        c.stop_reason = o.stop_reason;
        if let Some(f) = o.finish_reason {
            assert!(c.finish.is_none(), "{} finished twice", o.request_id);
            c.finish = Some(f.as_str());
        }
    }
}

/// Step until every request is finished.
fn run_all(core: &mut EngineCore) -> HashMap<String, Collected> {
    let mut all = HashMap::new();
    let mut guard = 0;
    while core.has_unfinished() {
        collect_into(&mut all, core.step().expect("step"));
        guard += 1;
        assert!(guard < 100_000, "engine did not finish");
    }
    all
}

/// Run requests together in one engine.
fn run_requests(setup: &Setup, reqs: &[(Vec<u32>, SamplingParams)]) -> (Vec<Collected>, EngineCore, Arc<Mutex<ToyLog>>) {
    let (mut core, log) = setup.build();
    for (i, (p, sp)) in reqs.iter().enumerate() {
        core.add_request(&format!("r{i}"), p.clone(), sp.clone()).expect("add");
    }
    let all = run_all(&mut core);
    let out = (0..reqs.len()).map(|i| all[&format!("r{i}")].clone()).collect();
    (out, core, log)
}

/// A byte-level BPE tokenizer whose token id `b` is the byte `b` (no merges), saved into a
/// fresh directory: enough to test UTF-8 handling and stop strings with real `tokenizers` code.
fn byte_tokenizer() -> Arc<Tokenizer> {
    static TOK: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
    TOK.get_or_init(build_byte_tokenizer).clone()
}

fn build_byte_tokenizer() -> Arc<Tokenizer> {
    build_byte_tokenizer_with(&[])
}

/// The byte tokenizer with `added` (non-special) tokens from id 256 on.
fn build_byte_tokenizer_with(added: &[&str]) -> Arc<Tokenizer> {
    let mut chars = Vec::new();
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        chars.push(if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        });
    }
    let vocab: serde_json::Map<String, serde_json::Value> = chars.iter().enumerate().map(|(i, c)| (c.to_string(), serde_json::json!(i))).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "added_tokens": added.iter().enumerate().map(|(i, content)| serde_json::json!({
            "id": 256 + i, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false
        })).collect::<Vec<_>>(),
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                   "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    let dir = std::env::temp_dir().join(format!("ninfer-byte-tok-{}-{}-{}", std::process::id(), n, added.len()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    Arc::new(Tokenizer::from_dir(&dir).expect("byte tokenizer"))
}

/// A runner that fails its `fail_at`-th step (the warm-up is the first) as a device would: in
/// its `forward` / `launch_forward`, or with `in_sampling` in its `launch_sampling`, after the
/// forward has run.
struct FailingRunner {
    inner: ToyRunner,
    calls: usize,
    fail_at: usize,
    in_sampling: bool,
}

impl FailingRunner {
    fn failure(&mut self, in_sampling: bool) -> crate::Result<()> {
        if !in_sampling {
            self.calls += 1;
        }
        if self.calls == self.fail_at && self.in_sampling == in_sampling {
            return Err(crate::NinferError::Device("injected failure".into()));
        }
        Ok(())
    }
}

impl crate::model::ModelRunner for FailingRunner {
    fn config(&self) -> &crate::config::ModelConfig {
        self.inner.config()
    }
    fn cache_spec(&self) -> crate::model::CacheSpec {
        self.inner.cache_spec()
    }
    fn allocate_caches(&mut self, b: usize, s: usize, n: usize) -> crate::Result<()> {
        self.inner.allocate_caches(b, s, n)
    }
    fn forward(&mut self, batch: &crate::model::StepBatch) -> crate::Result<crate::model::Logits> {
        self.failure(false)?;
        self.inner.forward(batch)
    }
    fn overlaps_steps(&self) -> bool {
        self.inner.overlaps_steps()
    }
    fn launch_forward(&mut self, batch: &crate::model::StepBatch, feed: bool) -> crate::Result<()> {
        self.failure(false)?;
        self.inner.launch_forward(batch, feed)
    }
    fn launch_sampling(&mut self, rows: &[crate::sampling::RowSampling]) -> crate::Result<()> {
        self.failure(true)?;
        self.inner.launch_sampling(rows)
    }
    fn collect_sampled(&mut self) -> crate::Result<Vec<crate::sampling::SampledToken>> {
        self.inner.collect_sampled()
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> crate::Result<()> {
        self.inner.copy_state(src, dst)
    }
}
