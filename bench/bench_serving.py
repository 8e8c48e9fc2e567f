"""Serving benchmark: kvwarm --batch 1, kvwarm --batch 8 and mlx_lm.server
(--decode-concurrency 8) on the same model, machine and run.

For 1 and 8 concurrent streaming clients (128 tokens each, EOS suppressed so
every client really gets 128) it prints aggregate output tokens/s and TTFT
p50/p95, then the ratios the core-server issue targets.

    python bench/bench_serving.py [--tokens 128] [--rounds-single 3] [--skip-mlx-lm]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import httpx
from _common import BIN, RESULTS, mlx_lm_server_cmd, pct, prepare_model, server_env, start, stop

TOPICS = ["a dragon", "the sea", "a robot", "a city", "winter", "a library", "a comet", "a garden"]
EOS_ID = 2  # SmolLM2's <|im_end|>


@dataclass
class Scenario:
    server: str
    clients: int
    tokens: int
    wall_s: float
    tok_per_s: float
    ttft_p50: float
    ttft_p95: float


_NONCES = itertools.count(1)


async def one_stream(client: httpx.AsyncClient, url: str, topic: str, max_tokens: int):
    # a fresh first line per request: TTFT is a prefill, never a prompt-cache hit
    # (both servers cache prompts, and the rounds repeat topics)
    content = f"[{next(_NONCES)}] Write a long, detailed story about {topic}."
    body = {
        "model": "default_model",  # mlx_lm.server loads any other name as a new model
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # kvwarm (vLLM extension)
        "logit_bias": {str(EOS_ID): -100},  # mlx_lm.server
    }
    start = time.perf_counter()
    ttft = None
    tokens = chunks = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    return ttft or 0.0, tokens or chunks


async def run_round(url: str, clients: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=1800) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, url, TOPICS[i % len(TOPICS)], max_tokens) for i in range(clients))
        )
        return time.perf_counter() - start, results


def measure(name: str, url: str, tokens: int, rounds_single: int) -> list[Scenario]:
    asyncio.run(run_round(url, 1, 8))  # warm-up
    out = []
    for clients, rounds in ((1, rounds_single), (8, 1)):
        walls, ttfts, total = [], [], 0
        for _ in range(rounds):
            wall, results = asyncio.run(run_round(url, clients, tokens))
            walls.append(wall)
            ttfts += [r[0] for r in results]
            total += sum(r[1] for r in results)
        sc = Scenario(
            name, clients, total, sum(walls), total / sum(walls), pct(ttfts, 50), pct(ttfts, 95)
        )
        print(
            f"  {name:<28} clients={clients}  {sc.tok_per_s:7.1f} tok/s  "
            f"TTFT p50 {sc.ttft_p50:6.2f}s  p95 {sc.ttft_p95:6.2f}s  ({total} tokens)",
            flush=True,
        )
        out.append(sc)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds-single", type=int, default=3)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    args = ap.parse_args()

    results_dir = RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model()
    print(f"model: {model_dir}\nmachine: {os.cpu_count()} CPUs, {sys.platform}\n", flush=True)

    servers = [
        ("kvwarm --batch 1", [str(BIN / "kvwarm"), "serve", "--batch", "1"]),
        ("kvwarm --batch 8", [str(BIN / "kvwarm"), "serve", "--batch", "8"]),
    ]
    if not args.skip_mlx_lm:
        servers.append(
            (
                "mlx_lm.server --decode-conc 8",
                mlx_lm_server_cmd(
                    model_dir, "--decode-concurrency", "8", "--max-tokens", str(args.tokens)
                ),
            )
        )
    scenarios: list[Scenario] = []
    for name, cmd in servers:
        port = args.port
        run_env = server_env(for_mlx_lm="mlx_lm" in name)
        log = results_dir / (name.split()[0] + name.split()[-1] + ".log")
        proc = start([*cmd, "--port", str(port)], port, log, run_env)
        try:
            scenarios += measure(name, f"http://127.0.0.1:{port}", args.tokens, args.rounds_single)
        finally:
            stop(proc)

    by = {(s.server, s.clients): s for s in scenarios}
    print("\nratios (8 clients, aggregate tok/s):")
    b8, b1 = by[("kvwarm --batch 8", 8)], by[("kvwarm --batch 1", 8)]
    print(
        f"  kvwarm --batch 8 / kvwarm --batch 1 = {b8.tok_per_s / b1.tok_per_s:.2f}x  (target >= 3x)"
    )
    if ("mlx_lm.server --decode-conc 8", 8) in by:
        ml = by[("mlx_lm.server --decode-conc 8", 8)]
        print(
            f"  kvwarm --batch 8 / mlx_lm.server   = {b8.tok_per_s / ml.tok_per_s:.2f}x  (target >= 1.0x)"
        )
    out = results_dir / f"serving-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps([asdict(s) for s in scenarios], indent=2))
    print(f"\nraw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
