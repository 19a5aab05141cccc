//! The device buffers a `CudaModel` step runs in: the KV pool and recurrent-state slots
//! (`DevCaches`), the activations (`Activations`), the logits and the decode attention's
//! scratch, each grown (never shrunk) when a larger step arrives.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use crate::backend::cuda::ops::{decode_scratch_len, AttnScratch, PagedAttentionShape, RecurrentShape};
use crate::backend::cuda::CudaDevice;
use crate::config::ModelConfig;
use crate::{NinferError, Result};

use super::CudaModel;

/// KV pool and recurrent-state slots on the device, per layer.
#[derive(Default)]
pub(super) struct DevCaches {
    pub(super) block_size: usize,
    pub(super) num_blocks: usize,
    /// State slots the engine hands out; one more is allocated, `num_slots` itself, for the
    /// padding rows of decode graphs (no sequence owns it, so their writes harm nothing).
    pub(super) num_slots: usize,
    /// Per attention layer, `[num_blocks, block_size, n_kv_heads, head_dim]` in storage type.
    pub(super) k: Vec<CudaSlice<u16>>,
    pub(super) v: Vec<CudaSlice<u16>>,
    /// Per GDN layer, `[slots, conv_dim, kernel - 1]` in storage type.
    pub(super) conv: Vec<CudaSlice<u16>>,
    /// Per GDN layer, f32 `[slots, n_v_heads, dk, dv]`.
    pub(super) delta: Vec<CudaSlice<f32>>,
}

/// Activation buffers for steps of up to `rows` tokens; grown (never shrunk) when a larger
/// step arrives, so that steady-state steps allocate nothing.
#[derive(Default)]
pub(super) struct Activations {
    pub(super) rows: usize,
    /// Residual stream `[rows, hidden]`.
    pub(super) x: Option<CudaSlice<u16>>,
    /// Normed input of the current sub-block.
    pub(super) h: Option<CudaSlice<u16>>,
    /// Sub-block output added to the residual.
    pub(super) tmp: Option<CudaSlice<u16>>,
    /// Attention qkv projection, or the GDN input projection (conv input, z, b, a per row).
    pub(super) proj: Option<CudaSlice<u16>>,
    /// Normed (then rotated) queries and keys for models with q/k norm.
    pub(super) qn: Option<CudaSlice<u16>>,
    pub(super) kn: Option<CudaSlice<u16>>,
    /// Mixer output before its output projection.
    pub(super) mix: Option<CudaSlice<u16>>,
    pub(super) gate_up: Option<CudaSlice<u16>>,
    pub(super) act: Option<CudaSlice<u16>>,
    /// GDN: conv output, gates, core output.
    pub(super) conv_out: Option<CudaSlice<u16>>,
    pub(super) g: Option<CudaSlice<f32>>,
    pub(super) beta: Option<CudaSlice<f32>>,
    pub(super) core: Option<CudaSlice<u16>>,
    /// f32 workspace of the chunked GDN kernels (`RecurrentShape::chunked_workspace_len`); one
    /// element where the model has no GDN layers or the device runs them recurrently.
    pub(super) gdn_work: Option<CudaSlice<f32>>,
    /// Election counters of the one-kernel GDN core (`gdn_conv_recurrent_gated`): one a
    /// (sequence, key head), zero between launches.
    pub(super) gdn_tickets: Option<CudaSlice<u32>>,
    /// Rows that produce logits, gathered.
    pub(super) sel: Option<CudaSlice<u16>>,
    /// f32 logits of the gathered rows: sized by the rows that want logits
    /// (`ensure_logit_rows`), not by the step's tokens, since a prefill step wants one row a
    /// sequence (a vocabulary of 248k at an 8192-token chunk would hold 7.6 GiB here).
    pub(super) logits: Option<CudaSlice<f32>>,
    /// f32 sums of a projection with a bias before the bias is added and the sum rounded
    /// (`CudaDevice::linear_bias`): rows x the widest biased projection, one element in models
    /// without biases.
    pub(super) lin32: Option<CudaSlice<f32>>,
}

