//! `Sequence`: what the scheduler knows about one request: its tokens, how many are computed,
//! and the KV blocks and state slot it holds.

use crate::kv::{block_hash, BlockHash};

/// Engine-internal sequence id (request ids are client strings).
pub type SeqId = u64;

/// Where a sequence is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqStatus {
    /// Queued, holding nothing.
    Waiting,
    /// Holding blocks (and a slot); runs in steps.
    Running,
}

/// Scheduler view of one request.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens of the original prompt.
    pub prompt_len: usize,
    /// Tokens whose KV (and recurrent state) are computed.
    pub num_computed: usize,
    /// KV block ids covering positions from 0.
    pub block_table: Vec<u32>,
    /// Chained hashes of the full blocks of `tokens` computed so far.
    pub block_hashes: Vec<BlockHash>,
    /// Leading blocks already registered in the prefix cache.
    pub num_registered_blocks: usize,
    /// Recurrent-state slot while running (hybrid models).
    pub state_slot: Option<usize>,
    /// Token count (block aligned) at which to snapshot the recurrent state.
    pub snapshot_at: Option<usize>,
    /// Key of the snapshot this sequence last took while decoding (replaced at each boundary).
    pub trailing_snapshot: Option<BlockHash>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: Option<usize>,
    /// Draft tokens to verify after the last token in the next decode step (speculative
    /// decoding); set by the engine before `Scheduler::schedule`, cleared by its update.
    pub draft: Vec<u32>,
    pub status: SeqStatus,
}

impl Sequence {
    /// A new waiting sequence.
    pub fn new(id: SeqId, prompt: Vec<u32>) -> Self {
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            block_table: Vec::new(),
            block_hashes: Vec::new(),
            num_registered_blocks: 0,
            state_slot: None,
            snapshot_at: None,
            trailing_snapshot: None,
            cached_tokens: None,
            draft: Vec::new(),
            status: SeqStatus::Waiting,
        }
    }

    /// Tokens still to run through the model (1 while decoding).
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Generated tokens so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Extend `block_hashes` to cover the first `n` full blocks (n <= full blocks of tokens).
    pub fn ensure_hashes(&mut self, n: usize, block_size: usize) {
        while self.block_hashes.len() < n {
            let b = self.block_hashes.len();
            let parent = self.block_hashes.last().copied();
            self.block_hashes.push(block_hash(parent, &self.tokens[b * block_size..(b + 1) * block_size]));
        }
    }
}
