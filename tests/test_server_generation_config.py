"""`ninfer serve` takes a request's missing sampling fields from the model's generation_config.json.

vLLM does the same by default (`--generation-config auto`); before this, the server sampled every
request that set no temperature at temperature 1 with no top-p/top-k whatever the model ships,
while `LLM` and `ninfer run` used the file. The fake core (tests/fake_core.py) makes the effect
visible: at temperature 0 its output ignores the seed, at temperature > 0 it follows it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from fake_core import FakeCore
from ninfer.server.protocol import ServerDefaults, sampling_fields
from ninfer.server.serve import parse_args
from server_process import ServerProcess


def _model_dir(tmp_path, config) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "generation_config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(d)


def _output(prompt_ids, max_tokens, **params) -> str:
    core = FakeCore()
    core.submit("x", prompt_ids, json.dumps(dict(params, max_tokens=max_tokens)))
    text, reason = "", None
    while reason is None:
        for d in core.step():
            text += d["text"]
            reason = d["finish_reason"]
    return text


def test_missing_fields_come_from_the_defaults_and_request_fields_win():
    d = ServerDefaults(model_id="m", sampling={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0})
    assert sampling_fields({}, d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                       "ignore_eos": False, "skip_special_tokens": True}
    p = sampling_fields({"temperature": 1.0, "top_k": 5}, d)
    assert (p["temperature"], p["top_k"], p["top_p"]) == (1.0, 5, 0.95)
    # --greedy makes the temperature 0 unless the request sets one, over the file's.
    g = ServerDefaults(model_id="m", greedy=True, sampling={"temperature": 0.6})
    assert sampling_fields({}, g)["temperature"] == 0.0
    assert sampling_fields({"temperature": 0.3}, g)["temperature"] == 0.3
    # No file, no defaults: the request's fields only.
    assert "temperature" not in sampling_fields({}, ServerDefaults(model_id="m"))


def test_parse_args_reads_auto_dir_and_vllm(tmp_path):
    model = _model_dir(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                  "repetition_penalty": 1.05, "max_new_tokens": 9, "bos_token_id": 1})
    a = parse_args([model])
    assert a.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                     "max_tokens": 9}
    assert a.default_max_tokens == 9
    # The flag wins over the file's max_new_tokens.
    assert parse_args([model, "--default-max-tokens", "4"]).default_max_tokens == 4
    assert parse_args([model, "--generation-config", "vllm"]).generation_defaults == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert parse_args([model, "--generation-config", str(other)]).generation_defaults == {"temperature": 0.0}
    # A model without the file: no defaults, no error.
    bare = tmp_path / "bare"
    bare.mkdir()
    assert parse_args([str(bare)]).generation_defaults == {}


@pytest.mark.parametrize("config,needle", [
    ("{not json", "malformed file"),
    ("[1, 2]", "not a JSON object"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
])
def test_a_bad_generation_config_stops_the_start_naming_the_file(tmp_path, capsys, config, needle):
    model = _model_dir(tmp_path, config)
    with pytest.raises(SystemExit) as e:
        parse_args([model])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "generation_config.json" in err


def test_generation_config_dir_without_the_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--core-factory", "fake_core:FakeCore", "--generation-config", str(tmp_path)])
    assert e.value.code == 2 and "no generation_config.json" in capsys.readouterr().err


def test_served_requests_sample_with_the_model_defaults(tmp_path):
    # do_sample false: a request without a temperature is greedy, so its seed changes nothing.
    model = _model_dir(tmp_path, {"do_sample": False, "max_new_tokens": 6})
    ids = [104, 105]
    body = {"prompt": ids, "seed": 7}
    greedy, seeded = _output(ids, 6, temperature=0.0), _output(ids, 6, temperature=1.0, seed=7)
    assert greedy != seeded
    with ServerProcess(["--core-factory", "fake_core:FakeCore", model]) as s:
        r = httpx.post(s.url + "/v1/completions", json=body).json()
        assert r["choices"][0]["text"] == greedy and r["usage"]["completion_tokens"] == 6
        # The request's own temperature wins.
        r = httpx.post(s.url + "/v1/completions", json=dict(body, temperature=1.0)).json()
        assert r["choices"][0]["text"] == seeded
        assert "request defaults from" in s.log() and "temperature=0.0" in s.log()
    with ServerProcess(["--core-factory", "fake_core:FakeCore", model, "--generation-config", "vllm"]) as s:
        r = httpx.post(s.url + "/v1/completions", json=dict(body, max_tokens=6)).json()
        assert r["choices"][0]["text"] == seeded


def test_sampling_flags_are_server_defaults_over_the_file(tmp_path):
    model = _model_dir(tmp_path, {"temperature": 0.7, "top_k": 20})
    a = parse_args([model, "--temperature", "0", "--top-p", "0.9", "--seed", "3"])
    assert a.flag_defaults == {"temperature": 0.0, "top_p": 0.9, "seed": 3}
    assert parse_args([model]).flag_defaults == {}


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "--temperature -1.0"),
    (["--top-p", "0"], "--top-p 0.0"),
    (["--top-k", "many"], "--top-k must be an integer, got 'many'"),
    (["--presence-penalty", "3"], "--presence-penalty 3.0"),
    (["--greedy", "--temperature", "0.7"], "--greedy and --temperature 0.7 contradict"),
])
def test_bad_sampling_flags_exit_2_naming_flag_and_value(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as e:
        parse_args(["--core-factory", "fake_core:FakeCore", *args])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_served_requests_take_the_flag_defaults(tmp_path):
    model = _model_dir(tmp_path, {"do_sample": False})
    ids = [104, 105]
    seeded = _output(ids, 5, temperature=1.0, seed=11)
    assert seeded != _output(ids, 5, temperature=0.0)
    # --temperature beats the file's greedy default; --seed applies to requests without one.
    with ServerProcess(["--core-factory", "fake_core:FakeCore", model, "--temperature", "1", "--seed", "11"]) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": ids, "max_tokens": 5}).json()
        assert r["choices"][0]["text"] == seeded
        assert "flags" in s.log() and "seed=11" in s.log()
