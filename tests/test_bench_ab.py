"""gpu_bench.py --ab (benches/gpu_ab.py): A-B runs of the GPU benchmark, one process per setting
of a NINFER_* variable, alternated round after round, records tagged with their setting and
summarized by setting. The pure parts here; an end-to-end run on the tiny CPU shapes below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench_scripts import BENCHES, load_bench


def _ab():
    return load_bench("gpu_ab")


@pytest.mark.parametrize("parser, spec", [
    *(("parse_ab", s) for s in ["NINFER_X", "FOO=1,2", "NINFER_X=1", "NINFER_X=1,,2", "=1,2"]),
    *(("parse_ab_builds", s) for s in ["abc=/x", "abc=/x,abc=/y", "abc=/x,=/y", "abc/x,def=/y", "abc=,def=/y"]),
])
def test_a_malformed_ab_or_builds_spec_is_refused_naming_it(parser, spec):
    with pytest.raises(ValueError) as e:
        getattr(_ab(), parser)(spec)
    assert repr(spec) in str(e.value)


def test_an_ab_spec_gives_the_variable_and_its_values():
    assert _ab().parse_ab("NINFER_TC_DECODE_MIN_TILES= 4, 8 ,16") == ("NINFER_TC_DECODE_MIN_TILES", ["4", "8", "16"])


def test_each_run_gets_the_parts_without_the_ab_arguments_and_keeps_the_checkpoints():
    got = _ab().child_argv(["--out", "x.json", "--decode-8b", "--ab", "NINFER_A=0,1", "--ab-rounds=3",
                            "--out=y.json", "--layers", "4"])
    assert got == ["--decode-8b", "--layers", "4", "--keep-checkpoints"]
    assert _ab().child_argv(["--keep-checkpoints", "--ab=NINFER_A=0,1"]) == ["--keep-checkpoints"]


def test_the_summary_gives_each_setting_its_mean_and_ratio_per_metric_and_case():
    def rec(value, setting, conc, frac=None):
        return {"metric": "decode_throughput_tok_s", "model": "llama-3-8b", "concurrency": conc, "value": value,
                "fraction_of_ceiling": frac, "ab": {"variable": "NINFER_T", "value": setting, "round": 1}}

    records = [rec(100.0, "4", 8, 0.5), rec(110.0, "8", 8, 0.55), rec(102.0, "4", 8, 0.51), rec(112.0, "8", 8, 0.56),
               rec(300.0, "4", 64), rec(330.0, "8", 64),
               {"metric": "decode_throughput_tok_s", "model": "llama-3-8b", "value": None, "error": "x",
                "ab": {"variable": "NINFER_T", "value": "8", "round": 1}}]
    lines = _ab().summarize(records, "NINFER_T", ["4", "8"])
    assert len(lines) == 2
    c8 = next(line for line in lines if "concurrency=8" in line)
    assert "NINFER_T=4: 101 (100, 102) fraction 0.505 ratio 1.0000" in c8
    assert "NINFER_T=8: 111 (110, 112) fraction 0.555 ratio 1.0990" in c8
    c64 = next(line for line in lines if "concurrency=64" in line)
    assert "NINFER_T=8: 330 (330) ratio 1.1000" in c64


def test_a_tiny_ab_run_alternates_processes_and_tags_every_record(tmp_path):
    """End to end on the tiny CPU shapes: two settings of NINFER_ASYNC_SCHEDULING, one round;
    each run's record carries its setting (the bench's env and the ab tag), the summary names
    both, and the checkpoint the first run wrote is gone at the end."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("ninfer._core")
    out, work = tmp_path / "ab.json", tmp_path / "work"
    p = subprocess.run([sys.executable, str(BENCHES / "gpu_bench.py"), "--tiny", "--decode-8b", "--skip-peer",
                        "--tokens", "8", "--out", str(out), "--workdir", str(work),
                        "--ab", "NINFER_ASYNC_SCHEDULING=0,1", "--ab-rounds", "1"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert [(r["metric"], r["ab"]["value"], r["ab"]["round"]) for r in recs] == [
        ("decode_bs1_tok_s", "0", 1), ("decode_bs1_tok_s", "1", 1)]
    assert [r["env"]["NINFER_ASYNC_SCHEDULING"] for r in recs] == ["0", "1"]
    assert all(r["value"] > 0 for r in recs)
    assert "A-B summary" in p.stdout and "NINFER_ASYNC_SCHEDULING=1:" in p.stdout
    assert not any(work.iterdir()), list(work.iterdir())


def test_a_builds_spec_gives_each_commit_and_its_site():
    assert _ab().parse_ab_builds("93ca6d2=/tmp/old, 4a58b96=/tmp/new") == [("93ca6d2", "/tmp/old"), ("4a58b96", "/tmp/new")]


def test_a_build_run_gets_its_own_commit_not_the_callers():
    got = _ab().child_argv(["--commit", "abc", "--decode-27b", "--ab-builds", "a=/x,b=/y", "--commit=zz", "--out", "o.json"])
    assert got == ["--decode-27b", "--keep-checkpoints"]


def test_builds_that_are_not_directories_are_refused_before_any_run(tmp_path):
    p = subprocess.run([sys.executable, str(BENCHES / "gpu_bench.py"), "--tiny", "--decode-8b", "--out", str(tmp_path / "o.json"),
                        "--ab-builds", f"aaa={tmp_path},bbb={tmp_path / 'missing'}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bbb" in p.stderr and "missing" in p.stderr, p.stderr[-2000:]


def test_a_tiny_builds_run_puts_each_site_first_and_records_its_commit(tmp_path):
    """End to end on the tiny CPU shapes: two "builds" (empty site directories, so both import the
    installed ninfer); each run's records carry the build's commit and the ab tag, and the
    summary names both."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("ninfer._core")
    out, work = tmp_path / "ab.json", tmp_path / "work"
    old, new = tmp_path / "site_old", tmp_path / "site_new"
    old.mkdir()
    new.mkdir()
    p = subprocess.run([sys.executable, str(BENCHES / "gpu_bench.py"), "--tiny", "--decode-8b", "--skip-peer",
                        "--tokens", "8", "--out", str(out), "--workdir", str(work), "--commit", "ignored",
                        "--ab-builds", f"1111111={old},2222222={new}", "--ab-rounds", "1"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert [(r["commit"], r["ab"]["variable"], r["ab"]["value"]) for r in recs] == [
        ("1111111", "build", "1111111"), ("2222222", "build", "2222222")]
    assert all(r["value"] > 0 for r in recs)
    assert "A-B summary" in p.stdout and "build=2222222:" in p.stdout
