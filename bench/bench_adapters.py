"""Adapter benchmark: 8 clients split over 2 LoRA adapters vs 8 on the base model.

One kvwarm server (--batch 8) with two adapters built the way `mlx_lm.lora`
makes them by default (rank 8, every linear layer of the last 16 blocks),
mounted at start. Scenarios run in alternating order, several rounds each,
on the same server in one run:

    base x8      8 clients, no adapter
    split 4+4    4 clients on adapter alpha, 4 on beta (per-row LoRA, one batch)
    alpha x8     8 clients on one adapter
    base x4      4 clients, no adapter: what a scheduler that groups rows by
                 adapter and alternates the groups could at best decode per step

Each client asks for 128 tokens (EOS ignored, prefix cache off so every round
prefills alike). Prints aggregate tok/s (median over rounds), the batch sizes
the engine decoded at, and split / base.

    python bench/bench_adapters.py [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import BIN, RESULTS, ROOT, prepare_model, server_env, start, stop, write_results

sys.path.insert(0, str(ROOT))
from tests.helpers.adapters import write_adapter  # noqa: E402 - mlx-lm's own LoRA layers

TOPICS = ["a dragon", "the sea", "a robot", "a city", "winter", "a library", "a comet", "a garden"]
SCENARIOS = {
    "base x8": [None] * 8,
    "split 4+4": ["alpha", "beta"] * 4,
    "alpha x8": ["alpha"] * 8,
    "base x4": [None] * 4,
}


async def one(client: httpx.AsyncClient, url: str, i: int, adapter: str | None, tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": f"Write a long story about {TOPICS[i % 8]}."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "use_kv_cache": False,
    }
    if adapter:
        body["adapter"] = adapter
    r = await client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def run(url: str, adapters: list[str | None], tokens: int) -> float:
    async with httpx.AsyncClient(timeout=1800) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(one(client, url, i, a, tokens) for i, a in enumerate(adapters))
        )
        return sum(counts) / (time.perf_counter() - started)


def mean_batch(url: str) -> float:
    """Rows per decode step over the server's life (kvwarm:batch_size histogram)."""
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvwarm:batch_size_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvwarm:batch_size_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total / count if count else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=18461)
    args = ap.parse_args()

    model_dir = Path(prepare_model())
    work = Path(tempfile.mkdtemp(prefix="kvwarm-bench-adapters-"))
    dirs = {
        name: write_adapter(model_dir, work / name, seed=seed, rank=8, scale=2.0, num_layers=16)
        for name, seed in (("alpha", 1), ("beta", 2))
    }
    print(f"model: {model_dir}\nmachine: {os.cpu_count()} CPUs\nadapters: {work}\n", flush=True)
    cmd = [str(BIN / "kvwarm"), "serve", "--batch", "8", "--port", str(args.port)]
    for name, path in dirs.items():
        cmd += ["--adapter", f"{name}={path}"]
    url = f"http://127.0.0.1:{args.port}"
    proc = start(cmd, args.port, RESULTS / "kvwarm-adapters.log", server_env(False))
    try:
        listed = httpx.get(url + "/v1/adapters").json()["data"]
        for a in listed:
            print(
                f"  {a['id']}: rank {a['rank']}, {a['mounted_layers']} layers, "
                f"{a['size_bytes'] / 2**20:.1f} MiB"
            )
        asyncio.run(run(url, [None, "alpha"], 8))  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in SCENARIOS}
        for r in range(args.rounds):
            for name, adapters in SCENARIOS.items():
                rate = asyncio.run(run(url, adapters, args.tokens))
                rates[name].append(rate)
                print(f"  round {r + 1} {name:<10} {rate:6.2f} tok/s", flush=True)
        rows = mean_batch(url)
    finally:
        stop(proc)

    print(f"\naggregate tok/s, median of {args.rounds} rounds ({args.tokens} tokens per client):")
    medians = {name: statistics.median(v) for name, v in rates.items()}
    for name, value in medians.items():
        print(f"  {name:<10} {value:6.2f}")
    print(f"\n  split 4+4 / base x8: {medians['split 4+4'] / medians['base x8']:.2f}x")
    print(f"  alpha x8  / base x8: {medians['alpha x8'] / medians['base x8']:.2f}x")
    print(f"  base x4   / base x8: {medians['base x4'] / medians['base x8']:.2f}x")
    print(f"  rows per decode step, mean over the run: {rows:.2f}")
    write_results("adapters", {"rates": rates, "medians": medians, "adapters": listed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
