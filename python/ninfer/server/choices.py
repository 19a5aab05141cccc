"""One choice of a response, built from engine deltas: reasoning split, tool calls, logprobs.

Streaming and non-streaming replies use the same `ChoiceBuilder`: `feed(delta)` returns the
OpenAI `delta` object to stream (or None when nothing is certain yet), and the accumulated
fields form the non-streaming message. Tool calls stream as OpenAI `tool_calls` items (a call's
first item has its index, id and name, later ones `{"index", "function": {"arguments": FRAGMENT}}`);
the message's calls are those fragments joined (tool_parsers.py).
"""

from __future__ import annotations

from typing import Optional

from ninfer.server.reasoning import ReasoningParser
from ninfer.server.tool_parsers import ToolCallParser


class TokenText:
    """Cached single-token strings for logprobs output."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)
            self.cache[token_id] = s
        return s


def chat_logprobs(entries: list, token_text: TokenText) -> list:
    """Core logprob entries as OpenAI chat `logprobs.content` items."""
    out = []
    for e in entries:
        s = token_text(e["token_id"])
        out.append({
            "token": s, "logprob": e["logprob"], "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode("utf-8"))}
                             for t, lp in e.get("top") or []],
        })
    return out


class ChoiceBuilder:
    """Accumulates one choice and turns each engine delta into its streamed form."""

    def __init__(self, index: int, *, reasoning: Optional[ReasoningParser], tools: Optional[list]):
        self.index = index
        self.reasoning = reasoning
        self.tools = ToolCallParser(tools) if tools else None
        self.text = ""
        self.content = ""
        self.reasoning_text = ""
        self.tool_calls: list = []
        self.logprobs: list = []
        self.token_ids: list = []
        self.finish_reason: Optional[str] = None
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def feed(self, delta) -> dict:
        """Absorb one delta; return the OpenAI chat `delta` fields that became certain."""
        final = delta.finished
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        self.completion_tokens = delta.completion_tokens
        self.prompt_tokens = delta.prompt_tokens
        self.cached_tokens = delta.cached_tokens
        reasoning, content = ("", delta.text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta.text, final=final)
        calls: list = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final=final)
            self.tool_calls = self.tools.calls
        self.reasoning_text += reasoning
        self.content += content
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        if final:
            self.finish_reason = delta.finish_reason
            if self.tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        return out

    def message(self) -> dict:
        """The non-streaming assistant message."""
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.tool_calls) else None}
        if self.reasoning is not None and self.reasoning.saw_reasoning:
            msg["reasoning_content"] = self.reasoning_text
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg
