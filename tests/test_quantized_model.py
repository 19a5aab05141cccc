"""Quantized weights in the CPU model, end to end.

- `--quantize MODE` on a dense checkpoint keeps greedy parity with the same model running the
  dequantized weights as a dense f32 checkpoint (the weights written by `_core.quantize`, decoded
  by `_core.dequantize`), and the demo model's held-out perplexity stays within the issue's bounds
  of bf16 (W8, FP8, Q6: 1%; the 4-bit formats: 10%) on a short window set.
- Quantized Hugging Face checkpoints (block FP8, AWQ, GPTQ with act-order g_idx, compressed-tensors
  pack-quantized) are built here by packers written from the formats' definitions: the model
  loaded from them equals the dense model of the values those definitions give; a truncated
  tensor, a group size that does not divide the row and a scale of the wrong shape are refused at
  load naming the tensor.
- GGUF: a tiny model's projections written by the `gguf` package in each GGUF format and read back
  with its reader, handed to the model as packed tensors (`_core.Model(quant_tensors=...)`; the
  GGUF file reader belongs to the model-files issue), match the dense model of `gguf`'s own
  `dequantize`.
- The flags: bad values are refused naming the flag and the value; the CUDA refusal names the
  tensor, the format and the device.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_models import make_model

_core = pytest.importorskip("ninfer._core")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "python" / "ninfer" / "demo"
MODES = ("w8", "q4", "q5", "q6", "fp8", "nvfp4")
FORMAT_OF = {"w8": "W8G32_F16S", "q4": "Q4G64_F16S", "q5": "Q5G64_F16S", "q6": "Q6G64_F16S",
             "fp8": "FP8_E4M3FN_ROW_BF16S", "nvfp4": "NVFP4"}


def is_projection(name: str) -> bool:
    """The tensors `--quantize` quantizes (lm_head and embeddings stay dense)."""
    return name.endswith("_proj.weight") or ".in_proj_" in name or name == "mtp.fc.weight"


def greedy(model, prompt, steps=12):
    """Greedy continuation by whole-sequence logits (the reference decode)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    return ids[len(prompt):]


