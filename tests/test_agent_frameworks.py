"""Forced tool calls as agent frameworks and structured-output libraries send them, against
`ninfer serve` on the demo model: the OpenAI Agents SDK's run loop, a LangChain tool loop,
instructor's TOOLS mode and LangChain's `with_structured_output(method="function_calling")`.

The demo model was never taught tool calls: what these show is that the server's grammar turns
whatever it writes into a call the libraries accept, with arguments valid against the schema,
in few tokens (compact JSON). Its fields are bounded (a string length, an integer range): the
demo model, left free, writes runaway strings and digits that no grammar can end for it.
The server runs with `--no-thinking`, so that a call is the whole answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from ninfer import _core
from server_process import ServerProcess

if not hasattr(_core, "Engine"):
    pytest.skip("_core.Engine is not built yet", allow_module_level=True)

openai = pytest.importorskip("openai")
instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")
agents = pytest.importorskip("agents")
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool

from json_schema_check import validate

MODEL = "demo"
SEEDS = range(10)
#: The most completion tokens a two-field object may cost.
MAX_CALL_TOKENS = 40


class User(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


class AddArgs(BaseModel):
    a: int = Field(ge=0, le=999)
    b: int = Field(ge=0, le=999)


ADD_SCHEMA = AddArgs.model_json_schema()


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model-id", MODEL, "--no-thinking"]) as s:
        yield s


def chat_model(server, seed: int, max_tokens: int):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, seed=seed,
                                       max_tokens=max_tokens, max_retries=0)


def test_an_openai_agents_sdk_run_calls_the_tool_and_answers(server):
    """The SDK's own loop: turn 1 forces a call (ModelSettings tool_choice "required"), the SDK
    runs the Python function and sends its result back, turn 2 (the SDK resets tool_choice to
    auto after a call) answers in text, which ends the run."""
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def add(a: Annotated[int, Field(ge=0, le=999)], b: Annotated[int, Field(ge=0, le=999)]) -> int:
        """Add two numbers."""
        ran.append(a + b)
        return a + b

    async def run(seed: int):
        # The client lives and closes in the run's own event loop: one left to the garbage
        # collector closes its connections in a loop that has ended, failing a later test.
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
            settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                            extra_args={"seed": seed})
            agent = agents.Agent(name="calculator", instructions="Use the add tool.", tools=[add], model=model,
                                 model_settings=settings)
            return await agents.Runner.run(agent, "What is 2 + 3?", max_turns=4)

    for seed in range(3):
        result = asyncio.run(run(seed))
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        call, output = result.new_items[0].raw_item, result.new_items[1]
        assert call.name == "add"
        args = json.loads(call.arguments)
        validate(args, add.params_json_schema)
        assert output.output == args["a"] + args["b"] == ran[-1]
        assert len(result.raw_responses) == 2 and result.final_output
    assert len(ran) == 3


def test_a_langchain_tool_loop_runs_the_tool_and_completes(server):
    """Turn 1 forces a call (tool_choice "required"); LangChain runs the Python tool and sends
    its result back; turn 2 (tool_choice auto) answers in text."""
    ran = []

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        ran.append((a, b))
        return a + b

    for seed in range(3):
        llm = chat_model(server, seed, max_tokens=120)
        messages = [HumanMessage("What is 2 + 3? Use the add tool.")]
        ai = llm.bind_tools([add], tool_choice="required", parallel_tool_calls=False).invoke(messages)
        assert ai.response_metadata["finish_reason"] == "tool_calls"
        assert len(ai.tool_calls) == 1 and not ai.invalid_tool_calls
        call = ai.tool_calls[0]
        assert call["name"] == "add"
        validate(call["args"], ADD_SCHEMA)
        messages.append(ai)
        result = add.invoke(call)  # the framework runs the tool: a ToolMessage for the call's id
        assert result.tool_call_id == call["id"] and result.content == str(call["args"]["a"] + call["args"]["b"])
        messages.append(result)
        final = llm.bind_tools([add]).invoke(messages)
        assert not final.tool_calls and final.content
        assert final.response_metadata["finish_reason"] in ("stop", "length")
        # The second turn saw the first turn's call and the tool's result in its prompt.
        assert final.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]
    assert len(ran) == 3


def test_instructor_tools_mode_extracts_a_two_field_model(server):
    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    good = 0
    for seed in SEEDS:
        user, completion = client.chat.completions.create_with_completion(
            model=MODEL, response_model=User, messages=[{"role": "user", "content": "Extract: Bob is 30 years old."}],
            seed=seed, max_tokens=100, max_retries=0)
        assert isinstance(user, User)
        assert completion.choices[0].finish_reason == "tool_calls"
        if completion.usage.completion_tokens <= MAX_CALL_TOKENS:
            good += 1
    assert good >= 9


def test_langchain_function_calling_extracts_a_two_field_model(server):
    good = 0
    for seed in SEEDS:
        structured = chat_model(server, seed, max_tokens=100).with_structured_output(
            User, method="function_calling", include_raw=True)
        out = structured.invoke("Extract: Bob is 30 years old.")
        assert out["parsing_error"] is None and isinstance(out["parsed"], User)
        raw = out["raw"]
        assert raw.response_metadata["finish_reason"] == "tool_calls"
        if raw.usage_metadata["output_tokens"] <= MAX_CALL_TOKENS:
            good += 1
    assert good >= 9
