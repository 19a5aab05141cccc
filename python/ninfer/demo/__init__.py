"""The bundled demo model (see MODEL_CARD.md; the code that trained it is the repository's
tools/demo/, not part of the package).

`MODEL_DIR` is what `ninfer serve` uses when no model is given; importing this package loads
nothing heavy.
"""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
"""The demo model's Hugging Face-layout directory (config, bf16 safetensors with mtp.*, tokenizer)."""

DFLASH_DIR = Path(__file__).resolve().parent / "dflash"
"""The demo model's DFlash drafter (config.json and bf16 model.safetensors in the public
DFlashDraftModel layout; trained by the repository's tools/dflash/train.py)."""


def default_drafter(model_dir, spec, drafter):
    """The drafter `--spec dflash` uses: `drafter` when given, else the shipped demo drafter
    when `model_dir` is the bundled demo model, else None (the engine then names --drafter)."""
    import os

    if drafter is not None or spec is None or str(spec).strip().lower() != "dflash" or model_dir is None:
        return None if drafter is None else os.fspath(drafter)
    return str(DFLASH_DIR) if is_demo_model(model_dir) and (DFLASH_DIR / "config.json").is_file() else None


def is_demo_model(model_dir) -> bool:
    """Whether `model_dir` is the bundled demo model: this package's directory, or a copy of it
    (a checkout's, a test's) with the same config.json and weights file size."""
    import os

    path = Path(os.fspath(model_dir))
    try:
        if path.resolve() == MODEL_DIR:
            return True
        return ((path / "config.json").read_bytes() == (MODEL_DIR / "config.json").read_bytes()
                and (path / "model.safetensors").stat().st_size == (MODEL_DIR / "model.safetensors").stat().st_size)
    except OSError:
        return False


HELDOUT_TOKENS = Path(__file__).resolve().parent / "heldout_tokens.json"
"""Held-out token windows (never trained on) that the model card's perplexity is measured on."""


def perplexity(logits_per_sequence, sequences) -> float:
    """exp(mean NLL of tokens 1..L-1 given their prefix), pooled over all sequences: how the
    model card's held-out perplexity is computed (`logits_per_sequence[i]` is `[L, vocab]`)."""
    import math

    import numpy as np

    nll, count = 0.0, 0
    for logits, ids in zip(logits_per_sequence, sequences):
        logits = np.asarray(logits, dtype=np.float64)[:-1]
        top = logits.max(axis=-1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[:, 0]
        targets = np.asarray(ids[1:])
        nll += float((logz - logits[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    return math.exp(nll / count)
