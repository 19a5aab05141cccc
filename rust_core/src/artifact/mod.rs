//! Weight files: HF safetensors (single file or sharded) through mmap.

pub mod safetensors;

pub use self::safetensors::{RawTensor, TensorInfo, WeightStore};
