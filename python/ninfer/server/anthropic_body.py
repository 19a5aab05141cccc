"""An Anthropic Messages body translated into the OpenAI chat body that `parse_chat` validates.

Every Anthropic feature is built on the chat path; this module only maps fields: the system
prompt, text / tool_use / tool_result blocks (in their order), tools with `input_schema`,
`tool_choice`, `thinking`, `stop_sequences`. Errors name the Anthropic field at fault.
"""

from __future__ import annotations

from ninfer.server.errors import bad_request
from ninfer.server.protocol import number

#: Anthropic `tool_choice.type` -> the chat body's `tool_choice` (`tool` names its function).
TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}

#: Prefix of a `tool_result` marked `is_error`: chat templates have no error flag, so the model
#: reads the failure in the text.
TOOL_ERROR_PREFIX = "Error: "


def _unsupported(kind, where: str):
    what = "image" if kind == "image" else f"content block type {kind!r}"
    return bad_request(f"{what} blocks are not supported by this server (`{where}`)", where, "unsupported")


def block_text(blocks: list, where: str) -> str:
    """The text of a list of text blocks (`system`, a tool_result's content); a block without a
    `type` counts as text, an image or other kind is refused."""
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            raise bad_request(f"`{where}[{i}]` must be a content block object, got {b!r}", f"{where}[{i}]")
        kind = b.get("type", "text")
        if kind != "text":
            raise _unsupported(kind, f"{where}[{i}]")
        t = b.get("text", "")
        if not isinstance(t, str):
            raise bad_request(f"`{where}[{i}].text` must be a string, got {t!r}", f"{where}[{i}].text")
        out.append(t)
    return "".join(out)


def _tool_use(block: dict, where: str) -> dict:
    """An assistant `tool_use` block as a chat tool call (arguments as an object)."""
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise bad_request(f"`{where}.{key}` must be a non-empty string, got {block.get(key)!r}", f"{where}.{key}")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise bad_request(f"`{where}.input` must be an object, got {args!r}", f"{where}.input")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}}


def _tool_result(block: dict, where: str) -> dict:
    """A user `tool_result` block as a chat `tool` message."""
    c = block.get("content")
    if isinstance(c, list):
        c = block_text(c, f"{where}.content")
    elif c is not None and not isinstance(c, str):
        raise bad_request(f"`{where}.content` must be a string or a list of blocks, got {c!r}", f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_request(f"`{where}.is_error` must be a boolean, got {is_error!r}", f"{where}.is_error")
    text = (TOOL_ERROR_PREFIX if is_error else "") + (c or "")
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def blocks_to_messages(role: str, content, where: str) -> list:
    """The chat messages of one Anthropic message, in block order: adjacent text blocks (and an
    assistant's tool_use blocks) form one message, each tool_result its own `tool` message;
    thinking blocks are dropped (templates render past reasoning their own way)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"`{where}.content` must be a string or a list of blocks, got {content!r}", where)
    out: list = []
    current = None

    def message() -> dict:
        nonlocal current
        if current is None:
            current = {"role": role, "content": ""}
            out.append(current)
        return current

    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            t = block.get("text")
            if not isinstance(t, str):
                raise bad_request(f"`{at}.text` must be a string, got {t!r}", f"{at}.text")
            message()["content"] += t
        elif kind == "tool_use" and role == "assistant":
            message().setdefault("tool_calls", []).append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block, at))
            current = None
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind in ("tool_use", "tool_result"):
            raise bad_request(f"`{at}`: a {kind} block belongs in a {'user' if kind == 'tool_result' else 'assistant'} "
                              f"message, not a {role} one", at)
        else:
            raise _unsupported(kind, at)
    return out or [{"role": role, "content": ""}]


def _tool_choice(body: dict, chat: dict) -> None:
    """Anthropic `tool_choice` onto the chat body's `tool_choice` and `parallel_tool_calls`."""
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"`tool_choice.name` must be a non-empty string, got {name!r}", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in TOOL_CHOICE:
        chat["tool_choice"] = TOOL_CHOICE[kind]
    else:
        raise bad_request(f"`tool_choice` must be an object with type auto, any, tool or none, got {choice!r}",
                          "tool_choice")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise bad_request(f"`tool_choice.disable_parallel_tool_use` must be a boolean, got {single!r}",
                          "tool_choice.disable_parallel_tool_use")
    if single and kind != "none":
        chat["parallel_tool_calls"] = False


def _thinking(body: dict, chat: dict) -> None:
    """Anthropic `thinking` onto the chat body: enabled with `budget_tokens` is a thinking budget
    (any integer >= 0 here: small budgets are how a small model gets to its answer, where
    Anthropic's API asks for 1024 or more), adaptive thinks as the model does by default,
    disabled turns the template's thinking off."""
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind in ("enabled", "adaptive"):
        chat["chat_template_kwargs"] = {"enable_thinking": True}
        if kind == "enabled" and thinking.get("budget_tokens") is not None:
            field = "thinking.budget_tokens"
            chat["thinking_budget"] = number({field: thinking["budget_tokens"]}, field, lo=0, integer=True)
    else:
        raise bad_request(f"`thinking` must be an object with type enabled, adaptive or disabled, got {thinking!r}",
                          "thinking")


def _stop_sequences(body: dict):
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise bad_request(f"`stop_sequences` must be a list of strings, got {stops!r}", "stop_sequences")
    return stops


def to_chat_body(body, *, for_count: bool = False) -> dict:
    """The equivalent OpenAI chat body. `for_count` (/v1/messages/count_tokens): `max_tokens`
    is not required and the result never streams."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not for_count:
        if body.get("max_tokens") is None:
            raise bad_request("`max_tokens` is required", "max_tokens")
        number(body, "max_tokens", lo=1, integer=True)
    messages = []
    system = body.get("system")
    if isinstance(system, list):
        system = block_text(system, "system")
    elif system is not None and not isinstance(system, str):
        raise bad_request(f"`system` must be a string or a list of text blocks, got {system!r}", "system")
    if system:
        messages.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request(f"`messages` must be a non-empty list, got {raw!r}", "messages")
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"`messages[{i}]` must have role user or assistant, got {m!r}", f"messages[{i}]")
        messages += blocks_to_messages(m["role"], m.get("content"), f"messages[{i}]")
    keep = ("model", "temperature", "top_p", "top_k") + (() if for_count else ("max_tokens", "stream"))
    chat = {k: body[k] for k in keep if k in body}
    chat["messages"] = messages
    stops = _stop_sequences(body)
    if stops is not None:
        chat["stop"] = stops
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"`tools` must be a list of tools, got {tools!r}", "tools")
    if tools:
        # A non-object stays as it is, for parse_chat to name it.
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}}
                         if isinstance(t, dict) else t for t in tools]
    _tool_choice(body, chat)
    _thinking(body, chat)
    return chat
