//! kv (filled in by its owner).
