"""DFlash block-diffusion drafting (`spec="dflash"`, `drafter=DIR`) on the CPU backend.

The Rust drafter's logits equal the PyTorch reference (tools/dflash/dflash_model.py, fed by
transformers' hidden states of the target) on a tiny random Qwen3.5 with a random drafter;
greedy output with DFlash drafts equals plain greedy output token for token on the bundled demo
model (with its shipped drafter, the default there) and on the tiny checkpoint, alone and in a
batch with mixed parameters, per-request K (0: off) and chunked prefill; sampled requests draw
their drafts from the drafter's distribution and follow plain sampling's distribution (a
chi-square test on the demo); bad drafter options are refused naming the flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ninfer import LLM, SamplingParams, _core
from test_speculative import _assert_as_plain, async_answer

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = Path(os.environ.get("NINFER_DEMO_DIR", REPO / "python" / "ninfer" / "demo"))
DEMO_MODEL = DEMO_DIR / "model"
DEMO_DRAFTER = DEMO_DIR / "dflash"
REL_TOL = 1e-4
"""As tests/test_model_parity.py: max abs diff over max abs reference."""

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "12 + 34 = 46. 12 + 34 =",
    "The weather in Paris is nice. The weather in",
]


def _reference():
    sys.path.insert(0, str(REPO / "tools" / "dflash"))
    import dflash_model

    return dflash_model


def write_random_drafter(out: Path, target: Path, *, seed: int = 0, layer_ids=(0, 2, 3), block_size: int = 5, **config) -> Path:
    """A random drafter for `target` in the public layout (f32), norms moved off 1."""
    import torch

    ref = _reference()
    t = json.loads((target / "config.json").read_text())
    t = t.get("text_config", t)
    c = ref.DFlashConfig(hidden_size=t["hidden_size"], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=40, vocab_size=t["vocab_size"], target_layer_ids=list(layer_ids),
                         block_size=block_size, mask_token_id=t["vocab_size"] - 3, num_target_layers=t["num_hidden_layers"],
                         rms_norm_eps=t["rms_norm_eps"])
    for k, v in config.items():
        setattr(c, k, v)
    torch.manual_seed(seed)
    d = ref.DFlashDrafter(c)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn(p.shape) if name.endswith("norm.weight") else 0.15 * torch.randn(p.shape))
    d.save(out, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory):
    """(tiny random Qwen3.5 target, random drafter for it reading its layers 0, 2 and the last)."""
    target = tiny_checkpoints.get("qwen3_5")
    return target, write_random_drafter(tmp_path_factory.mktemp("dflash") / "drafter", target, seed=3)


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def _run(model_dir, prompts, params, **engine):
    engine.setdefault("max_context", 512)
    engine.setdefault("max_concurrency", 8)
    with LLM(model_dir, **engine) as llm:
        outs = llm.generate([llm.encode(p) for p in prompts], params)
        return [(o.token_ids, o.finish_reason) for o in outs], llm.engine.stats()


def _rel_err(got, exp) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(exp)).max() / np.abs(np.asarray(exp)).max())


def test_rust_drafter_logits_equal_the_pytorch_reference(tiny):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import load_reference

    target, drafter_dir = tiny
    ref = _reference()
    model = load_reference(target)
    text = getattr(model.model, "language_model", model.model)
    drafter = ref.DFlashDrafter.load(drafter_dir)
    ids = [5, 17, 99, 4, 56, 23, 8, 71, 100, 3, 42, 5, 64, 9, 31, 77, 12, 7]
    with torch.no_grad():
        out = text(input_ids=torch.tensor([ids]), output_hidden_states=True)
        feats = ref.target_features(out.hidden_states, drafter.c.target_layer_ids)[0]
    embed = text.embed_tokens.weight.detach()
    lm_head = model.lm_head.weight.detach()
    rust = _core.DflashDrafter(str(target), str(drafter_dir), max_tokens=64)
    assert rust.block_size == 5
    _, rust_feats = rust.target(ids)
    assert _rel_err(rust_feats, feats.numpy()) < REL_TOL
    for n in (1, 9, 15):
        rust.absorb(np.ascontiguousarray(rust_feats[:n]), 0)
        got = rust.draft_logits(ids[n])
        want = drafter.draft_logits(feats[:n], ids[n], embed, lm_head).numpy()
        assert got.shape == want.shape == (4, embed.shape[0])
        assert _rel_err(got, want) < REL_TOL, n
    # Rolled back from 15 context rows to 12 and grown to 14 again, as rejected drafts are.
    rust.absorb(np.ascontiguousarray(rust_feats[12:14]), 12)
    want = drafter.draft_logits(feats[:14], ids[14], embed, lm_head).numpy()
    assert _rel_err(rust.draft_logits(ids[14]), want) < REL_TOL


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_dflash_equals_plain_on_a_tiny_random_checkpoint(tiny, k):
    target, drafter = tiny
    plain, _ = _run(target, PROMPTS[:2], greedy(40))
    spec, stats = _run(target, PROMPTS[:2], greedy(40), spec="dflash", drafter=str(drafter), draft_tokens=k)
    assert spec == plain
    assert stats["spec_drafted_tokens"] > 0 and len(stats["spec_acceptance_by_position"]) <= k


def _mixed_params(draft_tokens):
    params = [
        greedy(40),
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
        greedy(1),
        greedy(25, frequency_penalty=0.5, logit_bias={5: 1.0}),
        SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=33, ignore_eos=True, presence_penalty=0.3),
        greedy(7),
        greedy(48, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
    ]
    if draft_tokens:
        import dataclasses

        # Per request: 0 (no drafts) to 4.
        params = [dataclasses.replace(p, draft_tokens=i % 5) for i, p in enumerate(params)]
    return params


@pytest.mark.parametrize("model", ["tiny", "demo"])
def test_a_batch_with_mixed_parameters_per_request_k_and_chunked_prefill_equals_plain(tiny, model):
    if model == "demo":
        if not (DEMO_DRAFTER / "config.json").exists():
            pytest.skip("demo drafter not shipped")
        model_dir, engine = DEMO_MODEL, {}
    else:
        model_dir, engine = tiny[0], {"drafter": str(tiny[1])}
    plain, _ = _run(model_dir, PROMPTS, _mixed_params(False))
    spec, stats = _run(model_dir, PROMPTS, _mixed_params(True), spec="dflash", draft_tokens=4, prefill_chunk=16, **engine)
    _assert_as_plain("dflash", _mixed_params(True), spec, plain)
    again, _ = _run(model_dir, PROMPTS, _mixed_params(True), spec="dflash", draft_tokens=4, prefill_chunk=16, **engine)
    assert again == spec, "seeded requests draw the same drafts and tokens on every run"
    assert stats["spec_drafted_tokens"] > 0
    assert len(stats["spec_acceptance_by_position"]) <= 4, "no request drafts more than its own 4"
    assert stats["kv_blocks_used"] == 0
    if model == "demo":
        assert stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.skipif(not (DEMO_DRAFTER / "config.json").exists(), reason="demo drafter not shipped")
@pytest.mark.parametrize("k", [3, 7])
def test_greedy_dflash_equals_plain_on_the_demo_with_its_default_drafter(k):
    plain, _ = _run(DEMO_MODEL, PROMPTS[:3], greedy(64))
    spec, stats = _run(DEMO_MODEL, PROMPTS[:3], greedy(64), spec="dflash", draft_tokens=k)
    assert spec == plain
    # The shipped drafter is trained: its drafts are accepted, more than the target's own token
    # per verify step (benches/results/dflash_acceptance.json has the held-out figures).
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_mean_accepted_length"] > 1.0, stats
    assert len(stats["spec_acceptance_by_position"]) == k


@pytest.mark.skipif(not (DEMO_DRAFTER / "config.json").exists(), reason="demo drafter not shipped")
def test_the_demo_drafter_fits_in_10_mb_and_is_in_the_public_layout():
    files = {p.name: p.stat().st_size for p in DEMO_DRAFTER.iterdir() if p.is_file()}
    assert set(files) >= {"config.json", "model.safetensors"}
    assert sum(files.values()) <= 10 * 1024 * 1024, files
    cfg = json.loads((DEMO_DRAFTER / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert set(cfg["dflash_config"]) >= {"block_size", "mask_token_id", "target_layer_ids"}
    record = json.loads((REPO / "tools" / "dflash" / "training_record.json").read_text())
    assert record["config"] == cfg


def test_the_async_engine_takes_the_drafter(tiny):
    target, drafter = tiny
    params = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
    plain, _ = async_answer(target, PROMPTS[1], params)
    spec, last = async_answer(target, PROMPTS[1], params, spec="dflash", drafter=str(drafter), draft_tokens=3)
    assert spec == plain
    assert last.spec is not None and last.spec["drafted"] > 0


def test_bad_drafter_options_are_refused_naming_the_flag(tiny, tmp_path):
    target, drafter = tiny
    small = write_random_drafter(tmp_path / "small", target, hidden_size=48)
    no_ids = write_random_drafter(tmp_path / "no_ids", target)
    cfg = json.loads((no_ids / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (no_ids / "config.json").write_text(json.dumps(cfg))
    cases = [
        ({"spec": "dflash"}, "--spec dflash needs --drafter"),
        ({"spec": "dflash", "drafter": str(tmp_path / "missing")}, "no such drafter directory"),
        ({"spec": "dflash", "drafter": str(small)}, "hidden_size 48 does not match the target's 72"),
        ({"spec": "dflash", "drafter": str(no_ids)}, "target_layer_ids"),
        ({"spec": "dflash", "drafter": str(drafter), "draft_tokens": 5}, "--draft-tokens"),
        ({"spec": "ngram", "drafter": str(drafter)}, "--drafter"),
        ({"drafter": str(drafter)}, "needs --spec dflash"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(Exception) as e:
            LLM(target, max_context=256, **kwargs)
        msg = str(e.value)
        assert needle in msg and ("--drafter" in msg or "--draft-tokens" in msg), (kwargs, msg)
    # A drafter with a tensor missing names it.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(drafter / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((drafter / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(Exception) as e:
        LLM(target, max_context=256, spec="dflash", drafter=str(broken))
    assert "--drafter" in str(e.value) and "layers.1.mlp.up_proj.weight" in str(e.value)


def test_the_cli_refuses_a_drafter_without_spec_dflash(tiny, ninfer_env):
    target, drafter = tiny
    for args, needle in [
        (["--drafter", str(drafter)], "--drafter"),
        (["--spec", "ngram", "--drafter", str(drafter)], "needs --spec dflash"),
        (["--spec", "dflash", "--drafter", str(drafter) + "-missing"], "no such drafter directory"),
    ]:
        r = subprocess.run([sys.executable, "-m", "ninfer.cli", "run", str(target), "--prompt", "hi", *args],
                           capture_output=True, text=True, env=ninfer_env, timeout=120)
        assert r.returncode != 0 and needle in r.stderr, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "run", str(target), "--prompt", "one two three",
                        "--max-new", "8", "--greedy", "--spec", "dflash", "--drafter", str(drafter),
                        "--draft-tokens", "3"], capture_output=True, text=True, env=ninfer_env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "speculation drafted" in r.stderr


def test_a_tight_kv_pool_preempts_and_recomputes_with_drafts_as_without(tiny):
    target, drafter = tiny
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=60, ignore_eos=True) for i in range(8)]
    # 32 blocks of 16 for 8 requests of ~80 tokens: some are preempted and recomputed from 0,
    # which cuts their drafter context back to 0.
    plain, plain_stats = _run(target, PROMPTS, params, kv_capacity=512, max_context=256)
    spec, stats = _run(target, PROMPTS, params, kv_capacity=512, max_context=256, spec="dflash", drafter=str(drafter), draft_tokens=4)
    _assert_as_plain("dflash", params, spec, plain)
    assert plain_stats["preemptions"] > 0 and stats["preemptions"] > 0 and stats["spec_drafted_tokens"] > 0


def _demo_or_tiny(tiny):
    if (DEMO_DRAFTER / "config.json").exists():
        return DEMO_MODEL, {}
    return tiny[0], {"drafter": str(tiny[1])}


def test_stop_strings_and_eos_inside_drafts_end_the_request_as_without(tiny):
    model_dir, engine = _demo_or_tiny(tiny)
    with LLM(model_dir, max_context=512) as llm:
        ids = llm.encode(PROMPTS[2])
        [free] = llm.generate(ids, greedy(40))
        text = free.text
        eos = free.token_ids[len(free.token_ids) // 2]
    stop = text[len(text) // 2: len(text) // 2 + 3] if len(text) > 6 else None
    cases = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[eos])]
    if stop and stop.strip():
        cases.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))
    for params in cases:
        with LLM(model_dir, max_context=512) as llm:
            [a] = llm.generate(ids, params)
        with LLM(model_dir, max_context=512, spec="dflash", draft_tokens=4, **engine) as llm:
            [b] = llm.generate(ids, params)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert a.finish_reason == "stop"


def test_a_json_schema_grammar_with_drafts_equals_plain(tiny):
    model_dir, engine = _demo_or_tiny(tiny)
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
              "required": ["xs"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "xs", "schema": schema}}
    params = [SamplingParams(temperature=0.0, max_tokens=120, response_format=fmt),
              SamplingParams(temperature=0.9, seed=2, max_tokens=120, response_format=fmt)]
    prompts = ['{"xs": [1, 2, 3]} {"xs": [1, 2, 3]} {"xs": [1, 2, ', PROMPTS[1]]
    with LLM(model_dir, max_context=512) as llm:
        plain = [(o.text, o.finish_reason) for o in llm.generate([llm.encode(p) for p in prompts], params)]
    with LLM(model_dir, max_context=512, spec="dflash", draft_tokens=4, **engine) as llm:
        spec = [(o.text, o.finish_reason) for o in llm.generate([llm.encode(p) for p in prompts], params)]
    # Greedy: plain's text. Sampled (drafts drawn from the drafter's distribution): a document
    # of the schema, as plain's is.
    assert spec[0] == plain[0]
    for text, finish in (plain[1], spec[1]):
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            doc = json.loads(text)
            assert set(doc) == {"xs"} and all(isinstance(x, int) for x in doc["xs"]) and len(doc["xs"]) <= 6, text


def test_a_server_with_dflash_answers_as_without_and_reports_the_drafts(tiny):
    import httpx

    from ninfer.server.metrics import parse_metrics
    from server_process import ServerProcess

    target, drafter = tiny
    body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    answers = []
    for extra in ([], ["--spec", "dflash", "--drafter", str(drafter), "--draft-tokens", "3"]):
        with ServerProcess([str(target), "--model-id", "m", "--device", "cpu", "--max-context", "256", *extra]) as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            m = parse_metrics(httpx.get(s.url + "/metrics", timeout=10).text)
    assert answers[0] == answers[1]
    assert m["ninfer_spec_drafted_tokens_total"] > 0


def _chi_square(a: list[tuple], b: list[tuple]) -> tuple[float, int]:
    """Pearson's chi-square statistic of homogeneity of two equally large samples, with the
    cells of fewer than 10 draws in both together pooled into one; and its degrees of freedom."""
    cells: dict[tuple, list[int]] = {}
    for side, sample in enumerate((a, b)):
        for x in sample:
            cells.setdefault(x, [0, 0])[side] += 1
    table, rare = [], [0, 0]
    for c in cells.values():
        if sum(c) < 10:
            rare = [rare[0] + c[0], rare[1] + c[1]]
        else:
            table.append(c)
    if sum(rare):
        table.append(rare)
    stat = sum((c[0] - c[1]) ** 2 / (c[0] + c[1]) for c in table)
    return stat, len(table) - 1


@pytest.mark.skipif(not (DEMO_DRAFTER / "config.json").exists(), reason="demo drafter not shipped")
def test_sampled_dflash_drafts_follow_plain_sampling_by_a_chi_square_test():
    """Seeded sampled requests on the demo with its trained drafter: the first four tokens'
    joint distribution over 400 seeds is that of plain sampling (chi-square of homogeneity at
    1e-3, Wilson-Hilferty quantile). Their drafts are drawn from the drafter's distribution and
    verified by the speculative sampling rule, not drawn as plain decoding draws: drafts are
    accepted, and the tokens of some seeds differ from plain decoding's."""
    n = 400
    params = [SamplingParams(temperature=1.0, top_k=2, seed=7000 + i, max_tokens=4, ignore_eos=True) for i in range(n)]
    prompts = [PROMPTS[0]] * n  # code: the drafter is accepted often
    plain, _ = _run(DEMO_MODEL, prompts, params, max_concurrency=64)
    spec, stats = _run(DEMO_MODEL, prompts, params, max_concurrency=64, spec="dflash", draft_tokens=3)
    a, b = [tuple(t) for t, _ in plain], [tuple(t) for t, _ in spec]
    stat, df = _chi_square(a, b)
    z = 3.090  # the standard normal quantile at 1 - 1e-3
    limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert df >= 3 and stat < limit, (stat, df, limit)
    assert stats["spec_accepted_tokens"] > 0, stats
    assert 0 < sum(x != y for x, y in zip(a, b)) < n


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_draft_hook_drafts_what_the_drafter_gives_after_batched_chunked_prefill(tiny, chunk):
    """`Model.dflash_drafts` (the GPU suite's route to the runner's drafter: prompts prefilled
    together, whole or in chunks, each step's context rows absorbed, one batched drafting
    forward) on the CPU gives the greedy drafts of the reference drafter fed each prompt alone,
    and sampled drafts drawn from its q."""
    target, drafter_dir = tiny
    prompts = [[5 + 3 * i + j for j in range(4 + 5 * i)] for i in range(4)]
    ref = _core.DflashDrafter(str(target), str(drafter_dir), max_tokens=64)
    k = ref.block_size - 1
    model = _core.Model(str(target), device="cpu", logits_dtype="float32")
    nxt, drafts, q = model.dflash_drafts(prompts, str(drafter_dir), k, chunk=chunk)
    assert q == [[] for _ in prompts]
    u = [[0.5] * k for _ in prompts]
    s_nxt, s_drafts, s_q = model.dflash_drafts(prompts, str(drafter_dir), k, chunk=chunk, u=u, temperature=0.8)
    assert s_nxt == nxt
    for i, p in enumerate(prompts):
        logits, feats = ref.target(p)
        assert nxt[i] == int(np.argmax(logits[-1]))
        ref.absorb(np.ascontiguousarray(feats), 0)
        want = ref.draft_logits(nxt[i])
        assert drafts[i] == [int(np.argmax(row)) for row in want]
        for d in range(k):
            z = want[d].astype(np.float64) / 0.8
            want_q = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            assert np.abs(np.asarray(s_q[i][d]) - want_q).max() < 1e-4
            assert s_drafts[i][d] == int(np.searchsorted(np.cumsum(s_q[i][d]), 0.5, side="right"))
