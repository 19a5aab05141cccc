"""Offline acceptance of the demo model's DFlash drafter under greedy speculative decoding (CPU).

Prompts are the first P tokens of the demo's held-out code windows (CPython stdlib files never
trained on, ninfer/demo/heldout_tokens.json); the target continues each greedily for N tokens
in a plain run. Speculation is then replayed exactly on those tokens: greedy verification
accepts a draft while it equals the target's next token, so the target's features at the
accepted positions are those of the plain run, and only the drafter runs here (its context
absorbing the accepted rows, as the engine drives it).

Measured: the fraction of positions whose depth-d draft (d = 1..7, one block drafted from that
position) equals the target's token d ahead, the acceptance rate at each draft position (given
all before it accepted), and the mean tokens per verify step (accepted drafts + the target's
own) for K = 1..7. Written to benches/results/dflash_acceptance.json.

    .ci/dev-build && PYTHONPATH=python python benches/dflash_acceptance.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "python" / "ninfer" / "demo"


def replay(drafter, seq: list[int], prompt_len: int, max_k: int) -> dict:
    """Depth-d hits and speculative rounds for K = 1..max_k over the generated part of `seq`."""
    _, features = drafter.target(seq)
    end = len(seq)
    hits = np.zeros(max_k, dtype=np.int64)
    prefix_hits = np.zeros(max_k, dtype=np.int64)
    positions = 0
    # Anchor at n (the token the target output last), context 0..n-1.
    drafter.absorb(np.ascontiguousarray(features[:prompt_len]), 0)
    for n in range(prompt_len, end - max_k):
        if n > prompt_len:
            drafter.absorb(np.ascontiguousarray(features[n - 1 : n]), n - 1)
        drafts = drafter.draft_logits(seq[n])[:max_k].argmax(-1)
        ok = [int(drafts[d]) == seq[n + 1 + d] for d in range(max_k)]
        hits += ok
        prefix_hits += np.cumprod(ok)
        positions += 1
    rounds = {}
    for k in range(1, max_k + 1):
        n, steps, emitted = prompt_len, 0, 0
        drafter.absorb(np.ascontiguousarray(features[:n]), 0)
        while n + k + 1 <= end - 1:
            drafts = drafter.draft_logits(seq[n])[:k].argmax(-1)
            accepted = 0
            while accepted < k and int(drafts[accepted]) == seq[n + 1 + accepted]:
                accepted += 1
            # The verify chunk computed the anchor and the accepted drafts.
            drafter.absorb(np.ascontiguousarray(features[n : n + accepted + 1]), n)
            n += accepted + 1
            steps += 1
            emitted += accepted + 1
        rounds[k] = (steps, emitted)
    return {"hits": hits, "prefix_hits": prefix_hits, "positions": positions, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 384, 704])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafter", type=Path, default=DEMO / "dflash")
    ap.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "dflash_acceptance.json")
    args = ap.parse_args()
    from ninfer import _core

    model_dir = DEMO / "model"
    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    prompts = [w[:p] for w in windows for p in args.prompt_tokens]
    continuations, _, _ = _core.Model(str(model_dir)).decode_greedy(prompts, args.new_tokens)
    drafter = _core.DflashDrafter(str(model_dir), str(args.drafter), max_tokens=max(args.prompt_tokens) + args.new_tokens + 1)
    max_k = min(drafter.block_size - 1, 8)
    hits = np.zeros(max_k, dtype=np.int64)
    prefix_hits = np.zeros(max_k, dtype=np.int64)
    positions = 0
    rounds = {k: [0, 0] for k in range(1, max_k + 1)}
    for prompt, cont in zip(prompts, continuations):
        r = replay(drafter, prompt + list(cont), len(prompt), max_k)
        hits += r["hits"]
        prefix_hits += r["prefix_hits"]
        positions += r["positions"]
        for k, (steps, emitted) in r["rounds"].items():
            rounds[k][0] += steps
            rounds[k][1] += emitted
    per_k = {str(k): round(emitted / steps, 4) for k, (steps, emitted) in rounds.items()}
    depth_acc = [round(float(h / positions), 4) for h in hits]
    # None where no draft reached the position before (nothing to rate).
    before = [positions] + list(prefix_hits[:-1])
    accept_rate = [round(float(prefix_hits[d] / before[d]), 4) if before[d] else None for d in range(max_k)]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    cfg = json.loads((args.drafter / "config.json").read_text())
    size = sum(p.stat().st_size for p in args.drafter.iterdir() if p.is_file())
    record = {
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "command": " ".join(["python", "benches/dflash_acceptance.py", *sys.argv[1:]]),
        "model": "ninfer demo (Qwen3.5 hybrid, 10.1M params, bf16) with its DFlash drafter "
                 f"({cfg['num_hidden_layers']} layers, block {cfg['dflash_config']['block_size']}, "
                 f"target layers {cfg['dflash_config']['target_layer_ids']}, {size} bytes)",
        "metric": "mean tokens per verify step, DFlash K=7, greedy, on the target's greedy continuations of held-out code",
        "value": per_k.get("7"),
        "tokens_per_verify_step_by_k": per_k,
        "depth_top1_equals_target": depth_acc,
        "acceptance_rate_by_draft_position": accept_rate,
        "positions": positions,
        "prompts": f"{len(prompts)}: the first {args.prompt_tokens} tokens of each of the {len(windows)} held-out windows",
        "new_tokens": args.new_tokens,
        "drafter_bytes": size,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
