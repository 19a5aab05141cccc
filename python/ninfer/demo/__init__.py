"""The bundled demo model and the script that trained it (see MODEL_CARD.md).

`MODEL_DIR` is what `ninfer serve` uses when no model is given; importing this package loads
nothing heavy (the training modules import torch and transformers only when run).
"""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
"""The demo model's Hugging Face-layout directory (config, bf16 safetensors with mtp.*, tokenizer)."""
