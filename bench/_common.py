"""Helpers the benchmark scripts share: start/stop a server, percentiles, the model dir."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
RESULTS = ROOT / "bench" / "results"
# servers a bench starts write their SSD KV tier to a fresh folder, so a "cold"
# run is never warmed by the KV of an earlier bench (benches of the tier set it)
os.environ.setdefault("KVWARM_KV_DIR", tempfile.mkdtemp(prefix="kvwarm-bench-kv-"))


def write_results(name: str, payload: dict) -> Path:
    """``payload`` as bench/results/<name>-<time>.json; says where."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nraw results: {out}")
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def prepare_model() -> str:
    """Convert the default GGUF once; the mlx-lm directory both servers load."""
    out = subprocess.run(
        [str(BIN / "kvwarm"), "prepare", "--log-level", "warning"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def mlx_lm_server_cmd(model_dir: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, *args]


def server_env(for_mlx_lm: bool) -> dict[str, str]:
    env = dict(os.environ, KVWARM_LOG_LEVEL=os.environ.get("KVWARM_LOG_LEVEL", "warning"))
    if for_mlx_lm and os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS  # the same BLAS kvwarm preloads itself
    return env


def start(
    cmd: list[str], port: int, log: Path, env: dict[str, str], cwd: Path = ROOT
) -> subprocess.Popen:
    # its own process group: stop() ends whatever it started (mlx.launch's ranks)
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{cmd} did not start; see {log}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass
