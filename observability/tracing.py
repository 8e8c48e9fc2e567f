"""OpenTelemetry: one trace per request (queue, prefill and decode as child spans,
GenAI semantic-convention attributes) and the request metrics through an OTel
meter, both exported over OTLP/HTTP.

Configured only by the standard ``OTEL_*`` environment variables and off unless
an OTLP endpoint is set. Spans are built when a request ends, from the times it
recorded, and handed to a batch processor whose export runs on its own thread
with a bounded queue: a slow or absent collector drops spans, never requests.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from observability.metrics import ITL_BUCKETS, LATENCY_BUCKETS
from observability.records import RequestRecord, ServerSnapshot

log = logging.getLogger("kvwarm.otel")
_NS = 1_000_000_000
EXPORT_TIMEOUT_S = 5.0  # per export attempt, on the exporter's own thread


def _endpoint(signal: str, env: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP URL for ``signal`` (TRACES / METRICS), as the OTLP spec derives it:
    a signal-specific variable is used as is, the shared one gets ``/v1/<signal>``."""
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    if specific:
        return specific
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return f"{base.rstrip('/')}/v1/{signal.lower()}" if base else None


def _interval_ms(value: str | None, default: float = 15000.0) -> float:
    """The metric export interval: the SDK raises on 0 or a negative one (in the
    startup hook: the server exited) and never exports with NaN or infinity."""
    if not value:
        return default
    try:
        interval = float(value)
    except ValueError:
        interval = math.nan
    if math.isfinite(interval) and interval > 0:
        return interval
    log.warning(
        "OTEL_METRIC_EXPORT_INTERVAL=%r is not a positive number of ms; using %d ms",
        value,
        default,
    )
    return default


def _service_name(env: Mapping[str, str]) -> str:
    """The SDK's own choice (OTEL_SERVICE_NAME, else a service.name in
    OTEL_RESOURCE_ATTRIBUTES), else "kvwarm". Any name handed to Resource.create
    overrides both: a fixed default put every deployment under "kvwarm"."""
    name = env.get("OTEL_SERVICE_NAME")
    if name:
        return name
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "service.name" and value.strip():
            name = unquote(value.strip())  # the last one wins, as in the SDK
    return name or "kvwarm"


