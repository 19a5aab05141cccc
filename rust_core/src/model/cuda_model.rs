//! `CudaModel`: a loaded model on one CUDA device, running engine steps with the kernels of
//! `backend::cuda` on the device's stream.
//!
//! A step uploads its metadata (token ids, positions, KV slots, block tables, sequence offsets)
//! in two copies, runs every layer over all rows of the step, and copies only the wanted logits
//! rows back as f32 through a pinned buffer (`forward`), or samples them on the device and
//! copies back only ids and logprobs (`forward_sampled`, see `cuda_sampler.rs`); that copy is
//! the only host synchronization. Decode steps (one token per sequence, each wanting its
//! logits) are padded to a batch bucket and replayed as CUDA graphs (cuda_graphs.rs); prefill
//! and mixed steps run eagerly, with the prefill kernels (flash attention, chunked GDN).

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

use crate::artifact::WeightStore;
use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::ops::{decode_scratch_len, qkv_rope_fits, AttnScratch, ConvShape, GATED_MAX_DV, PagedAttentionShape, RecurrentShape, RopeKvShape, GEMV_ROUTE_MAX_M};
use crate::backend::cuda::blas::padded_row_buckets;
use crate::backend::cuda::plan::ModelShape;
use crate::backend::cuda::CudaDevice;
use crate::config::{CudaOptions, ModelConfig};
use crate::sampling::{RowSampling, SampledToken};
use crate::{NinferError, Result};

use super::cuda_graphs::{decode_bucket, table_stride, DecodeGraphs};
use super::cuda_sampler::DeviceSampler;
use super::cuda_step::StepMeta;
use super::cuda_weights::{DevLayer, DevLinear, DevMixer, DevWeights};
use super::kv_dtype::KvDtype;
use super::logits_dtype::LogitsDtype;
use super::runner::{CacheSpec, Logits, LogitsWanted, ModelRunner, StepBatch};

/// KV pool and recurrent-state slots on the device, per layer.
#[derive(Default)]
struct DevCaches {
    block_size: usize,
    num_blocks: usize,
    /// State slots the engine hands out; one more is allocated, `num_slots` itself, for the
    /// padding rows of decode graphs (no sequence owns it, so their writes harm nothing).
    num_slots: usize,
    /// Per attention layer, `[num_blocks, block_size, n_kv_heads, head_dim]` in storage type.
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    /// Per GDN layer, `[slots, conv_dim, kernel - 1]` in storage type.
    conv: Vec<CudaSlice<u16>>,
    /// Per GDN layer, f32 `[slots, n_v_heads, dk, dv]`.
    delta: Vec<CudaSlice<f32>>,
}

/// Activation buffers for steps of up to `rows` tokens; grown (never shrunk) when a larger
/// step arrives, so that steady-state steps allocate nothing.
#[derive(Default)]
struct Activations {
    rows: usize,
    /// Residual stream `[rows, hidden]`.
    x: Option<CudaSlice<u16>>,
    /// Normed input of the current sub-block.
    h: Option<CudaSlice<u16>>,
    /// Sub-block output added to the residual.
    tmp: Option<CudaSlice<u16>>,
    /// Attention qkv projection, or the GDN input projection (conv input, z, b, a per row).
    proj: Option<CudaSlice<u16>>,
    /// Normed (then rotated) queries and keys for models with q/k norm.
    qn: Option<CudaSlice<u16>>,
    kn: Option<CudaSlice<u16>>,
    /// Mixer output before its output projection.
    mix: Option<CudaSlice<u16>>,
    gate_up: Option<CudaSlice<u16>>,
    act: Option<CudaSlice<u16>>,
    /// GDN: conv output, gates, core output.
    conv_out: Option<CudaSlice<u16>>,
    g: Option<CudaSlice<f32>>,
    beta: Option<CudaSlice<f32>>,
    core: Option<CudaSlice<u16>>,
    /// f32 workspace of the chunked GDN kernels (`RecurrentShape::chunked_workspace_len`); one
    /// element where the model has no GDN layers or the device runs them recurrently.
    gdn_work: Option<CudaSlice<f32>>,
    /// Rows that produce logits, gathered.
    sel: Option<CudaSlice<u16>>,
    /// f32 logits of the gathered rows: sized by the rows that want logits
    /// (`ensure_logit_rows`), not by the step's tokens, since a prefill step wants one row a
    /// sequence (a vocabulary of 248k at an 8192-token chunk would hold 7.6 GiB here).
    logits: Option<CudaSlice<f32>>,
    /// f32 sums of a projection with a bias before the bias is added and the sum rounded
    /// (`CudaDevice::linear_bias`): rows x the widest biased projection, one element in models
    /// without biases.
    lin32: Option<CudaSlice<f32>>,
}

/// A model on one CUDA device (weights in the device's storage type).
pub struct CudaModel {
    cfg: ModelConfig,
    dev: Arc<CudaDevice>,
    weights: DevWeights,
    /// Layer index -> index into the KV lists (attention) or the state lists (GDN).
    cache_index: Vec<usize>,
    /// f32 `[rotary_dim / 2]`.
    inv_freq: CudaSlice<f32>,
    rope_scale: f32,
    caches: DevCaches,
    act: Activations,
    meta: StepMeta,
    /// A one-element buffer for the unused k argument of a q-only RoPE launch.
    dummy: CudaSlice<u16>,
    /// Decode steps' metadata, padded to the bucket (its own buffers, so that prefill steps
    /// never move what a captured graph reads).
    dmeta: StepMeta,
    /// Split-K partials of decode attention for `scratch_rows` tokens.
    scratch: Option<AttnScratch>,
    scratch_rows: usize,
    graphs: DecodeGraphs,
    /// Page-locked staging for the logits copy to the host.
    pinned: Option<PinnedHostSlice<f32>>,
    /// Rows of `act.logits` the last step produced (in the order of `Logits::data`).
    logits_rows: usize,
    /// Device-side sampling (`forward_sampled`).
    sampler: DeviceSampler,
    /// The step `launch_forward` queued and `launch_sampling` has not sampled yet: its logits
    /// rows per sequence, and whether it was fed (its input ids are then the sampled tokens).
    forwarded: Option<(Vec<usize>, bool)>,
    /// Batch-1 decode runs the qkv projection with RoPE and the KV cache write in its epilogue
    /// (`gemv_qkv_rope_kv_write`, where `AttnCtx::fuses_rope` allows): the plan's `fused_rope`.
    fused_rope: bool,
    /// The lm_head rounds logits to the storage type (logits_dtype "auto",
    /// model/logits_dtype.rs): in the decode GEMV's epilogue and after prefill's cuBLAS GEMM
    /// (`linear_f32_out`), the one place every consumer (device and host sampling, logprobs,
    /// `Model.logits`) reads logits from.
    logits_round: bool,
}

