"""Which Macs run a model: each memory size's budget is an estimate of Metal's
recommended working set, about 2/3 of the memory (in GiB) up to 36 GB and 3/4
above; it was 3/4 of the size in decimal GB for every Mac (a 16 GB Mac offered
11.2 GiB where Metal recommends about 10.7)."""

from __future__ import annotations

import pytest

from scheduler.fit import APPLE_MEMORY_GB, ModelFacts, apple_matrix, assess

GiB = 2**30
MODEL = ModelFacts(
    name="m",
    path="/m",
    kind="mlx",
    model_type="llama",
    weights_bytes=int(10.4 * GiB),  # between the old 16 GB budget and the new
    params=10**10,
    active_params=10**10,
    kv_bytes_per_token=100_000,
    context_length=32768,
    num_heads=16,
)


@pytest.mark.parametrize(
    "gb, working_set",
    [(8, 8 * GiB * 2 // 3), (16, 16 * GiB * 2 // 3), (36, 24 * GiB), (48, 36 * GiB)],
)
def test_each_row_is_priced_at_the_estimated_metal_working_set(gb, working_set):
    row = next(r for r in apple_matrix(MODEL) if r["memory_gb"] == gb)
    assert row["working_set_bytes"] == working_set
    assert "estimate" in row["working_set_from"]
    a = assess(MODEL, working_set, None)
    assert (row["verdict"], row["max_context"]) == (a.verdict, a.max_context)


def test_a_model_the_old_rule_fit_on_16_gb_does_not():
    rows = {r["memory_gb"]: r for r in apple_matrix(MODEL)}
    assert assess(MODEL, int(16e9 * 0.75), None).verdict != "no"  # what was shown
    assert rows[16]["verdict"] == "no"
    assert [r["memory_gb"] for r in rows.values()] == list(APPLE_MEMORY_GB)
