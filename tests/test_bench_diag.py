"""benches/diag_batch_alone.py and diag_repeat.py: their arguments are checked, and on the CPU
(whose kernels do not depend on the batch, nor carry anything between requests) they find a
batch equal to each prompt alone, movement near zero, and every alone run repeating itself."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench


def _load():
    return load_bench("diag_batch_alone")


@pytest.mark.parametrize("argv, named", [(["--prompts", "21"], "--prompts 21"), (["--top", "1"], "--top 1"), (["--tokens", "0"], "--tokens 0")])
def test_diag_batch_alone_rejects_bad_arguments_naming_them(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        _load().parse_args(["--out", "x.json", *argv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_diag_batch_alone_on_the_cpu_finds_no_movement(tmp_path):
    out = tmp_path / "ba.json"
    summary = _load().main(["--out", str(out), "--device", "cpu", "--prompts", "3", "--tokens", "3", "--label", "cpu"])
    assert summary["equal"] == 3 and summary["prompts"] == 3
    assert summary["token0_move_max"] < 1e-4 and summary["max_move_max"] < 1e-4 and summary["gap_move_max"] < 1e-4
    assert summary["alone_repeats_bitwise"] == 3
    assert all(r["repeat"] == {"bitwise": True, "first_token_diff": None, "max_logprob_diff": 0.0, "order_only": True} for r in json.loads(out.read_text())[0]["rows"])
    runs = json.loads(out.read_text())
    assert len(runs) == 1 and runs[0]["summary"] == summary
    assert all(len(r["moves"]) == 3 and r["divergence"] is None for r in runs[0]["rows"])


@pytest.mark.parametrize("argv, named", [(["--prompts", "0"], "--prompts 0"), (["--tokens", "1"], "--tokens 1")])
def test_diag_repeat_rejects_bad_arguments_naming_them(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        load_bench("diag_repeat").parse_args(["--out", "x.json", *argv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_diag_repeat_on_the_cpu_finds_every_alone_run_repeating(tmp_path):
    """The CPU backend carries nothing from one request into the next: every pair of runs of
    the same prompts is identical, before and after batches."""
    out = tmp_path / "rep.json"
    result = load_bench("diag_repeat").main(["--out", str(out), "--device", "cpu", "--prompts", "2", "--tokens", "3", "--label", "cpu"])
    assert len(result["pairs"]) == 6 and result["repeating_pairs"] == 6
    assert all(d is None for diffs in result["pairs"].values() for d in diffs)
    assert json.loads(out.read_text()) == [json.loads(json.dumps(result))]
