"""The bundled demo model's draft vocabulary (`--lm-head-draft`): token ids counted over the
code files of its training corpus (corpus.py: the standard library's .py files, held-out files
excluded by the same path rule), with the demo's own tokenizer, most frequent first.

    .ci/dev-build && PYTHONPATH=python python tools/demo/draft_vocab.py [--root /usr/lib/python3.12]

writes python/ninfer/demo/model/draft_vocab.json (as `ninfer draft-vocab` would from those
files). The stdlib is the running interpreter's unless --root names another; the record names
the directory counted. The model was trained on /usr/lib/python3.12 (Debian's, without the test
package); the shipped file was counted over /usr/lib/python3.11, the closest stdlib at hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="stdlib directory (default: this interpreter's)")
    ap.add_argument("--model", type=Path, default=REPO / "python" / "ninfer" / "demo" / "model")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from ninfer import _core
    from ninfer.draft_vocab import DRAFT_VOCAB_FILE, count_tokens, draft_vocab_record, write

    root = args.root or corpus.stdlib_root()
    files = [f for f in corpus.list_source_files(root) if not corpus.is_heldout(f.relpath)]
    tokenizer = _core.Tokenizer(str(args.model))
    counts = count_tokens(tokenizer, (f.text for f in files))
    name = f"standard library .py files under {root}, held-out files excluded (tools/demo/corpus.py): " \
           f"{len(files)} files, fingerprint {corpus.fingerprint(files)[:16]}"
    record = draft_vocab_record(counts, tokenizer.vocab_size, [name])
    out = args.out or args.model / DRAFT_VOCAB_FILE
    write(out, record)
    print(f"{len(record['token_ids'])} ids of {record['corpus_tokens']} tokens -> {out}")


if __name__ == "__main__":
    main()
