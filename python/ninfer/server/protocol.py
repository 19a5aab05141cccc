"""Request bodies validated into typed params, before any stream starts.

Every check raises `ApiError` 400 naming the field and the value it got. Fields we do not know
are ignored, as OpenAI does; fields we know but cannot honour yet are refused clearly.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

from ninfer.server.errors import ApiError, bad_request

_UNSET = object()
#: The field an InvalidRequestError of the core names.
_FIELD = re.compile(r"field `([^`]+)`")


#: `reasoning_effort` -> thinking budget in tokens (None: unlimited) unless
#: `--reasoning-effort-budgets` says otherwise: room for a focused plan at low, for most coding
#: and maths problems at medium, whatever the model needs at high (27B-class thinking models
#: often reason for several thousand tokens on hard problems).
REASONING_EFFORT_BUDGETS = {"minimal": 0, "low": 1024, "medium": 8192, "high": None}


def parse_effort_budgets(text: str) -> dict:
    """`--reasoning-effort-budgets low=N,medium=N,high=N|none` over the default table; ValueError
    naming the bad entry."""
    table = dict(REASONING_EFFORT_BUDGETS)
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or name not in table:
            raise ValueError(f"{item!r}: expected EFFORT=N with EFFORT one of {', '.join(table)}")
        if value in ("none", "unlimited"):
            table[name] = None
        elif value.isdigit():
            table[name] = int(value)
        else:
            raise ValueError(f"{item!r}: the budget must be a number of tokens >= 0 or none")
    return table


@dataclasses.dataclass
class ServerDefaults:
    """Server-wide defaults that requests may override (from `ninfer serve` flags)."""

    model_id: str
    default_max_tokens: Optional[int] = None
    greedy: bool = False
    enable_thinking: bool = True
    #: Sampling fields a request that leaves them out gets (generation_config.json's, by
    #: `--generation-config`); `greedy` still wins for the temperature.
    sampling: dict = dataclasses.field(default_factory=dict)
    #: `--reasoning-budget`: the thinking budget of a chat request that sets none (applied
    #: only where it leaves room for an answer within the request's max_tokens).
    reasoning_budget: Optional[int] = None
    #: `--reasoning-effort-budgets`: `reasoning_effort` -> budget (None: unlimited).
    effort_budgets: dict = dataclasses.field(default_factory=lambda: dict(REASONING_EFFORT_BUDGETS))
    #: `--reasoning-budget-message`: a sentence forced before the end-of-thinking tag.
    reasoning_budget_message: Optional[str] = None


@dataclasses.dataclass
class GenerationRequest:
    """What every endpoint hands the engine: sampling params plus how to shape the reply."""

    model: str
    sampling: dict
    max_tokens: Optional[int]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False


@dataclasses.dataclass
class ChatRequest(GenerationRequest):
    """A /v1/chat/completions (or /v1/messages) request."""

    messages: list = dataclasses.field(default_factory=list)
    tools: Optional[list] = None
    tool_choice: Any = "auto"
    #: With a forced tool_choice: whether the grammar admits more than one call.
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    #: The request field its thinking budget came from (`thinking_budget` or
    #: `reasoning_effort`), None when it set none (the server default may apply).
    budget_field: Optional[str] = None
    #: The `reasoning_effort` the request named, for messages.
    reasoning_effort: Optional[str] = None


@dataclasses.dataclass
class CompletionRequest(GenerationRequest):
    """A /v1/completions request: one or more prompts, each text or token ids.

    `echo` puts each prompt before its completion (and, with `logprobs`, the prompt's tokens
    before the completion's); `max_tokens` 0 (with echo only) scores the prompt, generating nothing.
    """

    prompts: list = dataclasses.field(default_factory=list)
    echo: bool = False


def _type_name(v: Any) -> str:
    return type(v).__name__ if v is not None else "null"


def number(body: dict, name: str, *, lo=None, hi=None, integer=False, lo_open=False, default=_UNSET):
    """A numeric field checked for type and range; `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return None if default is _UNSET else default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        kind = "an integer" if integer else "a number"
        raise bad_request(f"`{name}` must be {kind}, got {_type_name(v)} {v!r}", name)
    if v != v or v in (float("inf"), float("-inf")):
        raise bad_request(f"`{name}` must be finite, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad_request(f"`{name}` must be {'>' if lo_open else '>='} {lo}, got {v!r}", name)
    if hi is not None and v > hi:
        raise bad_request(f"`{name}` must be <= {hi}, got {v!r}", name)
    return v


def boolean(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"`{name}` must be a boolean, got {_type_name(v)} {v!r}", name)
    return v


def _stop(body: dict, name: str) -> list:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > 16:
            raise bad_request(f"`{name}` may hold at most 16 strings, got {len(v)}", name)
        return [s for s in v if s]
    raise bad_request(f"`{name}` must be a string or a list of strings, got {v!r}", name)


def _int_list(body: dict, name: str) -> list:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise bad_request(f"`{name}` must be a list of non-negative integers, got {v!r}", name)
    return v


def _logit_bias(body: dict) -> dict:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request(f"`logit_bias` must be an object mapping token ids to biases, got {v!r}", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"`logit_bias` key {k!r} is not a token id", "logit_bias") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad_request(f"`logit_bias` value for {k} must be a number, got {b!r}", "logit_bias")
        out[str(tok)] = float(b)
    return out


def sampling_fields(body: dict, defaults: ServerDefaults, *, stop_field: str = "stop", check: bool = True) -> dict:
    """The fields of the core's sampling params, from the OpenAI request fields.

    Here: the JSON types, and the limits of the OpenAI API (temperature up to 2, at most 16
    stop strings); the ranges the engine itself needs are the core's (`_core.SamplingParams`,
    rust_core/src/sampling/params.rs), checked once. `check` builds those params to check
    them now (flags, generation_config.json); a request's are checked when it is submitted.
    """
    p: dict = {}
    temperature = number(body, "temperature", lo=0, hi=2)
    if temperature is None and defaults.greedy:
        temperature = 0.0
    if temperature is not None:
        p["temperature"] = float(temperature)
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = number(body, name)
        if v is not None:
            p[name] = float(v)
    top_k = number(body, "top_k", lo=-1, integer=True)
    if top_k is not None:
        p["top_k"] = max(int(top_k), 0)
    seed = number(body, "seed", integer=True)
    if seed is not None:
        p["seed"] = int(seed) & 0xFFFFFFFFFFFFFFFF
    stop = _stop(body, stop_field)
    if stop:
        p["stop"] = stop
    ids = _int_list(body, "stop_token_ids")
    if ids:
        p["stop_token_ids"] = ids
    bias = _logit_bias(body)
    if bias:
        p["logit_bias"] = bias
    # Speculative decoding's draft length for this request (0: none); the core refuses it when
    # the server runs without --spec.
    draft = number(body, "draft_tokens", lo=0, integer=True)
    if draft is not None:
        p["draft_tokens"] = int(draft)
    for name, value in defaults.sampling.items():
        p.setdefault(name, value)
    p["ignore_eos"] = boolean(body, "ignore_eos")
    p["skip_special_tokens"] = boolean(body, "skip_special_tokens", True)
    if check:
        check_sampling(p)
    return p


def check_sampling(fields: dict) -> None:
    """The core's check of sampling fields, as a 400 naming the field."""
    from ninfer import _core

    try:
        _core.SamplingParams(**fields)
    except _core.InvalidRequestError as e:
        m = _FIELD.search(str(e))
        raise bad_request(str(e), m.group(1) if m else None) from None


def _max_tokens(body: dict, *names: str) -> Optional[int]:
    for name in names:
        v = number(body, name, lo=1, integer=True)
        if v is not None:
            return int(v)
    return None


def _common(body: dict, defaults: ServerDefaults) -> dict:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"`model` must be a string, got {model!r}", "model")
    if model and model != defaults.model_id:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{defaults.model_id}`",
                       param="model", code="model_not_found")
    n = number(body, "n", lo=1, hi=16, integer=True, default=1)
    stream = boolean(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad_request(f"`stream_options` must be an object, got {so!r}", "stream_options")
    include_usage = bool(stream and so and boolean(so, "include_usage"))
    return dict(model=model or defaults.model_id, n=int(n), stream=stream, include_usage=include_usage,
                return_token_ids=boolean(body, "return_token_ids"))


#: `response_format.type` values: OpenAI's three, plus llguidance's regex and lark grammars.
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "lark")


