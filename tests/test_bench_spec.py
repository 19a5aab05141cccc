"""The verify-step timing hook benches/gpu_spec.py measures with (`_core.Model.step_seconds`):
a plain decode step and a verify step of K + 1 rows as the engine runs them, on a tiny
checkpoint on the CPU (the hybrid one copies each sequence's recurrent state aside, as the
engine does for its rollback)."""

from __future__ import annotations

import pytest

from ninfer import _core


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_step_seconds_times_each_step_for_decode_and_verify_rows(tiny_checkpoints, name):
    model = _core.Model(str(tiny_checkpoints.get(name)), device="cpu", num_threads=1)
    prompts = [[3, 5, 7, 9, 11], [4, 6, 8]]
    for rows in (1, 4):
        times = model.step_seconds(prompts, rows, 3)
        assert len(times) == 3 and all(t > 0 for t in times)


def test_step_seconds_refuses_no_rows_and_empty_prompts(tiny_checkpoints):
    model = _core.Model(str(tiny_checkpoints.get("llama")), device="cpu", num_threads=1)
    with pytest.raises(_core.InvalidRequestError, match="rows 0"):
        model.step_seconds([[1, 2]], 0, 3)
    with pytest.raises(_core.InvalidRequestError):
        model.step_seconds([[]], 1, 3)
