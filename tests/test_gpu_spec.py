"""Speculative decoding on the CUDA backend (`--spec ngram|mtp|dflash`): the verify step's logits
against the CPU backend's, greedy output with drafts against plain greedy output on the same GPU,
and the MTP head's drafts (greedy, sampled from q, and over a reduced draft vocabulary) and the
DFlash drafter's (greedy and sampled, with prefix-cache hits) against the CPU drafters'.

A verify chunk (a decode token and its K drafts, logits at every position) runs the prefill
kernels (cuBLAS, flash attention, the recurrent or chunked Gated DeltaNet over K + 1 rows), while
a plain decode step runs the decode kernels (GEMV, split-K decode attention): different summation
orders, so, as for a batch against each prompt alone (tests/test_gpu_model.py), greedy output
with drafts may leave plain greedy output only at a near-tie (top-2 gap < NEAR_TIE, measured on
f32 logits). The same bound holds the CUDA drafts to the CPU drafts. The demo model is trained
(peaked distributions); the tiny random checkpoints use the head sizes the kernels take.

A step of nothing but verify chunks of one K runs as a CUDA graph keyed (sequences padded to a
bucket, block-table stride, K + 1); with `cuda_graphs=False` the same padded launches run
eagerly, so the two agree bit for bit.

A greedy request without logprobs is verified by the device sampler's argmax of every verify row
(outside the captured graph, as decode sampling is), with only ids copied back; the host route
(device_sampling off, or logprobs wanted) picks the same tokens from the same f32 logits.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ninfer  # noqa: E402
from ninfer import LLM, SamplingParams, _core  # noqa: E402

pytestmark = pytest.mark.gpu

#: As tests/test_gpu_model.py: logits rel err (max abs diff / max abs reference) of the trained
#: demo model against the CPU f32 path, and the top-2 logprob gap under which two summation
#: orders may pick different greedy tokens.
REL_TOL = 2e-2
NEAR_TIE = 0.5

#: Sizes the kernels are instantiated for (tests/test_gpu_model.py).
GPU_SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4),
}

DEMO = Path(os.environ.get("NINFER_DEMO_DIR", Path(ninfer.__file__).parent / "demo"))
DEMO_DRAFTER = DEMO / "dflash"

#: Repetitive prompts (tests/test_speculative.py), where prompt lookup finds drafts.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "SELECT name FROM users; SELECT name FROM",
    "a b c a b c a b c a b",
    "12 + 34 = 46. 12 + 34 =",
    "The weather in Paris is nice. The weather in",
]


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def _rel_err(got, exp) -> float:
    return float(np.abs(got - exp).max() / np.abs(exp).max())


def _ids(n: int, vocab: int, seed: int) -> list:
    return [int(t) for t in np.random.RandomState(seed).randint(3, vocab, size=n)]


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, top_logprobs=2, **kwargs)


def _gap(logits_row) -> float:
    """Top-2 logprob gap of a row of logits (the same as the top-2 logit gap)."""
    top = np.sort(np.asarray(logits_row, dtype=np.float64))[-2:]
    return float(top[1] - top[0])


def _divergence_gap(out, other_ids: list):
    """(index of the first token where `out` and `other_ids` differ, `out`'s top-2 logprob gap
    there), or None when they agree throughout."""
    n = 0
    while n < min(len(out.token_ids), len(other_ids)) and out.token_ids[n] == other_ids[n]:
        n += 1
    if n == len(out.token_ids):
        return None
    top = out.logprobs[n].top
    return n, top[0][1] - top[1][1]


@pytest.fixture(scope="module")
def demo_dir():
    _needs_cuda()
    if not (DEMO / "model" / "config.json").exists():
        pytest.skip("no bundled demo model")
    return DEMO / "model"


@pytest.fixture(scope="module")
def qwen3_5_mtp(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen3.5 checkpoint at the kernels' sizes, given a random MTP head."""
    _needs_cuda()
    from tiny_models import add_mtp_head

    path = tmp_path_factory.mktemp("gpu_spec_mtp") / "qwen3_5_mtp"
    shutil.copytree(tiny_checkpoints.get("qwen3_5", **GPU_SHAPES["qwen3_5"]), path)
    return add_mtp_head(path, seed=5)


@pytest.fixture(scope="module")
def qwen3_5_dflash(tiny_checkpoints, tmp_path_factory):
    """(the tiny Qwen3.5 at the kernels' sizes, a random DFlash drafter for it reading its layers
    0, 2 and the last (whose features are the final norm's), head size 64, blocks of 8)."""
    _needs_cuda()
    from test_dflash import write_random_drafter

    target = tiny_checkpoints.get("qwen3_5", **GPU_SHAPES["qwen3_5"])
    out = tmp_path_factory.mktemp("gpu_spec_dflash") / "drafter"
    return target, write_random_drafter(out, target, seed=3, block_size=8, head_dim=64, intermediate_size=128)


def _model_dir(name: str, request) -> Path:
    if name == "demo":
        return request.getfixturevalue("demo_dir")
    if name == "qwen3_5_mtp":
        return request.getfixturevalue("qwen3_5_mtp")
    if name == "qwen3_5_dflash":
        return request.getfixturevalue("qwen3_5_dflash")[0]
    _needs_cuda()
    return request.getfixturevalue("tiny_checkpoints").get(name, **GPU_SHAPES[name])


