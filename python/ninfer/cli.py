"""The `ninfer` program: `ninfer run` answers one prompt, `ninfer serve` starts the server.

`run` streams the answer to stdout as the engine produces it and reports load time, prefill
and decode speed on stderr, so the answer can be piped while the figures stay on the terminal.
`ninfer MODEL --prompt ...` (no subcommand) is `run`, as users of the original type it.
`serve` and the `ninfer-serve` program belong to `ninfer.server.serve`, imported only then.
The sampling flags are defined here once for both (`add_sampling_flags`) and checked as the
request fields of the same names are (`sampling_flag_values`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import List, Optional

from ninfer.draft_vocab import DRAFT_VOCAB_FILE

#: Flags of later work (tensor parallel, KV formats, vision) that
#: the original's users type: accepted by the parser only so they are refused by name.
LATER_WORK_FLAGS = {
    "--tp": {"metavar": "N"},
    "--devices": {"metavar": "LIST"},
    "--host-kv-mib": {"metavar": "MIB"},
    "--vision": {"action": "store_true"},
    "--gdn-state-fp16": {"action": "store_true"},
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

#: --quantize modes: the format a bf16/f16 checkpoint's projections are quantized to on load
#: (rust_core/src/quant/mod.rs QUANTIZE_MODES, exported as `_core.QUANTIZE_MODES`, which
#: tests/test_quantized_model.py compares with this copy).
QUANTIZE_MODES = ("w8", "q4", "q5", "q6", "fp8", "nvfp4")

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

USAGE = """\
usage: ninfer run [MODEL] (--prompt TEXT | --messages FILE.json) [options]
       ninfer serve [MODEL] [options]
       ninfer plan MODEL [--gpu-memory SIZE | --device DEVICE] [options]
       ninfer draft-vocab MODEL --corpus FILE... [--size N] [--out PATH]
       ninfer MODEL --prompt TEXT          (same as `ninfer run`)

commands:
  run          answer one prompt; the answer streams to stdout, speed figures go to stderr
  serve        start the OpenAI-compatible server (same as `ninfer-serve`)
  plan         print the memory ledger and what fits on a device, without loading the weights
  draft-vocab  count a corpus's token ids into the model's draft_vocab.json (--lm-head-draft)

`ninfer run --help`, `ninfer serve --help` and `ninfer plan --help` list the options."""


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


def _int_at_least(name: str, lo: int, what: str):
    """argparse type: an integer >= lo; the error names the flag and the value."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}")
        return v
    return parse


def positive_int(name: str):
    """argparse type of flag `name`: an integer >= 1."""
    return _int_at_least(name, 1, "a positive integer")


def non_negative_int(name: str):
    """argparse type of flag `name`: an integer >= 0."""
    return _int_at_least(name, 0, "an integer >= 0")


def _typed(name: str, kind):
    """argparse type: a number of `kind`; ranges are checked as a request's are (sampling_flag_values)."""
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
    return parse


class HelpFormatter(argparse.HelpFormatter):
    """`--help` of run and serve: each option that takes a value shows its default, from the
    parser unless its help already says what the default is (a None default means "decided
    later", which only the help can say)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in text
                and (action.option_strings or action.nargs in ("?", "*"))):
            text += " (default: %(default)s)"
        return text


#: The sampling flags of `ninfer run` and `ninfer serve`: flag -> (type, metavar, what it does,
#: default when the model's generation_config.json sets none, whether that file can set it).
#: Each is a default of the command's requests; the value is checked as the request field of
#: the same name (dashes as underscores) would be, so run and serve take the same values.
SAMPLING_FLAGS = {
    "--temperature": (float, "T", "sampling temperature; 0 is argmax decoding", "1.0", True),
    "--top-p": (float, "P", "sample from the most likely tokens whose probabilities add up to P", "1.0", True),
    "--top-k": (int, "K", "sample from the K most likely tokens; 0 disables", "0", True),
    "--min-p": (float, "P", "drop tokens less likely than P times the most likely one", "0.0", True),
    "--presence-penalty": (float, "X", "subtracted from the logit of every token already generated", "0.0", False),
    "--frequency-penalty": (float, "X", "subtracted from a token's logit once per time it was generated", "0.0",
                            False),
    "--repetition-penalty": (float, "X", "divides the positive logits (multiplies the negative ones) of tokens "
                                         "in the prompt or generated", "1.0", True),
    "--seed": (int, "N", "seed of the sampler", "unseeded", False),
}


def add_sampling_flags(parser: argparse.ArgumentParser, title: str, max_tokens_flag: str,
                       greedy_help: str) -> argparse._ArgumentGroup:
    """Add --greedy, the SAMPLING_FLAGS and the command's max-tokens flag (`--max-new` for run,
    `--default-max-tokens` for serve) in one group, which is returned for the command's own."""
    group = parser.add_argument_group(title)
    group.add_argument("--greedy", action="store_true", help=greedy_help)
    for flag, (kind, metavar, what, fallback, from_file) in SAMPLING_FLAGS.items():
        default = f"the model's generation_config.json, else {fallback}" if from_file else fallback
        group.add_argument(flag, type=_typed(flag, kind), metavar=metavar, help=f"{what} (default: {default})")
    group.add_argument(max_tokens_flag, type=positive_int(max_tokens_flag), metavar="N",
                       help="most tokens to generate (default: the model's generation_config.json max_new_tokens, "
                            "else what fits in the context)")
    return group


