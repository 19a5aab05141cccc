"""Results of the offline API: what `LLM.generate` and `LLM.chat` return per prompt.

The engine streams deltas (see `_core.Engine.step`); these classes fold the deltas of one
request into its final text, tokens, log-probabilities, finish reason and token counts.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional


@dataclasses.dataclass
class TokenLogprob:
    """Log-probability of one generated token and the most likely alternatives at its position.

    `top` holds `(token_id, logprob)` pairs, most likely first (empty unless top_logprobs > 0).
    """

    token_id: int
    logprob: float
    top: List[tuple] = dataclasses.field(default_factory=list)

    def __getitem__(self, key: str):
        """Dict-style access (`lp["logprob"]`), the shape the engine's deltas use."""
        return getattr(self, key)


@dataclasses.dataclass
class Usage:
    """Token counts of one request, as an OpenAI response's `usage` reports them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt (there are `n` per prompt)."""

    index: int
    text: str = ""
    token_ids: List[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[List[TokenLogprob]] = None
    finish_reason: Optional[str] = None
    usage: Usage = dataclasses.field(default_factory=Usage)

    @property
    def finished(self) -> bool:
        """True once the engine reported a finish reason."""
        return self.finish_reason is not None

    def add_delta(self, delta: dict) -> None:
        """Fold one engine delta (a dict of `_core.Engine.step`) into this completion."""
        self.token_ids.extend(delta.get("token_ids") or ())
        self.text += delta.get("text") or ""
        lps = delta.get("logprobs")
        if lps is not None:
            if self.logprobs is None:
                self.logprobs = []
            for lp in lps:
                top = [(int(t), float(v)) for t, v in (lp.get("top") or ())]
                self.logprobs.append(TokenLogprob(int(lp["token_id"]), float(lp["logprob"]), top))
        if delta.get("finish_reason") is not None:
            self.finish_reason = delta["finish_reason"]
        self.usage = Usage(
            prompt_tokens=int(delta.get("prompt_tokens", self.usage.prompt_tokens)),
            completion_tokens=int(delta.get("completion_tokens", len(self.token_ids))),
            cached_tokens=int(delta.get("cached_tokens", self.usage.cached_tokens)),
        )


@dataclasses.dataclass
class RequestOutput:
    """Everything generated for one prompt.

    `outputs` holds the `n` completions; `text`, `token_ids`, `logprobs` and `finish_reason`
    are those of the first, for the common n=1 case. `usage` counts the prompt once and the
    tokens of all completions.
    """

    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]

    @property
    def text(self) -> str:
        """Generated text of the first completion (stop strings removed)."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> List[int]:
        """Generated token ids of the first completion."""
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> Optional[List[TokenLogprob]]:
        """Per generated token of the first completion: {token_id, logprob, top}; None unless asked."""
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop", "length" or "abort" for the first completion."""
        return self.outputs[0].finish_reason

    @property
    def finished(self) -> bool:
        """True when every completion has finished."""
        return all(o.finished for o in self.outputs)

    @property
    def usage(self) -> Usage:
        """Prompt tokens once, completion tokens summed over the completions."""
        first = self.outputs[0].usage
        return Usage(
            prompt_tokens=first.prompt_tokens or len(self.prompt_token_ids),
            completion_tokens=sum(o.usage.completion_tokens for o in self.outputs),
            cached_tokens=first.cached_tokens,
        )
