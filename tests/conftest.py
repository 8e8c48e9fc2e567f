"""Shared test set-up: OpenBLAS before mlx, and a per-session model cache dir."""

from __future__ import annotations

import os

from engine.blas import preload_openblas

# Must run before anything imports mlx (pytest imports conftest first).
BLAS = preload_openblas()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
