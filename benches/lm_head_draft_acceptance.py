"""MTP acceptance of the demo model with a reduced draft head (`--lm-head-draft`) against the
full head, on the held-out code windows (CPU).

The replay is benches/mtp_acceptance.py's (greedy verification replayed exactly on the target's
greedy continuations); the only change between runs is the MTP drafter's vocabulary: the full
LM head, then the first N ids of the demo's draft_vocab.json for each N. Also timed: the seconds
one K = 3 drafting call takes (absorbing one row and three MTP steps, batch 1, the fastest of
200), where the head's share shrinks with N. Written to benches/results/lm_head_draft_acceptance.json.

    .ci/dev-build && PYTHONPATH=python python benches/lm_head_draft_acceptance.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtp_acceptance import DEMO, MAX_K, REPO, greedy_continuations, replay  # noqa: E402


def measure(drafter, prompts, continuations) -> dict:
    """Acceptance figures of the drafter as it is set up now, over every prompt."""
    hits = np.zeros(MAX_K, dtype=np.int64)
    prefix_hits = np.zeros(MAX_K, dtype=np.int64)
    positions = 0
    rounds = {k: [0, 0] for k in range(1, MAX_K + 1)}
    for prompt, cont in zip(prompts, continuations):
        r = replay(drafter, prompt + cont, len(prompt))
        hits += r["hits"]
        prefix_hits += r["prefix_hits"]
        positions += r["positions"]
        for k, (steps, emitted) in r["rounds"].items():
            rounds[k][0] += steps
            rounds[k][1] += emitted
    return {
        "tokens_per_verify_step_by_k": {str(k): round(e / s, 4) for k, (s, e) in rounds.items()},
        "acceptance_rate_by_draft_position": [round(float(prefix_hits[d] / (prefix_hits[d - 1] if d else positions)), 4)
                                              for d in range(MAX_K)],
        "positions": positions,
    }


def draft_seconds(drafter, seq: list[int], repeats: int) -> float:
    """Fastest of `repeats` K = 3 drafting calls (one row absorbed, three MTP steps): the least
    disturbed by other work on a shared CPU."""
    _, hidden = drafter.target(seq)
    n = len(seq) - 4
    drafter.draft(hidden[: n - 1], seq[1:n], 0, 0)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        drafter.draft(hidden[n - 1 : n], seq[n : n + 1], n - 1, 3)
        times.append(time.perf_counter() - t)
    return float(np.min(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 2048, 1024, 512, 256])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 384, 704])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "lm_head_draft_acceptance.json")
    args = ap.parse_args()
    from ninfer import _core

    model_dir = DEMO / "model"
    vocab = json.loads((model_dir / "draft_vocab.json").read_text())
    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    prompts = [w[:p] for w in windows for p in args.prompt_tokens]
    continuations = greedy_continuations(model_dir, prompts, args.new_tokens)
    drafter = _core.MtpDrafter(str(model_dir), max_tokens=max(args.prompt_tokens) + args.new_tokens + MAX_K + 1)
    vocab_size = vocab["vocab_size"]
    # The share of the held-out continuations' tokens each N covers.
    generated = [t for c in continuations for t in c]
    runs = []
    for size in [None, *args.sizes]:
        if size is not None:
            drafter.set_draft_vocab(vocab["token_ids"][:size])
        ids = set(range(vocab_size)) if size is None else set(vocab["token_ids"][:size])
        r = measure(drafter, prompts, continuations)
        runs.append({
            "draft_vocab": "full" if size is None else size,
            "mean_accepted_length_k3": r["tokens_per_verify_step_by_k"]["3"],
            **r,
            "target_tokens_in_draft_vocab": round(sum(t in ids for t in generated) / len(generated), 4),
            "draft_k3_seconds": round(draft_seconds(drafter, prompts[-1] + continuations[-1], 200), 6),
        })
        print(json.dumps(runs[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    full = runs[0]
    record = {
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "command": " ".join(["python", "benches/lm_head_draft_acceptance.py", *sys.argv[1:]]),
        "model": "ninfer demo (Qwen3.5 hybrid, 10.1M params, bf16, trained MTP head of 1.13M), vocab 8192",
        "metric": "mean tokens per verify step, MTP K=3, greedy, on the target's greedy continuations of held-out code, "
                  "full LM head vs the first N ids of draft_vocab.json",
        "value": full["mean_accepted_length_k3"],
        "draft_vocab_file": "python/ninfer/demo/model/draft_vocab.json (" + vocab["corpus"][0] + ")",
        "runs": runs,
        "prompts": f"{len(prompts)}: the first {args.prompt_tokens} tokens of each of the {len(windows)} held-out windows",
        "new_tokens": args.new_tokens,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