def _drafter(name: str, request) -> Path:
    """The DFlash drafter of model `name`: the demo's shipped one, or the tiny random one."""
    if name == "demo":
        if not (DEMO_DRAFTER / "config.json").exists():
            pytest.skip("demo drafter not shipped")
        return DEMO_DRAFTER
    return request.getfixturevalue("qwen3_5_dflash")[1]


def _spec(method: str, name: str, request) -> dict:
    """Engine options of `method` on model `name` (a DFlash drafter with its directory)."""
    return dict(spec=method, drafter=str(_drafter(name, request))) if method == "dflash" else dict(spec=method)


def _hf_bf16_error(model_dir: Path, ids: list) -> float:
    """transformers' own bf16 logits error against its f32 logits on `ids` (the GPU suite's
    yardstick for the random checkpoints, whose logits are nearly flat)."""
    x = torch.tensor([ids], device="cuda")
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to("cuda").eval()
        with torch.no_grad():
            out[dtype] = model(x).logits[0].float().cpu().numpy()
        del model
    return _rel_err(out[torch.bfloat16], out[torch.float32])


# The verify step: one forward where each sequence runs a chunk at its decode position with logits
# at every position (K + 1 rows for a verify chunk, one for a plain decode beside it).

@pytest.mark.parametrize("long_chunk", [False, True], ids=["verify-and-decode", "beside-a-70-token-chunk"])
@pytest.mark.parametrize("name", ["demo", "llama", "qwen3_5"])
def test_verify_step_logits_match_the_cpu(name, long_chunk, request):
    """Verify chunks of 4 and 6 tokens and a plain decode in one step, on prompts of 20-70 tokens
    prefilled before: every row's logits track the CPU f32 path. With a 70-token chunk in the
    same step the hybrid's Gated DeltaNet runs its chunked kernel over every sequence (the longest
    chunk decides), which must be exact for the short verify chunks too."""
    model_dir = _model_dir(name, request)
    cpu_model = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
    vocab = cpu_model.config["vocab_size"]
    if name == "demo":
        # Held-out text, where the trained model's logits are those REL_TOL was set on.
        seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
        text = [seqs[i % len(seqs)][100 * i:100 * i + 100] for i in range(4)]
        prompts, chunks = [t[:n] for t, n in zip(text, (20, 45, 70, 30))], [t[n:n + c] for t, n, c in zip(text, (20, 45, 70, 30), (4, 1, 6, 70))]
    else:
        prompts = [_ids(n, vocab, seed=70 + n) for n in (20, 45, 70, 30)]
        chunks = [_ids(c, vocab, seed=c) for c in (4, 1, 6, 70)]
    if not long_chunk:
        prompts, chunks = prompts[:3], chunks[:3]
    gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").verify_logits(prompts, chunks)
    cpu = cpu_model.verify_logits(prompts, chunks)
    assert gpu.shape == cpu.shape == (sum(len(c) for c in chunks), vocab)
    assert np.isfinite(gpu).all()
    tol = REL_TOL if name == "demo" else 2 * _hf_bf16_error(model_dir, prompts[0] + chunks[0]) + 5e-3
    row = 0
    for p, c in zip(prompts, chunks):
        err = _rel_err(gpu[row:row + len(c)], cpu[row:row + len(c)])
        print(f"{name}: {len(c)}-token chunk after {len(p)} tokens: rel err vs CPU f32 {err:.2e} (tol {tol:.2e})")
        assert err <= tol
        row += len(c)


# Verify steps as CUDA graphs: a step whose every sequence verifies K drafts is captured once per
# (bucket, table stride, K + 1) and replayed; graphs off runs the same launches eagerly.

_VERIFY_TOL = {}


def _verify_tol(name, model_dir, prompt):
    """The random checkpoint's logits tolerance against the CPU f32 path, as
    test_verify_step_logits_match_the_cpu sets it (measured once per model)."""
    if name not in _VERIFY_TOL:
        _VERIFY_TOL[name] = 2 * _hf_bf16_error(model_dir, prompt) + 5e-3
    return _VERIFY_TOL[name]


