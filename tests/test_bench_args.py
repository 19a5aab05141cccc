"""The GPU benchmark scripts reject malformed arguments before they build a checkpoint (which
takes minutes on the GPU machine): exit status 2 and a message naming the offending value; and
gpu_prefill removes the checkpoint it built when it ends."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench as _load  # noqa: E402


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--profile", "-1"], "--profile -1"),
        (["--prompts", "2048", "--profile", "4096"], "--profile 4096"),
        (["--prompts", "2k,8k"], "--prompts '2k,8k'"),
        (["--prompts", "0,8"], "--prompts '0,8'"),
    ],
)
def test_gpu_prefill_rejects_bad_arguments_naming_them(argv, named, capsys):
    prefill = _load("gpu_prefill")
    with pytest.raises(SystemExit) as e:
        prefill.parse_args(["--out", "x.json", *argv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [(["--profile-batch", "0"], "--profile-batch 0"),
                                         (["--quantize", "q4", "--startup"], "--quantize q4: with --startup"),
                                         (["--quantize", "q3", "--decode-8b"], "'q3'"),
                                         (["--tp-model", "llama-70b"], "llama-70b"),
                                         (["--ab", "cuda_graphs=true", "--decode-8b"], "--ab 'cuda_graphs=true'"),
                                         (["--ab", "NINFER_PDL=0,1", "--decode-8b"], "--ab 'NINFER_PDL=0,1'"),
                                         (["--ab", "cuda_graphs=true,false", "--decode-8b", "--ab-rounds", "0"],
                                          "--ab-rounds 0"),
                                         (["--option", "pdl=false", "--decode-8b"], "--option 'pdl=false'"),
                                         (["--option", "cuda_graphs=0", "--decode-8b"], "--option 'cuda_graphs=0'"),
                                         (["--option", "cuda_graphs=false", "--option", "cuda_graphs=true",
                                           "--decode-8b"], "cuda_graphs is given twice"),
                                         (["--option", "cuda_graphs=false", "--ab", "cuda_graphs=true,false",
                                           "--decode-8b"], "--option sets cuda_graphs already"),
                                         (["--option", "cuda_graphs=false", "--startup"], "takes no engine options"),
                                         (["--ab", "cuda_graphs=true,false"], "takes no engine options"),
                                         (["--sampling", "{bad", "--skip-peer"], "'{bad' is not JSON"),
                                         (["--sampling", "[1]", "--skip-peer"], "'[1]': expected a JSON object"),
                                         (["--sampling", '{"max_tokens": 3}', "--skip-peer"], "max_tokens is set by"),
                                         (["--sampling", '{"presence_penalty": 0.5}'], "add --skip-peer")])
def test_gpu_bench_rejects_bad_arguments_naming_them(argv, named, capsys):
    bench = _load("gpu_bench")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", "x.json", *argv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_gpu_bench_device_profile_reaches_every_engine_and_record(tmp_path, capsys):
    """--device-profile: a readable JSON object whose plan is an object, given to every engine as
    `device_profile` and named (path and plan) in every record; anything else is refused naming
    the file before a checkpoint is built."""
    bench = _load("gpu_bench")
    prof = tmp_path / "h100.json"
    plan = {"pdl": False, "smem_carveout": 100}
    prof.write_text(json.dumps({"version": 1, "device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
                                "plan": plan}))
    a = bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--workdir", str(tmp_path / "w"), "--decode-8b",
                          "--quantize", "q4", "--device-profile", str(prof)])
    assert a.options == {"quantize": "q4", "device_profile": str(prof.resolve())}
    b = bench.Bench(a)
    rec = b.record("decode_bs1_tok_s", "llama-3-8b", 1.0, b.shape("llama-3-8b"))
    assert rec["options"]["device_profile"] == str(prof.resolve()) and rec["device_profile_plan"] == plan
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{plan")
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    for argv, named in [([str(tmp_path / "none.json"), "--decode-8b"], "none.json"),
                        ([str(bad_json), "--decode-8b"], "not JSON"),
                        ([str(listed), "--decode-8b"], "'plan' is an object"),
                        ([str(prof), "--startup"], "--device-profile: the startup part")]:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--out", "x.json", "--device-profile", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert named in err and "--device-profile" in err, err


def test_gpu_bench_sampling_fields_reach_the_timed_requests_and_the_records():
    bench = _load("gpu_bench")
    a = bench.parse_args(["--out", "x.json", "--skip-peer", "--sampling", '{"presence_penalty": 0.5, "seed": 3}'])
    params = json.loads(bench.request_params(SimpleNamespace(a=a), 9))
    assert params == {"max_tokens": 9, "temperature": 0.0, "ignore_eos": True, "presence_penalty": 0.5, "seed": 3}
    plain = bench.parse_args(["--out", "x.json"])
    assert json.loads(bench.request_params(SimpleNamespace(a=plain), 9)) == {"max_tokens": 9, "temperature": 0.0,
                                                                             "ignore_eos": True}


def test_gpu_prefill_accepts_a_profile_within_the_longest_prompt():
    prefill = _load("gpu_prefill")
    a = prefill.parse_args(["--out", "x.json", "--prompts", "2048,8192", "--profile", "8192"])
    assert a.lengths == [2048, 8192] and a.profile == 8192


def test_profile_device_idle_splits_gaps_at_each_steps_first_kernel():
    """gpu_bench --profile's timeline: overlapping kernels (PDL) count once, a gap that ends at
    a step's first kernel is host turnaround, any other gap is idle inside a step."""
    from types import SimpleNamespace as NS

    bench = _load("gpu_bench")

    def ev(start, end, name):
        return NS(time_range=NS(start=start, end=end), name=name)

    events = [ev(100, 110, "embedding_gather"), ev(112, 120, "gemv_m1"), ev(0, 10, "embedding_gather"),
              ev(9, 20, "gemv_m1"), ev(25, 30, "sample_scan"), ev(5, 5, "empty")]
    got = bench.device_idle(events, steps=2)
    assert got == {"busy_us_per_step": 21.5, "between_steps_us_per_step": 35.0, "within_steps_us_per_step": 3.5}
    assert bench.device_idle([], steps=4) == {"busy_us_per_step": 0.0, "between_steps_us_per_step": 0.0,
                                              "within_steps_us_per_step": 0.0}


