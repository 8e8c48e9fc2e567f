"""Pick the memory budget when the user says ``--memory-budget auto``."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import psutil

LINUX_RAM_FRACTION = 0.75  # of MemAvailable at start-up, before the weights load
GPU_FRACTION = 0.90  # of CUDA device memory (leave room for the driver/context)


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    source: str


def _device_info() -> dict:
    info = getattr(mx, "device_info", None)
    if info is None and mx.metal.is_available():
        info = mx.metal.device_info
    try:
        return dict(info()) if info else {}
    except RuntimeError:
        return {}


def auto_budget() -> DeviceMemory:
    """Metal's recommended working set on macOS, device memory on CUDA, and a
    safe fraction of available RAM on the Linux CPU backend."""
    info = _device_info()
    if mx.metal.is_available() and info.get("max_recommended_working_set_size"):
        return DeviceMemory(
            int(info["max_recommended_working_set_size"]), "Metal recommended working set"
        )
    if total := _cuda_total(info):
        return DeviceMemory(int(total * GPU_FRACTION), "90% of CUDA device memory")
    available = psutil.virtual_memory().available
    return DeviceMemory(int(available * LINUX_RAM_FRACTION), "75% of available RAM")


def machine_memory() -> DeviceMemory:
    """All the memory there is to budget: unified memory on a Mac, device memory
    on CUDA, RAM on the CPU backend."""
    info = _device_info()
    if mx.metal.is_available() and info.get("memory_size"):
        return DeviceMemory(int(info["memory_size"]), "unified memory")
    if total := _cuda_total(info):
        return DeviceMemory(total, "CUDA device memory")
    return DeviceMemory(psutil.virtual_memory().total, "RAM")


def _cuda_total(info: dict) -> int:
    """The CUDA device's memory (0: not on CUDA, or it does not say)."""
    if getattr(mx, "cuda", None) is None or not mx.cuda.is_available():
        return 0
    return int(info.get("total_memory") or info.get("memory_size") or 0)


@dataclass(frozen=True)
class MemorySample:
    """MLX's allocator, read on the engine thread (MLX calls belong there)."""

    active_bytes: int
    peak_bytes: int
    cache_bytes: int


def sample_memory() -> MemorySample:
    return MemorySample(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory())


def measure_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Memory bandwidth as decoding sees it (bytes/s), on the device MLX runs on:
    the best of a few matrix-vector products over an ``nbytes`` matrix, which
    stream every element once, as a decode step streams the weights."""
    import time

    cols = 4096
    w = mx.ones((nbytes // 4 // cols, cols), dtype=mx.float32)
    v = mx.ones((1, w.shape[0]), dtype=mx.float32)
    mx.eval(w, v)
    passes = 8  # per timing: on a GPU one pass is ~0.1 ms, launch overhead would dominate
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        mx.eval([(v * (i + 1)) @ w for i in range(passes)])
        best = min(best, time.perf_counter() - started)
    del w, v
    mx.clear_cache()
    return passes * nbytes / best
