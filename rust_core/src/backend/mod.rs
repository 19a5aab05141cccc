//! backend (filled in by its owner).

pub mod cpu;
