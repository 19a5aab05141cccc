"""Prefix-cache hits under DFlash drafting (`spec="dflash"`, prefix reuse on) on the bundled demo
model with its shipped drafter and on a tiny random Qwen3.5 with a random drafter (hybrid
models: hits resume from recurrent-state snapshots).

The drafter's context rows are paged with the target's KV (model/cpu/dflash.rs), so a hit's
blocks carry the rows the request that computed them wrote. Greedy output with hits equals plain
greedy output and DFlash output without prefix reuse, token for token; the drafts after a hit are
those drafted without it (the same drafted and accepted counts: the drafter read the same
context); the hits are really taken; and blocks evicted from the cache and reused by another
prompt carry that prompt's rows (the context memory is the pool's, counted per token in the
ledger), so a prompt whose blocks were evicted drafts as in a fresh engine.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ninfer import LLM, SamplingParams
from test_speculative import _assert_as_plain

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = Path(os.environ.get("NINFER_DEMO_DIR", REPO / "python" / "ninfer" / "demo"))
DEMO_MODEL = DEMO_DIR / "model"
DEMO_DRAFTER = DEMO_DIR / "dflash"

demo_only = pytest.mark.skipif(not (DEMO_DRAFTER / "config.json").exists(), reason="demo drafter not shipped")

#: A long shared prefix (code, where the demo's drafter is accepted often) and suffixes.
PREFIX = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def __len__(self):\n"
    "        return len(self.items)\n\n    def is_empty(self):\n        return not self.items\n\n"
    "    def clear(self):\n        self.items.clear()\n\n    def __repr__(self):\n"
    "        return f\"Stack({self.items!r})\"\n\n\nclass Queue:\n    def __init__(self):\n"
)
SUFFIXES = [
    "        self.items = []\n\n    def push(self, x):\n",
    "        self.head = None\n        self.tail = None\n",
    "        self.data = {}\n\n    def get(self, key):\n",
    "        self.items = []\n\n    def __len__(self):\n",
]
#: Counters that must match between a run with hits and one without: what was drafted and
#: accepted (the drafter's context) and what was generated.
SPEC_COUNTERS = ["spec_verify_steps", "spec_drafted_tokens", "spec_accepted_tokens", "generation_tokens_total"]


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def _sequential(prompts, params, model_dir=DEMO_MODEL, **engine):
    """Each prompt alone, in order, on one engine: (token ids, cached tokens) per request and the
    engine's stats after each."""
    engine.setdefault("max_context", 512)
    engine.setdefault("max_concurrency", 8)
    outs, stats = [], []
    with LLM(model_dir, **engine) as llm:
        for p in prompts:
            [o] = llm.generate(llm.encode(p) if isinstance(p, str) else p, params)
            outs.append((o.token_ids, o.usage.cached_tokens))
            stats.append(llm.engine.stats())
    return outs, stats


def _counters(s):
    return {k: s[k] for k in SPEC_COUNTERS}


def _per_request(stats):
    """Each request's counters from the engine's stats after each of its requests."""
    zero = dict.fromkeys(SPEC_COUNTERS, 0)
    return [{k: b[k] - a[k] for k in SPEC_COUNTERS} for a, b in zip([zero] + stats, stats)]


@pytest.fixture(params=["demo", "tiny"])
def model(request, tiny_checkpoints, tmp_path_factory):
    """(model directory, engine options): the demo with its shipped drafter, or the tiny random
    Qwen3.5 (hybrid too) with a random drafter reading its layers 0, 2 and the last."""
    if request.param == "demo":
        if not (DEMO_DRAFTER / "config.json").exists():
            pytest.skip("demo drafter not shipped")
        return DEMO_MODEL, {}
    from test_dflash import write_random_drafter

    target = tiny_checkpoints.get("qwen3_5")
    return target, {"drafter": str(write_random_drafter(tmp_path_factory.mktemp("dflash_prefix") / "drafter", target, seed=3))}


