"""The built-in chat page (python/ninfer/static) in a real headless Chromium.

The page is driven through selenium with Debian's `chromium` and `chromium-driver` (no driver
download at test time). It runs against two servers: a small Starlette stand-in written here,
which streams OpenAI-shaped SSE chunks at a known pace and records client disconnects, and the
installed `ninfer serve`, on its paced fake engine and with no model argument (the bundled demo
model).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from server_process import NINFER, env_with_tests_dir

REPO = Path(__file__).resolve().parents[1]
#: The package the tests run against (the installed one), found without importing it.
PACKAGE = Path(importlib.util.find_spec("ninfer").submodule_search_locations[0])
STATIC = PACKAGE / "static"
DEMO_MODEL = PACKAGE / "demo" / "model"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver packages"
)

STUB_REASONING = ["The user ", "wants a ", "greeting."]
STUB_ANSWER = ["Hello", ",", " this", " is", " a", " streamed", " answer", "."]
LONG_TOKEN = " tok"
MAX_STUB_TOKENS = 8192
FAKE_CORE_SCRIPT = "say:<think>I will add them.</think>def total(xs):\n    return sum(xs)"
"""tests/fake_core.py makes its "model" say exactly the text after `say:`."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubChatServer:
    """An OpenAI-style streaming chat endpoint with a fixed script, serving the real page.

    A user message containing "long" gets an endless-looking answer (one token every 40 ms, for
    a minute) so the test can stop it; every request's fate ("completed" or "disconnected") is
    recorded in `outcomes`, in arrival order.
    """

    def __init__(self):
        self.port = free_port()
        self.requests: list[dict] = []
        self.outcomes: list[str] = []
        self._server = None
        self._thread = None

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import FileResponse, JSONResponse, StreamingResponse
        from starlette.routing import Mount, Route
        from starlette.staticfiles import StaticFiles

        async def index(request):
            return FileResponse(STATIC / "index.html")

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

        async def chat(request):
            body = await request.json()
            self.requests.append(body)
            if body.get("max_tokens", 0) > MAX_STUB_TOKENS:
                message = f"max_tokens {body['max_tokens']} exceeds the maximum context"
                error = {"message": message, "type": "invalid_request_error", "param": "max_tokens"}
                return JSONResponse({"error": error}, status_code=400)
            index_ = len(self.outcomes)
            self.outcomes.append("streaming")
            long = "long" in body["messages"][-1]["content"]
            return StreamingResponse(self._events(index_, long), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/", index),
                Route("/v1/models", models),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Mount("/static", StaticFiles(directory=STATIC)),
            ]
        )

    async def _events(self, index: int, long: bool):
        def chunk(delta=None, finish=None, usage=None):
            body = {"id": f"chatcmpl-{index}", "object": "chat.completion.chunk", "model": "stub-model",
                    "choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
            if usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            yield chunk({"role": "assistant"})
            for piece in STUB_REASONING:
                await asyncio.sleep(0.05)
                yield chunk({"reasoning_content": piece})
            pieces = [LONG_TOKEN] * 1500 if long else STUB_ANSWER
            for piece in pieces:
                await asyncio.sleep(0.04)
                yield chunk({"content": piece})
            yield chunk(finish="stop")
            n = len(STUB_REASONING) + len(pieces)
            yield chunk(usage={"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5})
            yield "data: [DONE]\n\n"
            self.outcomes[index] = "completed"
        finally:
            if self.outcomes[index] != "completed":
                self.outcomes[index] = "disconnected"

    def __enter__(self):
        import uvicorn

        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for_http(f"http://127.0.0.1:{self.port}/v1/models", 20)
        return self

    def __exit__(self, *exc):
        self._server.should_exit = True
        self._thread.join(10)


def wait_for_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


class NinferServer:
    """The installed `ninfer serve` on a free port: the bundled demo model, or the server's
    paced fake engine (tests/fake_core.py, 50 tokens/s) for the real HTTP layer without a model."""

    def __init__(self, kind: str):
        self.port = free_port()
        self.cmd = [*NINFER, "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if kind == "server-fake-core":
            self.cmd += ["--core-factory", "fake_core:SlowFakeCore", "--model-id", "fake"]
        self.env = env_with_tests_dir(os.environ)
        self.proc = None

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=REPO)
        try:
            wait_for_http(f"http://127.0.0.1:{self.port}/health", 120, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(params=["stub", "server-fake-core", "ninfer-demo"])
def chat_server(request):
    """(kind, base URL, stub or None): the stand-in here, then the real server (fake engine, demo model)."""
    kind = request.param
    if kind == "stub":
        with StubChatServer() as stub:
            yield kind, f"http://127.0.0.1:{stub.port}", stub
        return
    with NinferServer(kind) as server:
        yield kind, f"http://127.0.0.1:{server.port}", None


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def assistant_messages(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def answer_text(driver, index: int) -> str:
    msgs = assistant_messages(driver)
    if len(msgs) <= index:
        return ""
    return driver.execute_script("return arguments[0].querySelector('.answer').textContent", msgs[index])


def streamed_text(driver, index: int) -> str:
    """Reasoning and answer text of assistant message `index` (a model may still be thinking)."""
    msgs = assistant_messages(driver)
    if len(msgs) <= index:
        return ""
    return driver.execute_script(
        "return arguments[0].querySelector('.reasoning-text').textContent"
        " + arguments[0].querySelector('.answer').textContent", msgs[index])


#: Records the length of the first assistant message's reasoning + answer text at every DOM
#: change under #messages, in the page itself.
WATCH_LENGTHS_JS = """
window.__lengths = [];
new MutationObserver(() => {
  const m = document.querySelector('#messages .msg.assistant');
  if (!m) return;
  const r = m.querySelector('.reasoning-text'), a = m.querySelector('.answer');
  window.__lengths.push((r ? r.textContent : '').length + (a ? a.textContent : '').length);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""


def submit(driver, text: str, max_tokens: int, temperature: float) -> None:
    from selenium.webdriver.common.by import By

    for field_id, value in (("max-tokens", max_tokens), ("temperature", temperature)):
        field = driver.find_element(By.ID, field_id)
        field.clear()
        field.send_keys(str(value))
    prompt = driver.find_element(By.ID, "prompt")
    driver.execute_script("arguments[0].value = arguments[1]", prompt, text)
    driver.find_element(By.ID, "send").click()


def test_chat_page_streams_an_answer_then_stops_a_second_request(browser, chat_server):
    from selenium.webdriver.common.by import By

    kind, base, stub = chat_server
    browser.get(base + "/")
    wait_until(lambda: browser.find_element(By.ID, "model-name").text not in ("", "connecting…"), 20,
               "the model name")

    first_prompt = FAKE_CORE_SCRIPT if kind == "server-fake-core" else "Write a Python function: Return the sum of a list of numbers."
    # Streaming is seen on the whole message (reasoning, then answer): the demo model may spend
    # most of its 96 tokens thinking. The page records the message's length at every change
    # (a MutationObserver, in the browser): polling from here missed every partial state once
    # on a loaded 2-core CI machine, where a Selenium round trip can outlast the whole answer.
    browser.execute_script(WATCH_LENGTHS_JS)
    submit(browser, first_prompt, 96, 0.0)
    lengths = set()
    def finished():
        lengths.add(len(streamed_text(browser, 0)))
        return "done" in assistant_messages(browser)[0].get_attribute("class").split()
    wait_until(lambda: assistant_messages(browser), 10, "an assistant message")
    wait_until(finished, 120, "the first answer to finish")
    first = answer_text(browser, 0)
    assert first.strip(), "no streamed text appeared"
    lengths.update(browser.execute_script("return window.__lengths"))
    partial = {n for n in lengths if 0 < n < len(streamed_text(browser, 0))}
    assert partial, "the message arrived in one piece, not streamed"
    stats = browser.find_element(By.ID, "stats").text
    assert "tok/s" in stats and "tokens" in stats
    if stub is not None:
        assert first == "".join(STUB_ANSWER)
        reasoning = browser.execute_script(
            "return arguments[0].querySelector('.reasoning-text').textContent", assistant_messages(browser)[0])
        assert reasoning == "".join(STUB_REASONING)
        assert "".join(STUB_REASONING) not in first
        assert stub.requests[0]["stream"] is True
        assert stub.requests[0]["max_tokens"] == 96 and stub.requests[0]["temperature"] == 0.0
        assert stub.requests[0]["messages"][-1]["role"] == "user"
        assert stub.outcomes[0] == "completed"
    if kind == "server-fake-core":
        reasoning = browser.execute_script(
            "return arguments[0].querySelector('.reasoning-text').textContent", assistant_messages(browser)[0])
        assert reasoning.strip() == "I will add them."
        assert first.strip() == "def total(xs):\n    return sum(xs)"

    # A high temperature keeps the demo model from ending its turn before Stop is pressed; it is
    # unseeded, so a turn that still ends first is asked again (the stop path is what is tested).
    index = None
    for _ in range(5):
        index = len(assistant_messages(browser))
        submit(browser, "Now a long one: write a long module of helpers.", 300, 1.5)
        wait_until(lambda: len(assistant_messages(browser)) > index, 10, "a new assistant message")
        wait_until(lambda: streamed_text(browser, index).strip()
                   or {"done", "error"} & set(assistant_messages(browser)[index].get_attribute("class").split()), 60,
                   "second streamed text")
        classes = assistant_messages(browser)[index].get_attribute("class").split()
        assert "error" not in classes, "the long request failed"
        if "done" in classes:
            continue
        stop = browser.find_element(By.ID, "stop")
        if stop.is_enabled():
            stop.click()
        wait_until(lambda: {"stopped", "done"} & set(assistant_messages(browser)[index].get_attribute("class").split()),
                   10, "the stopped state")
        if "stopped" in assistant_messages(browser)[index].get_attribute("class").split():
            break
    else:
        raise AssertionError("the model ended each of 5 long turns before Stop could be pressed")
    stopped_at = streamed_text(browser, index)
    time.sleep(0.6)
    assert streamed_text(browser, index) == stopped_at, "text kept streaming after Stop"
    assert not browser.find_element(By.ID, "stop").is_enabled()
    assert browser.find_element(By.ID, "send").is_enabled()
    meta = browser.execute_script("return arguments[0].querySelector('.msg-meta').textContent",
                                  assistant_messages(browser)[index])
    assert "stopped" in meta
    if stub is not None:
        wait_until(lambda: stub.outcomes[1] == "disconnected", 10, "the server to see the disconnect")
        assert len(answer_text(browser, 1)) < len(LONG_TOKEN) * 1500
        assert stub.requests[1]["messages"][1] == {"role": "assistant", "content": first}


def test_chat_page_shows_the_servers_error_message(browser):
    from selenium.webdriver.common.by import By

    with StubChatServer() as stub:
        browser.get(f"http://127.0.0.1:{stub.port}/")
        submit(browser, "hello", MAX_STUB_TOKENS + 1, 0.0)
        wait_until(lambda: assistant_messages(browser)
                   and "error" in assistant_messages(browser)[0].get_attribute("class").split(), 20,
                   "the error state")
        text = assistant_messages(browser)[0].text
        assert f"max_tokens {MAX_STUB_TOKENS + 1} exceeds the maximum context" in text
        assert browser.find_element(By.ID, "send").is_enabled()
        assert not browser.find_element(By.ID, "stop").is_enabled()
