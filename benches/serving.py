"""Serving benchmark: TTFT, inter-token latency and output tok/s, over HTTP and direct, same run.

For each concurrency level (default 1, 8, 32) the same token-id prompts are run twice: through
the engine driven directly (`AsyncEngine`, the peer) and through `ninfer serve` over HTTP
(streaming /v1/completions). Every request generates exactly `--max-tokens` tokens
(ignore_eos, greedy). Records go to benches/results/serving.json with ratio = HTTP / direct;
the HTTP overhead at the highest concurrency must stay under 10% of direct throughput.

    python benches/serving.py --model MODEL_DIR [--device cpu] [--max-tokens 64]
    python benches/serving.py --small-model      # a random 8-layer Qwen3 made on first use
    python benches/serving.py --core-factory fake_core:FakeCore   # the HTTP layer alone
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests")]

import orjson  # noqa: E402

from ninfer.engine import AsyncEngine  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list:
    """Deterministic random token-id prompts (ids kept in a safe low range of the vocabulary)."""
    rng = random.Random(seed)
    hi = max(2, min(vocab, 30000) - 1)
    return [[rng.randrange(1, hi) for _ in range(length)] for _ in range(n)]


def summarize(results: list, wall_s: float) -> dict:
    """TTFT / ITL means and throughput from per-request (ttft, itl, tokens) results."""
    tokens = sum(r["tokens"] for r in results)
    itls = [r["itl"] for r in results if r["itl"] is not None]
    return {
        "ttft_ms": 1000 * statistics.mean(r["ttft"] for r in results),
        "itl_ms": 1000 * statistics.mean(itls) if itls else float("nan"),
        "output_tok_s": tokens / wall_s,
    }


def per_request(start: float, first: float, last: float, tokens: int) -> dict:
    return {"ttft": first - start, "itl": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens}


async def run_direct(engine: AsyncEngine, prompts: list, params: dict) -> dict:
    """All prompts at once through the engine; returns the summary."""
    results = []

    async def one(ids):
        start = time.monotonic()
        first = last = None
        tokens = 0
        async for d in engine.generate(ids, params):
            if d.token_ids:
                now = time.monotonic()
                first = first or now
                last = now
                tokens += len(d.token_ids)
        results.append(per_request(start, first, last, tokens))

    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in prompts))
    return summarize(results, time.monotonic() - t0)


async def _sse_lines(host: str, port: int, path: str, body: dict):
    """POST `body` and yield each SSE `data:` payload (a lean HTTP/1.1 client, so that the
    client's own cost does not count as server overhead)."""
    reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = orjson.dumps(body)
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), host.encode(), len(payload)) + payload)
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status!r}: {await reader.read(2000)!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            pending += await reader.readexactly(size)
            await reader.readexactly(2)
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]
    finally:
        writer.close()


async def run_http(url: str, prompts: list, params: dict) -> dict:
    """All prompts at once as streaming completions; returns the summary."""
    results = []
    host, port = url.split("//", 1)[1].split(":")

    async def one(ids):
        body = dict(params, prompt=ids, stream=True, stream_options={"include_usage": True})
        start = time.monotonic()
        first = last = None
        tokens = 0
        async for data in _sse_lines(host, int(port), "/v1/completions", body):
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"]:
                now = time.monotonic()
                first = first or now
                if chunk["choices"][0]["finish_reason"] is None:
                    last = now
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        results.append(per_request(start, first, last or first, tokens))

    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in prompts))
    return summarize(results, time.monotonic() - t0)


SMALL_QWEN3 = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


def make_small_model(path: pathlib.Path) -> str:
    """A random Qwen3 of SMALL_QWEN3's shape with a trained tiny tokenizer (tests/ factories)."""
    from tiny_models import make_model
    from tiny_tokenizer import make_tokenizer

    if not (path / "tokenizer.json").exists():
        make_model(path, "qwen3", **SMALL_QWEN3)
        tok = make_tokenizer(path, style="qwen3", vocab_size=SMALL_QWEN3["vocab_size"])
        for name in ("config.json", "generation_config.json"):
            f = path / name
            data = json.loads(f.read_text())
            data["eos_token_id"] = int(tok.eos_token_id)
            f.write_text(json.dumps(data))
    return str(path)


