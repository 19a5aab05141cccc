"""Held-out measurements of the demo model: perplexity and MTP top-1 accuracy.

The recorded perplexity is the contract ninfer is tested against, so it is computed the way
ninfer computes logits: from the bf16 weights as saved, widened to float32, with float32 math
(no autocast, no TF32), one whole sequence per forward.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F


def as_saved_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of `module` whose weights are rounded through bf16, as written to disk."""
    return copy.deepcopy(module).to(torch.bfloat16).to(torch.float32).eval()


@torch.no_grad()
def heldout_metrics(model, mtp, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Perplexity and MTP accuracy over `windows` [N, L] of held-out token ids.

    Perplexity is exp(mean NLL) of tokens 1..L-1 of each window given the tokens before it
    (every window is scored on its own, from an empty state). MTP top-1 accuracy is measured two
    ways: against the data (argmax of the MTP logits at t == token t+2) and against the main
    model (== argmax of the main logits at t+1), the latter being what greedy speculative
    decoding accepts.
    """
    device = next(model.parameters()).device
    nll_sum, nll_count = 0.0, 0
    main_correct, mtp_correct, mtp_agree, mtp_count = 0, 0, 0, 0
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size].to(device)
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden).float()
        targets = ids[:, 1:]
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        nll_sum += nll.item()
        nll_count += targets.numel()
        main_pred = logits.argmax(-1)
        main_correct += (main_pred[:, :-1] == targets).sum().item()
        if mtp is None or ids.shape[1] < 3:
            continue
        mtp_logits = mtp_logits_for(model, mtp, ids, hidden)
        mtp_pred = mtp_logits[:, :-1].argmax(-1)
        mtp_correct += (mtp_pred == ids[:, 2:]).sum().item()
        mtp_agree += (mtp_pred == main_pred[:, 1:-1]).sum().item()
        mtp_count += mtp_pred.numel()
    mean_nll = nll_sum / nll_count
    result = {
        "tokens_scored": nll_count,
        "mean_nll": mean_nll,
        "perplexity": math.exp(mean_nll),
        "main_top1_accuracy": main_correct / nll_count,
    }
    if mtp_count:
        result["mtp_top1_accuracy_vs_data"] = mtp_correct / mtp_count
        result["mtp_top1_agreement_with_main_greedy"] = mtp_agree / mtp_count
        result["mtp_positions_scored"] = mtp_count
    return result


def mtp_logits_for(model, mtp, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """MTP logits [B, L-1, V]: entry t predicts token t+2 from hidden[t] and token t+1."""
    seq = ids.shape[1] - 1
    next_embeds = model.model.embed_tokens(ids[:, 1:])
    positions = torch.arange(seq, device=ids.device).view(1, 1, -1).expand(3, 1, -1)
    position_embeddings = model.model.rotary_emb(next_embeds, positions)
    return model.lm_head(mtp(hidden[:, :seq], next_embeds, position_embeddings)).float()
