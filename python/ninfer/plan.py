"""`ninfer plan`: the memory ledger of a model on a device, without loading its weights.

The arithmetic is the engine's own (rust_core/src/plan, `_core.plan`): the weights by format
from config.json and the safetensors headers (a directory with config.json alone is counted from
the config's shapes), the KV pool, the recurrent-state slots, a step-workspace estimate and the
device reserve, against `--gpu-memory` or the memory of `--device`. Exit status: 0 when the
settings fit, 1 when they do not (with the bytes short and what would fit), 2 on a bad flag or
settings the loader would refuse (for a GPU, the CUDA loader's own checks run on the shapes
and headers: a fused projection it cannot hold, a quantized shape its kernels cannot run; with
`--device`, on an f16-storage GPU (sm_7x) also a stored FP8 / NVFP4 weight whose scales exceed
binary16's range, read from the scales alone. `--gpu-memory` names no architecture, so that
refusal is left to the load).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import List, Optional

from ninfer.cli import (HelpFormatter, MAX_DRAFT_TOKENS, kv_capacity_arg, kv_dtype_error, model_dir_error,
                        positive_int, spec_flag_error, _typed)
from ninfer.ledger import format_ledger

#: --quantize formats (rust_core/src/quant QUANTIZE_MODES, exported as
#: `_core.QUANTIZE_FORMATS`; tests/test_plan.py compares this copy, kept so `--help` needs no core).
QUANTIZE_FORMATS = ("w8", "q4", "q5", "q6", "fp8", "nvfp4")

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_size(text: str) -> int:
    """Bytes of a size such as 32GiB, 32GB, 24000MiB or 1.5TB (a unit is required: B, KB, MB,
    GB, TB in powers of 1000, KiB, MiB, GiB, TiB in powers of 1024); ValueError naming the value."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r} is not a size: give a number and a unit, e.g. 32GiB, 32GB, "
                         f"24000MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"--gpu-memory {text!r} must be more than 0 bytes")
    return n


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _quantize_arg(text: str) -> str:
    name = text.strip().lower()
    if name not in QUANTIZE_FORMATS:
        raise argparse.ArgumentTypeError(f"--quantize {text!r} is not a weight format: give one of "
                                         f"{', '.join(QUANTIZE_FORMATS)}")
    return name


