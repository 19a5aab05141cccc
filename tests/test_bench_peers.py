"""The peers and ceilings of the quantized GPU benchmarks, checked on the CPU: gpu_bench's
--peer-gptfast (gpt-fast's int4 decode, benches/peer_gptfast.py) is refused where it does not
apply, its int4 packing adapter writes torch's uint8 layout, and gpu_prefill's --quantize takes
gpu_bench's modes and reaches the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from bench_scripts import load_bench as _load  # noqa: E402

#: gpt-fast's checkout for the dry run (git-ignored, carried to the GPU machine; not in CI).
GPT_FAST = Path(os.environ.get("NINFER_GPT_FAST", Path(__file__).resolve().parents[1] / ".gpu-x" / "gpt-fast"))


def fake_gpt_fast(root: Path) -> Path:
    root.mkdir()
    for f in ("model.py", "quantize.py", "generate.py"):
        (root / f).write_text("")
    return root


@pytest.mark.parametrize("extra, named", [([], "add --quantize q4 (got no --quantize)"),
                                          (["--quantize", "q5"], "add --quantize q4 (got --quantize q5)"),
                                          (["--quantize", "fp8"], "add --quantize q4 (got --quantize fp8)")])
def test_peer_gptfast_without_4bit_weights_is_refused(tmp_path, capsys, extra, named):
    bench = _load("gpu_bench")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", "x.json", "--decode-8b", "--peer-gptfast", str(fake_gpt_fast(tmp_path / "g")),
                          *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--peer-gptfast" in err and named in err


def test_peer_gptfast_needs_a_gpt_fast_checkout_and_a_peer(tmp_path, capsys):
    bench = _load("gpu_bench")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--decode-8b", "--quantize", "q4", "--peer-gptfast", str(tmp_path / "empty")])
    assert "no model.py, quantize.py, generate.py there" in capsys.readouterr().err
    checkout = str(fake_gpt_fast(tmp_path / "g"))
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--decode-8b", "--quantize", "q4", "--peer-gptfast", checkout,
                          "--skip-peer"])
    assert "--peer-gptfast and --skip-peer" in capsys.readouterr().err
    a = bench.parse_args(["--out", "x.json", "--decode-8b", "--quantize", "q4", "--peer-gptfast", checkout])
    assert a.peer_gptfast == checkout and a.options == {"quantize": "q4"}


def test_the_gptfast_peer_runs_the_same_tokens_and_layers_compiled_on_the_gpu(tmp_path):
    bench = _load("gpu_bench")
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--decode-8b"]))
    job = {"kind": "gptfast", "gpt_fast": "/g", "prompt": 128, "tokens": 256}
    full = b.shape("llama-3-8b")
    assert bench.gptfast_argv(job, full, tiny=False) == ["--gpt-fast", "/g", "--prompt", "128", "--tokens", "256",
                                                        "--compile"]
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--decode-8b", "--layers", "8"]))
    assert bench.gptfast_argv(job, b.shape("llama-3-8b"), tiny=True)[-3:] == ["--layers", "8", "--tiny"]


def test_gptfast_fields_count_its_bytes_at_the_same_copy_rate():
    bench = _load("gpu_bench")
    got = {"peer": "gpt-fast int4 g64 (torch.compile)", "tok_s": 200.0, "bytes_per_token": 4_000_000_000,
           "int4_weight_bytes": 3_900_000_000, "torch": "2.11.0", "output_head_int4": True,
           "int4_check_relative_error": 0.004}
    f = bench.gptfast_fields(got, rate=4e12)
    assert f["peer"] == got["peer"] and f["peer_bytes_per_token"] == 4_000_000_000
    assert f["peer_fraction_of_ceiling"] == 0.2 and f["peer_torch"] == "2.11.0"


def test_int4_values_pack_two_a_byte_even_column_in_the_high_nibble():
    peer = _load("peer_gptfast")
    w = torch.tensor([[0, 1, 2, 3, 4, 5], [15, 14, 13, 12, 0, 15], [7, 8, 9, 10, 11, 6]], dtype=torch.int32)
    packed = peer.pack_int4_nibbles(w)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 3)
    assert packed.tolist() == [[0x01, 0x23, 0x45], [0xFE, 0xDC, 0x0F], [0x78, 0x9A, 0xB6]]
    # Unpacking the high then the low nibble gives the matrix back.
    back = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(3, 6).to(torch.int32)
    assert torch.equal(back, w)
    with pytest.raises(ValueError, match="even column"):
        peer.pack_int4_nibbles(w[:, :5])
    with pytest.raises(ValueError, match="outside 0..15"):
        peer.pack_int4_nibbles(w + 1)


@pytest.mark.parametrize("version, uint8", [("2.4.1+cu121", False), ("2.5.0", True), ("2.11.0+cu130", True),
                                            ("2.15.0+cu132", True), ("1.13.1", False), ("3.0.0a0", True)])
def test_int4_packing_form_follows_the_torch_version(version, uint8):
    assert _load("peer_gptfast").int4_pack_takes_uint8(version) is uint8


def test_peer_gptfast_refuses_a_folder_without_gpt_fast(tmp_path, capsys):
    peer = _load("peer_gptfast")
    with pytest.raises(SystemExit) as e:
        peer.parse_args(["--gpt-fast", str(tmp_path)])
    assert e.value.code == 2 and "no model.py, quantize.py, generate.py there" in capsys.readouterr().err


@pytest.mark.skipif(not (GPT_FAST / "quantize.py").is_file(),
                    reason=f"no gpt-fast checkout at {GPT_FAST} (set NINFER_GPT_FAST)")
def test_peer_gptfast_dry_run_quantizes_checks_and_times_on_the_cpu():
    """The tiny shape on the CPU through gpt-fast's own quantizer and decode loop (in its own
    process: gpt-fast's modules are top-level `model`, `quantize`, `generate`): the last stdout
    line is JSON with tok/s, its int4 Linears (five a layer and the output head) and the bytes a
    step reads."""
    script = Path(__file__).resolve().parents[1] / "benches" / "peer_gptfast.py"
    p = subprocess.run([sys.executable, str(script), "--gpt-fast", str(GPT_FAST), "--tiny", "--prompt", "16",
                        "--tokens", "8", "--warmup", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    peer = _load("peer_gptfast")
    assert out["peer"] == "gpt-fast int4 g64 (eager)" and out["decode_tokens"] == 8
    assert out["tok_s"] > 0 and out["compile"] is False and out["int4_linears"] == 2 * 5 + 1
    assert out["int4_check_relative_error"] < peer.INT4_CHECK_TOLERANCE
    assert out["bytes_per_token"] == (out["int4_weight_bytes"] + out["other_weight_bytes_per_token"]
                                      + out["kv_cache_bytes_per_token"])


def test_gpu_prefill_quantize_takes_gpu_bench_modes(capsys):
    prefill = _load("gpu_prefill")
    with pytest.raises(SystemExit) as e:
        prefill.parse_args(["--out", "x.json", "--quantize", "q3"])
    assert e.value.code == 2 and "'q3'" in capsys.readouterr().err
    for mode in _load("gpu_bench").QUANTIZE_MODES:
        assert prefill.parse_args(["--out", "x.json", "--quantize", mode]).quantize == mode
    assert prefill.parse_args(["--out", "x.json"]).quantize is None


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_gpu_prefill_gives_the_engine_its_quantize_option(tmp_path, monkeypatch, quantize):
    """--quantize reaches `_core.Engine` as gpu_bench passes it (the `quantize` keyword); a bf16
    run names no such keyword (older builds take none)."""
    core = pytest.importorskip("ninfer._core")
    prefill = _load("gpu_prefill")
    seen = []

    class FakeEngine:
        def __init__(self, path, **kw):
            seen.append(kw)
            self.left = 0

        def submit(self, rid, prompt, params):
            self.left = 1

        def has_unfinished(self):
            return self.left > 0

        def step(self):
            self.left = 0
            return []

        def shutdown(self):
            pass

    monkeypatch.setattr(core, "Engine", FakeEngine)
    tok_s, _ = prefill.ninfer_prefill(tmp_path, [[5] * 32, [6] * 64], chunk=64, quantize=quantize, device="cpu")
    assert len(tok_s) == 2 and all(v > 0 for v in tok_s)
    assert seen[0].get("quantize") == quantize and ("quantize" in seen[0]) == (quantize is not None)


def test_records_weights_name_the_packed_format_or_the_mode_without_a_checkpoint(tmp_path):
    """gpu_bench and gpu_prefill records' `weights`: bf16 unquantized, the loader's packed format
    for a checkpoint (the plan's name), the mode when the checkpoint was never written."""
    pytest.importorskip("ninfer._core")
    bench = _load("gpu_bench")
    assert bench.weights_format(tmp_path, None) == "bf16"
    assert bench.weights_format(tmp_path / "missing", "fp8") == "fp8"
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--workdir", str(tmp_path / "w")]))
    path = b.checkpoint("llama-3-8b")
    assert bench.weights_format(path, "q4") == "q4g64_f16s"
    assert bench.weights_format(path, "fp8") == "fp8_e4m3fn_row_bf16s"


def test_a_failing_gptfast_peer_keeps_ninfers_decode_record(tmp_path, monkeypatch):
    """gpt-fast's compilation or memory failing in its subprocess leaves ninfer's record with no
    peer value and the failure in `peer_note`; the 27B shape keeps the transformers peer."""
    pytest.importorskip("ninfer._core")
    bench = _load("gpu_bench")
    a = bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--decode-8b", "--workdir", str(tmp_path / "w"),
                          "--quantize", "q4", "--peer-gptfast", str(fake_gpt_fast(tmp_path / "g")), "--tokens", "8"])
    b = bench.Bench(a)
    jobs = []

    def failing_peer(b, job, timeout_s=1200):
        jobs.append(job)
        raise RuntimeError("peer worker failed (1): torch.compile ran out of memory")

    monkeypatch.setattr(bench, "run_peer", failing_peer)
    [rec] = bench.part_decode(b, "llama-3-8b")
    assert jobs[0]["kind"] == "gptfast" and jobs[0]["gpt_fast"] == a.peer_gptfast and jobs[0]["tokens"] == 8
    assert rec["value"] > 0 and rec["weights"] == "q4g64_f16s"
    assert rec["peer"] == "gpt-fast int4 g64 (torch.compile)" and rec["peer_value"] is None
    assert "torch.compile ran out of memory" in rec["peer_note"]
    monkeypatch.setattr(bench, "run_peer", lambda b, job, timeout_s=1200: jobs.append(job) or {"tok_s": 5.0})
    [rec] = bench.part_decode(b, "qwen3_5-27b")
    assert jobs[-1]["kind"] == "decode" and rec["peer"].startswith("transformers generate") and rec["peer_value"] == 5.0


