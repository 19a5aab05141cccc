"""The `ninfer` program: `ninfer run` answers one prompt, `ninfer serve` starts the server.

`run` streams the answer to stdout as the engine produces it and reports load time, prefill
and decode speed on stderr, so the answer can be piped while the figures stay on the terminal.
`ninfer MODEL --prompt ...` (no subcommand) is `run`, as users of the original type it.
`serve` and the `ninfer-serve` program belong to `ninfer.server.serve`, imported only then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import List, Optional

#: Flags of later work (tensor parallel, speculation, KV formats, vision, tuning profiles) that
#: the original's users type: accepted by the parser only so they are refused by name.
LATER_WORK_FLAGS = {
    "--tp": {"metavar": "N"},
    "--devices": {"metavar": "LIST"},
    "--spec": {"metavar": "KIND"},
    "--draft-tokens": {"metavar": "N"},
    "--host-kv-mib": {"metavar": "MIB"},
    "--device-profile-path": {"metavar": "FILE"},
    "--vision": {"action": "store_true"},
    "--gdn-state-fp16": {"action": "store_true"},
    "--lm-head-draft": {"action": "store_true"},
    "--vision-residency": {"metavar": "MODE"},
    "--vision-max-merged": {"metavar": "N"},
}

#: --kv-dtype: the KV cache is kept in the backend's own type (bf16 on a GPU, f16 on sm_70/sm_75,
#: float32 on the CPU); `auto` or that type by name is accepted. rust_core/src/model/kv_dtype.rs
#: maps the spellings to types and checks the type against the backend once the device is known
#: (KV_DTYPE_CHOICES and QUANTIZED_KV_DTYPES, exported as `_core.KV_DTYPES` and
#: `_core.QUANTIZED_KV_DTYPES`, which tests/test_cli.py compares with these copies); the CLI
#: refuses any other name itself (`kv_dtype_error`) before a weight is read.
DEFAULT_KV_DTYPE = "auto"
KV_DTYPES = ("auto", "bf16", "bfloat16", "f16", "float16", "half", "f32", "float32")
QUANTIZED_KV_DTYPES = ("int8", "rk8v4", "rk4v4")
_KV_KEPT = "bf16 on a GPU, f16 on sm_70/sm_75, float32 on the CPU"

#: --logits-dtype choices: rust_core/src/model/logits_dtype.rs parses them (LOGITS_DTYPE_CHOICES,
#: exported as `_core.LOGITS_DTYPES`, which tests/test_cli.py compares with this copy; the CLI
#: keeps its own so that `--help` needs no compiled core).
LOGITS_DTYPES = ("auto", "float32")

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

USAGE = """\
usage: ninfer run [MODEL] (--prompt TEXT | --messages FILE.json) [options]
       ninfer serve [MODEL] [options]
       ninfer MODEL --prompt TEXT          (same as `ninfer run`)

commands:
  run     answer one prompt; the answer streams to stdout, speed figures go to stderr
  serve   start the OpenAI-compatible server (same as `ninfer-serve`)

`ninfer run --help` and `ninfer serve --help` list the options."""


def add_later_work_flags(parser: argparse.ArgumentParser) -> None:
    """Accept the flags of later work so `reject_later_work_flags` can refuse them."""
    group = parser.add_argument_group("not supported yet (refused)")
    for flag, kwargs in LATER_WORK_FLAGS.items():
        group.add_argument(flag, default=None, help=argparse.SUPPRESS, **kwargs)


def reject_later_work_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with status 2 and "<flag> is not supported yet" when one of those flags was given (and
    on a --kv-dtype that no backend keeps)."""
    for flag in LATER_WORK_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value not in (None, False):
            parser.error(f"{flag} is not supported yet")
    error = kv_dtype_error(args.kv_dtype)
    if error:
        parser.error(error)


def kv_dtype_error(value: str) -> Optional[str]:
    """Why `--kv-dtype value` is refused before anything loads, or None for a name the core takes
    (run and serve); whether the chosen backend keeps that type the core checks once the device
    is known.

    A quantized format (SEEDS' int8, rk8v4, rk4v4) is named as later work, and the message says
    what each backend keeps, so a refusal does not read as "this GPU cannot hold a bf16 cache".
    """
    name = value.strip().lower()
    if name in KV_DTYPES:
        return None
    if name in QUANTIZED_KV_DTYPES:
        return (f"--kv-dtype {value} is not supported yet: quantized KV caches ({', '.join(QUANTIZED_KV_DTYPES)}) "
                f"are later work; --kv-dtype auto (or that type by name) keeps the KV cache in the backend's own "
                f"type: {_KV_KEPT}")
    return (f"--kv-dtype {value} is not a KV cache type: give auto or the backend's own type by name "
            f"({_KV_KEPT}; spellings: {', '.join(KV_DTYPES)})")


