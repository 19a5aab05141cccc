"""Split `<think>...</think>` output of thinking models into `reasoning_content`.

Works on streamed text: `feed(text)` returns the (reasoning, content) parts that are certain so
far, holding back a tail that could be the start of a tag. Qwen3-style templates either let the
model open `<think>` itself or open it in the prompt; the core tells the two apart when it
renders the prompt (`core.submit_chat`, rust_core/src/tokenizer/chat_prompt.rs).
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Stateful splitter of one response's text into reasoning and content."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.saw_reasoning = in_reasoning
        self.emitted_reasoning = False

    def feed(self, text: str, final: bool = False) -> tuple:
        """Return (reasoning_delta, content_delta) for the new text."""
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(OPEN):
                    self.buf = stripped[len(OPEN):]
                    self.state = "reasoning"
                    self.saw_reasoning = True
                    continue
                if OPEN.startswith(stripped) and not final:
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                if not self.emitted_reasoning:
                    self.buf = self.buf.lstrip("\n")
                at = self.buf.find(CLOSE)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf = self.buf[at + len(CLOSE):].lstrip("\n")
                    self.state = "after"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, CLOSE)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.emitted_reasoning = self.emitted_reasoning or bool(reasoning[-1])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.state == "after":
                if not self.buf and not final:
                    break
                self.buf = self.buf.lstrip("\n")
                if not self.buf and not final:
                    break
                self.state = "content"
                continue
            content.append(self.buf)
            self.buf = ""
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple:
    """Split a whole response at once: (reasoning or None, content)."""
    p = ReasoningParser(in_reasoning)
    r, c = p.feed(text, final=True)
    return (r if p.saw_reasoning else None), c
