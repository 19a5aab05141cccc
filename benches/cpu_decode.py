"""CPU decode speed, batch 1: ninfer (LLM) against transformers (torch CPU) on the same model.

A random ~50M-parameter Llama is saved with `save_pretrained`; both engines decode 128 greedy
tokens from the same prompt with the same thread count, alternating A-B-A-B with idle gaps.
Decode tok/s is measured the same way on both sides: (new tokens - 1) over the time from the
first generated token to the last, so prefill is excluded. The median of the repeats and the
ratio go to benches/results/cpu_decode.json with the commit, the CPU and the command.

    .ci/dev-build --release && PYTHONPATH=python python benches/cpu_decode.py
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The benchmark model: Llama shapes, ~50M parameters (untied embeddings, GQA 2:1).
MODEL_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=24000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)


def make_model(path: Path) -> int:
    """Save the random benchmark Llama to `path` (once); return its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        config = LlamaConfig.from_pretrained(str(path))
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL_CONFIG, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's answer elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """HEAD of this checkout, with -dirty when the tree has changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ninfer_decode(llm, prompt, new_tokens):
    """(decode tok/s, generated ids) for one ninfer run, timed from the first token to the last."""
    from ninfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t_first = None
    ids = []
    for delta in llm.stream(prompt, params):
        if delta["token_ids"] and t_first is None:
            t_first = time.perf_counter()
        ids += delta["token_ids"]
    t_end = time.perf_counter()
    return (len(ids) - 1) / (t_end - t_first), ids


class _TokenClock:
    """A transformers streamer that timestamps the first and last generated tokens."""

    def __init__(self):
        self.calls = 0
        self.t_first = None
        self.t_last = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.t_first = time.perf_counter()
        self.t_last = time.perf_counter()

    def end(self):
        pass


def hf_decode(model, prompt, new_tokens):
    """(decode tok/s, generated ids) for one transformers run, timed like `ninfer_decode`."""
    import torch

    clock = _TokenClock()
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=0, pad_token_id=0, streamer=clock)
    ids = out[0, len(prompt):].tolist()
    return (len(ids) - 1) / (clock.t_last - clock.t_first), ids


def main(argv=None) -> int:
    """Run the benchmark and write the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/ninfer_bench/llama50m"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gap-s", type=float, default=2.0, help="idle time between runs")
    p.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "cpu_decode.json")
    args = p.parse_args(argv)

    # Passive OpenMP waits: on a shared, oversubscribed machine torch's default spin-waiting
    # makes 2 threads ~10x slower than 1, which would flatter us; this keeps the peer honest.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import transformers

    from ninfer import LLM

    torch.set_num_threads(args.threads)
    n_params = make_model(args.model_dir)
    prompt = [(7 + 131 * i) % MODEL_CONFIG["vocab_size"] for i in range(args.prompt_tokens)]

    llm = LLM(args.model_dir, max_context=1024, num_threads=args.threads, max_concurrency=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None
    ninfer_decode(llm, prompt, 8)
    hf_decode(hf, prompt, 8)

    load_before = os.getloadavg()
    ours, peers, peers_1t = [], [], []
    ours_ids = peer_ids = None
    for r in range(args.repeats):
        time.sleep(args.gap_s)
        rate, ours_ids = ninfer_decode(llm, prompt, args.new_tokens)
        ours.append(rate)
        time.sleep(args.gap_s)
        rate, peer_ids = hf_decode(hf, prompt, args.new_tokens)
        peers.append(rate)
        time.sleep(args.gap_s)
        torch.set_num_threads(1)
        peers_1t.append(hf_decode(hf, prompt, args.new_tokens)[0])
        torch.set_num_threads(args.threads)
        print(f"repeat {r}: ninfer {ours[-1]:.1f} tok/s, transformers {peers[-1]:.1f} tok/s "
              f"({peers_1t[-1]:.1f} tok/s on 1 thread)", file=sys.stderr)
    load_after = os.getloadavg()

    value, peer_value = statistics.median(ours), statistics.median(peers)
    record = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{cpu_name()} ({args.threads} threads)",
        "command": " ".join(["python", "benches/cpu_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": f"random Llama {n_params / 1e6:.1f}M params f32 "
                 + ", ".join(f"{k}={v}" for k, v in MODEL_CONFIG.items()),
        "metric": f"decode tok/s, batch 1, greedy, {args.new_tokens} new tokens after a "
                  f"{args.prompt_tokens}-token prompt (median of {args.repeats}, A-B alternating)",
        "value": round(value, 2),
        "peer": f"transformers {transformers.__version__} generate, torch {torch.__version__} CPU",
        "peer_value": round(peer_value, 2),
        "ratio": round(value / peer_value, 3),
        "runs": {"ninfer": [round(x, 2) for x in ours], "transformers": [round(x, 2) for x in peers],
                 "transformers_1_thread": [round(x, 2) for x in peers_1t]},
        "peer_1_thread_value": round(statistics.median(peers_1t), 2),
        "ratio_vs_best_peer": round(value / max(peer_value, statistics.median(peers_1t)), 3),
        "peer_env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(load_after[0], 2),
                              "cores": os.cpu_count()},
        "outputs_equal": ours_ids == peer_ids,
        "output_sha256": {
            "ninfer": hashlib.sha256(json.dumps(ours_ids).encode()).hexdigest()[:16],
            "transformers": hashlib.sha256(json.dumps(peer_ids).encode()).hexdigest()[:16],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(record, indent=2))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
