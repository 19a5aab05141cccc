//! Incremental detokenization (filled in by the engine owner).
