//! The draft vocabulary of `--lm-head-draft`: the token ids the MTP head drafts over, read from
//! `draft_vocab.json` in the model directory (written by `ninfer draft-vocab MODEL --corpus
//! FILE...`, which counts the ids the model's tokenizer gives the corpus).
//!
//! The file is a JSON object whose `token_ids` lists ids most frequent first; the other fields
//! (`counts`, `corpus`, `corpus_tokens`, `vocab_size`) record how it was made. The engine takes
//! the first N (`--lm-head-draft-size`); a file with fewer gives all it has.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{NinferError, Result};

/// The draft vocabulary's file name in a model directory.
pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.json";

/// N when `--lm-head-draft-size` is not given: the ids that cover almost every token of text in
/// a large vocabulary, at an eighth of a 250k-entry head's cost.
pub const DEFAULT_DRAFT_VOCAB_SIZE: usize = 32768;

#[derive(Deserialize)]
struct DraftVocabFile {
    token_ids: Vec<u32>,
}

/// The file `--lm-head-draft` reads in `model_dir`.
pub fn draft_vocab_path(model_dir: &Path) -> PathBuf {
    model_dir.join(DRAFT_VOCAB_FILE)
}

/// The first `size` ids of `model_dir`'s draft vocabulary, each below `vocab_size` and none
/// twice. A missing file is an error naming it and the command that makes it.
pub fn read(model_dir: &Path, size: usize, vocab_size: usize) -> Result<Vec<u32>> {
    let path = draft_vocab_path(model_dir);
    let flag = "lm_head_draft (--lm-head-draft)";
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(NinferError::config(
                flag,
                format!("no draft vocabulary at {}: make one with `ninfer draft-vocab {} --corpus FILE...`", path.display(), model_dir.display()),
            ))
        }
        Err(e) => return Err(NinferError::config(flag, format!("cannot read {}: {e}", path.display()))),
    };
    let file: DraftVocabFile = serde_json::from_str(&text).map_err(|e| NinferError::config(flag, format!("{} is not a draft vocabulary (a JSON object with token_ids): {e}", path.display())))?;
    let mut ids = file.token_ids;
    ids.truncate(size);
    let mut seen = vec![false; vocab_size];
    for &t in &ids {
        match seen.get_mut(t as usize) {
            None => return Err(NinferError::config(flag, format!("{} lists token id {t}, outside the model's vocabulary of {vocab_size}", path.display()))),
            Some(s) if *s => return Err(NinferError::config(flag, format!("{} lists token id {t} twice", path.display()))),
            Some(s) => *s = true,
        }
    }
    if ids.is_empty() {
        return Err(NinferError::config(flag, format!("{} lists no token ids", path.display())));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory holding `text` as the draft vocabulary (none: no file).
    fn dir_with(text: Option<&str>) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!("ninfer-draft-vocab-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        if let Some(t) = text {
            std::fs::write(d.join(DRAFT_VOCAB_FILE), t).unwrap();
        }
        d
    }

    #[test]
    fn the_first_n_ids_are_taken_and_a_short_file_gives_all() {
        let d = dir_with(Some(r#"{"token_ids": [7, 3, 9, 1], "counts": [40, 30, 2, 1]}"#));
        assert_eq!(read(&d, 2, 10).unwrap(), vec![7, 3]);
        assert_eq!(read(&d, 100, 10).unwrap(), vec![7, 3, 9, 1]);
    }

    #[test]
    fn a_missing_or_bad_file_names_it_and_the_command_that_makes_it() {
        let d = dir_with(None);
        let e = read(&d, 8, 10).unwrap_err().to_string();
        assert!(e.contains(DRAFT_VOCAB_FILE) && e.contains("ninfer draft-vocab") && e.contains("--lm-head-draft"), "{e}");
        let e = read(dir_with(Some(r#"{"token_ids": [3, 12]}"#)).as_path(), 8, 10).unwrap_err().to_string();
        assert!(e.contains("12") && e.contains("outside"), "{e}");
        let e = read(dir_with(Some(r#"{"token_ids": [3, 3]}"#)).as_path(), 8, 10).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        assert!(read(dir_with(Some("[1, 2]")).as_path(), 8, 10).unwrap_err().to_string().contains("token_ids"));
    }
}
