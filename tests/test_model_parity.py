"""`_core.Model` against transformers (f32) on tiny random checkpoints of every architecture.

Logits of a whole prompt must match within 1e-4 relative error (max abs diff / max abs
reference), and a 64-token greedy continuation driven by `Model.logits` must equal
transformers' `generate(do_sample=False)` token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ninfer import _core  # noqa: E402

from tiny_models import ARCHS, load_reference, make_model  # noqa: E402

REL_TOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, arch, seed=i) for i, arch in enumerate(ARCHS)}


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, vocab, size=n)]


def _ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def _rel_err(got, exp) -> float:
    return float(np.abs(got - exp).max() / np.abs(exp).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(model_dirs, arch):
    path = model_dirs[arch]
    m = _core.Model(str(path))
    ref = load_reference(path)
    # 70 tokens: more than one GDN chunk of 64 and several KV blocks.
    ids = _prompt(70, m.config["vocab_size"], seed=1)
    got = m.logits(ids)
    assert got.dtype == np.float32 and got.shape == (70, m.config["vocab_size"])
    assert _rel_err(got, _ref_logits(ref, ids)) < REL_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_64_tokens_match_transformers_generate(model_dirs, arch):
    path = model_dirs[arch]
    m = _core.Model(str(path))
    ref = load_reference(path)
    prompt = _prompt(9, m.config["vocab_size"], seed=2)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    ids = list(prompt)
    for _ in range(64):
        ids.append(int(np.argmax(m.logits(ids)[-1])))
    assert ids[len(prompt):] == expected


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_scaled_rope_logits_match_transformers(tmp_path, rope):
    path = make_model(tmp_path / rope["rope_type"], "llama", seed=7, rope_parameters=dict(rope))
    m = _core.Model(str(path))
    ref = load_reference(path)
    ids = _prompt(90, m.config["vocab_size"], seed=3)
    assert _rel_err(m.logits(ids), _ref_logits(ref, ids)) < REL_TOL


def test_sharded_checkpoint_matches_single_file(tmp_path):
    single = make_model(tmp_path / "single", "qwen3", seed=5)
    sharded = make_model(tmp_path / "sharded", "qwen3", seed=5, sharded=True)
    assert (sharded / "model.safetensors.index.json").exists()
    ids = _prompt(20, 397, seed=4)
    a = _core.Model(str(single)).logits(ids)
    b = _core.Model(str(sharded)).logits(ids)
    np.testing.assert_array_equal(a, b)


def test_bf16_checkpoint_loads_and_tracks_f32(tmp_path):
    path = make_model(tmp_path / "bf16", "llama", seed=3)
    ids = _prompt(16, 397, seed=5)
    f32 = _core.Model(str(path)).logits(ids)
    load_reference(path).to(torch.bfloat16).save_pretrained(tmp_path / "bf16_saved")
    # f32 logits: the oracle below is f32 arithmetic (the default rounds a bf16 checkpoint's
    # logits to bf16, which test_demo_model covers).
    got = _core.Model(str(tmp_path / "bf16_saved"), logits_dtype="float32").logits(ids)
    assert _rel_err(got, f32) < 0.1
    # The oracle upcasts the same bf16 weights to f32 on load.
    exp = _ref_logits(load_reference(tmp_path / "bf16_saved"), ids)
    assert _rel_err(got, exp) < REL_TOL


def test_config_dict_describes_the_model(model_dirs):
    c = _core.Model(str(model_dirs["qwen3_5"]), num_threads=1).config
    assert c["architecture"] == "Qwen3_5ForCausalLM"
    assert c["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert c["num_layers"] == 4 and c["vocab_size"] == 397 and c["hidden_size"] == 72
    assert c["max_position_embeddings"] == 256 and c["has_mtp"] is False
    assert c["num_threads"] == 1
    assert c["kv_bytes_per_token"] == 1 * 2 * 2 * 24 * 4


def test_thread_count_does_not_change_logits(model_dirs):
    ids = _prompt(33, 397, seed=6)
    a = _core.Model(str(model_dirs["qwen3_5"]), num_threads=1).logits(ids)
    b = _core.Model(str(model_dirs["qwen3_5"]), num_threads=2).logits(ids)
    assert _rel_err(a, b) < 1e-6
