"""The quantized formats' CPU reference against outside oracles.

GGUF blocks decode bit for bit as `gguf.quants.dequantize` (llama.cpp's gguf-py) decodes them,
on random blocks whose f16 super-scales include zero, the largest finite value and subnormals;
the IQ3_S grid compiled into the core equals the package's. The encoders refuse NaN and infinity
naming the tensor, and truncated or unknown inputs are refused at load.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is in the test extra")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import IQ3_S  # noqa: E402

from ninfer import _core  # noqa: E402

GGUF_TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S"]

#: Byte offsets of the f16 super-scale fields inside one block.
F16_FIELDS = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0], "IQ3_S": [0]}

#: f16 words every run includes: +0, -0, largest finite, smallest and largest subnormal, 1.0.
EDGE_F16 = [0x0000, 0x8000, 0x7BFF, 0x0001, 0x03FF, 0x3C00]


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes `[rows, row_bytes]` with finite f16 scales (edges first)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.02, 0.02, size=(data.shape[0], len(F16_FIELDS[name]))).astype(np.float16).view(np.uint16)
    for i, edge in enumerate(EDGE_F16[: data.shape[0]]):
        scales[i, :] = edge
    for j, off in enumerate(F16_FIELDS[name]):
        data[:, off : off + 2] = scales[:, j : j + 1].copy().view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_dequantize_matches_gguf_package_bit_for_bit(name):
    rows, cols = 7, 1024
    data = random_blocks(name, rows, cols, seed=GGUF_TYPES.index(name))
    want = gguf.quants.dequantize(data, GGMLQuantizationType[name])
    got = _core.dequantize(f"GGUF_{name}", data.tobytes(), (rows, cols))
    assert got.shape == want.shape == (rows, cols)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_gguf_q8_0_written_by_the_package_decodes_identically():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[0] = 0.0
    data = gguf.quants.quantize(x, GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(data, GGMLQuantizationType.Q8_0)
    got = _core.dequantize("GGUF_Q8_0", data.tobytes(), (16, 256))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_iq3s_grid_equals_the_gguf_package_table():
    IQ3_S.init_grid()
    grid = IQ3_S.grid.reshape(512, 4).astype(np.uint32)
    words = grid[:, 0] | (grid[:, 1] << 8) | (grid[:, 2] << 16) | (grid[:, 3] << 24)
    assert _core.iq3s_grid() == [int(w) for w in words]


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_type_ids_and_block_sizes_match_the_package(name):
    qtype = GGMLQuantizationType[name]
    assert _core.gguf_format(int(qtype.value)) == f"GGUF_{name}"
    block, size = GGML_QUANT_SIZES[qtype]
    data = random_blocks(name, 2, 512, seed=1)
    assert data.shape[1] == 512 // block * size
    # One byte short of the shape is refused as truncated, naming the tensor.
    with pytest.raises(_core.ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*truncated"):
        _core.dequantize(f"GGUF_{name}", data.tobytes()[:-1], (2, 512), name="blk.0.ffn_up.weight")


def test_unknown_gguf_type_id_is_refused_naming_the_tensor():
    with pytest.raises(_core.ModelLoadError, match=r"blk\.3\.attn_k\.weight.*unknown GGUF type id 99"):
        _core.gguf_format(99, "blk.3.attn_k.weight")
    with pytest.raises(_core.ModelLoadError, match=r"Q4_0 is not supported yet"):
        _core.gguf_format(int(GGMLQuantizationType.Q4_0.value), "blk.3.attn_k.weight")
    assert _core.gguf_format(int(GGMLQuantizationType.BF16.value)) is None


def test_block_size_that_does_not_divide_the_row_is_refused():
    data = random_blocks("Q4_K", 1, 512, seed=2)
    with pytest.raises(_core.ModelLoadError, match=r"block size 256 does not divide the row length 320"):
        _core.dequantize("GGUF_Q4_K", data.tobytes(), (1, 320))


@pytest.mark.parametrize("mode", ["w8", "q4", "q5", "q6", "fp8", "nvfp4"])
def test_quantize_round_trip_error_is_bounded(mode):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((128, 256)) * 0.05).astype(np.float32)
    data = _core.quantize(mode, x, name="w")
    fmt = dict(zip(_core.QUANTIZE_MODES, ["W8G32_F16S", "Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "FP8_E4M3FN_ROW_BF16S", "NVFP4"]))[mode]
    w = _core.dequantize(fmt, data, x.shape)
    rel = np.linalg.norm(w - x) / np.linalg.norm(x)
    # Relative RMS error of round to nearest: about 2^-bits per code bit budget.
    bound = {"w8": 0.01, "q4": 0.15, "q5": 0.07, "q6": 0.035, "fp8": 0.04, "nvfp4": 0.15}[mode]
    assert rel < bound, (mode, rel)
    zeros = _core.dequantize(fmt, _core.quantize(mode, np.zeros_like(x)), x.shape)
    assert not zeros.any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode", ["w8", "q4", "q5", "q6", "fp8", "nvfp4"])
def test_quantize_refuses_nan_and_inf_naming_the_tensor(mode, bad):
    x = np.ones((128, 64), dtype=np.float32)
    x[2, 5] = bad
    with pytest.raises(_core.ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*element \[2, 5\]"):
        _core.quantize(mode, x, name="model.layers.0.mlp.up_proj.weight")


def test_format_table_lists_every_format():
    assert _core.QUANT_FORMATS[:6] == ["W8G32_F16S", "Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "FP8_E4M3FN_ROW_BF16S", "NVFP4"]
    assert [f for f in _core.QUANT_FORMATS if f.startswith("GGUF_")] == [f"GGUF_{n}" for n in GGUF_TYPES]


def test_gguf_file_written_by_the_package_decodes_tensor_by_tensor(tmp_path):
    """The loader's path: GGUF type id -> format, ne = [K, N] -> shape [N, K], block bytes."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = {}
    for i, name in enumerate(GGUF_TYPES):
        data = random_blocks(name, 4, 512, seed=40 + i)
        blocks[f"blk.0.{name.lower()}.weight"] = (name, data)
        writer.add_tensor(f"blk.0.{name.lower()}.weight", data, raw_dtype=GGMLQuantizationType[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == len(GGUF_TYPES)
    for t in reader.tensors:
        fmt = _core.gguf_format(int(t.tensor_type), t.name)
        k, n = (int(d) for d in t.shape)
        got = _core.dequantize(fmt, t.data.tobytes(), (n, k), name=t.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(got.view(np.uint32), want.reshape(n, k).view(np.uint32))
        name, data = blocks[t.name]
        assert fmt == f"GGUF_{name}" and t.data.tobytes() == data.tobytes()


def test_every_ggml_type_of_the_package_is_known():
    """Each ggml type id is dense, decoded, or refused as not supported yet (never 'unknown')."""
    supported = {f"GGUF_{n}" for n in GGUF_TYPES}
    for qtype in GGMLQuantizationType:
        try:
            fmt = _core.gguf_format(int(qtype.value), "t")
        except _core.ModelLoadError as e:
            assert "not supported yet" in str(e), (qtype.name, str(e))
            assert qtype.name not in GGUF_TYPES
            continue
        if fmt is None:
            assert qtype.name in ("F32", "F16", "BF16")
        else:
            assert fmt in supported and fmt == f"GGUF_{qtype.name}"
