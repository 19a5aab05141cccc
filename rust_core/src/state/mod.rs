//! state (filled in by its owner).