def _response_format(body: dict) -> Optional[dict]:
    """The `response_format` to enforce, or None for free text; the core checks the rest (an
    unknown type or a schema it cannot compile is an InvalidRequestError naming the field)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"`response_format.type` must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {rf!r}",
                          "response_format")
    if kind == "json_schema" and not (isinstance(rf.get("json_schema"), dict) and "schema" in rf["json_schema"]):
        raise bad_request("`response_format.json_schema` must be an object with a `schema`", "response_format")
    return None if kind == "text" else rf


def _message_content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise bad_request(f"`{where}` parts must be objects with a `type`, got {part!r}", where)
            if part["type"] in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"`{where}` text part needs a string `text`, got {part!r}", where)
                parts.append(part["text"])
            else:
                raise bad_request(f"content part type `{part['type']}` is not supported yet", where, "unsupported")
        return "".join(parts)
    raise bad_request(f"`{where}` must be a string or a list of content parts, got {_type_name(content)}", where)


def _tool_calls_with_object_arguments(calls: Any, where: str) -> list:
    """Assistant tool calls with `arguments` decoded from JSON text: Qwen3-Coder templates iterate them as a mapping."""
    if not isinstance(calls, list):
        raise bad_request(f"`{where}` must be a list, got {calls!r}", where)
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"`{where}` entries need a `function` with a string `name`, got {c!r}", where)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"`{where}` arguments of {fn['name']} are not valid JSON: {args!r}", where) from None
            args = parsed
        out.append(dict(c, function=dict(fn, arguments=args if args is not None else {})))
    return out


#: The roles a chat message may have; another would be rendered by the template as it pleases.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: Any, field: str = "messages") -> list:
    """Validate chat messages (a known role each) and flatten content-part arrays into text."""
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"`{field}` must be a non-empty list of messages, got {messages!r}", field)
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"`{where}` must be an object with a string `role`, got {m!r}", where)
        if m["role"] not in CHAT_ROLES:
            raise bad_request(f"`{where}.role` {m['role']!r} is not a known role; accepted roles: "
                              f"{', '.join(CHAT_ROLES)}", f"{where}.role")
        msg = dict(m)
        msg["content"] = _message_content(m.get("content"), f"{where}.content")
        if msg["content"] is None:
            msg["content"] = ""
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls_with_object_arguments(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def template_kwargs(body: dict) -> dict:
    """A body's `chat_template_kwargs` (an object; {} when absent)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request(f"`chat_template_kwargs` must be an object, got {kwargs!r}", "chat_template_kwargs")
    return kwargs


