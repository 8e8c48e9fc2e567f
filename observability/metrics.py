"""Prometheus metrics (`GET /metrics`), named and shaped the way vLLM/SGLang users
know: `kvwarm:` prefix, a `model_name` label, counters as counters, cache
counters in tokens (hit rate is a PromQL ratio), histogram buckets wide enough
for tens-of-seconds local prefill.

Per-request metrics are observed from plain ``RequestRecord``s when requests end;
engine and scheduler state is read at scrape time from a ``ServerSnapshot``
(a custom collector), so neither the scheduler nor the engine touches a metric.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import psutil
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvcache.stats import KVCacheStats
from observability.records import RequestRecord, ServerSnapshot
from scheduler.step_timings import StepReport

P = "kvwarm:"
# from milliseconds: a warm turn's first token (a cache hit on a small model) takes
# tens of them, and a first bucket of 50 ms held every one of them
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.035,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2,
    3,
    5,
    7.5,
    10,
    15,
    20,
    30,
    45,
    60,
    90,
    120,
    180,
    300,
    600,
    1200,
)
ITL_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    1.5,
    2,
    2.5,
    5,
    10,
    30,
)
TOKEN_BUCKETS = (
    1,
    16,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
    131072,
    262144,
)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
CORRECTNESS_KINDS = ("exact_key_rejected_by_model_lcp", "hybrid_trim_miss", "vlm_retreat")
REJECT_REASONS = (
    "over_budget",
    "over_context",
    "queue_full",
    "invalid",
    "body_timeout",
    "unavailable",
)
FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")
# unmounted ids remembered (a request can end after its adapter's unmount only
# while it is in flight: far fewer than this many unmounts ago)
MAX_FORGOTTEN_ADAPTERS = 1024
CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # *_created series double the output and no dashboard reads them


class _PsutilProcessCollector(Collector):
    """ProcessCollector's series where there is no /proc (the Memory panel's RSS)."""

    def __init__(self) -> None:
        self._process = psutil.Process()

    def collect(self) -> Iterable:
        p = self._process
        memory, cpu = p.memory_info(), p.cpu_times()
        yield GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory size in bytes.", memory.rss
        )
        yield GaugeMetricFamily(
            "process_virtual_memory_bytes", "Virtual memory size in bytes.", memory.vms
        )
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            cpu.user + cpu.system,
        )
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            p.create_time(),
        )


class _StateCollector(Collector):
    """Engine and scheduler state, read when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], ServerSnapshot | None]):
        self._snapshot = snapshot

    def collect(self) -> Iterable:
        snap = self._snapshot()
        if snap is None:
            return
        m = [snap.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        eng, cache = snap.engine, snap.engine.prompt_cache or KVCacheStats()
        yield gauge("num_requests_running", "Requests in the running batch.", snap.running)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", snap.waiting)
        usage = snap.reserved_kv_bytes / snap.kv_budget_bytes if snap.kv_budget_bytes else 0.0
        yield gauge(
            "kv_cache_usage_perc",
            "Share of the KV budget reserved by running requests (0-1): admission's view, "
            "prompt + max_tokens per request, not the KV filled so far.",
            usage,
        )
        yield gauge(
            "kv_cache_budget_bytes", "Bytes of the memory budget left for KV.", snap.kv_budget_bytes
        )
        yield gauge("prompt_cache_bytes", "Bytes of KV held by the prefix cache.", cache.bytes)
        yield gauge("prompt_cache_max_bytes", "Byte cap of the prefix cache.", cache.max_bytes)
        yield gauge("prompt_cache_entries", "Cached prefixes.", cache.entries)
        yield counter(
            "prompt_cache_evictions",
            "Prefix-cache entries evicted for room.",
            cache.evictions,
        )
        # the cache's own lookups: every request that reached it, finished or not
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            cache.tokens_queried,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            cache.tokens_reused,
        )
        yield from _kv_tier_metrics(snap.model, cache)
        yield counter(
            "prefill_computed_tokens",
            "Prompt tokens run through the model (not reused).",
            eng.prefill_tokens,
        )
        yield counter(
            "watchdog_aborts", "Requests ended by --request-timeout.", snap.watchdog_aborts
        )
        yield counter(
            "engine_row_faults",
            "Requests failed alone by a fault of their own in the engine (the others went on).",
            eng.row_faults,
        )
        yield counter(
            "engine_batch_recoveries",
            "Step faults no single request could be blamed for, each rebuilding the batch.",
            eng.recoveries,
        )
        kinds = CounterMetricFamily(
            P + "cache_correctness_events",
            "Cache decisions guarding correctness: a key match the model tokens refused, "
            "an untrimmable cache that could not be cut, a vision retreat.",
            labels=["model_name", "kind"],
        )
        for kind in CORRECTNESS_KINDS:
            kinds.add_metric([snap.model, kind], getattr(cache, kind))
        yield kinds
        for name, key in (("active", "active"), ("peak", "peak"), ("cache", "cache")):
            yield gauge(
                f"mlx_{name}_memory_bytes", f"MLX allocator: {name} bytes.", eng.memory.get(key, 0)
            )
        yield _batch_histogram(snap.model, eng.batch_sizes)
        if eng.vision is not None:  # a vision model: what its tower did
            vis = eng.vision
            yield counter(
                "vision_encoder_runs", "Images run through the vision tower.", vis.encoder_runs
            )
            yield counter(
                "vision_encoder_seconds", "Seconds spent in the vision tower.", vis.encoder_seconds
            )
            yield counter(
                "vision_feature_hits",
                "Re-sent images whose vision features were reused (the tower skipped).",
                vis.feature_hits,
            )
            yield counter(
                "vision_images_prefilled",
                "Images whose tokens went through the language model (not from the prefix cache).",
                vis.images_prefilled,
            )
        if eng.steps_report is not None:
            yield from _step_metrics(snap.model, eng.steps_report)


