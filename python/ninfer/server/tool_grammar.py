"""Forced tool calls (`tool_choice` "required" or a named function) as a llguidance Lark grammar.

The grammar admits only what the model writes for a call, in the model's own format, with
arguments valid against the tool's JSON schema:

- Qwen3 JSON: `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`;
- Qwen3-Coder XML: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...`
  `</function>\\n</tool_call>`.

The format is the one the chat template writes: XML when the template's source contains
`<function=`, JSON otherwise. Arguments are compact JSON (no whitespace between tokens), and
objects that list `properties` admit no other keys unless the schema says otherwise
(`additionalProperties`, `patternProperties`). An XML string parameter is raw text up to its
closing tag (checked for enum / const / minLength / maxLength; a pattern or format is enforced in
the JSON format only), its parameters come in schema order. Parallel calls are separated by one
newline, as the templates write them. When thinking is on, a reasoning block comes first: continued
when the prompt opened `<think>`, optional when the model opens it itself; any text up to
`</think>` is admitted, so a thinking budget's forced closing sequence is too.

A tag that is a special token of the tokenizer is named as one (`<tag>` in Lark); otherwise
it is a literal string, which the model may write as one added token (`<think>` in Qwen3 and
the demo model) or piece by piece.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Optional

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

#: llguidance's JSON options for arguments: "," and ":" with no whitespace around them.
COMPACT_JSON = {"whitespace_flexible": False}

#: Where the output starts relative to a reasoning block.
REASONING_OPEN = "open"          # the prompt opened <think>: reasoning first, then </think>
REASONING_OPTIONAL = "optional"  # the model may open <think> itself
REASONING_NONE = "none"          # no reasoning (thinking off, or a model without the tags)


@dataclasses.dataclass(frozen=True)
class ToolSyntax:
    """How one model writes tool calls: the format, and each tag as a Lark atom."""

    xml: bool
    tags: dict
    #: The model may reason first: its template writes `<think>` and its vocabulary has both tags.
    thinking: bool = False

    @classmethod
    def of(cls, tokenizer) -> "ToolSyntax":
        """The syntax of a core tokenizer: its chat template picks the format and tells whether
        the model thinks, its vocabulary tells which tags are special tokens."""
        template = tokenizer.chat_template or ""
        has_tags = tokenizer.token_to_id("<think>") is not None and tokenizer.token_to_id("</think>") is not None
        return cls(xml="<function=" in template, tags={t: _tag_atom(tokenizer, t) for t in TAGS},
                   thinking=has_tags and "<think>" in template)


def _tag_atom(tokenizer, tag: str) -> str:
    tid = tokenizer.token_to_id(tag)
    if tid is not None and tokenizer.decode([tid], skip_special_tokens=True) == "":
        return tag
    return json.dumps(tag)


def reasoning_mode(prompt_text: str, thinking: bool) -> str:
    """Where the output starts, from the rendered prompt of a model that thinks (or not):
    inside an open `<think>`, after a closed one (thinking off), or free to open one."""
    if not thinking:
        return REASONING_NONE
    opened, closed = prompt_text.rfind("<think>"), prompt_text.rfind("</think>")
    if opened > closed:
        return REASONING_OPEN
    if closed >= 0 and not prompt_text[closed + len("</think>"):].strip():
        return REASONING_NONE
    return REASONING_OPTIONAL


def forced_tools(tools: list, choice) -> list:
    """The tools a forced `tool_choice` admits: all of them for "required", the named one
    otherwise (the name was checked when the request was parsed)."""
    if choice == "required":
        return tools
    name = choice["function"]["name"]
    return [t for t in tools if t["function"]["name"] == name]


def tool_call_grammar(tools: list, syntax: ToolSyntax, *, parallel: bool, reasoning: str = REASONING_NONE) -> str:
    """A Lark grammar admitting one call (parallel: one or more) of `tools`, after the
    reasoning block `reasoning` asks for."""
    t = syntax.tags
    lines = ["%llguidance {}"]
    calls = "calls" if parallel else "call"
    if reasoning == REASONING_OPEN:
        lines.append(f"start: reasoning {calls}")
    elif reasoning == REASONING_OPTIONAL:
        lines.append(f"start: ({t['<think>']} reasoning)? {calls}")
    else:
        lines.append(f"start: {calls}")
    if reasoning != REASONING_NONE:
        close = t["</think>"]
        if close.startswith('"'):
            # Lazy: the reasoning ends at the first </think>.
            lines.append(f"reasoning: think_text NEWLINES?\nthink_text[suffix={close}]: /(?s:.*)/")
        else:
            lines.append(f"reasoning: /(?s:.*)/ {close} NEWLINES?")
        lines.append('NEWLINES: /\\n{1,2}/')
    lines.append('calls: call ("\\n" call)*')
    names = [f"fn_{i}" for i in range(len(tools))]
    if syntax.xml:
        lines.append(f"call: {t['<tool_call>']} \"\\n<function=\" ({' | '.join(names)}) "
                     f"\"</function>\\n\" {t['</tool_call>']}")
        for i, tool in enumerate(tools):
            lines += _xml_function(i, tool["function"])
    else:
        head = json.dumps('\n{"name": ')
        lines.append(f"call: {t['<tool_call>']} {head} ({' | '.join(names)}) \"}}\\n\" {t['</tool_call>']}")
        for i, tool in enumerate(tools):
            fn = tool["function"]
            head = json.dumps(json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ', ensure_ascii=False)
            lines.append(f"fn_{i}: {head} %json {json.dumps(arguments_schema(fn))}")
    return "\n".join(lines) + "\n"


def arguments_schema(fn: dict) -> dict:
    """The function's parameters schema, closed and with compact-JSON options for llguidance."""
    schema = closed_schema(fn.get("parameters") or {"type": "object", "properties": {}})
    return _compact(schema)


