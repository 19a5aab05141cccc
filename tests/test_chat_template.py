"""`_core.Tokenizer.apply_chat_template` renders exactly what transformers renders.

The oracle is `AutoTokenizer.from_pretrained(path).apply_chat_template(..., tokenize=False)` on
the same directory, for the Qwen3-style, Llama-3-style and Qwen3-Coder-style test templates.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_tokenizer import TEMPLATES_DIR, make_tokenizer  # noqa: E402

from ninfer import _core  # noqa: E402

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Returns <json> & \"quotes\".",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain BPE in one line."},
    ],
    "multi_turn_with_reasoning": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "sunny"}'},
        {"role": "assistant", "content": "Paris: 21°C, sunny."},
        {"role": "user", "content": "Now Tokyo, 3 days."},
    ],
    "tool_calls_string_arguments": [
        {"role": "user", "content": "Search twice."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "search", "arguments": '{"query": "ninfer", "limit": 3}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "result one"},
    ],
    "parallel_tool_results": [
        {"role": "user", "content": "Both cities."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "days": 2}}},
            ],
        },
        {"role": "tool", "content": "21"},
        {"role": "tool", "content": "18"},
    ],
}

# Conversations a template rejects on purpose (tested separately): the Llama-3-style template
# takes one tool call per assistant turn, the XML one needs arguments as objects.
REJECTED = {("llama3", "parallel_tool_results"), ("qwen3_coder", "tool_calls_string_arguments")}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for name, style, template in [
        ("qwen3", "qwen3", None),
        ("llama3", "llama3", None),
        ("qwen3_coder", "qwen3", "qwen3_coder.jinja"),
    ]:
        path = tmp_path_factory.mktemp(name)
        make_tokenizer(path, style=style, vocab_size=512 if style == "qwen3" else 600, template=template)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def pairs(dirs):
    return {name: (_core.Tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))) for name, path in dirs.items()}


def render_both(pair, messages, tools=None, add_generation_prompt=True, **kwargs):
    ours, hf = pair
    expected = hf.apply_chat_template(
        copy.deepcopy(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    got = ours.apply_chat_template(
        json.dumps(messages),
        json.dumps(tools) if tools is not None else None,
        add_generation_prompt,
        json.dumps(kwargs) if kwargs else None,
    )
    return got, expected


@pytest.mark.parametrize("template", ["qwen3", "llama3", "qwen3_coder"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(pairs, template, conversation, with_tools, add_generation_prompt):
    if (template, conversation) in REJECTED:
        # The template raises by design on this conversation: both renderers must refuse it.
        ours, theirs = pairs[template]
        messages = CONVERSATIONS[conversation]
        tools = TOOLS if with_tools else None
        with pytest.raises(Exception):
            theirs.apply_chat_template(copy.deepcopy(messages), tools=tools,
                                       add_generation_prompt=add_generation_prompt, tokenize=False)
        with pytest.raises(_core.InvalidRequestError):
            ours.apply_chat_template(json.dumps(messages), json.dumps(tools) if tools is not None else None,
                                     add_generation_prompt, None)
        return
    got, expected = render_both(
        pairs[template], CONVERSATIONS[conversation], tools=TOOLS if with_tools else None, add_generation_prompt=add_generation_prompt
    )
    assert got == expected


@pytest.mark.parametrize("template", ["qwen3", "qwen3_coder"])
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("conversation", ["single_user", "multi_turn_with_reasoning", "tool_round_trip"])
def test_enable_thinking_matches_transformers(pairs, template, enable_thinking, conversation):
    got, expected = render_both(pairs[template], CONVERSATIONS[conversation], tools=TOOLS, enable_thinking=enable_thinking)
    assert got == expected


def test_enable_thinking_false_adds_an_empty_think_block(pairs):
    ours, _ = pairs["qwen3"]
    messages = json.dumps(CONVERSATIONS["single_user"])
    off = ours.apply_chat_template(messages, None, True, json.dumps({"enable_thinking": False}))
    on = ours.apply_chat_template(messages, None, True, json.dumps({"enable_thinking": True}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_llama3_date_string_kwarg_and_custom_tools_match_transformers(pairs):
    got, expected = render_both(
        pairs["llama3"], CONVERSATIONS["system_user"], date_string="26 Jul 2024", custom_tools=[SEARCH_TOOL]
    )
    assert got == expected
    assert "Today: 26 Jul 2024" in got


def test_coder_arguments_of_every_json_type_match_transformers(pairs):
    arguments = {
        "path": "src/main.rs",
        "line": 42,
        "ratio": 0.5,
        "huge": 1e16,
        "tiny": 1e-05,
        "force": True,
        "dry_run": False,
        "nothing": None,
        "tags": ["a", "b"],
        "options": {"recursive": True, "depth": 2, "name": "ü"},
        "multiline": "fn main() {\n    println!(\"hi\");\n}",
    }
    messages = [
        {"role": "user", "content": "Edit it."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "edit", "arguments": arguments}}]},
        {"role": "tool", "content": "ok"},
    ]
    got, expected = render_both(pairs["qwen3_coder"], messages, tools=TOOLS)
    assert got == expected
    assert "<parameter=force>\nTrue\n</parameter>" in got


def test_null_fields_are_dropped_like_transformers(pairs):
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "hello", "tool_calls": None, "reasoning_content": None},
        {"role": "user", "content": "bye"},
    ]
    for template in ("qwen3", "llama3", "qwen3_coder"):
        got, expected = render_both(pairs[template], messages)
        assert got == expected, template


def test_reasoning_under_other_names_is_aliased_like_transformers(pairs):
    for field in ("reasoning", "thinking"):
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", field: "why"},
        ]
        got, expected = render_both(pairs["qwen3"], messages, add_generation_prompt=False)
        assert got == expected, field
        assert "<think>\nwhy\n</think>" in got


@pytest.mark.parametrize("template", ["qwen3", "llama3", "qwen3_coder"])
def test_rendered_prompt_tokenizes_like_transformers(pairs, template):
    ours, hf = pairs[template]
    messages = CONVERSATIONS["tool_round_trip"]
    text = ours.apply_chat_template(json.dumps(messages), json.dumps(TOOLS), True, None)
    expected_ids = hf.apply_chat_template(copy.deepcopy(messages), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode(text, add_special_tokens=False) == list(expected_ids)


def test_raise_exception_in_template_is_an_invalid_request(pairs):
    ours, hf = pairs["qwen3"]
    messages = [{"role": "narrator", "content": "once upon a time"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown message role: narrator"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(_core.InvalidRequestError, match="unknown message role: narrator"):
        ours.apply_chat_template(json.dumps(messages))


def test_coder_template_rejects_string_arguments(pairs):
    ours, _ = pairs["qwen3_coder"]
    with pytest.raises(_core.InvalidRequestError, match="must be an object"):
        ours.apply_chat_template(json.dumps(CONVERSATIONS["tool_calls_string_arguments"]))


def test_bad_json_inputs_are_invalid_requests(pairs):
    ours, _ = pairs["qwen3"]
    with pytest.raises(_core.InvalidRequestError, match="messages"):
        ours.apply_chat_template("[{")
    with pytest.raises(_core.InvalidRequestError, match="messages"):
        ours.apply_chat_template("[]")
    with pytest.raises(_core.InvalidRequestError, match="chat_template_kwargs"):
        ours.apply_chat_template(json.dumps(CONVERSATIONS["single_user"]), None, True, "[1]")


def _copy_tokenizer(src: Path, dst: Path) -> dict:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return json.loads((src / "tokenizer_config.json").read_text())


def test_template_inside_tokenizer_config_matches_transformers(tmp_path, dirs):
    """Older checkpoints keep the template as a string in tokenizer_config.json."""
    config = _copy_tokenizer(dirs["qwen3"], tmp_path / "m")
    config["chat_template"] = (TEMPLATES_DIR / "qwen3.jinja").read_text()
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    pair = (_core.Tokenizer(str(tmp_path / "m")), transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m")))
    got, expected = render_both(pair, CONVERSATIONS["tool_round_trip"], tools=TOOLS)
    assert got == expected


def test_named_templates_in_tokenizer_config_pick_tool_use_like_transformers(tmp_path, dirs):
    config = _copy_tokenizer(dirs["qwen3"], tmp_path / "m")
    config["chat_template"] = [
        {"name": "default", "template": (TEMPLATES_DIR / "qwen3.jinja").read_text()},
        {"name": "tool_use", "template": (TEMPLATES_DIR / "qwen3_coder.jinja").read_text()},
    ]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    pair = (_core.Tokenizer(str(tmp_path / "m")), transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m")))
    for tools in (None, TOOLS):
        got, expected = render_both(pair, CONVERSATIONS["tool_round_trip"], tools=tools)
        assert got == expected
    assert "<function=" not in render_both(pair, CONVERSATIONS["tool_round_trip"])[0]


def test_named_template_files_match_transformers(tmp_path, dirs):
    """transformers 5 saves several templates as chat_template.jinja plus
    additional_chat_templates/NAME.jinja; the layout here is the one save_pretrained writes."""
    hf = transformers.AutoTokenizer.from_pretrained(str(dirs["qwen3"]))
    hf.chat_template = {
        "default": (TEMPLATES_DIR / "qwen3.jinja").read_text(),
        "tool_use": (TEMPLATES_DIR / "qwen3_coder.jinja").read_text(),
    }
    hf.save_pretrained(str(tmp_path / "m"))
    assert (tmp_path / "m" / "additional_chat_templates" / "tool_use.jinja").exists()
    pair = (_core.Tokenizer(str(tmp_path / "m")), transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m")))
    for tools in (None, TOOLS):
        got, expected = render_both(pair, CONVERSATIONS["parallel_tool_results"], tools=tools)
        assert got == expected
    assert "<function=get_weather>" in render_both(pair, CONVERSATIONS["parallel_tool_results"], tools=TOOLS)[0]


def test_chat_template_property_exposes_the_default_source(pairs):
    ours, hf = pairs["qwen3"]
    assert ours.chat_template == hf.chat_template