impl Activations {
    /// Device bytes of every buffer.
    fn bytes(&self) -> usize {
        fn b<T>(x: &Option<CudaSlice<T>>) -> usize {
            x.as_ref().map_or(0, |s| s.len() * std::mem::size_of::<T>())
        }
        let u16s = [&self.x, &self.h, &self.tmp, &self.proj, &self.qn, &self.kn, &self.mix, &self.gate_up, &self.act, &self.conv_out, &self.core, &self.sel];
        u16s.iter().map(|x| b(x)).sum::<usize>() + b(&self.g) + b(&self.beta) + b(&self.gdn_work) + b(&self.logits) + b(&self.lin32)
    }
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, n: usize, what: &str) -> Result<CudaSlice<T>> {
    let free = dev.memory_info().map(|(f, _)| f as u64).unwrap_or(0);
    dev.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| NinferError::OutOfMemory {
        what: format!("{what} ({e})"),
        needed: (n * std::mem::size_of::<T>()) as u64,
        available: free,
        hint: "lower --kv-capacity, --max-concurrency or --prefill-chunk".into(),
    })
}

/// The buffer behind an activation slot (set once `ensure_rows`, for the logits
/// `ensure_logit_rows`, ran).
fn buf<T>(b: &Option<CudaSlice<T>>) -> &CudaSlice<T> {
    b.as_ref().expect("activation buffer allocated by ensure_rows")
}

fn buf_mut<T>(b: &mut Option<CudaSlice<T>>) -> &mut CudaSlice<T> {
    b.as_mut().expect("activation buffer allocated by ensure_rows")
}

impl CudaModel {
    /// Load config and weights from a HF model directory onto device `ordinal`.
    pub fn load(dir: &Path, ordinal: usize) -> Result<Self> {
        Self::load_with(dir, ordinal, LogitsDtype::Auto, KvDtype::Auto, &CudaOptions::default())
    }

