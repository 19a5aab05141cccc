"""Loading failures raise the right `_core` exception with a message naming the path/field/tensor,
and Qwen3.5 MTP weights (added by hand: transformers neither loads nor saves `mtp.*`) are
recognized, loaded and shape-checked."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer import _core  # noqa: E402

from tiny_models import make_model  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("err") / "llama", "llama")


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("err") / "qwen3_5", "qwen3_5")


@pytest.fixture
def copy_of(tmp_path):
    def _copy(src):
        dst = tmp_path / "model"
        shutil.copytree(src, dst)
        return dst

    return _copy


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_config_file_names_the_path(copy_of, llama_dir):
    d = copy_of(llama_dir)
    (d / "config.json").unlink()
    with pytest.raises(_core.ModelLoadError, match="config.json"):
        _core.Model(str(d))


def test_missing_weights_file_names_the_path(copy_of, llama_dir):
    d = copy_of(llama_dir)
    (d / "model.safetensors").unlink()
    with pytest.raises(_core.ModelLoadError, match="model.safetensors"):
        _core.Model(str(d))


@pytest.mark.parametrize("kwargs,needle", [
    ({"kv_capacity": 10}, "10 tokens is less than max_context"),
    ({"max_context": 10**7}, "exceeds the model's max_position_embeddings"),
    ({"max_context": 200, "kv_capacity": 100}, "100 tokens is less than max_context 200 tokens; raise --kv-capacity"),
])
def test_engine_flags_are_checked_before_the_weights_are_read(copy_of, llama_dir, kwargs, needle):
    # No weights file: an error about the flags proves they were checked first (a bad flag costs
    # no load of a large model).
    d = copy_of(llama_dir)
    (d / "model.safetensors").unlink()
    with pytest.raises(_core.NinferError, match=needle) as e:
        _core.Engine(str(d), device="cpu", **kwargs)
    assert "model.safetensors" not in str(e.value)


def test_truncated_safetensors_names_the_file(copy_of, llama_dir):
    d = copy_of(llama_dir)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(_core.ModelLoadError, match=r"model\.safetensors.*truncated"):
        _core.Model(str(d))


def test_wrong_tensor_shape_names_the_tensor(copy_of, llama_dir):
    d = copy_of(llama_dir)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(_core.ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\[135, 72\]"):
        _core.Model(str(d))


def test_missing_tensor_names_the_tensor(copy_of, llama_dir):
    d = copy_of(llama_dir)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(_core.ModelLoadError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        _core.Model(str(d))


def test_unknown_architecture_is_unsupported_and_lists_supported(copy_of, llama_dir):
    d = copy_of(llama_dir)
    _edit_config(d, lambda c: c.update(architectures=["MambaForCausalLM"]))
    with pytest.raises(_core.UnsupportedError, match=r"MambaForCausalLM.*LlamaForCausalLM.*Qwen3_5ForCausalLM"):
        _core.Model(str(d))


def test_missing_config_field_names_the_field(copy_of, llama_dir):
    d = copy_of(llama_dir)
    _edit_config(d, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(_core.ModelLoadError, match="num_hidden_layers"):
        _core.Model(str(d))


def test_unknown_device_is_unsupported(llama_dir):
    with pytest.raises(_core.UnsupportedError, match="tpu"):
        _core.Model(str(llama_dir), device="tpu")


def test_empty_prompt_is_an_invalid_request(llama_dir):
    with pytest.raises(_core.InvalidRequestError):
        _core.Model(str(llama_dir)).logits([])


def test_chunked_logits_need_a_positive_chunk_and_equal_the_whole_prefill(llama_dir):
    m = _core.Model(str(llama_dir))
    ids = list(range(3, 40))
    with pytest.raises(_core.InvalidRequestError, match="chunk"):
        m.logits(ids, chunk=0)
    np.testing.assert_allclose(m.logits(ids, chunk=5), m.logits(ids), rtol=1e-4, atol=1e-4)


def _add_mtp(d, hidden=72, fc_shape=None):
    """Append Qwen3.5-style MTP tensors (one full-attention layer, copied from layer 3)."""
    tensors = load_file(d / "model.safetensors")
    import torch

    g = torch.Generator().manual_seed(0)
    tensors["mtp.fc.weight"] = torch.randn(fc_shape or (hidden, 2 * hidden), generator=g)
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        tensors[n] = torch.randn(hidden, generator=g) * 0.1
    src = "model.layers.3."
    for name in [n for n in tensors if n.startswith(src)]:
        tensors["mtp.layers.0." + name[len(src):]] = tensors[name].clone()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_mtp_weights_are_recognized_and_do_not_change_logits(copy_of, qwen3_5_dir):
    plain = _core.Model(str(qwen3_5_dir))
    d = copy_of(qwen3_5_dir)
    _add_mtp(d)
    m = _core.Model(str(d))
    assert plain.config["has_mtp"] is False
    assert m.config["has_mtp"] is True
    assert m.config["weight_bytes"] > plain.config["weight_bytes"]
    ids = [5, 9, 33, 7, 100, 2]
    assert (m.logits(ids) == plain.logits(ids)).all()


def test_wrong_shaped_mtp_tensor_is_rejected(copy_of, qwen3_5_dir):
    d = copy_of(qwen3_5_dir)
    _add_mtp(d, fc_shape=(72, 72))
    with pytest.raises(_core.ModelLoadError, match=r"mtp\.fc\.weight"):
        _core.Model(str(d))
