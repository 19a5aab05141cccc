//! The CPU backend: f32 ops over contiguous row-major buffers, multi-threaded with rayon.
//!
//! Ops are plain functions over slices (no tensor type): the model code owns the buffers (a
//! reusable workspace) and calls these in a fixed order. Parallel ops run on whatever rayon
//! pool is current, so the model decides the thread count with `ThreadPool::install`.

pub mod activation;
pub mod attention;
pub mod gdn;
pub mod matmul;
pub mod norm;
pub mod rope;
pub mod simd;

/// A raw pointer that parallel tasks may share when each writes a disjoint part of the buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);

// SAFETY: only used by ops whose tasks write disjoint index ranges of the pointed-to buffer.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}
