"""NInfer: a fast LLM inference engine with a Rust core."""

from ninfer._core import __version__  # noqa: F401
