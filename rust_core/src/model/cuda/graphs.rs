//! CUDA graphs of decode steps: one graph per (batch-size bucket, block-table stride), captured
//! the first time a decode step of that shape runs and replayed afterwards, so that a decode
//! step costs one graph launch instead of hundreds of kernel launches from the host (each of
//! which is expensive under gVisor).
//!
//! A graph replays fixed kernel arguments over fixed addresses, so everything a decode step's
//! kernels touch lives in buffers that do not move (activations, step metadata, attention
//! scratch, logits) and no argument depends on the step's contexts (attention derives each
//! token's context from its uploaded position; `paged_attention_decode`). When one of those
//! buffers grows or the caches are reallocated the graphs are dropped and recaptured lazily.
//! With `cuda_graphs` off (`CudaOptions`) decode steps run eagerly with the same kernels (same
//! results, bit for bit).

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

/// A captured graph. `CudaGraph` holds raw driver handles and is not `Send`; the graphs are
/// owned by one `CudaModel` and only used through `&mut` of it, one thread at a time.
struct OwnedGraph(CudaGraph);

// SAFETY: the graph is only launched or dropped through `&mut DecodeGraphs`, never from two
// threads at once (the requirement of the CUDA graph API), and its context is bound first.
unsafe impl Send for OwnedGraph {}

/// The decode graphs of one model, by (bucket, table stride).
#[derive(Default)]
pub struct DecodeGraphs {
    enabled: bool,
    graphs: HashMap<(usize, usize), OwnedGraph>,
}

impl DecodeGraphs {
    /// Decode graphs, captured and replayed when `enabled` (the plan's `cuda_graphs`).
    pub fn new(enabled: bool) -> Self {
        DecodeGraphs { enabled, graphs: HashMap::new() }
    }

    /// Whether decode steps run as graphs.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Turns graphs off for good (capture failed) and drops those captured.
    pub fn disable(&mut self) {
        self.enabled = false;
        self.graphs.clear();
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
    pub fn has(&self, key: (usize, usize)) -> bool {
        self.graphs.contains_key(&key)
    }

    /// Captures what `queue` puts on the device's stream (nothing runs) as the graph for `key`.
    /// cuBLAS is created first: its handle and workspace must not be allocated under capture.
    pub fn capture(&mut self, dev: &CudaDevice, key: (usize, usize), queue: impl FnOnce() -> Result<()>) -> Result<()> {
        dev.blas()?;
        let s = dev.stream();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(driver_err("beginning graph capture"))?;
        let queued = queue();
        // End the capture whatever happened, so that the stream is usable again.
        let ended = s.end_capture(CUgraphInstantiate_flags(0));
        queued?;
        let graph = ended
            .map_err(driver_err("capturing a decode step"))?
            .ok_or_else(|| NinferError::Device(format!("capturing the decode step of bucket {key:?} produced no graph")))?;
        graph.upload().map_err(driver_err("uploading a decode graph"))?;
        self.graphs.insert(key, OwnedGraph(graph));
        Ok(())
    }

    /// Queues a replay of the graph for `key` (captured before).
    pub fn launch(&self, key: (usize, usize)) -> Result<()> {
        let g = self.graphs.get(&key).ok_or_else(|| NinferError::Device(format!("no decode graph for {key:?}")))?;
        g.0.launch().map_err(driver_err("launching a decode graph"))
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
}
