"""Diagnostic: why 64 greedy tokens of the demo model differ from transformers bf16 on some prompts.
Teacher-forced along transformers' own greedy continuation, it compares transformers' choice at each
step with ours taken three ways: argmax of our f32 logits, argmax of our logits rounded to bf16
(transformers' lm_head returns bf16 logits; torch.argmax takes the lowest index among equal values),
and argmax through the decode path (chunk=1: GEMV + decode attention, what generation runs). A
prompt counts as equal when every one of its 64 steps agrees.
Run on the GPU machine with ninfer installed: python3 benches/diag_greedy_ties.py
"""
import json
from pathlib import Path

import numpy as np
import torch
import transformers

import ninfer
from ninfer import _core

DEMO = Path(ninfer.__file__).parent / "demo"
STEPS = 64


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16, kept as f32 (what a bf16 lm_head output holds)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def main() -> None:
    seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    windows = [seq[i:i + 24] for seq in seqs for i in (0, 300, 600)][:20]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO / "model"), dtype=torch.bfloat16).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    ours = _core.Model(str(DEMO / "model"), device="cuda")
    equal = {"f32": 0, "bf16-rounded": 0, "decode path f32": 0, "decode path bf16-rounded": 0}
    for w in windows:
        with torch.no_grad():
            r = hf.generate(torch.tensor([w], device="cuda"), attention_mask=torch.ones(1, len(w), dtype=torch.long, device="cuda"),
                            do_sample=False, max_new_tokens=STEPS, min_new_tokens=0, pad_token_id=0)
        ref = r[0, len(w):].tolist()
        ids = w + ref[:-1]
        rows = slice(len(w) - 1, len(w) - 1 + STEPS)
        whole = ours.logits(ids)[rows]
        step = ours.logits(ids, chunk=1)[rows]
        line = []
        for name, lg in (("f32", whole), ("bf16-rounded", bf16_round(whole)), ("decode path f32", step),
                         ("decode path bf16-rounded", bf16_round(step))):
            pick = lg.argmax(-1)
            bad = np.nonzero(pick != np.array(ref))[0]
            if len(bad) == 0:
                equal[name] += 1
                line.append(f"{name}: equal")
            else:
                t = int(bad[0])
                top2 = np.sort(whole[t])[-2:]
                line.append(f"{name}: step {t} (ours {pick[t]} vs {ref[t]}, f32 top-2 gap {top2[1] - top2[0]:.4f})")
        print("; ".join(line), flush=True)
    print(f"prompts equal over {STEPS} teacher-forced steps (of {len(windows)}): {equal}")


if __name__ == "__main__":
    main()
