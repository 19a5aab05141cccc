"""The demo model's training corpus: the CPython standard library's own .py sources.

Every machine with Python has this corpus offline, under a license (PSF) that allows
redistributing a model trained on it. This module lists the files deterministically, splits off
a held-out ~2% by a hash of each file's path (so the split does not depend on the file order or
on which other files exist), fingerprints the exact file set, and turns documented functions into
synthetic chat examples (docstring -> code) so the bundled model answers in the chat format.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

HELDOUT_MODULUS = 50
"""One file in HELDOUT_MODULUS (by path hash) is held out: about 2% of the files."""

MAX_FUNCTION_LINES = 60
"""Longer functions are not turned into chat examples: they would not fit a training window."""


@dataclass(frozen=True)
class SourceFile:
    """One stdlib source file: its path relative to the stdlib root and its UTF-8 text."""

    relpath: str
    text: str


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    """The running interpreter's version, recorded with the corpus fingerprint."""
    return sys.version.split()[0]


def list_source_files(root: Path, limit: int | None = None) -> list[SourceFile]:
    """All .py files under `root` (third-party site-packages excluded), sorted by path.

    Files that are not valid UTF-8 (a few deliberately broken test inputs) are skipped, so the
    tokenizer only ever sees text. `limit` keeps the first N files (for quick smoke runs).
    """
    files: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        files.append(SourceFile(rel, text))
        if limit is not None and len(files) >= limit:
            break
    return files


def is_heldout(relpath: str) -> bool:
    """Whether a file belongs to the held-out set: decided by its path alone."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def fingerprint(files: list[SourceFile]) -> str:
    """A sha256 over every file's path and content: equal fingerprints mean equal corpora."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode("utf-8"))
        h.update(b"\0")
        h.update(hashlib.sha256(f.text.encode("utf-8")).digest())
    return h.hexdigest()


@dataclass(frozen=True)
class ChatExample:
    """One synthetic chat turn: a docstring as the request, the function as the answer."""

    request: str
    reasoning: str
    answer: str


def _module_name(relpath: str) -> str:
    name = relpath[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _summary(doc: str) -> str | None:
    """The docstring's first paragraph on one line, or None when it is too short to ask for."""
    first = doc.strip().split("\n\n")[0]
    line = " ".join(part.strip() for part in first.splitlines())
    if len(line) < 12 or len(line) > 300:
        return None
    return line


REQUEST_FORMS = (
    "Write a Python function: {summary}",
    "{summary} Write this in Python.",
    "Implement in Python: {summary}",
    "Python function, please. {summary}",
)
"""How a user might ask for a function; one is picked per example (seeded)."""


def chat_examples(source: SourceFile, rng: random.Random) -> list[ChatExample]:
    """Chat examples from every documented function of `source` that is short enough.

    The reasoning names the module and signature (the kind of short plan a reasoning model
    writes); the answer is the function's source in a fenced code block.
    """
    try:
        tree = ast.parse(source.text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = source.text.splitlines()
    module = _module_name(source.relpath)
    examples: list[ChatExample] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None:
            continue
        summary = _summary(doc)
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        if summary is None or node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
            continue
        code = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
        header = lines[node.lineno - 1].strip()
        request = rng.choice(REQUEST_FORMS).format(summary=summary)
        reasoning = f"This is like `{node.name}` in the `{module}` module. I will start with `{header}`"
        examples.append(ChatExample(request, reasoning, f"```python\n{code}\n```"))
    return examples
