"""NInfer: a fast LLM inference engine with a Rust core.

`LLM` is the offline API (batch generation in this process), `SamplingParams` the per-request
knobs, `AsyncEngine` the async-iterator API the server is built on: its `generate` yields
`Delta`s, its `submit` returns a `RequestStream` of them (both imported on first use, so the
offline path does not load the server's dependencies).
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
from ninfer.outputs import CompletionOutput, Delta, GenerationError, RequestOutput, TokenLogprob, Usage  # noqa: F401
from ninfer.sampling_params import SamplingParams  # noqa: F401

__all__ = [
    "LLM",
    "AsyncEngine",
    "Delta",
    "RequestStream",
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
    """Import `AsyncEngine` and `RequestStream` lazily from `ninfer.engine` (anyio, a server dependency)."""
    if name in ("AsyncEngine", "RequestStream"):
        from ninfer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