    /// As `load`, with the logits rounded as `logits_dtype` says, `kv_dtype` checked against
    /// the device's storage type (the KV cache's) as soon as the device is open, and the
    /// device's route plan made for this model under `options`.
    pub fn load_with(dir: &Path, ordinal: usize, logits_dtype: LogitsDtype, kv_dtype: KvDtype, options: &CudaOptions) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let dev = Arc::new(CudaDevice::for_model(ordinal, ModelShape { hidden_size: Some(cfg.hidden_size) }, options)?);
        kv_dtype.check(&format!("cuda:{ordinal} ({}, {})", dev.name(), dev.arch()), dev.storage().into())?;
        Self::check_supported(&cfg)?;
        let (graphs, sampler) = (DecodeGraphs::new(dev.plan().cuda_graphs), DeviceSampler::new(dev.plan().device_sampling));
        let fused_rope = dev.plan().fused_rope;
        let store = WeightStore::open(dir)?;
        // The device runs every checkpoint in its 16-bit storage type (an f32 checkpoint is
        // converted while loading, as transformers' `dtype=torch.bfloat16` does), so "auto"
        // rounds to that type whatever the file holds: f32 and bf16 copies of a model give the
        // same logits here.
        let logits_round = logits_dtype == LogitsDtype::Auto;
        // Kernels compile (or load from the disk cache) on a second thread while the weights
        // stream in: a cold start pays for the longer of the two, not their sum.
        let (kernels, weights, load_s) = std::thread::scope(|s| {
            let kernels = s.spawn(|| dev.load_all_kernels());
            let t0 = std::time::Instant::now();
            let weights = DevWeights::load(&dev, &cfg, &store);
            let load_s = t0.elapsed().as_secs_f64();
            (kernels.join(), weights, load_s)
        });
        kernels.map_err(|_| NinferError::Device("the kernel loading thread panicked".into()))??;
        let weights = weights?;
        let cache_index = cfg.cache_index();
        let (inv_freq, rope_scale) = cfg.rope.inv_freq(cfg.head_dim);
        let inv_freq = dev.stream().clone_htod(&inv_freq).map_err(driver_err("uploading rope frequencies"))?;
        let dummy = alloc::<u16>(&dev, 1, "rope scratch")?;
        eprintln!(
            "ninfer: loaded {} on cuda:{} ({}, {}, {:?}): {:.2} GiB of weights in {:.1} s ({:.1} GB/s)",
            cfg.architecture,
            ordinal,
            dev.name(),
            dev.arch(),
            dev.storage(),
            weights.bytes as f64 / (1u64 << 30) as f64,
            load_s,
            weights.bytes as f64 / 1e9 / load_s.max(1e-9)
        );
        Ok(CudaModel {
            cfg,
            dev,
            weights,
            cache_index,
            inv_freq,
            rope_scale,
            caches: DevCaches::default(),
            act: Activations::default(),
            meta: StepMeta::default(),
            dummy,
            dmeta: StepMeta::default(),
            scratch: None,
            scratch_rows: 0,
            graphs,
            pinned: None,
            logits_rows: 0,
            sampler,
            forwarded: None,
            fused_rope,
            logits_round,
        })
    }

    /// Shapes the kernels do not cover yet fail at load with the reason, not mid-step.
    fn check_supported(cfg: &ModelConfig) -> Result<()> {
        let unsupported = |what: String| Err(NinferError::Unsupported(format!("{what} on the CUDA backend (use device=\"cpu\")")));
        if cfg.num_attention_layers() > 0 && !matches!(cfg.head_dim, 64 | 96 | 128 | 256) {
            return unsupported(format!("head_dim {} (kernels: 64, 96, 128, 256)", cfg.head_dim));
        }
        if cfg.qkv_bias && cfg.attn_output_gate {
            return unsupported("q/k/v projection biases with a gated query (attn_output_gate)".into());
        }
        if let Some(la) = cfg.linear_attention {
            if !matches!(la.key_head_dim, 64 | 128) || la.value_head_dim % 32 != 0 || !(2..=4).contains(&la.conv_kernel) {
                return unsupported(format!(
                    "Gated DeltaNet with key head dim {}, value head dim {}, conv kernel {} (kernels: dk 64/128, dv a multiple of 32, kernel 2-4)",
                    la.key_head_dim, la.value_head_dim, la.conv_kernel
                ));
            }
        }
        Ok(())
    }

    /// The device this model runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// KV blocks, block size and state slots currently allocated.
    pub fn cache_capacity(&self) -> (usize, usize, usize) {
        (self.caches.num_blocks, self.caches.block_size, self.caches.num_slots)
    }

    /// Grow the activation buffers to hold `rows` tokens (with headroom, so that a run of
    /// growing steps allocates a few times, not every step).
    fn ensure_rows(&mut self, rows: usize) -> Result<()> {
        if rows <= self.act.rows {
            return Ok(());
        }
        let rows = rows.next_power_of_two().max(8);
        let c = &self.cfg;
        let dev = &self.dev;
        let (h, qd, kvd) = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let attn_width = qd * if c.attn_output_gate { 2 } else { 1 } + 2 * kvd;
        let (cd, vd, nv) = c.linear_attention.map_or((0, 0, 0), |la| (la.conv_dim(), la.value_dim(), la.num_value_heads));
        // The GDN input projection's output row: conv channels, z, b and a (DevGdn::in_proj).
        let gdn_in = cd + vd + 2 * nv;
        let inter = c.intermediate_size;
        let gdn_work = match c.linear_attention {
            Some(la) if dev.has_gdn_chunked(la.key_head_dim) => RecurrentShape::chunked_workspace_len(rows, la.num_value_heads, la.key_head_dim, la.value_head_dim),
            _ => 1,
        };
        // Free the old set first so that growth does not need both at once; graphs captured
        // over the old buffers are void. The logits buffer has its own size (ensure_logit_rows).
        self.graphs.clear();
        let logits = self.act.logits.take();
        self.act = Activations::default();
        let a = Activations {
            rows,
            x: Some(alloc(dev, rows * h, "activations")?),
            h: Some(alloc(dev, rows * h, "activations")?),
            tmp: Some(alloc(dev, rows * h, "activations")?),
            proj: Some(alloc(dev, rows * attn_width.max(gdn_in), "activations")?),
            qn: Some(alloc(dev, if c.qk_norm { rows * qd } else { 1 }, "activations")?),
            kn: Some(alloc(dev, if c.qk_norm { rows * kvd } else { 1 }, "activations")?),
            mix: Some(alloc(dev, rows * qd.max(vd), "activations")?),
            gate_up: Some(alloc(dev, rows * 2 * inter, "activations")?),
            act: Some(alloc(dev, rows * inter, "activations")?),
            conv_out: Some(alloc(dev, rows * cd, "activations")?),
            g: Some(alloc(dev, rows * nv, "activations")?),
            beta: Some(alloc(dev, rows * nv, "activations")?),
            core: Some(alloc(dev, rows * vd, "activations")?),
            gdn_work: Some(alloc(dev, gdn_work, "GDN chunk workspace")?),
            sel: Some(alloc(dev, rows * h, "activations")?),
            lin32: Some(alloc(dev, rows * biased_width(c, attn_width), "activations")?),
            logits,
        };
        self.act = a;
        Ok(())
    }

    /// Grow the logits buffer to hold `rows` rows of the vocabulary (the rows of a step that
    /// want logits; grown, never shrunk). Called before a step's first kernel, so that a
    /// device too small for a scoring request's rows fails before the step writes any cache.
    /// Growth voids the decode graphs, which write the old buffer. A step with no such row still
    /// allocates it once: the samplers take the buffer whatever the row count.
    fn ensure_logit_rows(&mut self, rows: usize) -> Result<()> {
        let vocab = self.cfg.vocab_size;
        if self.act.logits.as_ref().is_some_and(|l| rows * vocab <= l.len()) {
            return Ok(());
        }
        let rows = rows.next_power_of_two().max(8);
        self.graphs.clear();
        self.act.logits = None;
        self.act.logits = Some(alloc(&self.dev, rows * vocab, "logits")?);
        Ok(())
    }

    /// Decode-attention scratch for `rows` tokens (grown, never shrunk; growth voids graphs).
    fn ensure_scratch(&mut self, rows: usize) -> Result<()> {
        if rows <= self.scratch_rows || self.cfg.num_attention_layers() == 0 {
            return Ok(());
        }
        let rows = rows.next_power_of_two().max(8);
        self.graphs.clear();
        self.scratch = None;
        let len = decode_scratch_len(rows, &self.attn_shape(0, 0));
        // alloc zeroes: the arrival counters must start at 0 (paged_attention_decode).
        self.scratch = Some(AttnScratch {
            acc: alloc(&self.dev, len.acc, "attention scratch")?,
            ml: alloc(&self.dev, len.ml, "attention scratch")?,
            arrivals: alloc(&self.dev, len.arrivals, "attention scratch")?,
        });
        self.scratch_rows = rows;
        Ok(())
    }

    /// The attention shape of this model over its caches.
    fn attn_shape(&self, max_blocks_per_seq: usize, max_context: usize) -> PagedAttentionShape {
        let c = &self.cfg;
        PagedAttentionShape {
            n_q_heads: c.num_attention_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            q_stride: 0,
            block_size: self.caches.block_size,
            num_blocks: self.caches.num_blocks,
            max_blocks_per_seq,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            max_context,
            partition: 0,
        }
    }

    fn step(&mut self, batch: &StepBatch) -> Result<Logits> {
        let counts = self.run(batch)?;
        let m: usize = counts.iter().sum();
        let data = if m == 0 { Vec::new() } else { self.logits_to_host(m)? };
        Ok(Logits { vocab: self.cfg.vocab_size, data, rows: counts })
    }

    /// Run a step up to the f32 logits of its wanted rows, left in `act.logits` in sequence
    /// order; returns how many rows each sequence has.
    fn run(&mut self, batch: &StepBatch) -> Result<Vec<usize>> {
        self.run_fed(batch, false)
    }

    /// `run`; with `feed` (a decode step only), the tokens are the ones the device sampler
    /// wrote for the step sampled before (`ModelRunner::launch_forward`).
    fn run_fed(&mut self, batch: &StepBatch, feed: bool) -> Result<Vec<usize>> {
        self.meta.validate(&self.cfg, batch, self.caches.block_size, self.caches.num_blocks, self.caches.num_slots)?;
        if is_decode(batch) {
            return self.decode_step(batch, feed);
        }
        if feed {
            return Err(NinferError::invalid("launch_forward", "only a decode step (one token a sequence) takes its tokens from the step before"));
        }
        let rows = batch.num_tokens();
        self.ensure_rows(rows)?;
        let counts = self.meta.logit_counts(batch);
        self.ensure_logit_rows(counts.iter().sum())?;
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        self.meta.upload(&self.dev, batch, self.caches.block_size)?;
        self.zero_new_states(batch)?;
        // Longest chunk of the step: prefill kernels (flash attention, chunked GDN) take over
        // from the decode kernels when a sequence brings more than one token.
        let max_rows = batch.seqs.iter().map(|q| q.tokens.len()).max().unwrap_or(0);
        self.run_layers(false, rows, max_rows)?;
        let CudaModel { cfg, dev, weights, act, meta, logits_round, .. } = self;
        let (h, eps, plus_one) = (cfg.hidden_size, cfg.rms_norm_eps, weights.norm_plus_one);
        let picked = meta.picked_runs(batch);
        let m: usize = counts.iter().sum();
        let vocab = cfg.vocab_size;
        self.logits_rows = m;
        if m == 0 {
            return Ok(counts);
        }
        dev.add_rmsnorm(buf_mut(&mut act.x), buf(&act.tmp), &weights.final_norm, buf_mut(&mut act.h), rows, h, eps, plus_one)?;
        let mut out_row = 0;
        for (r0, n) in picked {
            let src = buf(&act.h).slice(r0 * h..(r0 + n) * h);
            let mut dst = buf_mut(&mut act.sel).slice_mut(out_row * h..(out_row + n) * h);
            dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering logits rows"))?;
            out_row += n;
        }
        dev.linear_f32_out(buf(&act.sel), weights.lm_head(), buf_mut(&mut act.logits), m, vocab, h, *logits_round)?;
        Ok(counts)
    }

    /// A decode step: padded to its bucket and replayed as a CUDA graph (captured on first
    /// use), or run eagerly over exactly its rows when graphs are off. Both run the same
    /// kernels with the same per-row arithmetic, so their logits agree bit for bit.
    fn decode_step(&mut self, batch: &StepBatch, feed: bool) -> Result<Vec<usize>> {
        let n = batch.seqs.len();
        let rows = if self.graphs.enabled() { decode_bucket(n) } else { n };
        let bs = self.caches.block_size.max(1);
        let blocks = batch.seqs.iter().map(|q| (q.start_pos + 1).div_ceil(bs)).max().unwrap_or(1);
        let stride = table_stride(blocks);
        self.ensure_rows(rows)?;
        self.ensure_logit_rows(rows)?;
        self.ensure_scratch(rows)?;
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let spare = self.caches.num_slots;
        if self.dmeta.upload_decode(&self.dev, batch, rows, stride, bs, spare)? {
            self.graphs.clear();
        }
        if feed {
            self.dev.feed_sampled_tokens(self.sampler.last_output()?, &mut self.dmeta.ids_mut(n), n)?;
        }
        self.zero_new_states(batch)?;
        let key = (rows, stride);
        if self.graphs.enabled() && !self.graphs.has(key) {
            let mut graphs = std::mem::take(&mut self.graphs);
            let dev = self.dev.clone();
            let captured = graphs.capture(&dev, key, || self.decode_forward(rows));
            self.graphs = graphs;
            if let Err(e) = captured {
                // Same kernels eagerly (same results); a driver that cannot capture should
                // cost speed, not the service.
                eprintln!("ninfer: capturing a CUDA graph of a decode step failed ({e}); decode steps run eagerly from now on");
                self.graphs.disable();
            }
        }
        if self.graphs.enabled() {
            self.graphs.launch(key)?;
        } else {
            self.decode_forward(rows)?;
        }
        self.logits_rows = n;
        Ok(vec![1; n])
    }

    /// Queues a decode step's forward over `rows` (padded) rows of `dmeta`, logits of every row
    /// into `act.logits`. Nothing here allocates or synchronizes (it is what graphs capture).
    fn decode_forward(&mut self, rows: usize) -> Result<()> {
        self.run_layers(true, rows, 1)?;
        let CudaModel { cfg, dev, weights, act, logits_round, .. } = self;
        dev.linear_f32_out(buf(&act.h), weights.lm_head(), buf_mut(&mut act.logits), rows, cfg.vocab_size, cfg.hidden_size, *logits_round)
    }

    /// Embedding and every layer over `rows` rows of the step's metadata (`dmeta` with decode
    /// attention when `decode`, else `meta`). Each sub-block's output projection also adds into
    /// the residual and applies the norm that follows it (`Activations::project_out`: one
    /// kernel at decode). A decode step, whose every row wants logits, ends with the final norm
    /// in `act.h`; a prefill step leaves the last projection in `act.tmp` for `run`, which
    /// norms only when some row wants logits.
    fn run_layers(&mut self, decode: bool, rows: usize, max_rows: usize) -> Result<()> {
        let CudaModel { cfg, dev, weights, cache_index, inv_freq, rope_scale, caches, act, meta, dummy, dmeta, scratch, fused_rope, .. } = self;
        let (meta, scratch) = if decode { (&*dmeta, scratch.as_ref()) } else { (&*meta, None) };
        let (h, eps, plus_one) = (cfg.hidden_size, cfg.rms_norm_eps, weights.norm_plus_one);
        dev.embedding(&weights.embed, &meta.ids(), buf_mut(&mut act.x), cfg.vocab_size, h)?;
        if let Some(first) = weights.layers.first() {
            dev.rmsnorm(buf(&act.x), &first.input_norm, buf_mut(&mut act.h), rows, h, h, h, eps, plus_one)?;
        }
        for (li, layer) in weights.layers.iter().enumerate() {
            let ci = cache_index[li];
            let post = NormNext { w: Some(&layer.post_norm), eps, plus_one };
            match &layer.mixer {
                DevMixer::Attention(a) => {
                    let attn = AttnCtx { cfg, dev, meta, inv_freq, rope_scale: *rope_scale, block_size: caches.block_size, num_blocks: caches.num_blocks, decode: scratch, max_rows, fused_rope: *fused_rope };
                    attn.run(a, &mut caches.k[ci], &mut caches.v[ci], act, dummy, rows, &post)?;
                }
                DevMixer::Gdn(g) => gdn_layer(cfg, dev, meta, g, &mut caches.conv[ci], &mut caches.delta[ci], caches.num_slots + 1, act, rows, max_rows, &post)?,
            }
            let next = match weights.layers.get(li + 1) {
                Some(l) => Some(&l.input_norm),
                None if decode => Some(&weights.final_norm),
                None => None,
            };
            mlp(dev, layer, act, rows, &NormNext { w: next, eps, plus_one })?;
        }
        Ok(())
    }

    /// Copies the first `m` logits rows to the host through the pinned buffer (the step's one
    /// synchronization).
    fn logits_to_host(&mut self, m: usize) -> Result<Vec<f32>> {
        let n = m * self.cfg.vocab_size;
        if self.pinned.as_ref().is_none_or(|p| p.len() < n) {
            self.pinned = None;
            // SAFETY: the buffer is written by the copy below before it is read.
            let p = unsafe { self.dev.context().alloc_pinned_with_flags::<f32>(n.next_power_of_two(), 0) }.map_err(driver_err("allocating pinned logits"))?;
            self.pinned = Some(p);
        }
        let pinned = self.pinned.as_mut().expect("allocated above");
        let src = buf(&self.act.logits).slice(0..n);
        // Copy into exactly n elements: cudarc sizes a copy by its destination, and the pinned
        // buffer is rounded up (copying into all of it would read past the logits).
        let host = pinned.as_mut_slice().map_err(driver_err("waiting for the pinned logits buffer"))?;
        self.dev.stream().memcpy_dtoh(&src, &mut host[..n]).map_err(driver_err("copying logits to the host"))?;
        self.dev.synchronize()?;
        let host = pinned.as_slice().map_err(driver_err("reading pinned logits"))?;
        Ok(host[..n].to_vec())
    }

    /// The logits of the last step on the device, f32 `[rows, vocab]` (rows in the order of
    /// `Logits::data`), for device-side sampling without a host copy. Valid until the next step.
    pub fn device_logits(&self) -> Option<(CudaView<'_, f32>, usize)> {
        let l = self.act.logits.as_ref()?;
        let m = self.logits_rows;
        Some((l.slice(0..m * self.cfg.vocab_size), m))
    }

    /// Sequences that start at position 0 begin from a zero recurrent state.
    fn zero_new_states(&mut self, batch: &StepBatch) -> Result<()> {
        let Some(la) = self.cfg.linear_attention else { return Ok(()) };
        let (conv_elems, delta_elems) = (la.conv_floats(), la.delta_floats());
        let s = self.dev.stream().clone();
        for seq in batch.seqs.iter().filter(|q| q.start_pos == 0) {
            let slot = seq.state_slot;
            for conv in &mut self.caches.conv {
                s.memset_zeros(&mut conv.slice_mut(slot * conv_elems..(slot + 1) * conv_elems)).map_err(driver_err("clearing a state slot"))?;
            }
            for delta in &mut self.caches.delta {
                s.memset_zeros(&mut delta.slice_mut(slot * delta_elems..(slot + 1) * delta_elems)).map_err(driver_err("clearing a state slot"))?;
            }
        }
        Ok(())
    }
}

