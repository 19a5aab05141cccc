//! `EngineConfig`: the engine's flags, validated against the model into concrete sizes, and the
//! memory ledger computed from them before anything is allocated.

use crate::model::CacheSpec;
use crate::{NinferError, Result};

/// KV budget used when `kv_capacity_tokens` is not given and the backend cannot tell how much
/// memory is free (host memory): enough for `max_concurrency` full contexts, but at most this
/// many bytes (and never less than one full context).
pub const DEFAULT_KV_BUDGET_BYTES: u64 = 4 << 30;

/// Engine flags as the user gives them (None: derive from the model).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Longest prompt + output of one request (`--max-context`); default: the model's
    /// `max_position_embeddings`.
    pub max_context: Option<usize>,
    /// Tokens of KV cache across all sequences (`--kv-capacity`); must be >= `max_context`.
    pub kv_capacity_tokens: Option<usize>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences running at once (`--max-concurrency`).
    pub max_concurrency: usize,
    /// Token budget of one step (`--prefill-chunk`).
    pub prefill_chunk: usize,
    /// Prefix cache on or off (`--no-prefix-reuse`).
    pub prefix_reuse: bool,
    /// Recurrent-state snapshot slots for prefix reuse on hybrid models; default
    /// `max_concurrency`.
    pub snapshot_slots: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_context: None,
            kv_capacity_tokens: None,
            block_size: 16,
            max_concurrency: 64,
            prefill_chunk: 512,
            prefix_reuse: true,
            snapshot_slots: None,
        }
    }
}

/// Concrete sizes after validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedConfig {
    pub max_context: usize,
    pub kv_capacity_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_concurrency: usize,
    pub prefill_chunk: usize,
    pub prefix_reuse: bool,
    /// Running state slots (max_concurrency + 1 for `score`), 0 for pure-attention models.
    pub running_state_slots: usize,
    pub snapshot_state_slots: usize,
}

/// What the engine's memory goes to, computed before allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLedger {
    pub weight_bytes: u64,
    pub kv_bytes_per_token: u64,
    pub kv_capacity_tokens: u64,
    pub kv_bytes: u64,
    pub state_bytes_per_slot: u64,
    pub state_slots: u64,
    pub state_bytes: u64,
    /// Step buffers after the warm-up step (0 until the engine ran it).
    pub workspace_bytes: u64,
    /// Weights + KV + state + workspace.
    pub total_bytes: u64,
    /// Free device memory after everything above was allocated (None on the CPU backend).
    pub device_free_bytes: Option<u64>,
}

impl EngineConfig {
    /// Check every flag and derive the sizes for a model with this context length (0: unknown)
    /// and these cache costs. `cache_budget` is what the device can give to the KV pool and the
    /// recurrent-state slots together (see `ModelRunner::cache_budget_bytes`); without one the
    /// default KV pool is capped at DEFAULT_KV_BUDGET_BYTES.
    pub fn resolve(&self, model_max: usize, spec: &CacheSpec, cache_budget: Option<u64>) -> Result<ResolvedConfig> {
        let positive = |v: usize, field: &str, flag: &str| {
            if v == 0 {
                Err(NinferError::config(format!("{field} ({flag})"), "must be at least 1"))
            } else {
                Ok(v)
            }
        };
        let block_size = positive(self.block_size, "block_size", "--block-size")?;
        let max_concurrency = positive(self.max_concurrency, "max_concurrency", "--max-concurrency")?;
        let prefill_chunk = positive(self.prefill_chunk, "prefill_chunk", "--prefill-chunk")?;
        let max_context = match self.max_context {
            Some(m) => {
                positive(m, "max_context", "--max-context")?;
                if model_max > 0 && m > model_max {
                    return Err(NinferError::config(
                        "max_context (--max-context)",
                        format!("{m} tokens exceeds the model's max_position_embeddings {model_max}"),
                    ));
                }
                m
            }
            None if model_max > 0 => model_max,
            None => return Err(NinferError::config("max_context (--max-context)", "the model config gives no max_position_embeddings; set it")),
        };
        let hybrid = spec.state_bytes_per_slot > 0;
        let snapshots = if hybrid && self.prefix_reuse { self.snapshot_slots.unwrap_or(max_concurrency) } else { 0 };
        let running_state_slots = if hybrid { max_concurrency + 1 } else { 0 };
        let kv_capacity_tokens = match self.kv_capacity_tokens {
            Some(k) if k < max_context => {
                return Err(NinferError::config(
                    "kv_capacity (--kv-capacity)",
                    format!("{k} tokens is less than max_context {max_context} tokens; raise --kv-capacity or lower --max-context"),
                ))
            }
            Some(k) => k,
            None => {
                // The state slots are fixed by --max-concurrency; the KV pool takes what is left
                // of a device budget. A pool below one full context is still planned (and its
                // allocation then fails with the bytes needed vs available).
                let state_bytes = ((running_state_slots + snapshots) * spec.state_bytes_per_slot) as u64;
                let budget = cache_budget.map_or(DEFAULT_KV_BUDGET_BYTES, |b| b.saturating_sub(state_bytes));
                let tokens = (budget / spec.kv_bytes_per_token.max(1) as u64).min(usize::MAX as u64) as usize;
                tokens.min(max_context.saturating_mul(max_concurrency)).max(max_context)
            }
        };
        Ok(ResolvedConfig {
            max_context,
            kv_capacity_tokens,
            block_size,
            num_blocks: kv_capacity_tokens.div_ceil(block_size),
            max_concurrency,
            prefill_chunk,
            prefix_reuse: self.prefix_reuse,
            running_state_slots,
            snapshot_state_slots: snapshots,
        })
    }
}