def add_kv_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """`--kv-dtype` (shared with `ninfer serve`); checked by `kv_dtype_error`, then by the core."""
    parser.add_argument("--kv-dtype", default=DEFAULT_KV_DTYPE, metavar="DTYPE",
                        help=f"KV cache type: auto (default) keeps it in the backend's own type ({_KV_KEPT}); "
                             "that type by name (bf16|bfloat16, f16|float16|half, f32|float32) is accepted "
                             "where the backend keeps it and refused elsewhere; quantized caches "
                             f"({', '.join(QUANTIZED_KV_DTYPES)}) are later work")


def model_dir_error(path: str) -> Optional[str]:
    """Why MODEL cannot be loaded before anything is read, or None for a directory.

    `ninfer run` and `ninfer serve` both check it: a single-file container (the original's
    `.ninfer`, GGUF) is the likeliest non-directory a user passes.
    """
    if os.path.isdir(path):
        return None
    if os.path.isfile(path):
        return (f"MODEL {path!r} is not a directory but a file: NInfer loads a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer.json); .ninfer and GGUF files are not supported yet")
    return f"MODEL {path!r} is not a directory (nothing exists at that path)"


def _kv_capacity(text: str) -> Optional[int]:
    """--kv-capacity: a positive token count, or auto (None: sized from free memory)."""
    return None if text == "auto" else _number(int, 1)(text)


def _number(kind, low=None, high=None, low_open=False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if kind is float and value != value:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} must be <= {high}")
        return value

    return parse


def device_arg(text: str) -> str:
    """argparse type of --device (shared with `ninfer serve`)."""
    if not _DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (expected auto, cpu, cuda or cuda:N)")
    return text


def add_logits_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """`--logits-dtype` (shared with `ninfer serve`)."""
    parser.add_argument("--logits-dtype", choices=LOGITS_DTYPES, default="auto",
                        help="auto (default): logits rounded to the 16-bit dtype the model runs in (bf16 on CUDA; "
                             "a bf16/f16 checkpoint's on the CPU), as transformers and vLLM return them; "
                             "float32: the lm_head's f32 sums unrounded")


def build_run_parser(prog: str = "ninfer run") -> argparse.ArgumentParser:
    """The parser of `ninfer run`."""
    p = argparse.ArgumentParser(prog=prog, description="Answer one prompt; stream the answer to stdout.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model directory (config.json, model.safetensors, tokenizer.json); "
                        "default: the bundled demo model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt (a chat model gets it as one user message)")
    src.add_argument("--messages", metavar="FILE.json",
                     help="UTF-8 JSON: an array of chat messages, or {\"messages\": [...], \"tools\": [...]}")
    p.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    p.add_argument("--no-thinking", action="store_true", help="render the chat template with enable_thinking=false")
    p.add_argument("--max-new", type=_number(int, 1), metavar="N",
                   help="most tokens to generate (default: what fits in the context)")
    p.add_argument("--max-context", type=_number(int, 1), metavar="N", help="context length (default: the model's)")
    p.add_argument("--kv-capacity", type=_kv_capacity, metavar="N|auto", help="KV cache tokens, or auto (default: what fits in free GPU memory on CUDA, 4 GiB on the CPU; at least max-context)")
    p.add_argument("--prefill-chunk", type=_number(int, 1), default=512, metavar="N", help="tokens per engine step")
    p.add_argument("--num-threads", type=_number(int, 1), metavar="N", help="threads of the CPU backend (default: all cores; refused on a GPU)")
    p.add_argument("--device", type=device_arg, default="auto",
                   help="auto (the GPU when present, else the CPU), cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    p.add_argument("--temperature", type=_number(float, 0.0), metavar="T")
    p.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True), metavar="P")
    p.add_argument("--top-k", type=_number(int, 0), metavar="K", help="0 disables")
    p.add_argument("--min-p", type=_number(float, 0.0, 1.0), metavar="P")
    p.add_argument("--presence-penalty", type=_number(float, -2.0, 2.0), metavar="X")
    p.add_argument("--frequency-penalty", type=_number(float, -2.0, 2.0), metavar="X")
    p.add_argument("--repetition-penalty", type=_number(float, 0.0, low_open=True), metavar="X")
    p.add_argument("--seed", type=_number(int, 0), metavar="N")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_logits_dtype_flag(p)
    add_kv_dtype_flag(p)
    add_later_work_flags(p)
    return p