/// What an attention layer needs besides its weights and cache.
struct AttnCtx<'a> {
    cfg: &'a ModelConfig,
    dev: &'a CudaDevice,
    meta: &'a StepMeta,
    inv_freq: &'a CudaSlice<f32>,
    rope_scale: f32,
    block_size: usize,
    num_blocks: usize,
    /// Decode steps: attention with per-token split-K into this scratch (batch-independent
    /// results, graph-stable arguments); `None` for prefill and mixed steps.
    decode: Option<&'a AttnScratch>,
    /// Most query rows of one sequence in the step (flash attention above one).
    max_rows: usize,
    /// `CudaModel::fused_rope`.
    fused_rope: bool,
}

impl AttnCtx<'_> {
    /// Whether this layer's qkv projection over `rows` rows runs `gemv_qkv_rope_kv_write`
    /// (projection, RoPE and KV cache write in one kernel) instead of `linear` and
    /// `rope_kv_write_packed`: a decode step of one row whose projection is the CUDA-core GEMV
    /// at M = 1 (`qkv_rope_fits`: the fused kernel's sums are that GEMV's), keys right after the
    /// queries (no output gate), no q/k norm between projection and RoPE, full rotary, and the
    /// switch on. Same bits either way.
    fn fuses_rope(&self, a: &super::cuda_weights::DevAttention, rows: usize) -> bool {
        let (c, dev) = (self.cfg, self.dev);
        let plain_qkv = !c.attn_output_gate && a.q_norm.is_none() && a.k_norm.is_none() && a.qkv.bias.is_none();
        let kernel = dev.gemv_kernel(dev.gemv_form(), a.qkv.n, a.qkv.k, 1);
        self.fused_rope && self.decode.is_some() && plain_qkv && qkv_rope_fits(kernel, rows, c.head_dim, self.inv_freq.len() * 2, a.qkv.k)
    }

    /// Softmax attention sub-block: reads `act.h`, ends with `Activations::project_out`.
    #[allow(clippy::too_many_arguments)]
    fn run(&self, a: &super::cuda_weights::DevAttention, kc: &mut CudaSlice<u16>, vc: &mut CudaSlice<u16>, act: &mut Activations, dummy: &mut CudaSlice<u16>, rows: usize, then: &NormNext) -> Result<()> {
        let (c, dev) = (self.cfg, self.dev);
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let width = a.qkv.n;
        let k_off = if c.attn_output_gate { 2 * qd } else { qd };
        let v_off = k_off + kvd;
        let positions = self.meta.positions();
        let rope = |q_stride, k_stride| RopeKvShape { n_q_heads: nh, n_kv_heads: nkv, head_dim: hd, q_stride, k_stride, v_stride: width, attn_scale: self.rope_scale };
        // Batch-1 decode projects, rotates and caches in one kernel where `fuses_rope` allows.
        let fused_rope = self.fuses_rope(a, rows);
        if fused_rope {
            dev.gemv_qkv_rope_kv_write(buf(&act.h), &a.qkv.w, buf_mut(&mut act.proj), kc, vc, &positions, &self.meta.slot_mapping(), self.inv_freq, &rope(width, width), a.qkv.k)?;
        } else {
            linear(dev, &a.qkv, buf(&act.h), buf_mut(&mut act.proj), &mut act.lin32, rows)?;
        }
        // Decode steps the projection did not fuse rotate q and k and write the cache in one
        // kernel (rope_kv_write, bit for bit rope_neox followed by kv_cache_write); other steps
        // run the two kernels.
        let decode = self.decode.is_some();
        let (q_src, q_stride, k_rows, k_stride): (CudaView<'_, u16>, usize, CudaView<'_, u16>, usize);
        if let (Some(qw), Some(kw)) = (&a.q_norm, &a.k_norm) {
            let proj = buf(&act.proj);
            head_norm(dev, proj, 0, width, qw, buf_mut(&mut act.qn), nh, hd, rows, c.rms_norm_eps, c.zero_centered_norm)?;
            head_norm(dev, proj, k_off, width, kw, buf_mut(&mut act.kn), nkv, hd, rows, c.rms_norm_eps, c.zero_centered_norm)?;
            let (qn, kn) = (buf_mut(&mut act.qn), buf_mut(&mut act.kn));
            if decode {
                let v = buf(&act.proj).slice(v_off..);
                dev.rope_kv_write(qn, kn, &v, kc, vc, &positions, &self.meta.slot_mapping(), self.inv_freq, &rope(qd, kvd))?;
            } else {
                dev.rope_neox(qn, kn, &positions, self.inv_freq, nh, nkv, hd, qd, kvd, self.rope_scale)?;
            }
            (q_src, q_stride, k_rows, k_stride) = (buf(&act.qn).as_view(), qd, buf(&act.kn).as_view(), kvd);
        } else {
            let proj = buf_mut(&mut act.proj);
            if fused_rope {
                // gemv_qkv_rope_kv_write rotated q and k and wrote the cache.
            } else if decode {
                dev.rope_kv_write_packed(proj, k_off, v_off, kc, vc, &positions, &self.meta.slot_mapping(), self.inv_freq, &rope(width, width))?;
            } else if k_off == qd {
                // Keys follow the queries in each row: one launch rotates both as q heads.
                dev.rope_neox(proj, dummy, &positions, self.inv_freq, nh + nkv, 0, hd, width, 0, self.rope_scale)?;
            } else {
                dev.rope_neox(proj, dummy, &positions, self.inv_freq, nh, 0, hd, width, 0, self.rope_scale)?;
                dev.rope_neox(&mut proj.slice_mut(k_off..), dummy, &positions, self.inv_freq, nkv, 0, hd, width, 0, self.rope_scale)?;
            }
            (q_src, q_stride, k_rows, k_stride) = (buf(&act.proj).as_view(), width, buf(&act.proj).slice(k_off..), width);
        }
        if !decode {
            let v_rows = buf(&act.proj).slice(v_off..);
            dev.kv_cache_write(&k_rows, &v_rows, kc, vc, &self.meta.slot_mapping(), kvd, k_stride, width)?;
        }
        let shape = PagedAttentionShape {
            n_q_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            q_stride,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_blocks_per_seq: self.meta.max_blocks_per_seq(),
            scale: 1.0 / (hd as f32).sqrt(),
            max_context: self.meta.max_context(),
            partition: 0,
        };
        let mut mix = buf_mut(&mut act.mix).slice_mut(0..rows * qd);
        let (tables, token_seq) = (self.meta.block_tables(), self.meta.token_seq());
        match self.decode {
            Some(scratch) => dev.paged_attention_decode(&q_src, kc, vc, &tables, &token_seq, &positions, &mut mix, &shape, scratch)?,
            None if self.max_rows > 1 && q_stride % 8 == 0 => {
                dev.flash_attention(&q_src, kc, vc, &tables, &token_seq, &positions, &self.meta.cu_seqlens(), &mut mix, &shape, self.max_rows)?
            }
            None => dev.paged_attention(&q_src, kc, vc, &tables, &token_seq, &positions, &mut mix, &shape)?,
        }
        if c.attn_output_gate {
            let gate = buf(&act.proj).slice(qd..);
            dev.sigmoid_gate_mul(&mut mix, &gate, rows, qd, width)?;
        }
        act.project_out(dev, &a.o, ProjIn::Mix, rows, then)
    }
}

