"""transformers against itself on random weights: greedy decoding of the same bf16 model with
its eager and its sdpa attention (the two differ only in how attention sums), 10 prompts of 16
random tokens, 64 new tokens each; prints how many prompts keep all 64 tokens equal and where
each first differs. Why: the issue-4 criterion (95% of prompts equal to transformers over 64
tokens) on random weights, whose next-token distributions are nearly flat, measures bit
identity to transformers' kernels; this shows how far two transformers paths get.

    python benches/diag_greedy_self.py            # CPU (torch's bf16 CPU kernels)
    python benches/diag_greedy_self.py --device cuda
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512),
    "llama-wide": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=4096),
}


def first_difference(a: list, b: list) -> int:
    return next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    torch.manual_seed(0)
    for name, shape in SHAPES.items():
        cfg = LlamaConfig(max_position_embeddings=512, **shape)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16).to(a.device).eval()
        g = torch.Generator().manual_seed(1)
        lens = []
        for _ in range(a.prompts):
            ids = torch.randint(3, cfg.vocab_size, (1, 16), generator=g).to(a.device)
            outs = []
            for impl in ("eager", "sdpa"):
                m.config._attn_implementation = impl
                with torch.no_grad():
                    o = m.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False, pad_token_id=0)
                outs.append(o[0, ids.shape[1]:].tolist())
            lens.append(first_difference(*outs))
        same = sum(k == a.tokens for k in lens)
        print(f"{name} on {a.device}, bf16, transformers {transformers.__version__}, torch {torch.__version__}: eager vs sdpa "
              f"{same}/{a.prompts} prompts equal over {a.tokens} tokens; tokens before the first difference {lens}", flush=True)


if __name__ == "__main__":
    main()