@pytest.mark.parametrize("n", [1, 3], ids=["batch-1", "batch-3-padded-to-4"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ["qwen3_5", "llama"])
def test_verify_step_as_a_cuda_graph_equals_graphs_off_bitwise_and_the_cpu(name, k, n, request):
    """`n` sequences, prompts of 19-37 tokens prefilled first, each verifying K drafts in one
    step: with graphs on the step is captured as a graph (3 sequences: padded to a bucket of 4)
    and its logits equal the eager run's with graphs off bit for bit, and every row tracks the
    CPU f32 path within the verify tolerance. The hybrid's Gated DeltaNet runs its K + 1 rows
    through the recurrent kernel inside the graph."""
    model_dir = _model_dir(name, request)
    cpu_model = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
    vocab = cpu_model.config["vocab_size"]
    prompts = [_ids(19 + 9 * i, vocab, seed=300 + 10 * k + i) for i in range(n)]
    chunks = [_ids(k + 1, vocab, seed=400 + 10 * k + i) for i in range(n)]
    graphed = _core.Model(str(model_dir), device="cuda", logits_dtype="float32")
    eager = _core.Model(str(model_dir), device="cuda", logits_dtype="float32", cuda_graphs=False)
    g = graphed.verify_logits(prompts, chunks)
    e = eager.verify_logits(prompts, chunks)
    assert graphed.step_graphs() >= 1, "the verify step did not run as a CUDA graph"
    assert eager.step_graphs() == 0, "cuda_graphs=False did not disable graphs"
    assert g.shape == e.shape == (n * (k + 1), vocab)
    assert np.isfinite(g).all()
    assert g.view(np.uint32).tobytes() == e.view(np.uint32).tobytes(), (
        f"{name} K={k} n={n}: graph vs eager differ, max abs diff {np.abs(g - e).max():.3e}")
    cpu = cpu_model.verify_logits(prompts, chunks)
    tol = _verify_tol(name, model_dir, prompts[0] + chunks[0])
    for i in range(n):
        rows = slice(i * (k + 1), (i + 1) * (k + 1))
        err = _rel_err(g[rows], cpu[rows])
        print(f"{name} K={k} sequence {i} of {n}: rel err vs CPU f32 {err:.2e} (tol {tol:.2e})")
        assert err <= tol


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ["qwen3_5_mtp", "demo"])
def test_greedy_mtp_with_verify_graphs_equals_graphs_off_and_plain_greedy(name, k, request):
    """Greedy `--spec mtp` on three requests, whose steps verify K drafts each (graphed steps,
    replayed at each later position of their stride) between prefill and rollback steps: with
    graphs on the tokens and their logprobs equal the run with graphs off exactly, and the tokens
    equal plain greedy output up to near-ties."""
    model_dir = _model_dir(name, request)
    plain = _plain_greedy(model_dir, 48)
    on, stats = _generate(model_dir, PROMPTS[:3], greedy(48), spec="mtp", draft_tokens=k)
    off, _ = _generate(model_dir, PROMPTS[:3], greedy(48), spec="mtp", draft_tokens=k, cuda_graphs=False)
    assert stats["spec_verify_steps"] > 0
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]
    _assert_equal_but_at_near_ties(plain, on, f"mtp K={k} with verify graphs on {name}")


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("name", ["qwen3_5_dflash", "demo"])
def test_greedy_dflash_with_verify_graphs_equals_graphs_off_and_plain_greedy(name, k, request):
    """Greedy `--spec dflash` on three requests: the target features the drafter reads are
    copied inside the captured decode and verify graphs (replayed at later positions), so with
    graphs on the drafts, the tokens and their logprobs equal the run with graphs off exactly,
    and the tokens equal plain greedy output up to near-ties."""
    model_dir = _model_dir(name, request)
    plain = _plain_greedy(model_dir, 48)
    opts = dict(draft_tokens=k, **_spec("dflash", name, request))
    on, stats = _generate(model_dir, PROMPTS[:3], greedy(48), **opts)
    off, off_stats = _generate(model_dir, PROMPTS[:3], greedy(48), cuda_graphs=False, **opts)
    assert stats["spec_verify_steps"] > 0
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]
    assert (stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]) == (off_stats["spec_drafted_tokens"], off_stats["spec_accepted_tokens"])
    _assert_equal_but_at_near_ties(plain, on, f"dflash K={k} with verify graphs on {name}")


# Rollback by replay: a verify step keeps each chunk's Gated DeltaNet inputs, and a rejected
# draft's state is rebuilt by the replay kernel over the accepted tokens (no second forward).

@pytest.mark.parametrize("name", ["qwen3_5", "demo"])
def test_replayed_states_on_cuda_match_the_cpu_and_recompute(name, request):
    """Four sequences verify chunks of 2-7 tokens in one step (a uniform K on the graphed verify
    path, mixed K on the eager one) and are rolled back to 1..len-1 accepted tokens by the
    replay kernel: the logits of the next token after the rollback track the CPU backend's
    replay (whose state is its recompute's, tests in rust_core) and the GPU's own recompute
    within the verify step's tolerance, and `spec_replayed_tokens` counts the engine's
    replays while no token runs a second forward."""
    model_dir = _model_dir(name, request)
    cpu_model = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
    vocab = cpu_model.config["vocab_size"]
    prompts = [_ids(n, vocab, seed=90 + n) for n in (20, 33, 41, 57)]
    tol = REL_TOL if name == "demo" else _verify_tol(name, model_dir, prompts[0])
    for lens, accepted in [((4, 4, 4, 4), (1, 2, 3, 1)), ((2, 5, 7, 3), (1, 4, 2, 2))]:
        chunks = [_ids(c, vocab, seed=c + 7 * i) for i, c in enumerate(lens)]
        args = (prompts, chunks, list(accepted))
        cpu = cpu_model.rolled_back_logits(*args, True)
        gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").rolled_back_logits(*args, True)
        redo = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").rolled_back_logits(*args, False)
        assert gpu.shape == cpu.shape == (4, vocab) and np.isfinite(gpu).all()
        for i in range(4):
            e_cpu, e_redo = _rel_err(gpu[i], cpu[i]), _rel_err(gpu[i], redo[i])
            print(f"{name} chunks {lens}, sequence {i} at {accepted[i]} accepted: rel err vs CPU {e_cpu:.2e}, "
                  f"vs recompute {e_redo:.2e} (tol {tol:.2e})")
            assert e_cpu <= tol and e_redo <= tol
    _, stats = _generate(model_dir, PROMPTS[:3], greedy(32), spec="ngram", draft_tokens=3)
    assert stats["spec_replayed_tokens"] > 0 and stats["spec_rollback_tokens"] == 0, stats