def write_dense(src: Path, dst: Path, tensors: dict) -> Path:
    """A copy of checkpoint `src` with `tensors` (f32) written as its weights."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            (dst / f).write_text((src / f).read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


PROMPT = [5, 17, 101, 3, 44, 250, 9, 77]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    # Shapes NVFP4 holds for most projections (rows a multiple of 128, columns of 64), not for
    # in_proj_b / in_proj_a (4 rows), which it keeps dense.
    return make_model(tmp_path_factory.mktemp("tiny_qwen"), "qwen3_5", hidden_size=128, intermediate_size=256,
                      head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, seed=3)


def dequantized_reference(src: Path, dst: Path, mode: str, lm_head: bool = False):
    """A dense f32 checkpoint of `src` whose projections (and logits projection, untied, when
    `lm_head`) are `_core.quantize(mode)` decoded by `_core.dequantize`; and how many were."""
    tensors = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    if lm_head:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"].clone())
        text["tie_word_embeddings"] = config["tie_word_embeddings"] = False
    deq, quantized = {}, 0
    for name, t in tensors.items():
        if is_projection(name) or (lm_head and name == "lm_head.weight"):
            try:
                packed = _core.quantize(mode, t.numpy(), name)
            except _core.NinferError:
                deq[name] = t  # a shape the format's layout cannot hold stays dense
                continue
            deq[name] = torch.from_numpy(_core.dequantize(FORMAT_OF[mode], packed, tuple(t.shape), name))
            quantized += 1
        else:
            deq[name] = t
    out = write_dense(src, dst, deq)
    (out / "config.json").write_text(json.dumps(config))
    return out, quantized


@pytest.mark.parametrize("mode", MODES)
def test_quantize_on_load_keeps_greedy_parity_with_the_dequantized_dense_model(tiny_qwen, tmp_path, mode):
    ref_dir, quantized = dequantized_reference(tiny_qwen, tmp_path / "deq", mode)
    assert quantized >= 12
    ref = _core.Model(str(ref_dir), logits_dtype="float32")
    model = _core.Model(str(tiny_qwen), quantize=mode, logits_dtype="float32")
    want = ref.logits(PROMPT)
    got = model.logits(PROMPT)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale
    assert greedy(model, PROMPT) == greedy(ref, PROMPT)
    # The quantized weights are not the dense ones: the model did change.
    dense = _core.Model(str(tiny_qwen), logits_dtype="float32").logits(PROMPT)
    assert np.abs(got - dense).max() > 1e-4 * scale


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_lm_head_quantizes_the_logits_projection(tmp_path, tied):
    src = make_model(tmp_path / "src", "llama_tied" if tied else "llama", hidden_size=128, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=384, seed=7)
    ref_dir, _ = dequantized_reference(src, tmp_path / "deq", "q4", lm_head=True)
    want = _core.Model(str(ref_dir), logits_dtype="float32").logits(PROMPT)
    got = _core.Model(str(src), quantize="q4", quantize_lm_head=True, logits_dtype="float32").logits(PROMPT)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    body_only = _core.Model(str(src), quantize="q4", logits_dtype="float32").logits(PROMPT)
    assert np.abs(body_only - want).max() > 1e-3 * np.abs(want).max()
    with pytest.raises(_core.NinferError, match="quantize_lm_head.*needs --quantize"):
        _core.Model(str(src), quantize_lm_head=True)


PROGRESS_SCRIPT = """
import sys
from ninfer import _core
_core.Model(sys.argv[1], quantize="nvfp4")
"""


def test_quantize_progress_goes_to_stderr_only_on_a_terminal(tiny_qwen):
    import os
    import pty
    import subprocess
    import sys

    env = dict(os.environ)
    cmd = [sys.executable, "-c", PROGRESS_SCRIPT, str(tiny_qwen)]
    piped = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert piped.stderr == ""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait() == 0
    os.close(master)
    text = out.decode()
    assert "ninfer: quantizing to NVFP4: layer 4/4" in text, text
    # 3 GDN layers x 6 + q, o and the MLP of the attention layer; the GDN layers' in_proj_b / a
    # and the attention's k / v (4 and 64 rows) do not fit NVFP4's 128-row tiles.
    assert "ninfer: quantized 23 weights to NVFP4 (8 kept dense: shapes NVFP4 cannot hold)" in text, text


def test_bad_quantize_value_is_refused_naming_it(tiny_qwen):
    with pytest.raises(_core.NinferError, match='quantize.*"q3".*w8, q4, q5, q6, fp8, nvfp4'):
        _core.Model(str(tiny_qwen), quantize="q3")
    from ninfer.cli import QUANTIZE_MODES

    assert tuple(_core.QUANTIZE_MODES) == QUANTIZE_MODES


@pytest.mark.parametrize("command,value", [("run", "q3"), ("serve", "int4")])
def test_cli_refuses_a_bad_quantize_value_naming_flag_and_value(capsys, command, value):
    from ninfer.cli import build_run_parser
    from ninfer.server.serve import parse_args

    with pytest.raises(SystemExit) as e:
        if command == "run":
            build_run_parser().parse_args(["--prompt", "x", "--quantize", value])
        else:
            parse_args(["--quantize", value])
    assert e.value.code == 2
    assert f"--quantize {value!r} is not a quantization mode: give one of w8, q4, q5, q6, fp8, nvfp4" in capsys.readouterr().err


def test_cli_refuses_quantize_lm_head_without_quantize():
    from ninfer.cli import build_run_parser, quantize_flag_error, quantize_kwargs

    args = build_run_parser().parse_args(["--prompt", "x", "--quantize-lm-head"])
    assert quantize_flag_error(args) == "--quantize-lm-head needs --quantize (the format the lm_head is quantized to)"
    args = build_run_parser().parse_args(["--prompt", "x", "--quantize", "nvfp4", "--quantize-lm-head"])
    assert quantize_flag_error(args) is None
    assert quantize_kwargs(args) == dict(quantize="nvfp4", quantize_lm_head=True)


def test_cuda_takes_every_quantize_mode_nvfp4_included(tiny_qwen):
    # NVFP4 loads on CUDA too (tests/test_gpu_quant_model.py runs it against this backend):
    # without a GPU (or a CUDA build) the only refusal is the device's, never the format's.
    try:
        _core.Model(str(tiny_qwen), device="cuda:0", quantize="nvfp4", quantize_lm_head=True)
    except _core.NinferError as e:
        msg = str(e)
        assert "cannot run yet" not in msg and "not supported" not in msg and "cuda" in msg.lower(), msg


# --- the demo model: perplexity bounds and the engine's flag -------------------------------------

def perplexity(model, windows) -> float:
    from ninfer.demo import perplexity as pooled

    return pooled([model.logits(ids) for ids in windows], windows)


@pytest.fixture(scope="module")
def demo_windows():
    if not (DEMO / "model" / "config.json").exists():
        pytest.skip("demo model not bundled")
    data = json.loads((DEMO / "heldout_tokens.json").read_text())
    return [w[:512] for w in data["sequences"][:4]]


@pytest.fixture(scope="module")
def demo_bf16_perplexity(demo_windows):
    return perplexity(_core.Model(str(DEMO / "model"), logits_dtype="float32"), demo_windows)


@pytest.mark.parametrize("mode,bound", [("w8", 0.01), ("fp8", 0.01), ("q6", 0.01), ("q5", 0.10), ("q4", 0.10),
                                        ("nvfp4", 0.10)])
def test_demo_perplexity_within_bounds_of_bf16(demo_windows, demo_bf16_perplexity, mode, bound):
    ppl = perplexity(_core.Model(str(DEMO / "model"), quantize=mode, logits_dtype="float32"), demo_windows)
    assert abs(ppl / demo_bf16_perplexity - 1.0) <= bound, (mode, ppl, demo_bf16_perplexity)
    assert ppl != demo_bf16_perplexity


def test_llm_quantize_generates_the_models_greedy_tokens(demo_windows):
    from ninfer import LLM, SamplingParams

    prompt = demo_windows[0][:48]
    want = greedy(_core.Model(str(DEMO / "model"), quantize="q4"), prompt, steps=10)
    with LLM(DEMO / "model", quantize="q4", max_context=128, max_concurrency=1) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert list(out.token_ids) == want


# --- quantized Hugging Face checkpoints -----------------------------------------------------------

AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]


def pack_nibbles(codes: np.ndarray, axis_positions) -> np.ndarray:
    """int32 words from `codes` [..., 8] (0..15), code i going to nibble axis_positions[i]."""
    words = np.zeros(codes.shape[:-1], dtype=np.uint32)
    for i, pos in enumerate(axis_positions):
        words |= (codes[..., i].astype(np.uint32) & 0xF) << (4 * pos)
    return words.view(np.int32)


def asym_codes(w: np.ndarray, groups: np.ndarray, n_groups: int, zmin: int = 0):
    """Asymmetric 4-bit round to nearest per (row, group): codes 0..15, zeros (at least `zmin`),
    f16 scales [G, N]."""
    n, k = w.shape
    scales = np.zeros((n_groups, n), np.float16)
    zeros = np.zeros((n_groups, n), np.int64)
    codes = np.zeros((n, k), np.int64)
    for g in range(n_groups):
        cols = np.nonzero(groups == g)[0]
        block = w[:, cols]
        lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        s = ((hi - lo) / 15).astype(np.float16)
        s[s == 0] = 1
        z = np.clip(np.round(-lo / s.astype(np.float32)), zmin, 15)
        codes[:, cols] = np.clip(np.round(block / s.astype(np.float32)[:, None]) + z[:, None], 0, 15)
        scales[g], zeros[g] = s, z
    return codes, zeros, scales


def deq_asym(codes, zeros, scales, groups):
    """`w[n,k] = f32(q - z) * scale[g(k), n]` (the AWQ / GPTQ definition)."""
    z = zeros[groups].T  # [N, K]
    s = scales[groups].T.astype(np.float32)
    return ((codes - z).astype(np.float32) * s).astype(np.float32)


def pack_awq(w, group):
    n, k = w.shape
    groups = np.arange(k) // group
    codes, zeros, scales = asym_codes(w, groups, k // group)
    qweight = pack_nibbles(codes.T.reshape(k, n // 8, 8), AWQ_NIBBLE)
    qzeros = pack_nibbles(zeros.reshape(k // group, n // 8, 8), AWQ_NIBBLE)
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return parts, deq_asym(codes, zeros, scales, groups)


def pack_gptq(w, group, seed):
    """GPTQ with act-order: input k belongs to group g_idx[k] (a permutation's blocks)."""
    n, k = w.shape
    perm = np.random.default_rng(seed).permutation(k)
    g_idx = np.empty(k, np.int64)
    g_idx[perm] = np.arange(k) // group
    # The original "gptq" form stores zero - 1 in four bits: its quantizers keep zero >= 1.
    codes, zeros, scales = asym_codes(w, g_idx, k // group, zmin=1)
    qweight = pack_nibbles(codes.T.reshape(k // 8, 8, n).transpose(0, 2, 1), range(8))
    qzeros = pack_nibbles((zeros - 1).reshape(k // group, n // 8, 8), range(8))  # "gptq" stores zero - 1
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.astype(np.int32)}
    return parts, deq_asym(codes, zeros, scales, g_idx)


def pack_compressed(w, group):
    """compressed-tensors pack-quantized, symmetric int4: code + 8 in nibble k % 8 of word k / 8."""
    n, k = w.shape
    g = k // group
    s = (np.abs(w.reshape(n, g, group)).max(-1) / 7).astype(np.float16)
    s[s == 0] = 1
    sf = s.astype(np.float32)
    q = np.clip(np.round(w.reshape(n, g, group) / sf[..., None]), -8, 7).reshape(n, k).astype(np.int64)
    packed = pack_nibbles((q + 8).reshape(n, k // 8, 8), range(8))
    deq = (q.astype(np.float32).reshape(n, g, group) * sf[..., None]).reshape(n, k)
    parts = {"weight_packed": packed, "weight_scale": s, "weight_shape": np.array([n, k], np.int32)}
    return parts, deq.astype(np.float32)


def pack_fp8_block(w, bn, bk):
    """Block FP8: e4m3 codes, a float32 multiplier per (bn x bk) tile (`weight_scale_inv`)."""
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    scale = np.zeros((gn, gk), np.float32)
    codes = torch.zeros((n, k), dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            tile = torch.from_numpy(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk])
            s = max(float(tile.abs().max()) / 448.0, 1e-12)
            scale[i, j] = s
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / torch.tensor(s, dtype=torch.float32)).to(torch.float8_e4m3fn)
    s_full = torch.from_numpy(np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k])
    deq = (codes.to(torch.float32) * s_full).numpy()
    return {"weight": codes, "weight_scale_inv": torch.from_numpy(scale)}, deq


QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 8, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 8, "desc_act": True, "sym": False},
    "compressed": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                       "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}}}},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16]},
    "compressed_fp8": {"quant_method": "compressed-tensors", "format": "float-quantized",
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                           "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 16]}}}},
}


def build_hf_quantized(src: Path, dst: Path, method: str):
    """(quantized checkpoint, dense checkpoint of the values its definition gives) from `src`."""
    tensors = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
    quant, deq = {}, {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if not is_projection(name):
            quant[name] = deq[name] = t
            continue
        module = name[: -len(".weight")]
        w = t.numpy()
        if method == "awq":
            parts, d = pack_awq(w, 8)
        elif method == "gptq":
            parts, d = pack_gptq(w, 8, seed=i)
        elif method == "compressed":
            parts, d = pack_compressed(w, 8)
        else:
            parts, d = pack_fp8_block(w, 16, 16)
            if method == "compressed_fp8":  # compressed-tensors names the multiplier weight_scale
                parts["weight_scale"] = parts.pop("weight_scale_inv")
        for suffix, v in parts.items():
            quant[f"{module}.{suffix}"] = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
        deq[name] = torch.from_numpy(d)
    qdir = write_dense(src, dst / method, {})
    save_file({k: v.contiguous() for k, v in quant.items()}, qdir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[method]
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, write_dense(src, dst / f"{method}_dense", deq)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=5)


@pytest.mark.parametrize("method,arch", [("awq", "llama"), ("gptq", "llama"), ("compressed", "llama"),
                                         ("fp8", "llama"), ("fp8", "qwen3_5"), ("compressed_fp8", "llama")])
def test_quantized_hf_checkpoint_equals_the_dense_model_of_its_definition(tiny_llama, tiny_qwen, tmp_path, method, arch):
    src = tiny_llama if arch == "llama" else tiny_qwen
    qdir, ddir = build_hf_quantized(src, tmp_path, method)
    model = _core.Model(str(qdir), logits_dtype="float32")
    ref = _core.Model(str(ddir), logits_dtype="float32")
    prompt = [p % 390 for p in PROMPT]
    want, got = ref.logits(prompt), model.logits(prompt)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert greedy(model, prompt, 8) == greedy(ref, prompt, 8)


def test_quantize_on_an_already_quantized_checkpoint_is_refused(tiny_llama, tmp_path):
    qdir, _ = build_hf_quantized(tiny_llama, tmp_path, "awq")
    with pytest.raises(_core.NinferError, match="already quantized.*HF_AWQ4"):
        _core.Model(str(qdir), quantize="q4")


def _rewrite(qdir: Path, edit):
    tensors = load_file(qdir / "model.safetensors")
    edit(tensors)
    save_file(tensors, qdir / "model.safetensors", metadata={"format": "pt"})


def test_bad_quantized_tensors_are_refused_at_load_naming_them(tiny_llama, tmp_path):
    name = "model.layers.1.mlp.down_proj"
    qdir, _ = build_hf_quantized(tiny_llama, tmp_path, "gptq")
    good = load_file(qdir / "model.safetensors")

    def truncated(t):
        t[f"{name}.qweight"] = t[f"{name}.qweight"][:-1].clone()

    _rewrite(qdir, truncated)
    with pytest.raises(_core.NinferError, match=rf"{name}\.qweight.*shape \[16, 72\], expected \[17, 72\]"):
        _core.Model(str(qdir))

    def wrong_scale(t):
        t.update(good)
        t[f"{name}.scales"] = t[f"{name}.scales"][:, :-8].clone()

    _rewrite(qdir, wrong_scale)
    with pytest.raises(_core.NinferError, match=rf"scale tensor {name}\.scales has shape \[17, 64\], expected \[17, 72\]"):
        _core.Model(str(qdir))

    _rewrite(qdir, lambda t: t.update(good))
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["group_size"] = 16  # K = 72 (q/k/v/gate/up) is not a multiple
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(_core.NinferError, match=r"model\.layers\.0\.self_attn\.q_proj\.qweight.*input features K 72 is not a multiple of 16"):
        _core.Model(str(qdir))


# --- GGUF formats ---------------------------------------------------------------------------------

GGUF_TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S"]
#: Byte offsets of the f16 super-scales inside one block (kept small and finite here).
F16_FIELDS = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0], "IQ3_S": [0]}


def gguf_blocks(gguf, name: str, w: np.ndarray, seed: int) -> np.ndarray:
    """Blocks of a GGUF type for the `[N, K]` weight `w`: the package's quantizer where it has one
    (Q8_0), else random codes under small random f16 scales (the package only decodes k- and
    i-quants)."""
    t = gguf.GGMLQuantizationType[name]
    if name == "Q8_0":
        return gguf.quants.quantize(w, t)
    block, size = gguf.GGML_QUANT_SIZES[t]
    n, k = w.shape
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        s = rng.uniform(0.0005, 0.004, size=(data.shape[0], 1)).astype(np.float16)
        data[:, off:off + 2] = s.view(np.uint8)
    return data.reshape(n, -1)


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_gguf_tensors_written_by_the_package_load_and_match_its_dequantize(tmp_path, kind):
    gguf = pytest.importorskip("gguf", reason="the gguf package is in the test extra")
    src = make_model(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=2, seed=11)
    tensors = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if is_projection(name):
            blocks = gguf_blocks(gguf, kind, t.numpy(), seed=i)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    handed, deq = {}, dict(tensors)
    for t in gguf.GGUFReader(str(tmp_path / "tiny.gguf")).tensors:
        k, n = (int(d) for d in t.shape)  # GGUF lists ne[0] (K) first
        assert _core.gguf_format(int(t.tensor_type), t.name) == f"GGUF_{kind}"
        data = np.asarray(t.data)
        handed[t.name] = (f"GGUF_{kind}", data.tobytes(), (n, k))
        deq[t.name] = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(n, k))
    assert len(handed) == 14
    ref = _core.Model(str(write_dense(src, tmp_path / "deq", deq)), logits_dtype="float32")
    model = _core.Model(str(src), quant_tensors=handed, logits_dtype="float32")
    prompt = [p % 390 for p in PROMPT]
    want, got = ref.logits(prompt), model.logits(prompt)
    assert np.isfinite(want).all()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert greedy(model, prompt, 8) == greedy(ref, prompt, 8)


def test_handed_in_tensor_of_a_wrong_shape_or_name_is_refused(tiny_llama):
    block = np.zeros((72, 72 // 32 * 34), np.uint8)
    with pytest.raises(_core.NinferError, match=r"q_proj\.weight.*block size 32 does not divide the row length 72|"
                                                r"q_proj\.weight.*\[72, 72\]"):
        _core.Model(str(tiny_llama), quant_tensors={"model.layers.0.self_attn.q_proj.weight": ("GGUF_Q8_0", block.tobytes(), (72, 72))})
    with pytest.raises(_core.NinferError, match=r"model\.layers\.9\.mlp\.down_proj\.weight.*no projection"):
        _core.Model(str(tiny_llama), quant_tensors={"model.layers.9.mlp.down_proj.weight": ("GGUF_Q8_0", b"\0" * 34 * 2, (1, 64))})
