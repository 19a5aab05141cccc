"""The benchmark scripts under benches/ as modules (they are scripts, not a package), for the
tests of their argument checks and CPU dry runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHES = Path(__file__).resolve().parent.parent / "benches"


def load_bench(name: str):
    """benches/NAME.py, imported afresh."""
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