def _check_tool(i: int, t: Any) -> None:
    """A tool is {"type": "function", "function": {"name": str, "parameters": JSON Schema object}}:
    the chat template and the tool-call parser read these fields as such."""
    where = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(fn, dict) or t.get("type", "function") != "function":
        raise bad_request(f"`{where}` must be {{\"type\": \"function\", \"function\": {{...}}}}, got {t!r}", where)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"`{where}.function.name` must be a non-empty string, got {fn.get('name')!r}", f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict)):
        raise bad_request(f"`{where}.function.parameters` must be a JSON Schema object (properties an object), got {params!r}",
                          f"{where}.function.parameters")


def parse_tools(body: dict) -> tuple:
    """(tools or None, tool_choice) from a request body; tool_choice none drops the tools.

    tool_choice comes back as "auto", "none", "required" or {"type": "function", "function":
    {"name": N}} naming one of the tools; the last two force a call (`ServerState.start_chat`
    enforces them with a grammar).
    """
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request(f"`tools` must be a list of tool objects, got {tools!r}", "tools")
        for i, t in enumerate(tools):
            _check_tool(i, t)
        if not tools:
            tools = None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if choice == "none":
        tools = None
    elif choice == "required" or isinstance(choice, dict):
        name = _forced_name(choice)
        names = [t["function"]["name"] for t in tools or ()]
        if not names:
            raise bad_request(f"`tool_choice` {choice!r} forces a tool call, but the request has no `tools`",
                              "tool_choice")
        if name is not None and name not in names:
            raise bad_request(f"`tool_choice` names the function {name!r}, which is not among the tools: "
                              f"{', '.join(names)}", "tool_choice")
    elif choice != "auto":
        raise bad_request(f"`tool_choice` must be none, auto, required or a function object, got {choice!r}", "tool_choice")
    return tools, choice


def _forced_name(choice: Any) -> Optional[str]:
    """The function a tool_choice object names (None for "required"); 400 when malformed."""
    if choice == "required":
        return None
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"`tool_choice` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                          f"to name a function, got {choice!r}", "tool_choice")
    return fn["name"]


def forces_tool_call(choice: Any) -> bool:
    """Whether a parsed tool_choice forces a call."""
    return choice == "required" or isinstance(choice, dict)


