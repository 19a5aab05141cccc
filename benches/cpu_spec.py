"""CPU speculative decoding (n-gram, the MTP head, the DFlash drafter) on the demo model's held-out code windows.

Each run feeds the first `--prompt-tokens` tokens of held-out CPython windows (never trained on,
python/ninfer/demo/heldout_tokens.json) and decodes `--new-tokens` greedy tokens, at batch 1
(window 0) and batch 8 (windows 0..7), plain, with `spec="ngram"` and `spec="mtp"` for K = 1..5, with
`spec="dflash"` (the demo's shipped drafter) for K = 1, 3, 5, 7, and MTP under `spec_adaptive` with
K at most 5. Figures:
generated tokens per second of wall time (prefill included, the same prompts for every config),
the mean accepted length (tokens per verify round), the acceptance rate per draft position, and
the tokens the rollback ran again (the demo model is hybrid: its recurrent state is recomputed past
rejected drafts) beside the tokens the verify chunks ran.
Every speculative run's tokens are checked against the plain run's. The record goes to
benches/results/cpu_spec.json with the commit, the CPU and the command.

    .ci/dev-build && PYTHONPATH=python python benches/cpu_spec.py
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


def run(windows, batch, prompt_tokens, new_tokens, threads, spec=None, k=None, adaptive=False):
    """(tok/s, stats, outputs) of one config (dflash drafts with the demo's shipped drafter)."""
    from ninfer import LLM, SamplingParams

    kwargs = dict(spec=spec, draft_tokens=k, spec_adaptive=adaptive) if spec else {}
    with LLM(DEMO / "model", max_context=prompt_tokens + new_tokens + 8, max_concurrency=batch,
             num_threads=threads, **kwargs) as llm:
        prompts = [w[:prompt_tokens] for w in windows[:batch]]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        stats = llm.engine.stats()
    generated = sum(len(o.token_ids) for o in outs)
    return generated / dt, stats, [o.token_ids for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--max-k", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "cpu_spec.json")
    args = p.parse_args(argv)
    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    rows = []
    for batch in (1, 8):
        base_tps, _, base_out = run(windows, batch, args.prompt_tokens, args.new_tokens, args.threads)
        rows.append(dict(batch=batch, method="plain", k=0, tok_s=round(base_tps, 2), mean_accepted_length=1.0,
                         acceptance_by_position=[], equal_to_plain=True))
        print(f"batch {batch} plain: {base_tps:.1f} tok/s", flush=True)
        configs = [(m, k, False) for m in ("ngram", "mtp") for k in range(1, args.max_k + 1)]
        configs += [("dflash", k, False) for k in (1, 3, 5, 7)] + [("mtp", args.max_k, True)]
        for method, k, adaptive in configs:
            tps, stats, out = run(windows, batch, args.prompt_tokens, args.new_tokens, args.threads, method, k, adaptive)
            rows.append(dict(batch=batch, method=method + (" adaptive" if adaptive else ""), k=k, tok_s=round(tps, 2),
                             mean_accepted_length=round(stats["spec_mean_accepted_length"], 3),
                             acceptance_by_position=[round(r, 3) for r in stats["spec_acceptance_by_position"]],
                             speedup=round(tps / base_tps, 3), equal_to_plain=out == base_out,
                             verify_tokens=stats["spec_drafted_tokens"] + stats["spec_verify_steps"],
                             rollback_tokens=stats["spec_rollback_tokens"],
                             replayed_tokens=stats["spec_replayed_tokens"]))
            print(f"batch {batch} {rows[-1]['method']} K={k}: {tps:.1f} tok/s ({tps / base_tps:.2f}x), mean accepted length "
                  f"{stats['spec_mean_accepted_length']:.2f}, by position {rows[-1]['acceptance_by_position']}, "
                  f"equal to plain: {out == base_out}", flush=True)
    best = max((r for r in rows if r["method"] != "plain" and r["batch"] == 1), key=lambda r: r["tok_s"])
    record = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{cpu_name()} ({args.threads} threads)",
        "command": "python benches/cpu_spec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "bundled demo model (python/ninfer/demo/model)",
        "metric": (f"generated tok/s (wall, prefill included) and mean accepted length, greedy, "
                   f"{args.new_tokens} new tokens after {args.prompt_tokens}-token held-out code windows"),
        "value": best["tok_s"],
        "value_config": f"{best['method']} K={best['k']}, batch 1",
        "runs": rows,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
