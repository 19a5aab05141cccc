"""A DFlash block-diffusion drafter in PyTorch: the reference forward and the checkpoint format.

DFlash (arXiv 2602.06036) drafts a whole block of tokens in one forward. The drafter is a few
Qwen3-style decoder layers that share the target's token embedding and LM head and are
conditioned on the target's hidden states:

    ctx   = hidden_norm(fc(concat(feature[l] for l in target_layer_ids)))   # one row per
            # context position: the output of target layer l (0-based) at that position
    block = embed([anchor, mask, mask, ...])                                  # block_size rows
    each layer: q from the block; k, v from [ctx rows ; block rows] (k_proj / v_proj of the
            layer, k_norm on k, RoPE at each row's position); attention is not causal: every
            block row sees every context row and every row of its own block
    logits of the tokens after the anchor = lm_head(norm(block rows 1..block_size-1))

At inference the context holds every position the target has computed and kept (the drafter's
context K/V grows with the accepted tokens and is cut back with them), the anchor is the token
after them (the target's last output) at the next position, and one forward gives
`block_size - 1` drafts.

Checkpoint (the public `DFlashDraftModel` layout): `config.json` with Qwen3 fields
(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, rms_norm_eps, rope_theta, vocab_size) and `dflash_config`
{block_size, mask_token_id, target_layer_ids}; `model.safetensors` with `fc.weight`,
`hidden_norm.weight`, `norm.weight` and `layers.{i}.{input_layernorm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight`. Its RMSNorms
scale by `weight` (Qwen3), not by `1 + weight` (Qwen3.5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class DFlashConfig:
    """The drafter's shape and its link to the target (what `config.json` holds)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        dc = d.get("dflash_config", {})
        pick = lambda k, default=None: dc.get(k, d.get(k, default))  # noqa: E731
        rope = d.get("rope_parameters") or {}
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            target_layer_ids=list(pick("target_layer_ids")),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(pick("mask_token_id")),
            num_target_layers=d.get("num_target_layers", 0),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
        )

    def to_json(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "num_target_layers": self.num_target_layers,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        }


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: `x / rms(x) * weight`, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.c = c


class Mlp(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = Mlp(c)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x [B, heads, T, hd], pos [B, T]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos.float()[..., None] * inv  # [B, T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DFlashDrafter(nn.Module):
    """The drafter's weights under the checkpoint names, and its forward."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, features, ctx_pos, noise, q_pos, mask=None):
        """Normed drafter states of the block rows [B, Q, h].

        `features` [B, T, n*h]: the target layers' outputs at the context rows (positions
        `ctx_pos` [B, T]); `noise` [B, Q, h]: the embeddings of the block rows (positions
        `q_pos` [B, Q]); `mask` [B, Q, T + Q] (True: visible) or None for all visible.
        """
        c = self.c
        B, Q, _ = noise.shape
        T = features.shape[1]
        ctx = self.hidden_norm(self.fc(features))
        x = noise
        for layer in self.layers:
            a = layer.self_attn
            hn = layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(hn).view(B, Q, -1, c.head_dim)).transpose(1, 2)
            kv_in = torch.cat([ctx, hn], 1)
            k = a.k_norm(a.k_proj(kv_in).view(B, T + Q, -1, c.head_dim)).transpose(1, 2)
            v = a.v_proj(kv_in).view(B, T + Q, -1, c.head_dim).transpose(1, 2)
            pos = torch.cat([ctx_pos, q_pos], 1)
            q, k = rope(q, q_pos, c.rope_theta), rope(k, pos, c.rope_theta)
            rep = c.num_attention_heads // c.num_key_value_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
            x = x + a.o_proj(att.transpose(1, 2).reshape(B, Q, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    @torch.no_grad()
    def draft_logits(self, features, anchor: int, embed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Logits [block_size - 1, vocab] of the tokens after `anchor`, which sits right after
        the `T` context positions `features` [T, n*h] (positions 0..T-1)."""
        c = self.c
        T = features.shape[0]
        block = torch.tensor([anchor] + [c.mask_token_id] * (c.block_size - 1))
        noise = embed[block][None].to(features.dtype)
        ctx_pos = torch.arange(T)[None]
        q_pos = torch.arange(T, T + c.block_size)[None]
        out = self.forward(features[None], ctx_pos, noise, q_pos)
        return out[0, 1:] @ lm_head.T.to(out.dtype)

    def save(self, out_dir: Path, dtype=torch.bfloat16) -> int:
        """Write config.json and model.safetensors; returns the safetensors size in bytes."""
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(self.c.to_json(), indent=2) + "\n")
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return (out_dir / "model.safetensors").stat().st_size

    @classmethod
    def load(cls, d: Path) -> "DFlashDrafter":
        from safetensors.torch import load_file

        c = DFlashConfig.from_json(json.loads((Path(d) / "config.json").read_text()))
        m = cls(c)
        m.load_state_dict({k: v.float() for k, v in load_file(str(Path(d) / "model.safetensors")).items()})
        return m.float().eval()


def target_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """The context feature of transformers' `output_hidden_states`: entry `l + 1` is the
    output of layer `l` (the last entry is after the model's final norm)."""
    return torch.cat([hidden_states[l + 1] for l in layer_ids], -1)
