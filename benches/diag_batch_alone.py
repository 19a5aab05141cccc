"""Diagnostic: how far a batch moves the demo model's logits from the same prompt alone.

By default the decode GEMV depends on the batch (docs/performance-history.md, "The price is batch
invariance"), so a prompt generated in a batch may leave its alone run at a near-tie; the GPU
test `test_demo_model_batch_differs_from_alone_only_at_near_ties` allows divergences where alone's
top-2 logprob gap is below 0.5. This measures the movement itself, so that two builds can be
compared on it instead of on which prompts happen to sit near a tie: for each of the test's 20
prompts (24-token held-out windows), generated greedily with f32 logits in one batch and alone,
the first divergence (token, alone's top-2 gap there) and, at every token up to it, the largest
|logprob difference| over the tokens in both top-k lists. Prints one line a prompt and a summary,
and writes them as JSON.

Run on the GPU machine with ninfer installed (PYTHONPATH picks the build):
    python3 benches/diag_batch_alone.py --out $OUT/batch_alone.json [--label BUILD] [--device cuda]
NINFER_BATCH_INVARIANT=1 makes every difference zero (a check of the script itself).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import ninfer
from ninfer import LLM, SamplingParams

DEMO = Path(ninfer.__file__).parent / "demo"


def windows(n: int) -> list:
    seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    return [seq[i:i + 24] for seq in seqs for i in (0, 300, 600)][:n]


def top_map(logprob) -> dict:
    return {tok: lp for tok, lp in logprob.top}


def compare(alone, batched) -> dict:
    """First divergence and per-token logprob movement of one prompt (alone is the reference)."""
    n = min(len(alone.token_ids), len(batched.token_ids))
    d = next((i for i in range(n) if alone.token_ids[i] != batched.token_ids[i]), None)
    moves, gap_moves = [], []
    for i in range(n if d is None else d + 1):
        a, b = top_map(alone.logprobs[i]), top_map(batched.logprobs[i])
        common = a.keys() & b.keys()
        moves.append(max((abs(a[t] - b[t]) for t in common), default=float("nan")))
        # How far the batch moved alone's top-2 gap (the quantity a greedy flip needs to cross).
        (t1, _), (t2, _) = alone.logprobs[i].top[:2]
        if t1 in b and t2 in b:
            gap_moves.append(abs((a[t1] - a[t2]) - (b[t1] - b[t2])))
    gap = None
    if d is not None:
        top = alone.logprobs[d].top
        gap = top[0][1] - top[1][1]
    return {"divergence": d, "alone_gap": gap, "token0_move": moves[0], "max_move": max(moves), "moves": moves,
            "max_gap_move": max(gap_moves, default=float("nan"))}


def _same(x, y) -> bool:
    """Token ids and every reported logprob equal."""
    return x.token_ids == y.token_ids and all(p.top == q.top for p, q in zip(x.logprobs, y.logprobs))


def repeat(first, second) -> dict:
    """How a second run of the same prompt alone differs from the first: the first token that
    differs, the largest logprob difference over the tokens both report up to there, and whether
    the reported lists differ only in the order of equal logprobs."""
    n = min(len(first.token_ids), len(second.token_ids))
    d = next((i for i in range(n) if first.token_ids[i] != second.token_ids[i]), None)
    diff, order_only = 0.0, True
    for i in range(n if d is None else d + 1):
        a, b = top_map(first.logprobs[i]), top_map(second.logprobs[i])
        diff = max([diff] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
        order_only &= sorted(first.logprobs[i].top) == sorted(second.logprobs[i].top)
    return {"bitwise": _same(first, second), "first_token_diff": d, "max_logprob_diff": diff,
            "order_only": order_only}


def parse_args(argv: list | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="unknown", help="the build's commit, carried into the JSON")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=5, help="top logprobs compared a token")
    a = p.parse_args(argv)
    if not 1 <= a.prompts <= 20:
        p.error(f"--prompts {a.prompts}: 1 to 20 (the test's windows)")
    if a.tokens < 1 or a.top < 2:
        p.error(f"--tokens {a.tokens} / --top {a.top}: at least 1 token and 2 logprobs")
    return a


def main(argv: list | None = None) -> dict:
    a = parse_args(argv)
    prompts = windows(a.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True, top_logprobs=a.top)
    with LLM(DEMO / "model", device=a.device, max_context=512, prefix_reuse=False, logits_dtype="float32") as llm:
        batched = llm.generate(prompts, params)
        alone = [llm.generate(pr, params)[0] for pr in prompts]
        # Each prompt alone a second time: the same build must repeat itself bit for bit.
        again = [llm.generate(pr, params)[0] for pr in prompts]
    repeats = sum(_same(x, y) for x, y in zip(alone, again))
    rows = [compare(al, b) | {"repeat": repeat(al, ag)} for al, b, ag in zip(alone, batched, again)]
    for i, r in enumerate(rows):
        div = "none" if r["divergence"] is None else f"token {r['divergence']} (alone's gap {r['alone_gap']:.4f})"
        if not r["repeat"]["bitwise"]:
            print(f"{a.label} prompt {i:2d} alone twice differs: {json.dumps(r['repeat'])}")
        print(f"{a.label} prompt {i:2d}: token-0 move {r['token0_move']:.4f}, max move {r['max_move']:.4f}, "
              f"max top-2 gap move {r['max_gap_move']:.4f}, divergence {div}")
    summary = {
        "label": a.label,
        "equal": sum(r["divergence"] is None for r in rows),
        "prompts": len(rows),
        "token0_move_max": max(r["token0_move"] for r in rows),
        "max_move_max": max(r["max_move"] for r in rows),
        "gap_move_max": max(r["max_gap_move"] for r in rows),
        "alone_repeats_bitwise": repeats,
        "largest_divergence_gap": max((r["alone_gap"] for r in rows if r["alone_gap"] is not None), default=None),
    }
    print(f"{a.label} summary: {json.dumps(summary)}")
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + [{"summary": summary, "rows": rows}], indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
