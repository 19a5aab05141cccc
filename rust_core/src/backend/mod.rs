//! Compute backends. `cpu` is the f32 reference (and the default without a GPU); every GPU op
//! is tested against it.

pub mod cpu;
pub mod cuda;
