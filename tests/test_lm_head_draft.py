"""`--lm-head-draft`: MTP drafts over the N most frequent ids of the model directory's
draft_vocab.json. Verification keeps the full vocabulary, so greedy output equals plain greedy
output (the demo model with its shipped file, and a tiny Qwen3.5 with a random MTP head and a
file made by `ninfer draft-vocab`); the command counts a corpus with the model's tokenizer; and
the flag without --spec mtp, or without a file, is refused naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ninfer import LLM, SamplingParams, _core

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = Path(os.environ.get("NINFER_DEMO_DIR", REPO / "python" / "ninfer" / "demo")) / "model"

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]

CORPUS = "the cat sat on the mat. the dog sat on the log. " * 20 + "a b c d e f g h\n" * 5


@pytest.fixture(scope="module")
def qwen3_5_mtp(tiny_checkpoints, tmp_path_factory):
    """A tiny Qwen3.5 with a random MTP head and no draft vocabulary."""
    from tiny_models import add_mtp_head

    path = tmp_path_factory.mktemp("lm_head_draft") / "qwen3_5_mtp"
    shutil.copytree(tiny_checkpoints.get("qwen3_5"), path)
    return add_mtp_head(path, seed=3)


def draft_vocab(model_dir, corpus_dir, *extra):
    corpus_dir.mkdir(exist_ok=True)
    (corpus_dir / "a.txt").write_text(CORPUS)
    (corpus_dir / "b.txt").write_text("\n".join(PROMPTS))
    return subprocess.run([sys.executable, "-m", "ninfer.cli", "draft-vocab", str(model_dir), "--corpus",
                           str(corpus_dir / "a.txt"), str(corpus_dir / "b.txt"), *extra],
                          capture_output=True, text=True, timeout=120)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(model_dir, prompts, params, **engine):
    with LLM(model_dir, max_context=512, max_concurrency=8, **engine) as llm:
        outs = llm.generate([llm.encode(p) for p in prompts], params)
        return [o.token_ids for o in outs], llm.engine.stats(), llm.engine.info()


def test_the_command_counts_the_corpus_with_the_models_tokenizer(qwen3_5_mtp, tmp_path):
    out = tmp_path / "dv.json"
    r = draft_vocab(qwen3_5_mtp, tmp_path / "corpus", "--out", str(out))
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    tok = _core.Tokenizer(str(qwen3_5_mtp))
    want = Counter(tok.encode(CORPUS, False)) + Counter(tok.encode("\n".join(PROMPTS), False))
    assert record["token_ids"] == [t for t, _ in sorted(want.items(), key=lambda kv: (-kv[1], kv[0]))]
    assert record["counts"] == [want[t] for t in record["token_ids"]]
    assert record["corpus_tokens"] == sum(want.values()) and record["vocab_size"] == tok.vocab_size
    r = draft_vocab(qwen3_5_mtp, tmp_path / "corpus", "--out", str(out), "--size", "5")
    assert r.returncode == 0 and json.loads(out.read_text())["token_ids"] == record["token_ids"][:5]
    bad = subprocess.run([sys.executable, "-m", "ninfer.cli", "draft-vocab", str(qwen3_5_mtp), "--corpus",
                          str(tmp_path / "missing.txt")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "missing.txt" in bad.stderr


def test_greedy_with_a_reduced_draft_head_equals_plain_greedy_on_a_tiny_mtp_checkpoint(qwen3_5_mtp, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(qwen3_5_mtp, model)
    # No file yet: the error names the file looked for and the command that makes it.
    with pytest.raises(Exception) as e:
        LLM(model, max_context=256, spec="mtp", lm_head_draft=True)
    assert "draft_vocab.json" in str(e.value) and "ninfer draft-vocab" in str(e.value)
    assert draft_vocab(model, tmp_path / "corpus").returncode == 0
    ids = json.loads((model / "draft_vocab.json").read_text())["token_ids"]
    plain, _, _ = _run(model, PROMPTS, greedy(40))
    for size in (None, 8):
        spec, stats, info = _run(model, PROMPTS, greedy(40), spec="mtp", draft_tokens=3, lm_head_draft=True,
                                 lm_head_draft_size=size)
        assert spec == plain, size
        assert stats["spec_drafted_tokens"] > 0
        assert info["lm_head_draft_size"] == (len(ids) if size is None else size)


def test_greedy_with_the_demos_reduced_draft_head_equals_plain_greedy():
    if not (DEMO_MODEL / "draft_vocab.json").exists():
        pytest.skip("demo model not shipped")
    plain, _, _ = _run(DEMO_MODEL, PROMPTS, greedy(48))
    full, full_stats, _ = _run(DEMO_MODEL, PROMPTS, greedy(48), spec="mtp", draft_tokens=3)
    for size in (None, 512):
        spec, stats, info = _run(DEMO_MODEL, PROMPTS, greedy(48), spec="mtp", draft_tokens=3, lm_head_draft=True,
                                 lm_head_draft_size=size)
        assert spec == plain == full, size
        # The trained head's drafts are mostly within the corpus's frequent ids: they pass as often.
        assert stats["spec_mean_accepted_length"] > 1.5, stats
        assert info["lm_head_draft_size"] == (512 if size else len(json.loads(
            (DEMO_MODEL / "draft_vocab.json").read_text())["token_ids"]))
    # With spec_adaptive too.
    spec, stats, _ = _run(DEMO_MODEL, PROMPTS, greedy(48), spec="mtp", draft_tokens=4, lm_head_draft=True,
                          spec_adaptive=True)
    assert spec == plain and stats["spec_mean_k_chosen"] is not None


@pytest.mark.parametrize("kwargs,needles", [
    ({"spec": "ngram", "lm_head_draft": True}, ["--lm-head-draft", "--spec mtp"]),
    ({"lm_head_draft": True}, ["--lm-head-draft", "--spec mtp"]),
    ({"spec": "mtp", "lm_head_draft_size": 16}, ["--lm-head-draft-size", "--lm-head-draft"]),
    ({"spec": "mtp", "lm_head_draft": True, "lm_head_draft_size": 0}, ["--lm-head-draft-size"]),
])
def test_bad_lm_head_draft_options_are_refused_naming_the_flags(qwen3_5_mtp, kwargs, needles):
    with pytest.raises(Exception) as e:
        LLM(qwen3_5_mtp, max_context=256, **kwargs)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_ninfer_run_with_lm_head_draft_works_on_the_demo_out_of_the_box(ninfer_env):
    if not (DEMO_MODEL / "draft_vocab.json").exists():
        pytest.skip("demo model not shipped")
    base = [sys.executable, "-m", "ninfer.cli", "run", "--device", "cpu", "--prompt", "def add(a, b):\n",
            "--max-new", "32", "--greedy", "--ignore-eos"]
    plain = subprocess.run(base, capture_output=True, env=ninfer_env, timeout=300)
    spec = subprocess.run([*base, "--spec", "mtp", "--lm-head-draft", "--lm-head-draft-size", "1024"],
                          capture_output=True, env=ninfer_env, timeout=300)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr.decode()
    assert spec.stdout == plain.stdout
    bad = subprocess.run([*base, "--spec", "ngram", "--lm-head-draft"], capture_output=True, env=ninfer_env,
                         timeout=60)
    assert bad.returncode == 2 and "--lm-head-draft needs --spec mtp" in bad.stderr.decode()
