"""Diagnostic: does a prompt run alone repeat itself bit for bit, before and after batches?

Session 21 found on the H200 that after any multi-sequence step, the first token's logprobs of
a prompt run alone depend on the request run before it (0.01-0.2 nats on the demo model), while
a fresh engine repeats itself exactly and the CPU backend always does. This runs one engine
through a fixed sequence of alone runs and batches and reports, for each pair of runs of the same
prompts, the first token whose id or reported logprobs differ and by how much (None: identical).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_batch_alone import DEMO, top_map, windows  # noqa: E402

from ninfer import LLM, SamplingParams  # noqa: E402


def first_diff(x, y):
    """(token index, largest logprob difference there) of the first difference, or None."""
    for i in range(min(len(x.logprobs), len(y.logprobs))):
        a, b = top_map(x.logprobs[i]), top_map(y.logprobs[i])
        if x.token_ids[i] != y.token_ids[i] or a != b:
            return (i, max((abs(a[t] - b[t]) for t in a.keys() & b.keys()), default=-1.0))
    return None


def parse_args(argv: list | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="unknown", help="the build's commit, carried into the JSON")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=5, help="prompts run alone (the batches take all 20)")
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args(argv)
    if not 1 <= a.prompts <= 20:
        p.error(f"--prompts {a.prompts}: 1 to 20 (the test's windows)")
    if a.tokens < 2:
        p.error(f"--tokens {a.tokens}: at least 2 (a decoding request is what disturbs the next)")
    return a


def main(argv: list | None = None) -> dict:
    a = parse_args(argv)
    every = windows(20)
    mine = every[:a.prompts]
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, top_logprobs=5)
    with LLM(DEMO / "model", device=a.device, max_context=512, prefix_reuse=False, logits_dtype="float32") as llm:
        alone = lambda n=a.tokens: [llm.generate(p, params(n))[0] for p in mine]
        runs = {}
        runs["fresh"] = alone()
        runs["fresh again"] = alone()
        llm.generate(every, params(a.tokens))
        runs["after a batch of 20"] = alone()
        runs["then again"] = alone()
        runs["prefill only"] = alone(1)
        runs["prefill only again"] = alone(1)
        llm.generate(every[:2], params(a.tokens))
        runs["after a batch of 2"] = alone()
        runs["after a batch of 2, again"] = alone()
    pairs = [("fresh", "fresh again"), ("fresh again", "after a batch of 20"), ("after a batch of 20", "then again"),
             ("prefill only", "prefill only again"), ("after a batch of 2", "after a batch of 2, again"),
             ("fresh", "after a batch of 2, again")]
    result = {"label": a.label, "pairs": {f"{x} ~ {y}": [first_diff(p, q) for p, q in zip(runs[x], runs[y])] for x, y in pairs}}
    for name, diffs in result["pairs"].items():
        print(f"{a.label} {name}: {diffs}")
    result["repeating_pairs"] = sum(all(d is None for d in v) for v in result["pairs"].values())
    print(f"{a.label} summary: {result['repeating_pairs']}/{len(pairs)} pairs identical")
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + [result], indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
