//! The HF `tokenizer.json` tokenizer, loaded through the `tokenizers` crate.

use std::path::{Path, PathBuf};

use crate::{NinferError, Result};

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Load `tokenizer.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(NinferError::MissingFile { path, what: "the HF tokenizer (tokenizer.json)".into() });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| NinferError::malformed(&path, e.to_string()))?;
        Ok(Tokenizer { inner, path })
    }

    /// Text to token ids.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| NinferError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| NinferError::Tokenizer(e.to_string()))
    }

    /// Id of a token string (special tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Size of the vocabulary including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The wrapped tokenizer, for the detokenizer and template helpers.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