# Greedy output with drafts against plain greedy output, both on the GPU.

CASES = [("ngram", "llama"), ("ngram", "qwen3_5"), ("ngram", "demo"), ("mtp", "qwen3_5_mtp"), ("mtp", "demo"),
         ("dflash", "qwen3_5_dflash"), ("dflash", "demo")]


def _generate(model_dir, prompts, params, **engine):
    engine.setdefault("max_context", 512)
    with LLM(model_dir, device="cuda", max_concurrency=8, logits_dtype="float32", **engine) as llm:
        ids = [llm.encode(p) for p in prompts]
        return llm.generate(ids, params), llm.engine.stats()


def _assert_equal_but_at_near_ties(plain, spec, what):
    gaps = [_divergence_gap(p, s.token_ids) for p, s in zip(plain, spec)]
    print(f"{what}: {gaps.count(None)}/{len(gaps)} outputs equal plain greedy; divergences (token, plain's top-2 gap): "
          f"{[g for g in gaps if g]}")
    assert all(len(s.token_ids) == len(p.token_ids) for p, s in zip(plain, spec)), "ignore_eos: exactly max_tokens"
    assert all(g is None or g[1] < NEAR_TIE for g in gaps)


_PLAIN = {}


def _plain_greedy(model_dir, n):
    """Plain greedy output of PROMPTS[:3] on the GPU (one run per model for every K)."""
    if (model_dir, n) not in _PLAIN:
        _PLAIN[model_dir, n] = _generate(model_dir, PROMPTS[:3], greedy(n))[0]
    return _PLAIN[model_dir, n]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_greedy_with_drafts_on_cuda_equals_plain_greedy(method, name, k, request):
    model_dir = _model_dir(name, request)
    plain = _plain_greedy(model_dir, 48)
    spec, stats = _generate(model_dir, PROMPTS[:3], greedy(48), draft_tokens=k, **_spec(method, name, request))
    _assert_equal_but_at_near_ties(plain, spec, f"{method} K={k} on {name}")
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_verify_steps"] > 0
    if name == "demo":
        # A trained model continues repeated text, and its trained head is accepted more often
        # than not (as on the CPU, tests/test_speculative.py).
        assert stats["spec_accepted_tokens"] > 0, stats
        if method == "mtp":
            assert stats["spec_mean_accepted_length"] > 1.0, stats