def _kv_tier_metrics(model: str, cache: KVCacheStats) -> Iterable[Metric]:
    """The KV store by tier (ram, disk): bytes, shared blocks, and the disk's traffic."""
    tiers = (("ram", cache.ram), ("disk", cache.disk))
    families: list[Metric] = []
    for name, doc, read in (
        ("kv_tier_bytes", "Bytes of cached KV held per tier (shared blocks once).", "bytes"),
        ("kv_tier_max_bytes", "Byte cap per tier.", "max_bytes"),
        ("kv_tier_blocks", "Shared KV blocks held per tier.", "blocks"),
        ("kv_tier_entries", "Cached prefixes per tier.", "entries"),
        (
            "kv_shared_saved_bytes",
            "Bytes the tier would hold more if entries did not share blocks.",
            "shared_saved_bytes",
        ),
    ):
        g = GaugeMetricFamily(P + name, doc, labels=["model_name", "tier"])
        for tier, st in tiers:
            g.add_metric([model, tier], getattr(st, read))
        families.append(g)
    for name, doc, value in (
        ("kv_disk_hits", "Prefix-cache hits whose KV was read from disk.", cache.disk_hits),
        (
            "kv_disk_load_tokens",
            "Tokens of KV loaded from disk instead of recomputed.",
            cache.disk_load_tokens,
        ),
        ("kv_disk_load_seconds", "Seconds spent reading KV from disk.", cache.disk_load_seconds),
        ("kv_disk_load_bytes", "Bytes of KV read from disk.", cache.disk_load_bytes),
        ("kv_disk_bytes_written", "Bytes of KV written to disk.", cache.disk_bytes_written),
        ("kv_spills", "Entries moved from RAM to disk to make room.", cache.demotions),
        ("kv_promotions", "Disk entries brought back into RAM by a hit.", cache.promotions),
        (
            "kv_disk_files_discarded",
            "Torn, corrupt, foreign or orphaned KV files removed, never loaded.",
            cache.disk_files_discarded,
        ),
        (
            "kv_disk_writes_skipped",
            "Entries not written to disk (write back-pressure or a disk 90% full).",
            cache.disk_writes_skipped,
        ),
        (
            "kv_disk_write_errors",
            "KV writes that failed (the tier turns off).",
            cache.disk_write_errors,
        ),
    ):
        c = CounterMetricFamily(P + name, doc, labels=["model_name"])
        c.add_metric([model], value)
        families.append(c)
    return families


