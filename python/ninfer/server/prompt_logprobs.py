"""The logprobs of a prompt's own tokens, from the all-position logits of one scoring forward.

What `/v1/completions` with `echo` and `logprobs` returns for the prompt (how loglikelihood
evaluation tools score a model over HTTP): token i's log-probability given the tokens before it,
the log-softmax of row i - 1 of `LLM.score`'s logits. The first token has no context: its
logprob and its top_logprobs are null.
"""

from __future__ import annotations

import numpy as np

#: Rows per log-softmax slice: bounds the float64 copy of a long prompt's logits.
_ROWS = 64


def prompt_logprob_entries(logits, token_ids: list, top: int) -> list:
    """Entries shaped as the core's logprobs ({"token_id", "logprob", "top": [(id, logprob)]}),
    one per prompt token; the first has logprob None and top None. `top` is the number of most
    likely tokens listed per position, most likely first (ties: lower id first)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = [{"token_id": int(ids[0]), "logprob": None, "top": None}] if len(ids) else []
    for start in range(0, len(ids) - 1, _ROWS):
        rows = np.asarray(logits[start:min(start + _ROWS, len(ids) - 1)], dtype=np.float64)
        peak = rows.max(axis=1, keepdims=True)
        lp = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
        targets = ids[start + 1:start + 1 + len(rows)]
        chosen = lp[np.arange(len(rows)), targets]
        k = min(top, lp.shape[1])
        best = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k else np.zeros((len(rows), 0), dtype=np.int64)
        values = np.take_along_axis(lp, best, axis=1)
        order = np.lexsort((best, -values), axis=-1)
        best_ids = np.take_along_axis(best, order, axis=1).tolist()
        best_lps = np.take_along_axis(values, order, axis=1).tolist()
        for token, logprob, ids_r, lps_r in zip(targets.tolist(), chosen.tolist(), best_ids, best_lps):
            out.append({"token_id": token, "logprob": logprob, "top": list(zip(ids_r, lps_r))})
    return out
