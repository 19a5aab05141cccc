"""Per-request JSONL log (`--request-log-jsonl`) and the periodic stats line (`--log-stats-interval-ms`).

The request log writes one line per finished engine request: id, token counts, the time it
waited before its first token (queue + prefill, which the server sees as one span), the decode
time after it, and the finish reason (and the error of a request that failed midway, and
speculative decoding's counts when it is on).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional, TextIO

import anyio
import orjson


class RequestLog:
    """Appends one JSON line per finished request to a file."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._file: TextIO = open(path, "a", encoding="utf-8")

    def request_finished(self, request_id: str, delta, timing) -> None:
        """Write the line of one finished request."""
        first = timing.first_token
        end = timing.finished or time.monotonic()
        record = {
            "ts": time.time(),
            "request_id": request_id,
            "prompt_tokens": delta.prompt_tokens,
            "completion_tokens": delta.completion_tokens,
            "reasoning_tokens": getattr(delta, "reasoning_tokens", 0),
            "cached_tokens": delta.cached_tokens,
            "queue_prefill_s": round(first - timing.submitted, 6) if first is not None else None,
            "decode_s": round(end - first, 6) if first is not None else None,
            "total_s": round(end - timing.submitted, 6),
            "finish_reason": delta.finish_reason,
        }
        spec = getattr(delta, "spec", None)
        if spec is not None:
            # Speculative decoding: drafted, accepted, verify_steps, mean_accepted_length,
            # acceptance_by_position.
            record["spec"] = dict(spec)
        if delta.error:
            # A request that failed midway: the log is where an operator sees why.
            record["error"] = delta.error
        line = orjson.dumps(record).decode()
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


def stats_line(stats: dict, prev: Optional[dict], interval_s: float) -> str:
    """One-line summary of engine counters, with throughput since the previous line."""
    gen = stats.get("generation_tokens_total", 0)
    prompt = stats.get("prompt_tokens_total", 0)
    reasoning = stats.get("reasoning_tokens_total", 0)
    dgen = gen - (prev or {}).get("generation_tokens_total", 0)
    dprompt = prompt - (prev or {}).get("prompt_tokens_total", 0)
    dreason = reasoning - (prev or {}).get("reasoning_tokens_total", 0)
    return (f"ninfer: running={stats.get('running', 0)} waiting={stats.get('waiting', 0)} "
            f"kv_blocks={stats.get('kv_blocks_used', 0)}/{stats.get('kv_blocks_total', 0)} "
            f"prompt_tok/s={dprompt / interval_s:.1f} gen_tok/s={dgen / interval_s:.1f} "
            f"(reasoning_tok/s={dreason / interval_s:.1f} answer_tok/s={(dgen - dreason) / interval_s:.1f}) "
            f"prefix_hit_tokens={stats.get('prefix_hit_tokens', 0)} steps={stats.get('steps', 0)}"
            + _spec_part(stats))


def _spec_part(stats: dict) -> str:
    """The speculative-decoding figures of the stats line, empty while no draft was verified."""
    if not stats.get("spec_verify_steps"):
        return ""
    drafted = stats.get("spec_drafted_tokens", 0)
    rate = stats.get("spec_accepted_tokens", 0) / drafted if drafted else 0.0
    return (f" spec_accept={rate:.2f} spec_mean_len={stats.get('spec_mean_accepted_length', 0.0):.2f}"
            f" spec_by_pos={'/'.join(f'{r:.2f}' for r in stats.get('spec_acceptance_by_position', []))}"
            + (f" spec_mean_k={stats['spec_mean_k_chosen']:.2f}" if stats.get("spec_mean_k_chosen") is not None else ""))


async def log_stats_forever(engine, interval_s: float, out: TextIO = sys.stderr) -> None:
    """Print `stats_line` every interval until cancelled."""
    prev = None
    while True:
        await anyio.sleep(interval_s)
        stats = await engine.astats()
        print(stats_line(stats, prev, interval_s), file=out, flush=True)
        prev = stats
