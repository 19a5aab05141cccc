"""CPU speculative decoding of sampled requests with the MTP head on the demo model's held-out code windows.

Sampled requests draft from the MTP head's distribution under their own temperature and top-p and
verify by the speculative sampling rule (accept min(1, p/q), else the residual), so their outputs
follow plain sampling's distribution. This records what that costs and gains beside greedy: for
greedy and for temperatures 0.7 and 1.0 (and 0.7 with top-p 0.9), batch 8 (windows 0..7, seeds
0..7), `--new-tokens` tokens after `--prompt-tokens`-token held-out windows (never trained on,
python/ninfer/demo/heldout_tokens.json), plain and `spec="mtp"` at K = `--k`: generated tokens per
second of wall time (prefill included), the acceptance rate of drafts, the mean accepted length
(tokens per verify round) and the acceptance per draft position. The record goes to
benches/results/cpu_spec_sampled.json with the commit, the CPU and the command.

    .ci/dev-build && PYTHONPATH=python python benches/cpu_spec_sampled.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benches"))

from cpu_decode import cpu_name, git_commit  # noqa: E402

DEMO = REPO / "python" / "ninfer" / "demo"

#: (name, sampling settings) of the runs.
SETTINGS = [
    ("greedy", dict(temperature=0.0)),
    ("T=0.7", dict(temperature=0.7)),
    ("T=1.0", dict(temperature=1.0)),
    ("T=0.7 top_p=0.9", dict(temperature=0.7, top_p=0.9)),
]


def run(prompts, settings, new_tokens, threads, k=None):
    """(tok/s, stats) of one batch of `prompts` under `settings` (seed i for prompt i)."""
    from ninfer import LLM, SamplingParams

    kwargs = dict(spec="mtp", draft_tokens=k) if k else {}
    with LLM(DEMO / "model", max_context=len(prompts[0]) + new_tokens + 8, max_concurrency=len(prompts),
             num_threads=threads, **kwargs) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=i, **settings) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        stats = llm.engine.stats()
    return sum(len(o.token_ids) for o in outs) / dt, stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "cpu_spec_sampled.json")
    args = p.parse_args(argv)
    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    prompts = [w[:args.prompt_tokens] for w in windows[:8]]
    rows = []
    for name, settings in SETTINGS:
        plain_tps, _ = run(prompts, settings, args.new_tokens, args.threads)
        tps, stats = run(prompts, settings, args.new_tokens, args.threads, k=args.k)
        drafted, accepted = stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]
        rows.append(dict(sampling=name, k=args.k, plain_tok_s=round(plain_tps, 2), mtp_tok_s=round(tps, 2),
                         acceptance=round(accepted / max(drafted, 1), 3),
                         mean_accepted_length=round(stats["spec_mean_accepted_length"], 3),
                         acceptance_by_position=[round(r, 3) for r in stats["spec_acceptance_by_position"]]))
        print(f"{name}: plain {plain_tps:.1f} tok/s, mtp K={args.k} {tps:.1f} tok/s, acceptance {rows[-1]['acceptance']}, "
              f"mean accepted length {rows[-1]['mean_accepted_length']}", flush=True)
    record = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{cpu_name()} ({args.threads} threads)",
        "command": "python benches/cpu_spec_sampled.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "bundled demo model (python/ninfer/demo/model)",
        "metric": (f"mean accepted length of MTP K={args.k} drafts for sampled requests (speculative sampling "
                   f"rule), batch 8, {args.new_tokens} new tokens after {args.prompt_tokens}-token held-out code windows"),
        "value": next(r["mean_accepted_length"] for r in rows if r["sampling"] == "T=0.7"),
        "value_config": "T=0.7",
        "runs": rows,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