/// Per-head RMSNorm of `heads` heads starting at column `offset` of `src` rows (stride
/// `width`) into contiguous `[rows, heads * hd]`, one launch for all rows and heads.
#[allow(clippy::too_many_arguments)]
fn head_norm(dev: &CudaDevice, src: &CudaSlice<u16>, offset: usize, width: usize, w: &CudaSlice<u16>, out: &mut CudaSlice<u16>, heads: usize, hd: usize, rows: usize, eps: f32, plus_one: bool) -> Result<()> {
    dev.rmsnorm_heads(&src.slice(offset..), w, out, rows, heads, hd, width, heads * hd, eps, plus_one)
}

/// The residual add + RMSNorm that follows a sub-block's output projection.
struct NormNext<'a> {
    /// The norm's weight: the post-attention norm, the next layer's input norm or the final
    /// norm. None leaves the projection in `act.tmp` (the last layer of a prefill step).
    w: Option<&'a CudaSlice<u16>>,
    eps: f32,
    plus_one: bool,
}

/// The activation buffer a sub-block's output projection reads.
#[derive(Clone, Copy)]
enum ProjIn {
    /// The mixer output (attention, GDN).
    Mix,
    /// The MLP activation.
    Act,
}

impl Activations {
    /// A sub-block's output projection of `input` for `rows` rows, then `then`: residual
    /// `x` += projection and `h` = rmsnorm(x) (`linear` into `tmp`, then `add_rmsnorm`); with no
    /// norm, the projection is left in `tmp`.
    fn project_out(&mut self, dev: &CudaDevice, l: &DevLinear, input: ProjIn, rows: usize, then: &NormNext) -> Result<()> {
        let Activations { x, h, tmp, mix, act, lin32, .. } = self;
        let src = buf(match input {
            ProjIn::Mix => mix,
            ProjIn::Act => act,
        });
        match then.w {
            None => linear(dev, l, src, buf_mut(tmp), lin32, rows),
            Some(w) => {
                linear(dev, l, src, buf_mut(tmp), lin32, rows)?;
                dev.add_rmsnorm(buf_mut(x), buf(tmp), w, buf_mut(h), rows, l.n, then.eps, then.plus_one)
            }
        }
    }
}