def model_summary(model_dir: str) -> dict:
    """The config fields that say how big the benchmarked model is."""
    cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    keys = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads")
    return {k: cfg.get(k) for k in keys if k in cfg}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def main_async(args) -> list:
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    levels = [int(x) for x in args.concurrency.split(",")]
    engine_kwargs = {k: v for k, v in dict(max_context=args.max_context, max_concurrency=max(levels)).items() if v}

    if args.core_factory:
        import importlib

        module, _, name = args.core_factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
        engine = await AsyncEngine.start(core=factory(max_concurrency=max(levels)))
        server_args = ["--core-factory", args.core_factory]
    else:
        engine = await AsyncEngine.start(args.model, device=args.device, **engine_kwargs)
        server_args = [args.model, "--device", args.device]
    server_args += ["--max-concurrency", str(max(levels))]
    if args.max_context:
        server_args += ["--max-context", str(args.max_context)]
    info = engine.core.info() if hasattr(engine.core, "info") else {}
    device = str(info.get("device_name") or info.get("device") or args.device)
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 1000
    warm = make_prompts(2, args.prompt_tokens, vocab, seed=99)
    await run_direct(engine, warm, params)
    direct = {}
    for c in levels:
        direct[c] = await run_direct(engine, make_prompts(c * args.rounds, args.prompt_tokens, vocab, seed=c), params)
        print(f"direct c={c}: {direct[c]}", file=sys.stderr)
    await engine.shutdown()

    http = {}
    with ServerProcess(server_args, ready_timeout_s=600) as server:
        await run_http(server.url, warm, params)
        for c in levels:
            http[c] = await run_http(server.url, make_prompts(c * args.rounds, args.prompt_tokens, vocab, seed=c), params)
            print(f"http   c={c}: {http[c]}", file=sys.stderr)

    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    base = {"commit": commit(), "date": stamp, "device": device, "command": " ".join([sys.argv[0], *sys.argv[1:]]),
            "model": args.model or args.core_factory,
            "config": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "model": model_summary(args.model) if args.model else None}}
    records = []
    for c in levels:
        for metric in ("ttft_ms", "itl_ms", "output_tok_s"):
            value, peer = http[c][metric], direct[c][metric]
            records.append(dict(base, metric=f"http_{metric}_c{c}", value=round(value, 3), peer=round(peer, 3),
                                ratio=round(value / peer, 4) if peer else None))
    top = max(levels)
    overhead = 1 - http[top]["output_tok_s"] / direct[top]["output_tok_s"]
    records.append(dict(base, metric=f"http_throughput_overhead_c{top}", value=round(overhead, 4), peer=0.0,
                        ratio=None, passes=overhead < 0.10))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory")
    p.add_argument("--small-model", action="store_true",
                   help="make (once) and use a random 8-layer Qwen3 in tests/.cache/bench-qwen3-small")
    p.add_argument("--core-factory", help="MODULE:CALLABLE fake core instead of a model (tests/fake_core.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-context", type=int)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2, help="requests per level = concurrency * rounds")
    p.add_argument("--out", default=str(ROOT / "benches" / "results" / "serving.json"))
    args = p.parse_args(argv)
    if args.small_model:
        args.model = make_small_model(ROOT / "tests" / ".cache" / "bench-qwen3-small")
    if not args.model and not args.core_factory:
        p.error("give --model DIR or --core-factory MODULE:CALLABLE")
    os.environ.setdefault("PYTHONPATH", f"{ROOT / 'python'}{os.pathsep}{ROOT / 'tests'}")
    records = asyncio.run(main_async(args))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + records, indent=1) + "\n")
    for r in records:
        print(f"{r['metric']:<36} {r['value']:>12} peer {r['peer']:>12} ratio {r['ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
