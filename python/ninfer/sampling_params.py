"""Per-request sampling parameters of the offline API.

The fields mirror the Rust `SamplingParams` (rust_core/src/sampling/params.rs): `to_core` builds
the typed `_core.SamplingParams` that `_core.Engine.submit` takes. Python checks only what Rust
cannot see (types, `n`, and the `max_tokens=None` convention); every range check lives in Rust,
so a value is judged the same way whether it comes from here, the CLI or the server.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from ninfer import _core
from ninfer._core import InvalidRequestError


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and not (
        isinstance(v, float) and math.isnan(v)
    )


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one prompt.

    `max_tokens=None` means "as many as fit in the context after the prompt". `n` asks for
    several independent completions of the same prompt; with a `seed`, completion `i` uses
    `seed + i`, so each is reproducible on its own.
    """

    n: int = 1
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Dict[int, float] = dataclasses.field(default_factory=dict)
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stop_token_ids: List[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    #: OpenAI-style output format enforced by grammar-constrained decoding:
    #: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": {...}}}`,
    #: `{"type": "regex", "regex": ...}`, `{"type": "lark", "lark": ...}`, or None / text.
    response_format: Optional[Dict[str, Any]] = None
    #: Most tokens a thinking model's reasoning block (`<think>` ... `</think>`) may take; when
    #: it runs out the engine forces the end of the reasoning and the answer follows, all within
    #: `max_tokens`. 0 closes the reasoning at once; None leaves it unlimited.
    thinking_budget: Optional[int] = None
    #: A sentence forced before the end-of-thinking tag when the budget runs out (None: none).
    thinking_budget_message: Optional[str] = None
    #: Draft tokens per verify step for this request under speculative decoding (0: none; None:
    #: the engine's `draft_tokens`); needs an engine started with `spec`.
    draft_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        self._check_types()

    @classmethod
    def greedy(cls, **kwargs) -> "SamplingParams":
        """Argmax decoding (temperature 0); other fields as given."""
        return cls(temperature=0.0, **kwargs)

    def _check_types(self) -> None:
        def bad(field: str, why: str) -> InvalidRequestError:
            value = getattr(self, field)
            return InvalidRequestError(f"invalid request field `{field}`: {value!r} {why}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty"):
            if not _is_number(getattr(self, field)):
                raise bad(field, "must be a number")
        for field in ("top_k", "top_logprobs"):
            if not _is_int(getattr(self, field)):
                raise bad(field, "must be an integer")
        if self.top_k < 0:
            self.top_k = 0
        if self.top_logprobs < 0:
            raise bad("top_logprobs", "must be >= 0")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif not (isinstance(self.stop, Sequence) and all(isinstance(s, str) for s in self.stop)):
            raise bad("stop", "must be a string or a list of strings")
        else:
            self.stop = list(self.stop)
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.logit_bias, Mapping) or not all(
            (_is_int(k) or (isinstance(k, str) and k.isdigit())) and _is_number(v)
            for k, v in self.logit_bias.items()
        ):
            raise bad("logit_bias", "must map token ids to numbers")
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        for field in ("ignore_eos", "logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "must be true or false")
        if self.top_logprobs > 0:
            self.logprobs = True
        if self.thinking_budget is not None and (not _is_int(self.thinking_budget) or self.thinking_budget < 0):
            raise bad("thinking_budget", "must be an integer >= 0 or None")
        if self.thinking_budget_message is not None and not isinstance(self.thinking_budget_message, str):
            raise bad("thinking_budget_message", "must be a string or None")
        if self.draft_tokens is not None and (not _is_int(self.draft_tokens) or not 0 <= self.draft_tokens <= 8):
            raise bad("draft_tokens", "must be an integer in 0..8 or None")
        if self.response_format is not None and not isinstance(self.response_format, Mapping):
            raise bad("response_format", "must be an object such as {\"type\": \"json_object\"} or None")

    def to_core_dict(self, max_tokens: int, seed: Optional[int]) -> dict:
        """The fields of `_core.SamplingParams`, for one completion.

        `max_tokens` and `seed` are resolved by the caller (context left, `seed + i` for n>1).
        """
        return {
            "max_tokens": max_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "min_p": float(self.min_p),
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "logit_bias": {str(int(k)): float(v) for k, v in self.logit_bias.items()},
            "seed": seed,
            "stop": list(self.stop),
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            "top_logprobs": int(self.top_logprobs),
            "skip_special_tokens": self.skip_special_tokens,
            "response_format": None if self.response_format is None else dict(self.response_format),
            "thinking_budget": self.thinking_budget,
            "thinking_budget_message": self.thinking_budget_message,
            "draft_tokens": self.draft_tokens,
        }

    def to_core(self, max_tokens: int, seed: Optional[int]) -> "_core.SamplingParams":
        """The checked `_core.SamplingParams` of one completion (`to_core_dict`'s fields)."""
        return _core.SamplingParams(**self.to_core_dict(max_tokens, seed))

    def seed_for(self, index: int) -> Optional[int]:
        """The seed of completion `index` of `n`: `seed + index`, or None when unseeded."""
        return None if self.seed is None else self.seed + index