def _step_metrics(model: str, report: StepReport) -> Iterable[Metric]:
    """Engine step times and prefill slices, from the engine's bucket counts."""
    for name, doc, hist in (
        (
            "engine_step_seconds",
            "Time of one engine step: decode of the running rows + a prefill slice.",
            report.step_seconds,
        ),
        (
            "engine_step_prefill_tokens",
            "Prompt tokens one engine step prefilled (steps that prefilled).",
            report.prefill_tokens,
        ),
    ):
        buckets, running = [], 0
        for bound, count in zip(hist.bounds, hist.counts):
            running += count
            buckets.append((str(float(bound)), running))
        buckets.append(("+Inf", hist.count))
        h = HistogramMetricFamily(P + name, doc, labels=["model_name"])
        h.add_metric([model], buckets, sum_value=hist.total)
        yield h
    g = GaugeMetricFamily(
        P + "engine_max_step_seconds",
        "The step time budget (--max-step-ms; 0: a token budget per step).",
        labels=["model_name"],
    )
    g.add_metric([model], report.max_step_ms / 1e3)
    yield g


def _batch_histogram(model: str, counts: tuple[int, ...]) -> HistogramMetricFamily:
    """Rows per decode step, from the engine's plain per-size step counts."""
    buckets, running = [], 0
    for bound in BATCH_BUCKETS:
        running = sum(counts[: bound + 1])
        buckets.append((str(float(bound)), running))
    total = sum(counts)
    buckets.append(("+Inf", total))
    h = HistogramMetricFamily(
        P + "batch_size", "Rows decoding together per decode step.", labels=["model_name"]
    )
    h.add_metric([model], buckets, sum_value=sum(i * c for i, c in enumerate(counts)))
    return h


