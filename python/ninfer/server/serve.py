"""`ninfer serve` / `ninfer-serve`: flags, validation and uvicorn startup.

Bad flag values exit with status 2 and name the flag and the value, as does a port already in
use (checked before anything starts). Flags of features that do not exist yet are refused with
"<flag> is not supported yet" rather than silently ignored. The sampling flags are `ninfer run`'s
(cli.add_sampling_flags).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pathlib
import socket
import sys
from typing import Optional, Sequence

from ninfer.cli import (LATER_WORK_FLAGS, spec_flag_error, HelpFormatter, add_engine_option_flags, add_kv_dtype_flag,
                        add_logits_dtype_flag, add_quantize_flags, add_sampling_flags, device_arg, engine_option_kwargs,
                        kv_capacity_arg, kv_dtype_error, model_dir_error, non_negative_int, positive_int,
                        quantize_flag_error, quantize_kwargs, sampling_flag_values)

#: Refused by name, as by `ninfer run` (one list: cli.LATER_WORK_FLAGS).
UNSUPPORTED_FLAGS = tuple(LATER_WORK_FLAGS)
BUNDLED_MODEL = pathlib.Path(__file__).resolve().parent.parent / "demo" / "model"


def _port(text: str) -> int:
    v = non_negative_int("--port")(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 0..65535, got {text!r}")
    return v


def _effort_budgets(text: str) -> dict:
    from ninfer.server.protocol import parse_effort_budgets

    try:
        return parse_effort_budgets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--reasoning-effort-budgets {e}") from None


def build_parser() -> argparse.ArgumentParser:
    """The `ninfer serve` argument parser."""
    p = argparse.ArgumentParser(prog="ninfer serve", description="OpenAI-compatible NInfer server",
                                formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", help="model directory (default: the bundled demo model, if installed)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--model-id", metavar="NAME", help="name clients use in `model` (default: the model directory name)")
    p.add_argument("--device", type=device_arg, default="auto", help="auto (the GPU when present, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--max-context", type=positive_int("--max-context"), metavar="N", help="context length (default: the model's)")
    p.add_argument("--kv-capacity", type=kv_capacity_arg, default=None, metavar="N|auto", help="tokens in the shared KV pool, or auto (default): --max-concurrency full contexts, as far as free GPU memory allows on CUDA (keeping 5%% of the device, at least 1 GiB, in reserve) or 4 GiB on the CPU")
    add_kv_dtype_flag(p)
    add_logits_dtype_flag(p)
    add_engine_option_flags(p)
    add_quantize_flags(p)
    p.add_argument("--max-concurrency", type=positive_int("--max-concurrency"), default=64, metavar="N",
                   help="requests decoded together")
    p.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk"), default=512, metavar="N", help="tokens per engine step")
    p.add_argument("--num-threads", type=positive_int("--num-threads"), metavar="N", help="threads of the CPU backend (default: all cores; refused on a GPU)")
    p.add_argument("--no-prefix-reuse", action="store_true", help="do not reuse the KV cache of a shared prompt prefix")
    p.add_argument("--no-thinking", action="store_true", help="enable_thinking false unless a request sets it")
    p.add_argument("--reasoning-budget", type=non_negative_int("--reasoning-budget"), metavar="N",
                   help="thinking budget (tokens) of a chat request that sets neither thinking_budget nor "
                        "reasoning_effort, where it leaves room for an answer within its max_tokens: the engine then "
                        "closes the reasoning after N tokens (default: unlimited)")
    p.add_argument("--reasoning-effort-budgets", type=_effort_budgets, default=None, metavar="low=N,medium=N,high=N",
                   help="thinking budgets of reasoning_effort minimal / low / medium / high, each a number of tokens or "
                        "none (unlimited); entries left out keep their defaults: minimal=0,low=1024,medium=8192,high=none")
    p.add_argument("--reasoning-budget-message", metavar="TEXT",
                   help="a sentence the engine writes into the reasoning before closing it when a budget runs out, "
                        "e.g. \"Thinking budget reached; answering now.\" (default: none, only the end-of-thinking tag)")
    add_sampling_flags(p, "request defaults (a request's own fields win; these win over generation_config.json)",
                       "--default-max-tokens", "temperature 0 unless a request sets it")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where the sampling defaults of a request that leaves a field out come from: auto (default) "
                        "the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens; do_sample false = greedy), DIR the generation_config.json in DIR, vllm none "
                        "(temperature 1, no top-p/top-k)")
    p.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"), metavar="KEY",
                   help="key clients must send as `Authorization: Bearer KEY` (default: $NINFER_API_KEY, else none)")
    p.add_argument("--cors", action="append", metavar="ORIGIN",
                   help="allowed origin (repeatable; * for any; default: none)")
    p.add_argument("--request-log-jsonl", metavar="FILE", help="append one JSON line per finished request to FILE (default: none)")
    p.add_argument("--log-stats-interval-ms", type=positive_int("--log-stats-interval-ms"), metavar="MS",
                   help="print throughput and queue figures this often (default: never)")
    p.add_argument("--max-queue", type=non_negative_int("--max-queue"), metavar="N",
                   help="requests allowed to wait beyond --max-concurrency before 429 (default: no limit)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    p.add_argument("--core-factory", metavar="MODULE:CALLABLE",
                   help="build the engine core with this callable instead of _core.Engine (tests, benchmarks; "
                        "default: _core.Engine)")
    return p


def _refuse_unsupported(argv: Sequence[str], parser: argparse.ArgumentParser) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in UNSUPPORTED_FLAGS:
            parser.exit(2, f"ninfer serve: error: {flag} is not supported yet\n")


def _load_factory(spec: str, parser: argparse.ArgumentParser):
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        parser.error(f"--core-factory {spec!r} cannot be loaded: {e}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate flags; exits 2 on a bad value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    _refuse_unsupported(argv, parser)
    args = parser.parse_args(argv)
    kv_error = kv_dtype_error(args.kv_dtype)
    if kv_error:
        parser.exit(2, f"ninfer serve: error: {kv_error}\n")
    spec_error = spec_flag_error(args) or quantize_flag_error(args)
    if spec_error:
        parser.error(spec_error)
    if args.kv_capacity is not None and args.max_context is not None and args.kv_capacity < args.max_context:
        parser.error(f"--kv-capacity {args.kv_capacity} must be >= --max-context {args.max_context}")
    if args.core_factory is None:
        if args.model is None:
            if not BUNDLED_MODEL.is_dir():
                parser.error("no MODEL given and no bundled demo model is installed at " + str(BUNDLED_MODEL))
            args.model = str(BUNDLED_MODEL)
            if args.model_id is None:
                args.model_id = "ninfer-demo"
        bad_model = model_dir_error(args.model)
        if bad_model:
            parser.error(bad_model)
    if args.model_id is None:
        args.model_id = pathlib.Path(args.model).name if args.model else "ninfer-model"
    try:
        args.generation_defaults, args.generation_source = generation_defaults(args.generation_config, args.model)
    except ValueError as e:
        parser.error(str(e))
    if args.default_max_tokens is None:
        args.default_max_tokens = args.generation_defaults.get("max_tokens")
    try:
        args.flag_defaults = sampling_flag_values(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def generation_defaults(source: str, model_dir: Optional[str]) -> tuple:
    """(sampling defaults, the file they came from or None) for `--generation-config source`.

    `auto` reads the model directory's generation_config.json when it has one; `vllm` reads
    nothing; anything else names a directory that must hold the file. A file that is not a JSON
    object, or whose values a request could not carry, is a ValueError naming the file.
    """
    from ninfer import _core
    from ninfer.server.errors import ApiError
    from ninfer.server.protocol import ServerDefaults, sampling_fields

    if source == "vllm":
        return {}, None
    if source == "auto":
        if model_dir is None:
            return {}, None
        path = pathlib.Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return {}, None
    else:
        path = pathlib.Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {source!r}: no generation_config.json in that directory "
                             "(auto: the model's, vllm: none)")
    try:
        # The core's parser (the engine's own), which names the file and the field at fault.
        defaults = dict(_core.generation_defaults(str(path.parent)))
    except _core.NinferError as e:
        raise ValueError(str(e)) from None
    # Checked as a request carrying these fields would be, so no request fails on a default.
    try:
        sampling_fields({k: v for k, v in defaults.items() if k != "max_tokens"}, ServerDefaults(model_id=""))
    except ApiError as e:
        raise ValueError(f"malformed file {path}: {e.message}") from None
    return defaults, str(path)


def make_app(args: argparse.Namespace, on_load_failure=None):
    """The ASGI app for parsed flags (the engine loads in the background once it starts)."""
    import anyio.to_thread

    from ninfer.engine import AsyncEngine
    from ninfer.server.app import build_app
    from ninfer.server.protocol import ServerDefaults
    from ninfer.server.request_log import RequestLog
    from ninfer.server.state import ServerState

    sampling = {k: v for k, v in args.generation_defaults.items() if k != "max_tokens"}
    sampling.update(args.flag_defaults)
    defaults = ServerDefaults(model_id=args.model_id, default_max_tokens=args.default_max_tokens,
                              greedy=args.greedy, enable_thinking=not args.no_thinking, sampling=sampling,
                              reasoning_budget=args.reasoning_budget, reasoning_budget_message=args.reasoning_budget_message)
    if args.reasoning_effort_budgets is not None:
        defaults.effort_budgets = args.reasoning_effort_budgets
    log = RequestLog(args.request_log_jsonl) if args.request_log_jsonl else None
    state = ServerState(defaults, api_key=args.api_key, request_log=log)
    engine_kwargs = dict(max_context=args.max_context, kv_capacity=args.kv_capacity,
                         max_concurrency=args.max_concurrency, prefill_chunk=args.prefill_chunk,
                         prefix_reuse=not args.no_prefix_reuse, num_threads=args.num_threads,
                         logits_dtype=args.logits_dtype, kv_dtype=args.kv_dtype, **engine_option_kwargs(args),
                         **quantize_kwargs(args))
    factory = _load_factory(args.core_factory, build_parser()) if args.core_factory else None

    async def start_engine():
        if factory is not None:
            kw = {k: v for k, v in engine_kwargs.items() if v is not None and k in ("max_context", "kv_capacity",
                                                                                     "max_concurrency")}
            core = await anyio.to_thread.run_sync(lambda: factory(**kw))
            return await AsyncEngine.start(core=core, max_queue=args.max_queue)
        return await AsyncEngine.start(args.model, device=args.device, max_queue=args.max_queue, **engine_kwargs)

    interval = args.log_stats_interval_ms / 1000 if args.log_stats_interval_ms else None
    return build_app(state, start_engine, cors=args.cors, log_stats_interval_s=interval, on_load_failure=on_load_failure)


def listen_error(host: str, port: int) -> Optional[str]:
    """Why the server could not listen on host:port (a port in use above all), or None.

    Checked by binding each address as the server will (SO_REUSEADDR, IPv6 sockets IPv6 only),
    then letting go: a flag error before the "serving on" line and before the model loads,
    rather than uvicorn's failure once everything has started.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host}: cannot resolve it ({e.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"--port {port}: {host}:{port} is already in use (another program listens there; "
                            "pick another --port)")
                return f"--host {host} --port {port}: cannot listen there ({e.strerror})"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `ninfer serve` and `ninfer-serve`."""
    import uvicorn

    args = parse_args(argv)
    error = listen_error(args.host, args.port)
    if error:
        print(f"ninfer serve: error: {error}", file=sys.stderr)
        return 2
    server: Optional[uvicorn.Server] = None

    def stop() -> None:
        server.should_exit = True

    app = make_app(args, on_load_failure=stop)
    if args.generation_source or args.flag_defaults:
        shown = " ".join(f"{k}={v}" for k, v in {**args.generation_defaults, **args.flag_defaults}.items())
        src = " and ".join(x for x in (args.generation_source, "flags" if args.flag_defaults else None) if x)
        print(f"ninfer: request defaults from {src}: {shown or 'none it sets'} (a request's own fields win; "
              "--generation-config vllm ignores the file)", file=sys.stderr, flush=True)
    print(f"ninfer: serving {args.model_id} on http://{args.host}:{args.port} (loading {args.model or 'core factory'})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level in ("info", "debug"), timeout_graceful_shutdown=5))
    server.run()
    if app.state.server.load_error:
        print(f"ninfer serve: error: {app.state.server.load_error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
