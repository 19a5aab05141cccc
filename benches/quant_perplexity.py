"""Perplexity of the bundled demo model on its held-out windows: the bf16 weights as shipped
against every `--quantize` mode and GGUF Q8_0 applied to the same projections.

Every run scores all held-out windows (python/ninfer/demo/heldout_tokens.json: CPython files never
trained on), each from an empty state, with float32 logits on the CPU backend; perplexity is
exp(mean NLL of tokens 1..L-1 of each window given its prefix), as the recorded figure is computed.
`--quantize` modes quantize the projection weights on load (embeddings and the tied lm_head stay
bf16); GGUF Q8_0 blocks come from the `gguf` package's own quantizer and are handed to the model
as packed tensors (`_core.Model(quant_tensors=...)`). Targets: W8, FP8 and Q6 within 1% of bf16,
the 4-bit formats within 10%. The record goes to benches/results/quant_perplexity.json.

    .ci/dev-build && PYTHONPATH=python python benches/quant_perplexity.py

`--device cuda` scores what the CUDA backend loads (every mode and the handed-in GGUF Q8_0) with the
same windows; the record goes to
benches/results/quant_perplexity_cuda.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benches"))

from cpu_decode import cpu_name, git_commit  # noqa: E402

DEMO = REPO / "python" / "ninfer" / "demo"
MODEL = DEMO / "model"

#: --quantize modes with their format names and the relative perplexity bound the issue sets.
MODES = {"w8": ("W8G32_F16S", 0.01), "fp8": ("FP8_E4M3FN_ROW_BF16S", 0.01), "q6": ("Q6G64_F16S", 0.01),
         "q5": ("Q5G64_F16S", 0.10), "q4": ("Q4G64_F16S", 0.10), "nvfp4": ("NVFP4", 0.10)}



def device_name(device: str) -> str:
    """The GPU's name as torch reports it (the record's device line)."""
    import torch

    index = int(device.split(":")[1]) if ":" in device else 0
    return torch.cuda.get_device_name(index)


def perplexity(model, windows) -> float:
    """The demo's held-out perplexity (`ninfer.demo.perplexity`) of `model` over `windows`."""
    from ninfer.demo import perplexity as pooled

    return pooled([model.logits(ids) for ids in windows], windows)


def projection_names(model_dir: Path) -> list:
    """The checkpoint tensors `--quantize` quantizes: every projection weight but the lm_head."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    return sorted(n for n in names if n.endswith("_proj.weight") or ".in_proj_" in n or n == "mtp.fc.weight")


def gguf_q8_0_tensors(model_dir: Path) -> dict:
    """The projections as GGUF Q8_0 blocks quantized by the `gguf` package: `quant_tensors`."""
    import gguf
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in projection_names(model_dir):
            w = f.get_tensor(name).to(torch.float32).numpy()
            blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            out[name] = ("GGUF_Q8_0", blocks.tobytes(), tuple(w.shape))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--windows", type=int, default=None, help="score only the first N windows (default: all)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    p.add_argument("--out", type=Path, default=None, help="default: benches/results/quant_perplexity.json (quant_perplexity_cuda.json on a GPU)")
    args = p.parse_args(argv)
    gpu = args.device != "cpu"
    if args.out is None:
        args.out = REPO / "benches" / "results" / ("quant_perplexity_cuda.json" if gpu else "quant_perplexity.json")
    if gpu and args.threads is not None:
        p.error("--threads sets the CPU backend's threads; leave it out with --device cuda")
    from ninfer import _core

    data = json.loads((DEMO / "heldout_tokens.json").read_text())
    windows = data["sequences"][: args.windows]
    runs = []

    def measure(weights: str, fmt: str, bound, **kwargs):
        t0 = time.perf_counter()
        model = _core.Model(str(MODEL), device=args.device, num_threads=args.threads, logits_dtype="float32", **kwargs)
        ppl = perplexity(model, windows)
        row = dict(weights=weights, format=fmt, perplexity=round(ppl, 4), seconds=round(time.perf_counter() - t0, 1))
        if runs:
            base = runs[0]["perplexity"]
            row["relative_to_bf16"] = round(ppl / base - 1.0, 5)
            row["bound"] = bound
            row["within_bound"] = abs(ppl / base - 1.0) <= bound
        runs.append(row)
        print(json.dumps(row), flush=True)

    measure("bf16", "bf16 (as shipped)", None)
    for mode, (fmt, bound) in MODES.items():
        measure(f"--quantize {mode}", fmt, bound, quantize=mode)
    measure("GGUF Q8_0 (gguf package quantizer)", "GGUF_Q8_0", 0.01, quant_tensors=gguf_q8_0_tensors(MODEL))
    record = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "device": device_name(args.device) if gpu else f"{cpu_name()} ({args.threads or os.cpu_count()} threads)",
        "command": "python benches/quant_perplexity.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        "model": "bundled demo model (python/ninfer/demo/model, Qwen3.5 hybrid, 10.1M params, bf16)",
        "metric": f"held-out perplexity, float32 logits, {'CUDA' if gpu else 'CPU'} backend",
        "value": runs[0]["perplexity"],
        "weights": "bf16",
        "windows": f"{len(windows)} x {len(windows[0])} tokens",
        "tokens_scored": sum(len(w) - 1 for w in windows),
        "recorded_bf16_perplexity": data["perplexity"],
        "scope": "projection weights (attention, Gated DeltaNet, MLP, MTP head); embeddings and the tied lm_head bf16",
        "runs": runs,
        "all_within_bounds": all(r.get("within_bound", True) for r in runs),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if record["all_within_bounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