def test_greedy_dflash_with_prefix_hits_equals_plain_and_drafts_as_without_the_hits(model):
    """A prompt, prompts that extend it, the same prompt again and a second turn (the first
    prompt, its answer, then more: blocks whose context rows verify steps wrote). On a hybrid
    model a hit resumes from a recurrent-state snapshot, taken at a prompt's last block
    boundary, so the prompts after the first extend it."""
    model_dir, engine = model
    k = 7 if model_dir == DEMO_MODEL else 4
    with LLM(model_dir, max_context=512) as llm:
        first = llm.encode(PREFIX)
        prompts = [first] + [llm.encode(PREFIX + s) for s in SUFFIXES] + [first]
        [answer] = llm.generate(first, greedy(40))
        turn2 = first + answer.token_ids + llm.encode("\n\nclass Deque(Queue):\n")
        prompts.append(turn2)
        plain = [o.token_ids for o in llm.generate(prompts, greedy(40))]
    reuse, reuse_stats = _sequential(prompts, greedy(40), model_dir, spec="dflash", draft_tokens=k, **engine)
    fresh, fresh_stats = _sequential(prompts, greedy(40), model_dir, spec="dflash", draft_tokens=k, prefix_reuse=False, **engine)
    # Each prompt on an engine of its own, prefix reuse on and nothing cached: the same chunks
    # as with the hit past it (a prompt is cut at its last block boundary for the snapshot
    # there, and a last token left alone is drafted from), without the hit.
    alone = [_sequential([p], greedy(40), model_dir, spec="dflash", draft_tokens=k, **engine) for p in prompts]
    assert [t for t, _ in reuse] == [t for t, _ in fresh] == [a[0][0][0] for a in alone] == plain
    # The hits are taken: every request after the first resumes past the shared prefix (the
    # second turn past the first turn's prompt), and only with prefix reuse.
    cached = [c for _, c in reuse]
    assert cached[0] == 0 and all(c >= 16 * (len(first) // 16) for c in cached[1:]), cached
    assert cached[-1] > len(first), cached
    assert all(c == 0 for _, c in fresh)
    assert reuse_stats[-1]["prefix_hit_tokens"] == sum(cached) and fresh_stats[-1]["prefix_hit_tokens"] == 0
    # The drafts after each hit are those without it, request by request.
    for i, (a, b) in enumerate(zip(_per_request(reuse_stats), [_counters(a[1][0]) for a in alone])):
        assert a == b, (i, a, b)
    assert reuse_stats[-1]["spec_drafted_tokens"] > 0
    if model_dir == DEMO_MODEL:
        assert reuse_stats[-1]["spec_accepted_tokens"] > 0
    # Fewer prompt tokens computed: the hits skipped them.
    assert reuse_stats[-1]["prefill_tokens_computed"] < fresh_stats[-1]["prefill_tokens_computed"]


@demo_only
def test_a_hit_that_leaves_one_prompt_token_drafts_from_the_cached_context_at_once():
    """A prompt whose blocks but its last token are cached (and a one-token prompt): its last
    prompt token is its first verify chunk's input, drafted from the context rows its cached
    blocks carry (or from no context), before the request computed any row itself."""
    with LLM(DEMO_MODEL, max_context=512) as llm:
        ids = llm.encode(PREFIX)
        n = len(ids) // 16 * 16
        prompts = [ids[: n + 5], ids[: n + 1], ids[:1]]
        plain = [o.token_ids for o in llm.generate(prompts, greedy(30))]
    runs, stats = _sequential(prompts, greedy(30), spec="dflash", draft_tokens=7)
    assert [t for t, _ in runs] == plain
    assert [c for _, c in runs] == [0, n, 0]
    assert stats[1]["spec_verify_steps"] > stats[0]["spec_verify_steps"]
    assert stats[1]["spec_accepted_tokens"] > stats[0]["spec_accepted_tokens"]


def _mixed(n: int):
    """Greedy and seeded sampled requests with their own K (0: no drafts) and penalties."""
    kinds = [
        greedy(32, draft_tokens=7),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, draft_tokens=3),
        greedy(28, draft_tokens=0),
        greedy(20, frequency_penalty=0.5, draft_tokens=2),
        SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=30, ignore_eos=True, draft_tokens=0),
        greedy(36, repetition_penalty=1.2, draft_tokens=5),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def _batch_after_warm_up(warm, prompts, params, **engine):
    with LLM(DEMO_MODEL, max_context=512, max_concurrency=8, **engine) as llm:
        llm.generate(llm.encode(warm), greedy(16))
        before = llm.engine.stats()
        outs = llm.generate([llm.encode(p) for p in prompts], params)
        return [(o.token_ids, o.finish_reason) for o in outs], [o.usage.cached_tokens for o in outs], before, llm.engine.stats()


@demo_only
def test_hits_in_a_batch_with_mixed_parameters_and_chunked_prefill_equal_plain_and_no_reuse():
    """A warm-up request caches a prompt; then a batch of 8 (greedy and sampled, K from 0 to 7,
    prompt chunks of 16 tokens) where some prompts extend it (and hit) and others share nothing.
    Greedy requests output plain's and no-reuse's tokens; sampled ones follow plain sampling's
    distribution (hits change how the step budget splits prompts, and so which rounds draft and
    draw from a request's RNG)."""
    others = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return", "one two three four one two three four one two"]
    prompts = [PREFIX + SUFFIXES[i % 4] if i % 4 != 3 else others[i % 2] for i in range(8)]
    prompts[4] = PREFIX
    params = _mixed(8)
    with LLM(DEMO_MODEL, max_context=512, max_concurrency=8) as llm:
        plain = [(o.token_ids, o.finish_reason) for o in llm.generate([llm.encode(p) for p in prompts], [dataclasses.replace(p, draft_tokens=None) for p in params])]
    reuse, cached, before, after = _batch_after_warm_up(PREFIX, prompts, params, spec="dflash", prefill_chunk=16)
    fresh, fresh_cached, _, _ = _batch_after_warm_up(PREFIX, prompts, params, spec="dflash", prefill_chunk=16, prefix_reuse=False)
    _assert_as_plain("dflash", params, reuse, plain)
    _assert_as_plain("dflash", params, fresh, plain)
    assert all(c >= 112 for p, c in zip(prompts, cached) if p.startswith(PREFIX)), cached
    assert all(c == 0 for p, c in zip(prompts, cached) if not p.startswith(PREFIX)), cached
    assert set(fresh_cached) == {0}
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == sum(cached)
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert after["kv_blocks_used"] == 0


@demo_only
def test_evicted_blocks_carry_their_new_owners_context_and_the_pool_counts_it():
    """A pool of 16 blocks of 16: a long unrelated prompt (all 16 blocks) evicts the first
    prompt's cached blocks and writes its own rows into them; the first prompt again then hits nothing and
    drafts as in a fresh engine, and the unrelated prompt drafts as in a fresh engine too."""
    tight = {"max_context": 256, "kv_capacity": 256, "max_concurrency": 2}
    with LLM(DEMO_MODEL, **tight) as llm:
        a = llm.encode(PREFIX + SUFFIXES[0])
        b = llm.encode(("for i in range(10):\n    print(i * i)\n" * 20))[:220]
        plain = [o.token_ids for o in llm.generate([a, b], greedy(24))]
        plain_info = llm.engine.info()
    runs, stats = _sequential([a, b, a], greedy(24), spec="dflash", draft_tokens=7, **tight)
    assert [t for t, _ in runs] == [plain[0], plain[1], plain[0]]
    assert [c for _, c in runs] == [0, 0, 0], "b evicted a's blocks; a hits nothing"
    fresh, fresh_stats = _sequential([b], greedy(24), spec="dflash", draft_tokens=7, **tight)
    # a again drafts as a did first (its rows rewritten into reused blocks), b as alone.
    first_a = _counters(stats[0])
    b_only = {k: stats[1][k] - stats[0][k] for k in SPEC_COUNTERS}
    a_again = {k: stats[2][k] - stats[1][k] for k in SPEC_COUNTERS}
    assert a_again == first_a and b_only == _counters(fresh_stats[0]), (first_a, a_again, b_only, _counters(fresh_stats[0]))
    assert stats[-1]["kv_blocks_used"] == 0
    # The drafter's context is part of every token's KV bytes (its 2 layers' K and V, 2 heads
    # of 64, f32), so the pool's bytes cover it and it goes with the blocks.
    with LLM(DEMO_MODEL, spec="dflash", **tight) as llm:
        info = llm.engine.info()
    assert info["prefix_reuse"] and info["num_blocks"] == plain_info["num_blocks"]
    assert info["kv_bytes_per_token"] - plain_info["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4
    assert info["kv_bytes"] == info["num_blocks"] * info["block_size"] * info["kv_bytes_per_token"]
