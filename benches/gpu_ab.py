"""A-B runs of gpu_bench.py: the same parts once per value of one engine option (--ab, e.g.
`cuda_graphs=true,false`: passed to every engine the parts build, as gpu_bench's --option), or
once per build of ninfer (--ab-builds: directories that wheels of two commits were installed
into with `pip install --target`), each setting in its own process, the settings alternated
round after round (A B A B), every record kept with the setting it ran under (an option's
records carry it in "options", a build's records its commit), and a summary of each metric by
setting with its ratio to the first setting.

Why builds: a kernel change that has no option is measured against the commit before it in the
same call on the same machine (records from two calls can differ by a few percent by machine).

Why a process per setting: a process that measured A first warms caches (kernel cache, page
cache, clocks) for B; alternating rounds spreads the drift of a shared machine over both
settings. Checkpoints are written once by the first run and kept for the others; they are
removed at the end unless --keep-checkpoints.

    python benches/gpu_bench.py --out ab.json --decode-8b --skip-peer \\
        --ab cuda_graphs=true,false --ab-rounds 2
    pip install --no-deps --target /tmp/site_old old/ninfer-*.whl   # and the new wheel likewise
    python benches/gpu_bench.py --out ab.json --decode-27b --skip-peer \\
        --ab-builds OLD_COMMIT=/tmp/site_old,NEW_COMMIT=/tmp/site_new
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

# Record fields that tell two measurements of one metric apart (a concurrency level, a prompt).
CASE_FIELDS = ("model", "concurrency", "batch", "prompt_tokens", "layers")


#: The engine options a run may set (`_core.Engine` keyword arguments, as `LLM(...)` takes them).
ENGINE_OPTIONS = ("async_scheduling", "cuda_graphs", "batch_invariant", "device_sampling")

#: How an option's value is spelt on the command line, and what the engine is given.
OPTION_VALUES = {"true": True, "false": False}


def parse_option(spec: str) -> tuple:
    """`NAME=true|false` -> (NAME, bool): an engine option and its value. Raises ValueError
    naming the spec and the options otherwise."""
    name, sep, value = (part.strip() for part in spec.partition("="))
    if not sep or name not in ENGINE_OPTIONS or value.lower() not in OPTION_VALUES:
        raise ValueError(f"{spec!r}: expected OPTION=true|false, OPTION one of {', '.join(ENGINE_OPTIONS)}")
    return name, OPTION_VALUES[value.lower()]


def parse_ab(spec: str) -> tuple:
    """`OPTION=V1,V2` -> (OPTION, [V1, V2]): an engine option and its two values ("true" and
    "false", in the order given). Raises ValueError naming the spec otherwise."""
    name, sep, values = spec.partition("=")
    name, vals = name.strip(), [v.strip().lower() for v in values.split(",")]
    if not sep or name not in ENGINE_OPTIONS or sorted(vals) != ["false", "true"]:
        raise ValueError(f"--ab {spec!r}: expected OPTION=true,false (or false,true), "
                         f"OPTION one of {', '.join(ENGINE_OPTIONS)}")
    return name, vals


def parse_ab_builds(spec: str) -> list:
    """`COMMIT=SITE,COMMIT=SITE[,...]` -> [(COMMIT, SITE), ...]: two or more builds, each a
    commit (what its records say) and the directory its wheel was installed into. Raises
    ValueError naming the spec when an entry is malformed or a commit repeats."""
    builds = []
    for entry in spec.split(","):
        commit, sep, site = (part.strip() for part in entry.partition("="))
        if not sep or not commit or not site:
            raise ValueError(f"--ab-builds {spec!r}: expected COMMIT=SITE_DIR,COMMIT=SITE_DIR[,...]")
        builds.append((commit, site))
    if len(builds) < 2 or len({c for c, _ in builds}) != len(builds):
        raise ValueError(f"--ab-builds {spec!r}: two or more builds, each commit once")
    return builds


def settings(a) -> tuple:
    """(variable, [(label, env, extra arguments), ...]) for the runs of --ab or --ab-builds: a
    build's runs record its commit, an option's runs the caller's --commit and pass the option
    to the engine (gpu_bench's --option)."""
    if getattr(a, "ab_builds", None):
        rows = []
        for commit, site in parse_ab_builds(a.ab_builds):
            path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
            rows.append((commit, {"PYTHONPATH": path}, ["--commit", commit]))
        return "build", rows
    name, values = parse_ab(a.ab)
    return name, [(v, {}, ["--commit", a.commit, "--option", f"{name}={v}"]) for v in values]


def child_argv(argv: list) -> list:
    """The bench's own arguments (--option included) without --ab / --ab-builds / --ab-rounds /
    --out (each run gets its own --out) and --commit (a build's run gets its own), with
    --keep-checkpoints (the next run reuses them)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--ab", "--ab-builds", "--ab-rounds", "--out", "--commit"):
            skip = "=" not in arg
            continue
        out.append(arg)
    if "--keep-checkpoints" not in out:
        out.append("--keep-checkpoints")
    return out


def summarize(records: list, var: str, values: list) -> list:
    """Lines of the summary: per metric and case, each setting's mean value over its rounds
    (and mean fraction of the ceiling where there is one), and its ratio to the first setting."""
    cases: dict = {}
    for r in records:
        if r.get("value") is None or "ab" not in r:
            continue
        key = (r["metric"],) + tuple((f, r[f]) for f in CASE_FIELDS if r.get(f) is not None)
        cases.setdefault(key, {}).setdefault(r["ab"]["value"], []).append(r)
    lines = []
    for key, by_value in cases.items():
        head = key[0] + " " + " ".join(f"{f}={v}" for f, v in key[1:])
        base = None
        parts = []
        for v in values:
            runs = by_value.get(v, [])
            if not runs:
                parts.append(f"{var}={v}: no value")
                continue
            mean = statistics.fmean(r["value"] for r in runs)
            fracs = [r["fraction_of_ceiling"] for r in runs if r.get("fraction_of_ceiling") is not None]
            base = mean if base is None else base
            each = ", ".join(format(r["value"], ".4g") for r in runs)
            text = f"{var}={v}: {mean:.4g} ({each})"
            if fracs:
                text += f" fraction {statistics.fmean(fracs):.3f}"
            parts.append(text + f" ratio {mean / base:.4f}")
        lines.append(f"{head}: " + "; ".join(parts))
    return lines


def run_ab(a, argv: list, log) -> int:
    """Runs the parts once per setting (a value of the option `a.ab`, or a build of
    `a.ab_builds`) for `a.ab_rounds` rounds; appends every record to `a.out` (each with "ab":
    {variable, value, round}: the option and its value, or "build" and the commit); logs the
    summary. The
    exit status is 1 when a run failed or a record holds an error."""
    var, rows = settings(a)
    values = [label for label, _, _ in rows]
    out = Path(a.out)
    records: list = json.loads(out.read_text()) if out.is_file() and out.stat().st_size else []
    workdir = Path(a.workdir)
    before = set(workdir.iterdir()) if workdir.is_dir() else set()
    runs_dir = out.parent / f"{out.stem}_ab_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    base_args = child_argv(argv)
    status, new = 0, []
    for rnd in range(1, a.ab_rounds + 1):
        for v, env_set, extra in rows:
            run_out = runs_dir / f"round{rnd}_{var}_{v}.json"
            run_out.unlink(missing_ok=True)
            log(f"=== A-B round {rnd}: {var}={v} ===")
            env = dict(os.environ, **env_set)
            rc = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_bench.py")), "--out", str(run_out),
                                 *base_args, *extra], env=env).returncode
            got = json.loads(run_out.read_text()) if run_out.is_file() else []
            if rc != 0 or not got:
                status = 1
                log(f"A-B round {rnd} {var}={v}: exit status {rc}, {len(got)} records")
            for r in got:
                r["ab"] = {"variable": var, "value": v, "round": rnd}
                status |= 1 if "error" in r else 0
            new.extend(got)
            out.write_text(json.dumps(records + new, indent=2) + "\n")
    if not a.keep_checkpoints and workdir.is_dir():
        for p in set(workdir.iterdir()) - before:
            shutil.rmtree(p, ignore_errors=True)
    log(f"A-B summary ({a.ab_rounds} rounds, {len(new)} records in {out}):")
    for line in summarize(new, var, values):
        log("  " + line)
    return status