def test_a_checkpoint_that_would_not_fit_is_refused_naming_the_kept_ones(tmp_path, monkeypatch):
    """gpu_bench checks the disk before writing a random checkpoint: too little room is an error
    naming the bytes needed, the bytes free and the checkpoints kept beside it (with sizes)."""
    import shutil
    from types import SimpleNamespace as NS

    bench = _load("gpu_bench")
    kept = tmp_path / "llama-3-8b-32l"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    (kept / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    (tmp_path / "not-a-checkpoint").mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: NS(total=64e9, used=47e9, free=17e9))
    target = tmp_path / "qwen3_5-27b-64l"
    msg = bench.room_for_checkpoint(target, 53_800_000_000)
    assert msg is not None
    assert "needs 53.8 GB" in msg and "17.0 GB free" in msg and str(target) in msg
    assert f"{kept} (0.0 GB)" in msg and "not-a-checkpoint" not in msg and "--workdir" in msg
    # Enough room (with the 5% headroom), or a workdir that does not exist yet: no objection.
    assert bench.room_for_checkpoint(target, 16_000_000_000) is None
    assert bench.room_for_checkpoint(tmp_path / "new" / "deeper" / "llama-3-8b-32l", 16_000_000_000) is None
    assert bench.room_for_checkpoint(target, 16_500_000_000) is not None