def read_messages_file(path: str) -> tuple:
    """(messages, tools) from a --messages file; ValueError naming the path when malformed."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    tools = None
    if isinstance(data, dict):
        tools = data.get("tools")
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty array of messages or an object with \"messages\"")
    for i, m in enumerate(data):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{path}: message {i} must be an object with a string \"role\"")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{path}: \"tools\" must be an array")
    return data, tools


def default_model_dir() -> Optional[str]:
    """The bundled demo model's directory when this install ships it, else None."""
    path = os.path.join(os.path.dirname(__file__), "demo", "model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def _sampling_params(llm, args):
    params = llm.get_default_sampling_params()
    if args.greedy:
        params.temperature = 0.0
    for flag in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed"):
        value = getattr(args, flag)
        if value is not None:
            setattr(params, flag, value)
    if args.max_new is not None:
        params.max_tokens = args.max_new
    params.stop = list(args.stop)
    params.ignore_eos = args.ignore_eos
    params.n = 1
    return params


def _use_utf8_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        if (getattr(stream, "encoding", "") or "").lower().replace("-", "") != "utf8":
            try:
                stream.reconfigure(encoding="utf-8", errors="replace")
            except (AttributeError, ValueError):
                pass


def run_main(argv: List[str], prog: str = "ninfer run") -> int:
    """`ninfer run`: load the model, stream one answer to stdout, figures to stderr."""
    parser = build_run_parser(prog)
    args = parser.parse_args(argv)
    reject_later_work_flags(parser, args)
    _use_utf8_stdio()
    model = args.model or default_model_dir()
    if model is None:
        parser.error("MODEL is required (no bundled demo model in this install)")
    bad_model = model_dir_error(model)
    if bad_model:
        parser.error(bad_model)
    if args.greedy and args.temperature is not None:
        parser.error(f"--greedy and --temperature {args.temperature} contradict each other: give one")
    messages = tools = None
    if args.messages is not None:
        try:
            messages, tools = read_messages_file(args.messages)
        except ValueError as e:
            parser.error(f"--messages: {e}")

    from ninfer import _core
    from ninfer.ledger import format_ledger
    from ninfer.llm import LLM

    try:
        t0 = time.perf_counter()
        llm = LLM(model, device=args.device, max_context=args.max_context, kv_capacity=args.kv_capacity,
                  prefill_chunk=args.prefill_chunk, num_threads=args.num_threads, max_concurrency=1,
                  logits_dtype=args.logits_dtype, kv_dtype=args.kv_dtype)
        load_s = time.perf_counter() - t0
        print(f"ninfer: loaded {model} in {load_s:.2f} s (max context {llm.max_context} tokens)",
              file=sys.stderr, flush=True)
        print(format_ledger(llm.engine.info()), file=sys.stderr, flush=True)
        kwargs = {"enable_thinking": False} if args.no_thinking else None
        if messages is not None:
            ids = llm.chat_prompt_ids(messages, tools, kwargs)
        elif not args.raw and llm.tokenizer is not None and llm.tokenizer.has_chat_template:
            ids = llm.chat_prompt_ids([{"role": "user", "content": args.prompt}], None, kwargs)
        else:
            ids = llm.encode(args.prompt)
        return _stream_answer(llm, ids, _sampling_params(llm, args))
    except KeyboardInterrupt:
        print("\nninfer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except _core.InvalidRequestError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except _core.NinferError as e:
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _stream_answer(llm, ids: List[int], params) -> int:
    t_submit = time.perf_counter()
    t_first = None
    generated = 0
    finish = None
    text_tail = ""
    for delta in llm.stream(ids, params):
        if delta["token_ids"] and t_first is None:
            t_first = time.perf_counter()
        generated += len(delta["token_ids"])
        if delta["text"]:
            sys.stdout.write(delta["text"])
            sys.stdout.flush()
            text_tail = delta["text"]
        finish = delta.get("finish_reason") or finish
    t_end = time.perf_counter()
    if sys.stdout.isatty() and not text_tail.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    t_first = t_first or t_end
    prefill_s = t_first - t_submit
    decode_s = t_end - t_first
    prefill_rate = len(ids) / prefill_s if prefill_s > 0 else float("inf")
    decode_rate = (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0
    print(f"ninfer: prompt {len(ids)} tokens, prefill {prefill_rate:.1f} tok/s ({prefill_s * 1e3:.0f} ms); "
          f"generated {generated} tokens, decode {decode_rate:.1f} tok/s "
          f"({decode_s * 1e3 / max(generated - 1, 1):.1f} ms/token); finish {finish}",
          file=sys.stderr, flush=True)
    return 0


def serve_main(argv: Optional[List[str]] = None) -> int:
    """`ninfer serve` / `ninfer-serve`: hand over to the server's own flag parser."""
    try:
        from ninfer.server.serve import main as server_main
    except ImportError as e:
        print(f"ninfer serve: the server module is not available ({e})", file=sys.stderr)
        return 1
    return server_main(sys.argv[1:] if argv is None else argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the `ninfer` program."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from ninfer import __version__

        print(f"ninfer {__version__}")
        return 0
    if argv[0] == "serve":
        return serve_main(argv[1:])
    if argv[0] == "run":
        return run_main(argv[1:])
    return run_main(argv, prog="ninfer")


if __name__ == "__main__":
    sys.exit(main())