class Tracing:
    def __init__(
        self,
        snapshot: Callable[[], ServerSnapshot | None] = lambda: None,
        env: Mapping[str, str] | None = None,
    ):
        env = os.environ if env is None else env
        self.enabled = env.get("OTEL_SDK_DISABLED", "").lower() != "true"
        resource = Resource.create({"service.name": _service_name(env)})
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        self._snapshot = snapshot
        traces_url, metrics_url = _endpoint("TRACES", env), _endpoint("METRICS", env)
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        if (traces_url or metrics_url) and protocol != "http/protobuf":
            log.warning(
                "OTEL_EXPORTER_OTLP_PROTOCOL=%s: kvwarm exports OTLP over HTTP only "
                "(http/protobuf, port 4318); telemetry is off",
                protocol,
            )
            traces_url = metrics_url = None
        if env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
            traces_url = None
        if env.get("OTEL_METRICS_EXPORTER", "otlp") == "none":
            metrics_url = None
        if self.enabled and traces_url:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self._tracer_provider = TracerProvider(resource=resource)
            exporter = OTLPSpanExporter(endpoint=traces_url, timeout=EXPORT_TIMEOUT_S)
            self._tracer_provider.add_span_processor(
                BatchSpanProcessor(exporter, max_queue_size=4096, export_timeout_millis=5000)
            )
            self._tracer = self._tracer_provider.get_tracer("kvwarm")
        if self.enabled and metrics_url:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            interval = _interval_ms(env.get("OTEL_METRIC_EXPORT_INTERVAL"))
            reader = PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=metrics_url, timeout=EXPORT_TIMEOUT_S), interval
            )
            self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
            self._instruments()
        self._propagator = TraceContextTextMapPropagator()

    @property
    def active(self) -> bool:
        return self._tracer_provider is not None or self._meter_provider is not None

    def describe(self) -> str:
        parts = [
            n
            for n, p in (("traces", self._tracer_provider), ("metrics", self._meter_provider))
            if p
        ]
        return f"OTLP {' + '.join(parts)}" if parts else "off (no OTEL_EXPORTER_OTLP_ENDPOINT)"

    # -- metrics ---------------------------------------------------------------
    def _instruments(self) -> None:
        meter = self._meter_provider.get_meter("kvwarm")  # type: ignore[union-attr]
        self._m_prompt = meter.create_counter("kvwarm.prompt_tokens", "{token}")
        self._m_generated = meter.create_counter("kvwarm.generation_tokens", "{token}")
        self._m_queries = meter.create_counter("kvwarm.prefix_cache.queries", "{token}")
        self._m_hits = meter.create_counter("kvwarm.prefix_cache.hits", "{token}")
        self._m_requests = meter.create_counter("kvwarm.requests", "{request}")
        # in seconds, so second-sized buckets: the SDK's defaults (0, 5, 10, ... 10000)
        # are for milliseconds and put every latency under 5 s in one bucket

        def seconds(name: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return meter.create_histogram(
                name, "s", explicit_bucket_boundaries_advisory=list(buckets)
            )

        self._m_ttft = seconds("gen_ai.server.time_to_first_token")
        self._m_duration = seconds("gen_ai.server.request.duration")
        self._m_tpot = seconds("gen_ai.server.time_per_output_token", ITL_BUCKETS)
        self._m_queue = seconds("kvwarm.request.queue_time")
        self._m_prefill = seconds("kvwarm.request.prefill_time")

        def gauge(field: str) -> Callable[[CallbackOptions], list[Observation]]:
            def read(_: CallbackOptions) -> list[Observation]:
                snap = self._snapshot()
                if snap is None:
                    return []
                return [Observation(getattr(snap, field), {"gen_ai.request.model": snap.model})]

            return read

        meter.create_observable_gauge("kvwarm.num_requests_running", [gauge("running")])
        meter.create_observable_gauge("kvwarm.num_requests_waiting", [gauge("waiting")])

    def _record_metrics(self, rec: RequestRecord) -> None:
        attrs = {"gen_ai.request.model": rec.model, "kvwarm.dialect": rec.dialect}
        if rec.reached_engine:  # a request dropped from the queue was never prefilled
            self._m_prompt.add(rec.prompt_tokens, attrs)
        self._m_generated.add(rec.completion_tokens, attrs)
        report = rec.cache_report
        if report is not None and report.tier != "disabled":  # the cache was asked
            self._m_queries.add(rec.prompt_tokens, attrs)
            self._m_hits.add(rec.cached_tokens, attrs)
        self._m_requests.add(1, {**attrs, "finished_reason": rec.finish})
        self._m_duration.record(rec.e2e_s, attrs)
        if rec.ttft_s is not None:
            self._m_ttft.record(rec.ttft_s, attrs)
        if rec.queued_s is not None:
            self._m_queue.record(rec.queued_s, attrs)
        if rec.stats is not None and rec.ttft_s is not None:  # as Metrics: a first token came
            self._m_prefill.record(rec.stats.prefill_s, attrs)
            if rec.completion_tokens > 1:
                self._m_tpot.record(rec.stats.decode_s / (rec.completion_tokens - 1), attrs)

    # -- traces ----------------------------------------------------------------
    def request_done(self, rec: RequestRecord, headers: Mapping[str, str]) -> None:
        try:
            if self._tracer_provider is not None:
                self._span(rec, headers)
            if self._meter_provider is not None:
                self._record_metrics(rec)
        except Exception:  # noqa: BLE001 - telemetry must never fail a request
            log.warning("telemetry for %s failed", rec.request_id, exc_info=True)

    def _span(self, rec: RequestRecord, headers: Mapping[str, str]) -> None:
        parent = self._propagator.extract(carrier=headers)
        operation = "text_completion" if rec.dialect == "completions" else "chat"
        start = int(rec.started_at * _NS)
        end = start + int(rec.e2e_s * _NS)
        cache = rec.cache_report
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": rec.model,
            "gen_ai.response.model": rec.model,
            "gen_ai.response.id": rec.request_id,
            "gen_ai.response.finish_reasons": [rec.finish],
            "gen_ai.usage.input_tokens": rec.prompt_tokens,
            "gen_ai.usage.output_tokens": rec.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": rec.cached_tokens,
            "kvwarm.cached_tokens": rec.cached_tokens,
            "kvwarm.cache.layer": (cache.layer if cache else None) or "miss",
            "kvwarm.cache.depth": cache.depth if cache else 0,
            "kvwarm.dialect": rec.dialect,
        }
        if rec.session:
            attributes["gen_ai.conversation.id"] = rec.session
        if rec.adapter:
            attributes["kvwarm.adapter"] = rec.adapter
        for key, value in rec.request.items():
            if value is not None:
                attributes[f"gen_ai.request.{key}"] = value
        root = self._tracer.start_span(
            f"{operation} {rec.model}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=start,
            attributes=attributes,
        )
        if rec.finish == "error":
            root.set_status(Status(StatusCode.ERROR, "generation failed"))
        phases: list[tuple[str, float]] = []
        if rec.stats is not None:
            phases = [
                ("prepare", rec.prepare_s),  # parsing, rendering, tokenising
                ("queue", rec.stats.queued_s),
                ("prefill", rec.stats.prefill_s),
                ("decode", rec.stats.decode_s),
            ]
        elif rec.waited_s is not None:  # never joined the batch (expired, given up): it waited
            phases = [("prepare", rec.prepare_s), ("queue", rec.waited_s)]
        if phases:
            inside = trace.set_span_in_context(root)
            at = start
            for name, seconds in phases:
                span = self._tracer.start_span(f"kvwarm.{name}", context=inside, start_time=at)
                at = min(end, at + int(seconds * _NS))
                if name == "prefill" and cache is not None:
                    span.set_attribute("kvwarm.cache.depth", cache.depth)
                    span.set_attribute(
                        "kvwarm.prefill.tokens", rec.prompt_tokens - rec.cached_tokens
                    )
                span.end(end_time=at)
        root.end(end_time=end)

    def flush(self, timeout_ms: int = 5000) -> None:
        for provider in (self._tracer_provider, self._meter_provider):
            if provider is not None:
                provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        for provider in (self._tracer_provider, self._meter_provider):
            if provider is not None:
                try:
                    provider.shutdown()
                except Exception:  # noqa: BLE001 - a dead collector at exit is not an error
                    log.debug("telemetry shutdown failed", exc_info=True)
