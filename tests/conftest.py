"""Shared test set-up: OpenBLAS before mlx, and a per-session model cache dir."""

from __future__ import annotations

import logging
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


@pytest.fixture(autouse=True)
def _root_logging_as_it_was():
    """``main`` sets logging up (basicConfig on the root) for the server it runs: under
    capsys that handler wrote to the test's capture, closed once the test ended, and
    any later log line printed "--- Logging error ---" and a traceback. Handlers a
    test adds are taken away after it (pytest's own come and go with each phase)."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    root.setLevel(level)
