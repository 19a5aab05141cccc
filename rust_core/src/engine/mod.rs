//! engine (filled in by its owner).
