//! artifact (filled in by its owner).