impl ResolvedConfig {
    /// The memory ledger for these sizes.
    pub fn ledger(&self, spec: &CacheSpec) -> MemoryLedger {
        let kv_tokens = (self.num_blocks * self.block_size) as u64;
        let kv_bytes = kv_tokens * spec.kv_bytes_per_token as u64;
        let state_slots = (self.running_state_slots + self.snapshot_state_slots) as u64;
        let state_bytes = state_slots * spec.state_bytes_per_slot as u64;
        MemoryLedger {
            weight_bytes: spec.weight_bytes as u64,
            kv_bytes_per_token: spec.kv_bytes_per_token as u64,
            kv_capacity_tokens: kv_tokens,
            kv_bytes,
            state_bytes_per_slot: spec.state_bytes_per_slot as u64,
            state_slots,
            state_bytes,
            workspace_bytes: 0,
            total_bytes: spec.weight_bytes as u64 + kv_bytes + state_bytes,
            device_free_bytes: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(max_pos: usize) -> usize {
        max_pos
    }

    const SPEC: CacheSpec = CacheSpec { kv_bytes_per_token: 1024, state_bytes_per_slot: 0, weight_bytes: 1 << 20 };

    #[test]
    fn kv_capacity_below_max_context_is_an_error_naming_both_numbers() {
        let cfg = EngineConfig { max_context: Some(4096), kv_capacity_tokens: Some(1000), ..Default::default() };
        let msg = cfg.resolve(model(8192), &SPEC, None).unwrap_err().to_string();
        assert!(msg.contains("1000") && msg.contains("4096") && msg.contains("--kv-capacity"), "{msg}");
    }

    #[test]
    fn zero_flags_are_errors_naming_the_flag() {
        let cfg = EngineConfig { prefill_chunk: 0, ..Default::default() };
        let msg = cfg.resolve(model(128), &SPEC, None).unwrap_err().to_string();
        assert!(msg.contains("--prefill-chunk"), "{msg}");
    }

    #[test]
    fn defaults_take_the_model_context_and_a_bounded_kv_pool() {
        let r = EngineConfig { max_concurrency: 4, ..Default::default() }.resolve(model(1000), &SPEC, None).unwrap();
        assert_eq!(r.max_context, 1000);
        assert_eq!(r.kv_capacity_tokens, 4000);
        assert_eq!(r.num_blocks, 250);
        assert_eq!(r.running_state_slots, 0);
        let l = r.ledger(&SPEC);
        assert_eq!(l.kv_bytes, 4000 * 1024);
        assert_eq!(l.total_bytes, l.kv_bytes + (1 << 20));
    }

    #[test]
    fn a_device_budget_sizes_the_default_kv_pool_after_the_state_slots() {
        let hybrid = CacheSpec { kv_bytes_per_token: 1024, state_bytes_per_slot: 10_000, weight_bytes: 0 };
        let cfg = EngineConfig { max_concurrency: 4, ..Default::default() };
        // 4 running + 1 score slot + 4 snapshots = 9 slots of 10,000 B come off the budget first.
        let r = cfg.resolve(model(1000), &hybrid, Some(90_000 + 2500 * 1024)).unwrap();
        assert_eq!(r.kv_capacity_tokens, 2500);
        // A large budget is capped at max_concurrency full contexts, a small one at one context.
        assert_eq!(cfg.resolve(model(1000), &hybrid, Some(1 << 40)).unwrap().kv_capacity_tokens, 4000);
        assert_eq!(cfg.resolve(model(1000), &hybrid, Some(1)).unwrap().kv_capacity_tokens, 1000);
        // An explicit --kv-capacity wins over any budget.
        let fixed = EngineConfig { kv_capacity_tokens: Some(1500), ..cfg };
        assert_eq!(fixed.resolve(model(1000), &hybrid, Some(1 << 40)).unwrap().kv_capacity_tokens, 1500);
    }

    #[test]
    fn max_context_beyond_the_model_is_rejected() {
        let cfg = EngineConfig { max_context: Some(2000), ..Default::default() };
        assert!(cfg.resolve(model(1000), &SPEC, None).is_err());
    }
}