@pytest.mark.parametrize("method,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_a_batch_of_8_with_mixed_k_and_chunked_prefill_on_cuda_equals_plain(method, name, request):
    """Eight requests with their own K (0 to 4) and lengths, prompts prefilled in 16-token
    chunks: steps mix prompt chunks, plain decodes and verify chunks, and rejected drafts roll the
    hybrid's recurrent state back through the rollback slots (`copy_state`)."""
    model_dir = _model_dir(name, request)
    params = [greedy(12 + 5 * i, draft_tokens=i % 5) for i in range(8)]
    plain, _ = _generate(model_dir, PROMPTS, [greedy(p.max_tokens) for p in params], prefill_chunk=16)
    spec, stats = _generate(model_dir, PROMPTS, params, draft_tokens=4, prefill_chunk=16, **_spec(method, name, request))
    _assert_equal_but_at_near_ties(plain, spec, f"{method} mixed K on {name}")
    assert stats["spec_drafted_tokens"] > 0
    assert len(stats["spec_acceptance_by_position"]) <= 4
    assert stats["kv_blocks_used"] == 0


# Greedy verification on the device: a greedy request without logprobs has every verify row
# picked by the device sampler's greedy kernel (only ids come back); with device_sampling=False,
# or with logprobs asked for, the same rows are picked on the host from the same f32 logits.

def _core_run(model_dir, params, **engine):
    """Each request's token ids and its last delta's draft counts, PROMPTS on `_core.Engine`;
    `params`: one for all, or a list (one a prompt)."""
    eng = _core.Engine(str(model_dir), device="cuda", max_context=512, max_concurrency=8, logits_dtype="float32",
                       **engine)
    tok = eng.tokenizer
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", list(tok.encode(p, True)), params[i] if isinstance(params, list) else params)
    ids, spec = {}, {}
    while eng.has_unfinished():
        for d in eng.step():
            ids.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                spec[d.request_id] = d.spec
    stats = eng.stats()
    eng.shutdown()
    return [ids[f"r{i}"] for i in range(len(PROMPTS))], [spec[f"r{i}"] for i in range(len(PROMPTS))], stats


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_greedy_verify_by_device_argmax_equals_the_host_route(method, name, k, request):
    """Eight greedy requests with drafts: picked on the device, on the host (device_sampling off)
    and on the host for their logprobs, the tokens and each request's accepted counts are equal;
    the tokens equal plain greedy output up to near-ties."""
    model_dir = _model_dir(name, request)
    params = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
    opts = _spec(method, name, request)
    dev, dev_spec, stats = _core_run(model_dir, _core.SamplingParams(**params), draft_tokens=k, **opts)
    host, host_spec, _ = _core_run(model_dir, _core.SamplingParams(**params), draft_tokens=k, device_sampling=False,
                                   **opts)
    lp, lp_spec, _ = _core_run(model_dir, _core.SamplingParams(**params, logprobs=True, top_logprobs=2), draft_tokens=k,
                               **opts)
    assert stats["spec_verify_steps"] > 0 and stats["spec_drafted_tokens"] > 0
    assert dev == host == lp
    for a, b, c in zip(dev_spec, host_spec, lp_spec):
        assert (a["drafted"], a["accepted"], a["acceptance_by_position"]) == (b["drafted"], b["accepted"], b["acceptance_by_position"])
        assert (a["drafted"], a["accepted"]) == (c["drafted"], c["accepted"])
    plain = _plain_greedy(model_dir, 48)
    _assert_equal_but_at_near_ties(plain, [SimpleNamespace(token_ids=t) for t in dev[:3]], f"{method} K={k} device argmax on {name}")


@pytest.mark.parametrize("method,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_a_verify_step_mixing_device_argmax_and_host_rows_equals_the_host_route(method, name, request):
    """Greedy requests beside seeded sampled ones (K = 3): each verify step picks the greedy
    chunks on the device and copies the sampled chunks' logits. The same batch with the greedy
    requests wanting logprobs (all on the host) gives the same tokens and counts, request by
    request (the sampled requests are the same in both runs, so the steps are too)."""
    model_dir = _model_dir(name, request)
    sampled = dict(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True)
    greedy_ = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    def params(logprobs):
        return [_core.SamplingParams(**sampled, seed=i) if i % 2 else
                _core.SamplingParams(**greedy_, **(dict(logprobs=True) if logprobs else {})) for i in range(len(PROMPTS))]
    dev, dev_spec, stats = _core_run(model_dir, params(False), draft_tokens=3, **_spec(method, name, request))
    host, host_spec, _ = _core_run(model_dir, params(True), draft_tokens=3, **_spec(method, name, request))
    assert stats["spec_verify_steps"] > 0 and stats["spec_drafted_tokens"] > 0
    assert dev == host
    assert [(a["drafted"], a["accepted"]) for a in dev_spec] == [(b["drafted"], b["accepted"]) for b in host_spec]


@pytest.mark.parametrize("size", [2048, 32768])
def test_lm_head_draft_on_cuda_equals_plain_greedy_and_drafts_within_its_vocabulary(size):
    """`--lm-head-draft` on the demo model (K = 3, the first `size` ids of its draft_vocab.json):
    greedy output equals plain greedy output on the GPU (up to near-ties), drafts are accepted,
    and the mean accepted length is within 0.25 of the CPU's with the same reduced head."""
    _needs_cuda()
    model_dir = DEMO / "model"
    plain = _plain_greedy(model_dir, 48)
    opts = dict(spec="mtp", draft_tokens=3, lm_head_draft=True, lm_head_draft_size=size)
    spec, stats = _generate(model_dir, PROMPTS[:3], greedy(48), **opts)
    _assert_equal_but_at_near_ties(plain, spec, f"--lm-head-draft {size} on the demo")
    assert stats["spec_accepted_tokens"] > 0, stats
    with LLM(model_dir, device="cpu", max_concurrency=8, max_context=512, logits_dtype="float32", **opts) as llm:
        llm.generate([llm.encode(p) for p in PROMPTS[:3]], greedy(48))
        cpu = llm.engine.stats()
    print(f"--lm-head-draft {size}: mean accepted length GPU {stats['spec_mean_accepted_length']:.3f}, "
          f"CPU {cpu['spec_mean_accepted_length']:.3f}")
    assert abs(stats["spec_mean_accepted_length"] - cpu["spec_mean_accepted_length"]) < 0.25


# The MTP head's drafts on the GPU against the CPU drafter.

@pytest.mark.parametrize("name", ["demo", "qwen3_5_mtp"])
def test_mtp_drafts_on_cuda_equal_the_cpu_drafts(name, request):
    """Greedy MTP drafts (K = 5) after prompts of 9-51 tokens, made as the engine makes them
    (prefill, absorb, draft: `Model.mtp_greedy_drafts`) on the GPU and on the CPU, each equal to
    the CPU drafter's (`_core.MtpDrafter`, which gives its logits) up to a near-tie of its target
    or MTP logits; on the trained demo head most GPU drafts equal it throughout."""
    model_dir = _model_dir(name, request)
    k = 5
    cpu_model = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
    if name == "demo":
        seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
        prompts = [seqs[i % len(seqs)][40 * i:40 * i + 9 + 6 * i] for i in range(8)]
    else:
        prompts = [_ids(9 + 6 * i, cpu_model.config["vocab_size"], seed=90 + i) for i in range(8)]
    gpu_next, gpu_drafts = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").mtp_greedy_drafts(prompts, k)
    cpu_next, cpu_drafts = cpu_model.mtp_greedy_drafts(prompts, k)
    ref = _core.MtpDrafter(str(model_dir), logits_dtype="float32")
    equal = {"cpu": 0, "gpu": 0}
    for i, p in enumerate(prompts):
        logits, hidden = ref.target(p)
        g = int(np.argmax(logits[-1]))
        tokens, mtp_logits = ref.draft(np.ascontiguousarray(hidden), p[1:] + [g], 0, k)
        for where, nxt, drafts in (("cpu", cpu_next[i], cpu_drafts[i]), ("gpu", gpu_next[i], gpu_drafts[i])):
            if nxt != g:
                gap = _gap(logits[-1])
                print(f"{name} prompt {i}: {where} target token {nxt}, drafter's {g} (top-2 gap {gap:.3f})")
                assert gap < NEAR_TIE
                continue
            assert len(drafts) == k
            d = next((j for j in range(k) if drafts[j] != tokens[j]), None)
            if d is None:
                equal[where] += 1
                continue
            gap = _gap(mtp_logits[d])
            print(f"{name} prompt {i}: {where} draft {d} is {drafts[d]}, the CPU drafter's {tokens[d]} (top-2 gap {gap:.3f})")
            assert gap < NEAR_TIE
    print(f"{name}: drafts equal to the CPU drafter's: {equal} of {len(prompts)}")
    if name == "demo":
        assert equal["gpu"] >= len(prompts) // 2


def test_sampled_mtp_drafts_on_cuda_are_drawn_from_the_cpu_drafters_q():
    """Sampled MTP drafts (K = 4, temperature 0.8, top-p 0.95) on the trained demo head: each
    depth's q on the GPU is the CPU drafter's to within the logits' agreement, sums to 1, and the
    draft drawn with the same uniform is the CPU's unless the draw sits at a boundary of q's
    cumulative sum that the two q place differently (the rest of that sequence then differs)."""
    _needs_cuda()
    model_dir = DEMO / "model"
    k = 4
    seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    prompts = [seqs[i % len(seqs)][40 * i:40 * i + 12 + 5 * i] for i in range(8)]
    rng = np.random.default_rng(11)
    u = [[float(x) for x in rng.random(k)] for _ in prompts]
    kw = dict(temperature=0.8, top_p=0.95)
    g_next, g_drafts, g_q = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").mtp_sampled_drafts(prompts, k, u, **kw)
    c_next, c_drafts, c_q = _core.Model(str(model_dir), device="cpu", logits_dtype="float32").mtp_sampled_drafts(prompts, k, u, **kw)
    equal = 0
    for i in range(len(prompts)):
        if g_next[i] != c_next[i]:
            continue  # a target near-tie (test_mtp_drafts_on_cuda_equal_the_cpu_drafts bounds those)
        assert len(g_drafts[i]) == k and len(g_q[i]) == k
        for d in range(k):
            qg, qc = np.asarray(g_q[i][d]), np.asarray(c_q[i][d])
            assert abs(qg.sum() - 1.0) < 1e-3
            assert np.abs(qg - qc).max() < 0.03, f"prompt {i} depth {d}"
            if g_drafts[i][d] != c_drafts[i][d]:
                gap = np.abs(np.cumsum(qc) - u[i][d]).min()
                print(f"prompt {i}: draft {d} is {g_drafts[i][d]} on the GPU, {c_drafts[i][d]} on the CPU (CDF gap {gap:.4f})")
                assert gap < 0.03
                break
        else:
            equal += 1
    print(f"sampled drafts equal to the CPU's: {equal} of {len(prompts)}")
    assert equal >= len(prompts) // 2


# The DFlash drafter's drafts on the GPU against the CPU drafter.

def _dflash_prompts(name: str, vocab: int, n: int = 8) -> list:
    if name == "demo":
        seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
        return [seqs[i % len(seqs)][40 * i:40 * i + 9 + 6 * (i % 8)] for i in range(n)]
    return [_ids(9 + 6 * (i % 8), vocab, seed=190 + i) for i in range(n)]


DFLASH_DRAFT_CASES = [("demo", 0, 8), ("demo", 16, 8), ("qwen3_5_dflash", 0, 8), ("qwen3_5_dflash", 16, 8), ("qwen3_5_dflash", 16, 40)]


@pytest.mark.parametrize("name,chunk,n", DFLASH_DRAFT_CASES, ids=[f"{m}-chunk{c}-{n}seqs" for m, c, n in DFLASH_DRAFT_CASES])
def test_dflash_drafts_on_cuda_equal_the_cpu_drafts(name, chunk, n, request):
    """Greedy DFlash drafts (a whole block) after prompts of 9-51 tokens prefilled together,
    whole or in 16-token chunks (context rows absorbed from several steps and several chunks a
    step), made as the engine makes them (`Model.dflash_drafts`: prefill, absorb, one batched
    drafting call) on the GPU and on the CPU; 40 sequences take two drafting forwards on the GPU
    (its groups of 32 share the spare pages). The anchors are the CPU reference's up to a
    target near-tie, and every draft, each depth drafted from the context and the anchor alone,
    is the argmax of the CPU drafter's logits at its depth (`_core.DflashDrafter`) unless that
    row is a near-tie; on the trained demo drafter most blocks equal it throughout. On the tiny
    model the drafter reads the last layer, whose features are the final norm's."""
    model_dir, drafter = _model_dir(name, request), _drafter(name, request)
    cpu_model = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
    prompts = _dflash_prompts(name, cpu_model.config["vocab_size"], n)
    ref = _core.DflashDrafter(str(model_dir), str(drafter), max_tokens=128)
    k = ref.block_size - 1
    gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").dflash_drafts(prompts, str(drafter), k, chunk=chunk)
    cpu = cpu_model.dflash_drafts(prompts, str(drafter), k, chunk=chunk)
    equal = {"cpu": 0, "gpu": 0}
    for i, p in enumerate(prompts):
        logits, feats = ref.target(p)
        g = int(np.argmax(logits[-1]))
        ref.absorb(np.ascontiguousarray(feats), 0)
        want = ref.draft_logits(g)
        for where, (nxt, drafts, _) in (("cpu", cpu), ("gpu", gpu)):
            if nxt[i] != g:
                gap = _gap(logits[-1])
                print(f"{name} prompt {i}: {where} target token {nxt[i]}, the reference's {g} (top-2 gap {gap:.3f})")
                assert gap < NEAR_TIE
                continue
            assert len(drafts[i]) == k
            off = [d for d in range(k) if drafts[i][d] != int(np.argmax(want[d]))]
            for d in off:
                gap = _gap(want[d])
                print(f"{name} prompt {i}: {where} draft {d} is {drafts[i][d]}, the reference's {int(np.argmax(want[d]))} (top-2 gap {gap:.3f})")
                assert gap < NEAR_TIE
            equal[where] += not off
    print(f"{name}: blocks equal to the CPU drafter's: {equal} of {len(prompts)}")
    if name == "demo":
        assert equal["gpu"] >= len(prompts) // 2


@pytest.mark.parametrize("name", ["demo", "qwen3_5_dflash"])
def test_sampled_dflash_drafts_on_cuda_are_drawn_from_the_cpu_drafters_q(name, request):
    """Sampled DFlash drafts (a whole block, temperature 0.8, top-p 0.95): each depth's q on the
    GPU is the CPU drafter's to within the logits' agreement and sums to 1, and the draft drawn
    with the same uniform is the CPU's unless the draw sits at a boundary of q's cumulative sum
    that the two q place differently (depths are drawn independently, so each is checked)."""
    model_dir, drafter = _model_dir(name, request), _drafter(name, request)
    cpu_model = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
    prompts = _dflash_prompts(name, cpu_model.config["vocab_size"])
    k = json.loads((Path(drafter) / "config.json").read_text())["dflash_config"]["block_size"] - 1
    rng = np.random.default_rng(13)
    u = [[float(x) for x in rng.random(k)] for _ in prompts]
    kw = dict(u=u, temperature=0.8, top_p=0.95)
    g_next, g_drafts, g_q = _core.Model(str(model_dir), device="cuda", logits_dtype="float32").dflash_drafts(prompts, str(drafter), k, **kw)
    c_next, c_drafts, c_q = cpu_model.dflash_drafts(prompts, str(drafter), k, **kw)
    compared = 0
    for i in range(len(prompts)):
        if g_next[i] != c_next[i]:
            continue  # a target near-tie (test_dflash_drafts_on_cuda_equal_the_cpu_drafts bounds those)
        assert len(g_drafts[i]) == k and len(g_q[i]) == k
        for d in range(k):
            qg, qc = np.asarray(g_q[i][d]), np.asarray(c_q[i][d])
            assert abs(qg.sum() - 1.0) < 1e-3
            # The bf16 drafter against the f32 CPU one: the deepest depths of a block drift most,
            # past 0.03 on the demo drafter.
            assert np.abs(qg - qc).max() < 0.06, f"prompt {i} depth {d}"
            if g_drafts[i][d] != c_drafts[i][d]:
                gap = np.abs(np.cumsum(qc) - u[i][d]).min()
                print(f"prompt {i}: draft {d} is {g_drafts[i][d]} on the GPU, {c_drafts[i][d]} on the CPU (CDF gap {gap:.4f})")
                assert gap < 0.03
        compared += 1
    assert compared >= len(prompts) // 2


#: A long shared prefix and suffixes (tests/test_dflash_prefix.py).
_PREFIX = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def __len__(self):\n"
    "        return len(self.items)\n\nclass Queue:\n    def __init__(self):\n"
)
_SUFFIXES = ["        self.items = []\n", "        self.head = None\n", "        self.data = {}\n"]


@pytest.mark.parametrize("name", ["demo", "qwen3_5_dflash"])
def test_greedy_dflash_with_prefix_hits_on_cuda_equals_plain_and_drafts_as_without_the_hits(name, request):
    """The prefix, then prompts extending it, each alone on one engine: requests after the first
    hit the cached blocks, whose drafter context rows the first request's steps wrote on the
    device. Greedy output equals plain greedy output up to near-ties with prefix reuse and
    without, the hits are taken, and on the trained demo drafter the requests after a hit accept
    about as many drafts as without it (context rows left unwritten would accept next to none;
    the two runs' prefills differ in their steps' shapes, so a near-tie may move a draft)."""
    model_dir = _model_dir(name, request)
    opts = dict(max_context=512, max_concurrency=8, logits_dtype="float32", draft_tokens=4, **_spec("dflash", name, request))

    def sequential(**extra):
        outs, stats = [], []
        with LLM(model_dir, device="cuda", **opts, **extra) as llm:
            for text in [_PREFIX] + [_PREFIX + s for s in _SUFFIXES]:
                [o] = llm.generate(llm.encode(text), greedy(32))
                outs.append(o)
                stats.append(llm.engine.stats())
        return outs, stats

    reuse, reuse_stats = sequential()
    fresh, fresh_stats = sequential(prefix_reuse=False)
    with LLM(model_dir, device="cuda", max_context=512, logits_dtype="float32") as llm:
        plain = llm.generate([llm.encode(_PREFIX)] + [llm.encode(_PREFIX + s) for s in _SUFFIXES], greedy(32))
    _assert_equal_but_at_near_ties(plain, reuse, f"dflash with prefix hits on {name}")
    _assert_equal_but_at_near_ties(plain, fresh, f"dflash without prefix reuse on {name}")
    cached = [o.usage.cached_tokens for o in reuse]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached
    assert all(o.usage.cached_tokens == 0 for o in fresh)
    assert reuse_stats[-1]["prefix_hit_tokens"] == sum(cached)

    def after_first(stats, key):
        return stats[-1][key] - stats[0][key]

    print(f"{name}: drafted / accepted after the first request, with hits "
          f"{after_first(reuse_stats, 'spec_drafted_tokens')} / {after_first(reuse_stats, 'spec_accepted_tokens')}, without "
          f"{after_first(fresh_stats, 'spec_drafted_tokens')} / {after_first(fresh_stats, 'spec_accepted_tokens')}")
    assert after_first(reuse_stats, "spec_drafted_tokens") > 0
    if name == "demo":
        assert after_first(reuse_stats, "spec_accepted_tokens") >= 0.75 * after_first(fresh_stats, "spec_accepted_tokens") > 0


def _safetensors_numel(path: Path) -> int:
    """Elements of every tensor in a safetensors file (from its header)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(int(np.prod(t["shape"])) for k, t in header.items() if k != "__metadata__")


def test_the_ledger_counts_the_dflash_drafter_on_cuda():
    """`--spec dflash` on CUDA: the drafter's weights (every tensor in the 16-bit storage type)
    are in the ledger's weights, its context (K and V of each of its layers, in the storage type)
    in every token's KV bytes, so the pool's bytes cover it, and the features every forward keeps
    in the workspace."""
    _needs_cuda()
    if not (DEMO_DRAFTER / "config.json").exists():
        pytest.skip("demo drafter not shipped")
    opts = dict(device="cuda", max_context=1024, kv_capacity=4096, prefill_chunk=256)
    plain = _core.Engine(str(DEMO / "model"), **opts).info()
    spec = _core.Engine(str(DEMO / "model"), spec="dflash", drafter=str(DEMO_DRAFTER), **opts).info()
    d = json.loads((DEMO_DRAFTER / "config.json").read_text())
    context = d["num_hidden_layers"] * 2 * d["num_key_value_heads"] * d["head_dim"] * 2
    assert spec["kv_bytes_per_token"] - plain["kv_bytes_per_token"] == context
    assert spec["weight_bytes"] - plain["weight_bytes"] == 2 * _safetensors_numel(DEMO_DRAFTER / "model.safetensors")
    assert spec["kv_bytes"] == spec["num_blocks"] * spec["block_size"] * spec["kv_bytes_per_token"]
    features = 256 * len(d["dflash_config"]["target_layer_ids"]) * d["hidden_size"] * 2
    assert spec["workspace_bytes"] - plain["workspace_bytes"] >= features
    assert spec["total_bytes"] == spec["weight_bytes"] + spec["kv_bytes"] + spec["state_bytes"] + spec["workspace_bytes"]


# Refusals that stay.

def test_mtp_without_mtp_weights_and_a_drafter_the_kernels_lack_are_refused_on_cuda_naming_the_flag(tiny_checkpoints, tmp_path):
    _needs_cuda()
    from test_dflash import write_random_drafter

    plain = tiny_checkpoints.get("qwen3_5", **GPU_SHAPES["qwen3_5"])
    with pytest.raises(Exception, match=r"mtp\.\* weights"):
        LLM(plain, device="cuda", max_context=256, spec="mtp")
    # A drafter whose head size the attention kernels are not instantiated for (16); its block of
    # 5 tokens takes at most 4 drafts.
    drafter = write_random_drafter(tmp_path / "drafter", plain, seed=3)
    with pytest.raises(Exception, match=r"--drafter.*head_dim 16 on the CUDA backend is not supported yet"):
        LLM(plain, device="cuda", max_context=256, spec="dflash", drafter=str(drafter), draft_tokens=4)
