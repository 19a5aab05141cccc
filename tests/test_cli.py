"""The `ninfer` program as a user runs it: a real subprocess, stdout for the answer, stderr for figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ninfer import LLM, SamplingParams


def run_cli(args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, env=env,
                          timeout=timeout)


def test_run_prints_the_greedy_answer_on_stdout_and_speed_on_stderr(qwen3_dir, ninfer_env):
    with LLM(qwen3_dir, max_context=256) as llm:
        ids = llm.chat_prompt_ids([{"role": "user", "content": "Say hello"}])
        [ref] = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=20))
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "Say hello", "--max-new", "20", "--greedy",
                    "--max-context", "256"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == ref.text
    err = proc.stderr.decode()
    assert "loaded" in err
    assert "memory ledger (device cpu)" in err and "weights" in err and "KV cache" in err
    assert "prefill" in err and "decode" in err and "tok/s" in err
    assert f"prompt {len(ids)} tokens" in err


def test_raw_prompt_skips_the_chat_template(qwen3_dir, ninfer_env):
    with LLM(qwen3_dir, max_context=256) as llm:
        [ref] = llm.generate("Say hello", SamplingParams(temperature=0.0, max_tokens=12))
    proc = run_cli([str(qwen3_dir), "--prompt", "Say hello", "--raw", "--max-new", "12", "--greedy",
                    "--max-context", "256"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == ref.text
    assert f"prompt {len(ref.prompt_token_ids)} tokens" in proc.stderr.decode()


def test_answer_streams_before_the_process_ends(tiny_checkpoints, ninfer_env):
    model = tiny_checkpoints.get("llama", max_position_embeddings=2048)
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "run", str(model), "--prompt", "Go",
                             "--raw", "--greedy", "--ignore-eos", "--max-new", "1500", "--max-context", "2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ninfer_env)
    try:
        first = b""
        while not first:
            first = os.read(proc.stdout.fileno(), 64)
            if not first and proc.poll() is not None:
                break
        t_first = time.monotonic()
        still_running = proc.poll() is None
        rest, err = proc.communicate(timeout=600)
        t_end = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert first, "no output at all"
    assert still_running, "stdout only arrived after the process ended"
    assert t_end - t_first > 0.05
    assert len(first) < len(first + rest)
    assert "generated 1500 tokens" in err.decode()


def test_messages_file_with_cjk_text_and_no_thinking(qwen3_dir, ninfer_env, tmp_path):
    messages = [{"role": "system", "content": "你是一个乐于助人的助手。"},
                {"role": "user", "content": "今天天气很好，我们去公园散步吧。東京は雨です 😀"}]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages, ensure_ascii=False), encoding="utf-8")
    with LLM(qwen3_dir, max_context=256) as llm:
        ids = llm.chat_prompt_ids(messages, chat_template_kwargs={"enable_thinking": False})
        [ref] = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=16))
    proc = run_cli(["run", str(qwen3_dir), "--messages", str(path), "--no-thinking", "--max-new", "16",
                    "--greedy", "--max-context", "256"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == ref.text
    assert f"prompt {len(ids)} tokens" in proc.stderr.decode()


def test_messages_file_as_an_object_with_tools(qwen3_dir, ninfer_env, tmp_path):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    path = tmp_path / "with_tools.json"
    path.write_text(json.dumps({"messages": messages, "tools": tools}), encoding="utf-8")
    with LLM(qwen3_dir, max_context=512) as llm:
        ids = llm.chat_prompt_ids(messages, tools=tools)
    proc = run_cli(["run", str(qwen3_dir), "--messages", str(path), "--max-new", "4", "--greedy",
                    "--max-context", "512"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert f"prompt {len(ids)} tokens" in proc.stderr.decode()


@pytest.mark.parametrize("content,needle", [("{not json", "not valid JSON"), ('{"tools": []}', "messages"),
                                            ('[{"content": "x"}]', "role")])
def test_malformed_messages_file_is_an_error_naming_the_path(qwen3_dir, ninfer_env, tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    proc = run_cli(["run", str(qwen3_dir), "--messages", str(path)], ninfer_env)
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert str(path) in err and needle in err


def test_missing_messages_file_is_an_error_naming_the_path(qwen3_dir, ninfer_env, tmp_path):
    path = tmp_path / "absent.json"
    proc = run_cli(["run", str(qwen3_dir), "--messages", str(path)], ninfer_env)
    assert proc.returncode == 2
    assert str(path) in proc.stderr.decode()


@pytest.mark.parametrize("flag,value", [("--max-new", "-5"), ("--max-new", "0"), ("--temperature", "-1"),
                                        ("--top-p", "1.5"), ("--device", "tpu"), ("--seed", "abc"),
                                        ("--max-context", "0"), ("--presence-penalty", "3"),
                                        ("--logits-dtype", "bfloat16"), ("--kv-dtype", "fp8")])
def test_bad_flag_values_exit_2_naming_flag_and_value(qwen3_dir, ninfer_env, flag, value):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", flag, value], ninfer_env)
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert flag in err and value in err


@pytest.mark.parametrize("args", [["--tp", "2"], ["--devices", "0,1"], ["--spec", "mtp"], ["--draft-tokens", "3"],
                                  ["--kv-dtype", "int8"], ["--vision"], ["--host-kv-mib", "1024"],
                                  ["--device-profile-path", "p.json"], ["--gdn-state-fp16"], ["--lm-head-draft"],
                                  ["--vision-residency", "overlay"], ["--vision-max-merged", "4"]])
def test_later_work_flags_are_refused_as_not_supported_yet(qwen3_dir, ninfer_env, args):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", *args], ninfer_env)
    assert proc.returncode == 2
    assert f"{args[0]} " in proc.stderr.decode() and "is not supported yet" in proc.stderr.decode()


def test_kv_dtype_names_are_the_cores():
    """The CLI's copies of the --kv-dtype names (it refuses the others before importing the core)
    are the core's, which maps them to types (rust_core/src/model/kv_dtype.rs)."""
    from ninfer import _core
    from ninfer.cli import KV_DTYPES, QUANTIZED_KV_DTYPES, kv_dtype_error

    assert tuple(_core.KV_DTYPES) == KV_DTYPES
    assert tuple(_core.QUANTIZED_KV_DTYPES) == QUANTIZED_KV_DTYPES
    assert all(kv_dtype_error(name) is None for name in KV_DTYPES + ("BF16", "Float32"))


