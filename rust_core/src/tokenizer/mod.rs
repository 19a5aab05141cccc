//! tokenizer (filled in by its owner).
