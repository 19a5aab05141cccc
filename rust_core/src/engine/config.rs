//! `EngineConfig`: the engine's flags, validated against the model into concrete sizes, and the
//! memory ledger computed from them before anything is allocated.

use crate::model::CacheSpec;
use crate::spec::SpecConfig;
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
    /// Asynchronous scheduling: keep a step in flight and queue the next decode step before
    /// its tokens are known (engine/overlap.rs). Effective only where the runner
    /// `overlaps_steps` (the CUDA backend); the outputs are the same either way.
    pub async_scheduling: bool,
    /// `json_schema` objects without `additionalProperties` admit unlisted keys, as JSON Schema
    /// says (`--json-schema-open-objects`); default: only the listed ones, as OpenAI reads them
    /// (sampling/grammar/closed_objects.rs). A strict schema is closed either way.
    pub json_schema_open_objects: bool,
    /// Speculative decoding (`--spec`, `--draft-tokens`); None: plain decoding. Speculation
    /// runs the synchronous step (no overlap): a round's accepted length is known only once its
    /// logits are on the host.
    pub spec: Option<SpecConfig>,
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
            async_scheduling: true,
            json_schema_open_objects: false,
            spec: None,
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
    /// Speculation's rollback slots on hybrid models (one per running sequence, after the
    /// running and snapshot slots): the state before a verify chunk, restored when a draft
    /// token is rejected. 0 without speculation or recurrent state.
    pub rollback_state_slots: usize,
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
    /// The checks that need only the model's context length (0: unknown): every count at least
    /// 1, --max-context within the model's, --kv-capacity covering --max-context. The loaders run
    /// them before reading any weights, so a bad flag costs no model load; `resolve` runs them
    /// again. Returns the max context.
    pub fn check(&self, model_max: usize) -> Result<usize> {
        let positive = |v: usize, field: &str, flag: &str| {
            if v == 0 {
                Err(NinferError::config(format!("{field} ({flag})"), "must be at least 1"))
            } else {
                Ok(v)
            }
        };
        positive(self.block_size, "block_size", "--block-size")?;
        positive(self.max_concurrency, "max_concurrency", "--max-concurrency")?;
        positive(self.prefill_chunk, "prefill_chunk", "--prefill-chunk")?;
        if let Some(spec) = &self.spec {
            spec.check()?;
        }
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
        if let Some(k) = self.kv_capacity_tokens {
            if k < max_context {
                let whose = if self.max_context.is_some() { "" } else { " (the model's max_position_embeddings)" };
                return Err(NinferError::config(
                    "kv_capacity (--kv-capacity)",
                    format!("{k} tokens is less than max_context {max_context} tokens{whose}; raise --kv-capacity or lower --max-context"),
                ));
            }
        }
        Ok(max_context)
    }

    /// Check every flag and derive the sizes for a model with this context length (0: unknown)
    /// and these cache costs. `cache_budget` is what the device can give to the KV pool and the
    /// recurrent-state slots together (see `ModelRunner::cache_budget_bytes`); without one the
    /// default KV pool is capped at DEFAULT_KV_BUDGET_BYTES.
    pub fn resolve(&self, model_max: usize, spec: &CacheSpec, cache_budget: Option<u64>) -> Result<ResolvedConfig> {
        let max_context = self.check(model_max)?;
        let (block_size, max_concurrency, prefill_chunk) = (self.block_size, self.max_concurrency, self.prefill_chunk);
        let hybrid = spec.state_bytes_per_slot > 0;
        // Speculation keeps prefix reuse: the MTP layer's KV and a DFlash drafter's context are
        // paged with the target's KV, so a hit's blocks carry them.
        let prefix_reuse = self.prefix_reuse;
        let snapshots = if hybrid && prefix_reuse { self.snapshot_slots.unwrap_or(max_concurrency) } else { 0 };
        let running_state_slots = if hybrid { max_concurrency + 1 } else { 0 };
        let rollback_state_slots = if hybrid && self.spec.is_some() { max_concurrency } else { 0 };
        let kv_capacity_tokens = match self.kv_capacity_tokens {
            Some(k) => k,
            None => {
                // The state slots are fixed by --max-concurrency; the KV pool takes what is left
                // of a device budget. A pool below one full context is still planned (and its
                // allocation then fails with the bytes needed vs available).
                let state_bytes = ((running_state_slots + snapshots + rollback_state_slots) * spec.state_bytes_per_slot) as u64;
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
            prefix_reuse,
            running_state_slots,
            snapshot_state_slots: snapshots,
            rollback_state_slots,
        })
    }
}