@pytest.mark.parametrize("value,needle", [("int8", "is not supported yet: quantized KV caches (int8, rk8v4, rk4v4) are later work"),
                                          ("rk4v4", "is not supported yet: quantized KV caches"),
                                          ("fp8", "is not a KV cache type")])
def test_kv_dtype_no_backend_keeps_is_refused_with_what_each_keeps(qwen3_dir, ninfer_env, value, needle):
    """A quantized format (SEEDS' int8, rk8v4, rk4v4) is later work and an unknown name is no
    type; both exit 2 before the core loads, saying what each backend keeps (cli.kv_dtype_error)."""
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", "--kv-dtype", value], ninfer_env)
    err = " ".join(proc.stderr.decode().split())
    assert proc.returncode == 2
    assert f"--kv-dtype {value} {needle}" in err, err
    assert "bf16 on a GPU, f16 on sm_70/sm_75, float32 on the CPU" in err, err


def test_kv_dtype_float32_runs_on_the_cpu_and_bf16_is_refused_naming_float32(qwen3_dir, ninfer_env):
    """The CPU keeps its KV cache in float32: `--kv-dtype float32` runs as auto does; bf16 (what
    a GPU keeps) is refused by the core once the device is known, naming float32."""
    base = ["run", str(qwen3_dir), "--prompt", "Say hello", "--max-new", "8", "--greedy", "--max-context", "256",
            "--device", "cpu"]
    auto = run_cli(base, ninfer_env)
    named = run_cli(base + ["--kv-dtype", "float32"], ninfer_env)
    assert auto.returncode == 0 and named.returncode == 0, named.stderr.decode()
    assert named.stdout == auto.stdout
    bf16 = run_cli(base + ["--kv-dtype", "bf16"], ninfer_env)
    err = " ".join(bf16.stderr.decode().split())
    assert bf16.returncode == 1
    assert "--kv-dtype" in err and "bf16 is not supported on cpu: its KV cache is float32 (use auto or float32)" in err, err


def test_prompt_too_long_for_max_new_exits_2_with_the_numbers(qwen3_dir, ninfer_env):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", "--raw", "--max-new", "300", "--max-context", "256"],
                   ninfer_env)
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert "300" in err and "256" in err


def test_missing_model_directory_exits_2_naming_it(ninfer_env, tmp_path):
    missing = tmp_path / "no_such_model"
    proc = run_cli(["run", str(missing), "--prompt", "hi"], ninfer_env)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr.decode() and "nothing exists" in proc.stderr.decode()


def test_a_model_file_is_refused_saying_what_a_model_is(ninfer_env, tmp_path):
    # The original's single-file container is what its users pass first.
    f = tmp_path / "model.ninfer"
    f.write_bytes(b"\0" * 16)
    for cmd in (["run", str(f), "--prompt", "hi"], ["serve", str(f)]):
        proc = run_cli(cmd, ninfer_env)
        err = proc.stderr.decode()
        assert proc.returncode == 2, err
        assert str(f) in err and "is not a directory but a file" in err and ".ninfer and GGUF" in err


def test_greedy_with_a_temperature_is_refused(qwen3_dir, ninfer_env):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", "--greedy", "--temperature", "0.7"], ninfer_env)
    assert proc.returncode == 2 and "--greedy and --temperature 0.7 contradict" in proc.stderr.decode()


def test_kv_capacity_auto_is_accepted_as_by_serve(qwen3_dir, ninfer_env):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", "--raw", "--max-new", "2", "--greedy",
                    "--kv-capacity", "auto", "--device", "cpu"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()


def test_help_lists_the_commands(ninfer_env):
    proc = run_cli(["--help"], ninfer_env)
    assert proc.returncode == 0
    assert "run" in proc.stdout.decode() and "serve" in proc.stdout.decode()


def test_serve_delegates_to_the_server_program(ninfer_env):
    pytest.importorskip("ninfer.server.serve")
    proc = run_cli(["serve", "--help"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "--host" in proc.stdout.decode() and "--port" in proc.stdout.decode()


def test_run_without_a_model_uses_the_bundled_demo_model(ninfer_env):
    import ninfer.cli

    demo = ninfer.cli.default_model_dir()
    if demo is None:
        pytest.skip("no bundled demo model in this checkout")
    proc = run_cli(["run", "--prompt", "def add(a, b):", "--raw", "--max-new", "4", "--greedy"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert f"loaded {demo}" in proc.stderr.decode()
    assert "generated 4 tokens" in proc.stderr.decode()


def test_device_auto_runs_where_it_can_and_says_which_device(qwen3_dir, ninfer_env):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "Say hello", "--max-new", "4", "--greedy",
                    "--max-context", "256", "--device", "auto"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    err = proc.stderr.decode()
    if "memory ledger (device cpu)" in err:
        assert "device=auto" in err and "using the CPU" in err, err
    else:
        assert "memory ledger (device cuda:0)" in err, err