class Metrics:
    """All of kvwarm's Prometheus metrics, on a registry of their own."""

    def __init__(self, snapshot: Callable[[], ServerSnapshot | None] = lambda: None):
        self.registry = CollectorRegistry()
        r = self.registry
        # decode of the requests that finished in the engine (/fit's measured rate):
        # tokens after each one's first, and the seconds from first to last token
        self.decoded_tokens = 0
        self.decode_seconds = 0.0
        if os.path.isdir("/proc/self"):
            ProcessCollector(registry=r)
        else:  # macOS: prometheus_client reads /proc and exports nothing
            r.register(_PsutilProcessCollector())
        r.register(_StateCollector(snapshot))
        label = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, [*label, *extra], registry=r)

        def histogram(name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(P + name, doc, [*label, *extra], buckets=buckets, registry=r)

        # the LoRA adapter a request ran with ("" = the base model) where it matters:
        # requests, tokens and cache reuse
        by_adapter = ("adapter",)
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished requests.", by_adapter
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.", by_adapter)
        self.success = counter(
            "request_success",
            "Requests that ended, by finish reason.",
            ("finished_reason", *by_adapter),
        )
        self.rejected = counter(
            "requests_rejected", "Requests refused before running.", ("reason",)
        )
        self.disconnects = counter(
            "client_disconnects", "Requests whose client left before the end."
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between generated tokens.", ITL_BUCKETS
        )
        self.max_itl = histogram(
            "request_max_inter_token_gap_seconds",
            "The longest gap between two tokens of one request (its worst stall).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS
        )
        self.prepare = histogram(
            "request_prepare_time_seconds",
            "Body received to queued: parsing, rendering and tokenising, off the event loop.",
            LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Queued to joining the batch.", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "Joining the batch to first token.", LATENCY_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First to last token.", LATENCY_BUCKETS
        )
        self.req_prompt = histogram(
            "request_prompt_tokens", "Prompt length per request.", TOKEN_BUCKETS
        )
        self.req_cached = histogram(
            "request_cached_tokens", "Prompt tokens reused per request.", TOKEN_BUCKETS, by_adapter
        )
        self.req_generated = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self._model = "unknown"
        # refusals before the model is known: under "unknown" (a model that never
        # loads still shows them), moved to its name once it is known
        self._early_rejections: dict[str, int] = {}
        self._early_lock = threading.Lock()
        # observed for every token of every stream: the labelled child is looked
        # up once per model, not per token (``labels`` takes a lock and builds a key)
        self._itl: Any = None
        self._per_adapter = [self.prompt_tokens, self.generation_tokens, self.req_cached]
        # unmounted adapter ids (insertion order: the oldest go first past the cap): a
        # request ending after the unmount must not bring back series nothing removes
        self._forgotten: dict[str, None] = {}
        self._per_model = [
            self.ttft,
            self.itl,
            self.max_itl,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.prepare,
            self.req_prompt,
            self.req_generated,
        ]

    def ensure_model(self, model: str) -> None:
        """Pre-create the labelled series so every panel has data from the first scrape."""
        if model == self._model:
            return
        with self._early_lock:
            self._model = model
        self._itl = self.itl.labels(model)
        for metric in self._per_model:
            metric.labels(model)
        for metric in self._per_adapter:
            metric.labels(model, "")
        for reason in REJECT_REASONS:
            self.rejected.labels(model, reason)
        for reason in FINISH_REASONS:
            self.success.labels(model, reason, "")
        self.disconnects.labels(model)
        with self._early_lock:
            early, self._early_rejections = self._early_rejections, {}
            for reason, n in early.items():
                self.rejected.labels(model, reason).inc(n)
                self.rejected.remove("unknown", reason)

    def forget_adapter(self, adapter: str) -> None:
        """An unmounted adapter's series go: its id is a client's name, and mounts
        come and go at run time (every id ever mounted stayed a label value)."""
        if adapter:
            self._forgotten[adapter] = None
            while len(self._forgotten) > MAX_FORGOTTEN_ADAPTERS:
                del self._forgotten[next(iter(self._forgotten))]
        keys = [(metric, (self._model, adapter)) for metric in self._per_adapter]
        keys += [(self.success, (self._model, reason, adapter)) for reason in FINISH_REASONS]
        for metric, labels in keys:
            try:
                metric.remove(*labels)
            except KeyError:  # never observed
                pass

    def adapter_mounted(self, adapter: str) -> None:
        """Mounted (again): its requests get series of their own."""
        self._forgotten.pop(adapter, None)

    def observe_request(self, rec: RequestRecord) -> None:
        m = rec.model
        # one that ran with an adapter unmounted since (it ended after the unmount, or
        # failed adapter_not_found) counts under the base model: still in the totals,
        # without a series of its own that would stay for good
        a = "" if rec.adapter in self._forgotten else rec.adapter
        if rec.reached_engine:  # a request dropped from the queue was never prefilled
            self.prompt_tokens.labels(m, a).inc(rec.prompt_tokens)
        self.generation_tokens.labels(m, a).inc(rec.completion_tokens)
        self.success.labels(m, rec.finish, a).inc()
        if rec.disconnected:
            self.disconnects.labels(m).inc()
        if rec.ttft_s is not None:
            self.ttft.labels(m).observe(rec.ttft_s)
        if rec.max_itl_s is not None:
            self.max_itl.labels(m).observe(rec.max_itl_s)
        self.e2e.labels(m).observe(rec.e2e_s)
        self.prepare.labels(m).observe(rec.prepare_s)
        if rec.queued_s is not None:
            self.queue.labels(m).observe(rec.queued_s)
        # prefill ends at the first token: one that ended before it (failed or cut off
        # in prefill) has a prefill time that is its time until then, and no decode
        if rec.stats is not None and rec.ttft_s is not None:
            self.prefill.labels(m).observe(rec.stats.prefill_s)
            self.decode.labels(m).observe(rec.stats.decode_s)
            self.decoded_tokens += max(0, rec.completion_tokens - 1)
            self.decode_seconds += rec.stats.decode_s
        self.req_prompt.labels(m).observe(rec.prompt_tokens)
        self.req_cached.labels(m, a).observe(rec.cached_tokens)
        self.req_generated.labels(m).observe(rec.completion_tokens)

    def decode_rate(self) -> float | None:
        """Tokens per second of decode, per stream. Only requests the engine finished
        count: one its client left has tokens but no decode time (it inflated the rate)."""
        if self.decode_seconds <= 0 or self.decoded_tokens <= 0:
            return None
        return self.decoded_tokens / self.decode_seconds

    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        """``tokens`` arrived ``seconds`` after the previous ones (one engine step)."""
        per = seconds / max(1, tokens)
        h = self._itl
        if h is None:
            h = self._itl = self.itl.labels(self._model)
        for _ in range(max(1, tokens)):
            h.observe(per)

    def observe_rejection(self, reason: str, model: str | None = None) -> None:
        if model:
            self.ensure_model(model)
        with self._early_lock:  # against ensure_model moving the early ones
            if self._model == "unknown":
                self._early_rejections[reason] = self._early_rejections.get(reason, 0) + 1
            self.rejected.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
