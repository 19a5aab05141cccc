//! CUDA graphs of decode steps and of uniform speculative verify steps: one graph per
//! (batch-size bucket, block-table stride, tokens a sequence), captured the first time a step
//! of that shape runs and replayed afterwards, so that a step costs one graph launch instead of
//! hundreds of kernel launches from the host (each of which is expensive under gVisor).
//!
//! A graph replays fixed kernel arguments over fixed addresses, so everything a graphed step's
//! kernels touch lives in buffers that do not move (activations, step metadata, attention
//! scratch, logits) and no argument depends on the step's contexts (attention derives each
//! token's context from its uploaded position; `paged_attention_decode`, `flash_attention`).
//! When one of those buffers grows or the caches are reallocated the graphs are dropped and
//! recaptured lazily. With `cuda_graphs` off (`CudaOptions`) the same steps run eagerly with the
//! same kernels (same results, bit for bit).

use std::collections::HashMap;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::CudaDevice;
use crate::{NinferError, Result};

/// Batch size a decode step of `n` sequences is padded to: 1, 2, 4, 8, 16, 24, 32, 48, 64,
/// then multiples of 32. Few enough shapes that capturing each once is cheap, close enough
/// that padding wastes little.
pub fn decode_bucket(n: usize) -> usize {
    const SMALL: [usize; 9] = [1, 2, 4, 8, 16, 24, 32, 48, 64];
    SMALL.iter().copied().find(|&b| b >= n).unwrap_or_else(|| n.div_ceil(32) * 32)
}

/// Block-table columns of a decode step whose longest table needs `blocks`: the next power of
/// two, at least 16, so that a step's tables upload in little more than they need while a
/// growing context changes the graph only at each doubling.
pub fn table_stride(blocks: usize) -> usize {
    blocks.next_power_of_two().max(16)
}

/// Most tokens a sequence of a graphed verify step brings (K + 1 for the largest `--draft-tokens`,
/// `spec::MAX_DRAFT_TOKENS`): a bound on the verify graphs a model captures.
pub const VERIFY_MAX_ROWS: usize = crate::spec::MAX_DRAFT_TOKENS + 1;

/// What a graph is captured for: the step's shape, on which every launch and address in it
/// depends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Sequences the step is padded to (`decode_bucket`).
    pub seqs: usize,
    /// Block-table columns (`table_stride`).
    pub stride: usize,
    /// Tokens each sequence brings: 1 for a decode step, K + 1 for a verify step.
    pub rows_per_seq: usize,
}

impl GraphKey {
    /// The graph of a step of `n` sequences of `rows_per_seq` tokens each whose longest block
    /// table needs `blocks` blocks.
    pub fn of(n: usize, rows_per_seq: usize, blocks: usize) -> Self {
        GraphKey { seqs: decode_bucket(n), stride: table_stride(blocks), rows_per_seq }
    }

    /// Rows the step runs (padding included).
    pub fn rows(&self) -> usize {
        self.seqs * self.rows_per_seq
    }

    fn is_verify(&self) -> bool {
        self.rows_per_seq > 1
    }
}

/// A captured graph. `CudaGraph` holds raw driver handles and is not `Send`; the graphs are
/// owned by one `CudaModel` and only used through `&mut` of it, one thread at a time.
struct OwnedGraph(CudaGraph);

// SAFETY: the graph is only launched or dropped through `&mut StepGraphs`, never from two
// threads at once (the requirement of the CUDA graph API), and its context is bound first.
unsafe impl Send for OwnedGraph {}

/// The step graphs of one model, by `GraphKey`.
#[derive(Default)]
pub struct StepGraphs {
    enabled: bool,
    /// Verify steps run as graphs (turned off alone when capturing one fails).
    verify: bool,
    graphs: HashMap<GraphKey, OwnedGraph>,
}

impl StepGraphs {
    /// Step graphs, captured and replayed when `enabled` (the plan's `cuda_graphs`).
    pub fn new(enabled: bool) -> Self {
        StepGraphs { enabled, verify: enabled, graphs: HashMap::new() }
    }

