"""Tiny byte-level BPE tokenizers in the Qwen3 and Llama 3 styles, for tests.

Test models need a real `tokenizer.json` + `tokenizer_config.json` + chat template laid out
exactly as transformers saves them, with a small vocabulary of a known size. `make_tokenizer`
trains one deterministically on a built-in corpus and saves it with transformers'
`PreTrainedTokenizerFast.save_pretrained`, so the files are what transformers writes and
transformers itself can serve as the oracle for encode, decode and chat templates.
"""

from __future__ import annotations

import random
from pathlib import Path

TEMPLATES_DIR = Path(__file__).parent / "templates"

# Pre-tokenization patterns of the two styles: contractions, letter runs with one leading
# non-letter, digits (one at a time for Qwen, up to three for Llama 3), punctuation runs with
# trailing newlines, newline runs, and whitespace that does not swallow the next word's space.
_QWEN3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in id order after the trained vocabulary. `special=False` tokens are kept
# by decode(skip_special_tokens=True), as in Qwen3 where <think> and <tool_call> survive it.
_STYLE_TOKENS = {
    "qwen3": [
        ("<|endoftext|>", True),
        ("<|im_start|>", True),
        ("<|im_end|>", True),
        ("<tool_call>", False),
        ("</tool_call>", False),
        ("<tool_response>", False),
        ("</tool_response>", False),
        ("<think>", False),
        ("</think>", False),
    ],
    "llama3": [
        ("<|begin_of_text|>", True),
        ("<|end_of_text|>", True),
        ("<|start_header_id|>", True),
        ("<|end_header_id|>", True),
        ("<|eot_id|>", True),
        ("<|python_tag|>", True),
    ],
}

_STYLE_NAMED = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": None},
}

_STYLE_TEMPLATE = {"qwen3": "qwen3.jinja", "llama3": "llama3.jinja"}

_BASE_TEXT = """\
The quick brown fox jumps over the lazy dog. It's a sunny day, isn't it? We'll see.
Once upon a time there was a tiny language model that wanted to answer every question.
It read books, wrote poems, solved equations like 12 + 34 = 46 and 3.14159 * 2 = 6.28318.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for (let i = 0; i < 10; i++) { console.log(`value: ${i}`); }
SELECT name, age FROM users WHERE age > 21 ORDER BY name;
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
The weather in Paris is 21 degrees and sunny; in Tokyo it is raining.
今天天气很好，我们去公园散步吧。机器学习和自然语言处理很有趣。
東京は雨です。こんにちは、世界！
안녕하세요 세계
Emoji time: 😀 🎉 👍🏽 🚀 ❤️ and symbols like © ® ™ € £ ¥ → ← ∑ ∞.
Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم
user assistant system tool thinking reasoning answer question function call result
"""

_WORDS = (
    "model token cache prefix decode prefill batch stream request response server engine "
    "kernel tensor matrix vector layer attention sampling temperature probability the a of and "
    "to in is that for it with as on be at by this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than"
).split()


def _corpus(seed: int) -> list[str]:
    """The base text plus seeded random sentences, so training sees enough pair statistics."""
    rng = random.Random(seed)
    lines = _BASE_TEXT.splitlines()
    for _ in range(400):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        lines.append(sentence)
    return lines


def _backend(style: str, n_trained: int, seed: int):
    """Train the byte-level BPE model: `n_trained` ids before any added token."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    split = _QWEN3_SPLIT if style == "qwen3" else _LLAMA3_SPLIT
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    if style == "qwen3":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=n_trained,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() > n_trained:
        raise RuntimeError(f"trainer produced {tok.get_vocab_size()} ids, wanted at most {n_trained}")
    if style == "qwen3":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_tokenizer(path, style: str = "qwen3", vocab_size: int = 512, seed: int = 0, template: str | None = None):
    """Write a tiny tokenizer of `style` ("qwen3" or "llama3") into directory `path`.

    The vocabulary (trained ids + the style's special tokens + padding tokens) has exactly
    `vocab_size` entries. `template` names a file in tests/templates/ (default: the style's own).
    Returns the transformers tokenizer that was saved.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    if style not in _STYLE_TOKENS:
        raise ValueError(f"unknown tokenizer style {style!r}; expected one of {sorted(_STYLE_TOKENS)}")
    specials = _STYLE_TOKENS[style]
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is below the {minimum} a byte-level {style} tokenizer needs")

    backend = _backend(style, vocab_size - len(specials), seed)
    added = [AddedToken(content, special=special, normalized=False) for content, special in specials]
    short = vocab_size - len(specials) - backend.get_vocab_size()
    added += [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(short)]
    backend.add_tokens(added)
    if backend.get_vocab_size() != vocab_size:
        raise RuntimeError(f"built {backend.get_vocab_size()} ids, wanted {vocab_size}")

    template_text = (TEMPLATES_DIR / (template or _STYLE_TEMPLATE[style])).read_text(encoding="utf-8")
    named = {k: v for k, v in _STYLE_NAMED[style].items() if v is not None}
    extra = {"add_bos_token": True} if style == "llama3" else {}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template_text,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        **named,
        **extra,
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(path))
    return hf