def sampling_flag_values(args: argparse.Namespace) -> dict:
    """The SAMPLING_FLAGS given, as request fields (`top_p`, ...) checked as a request's are;
    ValueError naming the flag and its value for a value a request could not carry, and for
    --greedy with a --temperature."""
    from ninfer.server.errors import ApiError
    from ninfer.server.protocol import ServerDefaults, sampling_fields

    given = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag in SAMPLING_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    try:
        checked = sampling_fields(given, ServerDefaults(model_id=""))
    except ApiError as e:
        flag = "--" + (e.param or "").replace("_", "-")
        raise ValueError(f"{flag} {given.get(e.param)!r}: {e.message}") from None
    if args.greedy and args.temperature is not None:
        raise ValueError(f"--greedy and --temperature {args.temperature} contradict each other: give one")
    return {k: checked[k] for k in given}


def kv_capacity_arg(text: str) -> Optional[int]:
    """argparse type of --kv-capacity: a positive token count, or auto (None: sized from free memory)."""
    return None if text == "auto" else positive_int("--kv-capacity")(text)


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


def add_engine_option_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's on/off options and the device profile (shared with `ninfer serve`); each is an
    `LLM(...)` / `AsyncEngine.start(...)` argument of the same name (`engine_option_kwargs`)."""
    group = parser.add_argument_group("engine options")
    group.add_argument("--no-async-scheduling", action="store_true",
                       help="wait for each step before scheduling the next (default: keep one step in flight "
                            "where the backend overlaps steps)")
    group.add_argument("--no-cuda-graphs", action="store_true",
                       help="run decode steps eagerly (default: replay captured CUDA graphs; same results)")
    group.add_argument("--batch-invariant", action="store_true",
                       help="make every CUDA kernel choice independent of the batch size, so a sequence in a "
                            "batch equals it alone bit for bit (slower)")
    group.add_argument("--no-device-sampling", action="store_true",
                       help="sample each step's logits on the host (default: on the GPU)")
    group.add_argument("--device-profile-path", metavar="FILE", default=None,
                       help="a measured device profile (JSON) whose routes override the GPU's default routing "
                            "table (rust_core/src/backend/cuda/plan/profile.rs)")
    group.add_argument("--json-schema-open-objects", action="store_true",
                       help="let a response_format json_schema's objects that do not say additionalProperties "
                            "admit keys they do not list, as JSON Schema does (default: only the listed keys, as "
                            "OpenAI reads them; a strict schema never admits others)")
    group.add_argument("--spec", metavar="METHOD", default=None,
                       help="speculative decoding: ngram (prompt lookup over the request's own tokens), mtp (the "
                            "model's mtp.* head) or dflash (a DFlash block drafter, --drafter) "
                            "(default: off)")
    group.add_argument("--draft-tokens", type=_typed("--draft-tokens", int), metavar="K", default=None,
                       help=f"draft tokens verified per step with --spec, 1..{MAX_DRAFT_TOKENS} (default 3; dflash 7, "
                            "at most the drafter's block size - 1); with --spec-adaptive the most a step drafts")
    group.add_argument("--drafter", metavar="DIR", default=None,
                       help="the DFlash drafter checkpoint --spec dflash drafts with (config.json and safetensors in "
                            "the public DFlashDraftModel layout; default for the bundled demo model: its own)")
    group.add_argument("--spec-adaptive", action="store_true",
                       help="choose each request's draft length per step, 0..--draft-tokens, from the measured step "
                            "cost and its running acceptance per draft position (0: drafting off for the request, "
                            "with a one-token probe every 16 steps)")
    group.add_argument("--lm-head-draft", action="store_true",
                       help=f"with --spec mtp: draft over the N most frequent token ids only (the model directory's "
                            f"{DRAFT_VOCAB_FILE}, made by `ninfer draft-vocab MODEL --corpus FILE...`); verification "
                            f"still uses the full vocabulary, so outputs are unchanged")
    group.add_argument("--lm-head-draft-size", type=_typed("--lm-head-draft-size", int), metavar="N", default=None,
                       help=f"N for --lm-head-draft: the first N ids of {DRAFT_VOCAB_FILE} (default "
                            f"{DEFAULT_DRAFT_VOCAB_SIZE}; a file with fewer gives all it has)")


def quantize_arg(text: str) -> str:
    """argparse type of --quantize: one of QUANTIZE_MODES; the error names the flag and the value."""
    if text not in QUANTIZE_MODES:
        raise argparse.ArgumentTypeError(f"--quantize {text!r} is not a quantization mode: give one of "
                                         f"{', '.join(QUANTIZE_MODES)}")
    return text


def add_quantize_flags(parser: argparse.ArgumentParser) -> None:
    """`--quantize` and `--quantize-lm-head` (shared with `ninfer serve`); `quantize_kwargs`."""
    group = parser.add_argument_group("quantization on load")
    group.add_argument("--quantize", type=quantize_arg, metavar="MODE", default=None,
                       help="quantize a bf16/f16 checkpoint's projection weights on load, round to nearest with "
                            "the format's scales: w8 (int8, f16 scale per 32), q4 / q5 / q6 (f16 scale per 64), "
                            "fp8 (e4m3, bf16 scale per row), nvfp4 (e2m1, e4m3 scale per 16); the CPU backend "
                            "(default: weights as stored)")
    group.add_argument("--quantize-lm-head", action="store_true",
                       help="with --quantize, quantize the lm_head too (default: kept as stored; embeddings "
                            "always are)")


def quantize_flag_error(args: argparse.Namespace) -> Optional[str]:
    """Why --quantize-lm-head is refused before anything loads, or None."""
    if args.quantize_lm_head and args.quantize is None:
        return "--quantize-lm-head needs --quantize (the format the lm_head is quantized to)"
    return None


def quantize_kwargs(args: argparse.Namespace) -> dict:
    """`add_quantize_flags`' values as the engine's keyword arguments."""
    return dict(quantize=args.quantize, quantize_lm_head=args.quantize_lm_head)


def engine_option_kwargs(args: argparse.Namespace) -> dict:
    """`add_engine_option_flags`' values as the engine's keyword arguments."""
    return dict(async_scheduling=not args.no_async_scheduling, cuda_graphs=not args.no_cuda_graphs,
                batch_invariant=args.batch_invariant, device_sampling=not args.no_device_sampling,
                device_profile=args.device_profile_path, json_schema_open_objects=args.json_schema_open_objects,
                spec=args.spec, draft_tokens=args.draft_tokens, drafter=args.drafter, spec_adaptive=args.spec_adaptive,
                lm_head_draft=args.lm_head_draft, lm_head_draft_size=args.lm_head_draft_size)


#: --spec methods; only SPEC_METHODS_RUNNING are built, the others are refused as not supported yet.
SPEC_METHODS = ("ngram", "mtp", "dflash")
SPEC_METHODS_RUNNING = ("ngram", "mtp", "dflash")
#: --draft-tokens range (rust_core/src/spec/config.rs: MAX_DRAFT_TOKENS).
MAX_DRAFT_TOKENS = 8
#: --lm-head-draft's default N (rust_core/src/spec/draft_vocab.rs: DEFAULT_DRAFT_VOCAB_SIZE); its
#: file is ninfer.draft_vocab.DRAFT_VOCAB_FILE.
DEFAULT_DRAFT_VOCAB_SIZE = 32768


def spec_flag_error(args: argparse.Namespace) -> Optional[str]:
    """Why --spec / --draft-tokens are refused before anything loads, or None (run and serve)."""
    if args.spec is not None:
        method = args.spec.strip().lower()
        if method not in SPEC_METHODS:
            return f"--spec {args.spec} is not a drafting method: give {', '.join(SPEC_METHODS_RUNNING)}"
        if method not in SPEC_METHODS_RUNNING:
            return f"--spec {args.spec} is not supported yet (only {', '.join(SPEC_METHODS_RUNNING)})"
    if args.draft_tokens is not None:
        if args.spec is None:
            return f"--draft-tokens {args.draft_tokens} needs --spec (the method that drafts them)"
        if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
            return f"--draft-tokens {args.draft_tokens} is outside 1..{MAX_DRAFT_TOKENS}"
    # `ninfer plan` has no drafting options beyond --spec / --draft-tokens.
    adaptive, head, head_size = (getattr(args, a, None) for a in ("spec_adaptive", "lm_head_draft", "lm_head_draft_size"))
    if adaptive and args.spec is None:
        return "--spec-adaptive needs --spec (the method whose draft length it adapts)"
    if head and (args.spec is None or args.spec.strip().lower() != "mtp"):
        return "--lm-head-draft needs --spec mtp (the MTP head drafts over the reduced vocabulary)"
    if head_size is not None:
        if not head:
            return "--lm-head-draft-size needs --lm-head-draft"
        if head_size < 1:
            return f"--lm-head-draft-size {head_size} must be at least 1"
    drafter = getattr(args, "drafter", None)
    if drafter is not None:
        if args.spec is None or args.spec.strip().lower() != "dflash":
            return f"--drafter {drafter} needs --spec dflash (the method that drafts with it)"
        if not os.path.isdir(drafter):
            return f"--drafter {drafter}: no such drafter directory"
    return None


def build_run_parser(prog: str = "ninfer run") -> argparse.ArgumentParser:
    """The parser of `ninfer run`."""
    p = argparse.ArgumentParser(prog=prog, description="Answer one prompt; stream the answer to stdout.",
                                formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model directory (config.json, model.safetensors, tokenizer.json); "
                        "default: the bundled demo model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt (a chat model gets it as one user message)")
    src.add_argument("--messages", metavar="FILE.json",
                     help="UTF-8 JSON: an array of chat messages, or {\"messages\": [...], \"tools\": [...]}")
    p.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    p.add_argument("--no-thinking", action="store_true", help="render the chat template with enable_thinking=false")
    p.add_argument("--thinking-budget", type=non_negative_int("--thinking-budget"), metavar="N",
                   help="close the model's reasoning after N tokens and let it answer (default: unlimited)")
    p.add_argument("--max-context", type=positive_int("--max-context"), metavar="N", help="context length (default: the model's)")
    p.add_argument("--kv-capacity", type=kv_capacity_arg, metavar="N|auto", help="KV cache tokens, or auto (default: what fits in free GPU memory on CUDA, 4 GiB on the CPU; at least max-context)")
    p.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk"), default=512, metavar="N", help="tokens per engine step")
    p.add_argument("--num-threads", type=positive_int("--num-threads"), metavar="N", help="threads of the CPU backend (default: all cores; refused on a GPU)")
    p.add_argument("--device", type=device_arg, default="auto",
                   help="auto (the GPU when present, else the CPU), cpu, cuda or cuda:N (default: auto)")
    add_logits_dtype_flag(p)
    add_kv_dtype_flag(p)
    add_engine_option_flags(p)
    add_quantize_flags(p)
    sampling = add_sampling_flags(p, "sampling", "--max-new", "argmax decoding (temperature 0)")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop string (repeatable; default: none)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
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


def _sampling_params(llm, args, flag_values: dict):
    """The model's default params with the sampling flags (`sampling_flag_values`) over them."""
    params = llm.get_default_sampling_params()
    if args.greedy:
        params.temperature = 0.0
    for field, value in flag_values.items():
        setattr(params, field, value)
    if args.max_new is not None:
        params.max_tokens = args.max_new
    params.stop = list(args.stop)
    params.ignore_eos = args.ignore_eos
    if args.thinking_budget is not None:
        params.thinking_budget = args.thinking_budget
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
    spec_error = spec_flag_error(args) or quantize_flag_error(args)
    if spec_error:
        parser.error(spec_error)
    _use_utf8_stdio()
    model = args.model or default_model_dir()
    if model is None:
        parser.error("MODEL is required (no bundled demo model in this install)")
    bad_model = model_dir_error(model)
    if bad_model:
        parser.error(bad_model)
    try:
        flag_values = sampling_flag_values(args)
    except ValueError as e:
        parser.error(str(e))
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
                  logits_dtype=args.logits_dtype, kv_dtype=args.kv_dtype, **engine_option_kwargs(args),
                  **quantize_kwargs(args))
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
        return _stream_answer(llm, ids, _sampling_params(llm, args, flag_values))
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
    spec = None
    for delta in llm.stream(ids, params):
        spec = delta.get("spec") or spec
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
    if spec:
        rate = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
        print(f"ninfer: speculation drafted {spec['drafted']}, accepted {spec['accepted']} ({rate:.0%}); "
              f"mean accepted length {spec['mean_accepted_length']:.2f} tokens per verify step"
              + (f"; mean K chosen {spec['mean_k_chosen']:.2f}" if spec.get("mean_k_chosen") is not None else ""),
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
    if argv[0] == "plan":
        from ninfer.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[0] == "draft-vocab":
        from ninfer.draft_vocab import main as draft_vocab_main

        return draft_vocab_main(argv[1:])
    return run_main(argv, prog="ninfer")


if __name__ == "__main__":
    sys.exit(main())