    /// Whether decode steps run as graphs.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether steps of `key`'s kind (decode or verify) run as graphs.
    pub fn enabled_for(&self, key: GraphKey) -> bool {
        self.enabled && (!key.is_verify() || self.verify)
    }

    /// Turns graphs of `key`'s kind off for good (capturing it failed) and drops those
    /// captured: a decode failure ends every graph, a verify failure only the verify graphs.
    pub fn disable_for(&mut self, key: GraphKey) {
        if key.is_verify() {
            self.verify = false;
            self.graphs.retain(|k, _| !k.is_verify());
        } else {
            self.enabled = false;
            self.verify = false;
            self.graphs.clear();
        }
    }

    /// Drops every graph (their buffers moved).
    pub fn clear(&mut self) {
        self.graphs.clear();
    }

    /// Graphs captured so far.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Whether the graph for `key` exists.
    pub fn has(&self, key: GraphKey) -> bool {
        self.graphs.contains_key(&key)
    }

    /// Captures what `queue` puts on the device's stream (nothing runs) as the graph for `key`.
    /// cuBLAS is created first: its handle and workspace must not be allocated under capture.
    pub fn capture(&mut self, dev: &CudaDevice, key: GraphKey, queue: impl FnOnce() -> Result<()>) -> Result<()> {
        dev.blas()?;
        let s = dev.stream();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(driver_err("beginning graph capture"))?;
        let queued = queue();
        // End the capture whatever happened, so that the stream is usable again.
        let ended = s.end_capture(CUgraphInstantiate_flags(0));
        queued?;
        let graph = ended
            .map_err(driver_err("capturing a step graph"))?
            .ok_or_else(|| NinferError::Device(format!("capturing the step of {key:?} produced no graph")))?;
        graph.upload().map_err(driver_err("uploading a step graph"))?;
        self.graphs.insert(key, OwnedGraph(graph));
        Ok(())
    }

    /// Queues a replay of the graph for `key` (captured before).
    pub fn launch(&self, key: GraphKey) -> Result<()> {
        let g = self.graphs.get(&key).ok_or_else(|| NinferError::Device(format!("no step graph for {key:?}")))?;
        g.0.launch().map_err(driver_err("launching a step graph"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_batch_with_the_listed_sizes() {
        let want = [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24), (25, 32), (33, 48), (49, 64), (65, 96), (96, 96), (97, 128), (300, 320)];
        for (n, b) in want {
            assert_eq!(decode_bucket(n), b, "bucket of {n}");
        }
        assert_eq!(table_stride(1), 16);
        assert_eq!(table_stride(17), 32);
        assert_eq!(table_stride(64), 64);
    }

    #[test]
    fn a_verify_graph_is_keyed_by_its_padded_sequences_stride_and_tokens_a_sequence() {
        // 3 sequences verifying K = 5 drafts, the longest table 20 blocks: 4 sequences of 6 rows.
        let key = GraphKey::of(3, 6, 20);
        assert_eq!(key, GraphKey { seqs: 4, stride: 32, rows_per_seq: 6 });
        assert_eq!(key.rows(), 24);
        // Each K has its own graph; a decode step of the same batch is another.
        assert_ne!(GraphKey::of(3, 4, 20), key);
        assert_eq!(GraphKey::of(3, 1, 20), GraphKey { seqs: 4, stride: 32, rows_per_seq: 1 });
        assert!(key.is_verify() && !GraphKey::of(3, 1, 20).is_verify());
        assert_eq!(VERIFY_MAX_ROWS, 9);
    }

    #[test]
    fn a_failed_verify_capture_leaves_decode_graphs_on_and_a_failed_decode_capture_ends_both() {
        let (decode, verify) = (GraphKey::of(2, 1, 1), GraphKey::of(2, 4, 1));
        let mut g = StepGraphs::new(true);
        assert!(g.enabled_for(decode) && g.enabled_for(verify));
        g.disable_for(verify);
        assert!(g.enabled_for(decode) && !g.enabled_for(verify) && g.enabled());
        let mut g = StepGraphs::new(true);
        g.disable_for(decode);
        assert!(!g.enabled_for(decode) && !g.enabled_for(verify));
        let off = StepGraphs::new(false);
        assert!(!off.enabled_for(decode) && !off.enabled_for(verify));
    }
}
