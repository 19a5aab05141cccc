"""Results of the offline API: what `LLM.generate` and `LLM.chat` return per prompt.

The engine streams deltas (see `_core.Engine.step`); these classes fold the deltas of one
request into its final text, tokens, log-probabilities, finish reason and token counts.
`GenerationError` is what a request that failed midway raises instead of a truncated result.
`Delta` (the core's `_core.Delta`) is one step's new output of one request, as `LLM.stream`
and `AsyncEngine` give it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from ninfer._core import Delta, InvalidRequestError  # noqa: F401 (Delta: exported from here)


class GenerationError(InvalidRequestError):
    """A request failed after it was accepted: its `response_format` grammar could not go on (the
    lexer grew too complex to compute the next token mask, or the grammar rejected a token), or
    the engine thread refused it on arrival.

    The engine ends such a request with finish reason "error" and the reason; every API raises
    this after the output produced so far, instead of returning that truncated output as if it
    were complete. The message is the engine's and names the request field at fault, as other
    `InvalidRequestError` messages do (the server answers it with a 400 on that field).

    `request_id` names the failed request. `delta` is its last `Delta`: the text held back until
    the end and the token counts. `outputs` is, from `LLM.generate` / `LLM.chat`, the list of every
    prompt's `RequestOutput` (the others complete, the failed one with finish_reason "error"
    and its `error`).
    """

    def __init__(self, message: str, *, request_id: Optional[str] = None, delta: Any = None,
                 outputs: Optional[list] = None):
        super().__init__(message)
        self.request_id = request_id
        self.delta = delta
        self.outputs = outputs


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
    #: Of `completion_tokens`, those inside the reasoning block (what a thinking budget counts).
    reasoning_tokens: int = 0

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
    #: Why the completion failed midway (finish_reason "error"); None otherwise.
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        """True once the engine reported a finish reason."""
        return self.finish_reason is not None

    def add_delta(self, delta: Delta) -> None:
        """Fold one engine delta into this completion."""
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        lps = delta.logprobs
        if lps is not None:
            if self.logprobs is None:
                self.logprobs = []
            for lp in lps:
                top = [(int(t), float(v)) for t, v in (lp.get("top") or ())]
                self.logprobs.append(TokenLogprob(int(lp["token_id"]), float(lp["logprob"]), top))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.error = delta.error
        self.usage = Usage(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
                           cached_tokens=delta.cached_tokens,
                           reasoning_tokens=getattr(delta, "reasoning_tokens", 0))


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
        """"stop", "length", "abort" or "error" (see `GenerationError`) for the first completion."""
        return self.outputs[0].finish_reason

    @property
    def error(self) -> Optional[str]:
        """Why the first completion failed midway (finish_reason "error"); None otherwise."""
        return self.outputs[0].error

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
            reasoning_tokens=sum(o.usage.reasoning_tokens for o in self.outputs),
        )