/// The advice of a KV pool plus recurrent-state slots that did not fit in `available` bytes:
/// the pool that would, in the flags that size it. --kv-capacity cannot go below --max-context,
/// so a pool shorter than one context needs a shorter --max-context too (the default pool is
/// never below one context: with a long model context, --max-context is the flag to lower).
pub fn cache_fit_hint(available: u64, spec: &CacheSpec, state_slots: usize, block_size: usize) -> String {
    let state = state_slots as u64 * spec.state_bytes_per_slot as u64;
    if state >= available {
        return format!(
            "the {state_slots} recurrent-state slots alone need {state} B: lower --max-concurrency (a slot per running sequence, and with prefix reuse one per snapshot)"
        );
    }
    let block = block_size.max(1) as u64;
    let fit = (available - state) / spec.kv_bytes_per_token.max(1) as u64 / block * block;
    if fit == 0 {
        return "not one KV block fits beside the recurrent-state slots: lower --max-concurrency".into();
    }
    format!("at most {fit} KV tokens fit beside the {state_slots} state slots: set --max-context (and --kv-capacity, which must cover it) to at most {fit}, or lower --max-concurrency")
}

impl ResolvedConfig {
    /// The memory ledger for these sizes.
    pub fn ledger(&self, spec: &CacheSpec) -> MemoryLedger {
        let kv_tokens = (self.num_blocks * self.block_size) as u64;
        let kv_bytes = kv_tokens * spec.kv_bytes_per_token as u64;
        let state_slots = (self.running_state_slots + self.snapshot_state_slots + self.rollback_state_slots) as u64;
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
    use crate::spec::SpecMethod;

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
    fn check_needs_only_the_model_context_and_agrees_with_resolve() {
        // The model's own context counts when --max-context is left out.
        let cfg = EngineConfig { kv_capacity_tokens: Some(500), ..Default::default() };
        let msg = cfg.check(1000).unwrap_err().to_string();
        assert!(msg.contains("500") && msg.contains("1000") && msg.contains("max_position_embeddings"), "{msg}");
        assert_eq!(cfg.resolve(1000, &SPEC, None).unwrap_err().to_string(), msg);
        assert_eq!(EngineConfig { max_context: Some(300), ..cfg.clone() }.check(1000).unwrap(), 300);
        let msg = EngineConfig { max_context: Some(2000), ..Default::default() }.check(1000).unwrap_err().to_string();
        assert!(msg.contains("2000") && msg.contains("--max-context"), "{msg}");
        assert!(EngineConfig::default().check(0).unwrap_err().to_string().contains("set it"));
    }

    #[test]
    fn the_cache_hint_names_the_pool_that_fits() {
        let hybrid = CacheSpec { kv_bytes_per_token: 1024, state_bytes_per_slot: 10_000, weight_bytes: 0 };
        // 5 slots take 50,000 B; 1,000,000 B more hold 976 tokens (61 blocks of 16); 1,010,000 B 986, still 976 in blocks.
        assert!(cache_fit_hint(1_050_000, &hybrid, 5, 16).contains("at most 976 KV tokens"));
        let hint = cache_fit_hint(1_060_000, &hybrid, 5, 16);
        assert!(hint.contains("at most 976 KV tokens") && hint.contains("--max-context") && hint.contains("--max-concurrency"), "{hint}");
        let hint = cache_fit_hint(40_000, &hybrid, 5, 16);
        assert!(hint.contains("alone need 50000 B") && hint.contains("--max-concurrency"), "{hint}");
        assert!(cache_fit_hint(50_100, &hybrid, 5, 16).contains("not one KV block"));
    }

    #[test]
    fn speculation_keeps_prefix_reuse_and_adds_rollback_slots() {
        let hybrid = CacheSpec { kv_bytes_per_token: 1024, state_bytes_per_slot: 10_000, weight_bytes: 0 };
        let with = |method| EngineConfig { max_concurrency: 4, spec: Some(SpecConfig { method, draft_tokens: 3, adaptive: false, lm_head_draft: None, drafter: None }), ..Default::default() };
        for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
            let cfg = with(method).resolve(model(1000), &hybrid, None).unwrap();
            assert!(cfg.prefix_reuse && cfg.snapshot_state_slots == 4 && cfg.rollback_state_slots == 4, "{method:?}: {cfg:?}");
        }
        // DFlash too: its drafter's context is paged with the KV, so a prefix hit carries it.
        let dflash = EngineConfig { max_concurrency: 4, spec: Some(SpecConfig::with_drafter("dflash", None, Some("d".into())).unwrap()), ..Default::default() };
        let cfg = dflash.resolve(model(1000), &hybrid, None).unwrap();
        assert!(cfg.prefix_reuse && cfg.snapshot_state_slots == 4 && cfg.rollback_state_slots == 4, "{cfg:?}");
        // --no-prefix-reuse still turns it off.
        let off = EngineConfig { prefix_reuse: false, ..dflash }.resolve(model(1000), &hybrid, None).unwrap();
        assert!(!off.prefix_reuse && off.snapshot_state_slots == 0);
    }

    #[test]
    fn max_context_beyond_the_model_is_rejected() {
        let cfg = EngineConfig { max_context: Some(2000), ..Default::default() };
        assert!(cfg.resolve(model(1000), &SPEC, None).is_err());
    }
}