def _device_arg(text: str) -> str:
    if not re.match(r"^(cpu|cuda(:\d+)?)$", text.strip().lower()):
        raise argparse.ArgumentTypeError(f"--device {text!r} is not a device (expected cpu, cuda or cuda:N)")
    return text.strip().lower()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer plan", formatter_class=HelpFormatter,
                                description="Print the memory ledger of MODEL on a device (weights by format, KV "
                                            "pool, recurrent state, workspace, reserve) and the largest context and "
                                            "concurrency that fit, without loading the weights. Exits 0 when the "
                                            "settings fit, 1 when they do not.")
    p.add_argument("model", metavar="MODEL", help="model directory (config.json, with or without *.safetensors)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpu-memory", type=_size_arg, metavar="SIZE",
                       help="plan for a GPU with this much memory, e.g. 32GiB, 32GB, 24000MiB")
    where.add_argument("--device", type=_device_arg, metavar="DEVICE",
                       help="plan for this device's free memory: cuda, cuda:N (asks the GPU) or cpu (the host's "
                            "available memory, f32 weights) (default: GPU 0 when there is one)")
    p.add_argument("--max-context", type=positive_int("--max-context"), metavar="N",
                   help="context length of each sequence (default: the model's)")
    p.add_argument("--max-concurrency", type=positive_int("--max-concurrency"), default=1, metavar="N",
                   help="sequences that can each reach --max-context at once")
    p.add_argument("--kv-capacity", type=kv_capacity_arg, metavar="N|auto",
                   help="KV pool tokens (default: --max-concurrency full contexts)")
    p.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk"), default=512, metavar="N",
                   help="tokens per engine step (sizes the workspace)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="no prefix cache (hybrid models then keep no state snapshots)")
    p.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                   help="KV cache type: auto, or the backend's own by name (bf16 on a GPU, f16 on sm_7x, "
                        "float32 on the CPU)")
    p.add_argument("--quantize", type=_quantize_arg, metavar="FORMAT",
                   help=f"plan the projections in a quantized format ({'|'.join(QUANTIZE_FORMATS)}), as the "
                        "loader's --quantize packs them (a matrix the format cannot hold stays dense); the LM head "
                        "and embedding stay dense (bf16 on a GPU, f32 on the CPU)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantize, the LM head in that format too; the embedding stays dense and a tied "
                        "head is held as a quantized copy (CPU and GPU)")
    p.add_argument("--spec", metavar="METHOD", default=None,
                   help="speculative decoding to plan for: ngram, mtp (the MTP head's weights and KV) or dflash "
                        "(the drafter's weights and context, with --drafter); each sizes the verify steps' buffers")
    p.add_argument("--draft-tokens", type=_typed("--draft-tokens", int), metavar="K", default=None,
                   help=f"draft tokens per step with --spec, 1..{MAX_DRAFT_TOKENS} (sizes the rollback slots only)")
    p.add_argument("--drafter", metavar="DIR", default=None,
                   help="the DFlash drafter checkpoint --spec dflash loads beside the model (its config.json and "
                        "safetensors headers are read, no weights; default: the demo's own for the demo model)")
    return p


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def format_plan(p: dict, model: str) -> str:
    """The plan as text: the ledger lines `ninfer run` prints at startup (same numbers), the
    weights by format, the reserve and the verdict."""
    where = "config.json only: weights counted from its shapes" if p["config_only"] else "weights counted from the safetensors headers"
    ledger = format_ledger(p, plan=True).splitlines()
    # The weights by format go under the ledger's weights line.
    at = next(i for i, line in enumerate(ledger) if line.strip().startswith("weights")) + 1
    ledger[at:at] = [f"    {w['format']:<21} {_mib(w['bytes'])} ({w['tensors']} tensors)" for w in p["weights"]]
    dequant, lt = p.get("workspace_dequant_bytes", 0), p.get("workspace_cublaslt_bytes", 0)
    if dequant or lt:
        at = next(i for i, line in enumerate(ledger) if line.strip().startswith("workspace")) + 1
        ledger[at:at] = [f"    step buffers {_mib(p['workspace_bytes'] - dequant - lt)}, dequantization {_mib(dequant)}, "
                         f"cuBLASLt {_mib(lt)}"]
    lines = [f"ninfer plan: {model} ({where})", *ledger]
    if p["target"] == "gpu":
        lines.append(f"  reserve        {_mib(p['reserve_bytes'])} (kept free: 5% of the GPU, at least 1 GiB)")
    lines.append(f"  needed         {_mib(p['needed_bytes'])} ({p['needed_bytes']:,} B)")
    if "fits" not in p:
        lines.append("  available      unknown (this system does not say how much memory is free)")
        return "\n".join(lines)
    lines.append(f"  available      {_mib(p['available_bytes'])} ({p['available_bytes']:,} B)")
    ctx, conc = p["max_context"], p["max_concurrency"]
    if p["fits"]:
        lines.append(f"fits: --max-context {ctx} at --max-concurrency {conc}, "
                     f"{_mib(p['available_bytes'] - p['needed_bytes'])} to spare")
    else:
        lines.append(f"does not fit: short by {p['short_bytes']:,} B ({_mib(p['short_bytes'])}) for --max-context {ctx} "
                     f"at --max-concurrency {conc}")
    lines.append(f"largest --max-context at --max-concurrency {conc}: {p['largest_context']:,} tokens"
                 + (f" (the model's own is {p['model_max_context']:,})" if p["model_max_context"] else ""))
    lines.append(f"largest --max-concurrency at --max-context {ctx}: {p['largest_concurrency']:,}")
    if not p["fits"]:
        lines.append(f"what fits: {p['hint']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for error in (kv_dtype_error(args.kv_dtype), spec_flag_error(args), model_dir_error(args.model)):
        if error:
            parser.error(error)
    if args.quantize_lm_head and args.quantize is None:
        parser.error("--quantize-lm-head needs --quantize (the format to store the LM head and embedding in)")
    if args.kv_capacity is not None and args.max_context is not None and args.kv_capacity < args.max_context:
        parser.error(f"--kv-capacity {args.kv_capacity} must be >= --max-context {args.max_context}")

    from ninfer import _core
    from ninfer.demo import default_drafter

    try:
        p = _core.plan(args.model, device=args.device, gpu_memory=args.gpu_memory, max_context=args.max_context,
                       kv_capacity=args.kv_capacity, max_concurrency=args.max_concurrency,
                       prefill_chunk=args.prefill_chunk, prefix_reuse=not args.no_prefix_reuse,
                       kv_dtype=args.kv_dtype, quantize=args.quantize, quantize_lm_head=args.quantize_lm_head,
                       spec=args.spec, draft_tokens=args.draft_tokens, drafter=default_drafter(args.model, args.spec, args.drafter))
    except _core.NinferError as e:
        print(f"ninfer plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(p, args.model))
    return 0 if p.get("fits", True) else 1


if __name__ == "__main__":
    sys.exit(main())