def test_a_checkpoint_write_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    """A write that fails midway (here the second shard: the disk filling up) removes the
    half-written checkpoint and re-raises, so its gigabytes do not starve later parts; a
    complete one is reused on the next call."""
    import safetensors.torch as st

    bench = _load("gpu_bench")
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--workdir", str(tmp_path / "w")]))
    real_save, calls = st.save_file, []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        b.checkpoint("llama-3-8b")
    assert len(calls) == 2 and not (tmp_path / "w" / "llama-3-8b-2l").exists()
    monkeypatch.setattr(st, "save_file", real_save)
    path = b.checkpoint("llama-3-8b")
    assert (path / "config.json").exists() and b.checkpoint("llama-3-8b") == path


def test_records_carry_the_settings_they_were_measured_under(tmp_path, monkeypatch):
    """Each record names the engine options --option set and the NINFER_* variables set (the
    architecture a GPU runs as; not the kernel-cache path or the commit); a run under none has
    neither an `options` nor an `env` field."""
    bench = _load("gpu_bench")
    for k in [k for k in __import__("os").environ if k.startswith("NINFER_")]:
        monkeypatch.delenv(k)
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--throughput"]))
    s = b.shape("llama-3-8b")
    plain = b.record("decode_throughput_tok_s", "llama-3-8b", 1.0, s)
    assert "env" not in plain and "options" not in plain
    monkeypatch.setenv("NINFER_EMULATE_ARCH", "80")
    monkeypatch.setenv("NINFER_KERNEL_CACHE", "/tmp/k")
    monkeypatch.setenv("NINFER_COMMIT", "abc")
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--throughput",
                                      "--option", "cuda_graphs=false", "--option", "batch_invariant=TRUE"]))
    rec = b.record("decode_throughput_tok_s", "llama-3-8b", 1.0, s)
    assert rec["env"] == {"NINFER_EMULATE_ARCH": "80"}
    assert rec["options"] == {"cuda_graphs": False, "batch_invariant": True}


def test_every_engine_the_parts_build_gets_the_options(tmp_path, monkeypatch):
    """--option's values reach `_core.Engine` as keyword arguments, beside each part's own."""
    core = pytest.importorskip("ninfer._core")
    bench = _load("gpu_bench")
    seen = []
    monkeypatch.setattr(core, "Engine", lambda path, **kw: seen.append((path, kw)) or "engine")
    a = bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--decode-8b",
                          "--option", "device_sampling=false", "--option", "async_scheduling=true"])
    eng, secs = bench.ninfer_engine(SimpleNamespace(a=a, ninfer_device="cpu"), tmp_path, max_context=64)
    assert eng == "engine" and secs >= 0
    assert seen == [(str(tmp_path), {"device": "cpu", "prefix_reuse": False, "device_sampling": False,
                                     "async_scheduling": True, "max_context": 64})]
    plain = bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--decode-8b"])
    bench.ninfer_engine(SimpleNamespace(a=plain, ninfer_device="cpu"), tmp_path)
    assert seen[1] == (str(tmp_path), {"device": "cpu", "prefix_reuse": False})


@pytest.mark.parametrize("prompt, tokens, context", [(128, 256, 8192), (8000, 128, 8192), (8000, 256, 16384),
                                                     (16384, 128, 32768), (32768, 128, 65536)])
def test_the_checkpoint_context_holds_the_longest_batch_1_run(tmp_path, prompt, tokens, context):
    """A long batch-1 run (--prompt + --tokens) needs a checkpoint whose context holds it (the
    engine refuses a prompt past max_position_embeddings): 8192, or the next power of two."""
    bench = _load("gpu_bench")
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--decode-8b",
                                      "--prompt", str(prompt), "--tokens", str(tokens)]))
    assert b.max_positions() == context
    assert b.max_positions() >= prompt + tokens


