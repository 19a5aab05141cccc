"""Server behaviour around the requests: loading, disconnects, auth, queue limits, flags."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import httpx
import pytest

from ninfer.server.metrics import parse_metrics
from server_process import NINFER, ROOT, ServerProcess, env_with_tests_dir, free_port

MODEL = "fake-model"


def metrics(url) -> dict:
    return parse_metrics(httpx.get(url + "/metrics").text)


def wait_for(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_health_is_503_while_loading_then_200():
    with ServerProcess(["--core-factory", "fake_core:SlowLoadingFakeCore"], wait_ready=False) as s:
        assert wait_for(lambda: _status(s.url + "/health") == 503, 10)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        s.wait_ready(20)
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}


def _status(url):
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


def test_client_disconnect_mid_stream_frees_kv_blocks():
    with ServerProcess(["--core-factory", "fake_core:SlowFakeCore", "--model-id", MODEL]) as s:
        baseline = metrics(s.url)["ninfer_kv_blocks_used"]
        body = {"prompt": "a long running request", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            assert metrics(s.url)["ninfer_kv_blocks_used"] > baseline
        assert wait_for(lambda: metrics(s.url)["ninfer_kv_blocks_used"] == baseline
                        and metrics(s.url)["ninfer_num_requests_running"] == 0)
        assert metrics(s.url)['ninfer_requests_total{finish_reason="abort"}'] == 1


def test_non_streaming_client_disconnect_aborts_request():
    with ServerProcess(["--core-factory", "fake_core:SlowFakeCore", "--model-id", MODEL]) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400}, timeout=0.3)
        assert wait_for(lambda: metrics(s.url).get('ninfer_requests_total{finish_reason="abort"}') == 1)
        assert metrics(s.url)["ninfer_kv_blocks_used"] == 0


def test_api_key_required_when_set():
    with ServerProcess(["--core-factory", "fake_core:FakeCore", "--api-key", "sekret"]) as s:
        body = {"prompt": "x", "max_tokens": 1}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.post(s.url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200


def test_full_queue_answers_429_with_retry_after():
    with ServerProcess(["--core-factory", "fake_core:SlowFakeCore", "--max-concurrency", "1", "--max-queue", "1"]) as s:
        body = {"prompt": "x", "max_tokens": 300, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as a, \
                httpx.stream("POST", s.url + "/v1/completions", json=body) as b:
            assert a.status_code == 200 and b.status_code == 200
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"


def test_default_max_tokens_flag_applies_when_absent():
    with ServerProcess(["--core-factory", "fake_core:FakeCore", "--default-max-tokens", "7"]) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}).json()
        assert r["usage"]["completion_tokens"] == 7
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}).json()
        assert r["usage"]["completion_tokens"] == 3


def test_log_stats_interval_prints_summary_lines():
    with ServerProcess(["--core-factory", "fake_core:FakeCore", "--log-stats-interval-ms", "100"]) as s:
        httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert wait_for(lambda: "gen_tok/s=" in s.log(), 5)


def _serve(*args):
    """`ninfer serve ARGS` to its exit, on a free port unless ARGS name one."""
    return subprocess.run([*NINFER, "serve", "--port", str(free_port()), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env_with_tests_dir(os.environ), timeout=60)


@pytest.mark.parametrize("flag", ["--tp", "--devices", "--host-kv-mib", "--vision", "--gdn-state-fp16"])
def test_later_flags_are_refused_as_not_supported_yet(flag):
    r = _serve("--core-factory", "fake_core:FakeCore", flag, "2")
    assert r.returncode == 2 and f"{flag} is not supported yet" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--port", "abc"], "--port"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--kv-capacity", "lots"], "--kv-capacity"),
    (["--kv-dtype", "int8"], "--kv-dtype int8 is not supported yet"),
    # a name no backend keeps is refused as a flag, saying what auto keeps on each
    (["--kv-dtype", "fp8"], "bf16 on a GPU, f16 on sm_70/sm_75, float32 on the CPU"),
    (["--max-context", "4096", "--kv-capacity", "100"], "--kv-capacity 100"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--logits-dtype", "bf16"], "--logits-dtype"),
])
def test_bad_flag_values_exit_2_naming_flag_and_value(args, needle):
    r = _serve("--core-factory", "fake_core:FakeCore", *args)
    assert r.returncode == 2 and needle in r.stderr
    assert args[1] in r.stderr


def test_missing_model_directory_is_a_clear_error(tmp_path):
    r = _serve(str(tmp_path / "nope"))
    assert r.returncode == 2 and "is not a directory" in r.stderr
    assert json.dumps(str(tmp_path / "nope"))[1:-1] in r.stderr


def test_failure_mid_stream_is_an_sse_error_event_and_server_recovers():
    with ServerProcess(["--core-factory", "fake_core:FailingFakeCore"]) as s:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        assert "device lost" in events[-1]["error"]["message"]
        assert events[-1]["error"]["type"] == "server_error"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_cors_flag_allows_the_origin():
    with ServerProcess(["--core-factory", "fake_core:FakeCore", "--cors", "http://example.com"]) as s:
        r = httpx.options(s.url + "/v1/chat/completions", headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "http://example.com"


def test_index_page_answers_and_unknown_route_is_openai_404():
    with ServerProcess(["--core-factory", "fake_core:FakeCore"]) as s:
        assert httpx.get(s.url + "/").status_code == 200
        r = httpx.get(s.url + "/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_kv_dtype_the_backend_does_not_keep_stops_the_server_naming_its_type(qwen3_dir):
    """`--kv-dtype bf16` passes the flag check (a GPU keeps bf16) and reaches the core, which
    refuses it on the CPU naming float32."""
    r = _serve(str(qwen3_dir), "--device", "cpu", "--kv-dtype", "bf16")
    assert r.returncode == 1 and "bf16 is not supported on cpu: its KV cache is float32" in r.stderr, r.stderr


def test_model_that_fails_to_load_stops_the_server_with_status_1(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = _serve(str(tmp_path))
    assert r.returncode == 1 and "model load failed" in r.stderr


def test_a_port_in_use_exits_2_naming_it_before_serving():
    """The bundled demo model's server on a port another socket listens on: refused as a flag,
    before the "serving on" line and before the model loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = _serve("--port", str(port))
        elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in r.stderr, r.stderr
    assert "serving" not in r.stderr and "loaded" not in r.stderr, r.stderr
    assert elapsed < 30