/// `y = x · Wᵀ (+ bias)` for `rows` rows (GEMV up to 8 rows, cuBLAS above); a bias is added
/// to the f32 sums in `lin32` and rounded once (`CudaDevice::linear_bias`).
fn linear(dev: &CudaDevice, l: &DevLinear, x: &CudaSlice<u16>, y: &mut CudaSlice<u16>, lin32: &mut Option<CudaSlice<f32>>, rows: usize) -> Result<()> {
    match &l.bias {
        None => dev.linear(x, &l.w, y, rows, l.n, l.k),
        Some(b) => dev.linear_bias(x, &l.w, b, buf_mut(lin32), y, rows, l.n, l.k),
    }
}

/// Columns of `Activations::lin32` a row: the widest projection with a bias (`attn_width`: the
/// packed q | k | v row), 1 for models without biases (the buffer is then never read).
fn biased_width(c: &ModelConfig, attn_width: usize) -> usize {
    let qkv = if c.qkv_bias { attn_width } else { 0 };
    let o = if c.o_bias { c.hidden_size } else { 0 };
    let mlp = if c.mlp_bias { (2 * c.intermediate_size).max(c.hidden_size) } else { 0 };
    qkv.max(o).max(mlp).max(1)
}

/// Tokens per chunk of the chunked GDN kernel; shorter steps stay on the recurrent kernel.
const GDN_CHUNK: usize = 64;

/// Gated DeltaNet sub-block over all sequences of the step at once: reads `act.h`, projects it
/// (q, k, v, z, b, a in one GEMM / GEMV into `act.proj`), ends with `Activations::project_out`. Steps with a sequence chunk of at least GDN_CHUNK
/// tokens run gdn_gates, the chunked kernel for all their sequences (it is exact for short ones
/// too) and rmsnorm_gated; others (decode, short chunks, and every step on a device without the
/// chunked kernel) run `gdn_recurrent_gated`, which
/// computes the gates, the recurrent rule and the gated norm in one kernel, the three-kernel
/// recurrent path's bits (value head dims above GATED_MAX_DV keep that path).
#[allow(clippy::too_many_arguments)]
fn gdn_layer(cfg: &ModelConfig, dev: &CudaDevice, meta: &StepMeta, g: &super::cuda_weights::DevGdn, conv: &mut CudaSlice<u16>, delta: &mut CudaSlice<f32>, n_slots: usize, act: &mut Activations, rows: usize, max_rows: usize, then: &NormNext) -> Result<()> {
    let la = cfg.linear_attention.expect("GDN layer without linear_attention config");
    let (cd, kd, vd, nv) = (la.conv_dim(), la.key_dim(), la.value_dim(), la.num_value_heads);
    // One projection: row t of act.proj is q | k | v (conv channels), z, b, a (DevGdn::in_proj).
    let width = g.in_proj.n;
    linear(dev, &g.in_proj, buf(&act.h), buf_mut(&mut act.proj), &mut act.lin32, rows)?;
    let proj = buf(&act.proj);
    let cu = meta.cu_seqlens();
    let slots = meta.slots();
    let conv_shape = ConvShape { n_tokens: rows, channels: cd, x_stride: width, kernel_size: la.conv_kernel, n_slots };
    let bias = g.conv_b.as_ref().map(|b| b as &dyn crate::backend::cuda::ops::DevicePtrDyn);
    dev.causal_conv1d(proj, conv, &g.conv_w, bias, &cu, &slots, buf_mut(&mut act.conv_out), &conv_shape)?;
    let (z, b, a) = (proj.slice(cd..), proj.slice(cd + vd..), proj.slice(cd + vd + nv..));
    let co = buf(&act.conv_out);
    let shape = RecurrentShape {
        n_tokens: rows,
        n_k_heads: la.num_key_heads,
        n_v_heads: nv,
        dk: la.key_head_dim,
        dv: la.value_head_dim,
        qk_stride: cd,
        v_stride: cd,
        n_slots,
    };
    let (q, k, v) = (co.slice(0..), co.slice(kd..), co.slice(2 * kd..));
    // The recurrent rule runs when no chunk reaches GDN_CHUNK tokens, or where the chunked
    // kernel does not fit the device (`gdn_chunked` would fall back to it).
    let recurrent = max_rows < GDN_CHUNK || !dev.has_gdn_chunked(la.key_head_dim);
    if recurrent && la.value_head_dim <= GATED_MAX_DV {
        dev.gdn_recurrent_gated(&q, &k, &v, &a, &b, width, &g.a_log, &g.dt_bias, delta, &cu, &slots, &z, width, &g.norm, cfg.rms_norm_eps, buf_mut(&mut act.mix), &shape)?;
    } else {
        dev.gdn_gates(&a, &b, width, &g.a_log, &g.dt_bias, buf_mut(&mut act.g), buf_mut(&mut act.beta), rows, nv)?;
        if max_rows >= GDN_CHUNK {
            dev.gdn_chunked(&q, &k, &v, buf(&act.g), buf(&act.beta), delta, &cu, &slots, buf_mut(&mut act.core), buf_mut(&mut act.gdn_work), &shape)?;
        } else {
            dev.gdn_recurrent(&q, &k, &v, buf(&act.g), buf(&act.beta), delta, &cu, &slots, buf_mut(&mut act.core), &shape)?;
        }
        dev.rmsnorm_gated(buf(&act.core), &z, width, &g.norm, buf_mut(&mut act.mix), rows, nv, la.value_head_dim, cfg.rms_norm_eps)?;
    }
    act.project_out(dev, &g.out, ProjIn::Mix, rows, then)
}

