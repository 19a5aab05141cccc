"""A byte-level BPE `tokenizer.json` with exactly the model's vocabulary, for the random bench
checkpoints (they have none): requests with a `response_format` need one, and the host's cost of
a grammar's allow-mask grows with the number of tokens it walks, so a bench of constrained
decoding needs a full-size vocabulary of real byte strings, not a few hundred tokens padded with
special ones (tests/tiny_tokenizer.py's trained vocabularies).

The vocabulary is built, not trained: ids 0 / 1 / 2 are special pad / bos / eos tokens (the
bench configs' ids: a grammar must not take the end of text for a byte), then the 256 byte
symbols, then every two-symbol string over
64 symbols (the space symbol, letters, digits and the full stop), then three-symbol strings, in a fixed order until `vocab_size` ids exist. Each
longer token has one merge (its first symbols, then its last), so every token is reachable and
every byte string encodes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

#: Special tokens at ids 0, 1, 2 (pad, bos, eos in the bench checkpoints' configs).
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>"]
#: Symbols that longer tokens are made of: the byte-level space, letters, digits, full stop.
SYMBOLS = ["\u0120", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789."]


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` (byte-level BPE) with exactly `vocab_size` ids. Raises
    ValueError naming the size when it is below the byte alphabet or above what the composed
    strings reach."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    n = len(SYMBOLS)
    least = len(SPECIALS) + len(alphabet)
    most = least + n**2 + n**3
    if not least <= vocab_size <= most:
        raise ValueError(f"vocab_size {vocab_size}: a bench tokenizer has {least} to {most} ids")
    symbols = SYMBOLS
    vocab = {s: i for i, s in enumerate(SPECIALS + alphabet)}
    merges = []
    longer = itertools.chain(
        ((a, b) for a in symbols for b in symbols),
        ((a + b, c) for a in symbols for b in symbols for c in symbols),
    )
    for left, right in longer:
        if len(vocab) == vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """`tokenizer.json` in checkpoint directory `path`."""
    build_tokenizer(vocab_size).save(str(Path(path) / "tokenizer.json"))
