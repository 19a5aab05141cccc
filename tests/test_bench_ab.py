"""gpu_bench.py --ab / --ab-builds (benches/gpu_ab.py): A-B runs of the GPU benchmark, one process
per value of an engine option or per build, alternated round after round, records tagged with
their setting and summarized by setting. The pure parts here; end-to-end runs on the tiny CPU
shapes below."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench_scripts import BENCHES, load_bench


def _ab():
    return load_bench("gpu_ab")


@pytest.mark.parametrize("parser, spec", [
    *(("parse_ab", s) for s in ["cuda_graphs", "NINFER_CUDA_GRAPHS=0,1", "cuda_graphs=true", "cuda_graphs=true,,false",
                                "cuda_graphs=true,true", "cuda_graphs=1,0", "cuda_graph=true,false", "=true,false",
                                "cuda_graphs=true,false,true"]),
    *(("parse_option", s) for s in ["cuda_graphs", "cuda_graphs=", "cuda_graphs=0", "cuda_graphs=yes",
                                    "pdl=false", "NINFER_CUDA_GRAPHS=false", "=true"]),
    *(("parse_ab_builds", s) for s in ["abc=/x", "abc=/x,abc=/y", "abc=/x,=/y", "abc/x,def=/y", "abc=,def=/y"]),
])
def test_a_malformed_ab_or_builds_spec_is_refused_naming_it(parser, spec):
    with pytest.raises(ValueError) as e:
        getattr(_ab(), parser)(spec)
    assert repr(spec) in str(e.value)


def test_an_ab_spec_gives_the_option_and_its_values_in_order():
    assert _ab().parse_ab("cuda_graphs= true, False") == ("cuda_graphs", ["true", "false"])
    assert _ab().parse_ab("async_scheduling=false,true") == ("async_scheduling", ["false", "true"])


@pytest.mark.parametrize("name", ["async_scheduling", "cuda_graphs", "batch_invariant", "device_sampling"])
def test_every_engine_option_parses_to_its_bool(name):
    assert _ab().parse_option(f"{name}=true") == (name, True)
    assert _ab().parse_option(f" {name} = FALSE ") == (name, False)


def test_each_run_gets_the_parts_without_the_ab_arguments_and_keeps_the_checkpoints():
    got = _ab().child_argv(["--out", "x.json", "--decode-8b", "--ab", "cuda_graphs=true,false", "--ab-rounds=3",
                            "--out=y.json", "--layers", "4", "--option", "batch_invariant=true"])
    assert got == ["--decode-8b", "--layers", "4", "--option", "batch_invariant=true", "--keep-checkpoints"]
    assert _ab().child_argv(["--keep-checkpoints", "--ab=cuda_graphs=true,false"]) == ["--keep-checkpoints"]


def test_an_option_run_passes_its_value_as_an_option_and_keeps_the_callers_commit():
    a = SimpleNamespace(ab="device_sampling=false,true", ab_builds=None, commit="abc")
    assert _ab().settings(a) == ("device_sampling", [
        ("false", {}, ["--commit", "abc", "--option", "device_sampling=false"]),
        ("true", {}, ["--commit", "abc", "--option", "device_sampling=true"])])


def test_the_summary_gives_each_setting_its_mean_and_ratio_per_metric_and_case():
    def rec(value, setting, conc, frac=None):
        return {"metric": "decode_throughput_tok_s", "model": "llama-3-8b", "concurrency": conc, "value": value,
                "fraction_of_ceiling": frac, "ab": {"variable": "cuda_graphs", "value": setting, "round": 1}}

    records = [rec(100.0, "false", 8, 0.5), rec(110.0, "true", 8, 0.55), rec(102.0, "false", 8, 0.51),
               rec(112.0, "true", 8, 0.56), rec(300.0, "false", 64), rec(330.0, "true", 64),
               {"metric": "decode_throughput_tok_s", "model": "llama-3-8b", "value": None, "error": "x",
                "ab": {"variable": "cuda_graphs", "value": "true", "round": 1}}]
    lines = _ab().summarize(records, "cuda_graphs", ["false", "true"])
    assert len(lines) == 2
    c8 = next(line for line in lines if "concurrency=8" in line)
    assert "cuda_graphs=false: 101 (100, 102) fraction 0.505 ratio 1.0000" in c8
    assert "cuda_graphs=true: 111 (110, 112) fraction 0.555 ratio 1.0990" in c8
    c64 = next(line for line in lines if "concurrency=64" in line)
    assert "cuda_graphs=true: 330 (330) ratio 1.1000" in c64


def test_a_tiny_ab_run_alternates_processes_and_tags_every_record(tmp_path):
    """End to end on the tiny CPU shapes: both values of the engine option async_scheduling, one
    round, the other three options set for every run (each a keyword the real engine takes: an
    unknown one fails the run); each run's record carries its options (the bench's "options" and
    the ab tag), the summary names both values, and the checkpoint the first run wrote is gone at
    the end."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("ninfer._core")
    out, work = tmp_path / "ab.json", tmp_path / "work"
    p = subprocess.run([sys.executable, str(BENCHES / "gpu_bench.py"), "--tiny", "--decode-8b", "--skip-peer",
                        "--tokens", "8", "--out", str(out), "--workdir", str(work),
                        "--ab", "async_scheduling=false,true", "--option", "cuda_graphs=false",
                        "--option", "batch_invariant=true", "--option", "device_sampling=false", "--ab-rounds", "1"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert [(r["metric"], r["ab"]["value"], r["ab"]["round"]) for r in recs] == [
        ("decode_bs1_tok_s", "false", 1), ("decode_bs1_tok_s", "true", 1)]
    fixed = {"cuda_graphs": False, "batch_invariant": True, "device_sampling": False}
    assert [r["options"] for r in recs] == [{**fixed, "async_scheduling": False}, {**fixed, "async_scheduling": True}]
    assert all(r["value"] > 0 for r in recs)
    assert "A-B summary" in p.stdout and "async_scheduling=true:" in p.stdout
    assert not any(work.iterdir()), list(work.iterdir())


def test_a_builds_spec_gives_each_commit_and_its_site():
    assert _ab().parse_ab_builds("93ca6d2=/tmp/old, 4a58b96=/tmp/new") == [("93ca6d2", "/tmp/old"), ("4a58b96", "/tmp/new")]


def test_a_build_run_gets_its_own_commit_not_the_callers():
    got = _ab().child_argv(["--commit", "abc", "--decode-27b", "--ab-builds", "a=/x,b=/y", "--commit=zz", "--out", "o.json"])
    assert got == ["--decode-27b", "--keep-checkpoints"]


def test_a_quantized_builds_run_gives_every_build_the_quantize_mode(tmp_path):
    # 4-bit decode A-B of two builds: each run loads the checkpoint quantized.
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    argv = ["--decode-8b", "--quantize", "q4", "--layers", "16", "--ab-builds", f"a={tmp_path / 'a'},b={tmp_path / 'b'}"]
    assert _ab().child_argv(argv) == ["--decode-8b", "--quantize", "q4", "--layers", "16", "--keep-checkpoints"]
    assert load_bench("gpu_bench").parse_args(["--out", "x.json", *argv]).quantize == "q4"


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