def test_bench_tokenizer_has_the_model_vocab_with_special_pad_bos_eos_and_round_trips_text():
    pytest.importorskip("tokenizers")
    tok = _load("bench_tokenizer").build_tokenizer(5000)
    assert tok.get_vocab_size() == 5000
    assert [tok.id_to_token(i) for i in range(3)] == ["<|pad|>", "<|bos|>", "<|eos|>"]
    text = 'Hello world. {"a": 12} x_y\n'
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()), "composed tokens are used"
    assert 2 not in ids, "no byte string encodes to the end-of-text id"


@pytest.mark.parametrize("size", [258, 10**7])
def test_bench_tokenizer_refuses_a_size_it_cannot_build_naming_it(size):
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match=f"vocab_size {size}"):
        _load("bench_tokenizer").build_tokenizer(size)


@pytest.mark.parametrize("keep", [False, True])
def test_gpu_prefill_deletes_its_checkpoint_after_the_run_unless_kept(tmp_path, monkeypatch, keep):
    """The 27B checkpoint (50 GB) left on the GPU machine's 64 GiB disk made the next benchmark
    of the same call fail; the run removes it when it ends, a failing run too."""
    prefill = _load("gpu_prefill")
    ckpt = tmp_path / "ckpt"

    def fake_run(a):
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(b"0" * 16)
        raise RuntimeError("the run fails after writing its checkpoint")

    monkeypatch.setattr(prefill, "run", fake_run)
    argv = ["gpu_prefill.py", "--out", str(tmp_path / "x.json"), "--dir", str(ckpt)] + (["--keep-checkpoint"] if keep else [])
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="fails after writing"):
        prefill.main()
    assert ckpt.exists() == keep


def test_decode_bytes_per_step_count_each_sequence_at_its_own_context(tmp_path, monkeypatch):
    """The bandwidth ceilings of gpu_bench: a decode step moves the weights once plus, per
    sequence, its KV cache at its own context (attention layers) and its recurrent state read and
    written (GDN layers, independent of the context); the throughput part's per-step ceiling sums
    these over the sequences each step ran, so a step of fewer sequences needs fewer bytes."""
    bench = _load("gpu_bench")
    b = bench.Bench(bench.parse_args(["--out", str(tmp_path / "o.json"), "--workdir", str(tmp_path)]))
    monkeypatch.setattr(bench.Bench, "weight_bytes", lambda self, s: (1_000_000, 2_000_000))
    llama, qwen = b.shape("llama-3-8b"), b.shape("qwen3_5-27b")
    # Llama-3-8B: 32 layers x (K, V) x 8 kv heads x 128 x 2 bytes = 128 KiB a token.
    assert b.seq_bytes(llama, 1) == 131072 and b.seq_bytes(llama, 1000) == 1000 * 131072
    assert b.step_bytes(llama, [1000, 3000]) == 1_000_000 + 4000 * 131072
    assert b.bytes_per_token(llama, 1500, batch=2) == b.step_bytes(llama, [1500, 1500])
    assert b.step_bytes(llama, []) == 1_000_000
    # Qwen3.5-27B: 16 attention layers x (K, V) x 4 kv heads x 256 x 2 bytes a token, plus the 48
    # GDN layers' state read and written: f32 delta state 48 heads x 128 x 128, bf16 conv state
    # (2 x 16 x 128 + 48 x 128 channels) x 3 taps.
    state = 48 * 2 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2)
    assert b.seq_bytes(qwen, 0) == state
    assert b.seq_bytes(qwen, 1001) - b.seq_bytes(qwen, 1000) == 16 * 2 * 4 * 256 * 2
    assert b.step_bytes(qwen, [10, 20, 30]) == 1_000_000 + 3 * state + 60 * 65536


