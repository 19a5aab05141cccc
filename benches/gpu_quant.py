#!/usr/bin/env python3
"""Record a GPU run's quantized decode GEMV timings into benches/results/gpu_quant.json.

rust_core/tests/cuda_ops/quant.rs `quant_gemv_decode_timing` (run by `.ci/gpu-parts ops` with
the other `_timing` tests, its lines in cuda_ops.log) prints one line per (format, model, m):
    TIMING quant_gemv weights=<format> model=<name> m=<rows of x> bytes=<read> us=<per layer> \
        read_gbps=<...> copy_gbps=<...> fraction=<...>
`bytes` counts what the GEMVs of one layer actually read (packed weights with their scale / zero
companions, x) and write (y); `fraction` is that rate over the device's copy rate (bytes read plus
written a second by a 1 GiB device-to-device copy in the same process). The issue's target is
fraction >= 0.80 for the 4-bit formats at m=1. This script keeps each line as a record with its
weights=<format>, the run's provenance (commit, date, device as nvidia-smi names it, command),
and exits non-zero when the log has no such line.

With --peer-log (the same test's lines from another build, run in the same call: the `opab`
part alternates them), each record also holds that build's figures as peer_us / peer_fraction.

Usage: benches/gpu_quant.py --env env.txt --log cuda_ops.log --commit SHA --command "..." \
           [--peer-log LOG --peer NAME] [--out benches/results/gpu_quant.json]
"""
import argparse
import json
import re
import sys

LINE = re.compile(r"^TIMING quant_gemv (.*)$")


def number(v):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def timings(path):
    """The log's TIMING quant_gemv lines as records; a later line of the same key replaces an earlier one."""
    out = {}
    for line in open(path):
        m = LINE.match(line.strip())
        if m:
            r = {k: number(v) for k, v in (kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)}
            out[(r.get("weights"), r.get("model"), r.get("m"))] = r
    return list(out.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", required=True, help="nvidia-smi / date capture of the run (as gpu_ops.py reads it)")
    ap.add_argument("--log", required=True, help="the cuda_ops log holding the TIMING quant_gemv lines")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--peer-log", help="the same test's lines from another build, same call")
    ap.add_argument("--peer", help="what --peer-log ran (e.g. the build before the change)")
    ap.add_argument("--out", default="benches/results/gpu_quant.json")
    a = ap.parse_args()
    if bool(a.peer_log) != bool(a.peer):
        ap.error("--peer-log and --peer go together")

    env = open(a.env).read()
    device = re.search(r"name, driver_version, compute_cap\n(.+)", env)
    date = env.splitlines()[0].strip()
    records = timings(a.log)
    if a.peer_log:
        peer = {(r["weights"], r["model"], r["m"]): r for r in timings(a.peer_log)}
        for r in records:
            p = peer.get((r["weights"], r["model"], r["m"]))
            if p:
                r.update(peer=a.peer, peer_us=p["us"], peer_fraction=p["fraction"])
    if not records:
        print(f"{a.log}: no TIMING quant_gemv lines", file=sys.stderr)
        return 1
    out = {
        "commit": a.commit,
        "date": date,
        "device": device.group(1).strip() if device else None,
        "command": a.command,
        "metric": "batch-1 decode GEMV of one layer's projections: bytes read / time over the device copy rate",
        "target": {"fraction_4bit": 0.80},
        "records": records,
    }
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    for r in records:
        print(f"{r.get('weights')} {r.get('model')} m={r.get('m')}: {r.get('us')} us, {r.get('fraction')} of the copy rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
