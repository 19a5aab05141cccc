"""The GPU benchmark scripts reject malformed arguments before they build a checkpoint (which
takes minutes on the GPU machine): exit status 2 and a message naming the offending value."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCHES = Path(__file__).resolve().parent.parent / "benches"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_gpu_prefill_accepts_a_profile_within_the_longest_prompt():
    prefill = _load("gpu_prefill")
    a = prefill.parse_args(["--out", "x.json", "--prompts", "2048,8192", "--profile", "8192"])
    assert a.lengths == [2048, 8192] and a.profile == 8192
