"""The README's async-iterator example, run as written against the bundled demo model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- async-example:"


def readme_example() -> str:
    """The ```python block right after the async-example marker."""
    text = README.read_text(encoding="utf-8")
    after = text[text.index(MARKER):]
    m = re.search(r"```python\n(.*?)```", after, re.S)
    assert m is not None, "no python block after the async-example marker"
    return m.group(1)


def test_the_readme_async_example_streams_two_requests_and_cancels_one():
    proc = subprocess.run([sys.executable, "-c", readme_example()], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3, proc.stdout
    for line in lines[:2]:
        reason, tokens, text = line.split(" ", 2)
        assert reason in ("stop", "length") and 0 < int(tokens) <= 24 and text.startswith("'"), line
    assert lines[2] == "cancelled: True"
