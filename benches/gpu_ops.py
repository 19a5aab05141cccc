#!/usr/bin/env python3
"""Summarise a GPU run of rust_core/tests/cuda_ops.rs into benches/results/gpu_op_parity.json.

The test binary prints one `PARITY op=... storage=... shape=... rel_err=... tol=...` line per
checked output and, with `--ignored report_decode_op_throughput`, `PERF op=... key=value` lines.
This script keeps the worst relative error per (op, storage), the throughput lines, and the
run's provenance (commit, date, device as nvidia-smi names it, command).

Usage: benches/gpu_ops.py --env env.txt --parity parity.log --perf perf.log \
           --commit SHA --command "..." [--out benches/results/gpu_op_parity.json]
"""
import argparse
import json
import re
import sys

LINE = re.compile(r"^(PARITY|PERF) (.*)$")


def fields(text):
    return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)


def number(v):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", required=True)
    ap.add_argument("--parity", required=True)
    ap.add_argument("--perf")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--out", default="benches/results/gpu_op_parity.json")
    a = ap.parse_args()

    env = open(a.env).read()
    device = re.search(r"name, driver_version, compute_cap\n(.+)", env)
    date = env.splitlines()[0].strip()
    worst, checks = {}, 0
    passed = failed = None
    for line in open(a.parity):
        m = LINE.match(line.strip())
        if m and m.group(1) == "PARITY":
            f = fields(m.group(2))
            key = (f["op"], f["storage"])
            err = float(f["rel_err"])
            checks += 1
            if key not in worst or err > worst[key]["max_rel_err"]:
                worst[key] = {"op": f["op"], "storage": f["storage"], "max_rel_err": err,
                              "tolerance": float(f["tol"]), "worst_shape": f["shape"]}
        r = re.search(r"test result: \w+\. (\d+) passed; (\d+) failed", line)
        if r and passed is None:
            passed, failed = int(r.group(1)), int(r.group(2))
    perf = []
    if a.perf:
        for line in open(a.perf):
            m = LINE.match(line.strip())
            if m and m.group(1) == "PERF":
                perf.append({k: number(v) for k, v in fields(m.group(2)).items()})
    out = {
        "commit": a.commit,
        "date": date,
        "device": device.group(1).strip() if device else None,
        "command": a.command,
        "tests_passed": passed,
        "tests_failed": failed,
        "checks": checks,
        "metric": "max |gpu - cpu| / max |cpu| per output, worst over shapes",
        "ops": sorted(worst.values(), key=lambda r: (r["op"], r["storage"])),
        "throughput": perf,
    }
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(f"{a.out}: {checks} checks, {len(worst)} (op, storage) rows, {len(perf)} perf rows")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
