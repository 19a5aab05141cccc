"""The startup memory ledger: what the weights, KV pool and recurrent state take, and what is left.

The engine plans its memory before serving (`_core.Engine.info()`); this turns that plan into the
lines `ninfer serve` and `ninfer run` print, so a user sees why a context fits or not.
"""

from __future__ import annotations

import os


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def available_host_bytes() -> int | None:
    """Free physical memory of this machine (the CPU backend's pool), or None if unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_ledger(info: dict, plan: bool = False) -> str:
    """One block of text from `Engine.info()`, or with `plan` from `_core.plan()` (`ninfer
    plan`), whose weights, KV and state lines are the same arithmetic and print the same
    numbers; a plan's workspace is an estimate, the engine's the measured high-water mark."""
    kv_tokens = info.get("kv_capacity_tokens", 0)
    lines = [
        f"memory ledger (device {info.get('device', '?')}):",
        f"  weights        {_mib(info.get('weight_bytes', 0))}",
        f"  KV cache       {_mib(info.get('kv_bytes', 0))} = {kv_tokens:,} tokens x "
        f"{info.get('kv_bytes_per_token', 0):,} B/token ({info.get('num_blocks', 0):,} blocks of "
        f"{info.get('block_size', 0)})",
    ]
    if info.get("state_bytes"):
        slots = info.get("state_slots_running", 0) + info.get("state_slots_snapshot", 0)
        lines.append(f"  GDN state      {_mib(info['state_bytes'])} = {slots} slots x "
                     f"{info.get('state_bytes_per_slot', 0):,} B/slot")
    if "workspace_bytes" in info:
        lines.append(f"  workspace      {_mib(info['workspace_bytes'])}" + (" (estimate)" if plan else ""))
    lines.append(f"  total planned  {_mib(info.get('total_bytes', 0))}")
    if plan:
        lines.append(_limits(info))
        return "\n".join(lines)
    free = info.get("device_free_bytes")
    if free is None and str(info.get("device", "cpu")).startswith("cpu"):
        free = available_host_bytes()
    if free is not None:
        lines.append(f"  left after plan {_mib(max(free, 0))} of free memory found at start")
    lines.append(_limits(info))
    return "\n".join(lines)


def _limits(info: dict) -> str:
    return (f"  max context {info.get('max_context', '?'):,} tokens; max concurrency "
            f"{info.get('max_concurrency', '?')}; prefill chunk {info.get('prefill_chunk', '?')}")