impl Activations {
    /// Device bytes of every buffer.
    pub(super) fn bytes(&self) -> usize {
        fn b<T>(x: &Option<CudaSlice<T>>) -> usize {
            x.as_ref().map_or(0, |s| s.len() * std::mem::size_of::<T>())
        }
        let u16s = [&self.x, &self.h, &self.tmp, &self.proj, &self.qn, &self.kn, &self.mix, &self.gate_up, &self.act, &self.conv_out, &self.core, &self.sel];
        u16s.iter().map(|x| b(x)).sum::<usize>() + b(&self.g) + b(&self.beta) + b(&self.gdn_work) + b(&self.gdn_tickets) + b(&self.logits) + b(&self.lin32)
    }
}

pub(super) fn alloc<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, n: usize, what: &str) -> Result<CudaSlice<T>> {
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
pub(super) fn buf<T>(b: &Option<CudaSlice<T>>) -> &CudaSlice<T> {
    b.as_ref().expect("activation buffer allocated by ensure_rows")
}

pub(super) fn buf_mut<T>(b: &mut Option<CudaSlice<T>>) -> &mut CudaSlice<T> {
    b.as_mut().expect("activation buffer allocated by ensure_rows")
}

impl CudaModel {
    /// Grow the activation buffers to hold `rows` tokens (with headroom, so that a run of
    /// growing steps allocates a few times, not every step).
    pub(super) fn ensure_rows(&mut self, rows: usize) -> Result<()> {
        if rows <= self.act.rows {
            return Ok(());
        }
        let rows = rows.next_power_of_two().max(8);
        let c = &self.cfg;
        let dev = &self.dev;
        let (h, qd, kvd) = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let attn_width = qd * if c.attn_output_gate { 2 } else { 1 } + 2 * kvd;
        let (cd, vd, nv, nk) = c.linear_attention.map_or((0, 0, 0, 0), |la| (la.conv_dim(), la.value_dim(), la.num_value_heads, la.num_key_heads));
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
            // alloc zeroes: the counters must start at 0.
            gdn_tickets: Some(alloc(dev, rows * nk, "activations")?),
            sel: Some(alloc(dev, rows * h, "activations")?),
            lin32: Some(alloc(dev, rows * biased_width(c, attn_width), "activations")?),
            logits,
        };
        self.act = a;
        if let Some(d) = self.dflash.as_mut() {
            d.ensure_features(&self.dev, rows)?;
        }
        Ok(())
    }

    /// Grow the logits buffer to hold `rows` rows of the vocabulary (the rows of a step that
    /// want logits; grown, never shrunk). Called before a step's first kernel, so that a
    /// device too small for a scoring request's rows fails before the step writes any cache.
    /// Growth voids the decode graphs, which write the old buffer. A step with no such row still
    /// allocates it once: the samplers take the buffer whatever the row count.
    pub(super) fn ensure_logit_rows(&mut self, rows: usize) -> Result<()> {
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
    pub(super) fn ensure_scratch(&mut self, rows: usize) -> Result<()> {
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
    pub(super) fn attn_shape(&self, max_blocks_per_seq: usize, max_context: usize) -> PagedAttentionShape {
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
}

/// Columns of `Activations::lin32` a row: the widest projection with a bias (`attn_width`: the
/// packed q | k | v row), 1 for models without biases (the buffer is then never read).
fn biased_width(c: &ModelConfig, attn_width: usize) -> usize {
    let qkv = if c.qkv_bias { attn_width } else { 0 };
    let o = if c.o_bias { c.hidden_size } else { 0 };
    let mlp = if c.mlp_bias { (2 * c.intermediate_size).max(c.hidden_size) } else { 0 };
    qkv.max(o).max(mlp).max(1)
}
