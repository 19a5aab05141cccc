"""The memory plan on a GPU (marked gpu: skipped without one): under `--spec`, the CUDA runner
allocates the largest verify step's buffers at startup (`ModelRunner::reserve_verify`), so the
startup ledger holds them (the logits of every verify row, the sampler's scratch) and a start
that fits does not allocate them at its first speculative step; `ninfer plan` counts them too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ninfer
from ninfer import LLM, _core

pytestmark = pytest.mark.gpu

DEMO = Path(os.environ.get("NINFER_DEMO_DIR", Path(ninfer.__file__).parent / "demo")) / "model"


def _needs_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if not (DEMO / "config.json").exists():
        pytest.skip("demo model not shipped")


def test_the_startup_ledger_holds_the_verify_steps_buffers():
    _needs_cuda()
    opts = dict(device="cuda", max_concurrency=8, max_context=512)
    with LLM(DEMO, **opts) as llm:
        plain = llm.engine.info()
    with LLM(DEMO, spec="ngram", **opts) as llm:
        spec = llm.engine.info()
        llm.generate([llm.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return")] * 8,
                     ninfer.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        assert llm.engine.stats()["spec_verify_steps"] > 0
    vocab = json.loads((DEMO / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    # 8 sequences of up to 9 verify rows: 72 logits rows (a power of two: 128) instead of the
    # 8 decode rows; f32 over the vocabulary, and at least as much again in the sampler.
    assert spec["workspace_bytes"] - plain["workspace_bytes"] >= (128 - 8) * vocab * 4, (spec, plain)
    # The plan's estimate for the same settings holds the same difference.
    p0 = _core.plan(str(DEMO), gpu_memory=80 << 30, max_context=512, max_concurrency=8)
    p1 = _core.plan(str(DEMO), gpu_memory=80 << 30, max_context=512, max_concurrency=8, spec="ngram")
    assert p1["workspace_bytes"] - p0["workspace_bytes"] >= (128 - 8) * vocab * 4
