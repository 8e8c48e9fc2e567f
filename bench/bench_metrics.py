"""What a Prometheus scrape of /metrics costs with many requests recorded.

Records N finished requests (varied lengths, cache hits, finish reasons, ITL
samples) into kvwarm's metrics, then times rendering the exposition text —
the work each scrape does on the server — and prints the median and p95 over
repeated renders, next to prometheus_client's bare registry as a floor.

    python bench/bench_metrics.py [--requests 10000] [--renders 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from kvcache.stats import KVCacheStats  # noqa: E402
from observability.metrics import Metrics  # noqa: E402
from observability.records import RequestRecord, ServerSnapshot  # noqa: E402
from scheduler.contracts import EngineStats  # noqa: E402
from scheduler.request import CacheReport, RequestStats  # noqa: E402


def snapshot() -> ServerSnapshot:
    engine = EngineStats(
        steps=10**6,
        active_rows=4,
        prefill_tokens=10**8,
        generated_tokens=10**7,
        prompt_cache=KVCacheStats(
            entries=120,
            bytes=3 * 2**30,
            max_bytes=4 * 2**30,
            evictions=40,
            exact_key_rejected_by_model_lcp=2,
            hybrid_trim_miss=1,
        ),
        batch_sizes=tuple(random.randint(0, 10**5) for _ in range(9)),
        memory={"active": 9 * 2**30, "peak": 11 * 2**30, "cache": 2**30},
    )
    return ServerSnapshot("model", 4, 2, 2**30, 4 * 2**30, 3, engine)


def fill(metrics: Metrics, n: int, rng: random.Random) -> None:
    metrics.ensure_model("model")
    for i in range(n):
        prompt = rng.randint(100, 30000)
        cached = rng.randint(0, prompt - 1)
        metrics.observe_request(
            RequestRecord(
                request_id=f"req-{i}",
                dialect=rng.choice(["chat", "messages", "responses"]),
                model="model",
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=rng.randint(1, 2000),
                finish=rng.choice(["stop", "length", "tool_calls", "abort"]),
                e2e_s=rng.uniform(0.5, 120),
                started_at=time.time(),
                ttft_s=rng.uniform(0.05, 60),
                stats=RequestStats(
                    rng.uniform(0, 5),
                    rng.uniform(0.05, 60),
                    rng.uniform(0.5, 60),
                    CacheReport("global", cached),
                ),
            )
        )
        for _ in range(5):
            metrics.observe_itl(rng.uniform(0.01, 0.3))
        if i % 50 == 0:
            metrics.observe_rejection(rng.choice(["over_budget", "queue_full", "invalid"]))


def timed(render, renders: int) -> list[float]:
    out = []
    for _ in range(renders):
        t0 = time.perf_counter()
        render()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--renders", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    metrics = Metrics(snapshot)
    t0 = time.perf_counter()
    fill(metrics, args.requests, rng)
    record_us = (time.perf_counter() - t0) / args.requests * 1e6
    ours = timed(metrics.render, args.renders)
    floor_registry = CollectorRegistry()
    floor = timed(lambda: generate_latest(floor_registry), args.renders)
    size = len(metrics.render())
    print(f"{args.requests} requests recorded ({record_us:.1f} us each, incl. 5 ITL samples)")
    print(
        f"/metrics render: median {statistics.median(ours):.2f} ms, p95 {statistics.quantiles(ours, n=20)[18]:.2f} ms, {size / 1024:.0f} KiB"
    )
    print(f"empty prometheus_client registry: median {statistics.median(floor):.3f} ms")


if __name__ == "__main__":
    main()
