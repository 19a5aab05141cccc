"""Tiny random HF checkpoints for tests, written with transformers' own `save_pretrained`.

Sizes are deliberately not powers of two, attention is grouped (GQA ratio > 1), and every
norm weight, bias and Gated DeltaNet parameter is moved away from its init value, so that a bug
in any of those paths changes the logits. Seeded: the same call writes the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHS = ("llama", "llama_tied", "qwen2", "qwen3", "qwen3_5", "qwen3_5_vl")


def _base(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=72,
        intermediate_size=136,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _qwen3_5_text(vocab: int) -> dict:
    c = _base(vocab)
    c.update(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=12,
        linear_value_head_dim=10,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 1], "mrope_interleaved": True},
    )
    return c


def _build(arch: str, overrides: dict):
    import torch
    import transformers as tf

    vocab = overrides.pop("vocab_size", 397)
    if arch in ("llama", "llama_tied"):
        c = _base(vocab)
        c.update(tie_word_embeddings=(arch == "llama_tied"))
        c.update(overrides)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**c))
    if arch == "qwen2":
        c = _base(vocab)
        c.update(overrides)
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**c))
    if arch == "qwen3":
        c = _base(vocab)
        c.update(head_dim=20, num_key_value_heads=3)
        c.update(overrides)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**c))
    if arch == "qwen3_5":
        c = _qwen3_5_text(vocab)
        c.update(overrides)
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**c))
    if arch == "qwen3_5_vl":
        text = _qwen3_5_text(vocab)
        text.update(overrides)
        vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                      num_position_embeddings=16)
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=vocab - 3,
                               video_token_id=vocab - 4, vision_start_token_id=vocab - 5,
                               vision_end_token_id=vocab - 6)
        return tf.Qwen3_5ForConditionalGeneration(cfg)
    raise ValueError(f"unknown tiny arch {arch!r}; known: {ARCHS}")


def _perturb(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=g))


def make_model(path, arch: str, *, seed: int = 0, sharded: bool = False, **overrides) -> Path:
    """Write a tiny random `arch` checkpoint (config.json, safetensors, generation_config.json)
    to `path` and return it. `overrides` replace (text) config fields."""
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _build(arch, dict(overrides)).to(torch.float32).eval()
    _perturb(model, seed)
    kwargs = {"max_shard_size": "300KB"} if sharded else {}
    model.save_pretrained(path, **kwargs)
    gen = path / "generation_config.json"
    if not gen.exists():
        gen.write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


def load_reference(path):
    """The transformers model of a tiny checkpoint, f32, eval mode (the oracle)."""
    import torch
    import transformers as tf

    cfg = json.loads((Path(path) / "config.json").read_text())
    arch = cfg["architectures"][0]
    cls = getattr(tf, arch)
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def add_mtp_head(path, *, seed: int = 0) -> Path:
    """Give a tiny Qwen3.5 checkpoint a random MTP head under the names Qwen3.5 checkpoints use
    (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` a
    gated full-attention layer, `mtp.norm`) and declare it (`mtp_num_hidden_layers: 1`).
    transformers neither builds nor saves `mtp.*`, so the tensors are appended by hand."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    g = torch.Generator().manual_seed(seed + 101)

    def weight(*shape, scale=0.08):
        return torch.randn(shape, generator=g) * scale

    def norm(dim):
        return torch.randn(dim, generator=g) * 0.3  # zero-centred: applied as 1 + w

    tensors = load_file(path / "model.safetensors")
    layer = "mtp.layers.0."
    tensors.update({
        "mtp.fc.weight": weight(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": norm(hidden),
        "mtp.pre_fc_norm_hidden.weight": norm(hidden),
        "mtp.norm.weight": norm(hidden),
        layer + "input_layernorm.weight": norm(hidden),
        layer + "post_attention_layernorm.weight": norm(hidden),
        layer + "self_attn.q_proj.weight": weight(2 * heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": norm(head_dim),
        layer + "self_attn.k_norm.weight": norm(head_dim),
        layer + "mlp.gate_proj.weight": weight(inter, hidden),
        layer + "mlp.up_proj.weight": weight(inter, hidden),
        layer + "mlp.down_proj.weight": weight(hidden, inter),
    })
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
