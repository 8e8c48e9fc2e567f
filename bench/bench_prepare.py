"""Request preparation must be cheap, linear and off the event loop.

Drives `POST /v1/messages/count_tokens` (the whole preparation path: parse,
validate, heal, render, tokenise; no generation) on a real `kvwarm serve`
with the default model, while another thread polls `/health` every 10 ms, and
prints per case the preparation latency and the /health p99 meanwhile:

- warm turns of a 1,000-message conversation growing two messages a turn
  (target: < 20 ms a turn);
- cold bodies near and over every limit: 1,500 one-line messages, a message of
  "<think>" x 20,000, "<system-reminder>" x 8,000, 30 MB of text in one message,
  200,000 tiny messages, a 32 MiB body of a million JSON values (target: each
  answered in < 1 s; the median of ``--repeats`` posts);
- /health p99 while each runs (target: < 50 ms), over all its posts.

`--against REF` runs the same cases against another git revision of kvwarm
(a worktree served with this venv) in the same run, e.g. `--against 74d3677`.

    python bench/bench_prepare.py [--against REF] [--turns 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from _common import ROOT, pct, prepare_model, server_env, start, stop

PORT = 8391
COUNT = "/v1/messages/count_tokens"
TIMEOUT_S = 60.0  # a server still busy past it is restarted for the next case


@dataclass
class Case:
    name: str
    latencies_ms: list[float]
    status: str
    health_p99_ms: float
    health_max_ms: float


def _probe_loop(url: str, armed, stop, out) -> None:
    samples: list[float] = []
    was_armed = False
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            now_armed = armed.is_set()  # a probe counts if it started while armed
            if was_armed and not now_armed:
                out.put(samples)
                samples = []
            was_armed = now_armed
            t = time.perf_counter()
            try:
                client.get(url + "/health")
            except httpx.HTTPError:
                pass
            took = time.perf_counter() - t
            if now_armed:
                samples.append(took * 1000)
            time.sleep(max(0.0, 0.01 - took))


class HealthProbe:
    """GET /health every 10 ms from a process of its own (so the client's own
    work never delays a probe); latencies of the probes started while armed."""

    def __init__(self, url: str):
        ctx = multiprocessing.get_context("spawn")
        self._armed, self._stop, self._out = ctx.Event(), ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(
            target=_probe_loop, args=(url, self._armed, self._stop, self._out), daemon=True
        )
        self._proc.start()

    def arm(self) -> None:
        self._armed.set()

    def disarm(self) -> tuple[float, float]:
        self._armed.clear()
        samples = self._out.get(timeout=TIMEOUT_S + 30) or [float("nan")]
        return pct(samples, 99), max(samples)

    def close(self) -> None:
        self._stop.set()
        self._proc.join(5)


def chat(n: int, offset: int = 0) -> list[dict]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"line {i} of the chat"}
        for i in range(offset, offset + n)
    ]


def cold_bodies() -> dict[str, bytes]:
    def body(messages: list[dict]) -> bytes:
        return json.dumps({"model": "m", "messages": messages}).encode()

    tiny = b'{"role":"user","content":"x"},'
    return {
        "1,500 one-line messages": body(chat(1500)),
        '"<think>" x 20,000 (140 KB)': body([{"role": "user", "content": "<think>" * 20_000}]),
        '"<system-reminder>" x 8,000': body(
            [{"role": "user", "content": "<system-reminder>" * 8_000}]
        ),
        "30 MB of text in one message": body([{"role": "user", "content": "word " * 6_000_000}]),
        "200,000 tiny messages (6 MB)": body([{"role": "user", "content": "x"}] * 200_000),
        "1,000,000 tiny messages (30 MiB)": b'{"messages": ['
        + tiny * 999_999
        + b'{"role":"user","content":"x"}]}',
    }


def post(client: httpx.Client, url: str, raw: bytes) -> tuple[float, str]:
    t = time.perf_counter()
    try:
        r = client.post(url + COUNT, content=raw, headers={"content-type": "application/json"})
        status = str(r.status_code)
    except httpx.TimeoutException:
        status = "timeout"
    return (time.perf_counter() - t) * 1000, status


def run_cases(cwd: Path, log: Path, turns: int, repeats: int) -> list[Case]:
    url = f"http://127.0.0.1:{PORT}"
    cases: list[Case] = []
    proc = serve(cwd, log)
    probe = HealthProbe(url)
    try:
        with httpx.Client(timeout=TIMEOUT_S) as client:
            conversation = [{"role": "system", "content": "You are helpful."}, *chat(1000)]
            post(client, url, json.dumps({"messages": conversation}).encode())  # the cold turn
            probe.arm()
            warm = []
            for turn in range(turns):
                conversation += chat(2, offset=1000 + 2 * turn)
                ms, status = post(client, url, json.dumps({"messages": conversation}).encode())
                warm.append(ms)
            name = "1,000-message conversation, per warm turn"
            cases.append(Case(name, warm, status, *probe.disarm()))
            for name, raw in cold_bodies().items():
                time.sleep(0.3)
                probe.arm()
                took = []
                for _ in range(repeats):
                    ms, status = post(client, url, raw)
                    took.append(ms)
                    if status == "timeout":
                        break
                cases.append(Case(name, took, status, *probe.disarm()))
                if status == "timeout":  # still busy with it: start afresh
                    stop(proc)
                    proc = serve(cwd, log)
    finally:
        probe.close()
        stop(proc)
    return cases


def serve(cwd: Path, log: Path) -> subprocess.Popen:
    """`kvwarm serve` from the source tree at ``cwd`` (this venv's packages)."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(PORT)]
    return start(cmd, PORT, log, server_env(for_mlx_lm=False), cwd=cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="also run a git revision of kvwarm (worktree)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="posts of each cold body")
    args = parser.parse_args()
    prepare_model()
    runs: dict[str, list[Case]] = {}
    targets = [("this tree", ROOT)]
    tmp = None
    if args.against:
        tmp = Path(tempfile.mkdtemp(prefix="kvwarm-ref-"))
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tmp), args.against],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        targets.append((args.against, tmp))
    try:
        for label, cwd in targets:
            log = Path(tempfile.gettempdir()) / f"bench-prepare-{label.replace(' ', '_')}.log"
            runs[label] = run_cases(cwd, log, args.turns, args.repeats)
    finally:
        if tmp is not None:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tmp)], cwd=ROOT, capture_output=True
            )
    for label, cases in runs.items():
        print(f"\n{label}")
        print(f"{'case':44} {'status':>8} {'prepare ms':>12} {'/health p99':>12} {'max':>8}")
        for c in cases:
            ms = statistics.median(c.latencies_ms)
            print(
                f"{c.name:44} {c.status:>8} {ms:12.1f} {c.health_p99_ms:12.1f} {c.health_max_ms:8.1f}"
            )


if __name__ == "__main__":
    main()
