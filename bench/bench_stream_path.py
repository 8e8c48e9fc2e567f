"""The HTTP side's own cost per streamed token, at large batches.

Over a model-free engine (the tests' FakeEngine: the real engine loop, scheduler
and output router, a token per row per step at once), N clients stream at once
through chat completions, Anthropic Messages and Responses. Printed per dialect:
the server process's CPU time per token delivered (queues, output parser, SSE
framing, Starlette/uvicorn) and tokens/s. On a fast accelerator this work shares
the GIL with the engine thread's step loop, so every microsecond here is taken
from the steps of a large batch.

`--against REV` serves another git revision (a worktree, this venv) in the same
run, one server at a time.

    python bench/bench_stream_path.py [--streams 64] [--tokens 200] [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
PORT = 8393

DIALECTS = {
    "chat": (
        "/v1/chat/completions",
        lambda n: {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": n,
            "stream": True,
        },
    ),
    "messages": (
        "/v1/messages",
        lambda n: {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": n,
            "stream": True,
        },
    ),
    "responses": (
        "/v1/responses",
        lambda n: {"model": "m", "input": "go", "max_output_tokens": n, "stream": True},
    ),
}


def serve(root: Path, port: int, batch: int) -> None:
    """The server process: a revision's app over the model-free engine."""
    sys.path.insert(0, str(root))
    import uvicorn

    from app.server import create_app
    from app.settings import Settings
    from tests.helpers.fake_engine import FakeEngine

    settings = Settings(_env_file=None, batch=batch, max_queue=4 * batch)
    app = create_app(
        settings,
        lambda s, r: FakeEngine(s, r, step_delay=0.0, kv_budget_tokens=10**7),
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def one_stream(client: httpx.AsyncClient, path: str, body: dict) -> int:
    """Data events received (a token each, give or take the framing events)."""
    events = 0
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            events += line.startswith("data:")
    return events


async def load(base: str, dialect: str, streams: int, tokens: int) -> float:
    path, make = DIALECTS[dialect]
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(one_stream(client, path, make(tokens)) for _ in range(streams)))
        return time.perf_counter() - began


def measure(root: Path, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, __file__, "--serve", str(root), str(PORT), str(args.streams)]
    proc = subprocess.Popen(cmd, env=env, cwd=root)
    base = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the server of {root} did not start")
            time.sleep(0.1)
        server = psutil.Process(proc.pid)
        results: dict[str, tuple[float, float]] = {}
        for dialect in DIALECTS:
            asyncio.run(load(base, dialect, args.streams, 8))  # warm-up
            cpu, rate = [], []
            for _ in range(args.repeats):
                before = server.cpu_times()
                seconds = asyncio.run(load(base, dialect, args.streams, args.tokens))
                after = server.cpu_times()
                used = (after.user - before.user) + (after.system - before.system)
                delivered = args.streams * args.tokens
                cpu.append(used / delivered * 1e6)
                rate.append(delivered / seconds)
            results[dialect] = (statistics.median(cpu), statistics.median(rate))
        return results
    finally:
        proc.terminate()
        proc.wait(15)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams (= --batch)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", help="also serve this git revision (a worktree)")
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]), int(args.serve[2]))
        return 0
    targets = [("this tree", ROOT)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            subprocess.run(
                ["git", "worktree", "add", "--detach", tmp, args.against],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            targets.append((args.against, Path(tmp)))
        try:
            results = {name: measure(root, args) for name, root in targets}
        finally:
            if args.against:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", tmp], cwd=ROOT, capture_output=True
                )
    print(f"{args.streams} streams x {args.tokens} tokens, median of {args.repeats}")
    print(f"{'server':>12} {'dialect':>10} {'server CPU/token':>17} {'tokens/s':>9}")
    for name, per in results.items():
        for dialect, (cpu, rate) in per.items():
            print(f"{name:>12} {dialect:>10} {cpu:>14.1f} us {rate:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
