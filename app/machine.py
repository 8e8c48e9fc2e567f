"""The machine a model runs on: chip or CPU name, memory and memory bandwidth.

Apple chips' bandwidth is published, so it is known rather than measured;
anything else uses the engine's measurement (engine.device_memory.
measure_bandwidth: a matrix-vector pass over 256 MiB on the device MLX runs on,
i.e. what a decode step streams).
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import psutil

from scheduler.fit import MachineFacts

# Apple's published unified-memory bandwidth (GB/s), by exact chip name. Binned
# variants share the larger figure.
APPLE_BANDWIDTH_GB_S: tuple[tuple[str, float], ...] = (
    ("M1 Ultra", 800),
    ("M1 Max", 400),
    ("M1 Pro", 200),
    ("M1", 68),
    ("M2 Ultra", 800),
    ("M2 Max", 400),
    ("M2 Pro", 200),
    ("M2", 100),
    ("M3 Ultra", 819),
    ("M3 Max", 400),
    ("M3 Pro", 150),
    ("M3", 100),
    ("M4 Max", 546),
    ("M4 Pro", 273),
    ("M4", 120),
    ("M5", 153),
)


def chip_name() -> str:
    """'Apple M2 Pro' on a Mac, the CPU model on Linux."""
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def known_bandwidth(chip: str) -> float | None:
    """Bytes/s Apple publishes for ``chip``; None for anything else."""
    if not chip.startswith("Apple "):
        return None
    model = chip.removeprefix("Apple ").split(" (")[0].strip()  # "M1 (Virtual)"
    for name, gb_s in APPLE_BANDWIDTH_GB_S:
        if model == name:  # an unlisted "M5 Max" is measured, not given the M5's figure
            return gb_s * 1e9
    return None


def machine_facts(measured_bandwidth: float, device: str = "cpu") -> MachineFacts:
    chip = chip_name()
    known = known_bandwidth(chip)
    if known is not None:
        bandwidth, source = known, f"published for {chip}"
    else:
        bandwidth, source = measured_bandwidth, "measured (matrix-vector pass over 256 MiB)"
    return MachineFacts(
        name=chip,
        memory_bytes=psutil.virtual_memory().total,
        bandwidth_bytes_s=bandwidth,
        bandwidth_source=source,
        device="gpu" if "gpu" in device.lower() else "cpu",
    )