def _compact(schema) -> dict:
    if not isinstance(schema, dict):
        # A boolean schema: true admits anything, false nothing.
        schema = {} if schema else {"not": {}}
    return dict(schema, **{"x-guidance": COMPACT_JSON})


def closed_schema(schema):
    """A copy of `schema` whose objects with `properties` admit no unlisted keys unless they
    say otherwise (OpenAI strict semantics), so that a call ends after its arguments."""
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def _close(s) -> None:
    if isinstance(s, list):
        for x in s:
            _close(x)
        return
    if not isinstance(s, dict):
        return
    if isinstance(s.get("properties"), dict) and "additionalProperties" not in s and "patternProperties" not in s \
            and "unevaluatedProperties" not in s:
        s["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions"):
        if isinstance(s.get(key), dict):
            for v in s[key].values():
                _close(v)
    # allOf members are left open: each one closed would refuse the keys of the others.
    for key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "not", "if", "then", "else"):
        if key in s:
            _close(s[key])


def _xml_function(i: int, fn: dict) -> list:
    """Rules for one function in the XML format: its parameters in schema order, the required
    ones always, each value raw text for strings and compact JSON otherwise."""
    schema = closed_schema(fn.get("parameters") or {})
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts, lines = [], []
    for k, (pname, pschema) in enumerate(props.items()):
        rule = f"p_{i}_{k}"
        parts.append(rule if pname in required else f"{rule}?")
        head = json.dumps(f"<parameter={pname}>\n", ensure_ascii=False)
        lines.append(f"{rule}: {head} {_xml_value(f'v_{i}_{k}', pschema, defs, lines)}")
    head = json.dumps(f"{fn['name']}>\n", ensure_ascii=False)
    return [f"fn_{i}: {head} {' '.join(parts)}".rstrip()] + lines


_PARAM_END = json.dumps("\n</parameter>\n")
#: Text containing a tag that the XML tool-call parser stops a value at.
_XML_TAGS = r"/(?s:.*)(<\/parameter>|<parameter=|<\/function>|<\/tool_call>)(?s:.*)/"


def _xml_value(rule: str, schema, defs: dict, lines: list) -> str:
    """The Lark expression of one parameter's value followed by its closing tag."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        options = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
        if options is not None:
            alts = " | ".join(json.dumps(o, ensure_ascii=False) for o in options if isinstance(o, str))
            return f"({alts}) {_PARAM_END}"
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        # Raw text that the tool-call parser reads back whole: no tag that ends the value, the
        # function or the call early.
        lines.append(f"{rule.upper()}: /(?s:.{{{lo},{'' if hi is None else hi}}})/ & ~{_XML_TAGS}")
        # Lazy: the value ends at the first closing tag, which the suffix writes.
        lines.append(f"{rule}[suffix={_PARAM_END}]: {rule.upper()}")
        return rule
    sub = _compact(schema)
    if defs and "$ref" in json.dumps(schema):
        sub = dict(defs, **sub)
    return f"%json {json.dumps(sub)} {_PARAM_END}"


def prompt_reasoning(tokenizer, syntax: ToolSyntax, messages: list, tools: Optional[list], kwargs: dict) -> str:
    """The reasoning mode of a conversation, from its prompt rendered as the core will."""
    if not syntax.thinking:
        return REASONING_NONE
    text = tokenizer.apply_chat_template(json.dumps(messages), json.dumps(tools) if tools else None, True,
                                         json.dumps(kwargs) if kwargs else None)
    return reasoning_mode(text, True)