/// SwiGLU MLP sub-block: reads `act.h`, ends with `Activations::project_out`. Decode-sized steps (the GEMV's rows,
/// up to GEMV_ROUTE_MAX_M) compute the activation in the gate_up GEMV's epilogue
/// (`gemv_gateup_swiglu`: bit for bit the GEMV followed by swiglu, one kernel and the
/// [rows, 2 * inter] round trip less, the weight stream untouched); larger steps run cuBLAS,
/// swiglu and cuBLAS. The loader packs every model's gate_up weight as gate rows then up rows,
/// the layout the kernel pairs.
fn mlp(dev: &CudaDevice, layer: &DevLayer, act: &mut Activations, rows: usize, then: &NormNext) -> Result<()> {
    let inter = layer.gate_up.n / 2;
    if rows <= GEMV_ROUTE_MAX_M && layer.gate_up.k.is_multiple_of(8) && layer.gate_up.bias.is_none() {
        dev.gemv_gateup_swiglu(buf(&act.h), &layer.gate_up.w, buf_mut(&mut act.act), rows, inter, layer.gate_up.k)?;
    } else {
        linear(dev, &layer.gate_up, buf(&act.h), buf_mut(&mut act.gate_up), &mut act.lin32, rows)?;
        let gu = buf(&act.gate_up);
        dev.swiglu(&gu.slice(0..), &gu.slice(inter..), buf_mut(&mut act.act), rows, inter, 2 * inter, 2 * inter)?;
    }
    act.project_out(dev, &layer.down, ProjIn::Act, rows, then)
}

impl CudaModel {
    /// Grows the buffers a step of `rows` sequences wanting logits needs besides the
    /// activations and logits (the decode attention's split-K scratch, the device sampler's
    /// buffers) now: they then count in the memory plan and the startup ledger, and a running
    /// server does not allocate them as its concurrency climbs, nor drop every captured decode
    /// graph each time the attention scratch grows (it did at 16, 32 and 64 sequences).
    fn reserve_decode(&mut self, rows: usize) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        self.ensure_scratch(rows)?;
        if self.sampler.enabled() {
            self.sampler.reserve(&self.dev, rows, self.cfg.vocab_size)?;
        }
        Ok(())
    }

    /// Runs each cuBLAS GEMM shape of the model (every projection's [n, k], the lm_head with
    /// f32 output) once at every row bucket of `padded_rows` the step buffers hold, on whatever
    /// they contain (nothing reads the results), so that cuBLAS meets its kernels now and not
    /// inside a request (backend/cuda/blas.rs: ~4 ms a kernel it has not run yet, on Hopper).
    /// The MLP's buffers serve every shape: `gate_up` has the widest rows of the step buffers
    /// and `act` the next; a shape they do not hold (none of the supported models') is left out.
    fn warm_gemm_kernels(&mut self) -> Result<()> {
        let CudaModel { cfg, dev, weights, act, .. } = self;
        let mut shapes: Vec<&DevLinear> = Vec::new();
        for l in &weights.layers {
            match &l.mixer {
                DevMixer::Attention(a) => shapes.extend([&a.qkv, &a.o]),
                DevMixer::Gdn(g) => shapes.extend([&g.in_proj, &g.out]),
            }
            shapes.extend([&l.gate_up, &l.down]);
        }
        // A projection with a bias runs cuBLAS with f32 output (`linear_bias`): another kernel.
        shapes.sort_by_key(|l| (l.n, l.k, l.bias.is_some()));
        shapes.dedup_by_key(|l| (l.n, l.k, l.bias.is_some()));
        let Activations { act: x, gate_up: y, logits, lin32, rows, .. } = act;
        let (Some(x), Some(y), Some(y32)) = (x.as_ref(), y.as_mut(), lin32.as_mut()) else {
            return Ok(());
        };
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        for m in padded_row_buckets(*rows) {
            for l in &shapes {
                if x.len() < m * l.k {
                    continue;
                }
                if l.bias.is_some() && y32.len() >= m * l.n {
                    dev.gemm_f32_out(x, &l.w, y32, m, l.n, l.k)?;
                } else if l.bias.is_none() && y.len() >= m * l.n {
                    dev.gemm(x, &l.w, y, m, l.n, l.k)?;
                }
            }
            if let Some(out) = logits.as_mut().filter(|o| o.len() >= m * vocab && x.len() >= m * h) {
                dev.gemm_f32_out(x, weights.lm_head(), out, m, vocab, h)?;
            }
        }
        Ok(())
    }
}

