//! Tokenization: HF tokenizer.json, chat templates and chat prompts, incremental detokenization,
//! stop strings.

pub mod chat_prompt;
pub mod chat_template;
pub mod detokenizer;
pub mod hf;
pub mod stop;

pub use hf::Tokenizer;