@pytest.mark.parametrize("quantize, rate, weights", [(None, 1e12, "bf16"), ("fp8", 3e12, "fp8_e4m3fn_row_bf16s"),
                                                     ("q4", 1e12, "q4g64_f16s")])
def test_gpu_prefill_records_hold_fp8_to_the_fp8_tensor_rate(tmp_path, monkeypatch, quantize, rate, weights):
    """gpu_prefill's run on the CPU (a tiny Llama for the checkpoint, the rates given): an fp8 run's
    fraction is its FLOPs over the FP8 tensor rate, any other run's over the bf16 GEMM rate, which
    every record keeps in gemm_rate_flop_s; `weights` names the packed format."""
    pytest.importorskip("ninfer._core")
    import transformers as tf

    prefill = _load("gpu_prefill")

    def tiny_model(shape, layers, max_pos):
        # Head size 64: the record's weights come from the GPU plan, which takes the CUDA kernels' sizes.
        cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                             vocab_size=4096, num_hidden_layers=layers, max_position_embeddings=max_pos,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        cfg.architectures = ["LlamaForCausalLM"]
        return tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), cfg

    real_prefill = prefill.ninfer_prefill
    monkeypatch.setattr(prefill, "build_model", tiny_model)
    monkeypatch.setattr(prefill, "gemm_rate", lambda hidden: 1e12)
    monkeypatch.setattr(prefill, "fp8_tensor_rate", lambda: {"rate": 3e12, "exact_accum": 2e12, "fast_accum": 3e12})
    monkeypatch.setattr(prefill, "ninfer_prefill", lambda *a, **kw: real_prefill(*a, **kw, device="cpu"))
    monkeypatch.setattr(prefill.subprocess, "run", lambda *a, **kw: SimpleNamespace(stdout="Test GPU\n"))
    out = tmp_path / "p.json"
    argv = ["--out", str(out), "--prompts", "32,64", "--layers", "2", "--skip-peer", "--dir", str(tmp_path / "c")]
    prefill.run(prefill.parse_args(argv + (["--quantize", quantize] if quantize else [])))
    recs = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in recs] == [32, 64]
    for r in recs:
        assert r["weights"] == weights and r["config"]["quantize"] == quantize and r["gemm_rate_flop_s"] == 1e12
        assert r["fraction_of_ceiling"] == round(r["flops_per_token"] * r["value"] / rate, 4)
        assert ("fp8_tensor_rate_flop_s" in r) == (quantize == "fp8")
        assert r["ceiling"].startswith("FP8 tensor rate" if quantize == "fp8" else "bf16 GEMM rate")
