"""Regenerate rust_core/tests/fixtures/gdn_golden.json from transformers (the GDN oracle).

Runs transformers' own Qwen3.5 GDN reference functions (torch_chunk_gated_delta_rule,
causal_conv1d_fn, Qwen3_5RMSNormGated) on small seeded inputs and writes inputs and outputs
to JSON, which rust_core/tests/gdn.rs compares the CPU kernels against.

Usage: python tests/gdn_golden.py
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated,
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
)

OUT = Path(__file__).resolve().parent.parent / "rust_core" / "tests" / "fixtures" / "gdn_golden.json"


def rounded(shape, gen, scale=1.0):
    """Random values rounded to 4 decimals, so the JSON holds the exact inputs."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    return torch.round(x * 1e4).div(1e4).to(torch.float32)


def flat(x, digits=7):
    """Values as short decimals: 7 digits recover the 4-decimal inputs exactly and keep outputs
    within 1e-7; computed inputs (g, beta) use 9 digits, which round-trip f32 exactly."""
    return [float(f"{v:.{digits}g}") for v in x.detach().to(torch.float32).reshape(-1).tolist()]


def delta_rule_case(gen, t, nk, nv, kd, vd):
    q = rounded((1, t, nk, kd), gen)
    k = rounded((1, t, nk, kd), gen)
    v = rounded((1, t, nv, vd), gen)
    a = rounded((1, t, nv), gen)
    dt_bias = rounded((nv,), gen)
    a_log = rounded((nv,), gen, 0.5)
    g = (-a_log.exp() * F.softplus(a + dt_bias)).to(torch.float32)
    beta = rounded((1, t, nv), gen, 2.0).sigmoid()
    state0 = rounded((1, nv, kd, vd), gen, 0.5)
    out, state1 = torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, chunk_size=64, initial_state=state0.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return {
        "t": t, "num_k_heads": nk, "num_v_heads": nv, "k_dim": kd, "v_dim": vd,
        "q": flat(q), "k": flat(k), "v": flat(v), "g": flat(g, 9), "beta": flat(beta, 9),
        "initial_state": flat(state0), "out": flat(out), "final_state": flat(state1),
    }


def conv_case(gen, t, c, kernel, with_bias):
    x = rounded((1, c, t), gen)
    weight = rounded((c, kernel), gen, 0.5)
    bias = rounded((c,), gen) if with_bias else None
    out = causal_conv1d_fn(x, weight, bias, activation="silu")
    return {
        "t": t, "c": c, "k": kernel,
        "x": flat(x[0].transpose(0, 1)), "weight": flat(weight),
        "bias": flat(bias) if bias is not None else None,
        "out": flat(out[0].transpose(0, 1)),
    }


def gated_norm_case(gen, rows, v_dim, eps):
    x = rounded((rows, v_dim), gen)
    z = rounded((rows, v_dim), gen)
    norm = Qwen3_5RMSNormGated(v_dim, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(rounded((v_dim,), gen, 0.5) + 1.0)
    out = norm(x, z)
    return {
        "rows": rows, "v_dim": v_dim, "eps": eps, "x": flat(x), "z": flat(z),
        "weight": flat(norm.weight), "out": flat(out),
    }


def main():
    gen = torch.Generator().manual_seed(20261129)
    golden = {
        "delta_rule": [
            delta_rule_case(gen, t=84, nk=2, nv=4, kd=4, vd=2),
            delta_rule_case(gen, t=20, nk=1, nv=1, kd=6, vd=5),
        ],
        "conv1d": [
            conv_case(gen, t=9, c=5, kernel=4, with_bias=False),
            conv_case(gen, t=2, c=3, kernel=4, with_bias=True),
        ],
        "rms_norm_gated": [gated_norm_case(gen, rows=4, v_dim=8, eps=1e-6)],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
