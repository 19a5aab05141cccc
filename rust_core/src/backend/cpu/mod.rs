//! CPU backend: f32 reference math, multi-threaded with rayon.

pub mod gdn;