impl ModelRunner for CudaModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_spec(&self) -> CacheSpec {
        let c = &self.cfg;
        let kv = c.num_attention_layers() * 2 * c.num_kv_heads * c.head_dim * 2;
        // Conv state in the storage type (2 bytes), delta state in f32.
        let state = c.linear_attention.map_or(0, |la| (la.conv_floats() * 2 + la.delta_floats() * 4) * c.num_linear_layers());
        CacheSpec { kv_bytes_per_token: kv, state_bytes_per_slot: state, weight_bytes: self.weights.bytes }
    }

    fn allocate_caches(&mut self, num_blocks: usize, block_size: usize, num_state_slots: usize) -> Result<()> {
        if block_size == 0 {
            return Err(NinferError::config("block_size", "must be positive"));
        }
        self.caches = DevCaches::default();
        self.graphs.clear();
        let c = &self.cfg;
        let spec = self.cache_spec();
        // The state buffers hold one spare slot past the running ones (decode padding rows).
        let needed = (num_blocks * block_size * spec.kv_bytes_per_token + (num_state_slots + 1) * spec.state_bytes_per_slot) as u64;
        let (free, _) = self.dev.memory_info()?;
        if needed > free as u64 {
            return Err(NinferError::OutOfMemory {
                what: format!("KV cache ({} tokens) and {num_state_slots} state slots on cuda:{}", num_blocks * block_size, self.dev.ordinal()),
                needed,
                available: free as u64,
                hint: crate::engine::cache_fit_hint(free as u64, &spec, num_state_slots + 1, block_size),
            });
        }
        let mut caches = DevCaches { block_size, num_blocks, num_slots: num_state_slots, ..Default::default() };
        let kv_elems = num_blocks * block_size * c.num_kv_heads * c.head_dim;
        for _ in 0..c.num_attention_layers() {
            caches.k.push(alloc(&self.dev, kv_elems, "KV cache")?);
            caches.v.push(alloc(&self.dev, kv_elems, "KV cache")?);
        }
        if let Some(la) = c.linear_attention {
            for _ in 0..c.num_linear_layers() {
                let slots = num_state_slots + 1;
                caches.conv.push(alloc(&self.dev, slots * la.conv_floats(), "recurrent state")?);
                caches.delta.push(alloc(&self.dev, slots * la.delta_floats(), "recurrent state")?);
            }
        }
        self.caches = caches;
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        self.step(batch)
    }

    fn warm_up_kernels(&mut self) -> Result<()> {
        self.warm_gemm_kernels()
    }

    fn workspace_bytes(&self) -> usize {
        let scratch = self.scratch.as_ref().map_or(0, |s| s.acc.len() * 4 + s.ml.len() * 4);
        self.act.bytes() + self.meta.bytes() + self.dmeta.bytes() + scratch + self.sampler.bytes()
    }

    fn device_free_bytes(&self) -> Option<u64> {
        self.dev.memory_info().ok().map(|(free, _)| free as u64)
    }

    fn cache_budget_bytes(&mut self, step_rows: usize, decode_rows: usize) -> Result<Option<u64>> {
        self.ensure_rows(step_rows.max(decode_bucket(decode_rows)))?;
        self.ensure_logit_rows(decode_bucket(decode_rows))?;
        self.reserve_decode(decode_bucket(decode_rows))?;
        let (free, total) = self.dev.memory_info()?;
        Ok(Some(cache_budget(free as u64, total as u64)))
    }

    fn forward_sampled(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> Result<Vec<SampledToken>> {
        if !self.sampler.enabled() {
            return self.step(batch)?.sample_on_host(rows);
        }
        let counts = self.run(batch)?;
        self.sampler.sample(&self.dev, buf(&self.act.logits), &counts, rows, self.cfg.vocab_size)
    }

    /// Steps overlap when they sample on the device (the host sampler needs the logits first).
    fn overlaps_steps(&self) -> bool {
        self.sampler.enabled()
    }

    /// The forward only (a CUDA graph for a decode step): the sampling, queued behind it by
    /// `launch_sampling`, is never part of a captured graph.
    fn launch_forward(&mut self, batch: &StepBatch, feed: bool) -> Result<()> {
        if !self.sampler.enabled() {
            return Err(NinferError::invalid("launch_forward", "steps sample on the host (device_sampling off), which needs each step's logits first"));
        }
        self.forwarded = None;
        let counts = self.run_fed(batch, feed).inspect_err(|_| self.sampler.reset())?;
        self.forwarded = Some((counts, feed));
        Ok(())
    }

    fn launch_sampling(&mut self, rows: &[RowSampling]) -> Result<()> {
        let (counts, feed) = self.forwarded.take().ok_or_else(|| NinferError::invalid("launch_sampling", "no forward pass was queued to sample (launch_forward)"))?;
        // A fed step's rows with penalties count its input token, which the device ids hold
        // (feed_sampled_tokens wrote them; row i is sequence i). Nothing queued since the
        // forward rewrote them: the next step's metadata is uploaded after this.
        let fed = feed.then(|| self.dmeta.ids());
        self.sampler.launch(&self.dev, buf(&self.act.logits), &counts, rows, self.cfg.vocab_size, fed.as_ref()).inspect_err(|_| self.sampler.reset())
    }

    fn collect_sampled(&mut self) -> Result<Vec<SampledToken>> {
        self.sampler.collect().inspect_err(|_| self.sampler.reset())
    }

    fn decode_graphs(&self) -> usize {
        self.graphs.len()
    }

    fn copy_state(&mut self, src: usize, dst: usize) -> Result<()> {
        let slots = self.caches.num_slots;
        if src >= slots || dst >= slots {
            return Err(NinferError::invalid("state_slot", format!("copy {src} -> {dst} outside {slots} slots")));
        }
        if src == dst {
            return Ok(());
        }
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let s = self.dev.stream().clone();
        // Buffers hold one more slot than the engine's (the decode padding slot).
        for buf in &mut self.caches.conv {
            copy_slot(&s, buf, slots + 1, src, dst)?;
        }
        for buf in &mut self.caches.delta {
            copy_slot(&s, buf, slots + 1, src, dst)?;
        }
        Ok(())
    }
}

/// What the default KV pool and state slots may take of `free` device bytes (step buffers
/// already allocated): all but a reserve of 5% of the device, at least 1 GiB, for what is
/// allocated later (decode graphs and their scratch, the warm-up step's leftovers, the CUDA
/// context's own growth, other processes' drift).
fn cache_budget(free: u64, total: u64) -> u64 {
    free.saturating_sub((total / 20).max(1 << 30))
}

/// A step the decode graphs serve: every sequence runs one token and wants its logits.
fn is_decode(batch: &StepBatch) -> bool {
    !batch.seqs.is_empty() && batch.seqs.iter().all(|q| q.tokens.len() == 1 && q.logits == LogitsWanted::Last)
}

/// Device-to-device copy of slot `src` of `buf` (equal-sized slots) onto slot `dst`.
fn copy_slot<T: DeviceRepr>(s: &Arc<cudarc::driver::CudaStream>, buf: &mut CudaSlice<T>, slots: usize, src: usize, dst: usize) -> Result<()> {
    let per = buf.len() / slots;
    let (lo, mut hi) = buf.split_at_mut(src.max(dst) * per);
    let r = if src < dst {
        let from = lo.slice(src * per..(src + 1) * per);
        let mut to = hi.slice_mut(0..per);
        s.memcpy_dtod(&from, &mut to)
    } else {
        let mut lo = lo;
        let from = hi.slice(0..per);
        let mut to = lo.slice_mut(dst * per..(dst + 1) * per);
        s.memcpy_dtod(&from, &mut to)
    };
    r.map_err(driver_err("copying a state slot"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(arch: &str, extra: serde_json::Value) -> ModelConfig {
        let mut v = serde_json::json!({"architectures": [arch], "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        ModelConfig::from_json_str(&v.to_string(), std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn projection_biases_load_on_the_gpu_except_beside_a_gated_query() {
        CudaModel::check_supported(&config("Qwen2ForCausalLM", serde_json::json!({}))).unwrap();
        CudaModel::check_supported(&config("LlamaForCausalLM", serde_json::json!({"attention_bias": true, "mlp_bias": true}))).unwrap();
        let mut gated = config("Qwen2ForCausalLM", serde_json::json!({}));
        gated.attn_output_gate = true;
        let err = CudaModel::check_supported(&gated).unwrap_err().to_string();
        assert!(err.contains("q/k/v projection biases with a gated query"), "{err}");
    }
}
