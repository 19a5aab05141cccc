"""Diagnostic: GPU logits of a random Llama-3-8B-shape model (2 layers) against transformers, per
position, through the three prefill paths (whole: flash attention + cuBLAS; chunks of 8; token by
token: decode attention + GEMV). It showed that the real-shape parity test's reference was built
with `.to(bfloat16)`, which rounds transformers' rotary inv_freq buffer: the error was the same on
every path and grew with the position. Record: benches/results/diag_rotary_reference_555f6f7.log.
Run on the GPU machine with ninfer installed: python3 benches/diag_rotary_reference.py
"""
import json, sys, tempfile, copy, time
from pathlib import Path
import numpy as np, torch, transformers
from ninfer import _core
t0 = time.time()
cfg = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
with torch.device("cuda"):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16).eval()
d = Path(tempfile.mkdtemp())
hf.save_pretrained(d)
(d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
ids = [int(t) for t in np.random.RandomState(5).randint(3, 128256, size=64)]
x = torch.tensor([ids], device="cuda")
with torch.no_grad():
    b16 = hf(x).logits[0].float().cpu().numpy()
    f32 = copy.deepcopy(hf).float()(x).logits[0].float().cpu().numpy()
def rel(a, b): return float(np.abs(a - b).max() / np.abs(b).max())
def per_pos(a, b): return [round(float(v), 3) for v in (np.abs(a - b).max(-1) / np.abs(b).max())[[0, 1, 2, 8, 16, 32, 63]]]
m = _core.Model(str(d), device="cuda")
for label, kw in (("whole (flash, cuBLAS)", {}), ("chunk 1 (decode attention, GEMV)", {"chunk": 1}), ("chunk 8", {"chunk": 8})):
    g = m.logits(ids, **kw)
    print(f"{label}: vs f32 {rel(g, f32):.3e}, vs bf16 {rel(g, b16):.3e}; per position vs f32 {per_pos(g, f32)}", flush=True)
print(f"hf bf16 vs f32 {rel(b16, f32):.3e}; per position {per_pos(b16, f32)}")
print(f"max |logit| {np.abs(f32).max():.2f}; {time.time() - t0:.0f} s")