def test_the_qwen2_shape_has_projection_biases_and_attention_only_bytes(tmp_path):
    """--decode-qwen2-7b times the bias path (`linear_bias`): its checkpoint config is Qwen2's,
    whose q/k/v projections carry biases the weights read per token include, and a sequence adds
    only its KV cache (no recurrent state) to a step's bytes."""
    bench = _load("gpu_bench")
    a = bench.parse_args(["--out", str(tmp_path / "r.json"), "--tiny", "--decode-qwen2-7b"])
    assert a.decode_qwen2_7b and not (a.decode_8b or a.decode_27b or a.throughput or a.startup)
    b = bench.Bench(a)
    s = b.shape("qwen2-7b")
    assert b.hf_config(s).architectures == ["Qwen2ForCausalLM"]
    shapes = b.param_shapes(s)
    assert {n.rsplit(".", 2)[-2] for n in shapes if n.endswith(".bias")} == {"q_proj", "k_proj", "v_proj"}
    assert b.seq_bytes(s, 100) == s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * 100 * 2
    weights, total = b.weight_bytes(s)
    assert weights == total - s["vocab"] * s["hidden"] * 2 + s["hidden"] * 2


def test_sampling_params_are_typed_or_json_text_as_the_build_takes_them(monkeypatch):
    """An --ab-builds run of a commit from before the typed params submits them as the JSON
    text that build's Engine.submit took; a build with `_core.SamplingParams` gets the object."""
    core = pytest.importorskip("ninfer._core")
    bench = _load("gpu_bench")
    text = '{"max_tokens": 5, "temperature": 0.0, "ignore_eos": true}'
    typed = bench._core_params(text)
    assert isinstance(typed, core.SamplingParams) and json.loads(typed.to_json())["max_tokens"] == 5
    assert json.loads(typed.to_json())["ignore_eos"] is True
    monkeypatch.delattr(core, "SamplingParams")
    assert bench._core_params(text) == text


def test_output_hashes_dry_run_is_the_same_in_two_processes(tmp_path):
    """benches/gpu_output_hashes.py (two builds compared by their greedy tokens) on the tiny
    shapes: a line per shape and batch, and the same hashes from a second process."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benches" / "gpu_output_hashes.py"

    def run() -> list:
        out = subprocess.run([sys.executable, str(script), "2", "tiny"], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
        assert out.returncode == 0, out.stderr[-2000:]
        return [line.split(" secs=")[0] for line in out.stdout.splitlines() if line.startswith("HASH ")]

    first = run()
    assert len(first) == 6 and all("hash=" in line for line in first)
    assert run() == first


def test_profile_kernel_path_prices_what_each_kernel_adds_to_the_timeline():
    """gpu_bench --profile: under PDL a kernel starts while the one before runs, so each kernel is
    priced by its end past the latest end before it; idle gaps and time hidden under an earlier
    kernel are not counted, and the sums add up to the busy union."""
    gb = _load("gpu_bench")

    def ev(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    # gemv 0-10; norm launched early (5) ends at 12: adds 2; a kernel hidden under gemv adds 0;
    # gemv again 11-20 adds 8; idle 20-30; emb 30-31 adds 1, not the 10 us gap.
    events = [ev("gemv", 0, 10), ev("norm", 5, 12), ev("hidden", 6, 9), ev("gemv", 11, 20), ev("emb", 30, 31)]
    path = {r["name"]: r for r in gb.kernel_path(events, steps=1)}
    assert path["gemv"]["adds_us_per_step"] == 18.0 and path["gemv"]["calls_per_step"] == 2.0
    assert path["gemv"]["us_per_call"] == 9.5
    assert path["norm"]["adds_us_per_step"] == 2.0 and path["norm"]["us_per_call"] == 7.0
    assert path["hidden"]["adds_us_per_step"] == 0.0
    assert path["emb"]["adds_us_per_step"] == 1.0
    busy = gb.device_idle(events, steps=1)["busy_us_per_step"]
    assert sum(r["adds_us_per_step"] for r in path.values()) == busy
    assert [r["name"] for r in gb.kernel_path(events, steps=2)][:2] == ["gemv", "norm"]
