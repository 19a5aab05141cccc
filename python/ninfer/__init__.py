"""NInfer: a fast LLM inference engine with a Rust core.

`LLM` is the offline API (batch generation in this process), `SamplingParams` the per-request
knobs, `AsyncEngine` the async-iterator API the server is built on (imported on first use, so
the offline path does not load the server's dependencies).
"""

from ninfer._core import (  # noqa: F401
    ContextOverflowError,
    DeviceError,
    InvalidRequestError,
    ModelLoadError,
    NinferError,
    OutOfMemoryError,
    UnsupportedError,
    __version__,
)
from ninfer.llm import LLM  # noqa: F401
from ninfer.outputs import CompletionOutput, GenerationError, RequestOutput, TokenLogprob, Usage  # noqa: F401
from ninfer.sampling_params import SamplingParams  # noqa: F401

__all__ = [
    "LLM",
    "AsyncEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TokenLogprob",
    "Usage",
    "NinferError",
    "ModelLoadError",
    "UnsupportedError",
    "InvalidRequestError",
    "ContextOverflowError",
    "GenerationError",
    "OutOfMemoryError",
    "DeviceError",
    "__version__",
]


def __getattr__(name: str):
    """Import `AsyncEngine` lazily from `ninfer.engine` (the server's dependencies)."""
    if name == "AsyncEngine":
        from ninfer.engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
