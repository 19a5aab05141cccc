"""`ninfer draft-vocab MODEL --corpus FILE... [--size N] [--out PATH]`: the draft vocabulary of
`--lm-head-draft`.

Counts the token ids the model's own tokenizer gives the corpus files and writes them, most
frequent first (ties: the lower id first), to `draft_vocab.json` in the model directory (or
`--out`). The file is a JSON object:

    {"format": "ninfer.draft_vocab", "vocab_size": V, "corpus": [names], "corpus_tokens": T,
     "token_ids": [most frequent first], "counts": [their counts]}

The engine reads only `token_ids` and takes its first `--lm-head-draft-size` entries
(rust_core/src/spec/draft_vocab.rs). Ids the corpus never produced are left out, so a small
corpus gives a short list; `--size` caps it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable, List, Optional

#: The file `--lm-head-draft` reads in the model directory.
DRAFT_VOCAB_FILE = "draft_vocab.json"


def count_tokens(tokenizer, texts: Iterable[str]) -> Counter:
    """How often each id occurs in the tokenized `texts` (no special tokens added)."""
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, False))
    return counts


def ranked(counts: Counter, size: Optional[int] = None) -> List[tuple]:
    """(id, count) most frequent first, ties by id, at most `size` of them."""
    order = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return order if size is None else order[:size]


def draft_vocab_record(counts: Counter, vocab_size: int, corpus: List[str], size: Optional[int] = None) -> dict:
    """The JSON object `draft_vocab.json` holds."""
    top = ranked(counts, size)
    return {
        "format": "ninfer.draft_vocab",
        "vocab_size": vocab_size,
        "corpus": corpus,
        "corpus_tokens": sum(counts.values()),
        "token_ids": [t for t, _ in top],
        "counts": [c for _, c in top],
    }


def write(path: Path, record: dict) -> None:
    """Write `record` compactly (one id list per line keeps the file small and diffable)."""
    body = {k: v for k, v in record.items() if k not in ("token_ids", "counts")}
    text = json.dumps(body, indent=1)[:-2]
    text += ',\n "token_ids": ' + json.dumps(record["token_ids"], separators=(",", ":"))
    text += ',\n "counts": ' + json.dumps(record["counts"], separators=(",", ":")) + "\n}\n"
    path.write_text(text)


def build_parser(prog: str = "ninfer draft-vocab") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Count the model tokenizer's ids over a corpus and write the "
                                                        "draft vocabulary of --lm-head-draft, most frequent first.")
    p.add_argument("model", metavar="MODEL", help="model directory (its tokenizer.json tokenizes the corpus)")
    p.add_argument("--corpus", metavar="FILE", nargs="+", required=True,
                   help="text files to count over (UTF-8; a directory: every file under it)")
    p.add_argument("--size", metavar="N", type=int, default=None,
                   help="keep the N most frequent ids (default: every id the corpus produced)")
    p.add_argument("--out", metavar="PATH", default=None, help=f"output file (default: MODEL/{DRAFT_VOCAB_FILE})")
    return p


def corpus_files(paths: List[str]) -> List[Path]:
    """The files named, directories expanded to the files under them (sorted)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"--corpus {p}: no such file or directory")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.size is not None and args.size < 1:
        parser.error(f"--size {args.size} must be at least 1")
    try:
        files = corpus_files(args.corpus)
    except FileNotFoundError as e:
        parser.error(str(e))
    from ninfer import _core

    tokenizer = _core.Tokenizer(os.fspath(args.model))
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    counts = count_tokens(tokenizer, texts)
    if not counts:
        parser.error("the corpus gave no tokens")
    record = draft_vocab_record(counts, tokenizer.vocab_size, [f.name for f in files], args.size)
    out = Path(args.out) if args.out else Path(args.model) / DRAFT_VOCAB_FILE
    write(out, record)
    print(f"ninfer draft-vocab: {len(record['token_ids'])} ids of {record['corpus_tokens']} corpus tokens "
          f"({len(files)} files) -> {out}", file=sys.stderr)
    return 0
