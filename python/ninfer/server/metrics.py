"""Prometheus text exposition of the server's counters, latency histograms and engine gauges.

Request-level figures (TTFT, inter-token latency, token counts, finish reasons) are recorded by
the server as requests finish; engine figures (running, waiting, KV blocks, prefix-cache hits,
largest batch) are read from `core.stats()` at scrape time.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PREFIX = "ninfer"


class Histogram:
    """Cumulative-bucket histogram in seconds."""

    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        """Record one value."""
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str) -> list:
        """Exposition lines for this histogram."""
        out, acc = [], 0
        for le, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total}")
        out.append(f"{name}_count {self.n}")
        return out


class ServerMetrics:
    """Everything /metrics reports that the server itself measures."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.http_errors = {}
        self.client_cancels = {"body": 0, "response": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request_finished(self, delta, timing) -> None:
        """Record one finished engine request (called from the pump, once per request)."""
        with self.lock:
            self.requests[delta.finish_reason] = self.requests.get(delta.finish_reason, 0) + 1
            self.prompt_tokens += delta.prompt_tokens
            self.generation_tokens += delta.completion_tokens
            self.reasoning_tokens += getattr(delta, "reasoning_tokens", 0)
            self.cached_tokens += delta.cached_tokens
            if timing.first_token is not None:
                self.ttft.observe(timing.first_token - timing.submitted)
            for gap in timing.token_gaps:
                self.itl.observe(gap)

    def http_error(self, status: int) -> None:
        """Count a request refused with an error status."""
        with self.lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def client_cancelled(self, stage: str) -> None:
        """Count a client that disconnected before its response was complete: at `stage` "body"
        (before or while its request body was read) or "response" (while it was answered)."""
        with self.lock:
            self.client_cancels[stage] = self.client_cancels.get(stage, 0) + 1

    def render(self, core_stats: dict) -> str:
        """The whole exposition text."""
        p = PREFIX
        lines = [f"# HELP {p}_requests_total Finished engine requests by finish reason.",
                 f"# TYPE {p}_requests_total counter"]
        with self.lock:
            for reason, n in sorted(self.requests.items(), key=lambda kv: str(kv[0])):
                lines.append(f'{p}_requests_total{{finish_reason="{reason}"}} {n}')
            lines += [f"# HELP {p}_http_errors_total Requests refused with an error status.",
                      f"# TYPE {p}_http_errors_total counter"]
            for status, n in sorted(self.http_errors.items()):
                lines.append(f'{p}_http_errors_total{{status="{status}"}} {n}')
            lines += [f"# HELP {p}_client_cancels_total Requests whose client disconnected before the response was "
                      "complete, by stage (body: before or while the request body was read).",
                      f"# TYPE {p}_client_cancels_total counter"]
            for stage, n in sorted(self.client_cancels.items()):
                lines.append(f'{p}_client_cancels_total{{stage="{stage}"}} {n}')
            for name, value, help_ in (
                ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("generation_tokens_total", self.generation_tokens, "Generated tokens of finished requests."),
                ("reasoning_tokens_total", self.reasoning_tokens,
                 "Of the generated tokens, those inside reasoning blocks (what thinking budgets count)."),
                ("answer_tokens_total", self.generation_tokens - self.reasoning_tokens,
                 "Of the generated tokens, those outside reasoning blocks."),
                ("request_cached_tokens_total", self.cached_tokens, "Prompt tokens served from the prefix cache."),
            ):
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
            lines += [f"# HELP {p}_time_to_first_token_seconds Submit to first token.",
                      f"# TYPE {p}_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines(f"{p}_time_to_first_token_seconds")
            lines += [f"# HELP {p}_inter_token_latency_seconds Time between output tokens.",
                      f"# TYPE {p}_inter_token_latency_seconds histogram"]
            lines += self.itl.lines(f"{p}_inter_token_latency_seconds")
        gauges = {
            "running": ("num_requests_running", "gauge", "Requests in the running batch."),
            "waiting": ("num_requests_waiting", "gauge", "Requests waiting for admission."),
            "kv_blocks_used": ("kv_blocks_used", "gauge", "KV-cache blocks in use."),
            "kv_blocks_total": ("kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
            "prefix_hit_tokens": ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache."),
            "prompt_tokens_total": ("engine_prompt_tokens_total", "counter", "Prompt tokens admitted by the engine."),
            "generation_tokens_total": ("engine_generation_tokens_total", "counter", "Tokens generated by the engine."),
            "reasoning_tokens_total": ("engine_reasoning_tokens_total", "counter",
                                       "Of the tokens generated by the engine, those inside reasoning blocks."),
            "prefill_tokens_computed": ("prefill_tokens_computed_total", "counter", "Prompt tokens actually computed."),
            "max_batch_size_seen": ("max_batch_size_seen", "gauge", "Largest number of sequences in one step."),
            "steps": ("engine_steps_total", "counter", "Engine steps run."),
            "lookahead_steps": ("engine_lookahead_steps_total", "counter",
                                "Decode steps queued before the step ahead returned (asynchronous scheduling)."),
            "split_lookahead_steps": ("engine_split_lookahead_steps_total", "counter",
                                      "Lookahead steps whose sampling waited for the step ahead (grammar masks)."),
            "spec_verify_steps": ("spec_verify_steps_total", "counter", "Speculative verify rounds (a decode with a draft)."),
            "spec_drafted_tokens": ("spec_drafted_tokens_total", "counter", "Draft tokens verified."),
            "spec_accepted_tokens": ("spec_accepted_tokens_total", "counter", "Draft tokens accepted."),
            "spec_rollback_tokens": ("spec_rollback_tokens_total", "counter",
                                     "Tokens run through a second forward to roll a recurrent state back past rejected drafts."),
            "spec_replayed_tokens": ("spec_replayed_tokens_total", "counter",
                                     "Tokens whose recurrence alone was replayed to roll a recurrent state back past rejected drafts."),
            "spec_mean_accepted_length": ("spec_mean_accepted_length", "gauge",
                                          "Tokens output per verify round (accepted drafts plus the target's token)."),
            "spec_mean_k_chosen": ("spec_mean_k_chosen", "gauge",
                                   "Mean draft length chosen per request and step by --spec-adaptive (0 included)."),
        }
        for key, (name, kind, help_) in gauges.items():
            if core_stats.get(key) is not None:
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} {kind}", f"{p}_{name} {core_stats[key]}"]
        by_position = core_stats.get("spec_acceptance_by_position")
        if by_position:
            lines += [f"# HELP {p}_spec_acceptance_rate Accepted share of the draft tokens at each draft position.",
                      f"# TYPE {p}_spec_acceptance_rate gauge"]
            lines += [f'{p}_spec_acceptance_rate{{position="{j}"}} {r}' for j, r in enumerate(by_position)]
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict:
    """Parse exposition text into {name_with_labels: float} (for tests and benchmarks)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
