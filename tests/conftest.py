"""Shared test set-up: OpenBLAS before mlx, and a per-session model cache dir."""

from __future__ import annotations

import os

import pytest

from engine.blas import preload_openblas

# Must run before anything imports mlx (pytest imports conftest first).
BLAS = preload_openblas()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _cache_dir_as_it_was():
    """``main`` exports --cache-dir as KVWARM_CACHE_DIR for the code it runs: a test
    calling it left its temporary folder as every later test's cache."""
    before = os.environ.get("KVWARM_CACHE_DIR")
    yield
    if before is None:
        os.environ.pop("KVWARM_CACHE_DIR", None)
    else:
        os.environ["KVWARM_CACHE_DIR"] = before
