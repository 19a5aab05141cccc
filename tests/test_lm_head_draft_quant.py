"""`--lm-head-draft` over a quantized LM head (`--quantize ... --quantize-lm-head`): the head's
rows of the draft vocabulary are decoded once at set-up, so the MTP head drafts over the same
values the full quantized head multiplies by. Greedy output with such drafts equals plain greedy
output of the same quantized model on the CPU (exactly) and on a GPU (up to near-ties, as
tests/test_gpu_spec.py bounds them; the GPU test is marked gpu), and the drafts pass about as
often as with the full head over the same vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ninfer import LLM, SamplingParams
from test_lm_head_draft import PROMPTS as _PROMPTS

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = Path(os.environ.get("NINFER_DEMO_DIR", REPO / "python" / "ninfer" / "demo")) / "model"

#: The reduced-head suite's first three prompts.
PROMPTS = _PROMPTS[:3]

QUANT = dict(quantize="w8", quantize_lm_head=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(device, params, **engine):
    with LLM(DEMO_MODEL, device=device, max_context=512, max_concurrency=8, **QUANT, **engine) as llm:
        outs = llm.generate([llm.encode(p) for p in PROMPTS], params)
        return [o.token_ids for o in outs], llm.engine.stats()


def _demo():
    if not (DEMO_MODEL / "draft_vocab.json").exists():
        pytest.skip("demo model not shipped")


def test_greedy_with_a_reduced_draft_head_over_a_quantized_head_equals_plain_greedy_on_the_cpu():
    _demo()
    plain, _ = _run("cpu", greedy(40))
    spec, stats = _run("cpu", greedy(40), spec="mtp", draft_tokens=3, lm_head_draft=True, lm_head_draft_size=512)
    assert spec == plain
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_mean_accepted_length"] > 1.5, stats


@pytest.mark.gpu
def test_greedy_with_a_reduced_draft_head_over_a_quantized_head_on_cuda():
    """The GPU gathers the head's rows a dequantized chunk at a time: greedy output equals plain
    greedy output up to near-ties (top-2 gap < 0.5), drafts pass, and the mean accepted length
    is within 0.25 of the CPU's with the same quantized, reduced head."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    _demo()
    from test_gpu_spec import NEAR_TIE, _divergence_gap, greedy as greedy_top2

    with LLM(DEMO_MODEL, device="cuda", max_context=512, max_concurrency=8, logits_dtype="float32", **QUANT) as llm:
        plain = llm.generate([llm.encode(p) for p in PROMPTS], greedy_top2(40))
    opts = dict(spec="mtp", draft_tokens=3, lm_head_draft=True, lm_head_draft_size=2048)
    spec, stats = _run("cuda", greedy(40), **opts)
    gaps = [_divergence_gap(p, s) for p, s in zip(plain, spec)]
    assert all(g is None or g[1] < NEAR_TIE for g in gaps), gaps
    assert stats["spec_accepted_tokens"] > 0, stats
    _, cpu = _run("cpu", greedy(40), **opts)
    assert abs(stats["spec_mean_accepted_length"] - cpu["spec_mean_accepted_length"]) < 0.25
