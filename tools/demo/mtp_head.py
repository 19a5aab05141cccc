"""The demo model's multi-token-prediction (MTP) head, in Qwen3-Next / Qwen3.5 weight naming.

transformers has no MTP module for Qwen3.5 (it ignores `mtp.*` weights when loading), but the
speculative-decoding work in ninfer needs a trained head to draft with. This module defines it
with the parameter names public Qwen3.5 checkpoints use, so that the saved tensors
(`mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.layers.0.*`, `mtp.norm.weight`) load in ninfer exactly as a real checkpoint's would.

Math, for a position t of the main model:
    e = pre_fc_norm_embedding(embed_tokens(token[t+1]))
    h = pre_fc_norm_hidden(final_hidden[t])          # final_hidden is after the model's norm
    x = fc(concat(e, h))                              # [2*hidden] -> [hidden]
    x = layers[0](x)                                  # a full-attention decoder layer, causal
                                                      # over the MTP inputs of the sequence
    logits_for_token[t+2] = lm_head(norm(x))          # lm_head shared with the main model
All norms are the model's zero-centred RMSNorm (scale 1 + weight).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class MtpHead(nn.Module):
    """One MTP block predicting token t+2 from the main model's state at t and token t+1."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
        )

        hidden = config.hidden_size
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        layer_config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=config.initializer_range)

    def forward(
        self,
        final_hidden: torch.Tensor,
        next_token_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Normed MTP hidden states [B, T, hidden]; feed them to the shared lm_head.

        `final_hidden[:, t]` is the main model's normed last hidden state at position t and
        `next_token_embeds[:, t]` the embedding of token t+1. Attention is causal through an
        explicit additive mask (an unset mask is not causal under every attention backend that
        transformers may pick for a standalone layer); positions come from `position_embeddings`.
        """
        x = torch.cat(
            [self.pre_fc_norm_embedding(next_token_embeds), self.pre_fc_norm_hidden(final_hidden)],
            dim=-1,
        )
        x = self.fc(x)
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        for layer in self.layers:
            out = layer(x, position_embeddings=position_embeddings, attention_mask=mask)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This head's weights under the checkpoint names (`mtp.` prefix)."""
        return {f"mtp.{name}": t.detach() for name, t in self.state_dict().items()}
