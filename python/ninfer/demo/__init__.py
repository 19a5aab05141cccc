"""The bundled demo model (see MODEL_CARD.md; the code that trained it is the repository's
tools/demo/, not part of the package).

`MODEL_DIR` is what `ninfer serve` uses when no model is given; importing this package loads
nothing heavy.
"""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
"""The demo model's Hugging Face-layout directory (config, bf16 safetensors with mtp.*, tokenizer)."""
