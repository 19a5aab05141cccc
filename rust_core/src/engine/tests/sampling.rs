//! The engine samples through `ModelRunner::forward_sampled`: one `RowSampling` per sequence
//! that produced logits, carrying the request's RNG draw and penalty history, and the tokens the
//! runner returns are the tokens the requests get.

use std::sync::{Arc, Mutex};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::config::ModelConfig;
use crate::model::{CacheSpec, Logits, LogitsWanted, ModelRunner, StepBatch};
use crate::sampling::{RowSampling, SampledToken};
use crate::Result;

/// A toy model that records the sampling rows of every step and, when `forced` is set, answers
/// with that token instead of sampling (as a device sampler would answer with its own pick).
struct SamplingProbe {
    inner: ToyRunner,
    #[allow(clippy::type_complexity)] // every step's batch and row sampling, as the runner saw them
    steps: Arc<Mutex<Vec<(StepBatch, Vec<RowSampling>)>>>,
    forced: Option<u32>,
}

impl ModelRunner for SamplingProbe {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn cache_spec(&self) -> CacheSpec {
        self.inner.cache_spec()
    }
    fn allocate_caches(&mut self, num_blocks: usize, block_size: usize, num_state_slots: usize) -> Result<()> {
        self.inner.allocate_caches(num_blocks, block_size, num_state_slots)
    }
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        self.inner.forward(batch)
    }
    fn forward_sampled(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> Result<Vec<SampledToken>> {
        self.steps.lock().unwrap().push((batch.clone(), rows.to_vec()));
        let host = self.forward(batch)?.sample_on_host(rows)?;
        Ok(match self.forced {
            Some(t) => host.into_iter().map(|s| SampledToken { token: t, logprob: s.logprob }).collect(),
            None => host,
        })
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<()> {
        self.inner.copy_state(src, dst)
    }
}

type Steps = Arc<Mutex<Vec<(StepBatch, Vec<RowSampling>)>>>;

fn probe_engine(forced: Option<u32>) -> (EngineCore, Steps) {
    let steps = Arc::new(Mutex::new(Vec::new()));
    let runner = SamplingProbe { inner: ToyRunner::new(VOCAB, 4096, false), steps: steps.clone(), forced };
    let mut cfg = Setup::default().cfg;
    cfg.prefill_chunk = 8;
    (EngineCore::new(Box::new(runner), &cfg, None, Vec::new()).expect("engine"), steps)
}

#[test]
fn each_sequence_with_logits_gets_one_row_and_outputs_match_host_sampling() {
    let reqs: Vec<(Vec<u32>, SamplingParams)> = vec![
        (prompt(20, 1), SamplingParams { max_tokens: 6, seed: Some(4), top_k: 5, ..Default::default() }),
        (prompt(3, 2), greedy(9)),
        (prompt(11, 3), SamplingParams { max_tokens: 7, seed: Some(9), top_p: 0.8, presence_penalty: 1.0, ..Default::default() }),
    ];
    let (mut core, steps) = probe_engine(None);
    for (i, (p, sp)) in reqs.iter().enumerate() {
        core.add_request(&format!("r{i}"), p.clone(), sp.clone()).unwrap();
    }
    let got = run_all(&mut core);
    for (batch, rows) in steps.lock().unwrap().iter() {
        let with_logits = batch.seqs.iter().filter(|s| s.logits != LogitsWanted::None).count();
        assert_eq!(rows.len(), with_logits, "one sampling row per sequence that produces logits");
    }
    let (plain, _, _) = run_requests(&Setup { cfg: EngineConfig { prefill_chunk: 8, ..Setup::default().cfg }, ..Setup::default() }, &reqs);
    for (i, want) in plain.iter().enumerate() {
        assert_eq!(got[&format!("r{i}")].tokens, want.tokens, "request r{i}: the default forward_sampled is the host sampler");
    }
}

#[test]
fn rows_carry_the_request_rng_draws_and_penalty_history() {
    let (mut core, steps) = probe_engine(Some(5));
    let params = SamplingParams { max_tokens: 4, seed: Some(11), presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
    core.add_request("r", vec![1, 2, 3], params).unwrap();
    let got = run_all(&mut core);
    assert_eq!(got["r"].tokens, vec![5; 4], "the engine emits the runner's tokens");
    let rows: Vec<RowSampling> = steps.lock().unwrap().iter().flat_map(|(_, r)| r.clone()).collect();
    assert_eq!(rows.len(), 4);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.u, rng.random::<f64>(), "token {i}: one draw of the request's RNG per token");
        let want: Vec<(u32, u32)> = if i == 0 { Vec::new() } else { vec![(5, i as u32)] };
        assert_eq!(row.penalized, want, "token {i}: the history holds the tokens the runner returned");
        assert_eq!((row.penalties.presence, row.penalties.frequency), (0.5, 0.25));
    }
}

#[test]
fn greedy_rows_draw_nothing_from_the_rng() {
    let (mut core, steps) = probe_engine(None);
    core.add_request("r", vec![1, 2, 3], SamplingParams { max_tokens: 3, ..greedy(3) }).unwrap();
    run_all(&mut core);
    let steps = steps.lock().unwrap();
    assert!(steps.iter().flat_map(|(_, r)| r).all(|r| r.is_greedy() && r.u == 0.0));
}
