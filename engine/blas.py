"""Make MLX's Linux CPU backend use OpenBLAS instead of the reference BLAS.

The Linux CPU wheel of MLX links the slow reference BLAS (~6 GFLOP/s on matmul).
Loading Debian's OpenBLAS with RTLD_GLOBAL *before* the first ``import mlx``
makes its symbols win (~350 GFLOP/s). This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/openblas-pthread/libblas.so.3",
)


@dataclass(frozen=True)
class BlasChoice:
    name: str
    path: str | None
    reason: str

    def describe(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"{self.name}{where}: {self.reason}"


def preload_openblas(candidates: tuple[str, ...] = OPENBLAS_CANDIDATES) -> BlasChoice:
    """Preload OpenBLAS when running on Linux; say which BLAS MLX will use."""
    if platform.system() != "Linux":
        return BlasChoice("platform default", None, "not Linux (Accelerate/CUDA path)")
    if os.environ.get("KVWARM_NO_OPENBLAS", "").strip().lower() in ("1", "true", "yes", "on"):
        return BlasChoice("reference BLAS", None, "KVWARM_NO_OPENBLAS is set")
    if "mlx.core" in sys.modules:
        return BlasChoice("unknown", None, "mlx was imported before the OpenBLAS preload could run")
    for path in candidates:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            except OSError as exc:
                return BlasChoice("reference BLAS", None, f"loading {path} failed: {exc}")
            return BlasChoice("OpenBLAS", path, "preloaded before mlx")
    return BlasChoice(
        "reference BLAS",
        None,
        "OpenBLAS not found; install Debian's libopenblas0-pthread for ~50x faster matmul",
    )