def thinking_budget(body: dict, defaults: ServerDefaults) -> tuple:
    """(budget or None, the field it came from or None): `thinking_budget` (tokens) wins over
    `reasoning_effort` (a name in the server's table, whose budget may be None: unlimited)."""
    budget = number(body, "thinking_budget", lo=0, hi=2**32 - 1, integer=True)
    if budget is not None:
        return int(budget), "thinking_budget"
    effort = body.get("reasoning_effort")
    if effort is None:
        return None, None
    if not isinstance(effort, str) or effort not in defaults.effort_budgets:
        raise bad_request(f"`reasoning_effort` must be one of {', '.join(defaults.effort_budgets)}, got {effort!r}",
                          "reasoning_effort")
    return defaults.effort_budgets[effort], "reasoning_effort"


def parse_chat(body: Any, defaults: ServerDefaults) -> ChatRequest:
    """Validate a chat completions body."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    common = _common(body, defaults)
    response_format = _response_format(body)
    # Checked by the core when the request is submitted (one check, the engine's).
    sampling = sampling_fields(body, defaults, check=False)
    if response_format is not None:
        sampling["response_format"] = response_format
    logprobs = boolean(body, "logprobs")
    top = number(body, "top_logprobs", lo=0, hi=20, integer=True, default=0)
    if top and not logprobs:
        raise bad_request("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    sampling.update(logprobs=logprobs, top_logprobs=int(top))
    budget, budget_field = thinking_budget(body, defaults)
    if budget_field is not None:
        sampling["thinking_budget"] = budget
    kwargs = template_kwargs(body)
    # A constrained answer leaves no room for a <think> block: thinking is off unless asked for.
    kwargs = {"enable_thinking": defaults.enable_thinking and response_format is None, **kwargs}
    tools, choice = parse_tools(body)
    parallel = boolean(body, "parallel_tool_calls", default=True)
    if forces_tool_call(choice) and response_format is not None:
        raise bad_request("`response_format` cannot be combined with a `tool_choice` that forces a call: "
                          "the call is the whole answer", "response_format")
    return ChatRequest(
        sampling=sampling, max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
        logprobs=logprobs, top_logprobs=int(top), messages=chat_messages(body.get("messages")),
        tools=tools, tool_choice=choice, parallel_tool_calls=parallel, chat_template_kwargs=kwargs,
        budget_field=budget_field,
        reasoning_effort=body.get("reasoning_effort") if budget_field == "reasoning_effort" else None, **common)


def _prompts(v: Any) -> list:
    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)

    def checked(prompts: list) -> list:
        # Token ids travel as u32: a larger one is outside every vocabulary.
        for p in prompts:
            if isinstance(p, list) and max(p) >= 1 << 32:
                raise bad_request(f"token id {max(p)} in `prompt` is outside the vocabulary", "prompt")
        return prompts

    if isinstance(v, str):
        return [v]
    if is_ids(v):
        return checked([v])
    if isinstance(v, list) and v and all(isinstance(x, str) or is_ids(x) for x in v):
        return checked(list(v))
    raise bad_request(f"`prompt` must be a string, a list of strings, a list of token ids or a list of such lists, "
                      f"got {v!r}"[:300], "prompt")


def parse_completion(body: Any, defaults: ServerDefaults) -> CompletionRequest:
    """Validate a (legacy) completions body."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    common = _common(body, defaults)
    echo = boolean(body, "echo")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request(f"`suffix` must be a string, got {_type_name(suffix)} {suffix!r}", "suffix")
    if suffix:
        # Text after the insertion point (fill-in-the-middle): ignoring it would answer another question.
        raise bad_request("`suffix` is not supported yet", "suffix", "unsupported")
    if body.get("best_of") not in (None, 1):
        raise bad_request(f"`best_of` {body['best_of']!r} is not supported yet", "best_of", "unsupported")
    sampling = sampling_fields(body, defaults, check=False)
    response_format = _response_format(body)
    if response_format is not None:
        sampling["response_format"] = response_format
    top = number(body, "logprobs", lo=0, hi=20, integer=True)
    logprobs = top is not None
    sampling.update(logprobs=logprobs, top_logprobs=int(top or 0))
    max_tokens = number(body, "max_tokens", lo=0, integer=True)
    if max_tokens == 0 and not echo:
        # As vLLM: 0 tokens return only the echoed (and scored) prompt, nothing without echo.
        raise bad_request("`max_tokens` 0 needs `echo` true (it returns the prompt, scored with `logprobs`); "
                          "without echo it must be >= 1", "max_tokens")
    return CompletionRequest(sampling=sampling, max_tokens=None if max_tokens is None else int(max_tokens),
                             logprobs=logprobs, top_logprobs=int(top or 0), prompts=_prompts(body.get("prompt")),
                             echo=echo, **common)
