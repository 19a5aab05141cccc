"""Offline acceptance of the demo model's MTP head under greedy speculative decoding (CPU).

Prompts are the first P tokens of the demo's held-out code windows (CPython stdlib files never
trained on, ninfer/demo/heldout_tokens.json); the target continues each greedily for N tokens
in a plain run. Speculation is then replayed exactly on those tokens: greedy verification
accepts a draft while it equals the target's next token, so the target's hidden states of the
accepted tokens are those of the plain run, and only the MTP head runs here (its KV absorbing
the accepted rows and dropping the rejected ones, as the engine will drive it).

Measured: the fraction of positions whose depth-d draft (d = 1..5, drafting from that position)
equals the target's token d ahead, the acceptance rate at each draft position (given all
before it accepted), and the mean tokens per verify step (accepted drafts + the target's own)
for K = 1..5. The issue's target for K = 3 is 2.5. Written to benches/results/mtp_acceptance.json.

    .ci/dev-build && PYTHONPATH=python python benches/mtp_acceptance.py
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
MAX_K = 5


def greedy_continuations(model_dir: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """The target's greedy tokens after each prompt (a plain run, every sequence in one batch)."""
    from ninfer import _core

    tokens, _, _ = _core.Model(str(model_dir)).decode_greedy(prompts, steps)
    return tokens


def replay(drafter, seq: list[int], prompt_len: int) -> dict:
    """Depth-d hits and speculative rounds for K = 1..MAX_K over the generated part of `seq`."""
    _, hidden = drafter.target(seq)
    end = len(seq)
    # Depth d from each position n >= prompt_len (t_n known): do drafts 1..d equal t_{n+1..n+d}?
    hits = np.zeros(MAX_K, dtype=np.int64)
    prefix_hits = np.zeros(MAX_K, dtype=np.int64)
    positions = 0
    drafter.draft(hidden[: prompt_len - 1], seq[1:prompt_len], 0, 0)
    for n in range(prompt_len, end - MAX_K):
        drafts, _ = drafter.draft(hidden[n - 1 : n], seq[n : n + 1], n - 1, MAX_K)
        ok = [drafts[d] == seq[n + 1 + d] for d in range(MAX_K)]
        hits += ok
        prefix_hits += np.cumprod(ok)
        positions += 1
    rounds = {}
    for k in range(1, MAX_K + 1):
        n, absorbed, steps, emitted = prompt_len, prompt_len - 1, 0, 0
        drafter.draft(hidden[:absorbed], seq[1 : absorbed + 1], 0, 0)
        while n + k + 1 <= end - 1:
            drafts, _ = drafter.draft(hidden[absorbed:n], seq[absorbed + 1 : n + 1], absorbed, k)
            accepted = 0
            while accepted < k and drafts[accepted] == seq[n + 1 + accepted]:
                accepted += 1
            absorbed = n
            n += accepted + 1
            steps += 1
            emitted += accepted + 1
        rounds[k] = (steps, emitted)
    return {"hits": hits, "prefix_hits": prefix_hits, "positions": positions, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 384, 704])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "mtp_acceptance.json")
    args = ap.parse_args()
    from ninfer import _core

    model_dir = DEMO / "model"
    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    prompts = [w[:p] for w in windows for p in args.prompt_tokens]
    continuations = greedy_continuations(model_dir, prompts, args.new_tokens)
    drafter = _core.MtpDrafter(str(model_dir), max_tokens=max(args.prompt_tokens) + args.new_tokens + MAX_K + 1)
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
    per_k = {str(k): round(emitted / steps, 4) for k, (steps, emitted) in rounds.items()}
    depth_acc = [round(float(h / positions), 4) for h in hits]
    accept_rate = [round(float(prefix_hits[d] / (prefix_hits[d - 1] if d else positions)), 4) for d in range(MAX_K)]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    record = {
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "command": " ".join(["python", "benches/mtp_acceptance.py", *sys.argv[1:]]),
        "model": "ninfer demo (Qwen3.5 hybrid, 10.1M params, bf16, trained MTP head of 1.13M)",
        "metric": "mean tokens per verify step, MTP K=3, greedy, on the target's greedy continuations of held-out code",
        "value": per_k["3"],
        "target": 2.5,
        "tokens_per_verify_step_by_k": per_k,
        "depth_top1_equals_target": depth_acc,
        "acceptance_rate_by_draft_position": accept_rate,
        "positions": positions,
        "prompts": f"{len(prompts)}: the first {args.prompt_tokens} tokens of each of the {len(windows)} held-out windows",
        "new_tokens": args.new_tokens,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
