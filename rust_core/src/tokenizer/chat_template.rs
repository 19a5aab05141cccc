//! Jinja chat templates rendered with minijinja (filled in by the tokenizer owner).
