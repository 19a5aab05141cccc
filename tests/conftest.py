"""Shared pytest fixtures: tiny checkpoints made once per session, and the `gpu` marker.

A tiny checkpoint is a random transformers model (tests/tiny_models.py) plus a tiny byte-level
BPE tokenizer with a chat template (tests/tiny_tokenizer.py) in one directory, so the engine,
the offline API, the CLI and transformers (the oracle) all load the same files. The model's
EOS ids are set to the tokenizer's, as in a real checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

#: Vocabulary of every tiny checkpoint: fits both tokenizer styles, not a power of two.
TINY_VOCAB = 448

#: max_position_embeddings of tiny checkpoints unless a test asks for more.
DEFAULT_MAX_POSITIONS = 1024

#: (model arch, tokenizer style) per fixture name.
TINY_CHECKPOINTS = {
    "llama": ("llama", "llama3"),
    "qwen2": ("qwen2", "qwen3"),
    "qwen3": ("qwen3", "qwen3"),
    "qwen3_5": ("qwen3_5", "qwen3"),
}


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` on machines without an NVIDIA GPU."""
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (nvidia-smi -L found none)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def gpu_compute_capability() -> tuple:
    """The compute capability our engine runs the GPU as: the one NINFER_EMULATE_ARCH names
    (`80`, `8.0` or `sm_80`; rust_core/src/backend/cuda/emulate.rs), else the GPU's own. The
    suites run under the variable to execute older GPUs' code paths on a newer GPU."""
    v = os.environ.get("NINFER_EMULATE_ARCH", "").strip()
    if v:
        digits = v.removeprefix("sm_").replace(".", "")
        return int(digits[:-1]), int(digits[-1])
    import torch
    return torch.cuda.get_device_capability()


def device_profile(tmp_path: Path, name: str, plan: dict) -> str:
    """A device profile of this GPU (its driver name and the capability the engine runs it as)
    whose `plan` overrides the default routes (backend/cuda/plan/profile.rs); its path."""
    import torch
    major, minor = gpu_compute_capability()
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"version": 1, "device": torch.cuda.get_device_name(),
                                "compute_capability": f"{major}.{minor}", "plan": plan}))
    return str(path)


def _set_eos(model_dir: Path, eos_id: int) -> None:
    """Point the model's config.json and generation_config.json at the tokenizer's EOS id."""
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        data["eos_token_id"] = eos_id
        path.write_text(json.dumps(data, indent=2), encoding="utf-8")


class TinyCheckpoints:
    """Makes tiny checkpoints on first use and returns the cached directory afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made = {}

    def get(self, name: str, **overrides) -> Path:
        """Directory of checkpoint `name` (a key of TINY_CHECKPOINTS) with config overrides.

        The context defaults to DEFAULT_MAX_POSITIONS so tests can ask for `max_context` up to it.
        """
        overrides.setdefault("max_position_embeddings", DEFAULT_MAX_POSITIONS)
        key = (name, tuple(sorted(overrides.items())))
        if key not in self._made:
            arch, style = TINY_CHECKPOINTS[name]
            suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items())
                              if (k, v) != ("max_position_embeddings", DEFAULT_MAX_POSITIONS))
            path = self.root / (f"{name}-{suffix}" if suffix else name)
            from tiny_models import make_model
            from tiny_tokenizer import make_tokenizer

            make_model(path, arch, vocab_size=TINY_VOCAB, **overrides)
            hf_tok = make_tokenizer(path, style=style, vocab_size=TINY_VOCAB)
            _set_eos(path, int(hf_tok.eos_token_id))
            self._made[key] = path
        return self._made[key]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> TinyCheckpoints:
    """Factory of tiny checkpoints shared by the whole session."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny_checkpoints"))


@pytest.fixture(scope="session")
def llama_dir(tiny_checkpoints) -> Path:
    """A tiny random Llama with a Llama-3-style tokenizer and chat template."""
    return tiny_checkpoints.get("llama")


@pytest.fixture(scope="session")
def qwen3_dir(tiny_checkpoints) -> Path:
    """A tiny random Qwen3 with a Qwen3-style tokenizer and chat template."""
    return tiny_checkpoints.get("qwen3")


@pytest.fixture(scope="session")
def qwen3_5_dir(tiny_checkpoints) -> Path:
    """A tiny random Qwen3.5 (hybrid Gated DeltaNet + attention) with a Qwen3-style tokenizer."""
    return tiny_checkpoints.get("qwen3_5")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout's root directory."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ninfer_env() -> dict:
    """Environment for `python -m ninfer.cli` subprocesses: the tests' own, inherited, so they
    import the package the tests import (the installed one, or an in-place build that the
    developer put on PYTHONPATH)."""
    return dict(os.environ)
