"""The `ninfer` program as a user runs it: a real subprocess, stdout for the answer, stderr for figures."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.parametrize("args", [["--tp", "2"], ["--devices", "0,1"],
                                  ["--kv-dtype", "int8"], ["--vision"], ["--host-kv-mib", "1024"],
                                  ["--gdn-state-fp16"],
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


def _help_entries(text: str) -> dict:
    """{first option string or positional name: its whole entry} of an argparse --help text."""
    entries, key = {}, None
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            key = line.split()[0].rstrip(",")
            entries[key] = line
        elif line.startswith("   ") and key is not None:
            entries[key] += " " + line.strip()
        else:
            key = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def _value_options(parser):
    """(first option string or name, default) of every argument that takes a value, but the
    required choice of `run` (--prompt or --messages), which has no default."""
    required = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    for action in parser._actions:
        if action.nargs == 0 or action.help == argparse.SUPPRESS or action in required:
            continue
        yield (action.option_strings[0] if action.option_strings else action.metavar or action.dest), action.default


@pytest.mark.parametrize("command", ["run", "serve"])
def test_help_shows_the_default_of_every_option(command, ninfer_env):
    from ninfer.cli import build_run_parser
    from ninfer.server.serve import build_parser

    proc = run_cli([command, "--help"], ninfer_env)
    assert proc.returncode == 0, proc.stderr.decode()
    entries = _help_entries(proc.stdout.decode())
    options = list(_value_options(build_run_parser() if command == "run" else build_parser()))
    assert len(options) > 15
    for name, default in options:
        assert name in entries, (name, sorted(entries))
        assert "default" in entries[name], entries[name]
        if default not in (None, []) and f"default: {default}" not in entries[name]:
            assert f"{default} (default)" in entries[name], entries[name]
    if command == "serve":
        for name, shown in (("--host", "127.0.0.1"), ("--port", "8000"), ("--max-concurrency", "64"),
                            ("--log-level", "warning"), ("--prefill-chunk", "512")):
            assert f"(default: {shown})" in entries[name], entries[name]
        assert "NINFER_API_KEY" in entries["--api-key"]
    else:
        assert "(default: 512)" in entries["--prefill-chunk"]


def test_serve_help_does_not_show_the_api_key(ninfer_env):
    proc = run_cli(["serve", "--help"], dict(ninfer_env, NINFER_API_KEY="s3cret-key"))
    assert proc.returncode == 0 and "s3cret-key" not in proc.stdout.decode()


def test_run_and_serve_take_the_same_sampling_flags():
    """One definition (cli.add_sampling_flags): the same flags, metavars and help in both."""
    from ninfer.cli import SAMPLING_FLAGS, build_run_parser
    from ninfer.server.serve import build_parser

    def sampling(parser):
        return {a.option_strings[0]: (a.metavar, a.help) for a in parser._actions
                if a.option_strings and (a.option_strings[0] in SAMPLING_FLAGS or a.option_strings[0] == "--greedy")}

    run, serve = sampling(build_run_parser()), sampling(build_parser())
    assert set(run) == set(SAMPLING_FLAGS) | {"--greedy"}
    assert {k: v for k, v in run.items() if k != "--greedy"} == {k: v for k, v in serve.items() if k != "--greedy"}


@pytest.mark.parametrize("flag,value,needle", [
    ("--top-k", "-2", "--top-k -2: `top_k` must be >= -1"),
    ("--temperature", "nan", "--temperature nan: `temperature` must be finite"),
    ("--seed", "1.5", "--seed must be an integer, got '1.5'"),
])
def test_run_and_serve_refuse_a_sampling_flag_alike(qwen3_dir, ninfer_env, flag, value, needle):
    """Both check a sampling flag as the request field of the same name is checked."""
    run = run_cli(["run", str(qwen3_dir), "--prompt", "hi", flag, value], ninfer_env)
    serve = run_cli(["serve", str(qwen3_dir), flag, value], ninfer_env)
    for proc in (run, serve):
        err = " ".join(proc.stderr.decode().split())
        assert proc.returncode == 2 and needle in err, err
        assert "serving" not in err


def test_tests_and_their_subprocesses_import_the_installed_package(repo_root, ninfer_env):
    """The package under test is the installed one (or the build a developer put on PYTHONPATH),
    never the checkout's python/ by accident, and the programs the tests start import the same."""
    import ninfer

    here = Path(ninfer.__file__).resolve()
    checkout = (repo_root / "python").resolve()
    named = any(Path(p).resolve() == checkout for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    assert named or checkout not in here.parents, here
    proc = subprocess.run([sys.executable, "-c", "import ninfer; print(ninfer.__file__)"], capture_output=True,
                          text=True, env=ninfer_env, cwd=repo_root, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == here


def test_engine_option_flags_become_the_engines_keyword_arguments():
    """`run` and `serve` share the engine options; each flag is the `LLM(...)` argument of the same
    name, and the defaults are the engine's."""
    from ninfer.cli import build_run_parser, engine_option_kwargs
    from ninfer.server.serve import build_parser

    for parser, base in ((build_run_parser(), ["m", "--prompt", "x"]), (build_parser(), ["m"])):
        assert engine_option_kwargs(parser.parse_args(base)) == dict(
            async_scheduling=True, cuda_graphs=True, batch_invariant=False, device_sampling=True, device_profile=None,
            json_schema_open_objects=False, spec=None, draft_tokens=None, drafter=None, spec_adaptive=False,
            lm_head_draft=False, lm_head_draft_size=None)
        args = parser.parse_args([*base, "--no-async-scheduling", "--no-cuda-graphs", "--batch-invariant",
                                  "--no-device-sampling", "--device-profile-path", "h200.json",
                                  "--json-schema-open-objects", "--spec", "mtp", "--draft-tokens", "4",
                                  "--spec-adaptive", "--lm-head-draft", "--lm-head-draft-size", "512"])
        assert engine_option_kwargs(args) == dict(
            async_scheduling=False, cuda_graphs=False, batch_invariant=True, device_sampling=False,
            device_profile="h200.json", json_schema_open_objects=True, spec="mtp", draft_tokens=4, drafter=None,
            spec_adaptive=True, lm_head_draft=True, lm_head_draft_size=512)
        args = parser.parse_args([*base, "--spec", "dflash", "--draft-tokens", "4", "--drafter", "d"])
        assert engine_option_kwargs(args)["drafter"] == "d"


@pytest.mark.parametrize("args,needle", [
    (["--spec", "ngram", "--draft-tokens", "0"], "--draft-tokens 0 is outside 1..8"),
    (["--spec", "ngram", "--draft-tokens", "9"], "--draft-tokens 9 is outside 1..8"),
    (["--draft-tokens", "3"], "--draft-tokens 3 needs --spec"),
    (["--spec", "medusa"], "--spec medusa is not a drafting method"),
    (["--spec", "mtp", "--draft-tokens", "9"], "--draft-tokens 9 is outside 1..8"),
    (["--spec", "ngram", "--lm-head-draft"], "--lm-head-draft needs --spec mtp"),
    (["--lm-head-draft"], "--lm-head-draft needs --spec mtp"),
    (["--spec-adaptive"], "--spec-adaptive needs --spec"),
    (["--spec", "mtp", "--lm-head-draft-size", "64"], "--lm-head-draft-size needs --lm-head-draft"),
    (["--spec", "mtp", "--lm-head-draft", "--lm-head-draft-size", "0"], "--lm-head-draft-size 0 must be at least 1"),
])
def test_bad_speculation_flags_exit_2_naming_the_flag(qwen3_dir, ninfer_env, args, needle):
    proc = run_cli(["run", str(qwen3_dir), "--prompt", "hi", *args], ninfer_env)
    assert proc.returncode == 2 and needle in proc.stderr.decode(), proc.stderr.decode()


def test_run_with_ngram_drafts_prints_the_plain_greedy_answer(qwen3_dir, ninfer_env):
    base = ["run", str(qwen3_dir), "--device", "cpu", "--prompt", "a b a b a b", "--max-new", "24", "--greedy",
            "--ignore-eos"]
    plain = run_cli(base, ninfer_env)
    spec = run_cli([*base, "--spec", "ngram", "--draft-tokens", "3"], ninfer_env)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr.decode()
    assert spec.stdout == plain.stdout
    assert "mean accepted length" in spec.stderr.decode() and "mean accepted length" not in plain.stderr.decode()


def test_run_with_mtp_drafts_prints_the_plain_greedy_answer_and_needs_mtp_weights(qwen3_dir, ninfer_env):
    base = ["run", "--device", "cpu", "--prompt", "def add(a, b):\n", "--max-new", "24", "--greedy", "--ignore-eos"]
    plain = run_cli(base, ninfer_env)
    spec = run_cli([*base, "--spec", "mtp", "--draft-tokens", "3"], ninfer_env)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr.decode()
    assert spec.stdout == plain.stdout
    assert "mean accepted length" in spec.stderr.decode()
    bare = run_cli(["run", str(qwen3_dir), "--device", "cpu", "--prompt", "hi", "--spec", "mtp"], ninfer_env)
    assert bare.returncode != 0
    assert "--spec mtp needs the model's mtp.* weights; this checkpoint has none" in bare.stderr.decode()


def test_engine_option_flags_run_and_a_device_profile_on_the_cpu_is_refused_naming_it(qwen3_dir, ninfer_env):
    ok = run_cli(["run", str(qwen3_dir), "--device", "cpu", "--prompt", "hi", "--max-new", "3", "--greedy",
                  "--no-async-scheduling", "--no-cuda-graphs", "--batch-invariant", "--no-device-sampling"], ninfer_env)
    assert ok.returncode == 0, ok.stderr.decode()
    bad = run_cli(["run", str(qwen3_dir), "--device", "cpu", "--prompt", "hi", "--device-profile-path", "h200.json"],
                  ninfer_env)
    err = bad.stderr.decode()
    assert bad.returncode != 0 and "h200.json" in err and "--device-profile-path" in err, err


@pytest.mark.parametrize("cmd,flag,value", [
    ("run", "--thinking-budget", "-1"),
    ("serve", "--reasoning-budget", "-1"),
    ("serve", "--reasoning-budget", "many"),
    ("serve", "--reasoning-effort-budgets", "huge=3"),
    ("serve", "--reasoning-effort-budgets", "low=-1"),
])
def test_bad_thinking_budget_flags_exit_2_naming_flag_and_value(qwen3_dir, ninfer_env, cmd, flag, value):
    args = [cmd, str(qwen3_dir), *(["--prompt", "hi"] if cmd == "run" else []), flag, value]
    proc = run_cli(args, ninfer_env)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and flag in err and value in err, err
    assert "serving" not in err
