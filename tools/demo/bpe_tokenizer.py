"""The demo model's byte-level BPE tokenizer and chat format.

Trained with the `tokenizers` library on the same stdlib corpus as the model, saved in the
Hugging Face layout (tokenizer.json, tokenizer_config.json, chat_template.jinja) that both
transformers and ninfer's Rust tokenizer read. The special tokens follow Qwen's ChatML names so
that the server's chat and reasoning handling treats the demo like a real Qwen3.5 model.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Control tokens (ids 0, 1, 2): skipped when decoding with skip_special_tokens."""

MARKUP_TOKENS = (THINK_OPEN, THINK_CLOSE)
"""Single tokens that stay visible in decoded text, like Qwen3's <think> markers."""

PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2-style split: words, single digits, punctuation runs, newlines, indentation runs."""

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def chat_template() -> str:
    """The demo chat template's Jinja source."""
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE with `vocab_size` ids in total, markup tokens included.

    The three control tokens get ids 0..2, the BPE merges fill the middle and the two markup
    tokens take the last two ids, so the embedding table has exactly `vocab_size` rows.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batched(texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def _batched(texts: Iterable[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def save_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`.

    tokenizer_config.json also carries the template under "chat_template", for readers that
    look only there.
    """
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template()
    fast.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = chat_template()
    config["add_bos_token"] = False
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _compiled_template():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(chat_template())


def render_chat(messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """Render `messages` with the demo template the way transformers does (jinja2 sandbox)."""
    return _compiled_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
    )


def chat_training_text(request: str, reasoning: str, answer: str, thinking: bool) -> str:
    """One chat example as the model must learn it: prompt, then the assistant's whole turn.

    With thinking on, the assistant writes its reasoning inside <think>...</think> first; with
    thinking off the prompt already holds the empty think block the template adds for
    enable_thinking=false, and the assistant writes only the answer.
    """
    messages = [{"role": "user", "content": request}]
    if thinking:
        prompt = render_chat(messages)
        return f"{prompt}{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{answer}{IM_END}\n"
    prompt = render_chat(messages, enable_thinking=False)
    return f"{prompt}{answer}{IM_END}\n"
