"""Tool calls in model output: Qwen3 `<tool_call>` JSON and Qwen3-Coder XML, whole or streamed.

Qwen3 writes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; Qwen3-Coder writes
`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
Both are recognised by the body of the block. The streaming parser passes ordinary text through
as content (holding back a tail that could start `<tool_call>`) and emits each call once its
closing tag arrives.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\s]+)\s*>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)\s*>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _param_types(tools: Optional[list], name: str) -> dict:
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _xml_value(raw: str, typ: Optional[str]):
    value = raw.strip("\n")
    if typ == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_tool_call_body(body: str, tools: Optional[list] = None) -> Optional[dict]:
    """One call from the text between the tags, as an OpenAI tool call; None when malformed."""
    body = body.strip()
    name, args = None, None
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
    else:
        m = _FUNCTION.search(body)
        if m is None:
            return None
        name = m.group(1)
        types = _param_types(tools, name)
        args = {p.group(1): _xml_value(p.group(2), types.get(p.group(1))) for p in _PARAMETER.finditer(m.group(2))}
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Streaming splitter of one response's content into plain text and tool calls."""

    def __init__(self, tools: Optional[list] = None):
        self.tools = tools
        self.buf = ""
        self.in_call = False
        self.calls: list = []

    def feed(self, text: str, final: bool = False) -> tuple:
        """Return (content_delta, new_calls) for the new text."""
        self.buf += text
        content, new_calls = [], []
        while True:
            if not self.in_call:
                at = self.buf.find(OPEN)
                if at >= 0:
                    content.append(self.buf[:at])
                    self.buf = self.buf[at + len(OPEN):]
                    self.in_call = True
                    continue
                keep = 0 if final else _partial_suffix(self.buf, OPEN)
                content.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            at = self.buf.find(CLOSE)
            if at < 0 and not final:
                break
            body = self.buf if at < 0 else self.buf[:at]
            call = parse_tool_call_body(body, self.tools)
            if call is None:
                content.append(OPEN + body + ("" if at < 0 else CLOSE))
            else:
                new_calls.append(call)
                self.calls.append(call)
            self.buf = "" if at < 0 else self.buf[at + len(CLOSE):]
            self.in_call = False
            if at < 0:
                break
        text_out = "".join(content)
        if self.calls and not text_out.strip():
            text_out = ""
        return text_out, new_calls


def parse_tool_calls(text: str, tools: Optional[list] = None) -> tuple:
    """Split a whole response: (content, [tool calls])."""
    p = ToolCallParser(tools)
    content, calls = p.feed(text, final=True)
    return content, calls
