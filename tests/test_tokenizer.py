"""`_core.Tokenizer` encodes and decodes exactly as transformers does on the same directory."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_tokenizer import make_tokenizer  # noqa: E402

from ninfer import _core  # noqa: E402

transformers = pytest.importorskip("transformers")

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it?",
    "whitespace": "  leading spaces\n\n\ttabs and\r\nwindows newlines   trailing  ",
    "cjk": "今天天气很好，我们去公园散步吧。東京は雨です。안녕하세요",
    "emoji": "Emoji: 😀🎉 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and ❤️",
    "code": 'def f(x: int) -> int:\n    return {"a": [1, 2, 3]}[x] ** 2  # comment\n\nfor i in range(10): print(i)\n',
    "numbers": "3.14159 1234567890 0xFF 1e-5 -42",
    "specials_inline": "<|im_start|>user\nhi<|im_end|> <|begin_of_text|><think>x</think>",
    "unseen_script": "ἀρχὴ ⅷ ﬁ café Å Å",
    "empty": "",
}

STYLES = {"qwen3": 512, "llama3": 600}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for style, size in STYLES.items():
        path = tmp_path_factory.mktemp(style)
        make_tokenizer(path, style=style, vocab_size=size)
        out[style] = path
    return out


@pytest.fixture(scope="module")
def pairs(dirs):
    """(ours, transformers') for each style."""
    return {style: (_core.Tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))) for style, path in dirs.items()}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(pairs, style, name, add_special_tokens):
    ours, hf = pairs[style]
    text = TEXTS[name]
    assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(pairs, style, name, skip_special_tokens):
    ours, hf = pairs[style]
    ids = hf.encode(TEXTS[name], add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("style", STYLES)
def test_decode_of_arbitrary_ids_matches_transformers(pairs, style):
    """Random ids split UTF-8 sequences and mix in special tokens; both sides must agree."""
    ours, hf = pairs[style]
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(STYLES[style]) for _ in range(rng.randint(1, 40))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("style", STYLES)
def test_long_text_round_trips_and_matches(pairs, style):
    ours, hf = pairs[style]
    text = " ".join(TEXTS.values()) * 40
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("style", STYLES)
def test_special_tokens_and_vocab_match_transformers(pairs, style):
    ours, hf = pairs[style]
    assert ours.bos_token == hf.bos_token
    assert ours.eos_token == hf.eos_token
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == len(hf) == STYLES[style]
    for token in list(hf.get_added_vocab()) + ["Ġthe", "definitely-not-a-token"]:
        assert ours.token_to_id(token) == hf.convert_tokens_to_ids(token) or (
            ours.token_to_id(token) is None and hf.convert_tokens_to_ids(token) is None
        ), token
    assert ours.has_chat_template


@pytest.mark.parametrize("style,vocab_size", [("qwen3", 300), ("qwen3", 2048), ("llama3", 262), ("llama3", 3000)])
def test_tiny_tokenizer_has_exactly_the_requested_vocab(tmp_path, style, vocab_size):
    make_tokenizer(tmp_path, style=style, vocab_size=vocab_size)
    assert len(transformers.AutoTokenizer.from_pretrained(str(tmp_path))) == vocab_size
    assert _core.Tokenizer(str(tmp_path)).vocab_size == vocab_size


def test_tiny_tokenizer_is_deterministic(tmp_path):
    make_tokenizer(tmp_path / "a", style="qwen3", vocab_size=700)
    make_tokenizer(tmp_path / "b", style="qwen3", vocab_size=700)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_tiny_tokenizer_rejects_a_vocab_below_the_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="below"):
        make_tokenizer(tmp_path, style="qwen3", vocab_size=200)


def test_missing_tokenizer_json_raises_model_load_error_naming_the_path(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(_core.ModelLoadError, match=str(tmp_path / "tokenizer.json")):
        _core.Tokenizer(str(tmp_path))


def test_malformed_tokenizer_json_raises_model_load_error_naming_the_path(tmp_path, dirs):
    good = (dirs["qwen3"] / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(good[: len(good) // 2])
    with pytest.raises(_core.ModelLoadError, match=str(tmp_path / "tokenizer.json")):
        _core.Tokenizer(str(tmp_path))


def test_malformed_tokenizer_config_raises_model_load_error_naming_the_path(tmp_path, dirs):
    (tmp_path / "tokenizer.json").write_text((dirs["qwen3"] / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(_core.ModelLoadError, match=str(tmp_path / "tokenizer_config.json")):
        _core.Tokenizer(str(tmp_path))


def test_add_bos_token_in_config_is_treated_like_transformers(tmp_path, dirs):
    """Older checkpoints set add_bos_token in tokenizer_config.json; transformers 5 lets
    tokenizer.json's post-processor decide instead, and so must we."""
    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_text((dirs["qwen3"] / name).read_text())
    config = json.loads((dirs["qwen3"] / "tokenizer_config.json").read_text())
    config.update({"bos_token": "<|endoftext|>", "add_bos_token": True, "add_eos_token": True})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = _core.Tokenizer(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("hello world", ""):
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
