"""Tool calls in model output: Qwen3 `<tool_call>` JSON and Qwen3-Coder XML, whole or streamed.

Qwen3 writes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; Qwen3-Coder writes
`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
The streaming parser passes ordinary text through as content (holding back a tail that could
start `<tool_call>` and the whitespace before it: whitespace next to a call is dropped) and
streams each call as OpenAI `tool_calls` delta items: the first carries the index, id and name,
later ones argument fragments as the model writes them.

A call's `arguments` string is by definition the concatenation of its fragments, and every
decision depends only on the text read so far, so any chunking of the same output (a stream or
one whole response) yields the same calls. The arguments are:
- JSON format, written `{"name": "N", "arguments": {...` (or `"parameters"`) in that order: the
  arguments object exactly as the model wrote it, streamed character by character (its end is
  found by tracking strings and brackets; what follows it up to `</tool_call>` is dropped);
- XML format: a JSON object built as the parameters arrive, `{"P": ` once a parameter's name is
  known, then a string value's escaped text as it comes, any other value once it is complete,
  and `}` at `</function>` (or where the call ends), with `json.dumps` spacing;
- any other body (another key order, arguments as a string, text before `<function=`): read
  whole when `</tool_call>` arrives and sent as one item, normalised by `json.dumps`; a body that
  is no call at all stays content.
Within one `feed`, a call's fragments are merged into one item, so only the first item can lack an
id: it continues the call that was open before; content of the same feed comes after it in the
text and, but for text between two calls that both begin in that feed, before the items with ids
(the order a consumer that opens a block per part needs).
`</tool_call>` ends a call wherever it appears. Once a call's name is out it stays a call: output
that ends (max_tokens) inside JSON arguments leaves them cut short, as OpenAI does; XML arguments
are closed where the call ends.
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
_FUNCTION_HEAD = re.compile(r"<function=([^>\s]+)\s*>")
_PARAMETER_HEAD = re.compile(r"<parameter=([^>\s]+)\s*>")
_FUNCTION_END = "</function>"
_PARAMETER_OPEN = "<parameter="
_PARAMETER_END = "</parameter>"
_VALUE_ENDS = (_PARAMETER_END, _PARAMETER_OPEN, _FUNCTION_END)
#: First characters of a text `json.loads` can read (after the newlines a value is stripped of):
#: an XML value starting otherwise is a string, streamed as it comes.
_JSON_STARTS = set('{["-0123456789tfnNI \t\r')
#: JSON whitespace between the keys of the JSON format's head.
_WS = " \t\r\n"


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


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_call_body(body: str, tools: Optional[list] = None) -> Optional[dict]:
    """One call from the text between the tags, read whole, as an OpenAI tool call; None when malformed."""
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
    return {"id": _new_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_head(s: str):
    """Read `{"name": "N", "arguments": ` (or "parameters") up to the `{` of the arguments object.

    Returns "more" while `s` could still become one, "no" once it cannot, else (name, offset of
    that `{`)."""
    i = 0

    def ws():
        nonlocal i
        while i < len(s) and s[i] in _WS:
            i += 1

    def lit(*words):
        nonlocal i
        rest = s[i:]
        for w in words:
            if rest.startswith(w):
                i += len(w)
                return True
        return "more" if any(w.startswith(rest) for w in words) else "no"

    name = None
    for step in ("{", '"name"', ":", "string", ",", "key", ":", "args"):
        ws()
        if i == len(s):
            return "more"
        if step == "string":
            if s[i] != '"':
                return "no"
            j, esc = i + 1, False
            while j < len(s) and (esc or s[j] != '"'):
                esc = not esc and s[j] == "\\"
                j += 1
            if j == len(s):
                return "more"
            try:
                name = json.loads(s[i:j + 1])
            except ValueError:
                return "no"
            i = j + 1
        elif step == "args":
            return (name, i) if s[i] == "{" else "no"
        else:
            r = lit('"arguments"', '"parameters"') if step == "key" else lit(step)
            if r is not True:
                return r
    return "no"


class ToolCallParser:
    """Streaming splitter of one response's content into plain text and tool-call delta items."""

    def __init__(self, tools: Optional[list] = None):
        self.tools = tools
        self.buf = ""
        #: text | head (deciding what the call is) | whole (read at the close tag) | json | xml | tail
        self.mode = "text"
        self.calls: list = []
        self.items: list = []
        #: Whitespace before `<tool_call>`: dropped if a call follows, content if the block is not one.
        self.pending_space = ""
        # JSON arguments scanner.
        self.depth, self.in_string, self.escape = 0, False, False
        # XML state: between parameters or inside a value of kind undecided / string / held.
        self.in_value, self.value_kind, self.value, self.nparams = False, None, "", 0
        self.types: dict = {}
        self.param = ""

    def feed(self, text: str, final: bool = False) -> tuple:
        """Return (content_delta, tool_call_delta_items) for the new text."""
        self.buf += text
        content: list = []
        self.items = []
        while True:
            if self.mode == "text":
                at = self.buf.find(OPEN)
                if at >= 0:
                    text = self.buf[:at]
                    content.append(text.rstrip())
                    self.pending_space = text[len(text.rstrip()):]
                    self.buf = self.buf[at + len(OPEN):]
                    self.mode = "head"
                    continue
                if final:
                    content.append(self.buf.rstrip() if self.calls else self.buf)
                    self.buf = ""
                    break
                keep = _partial_suffix(self.buf, OPEN)
                keep += len(self.buf[:len(self.buf) - keep]) - len(self.buf[:len(self.buf) - keep].rstrip())
                content.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            at = self.buf.find(CLOSE)
            ended = at >= 0 or final
            if at >= 0:
                avail = self.buf[:at]
            else:
                avail = self.buf[:len(self.buf) - (0 if final else _partial_suffix(self.buf, CLOSE))]
            state = (self.mode, self.in_value)
            used = self._step(avail, ended)
            self.buf = self.buf[used:]
            if used or (self.mode, self.in_value) != state:
                continue
            if not ended:
                break
            # The call's text is all read: close it, or keep an unreadable block as content.
            body = self.buf if at < 0 else self.buf[:at]
            if self.mode in ("head", "whole"):
                call = parse_tool_call_body(body, self.tools)
                if call is None:
                    content.append(self.pending_space + OPEN + body + ("" if at < 0 else CLOSE))
                else:
                    self._start(call["function"]["name"], call["id"])
                    self._emit(call["function"]["arguments"])
            elif self.mode == "xml":
                self._end_function()
            self.buf = "" if at < 0 else self.buf[at + len(CLOSE):]
            self.mode = "text"
            if at < 0:
                break
        return "".join(content), self.items

    def _start(self, name: str, call_id: Optional[str] = None) -> None:
        self.pending_space = ""
        call = {"id": call_id or _new_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.items.append({"index": len(self.calls), "id": call["id"], "type": "function",
                           "function": {"name": name, "arguments": ""}})
        self.calls.append(call)

    def _emit(self, fragment: str) -> None:
        if not fragment:
            return
        index = len(self.calls) - 1
        self.calls[index]["function"]["arguments"] += fragment
        if self.items and self.items[-1]["index"] == index:
            self.items[-1]["function"]["arguments"] += fragment
        else:
            self.items.append({"index": index, "function": {"arguments": fragment}})

    def _step(self, avail: str, ended: bool) -> int:
        """Consume what is certain of `avail` (the call's text read so far, a possible close tag
        held back) in the current mode; returns how many characters were used."""
        if self.mode == "head":
            return self._head(avail)
        if self.mode == "json":
            return self._json(avail)
        if self.mode == "xml":
            return self._xml(avail, ended)
        if self.mode == "tail":
            return len(avail)
        return 0  # whole: waits for the end of the call

    def _head(self, avail: str) -> int:
        """Wait until the body shows a call of either format (then start it) or shows it is neither."""
        s = avail.lstrip()
        if not s:
            return 0
        skipped = len(avail) - len(s)
        if s[0] == "{":
            r = _json_head(s)
            if r == "no":
                self.mode = "whole"
            elif r != "more":
                self._start(r[0])
                self.mode, self.depth, self.in_string, self.escape = "json", 0, False, False
                return skipped + r[1]
            return 0
        m = _FUNCTION_HEAD.match(s)
        if m is not None:
            self._start(m.group(1))
            self._emit("{")
            self.mode, self.in_value, self.nparams = "xml", False, 0
            self.types = _param_types(self.tools, m.group(1))
            return skipped + m.end()
        if not re.fullmatch(r"<(f(u(n(c(t(i(o(n(=([^>\s]+\s*)?)?)?)?)?)?)?)?)?)?", s):
            self.mode = "whole"
        return 0

    def _json(self, avail: str) -> int:
        """The arguments object as written, up to the bracket that closes it."""
        for i, c in enumerate(avail):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self._emit(avail[:i + 1])
                    self.mode = "tail"
                    return i + 1
        self._emit(avail)
        return len(avail)

    def _xml(self, avail: str, ended: bool) -> int:
        """Inside `<function=...>`: a parameter value up to the tag that ends it (a string's text as it
        comes, its trailing newlines held since the value is stripped of them), or the text between."""
        if not self.in_value:
            return self._between(avail, ended)
        ends = [(avail.find(t), t) for t in _VALUE_ENDS]
        ends = [(at, t) for at, t in ends if at >= 0]
        at, tag = min(ends) if ends else (-1, None)
        done = at >= 0 or ended
        text = avail[:at] if at >= 0 else avail
        if not done:
            text = text[:len(text) - max(_partial_suffix(text, t) for t in _VALUE_ENDS)]
        used = 0
        if self.value_kind is None:
            lead = len(text) - len(text.lstrip("\n"))
            used, text = lead, text[lead:]
            if text:
                string = self.types.get(self.param) == "string" or text[0] not in _JSON_STARTS
                self.value_kind = "string" if string else "held"
                if string:
                    self._emit('"')
        if self.value_kind == "held":
            self.value += text
            used += len(text)
        elif self.value_kind == "string":
            keep = len(text) - len(text.rstrip("\n"))
            self._emit(json.dumps(text[:len(text) - keep], ensure_ascii=False)[1:-1])
            used += len(text) - keep
            if done:
                used += keep
        if not done:
            return used
        self._end_value()
        return at + (len(tag) if tag == _PARAMETER_END else 0) if at >= 0 else len(avail)

    def _between(self, avail: str, ended: bool) -> int:
        """Text between parameters: the next `<parameter=P>` or `</function>`; anything else is skipped."""
        p, f = avail.find(_PARAMETER_OPEN), avail.find(_FUNCTION_END)
        if f >= 0 and (p < 0 or f < p):
            self._end_function()
            self.mode = "tail"
            return f + len(_FUNCTION_END)
        if p >= 0:
            m = _PARAMETER_HEAD.match(avail, p)
            if m is not None and (f < 0 or m.end() <= f):  # the function ends at its first </function>
                self.param = m.group(1)
                self._emit((", " if self.nparams else "") + json.dumps(self.param, ensure_ascii=False) + ": ")
                self.nparams += 1
                self.in_value, self.value_kind, self.value = True, None, ""
                return m.end()
            if not ended and re.fullmatch(r"<parameter=[^>\s]*\s*", avail[p:]):
                return p
            return p + len(_PARAMETER_OPEN)
        if ended:
            return len(avail)
        return len(avail) - max(_partial_suffix(avail, _PARAMETER_OPEN), _partial_suffix(avail, _FUNCTION_END))

    def _end_value(self) -> None:
        if self.value_kind == "string":
            self._emit('"')
        else:
            self._emit(json.dumps(_xml_value(self.value, self.types.get(self.param)), ensure_ascii=False))
        self.in_value = False

    def _end_function(self) -> None:
        if self.in_value:
            self._end_value()
        self._emit("}")


def parse_tool_calls(text: str, tools: Optional[list] = None) -> tuple:
    """Split a whole response: (content, [tool calls])."""
    p = ToolCallParser(tools)
    content, _ = p.feed(text, final=True)
    return content, p.calls
