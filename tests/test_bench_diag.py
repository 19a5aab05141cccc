"""benches/diag_batch_alone.py: its arguments are checked, and on the CPU (whose kernels do not
depend on the batch) it finds a batch equal to each prompt alone, movement near zero."""

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
    runs = json.loads(out.read_text())
    assert len(runs) == 1 and runs[0]["summary"] == summary
    assert all(len(r["moves"]) == 3 and r["divergence"] is None for r in runs[0]["rows"])
