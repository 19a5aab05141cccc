"""Record the demo model's greedy completions, computed by the oracle (transformers, CPU, f32).

    python tools/demo/greedy_sample.py [--prompt TEXT] [--max-new-tokens N]

The completions go into training_record.json under "greedy_samples" (text and token ids), so the
model card can quote them and ninfer's own greedy decoding has a reference to compare with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
MODEL_DIR = TOOLS_DIR.parents[1] / "python" / "ninfer" / "demo" / "model"
"""The shipped model: the package's copy in this checkout."""
DEFAULT_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef list_python_files(root):\n")


def greedy_completion(model_dir: Path, prompt: str, max_new_tokens: int) -> dict:
    """Greedy continuation of `prompt` (stops at <|endoftext|> or <|im_end|>)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    new = out[0, ids.shape[1]:].tolist()
    finished = bool(new) and new[-1] in eos
    return {
        "prompt_token_ids": ids[0].tolist(),
        "completion_token_ids": new,
        "completion": tok.decode(new, skip_special_tokens=True),
        "finish_reason": "stop" if finished else "length",
        "max_new_tokens": max_new_tokens,
    }


def main(argv=None) -> None:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", action="append", help="prompt(s) to complete (default: the card's)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    args = p.parse_args(argv)
    record_path = TOOLS_DIR / "training_record.json"
    record = json.loads(record_path.read_text())
    samples = record.setdefault("greedy_samples", {})
    for prompt in args.prompt or DEFAULT_PROMPTS:
        sample = greedy_completion(MODEL_DIR, prompt, args.max_new_tokens)
        sample["computed_by"] = f"transformers {transformers.__version__}, CPU, float32"
        samples[prompt] = sample
        print(prompt + sample["completion"], "\n---", sample["finish_reason"], flush=True)
    record_path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
