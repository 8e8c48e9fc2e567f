"""Metrics, traces and logs from plain records, and over HTTP with a model-free engine."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from app.server import create_app
from app.settings import Settings
from kvcache.stats import KVCacheStats
from observability.logging_setup import JsonFormatter
from observability.metrics import Metrics, _batch_histogram
from observability.records import RequestRecord, ServerSnapshot
from observability.request_log import RequestLog
from observability.tracing import Tracing, _interval_ms
from scheduler.admission import AdmissionController, MemoryBudget
from scheduler.contracts import EngineStats
from scheduler.request import CacheReport, Request, RequestOutput, RequestStats
from scheduler.scheduler import Scheduler
from tests.helpers.fake_engine import FakeEngine, FakeRunner
from tests.helpers.http_server import serve_app
from tests.helpers.otlp_receiver import OTLPReceiver, attributes

REQUIRED = [
    "kvwarm:num_requests_running",
    "kvwarm:num_requests_waiting",
    "kvwarm:kv_cache_usage_perc",
    "kvwarm:prompt_cache_bytes",
    "kvwarm:prompt_cache_entries",
    "kvwarm:prefix_cache_queries_total",
    "kvwarm:prefix_cache_hits_total",
    "kvwarm:prompt_tokens_total",
    "kvwarm:generation_tokens_total",
    "kvwarm:request_success_total",
    "kvwarm:requests_rejected_total",
    "kvwarm:client_disconnects_total",
    "kvwarm:watchdog_aborts_total",
    "kvwarm:cache_correctness_events_total",
    "kvwarm:time_to_first_token_seconds_bucket",
    "kvwarm:inter_token_latency_seconds_bucket",
    "kvwarm:e2e_request_latency_seconds_bucket",
    "kvwarm:request_queue_time_seconds_bucket",
    "kvwarm:request_prefill_time_seconds_bucket",
    "kvwarm:request_decode_time_seconds_bucket",
    "kvwarm:request_prompt_tokens_bucket",
    "kvwarm:request_cached_tokens_bucket",
    "kvwarm:batch_size_bucket",
    "kvwarm:mlx_active_memory_bytes",
    "kvwarm:mlx_peak_memory_bytes",
    "kvwarm:mlx_cache_memory_bytes",
    "process_resident_memory_bytes",
]


def record(**kw) -> RequestRecord:
    base = dict(
        request_id="req-1",
        dialect="chat",
        model="m",
        prompt_tokens=100,
        cached_tokens=60,
        completion_tokens=10,
        finish="stop",
        e2e_s=2.0,
        started_at=time.time() - 2.0,
        ttft_s=0.5,
        stats=RequestStats(
            0.1, 0.4, 1.5, CacheReport("global", 60, 80, 0, 2, ("entry 3: volatile mismatch",))
        ),
        session="s1",
        request={"max_tokens": 32, "temperature": 0.0, "top_p": 1.0},
    )
    base.update(kw)
    return RequestRecord(**base)


def sample(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def _snapshot(**cache) -> ServerSnapshot:
    engine = EngineStats(
        1, 0, 0, 0, prompt_cache=KVCacheStats(**cache), batch_sizes=(0, 1), memory={}
    )
    return ServerSnapshot("m", 0, 0, 0, 100, 0, engine)


def test_refusals_before_the_model_is_known_count_under_its_name_once_loaded():
    """Requests refused while the model loads were filed under model_name="unknown",
    a series no dashboard's model picker selects, there for good. They show there
    until the model is known (one that never loads still shows its refusals)."""
    metrics = Metrics(lambda: None)
    metrics.observe_rejection("unavailable")
    metrics.observe_rejection("unavailable")
    assert sample(metrics, "kvwarm:requests_rejected_total", reason="unavailable") is None
    unknown = {"model_name": "unknown", "reason": "unavailable"}
    assert metrics.registry.get_sample_value("kvwarm:requests_rejected_total", unknown) == 2
    metrics.ensure_model("m")
    metrics.observe_rejection("unavailable", "m")
    text = metrics.render().decode()
    assert 'model_name="unknown"' not in text
    assert sample(metrics, "kvwarm:requests_rejected_total", reason="unavailable") == 3


def test_every_per_model_histogram_has_a_series_from_the_first_scrape():
    metrics = Metrics(lambda: None)
    metrics.ensure_model("m")
    assert sample(metrics, "kvwarm:request_prepare_time_seconds_count") == 0


def test_counters_are_token_denominated_and_typed_as_counters():
    metrics = Metrics(lambda: _snapshot(tokens_queried=150, tokens_reused=60))
    metrics.ensure_model("m")
    metrics.observe_request(record())
    metrics.observe_request(record(prompt_tokens=50, cached_tokens=0, finish="tool_calls"))
    # dropped from the queue by the watchdog: never prefilled, so no prompt tokens
    metrics.observe_request(
        record(finish="error", stats=None, ttft_s=None, completion_tokens=0, cached_tokens=0)
    )
    assert sample(metrics, "kvwarm:prompt_tokens_total", adapter="") == 150
    assert sample(metrics, "kvwarm:prefix_cache_queries_total") == 150  # the cache's own count
    assert sample(metrics, "kvwarm:prefix_cache_hits_total") == 60
    assert (
        sample(metrics, "kvwarm:request_success_total", finished_reason="tool_calls", adapter="")
        == 1
    )
    assert sample(metrics, "kvwarm:request_prefill_time_seconds_count") == 2
    text = metrics.render().decode()
    assert "# TYPE kvwarm:prompt_tokens_total counter" in text
    assert "# TYPE kvwarm:time_to_first_token_seconds histogram" in text
    # a 30 s prefill lands in a bucket of its own, not only in +Inf
    metrics.observe_request(record(stats=RequestStats(0.0, 30.0, 1.0)))
    assert sample(metrics, "kvwarm:request_prefill_time_seconds_bucket", le="20.0") == 2
    assert sample(metrics, "kvwarm:request_prefill_time_seconds_bucket", le="30.0") == 3


def test_otel_settings_that_turn_export_off():
    url = "http://127.0.0.1:9"
    assert not Tracing(env={"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_SDK_DISABLED": "true"}).active
    grpc = Tracing(env={"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert not grpc.active  # refused with a warning rather than silently sending HTTP to 4317
    only_metrics = Tracing(
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": url,
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRIC_EXPORT_INTERVAL": "x",
        }
    )
    assert only_metrics.describe() == "OTLP metrics"
    only_metrics.shutdown()


@pytest.mark.parametrize("interval", ["0", "-5", "nan", "inf", "1e400"])
def test_an_export_interval_the_sdk_refuses_falls_back_to_the_default(interval):
    """The SDK raised on 0 or a negative interval inside the startup hook (the
    server exited 3) and never exported with NaN: telemetry must not stop serving."""
    tracing = Tracing(
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
            "OTEL_METRIC_EXPORT_INTERVAL": interval,
        }
    )
    try:
        assert tracing.describe() == "OTLP traces + metrics"
        assert _interval_ms(interval) == 15000.0  # NaN: no error, and never an export
    finally:
        tracing.shutdown()


def test_batch_size_histogram_from_step_counts():
    h = _batch_histogram("m", (0, 5, 3, 0, 2))  # 5 steps of 1 row, 3 of 2, 2 of 4
    samples = {(s.name, s.labels.get("le")): s.value for s in h.samples}
    assert samples[("kvwarm:batch_size_bucket", "1.0")] == 5
    assert samples[("kvwarm:batch_size_bucket", "2.0")] == 8
    assert samples[("kvwarm:batch_size_bucket", "4.0")] == 10
    assert samples[("kvwarm:batch_size_bucket", "+Inf")] == 10
    assert samples[("kvwarm:batch_size_sum", None)] == 5 + 6 + 8


def test_watchdog_ends_requests_past_the_timeout():
    budget = MemoryBudget(total_bytes=10**6, weights_bytes=0, reserve_bytes=0, kv_bytes_per_token=1)
    sched = Scheduler(AdmissionController(budget, 4096), 1, 8, request_timeout_s=0.05)
    running, waiting = Request([1, 2], 4), Request([3], 4)
    sched.add(running)
    sched.add(waiting)
    assert sched.schedule().admit == [running]
    time.sleep(0.08)
    fresh = Request([4], 4)
    sched.add(fresh)
    plan = sched.schedule()
    assert plan.timed_out == [running.request_id]  # cut short: ends as finish "length"
    assert plan.expired == [waiting.request_id]  # never ran: refused, retry later
    assert plan.admit == [fresh]  # the freed slot goes to the next request
    assert sched.stats().watchdog_aborts_total == 2
    assert sched.stats().aborted_total == 2


def test_json_log_lines_and_cache_trace_files(tmp_path):
    log = RequestLog(tmp_path / "traces")
    captured = []
    handler = logging.Handler()
    handler.emit = lambda r: captured.append(JsonFormatter().format(r))
    logger = logging.getLogger("kvwarm.request")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log.write(record(session="agent/1 x"))
    finally:
        logger.removeHandler(handler)
    log.flush()
    line = json.loads(captured[0])
    assert line["request_id"] == "req-1" and line["session"] == "agent/1 x"
    assert (
        line["cached_tokens"] == 60 and line["cache_layer"] == "global" and line["prefill_s"] == 0.4
    )
    assert "cached=60" in line["message"] and "cache=global:60" in line["message"]
    (trace_file,) = (tmp_path / "traces").iterdir()
    assert trace_file.name == "agent_1_x.jsonl"
    entry = json.loads(trace_file.read_text())
    assert entry["cache_rejected"] == ["entry 3: volatile mismatch"]
    assert entry["cache_entry_tokens"] == 80


def test_cache_trace_files_are_written_off_the_callers_thread(tmp_path, monkeypatch):
    """The caller is the event loop (a request's end): a slow disk must not stall it."""
    writers = []
    real_open = Path.open

    def spying_open(self, *args, **kwargs):
        writers.append(threading.current_thread().name)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", spying_open)
    log = RequestLog(tmp_path)
    log.write(record(session="s"))
    log.close()
    assert writers == ["kvwarm-cache-trace"]
    assert json.loads((tmp_path / "s.jsonl").read_text())["request_id"] == "req-1"


def test_cache_trace_files_stop_at_their_byte_limit_counting_earlier_runs(tmp_path, caplog):
    """A client choosing a new session id each request made a file each, without end."""
    # one start time for all: time.time()'s repr varies in length, and a record a byte
    # longer than the first made the count of files that fit a matter of chance
    at = 1_795_000_000.5
    first = RequestLog(tmp_path, max_trace_bytes=10**6)
    first.write(record(session="old", started_at=at))
    first.close()
    held = (tmp_path / "old.jsonl").stat().st_size
    log = RequestLog(tmp_path, max_trace_bytes=held * 3)  # a restart counts what is there
    with caplog.at_level(logging.WARNING, logger="kvwarm.request"):
        for i in range(10):
            log.write(record(session=f"s{i}", started_at=at))
    log.flush()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["old.jsonl", "s0.jsonl", "s1.jsonl"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= held * 3
    assert sum("cache traces stopped" in m for m in caplog.messages) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvwarm.request"):  # full at start: said
        RequestLog(tmp_path, max_trace_bytes=held).write(record(session="s9", started_at=at))
    assert sum("cache traces stopped" in m for m in caplog.messages) == 1
    assert not (tmp_path / "s9.jsonl").exists()


def test_traces_carry_genai_attributes_and_the_callers_parent():
    receiver = OTLPReceiver()
    try:
        tracing = Tracing(
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "kv"}
        )
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        tracing.request_done(record(), {"traceparent": parent})
        tracing.flush()
        tracing.shutdown()
        spans = {s.name: s for s in receiver.spans}
        root = spans["chat m"]
        assert root.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
        assert root.parent_span_id.hex() == "b7ad6b7169203331"
        attrs = attributes(root)
        assert attrs["gen_ai.request.model"] == "m"
        assert attrs["gen_ai.usage.input_tokens"] == 100
        assert attrs["gen_ai.usage.output_tokens"] == 10
        assert attrs["kvwarm.cached_tokens"] == 60 and attrs["kvwarm.cache.layer"] == "global"
        assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
        for child in ("kvwarm.queue", "kvwarm.prefill", "kvwarm.decode"):
            assert spans[child].parent_span_id == root.span_id
        assert spans["kvwarm.prefill"].end_time_unix_nano - spans[
            "kvwarm.prefill"
        ].start_time_unix_nano == pytest.approx(0.4e9, rel=0.01)
        assert "gen_ai.server.time_to_first_token" in receiver.metric_names
        assert "kvwarm.prefix_cache.hits" in receiver.metric_names
    finally:
        receiver.close()


def test_tracing_is_off_without_an_endpoint():
    tracing = Tracing(env={})
    assert not tracing.active
    tracing.request_done(record(), {})  # a no-op


def _timed_requests(url: str, n: int) -> float:
    started = time.monotonic()
    for _ in range(n):
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        )
        assert r.status_code == 200
    return time.monotonic() - started


def test_a_dead_collector_neither_fails_nor_slows_requests(monkeypatch):
    def app():
        return create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, step_delay=0.01))

    with serve_app(app()) as url:
        _timed_requests(url, 3)
        baseline = _timed_requests(url, 15)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    dead = app()
    with serve_app(dead) as url:
        assert dead.state.kvwarm.obs.tracing.active
        _timed_requests(url, 3)
        slowed = _timed_requests(url, 15)
    assert slowed < baseline * 1.5 + 0.5, (baseline, slowed)


@pytest.fixture
def metrics_server():
    app = create_app(
        Settings(_env_file=None, max_queue=1, batch=1, request_timeout=1.0),
        lambda s, r: FakeEngine(s, r, step_delay=0.05, context_length=256),
    )
    with serve_app(app) as url:
        yield url


def _value(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": "fake-model", **labels}.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not exported")


def test_http_rejections_disconnects_and_watchdog_reach_metrics(metrics_server):
    url = metrics_server
    chat = url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    assert httpx.post(chat, json={"messages": msgs, "max_tokens": 10_000}).status_code == 400
    assert httpx.post(chat, json={"messages": "nope"}).status_code == 400
    # one running (slowly), one waiting, the third finds the queue full
    done = []
    threads = [
        threading.Thread(
            target=lambda: done.append(
                httpx.post(chat, json={"messages": msgs, "max_tokens": 12}, timeout=30)
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
        time.sleep(0.1)
    assert httpx.post(chat, json={"messages": msgs, "max_tokens": 2}).status_code == 429
    for t in threads:
        t.join()
    # the first ran 12 steps x 50 ms; the second waited, then ran past the 1 s watchdog
    # and was cut short as the seed server does: finish "length", what it had delivered
    assert [r.status_code for r in done] == [200, 200]
    cut = min(done, key=lambda r: r.json()["usage"]["completion_tokens"]).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert 0 < cut["usage"]["completion_tokens"] < 12
    assert cut["choices"][0]["message"]["content"].startswith("w0 w1 ")
    with httpx.stream(
        "POST", chat, json={"messages": msgs, "max_tokens": 15, "stream": True}
    ) as resp:
        next(resp.iter_lines())  # leave after the first chunk
    time.sleep(0.3)
    text = httpx.get(url + "/metrics").text
    assert _value(text, "kvwarm:requests_rejected_total", reason="over_context") == 1
    assert _value(text, "kvwarm:requests_rejected_total", reason="invalid") == 1
    assert _value(text, "kvwarm:requests_rejected_total", reason="queue_full") == 1
    assert _value(text, "kvwarm:watchdog_aborts_total") == 1
    assert _value(text, "kvwarm:client_disconnects_total") == 1
    assert _value(text, "kvwarm:request_success_total", finished_reason="length", adapter="") == 2
    for name in REQUIRED:
        assert f"\n{name}" in text, name


def test_an_http_request_with_traceparent_joins_the_callers_trace(monkeypatch):
    receiver = OTLPReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url + "/v1/traces")
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=3))
    try:
        with serve_app(app) as url:
            parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            r = httpx.post(
                url + "/v1/messages",
                json={
                    "model": "c",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "x"}],
                },
                headers={"traceparent": parent},
            )
            assert r.status_code == 200
            app.state.kvwarm.obs.tracing.flush()
        root = next(s for s in receiver.spans if s.name == "chat fake-model")
        assert root.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert root.parent_span_id.hex() == "00f067aa0ba902b7"
        attrs = attributes(root)
        assert attrs["kvwarm.dialect"] == "messages" and attrs["gen_ai.usage.output_tokens"] == 3
        assert {s.name for s in receiver.spans} >= {
            "kvwarm.queue",
            "kvwarm.prefill",
            "kvwarm.decode",
        }
    finally:
        receiver.close()


def test_preparation_counts_in_ttft_and_latency_and_not_as_queueing(monkeypatch):
    """Rendering and tokenising (and waiting for a preparation thread) are part of
    what the client waits for: TTFT and e2e left them out, so a server busy
    preparing long agent prompts showed fast first tokens."""
    from tests.helpers import fake_engine

    render = fake_engine.CharFormatter.render_chat

    def slow_render(self, *args, **kwargs):
        time.sleep(0.4)  # a long prompt's template and tokeniser
        return render(self, *args, **kwargs)

    monkeypatch.setattr(fake_engine.CharFormatter, "render_chat", slow_render)
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 200
        text = httpx.get(url + "/metrics").text
    assert _value(text, "kvwarm:time_to_first_token_seconds_sum") >= 0.4
    assert _value(text, "kvwarm:e2e_request_latency_seconds_sum") >= 0.4
    assert _value(text, "kvwarm:request_prepare_time_seconds_sum") >= 0.4
    assert _value(text, "kvwarm:request_queue_time_seconds_sum") < 0.4  # not queueing


def test_log_lines_tell_an_aborted_request_from_a_miss():
    from observability.request_log import plain_line
    from scheduler.request import CacheReport

    def line(**kw) -> str:
        fields = dict(request_id="r", dialect="chat", model="m", prompt_tokens=40)
        fields.update(cached_tokens=0, completion_tokens=0, finish="abort", e2e_s=1.0)
        return plain_line(RequestRecord(**fields, started_at=0.0, **kw))

    assert "cache=-" in line()  # left before reaching the prefix cache
    reused = CacheReport(layer="global", depth=24)
    assert "cache=global:24" in line(cache=reused)  # left mid-decode, after a hit
    assert "cache=miss" in line(cache=CacheReport())


def test_engine_steps_and_worst_gaps_are_histograms():
    from scheduler.cost_model import StepShape
    from scheduler.step_budget import StepBudget
    from scheduler.step_timings import StepTimings

    timings = StepTimings(StepBudget(1.0, 512, 4))
    for seconds, tokens in ((0.2, 0), (0.9, 24), (1.2, 16), (8.0, 512)):
        timings.record(seconds, tokens, tokens, budgeted=tokens < 512)
    timings.budget.observe(StepShape(2, 4000), 0.3)
    engine = EngineStats(1, 0, 0, 0, steps_report=timings.snapshot())
    metrics = Metrics(lambda: ServerSnapshot("m", 0, 0, 0, 100, 0, engine))
    metrics.ensure_model("m")
    metrics.observe_request(record(max_itl_s=1.7))
    assert sample(metrics, "kvwarm:engine_step_seconds_bucket", le="1.0") == 2
    assert sample(metrics, "kvwarm:engine_step_seconds_bucket", le="1.5") == 3
    assert sample(metrics, "kvwarm:engine_step_seconds_count") == 4
    assert sample(metrics, "kvwarm:engine_step_seconds_sum") == pytest.approx(10.3)
    assert sample(metrics, "kvwarm:engine_step_prefill_tokens_bucket", le="16.0") == 1
    assert sample(metrics, "kvwarm:engine_step_prefill_tokens_count") == 3
    assert sample(metrics, "kvwarm:engine_max_step_seconds") == 1.0
    assert sample(metrics, "kvwarm:request_max_inter_token_gap_seconds_bucket", le="1.5") == 0
    assert sample(metrics, "kvwarm:request_max_inter_token_gap_seconds_bucket", le="2.0") == 1
    view = timings.snapshot().as_dict()
    assert view["steps"] == 4 and view["budget"] == "time" and view["budgeted_steps"] == 2
    assert view["step_seconds_quantiles"]["p50"] == 1.0  # the bucket bound, as Prometheus says
    assert view["cost_model"]["decode_samples"] == 1


def test_requests_tokens_and_cache_reuse_carry_the_adapter():
    metrics = Metrics()
    metrics.ensure_model("m")
    metrics.observe_request(record())
    metrics.observe_request(record(prompt_tokens=70, cached_tokens=64, adapter="sql"))
    metrics.observe_request(record(prompt_tokens=30, cached_tokens=0, adapter="sql"))
    assert sample(metrics, "kvwarm:prompt_tokens_total", adapter="sql") == 100
    assert sample(metrics, "kvwarm:prompt_tokens_total", adapter="") == 100
    assert (
        sample(metrics, "kvwarm:request_success_total", finished_reason="stop", adapter="sql") == 2
    )
    assert sample(metrics, "kvwarm:request_cached_tokens_sum", adapter="sql") == 64
    assert sample(metrics, "kvwarm:generation_tokens_total", adapter="sql") is not None


def test_a_request_ending_after_its_adapter_is_unmounted_brings_no_series_back():
    """A request still finishing (engine done, response open) or one failing
    adapter_not_found after the unmount re-created the adapter's series, which
    then stayed for good: nothing removes them a second time."""
    metrics = Metrics()
    metrics.ensure_model("m")
    metrics.observe_request(record(adapter="lora-7"))
    metrics.forget_adapter("lora-7")
    metrics.observe_request(record(adapter="lora-7", finish="error"))
    metrics.observe_request(record(adapter="lora-7", completion_tokens=0, stats=None))

    def labelled(adapter: str) -> list[str]:
        return [
            s.name
            for family in metrics.registry.collect()
            for s in family.samples
            if s.labels.get("adapter") == adapter
        ]

    assert labelled("lora-7") == []
    # still counted: under the base model's series, not dropped from the totals
    assert sample(metrics, "kvwarm:request_success_total", finished_reason="error", adapter="") == 1
    metrics.adapter_mounted("lora-7")  # mounted again: its own series again
    metrics.observe_request(record(adapter="lora-7"))
    assert (
        sample(metrics, "kvwarm:request_success_total", finished_reason="stop", adapter="lora-7")
        == 1
    )


def test_engine_row_faults_and_batch_recoveries_reach_metrics_and_stats():
    """The runner's counts (tests/engine/test_fault_isolation.py makes them move)
    are what /metrics and /stats report."""
    engines: list[FakeEngine] = []

    def engine(s, r):
        engines.append(FakeEngine(s, r, eos_after=2))
        return engines[-1]

    with serve_app(create_app(Settings(_env_file=None), engine)) as url:
        text = httpx.get(url + "/metrics").text
        assert _value(text, "kvwarm:engine_row_faults_total") == 0
        engines[0].fake.row_faults, engines[0].fake.recoveries = 3, 1
        text = httpx.get(url + "/metrics").text
        stats = httpx.get(url + "/stats").json()["engine"]
    assert _value(text, "kvwarm:engine_row_faults_total") == 3
    assert _value(text, "kvwarm:engine_batch_recoveries_total") == 1
    assert stats["row_faults"] == 3 and stats["batch_recoveries"] == 1


def test_an_accepted_request_that_fails_counts_once_and_admin_400s_not_at_all(monkeypatch):
    """A request that expires in the queue was accepted: it is one finished-in-error
    request, not also a refused one; a bad adapter or KV admin call is no refused
    generation request."""
    monkeypatch.setattr(
        FakeRunner,
        "add",
        lambda self, req: RequestOutput.failure(
            req.request_id, "expired in the queue", "queue_timeout"
        ),
    )
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r))
    with serve_app(app) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
        for stream in (False, True):
            r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 503 and "queue_timeout" in r.text
        for path, sent in (
            ("/v1/adapters", {"id": "x"}),
            ("/v1/conv_kv/save", {"conversation_id": 5}),
        ):
            assert httpx.post(url + path, json=sent).status_code == 400
        text = httpx.get(url + "/metrics").text
    assert _value(text, "kvwarm:request_success_total", finished_reason="error", adapter="") == 2
    for reason in ("unavailable", "invalid"):
        assert _value(text, "kvwarm:requests_rejected_total", reason=reason) == 0


def test_a_request_cancelled_mid_prefill_counts_its_prompt():
    metrics = Metrics()
    cancelled = record(
        prompt_tokens=100_000, cached_tokens=0, completion_tokens=0, ttft_s=None, stats=None,
        finish="abort", disconnected=True, cache=CacheReport(tier="none"),
    )  # fmt: skip
    metrics.observe_request(cancelled)
    assert sample(metrics, "kvwarm:prompt_tokens_total", adapter="") == 100_000


def test_the_decode_rate_counts_the_gaps_after_the_first_token():
    two = record(completion_tokens=2, stats=RequestStats(0.0, 0.1, 0.1))
    assert two.tokens_per_s == pytest.approx(10.0)  # one gap of 0.1 s
    assert record(completion_tokens=1, stats=RequestStats(0.0, 0.1, 0.0)).tokens_per_s == 0


def test_otel_counts_no_prompt_or_cache_query_for_a_request_never_prefilled():
    tracing = Tracing(env={})
    reader = InMemoryMetricReader()
    tracing._meter_provider = MeterProvider(metric_readers=[reader])  # noqa: SLF001
    tracing._instruments()  # noqa: SLF001
    dropped = record(
        prompt_tokens=30_000, cached_tokens=0, completion_tokens=0, ttft_s=None, stats=None,
        finish="abort", disconnected=True, cache=None,
    )  # fmt: skip
    assert not dropped.reached_engine
    tracing.request_done(dropped, {})
    sums: dict[str, float] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    sums[metric.name] = sums.get(metric.name, 0) + getattr(point, "value", 0)
    assert sums.get("kvwarm.prompt_tokens", 0) == 0
    assert sums.get("kvwarm.prefix_cache.queries", 0) == 0
    assert sums["kvwarm.requests"] == 1  # the request itself is still counted


def test_otel_latency_histograms_have_second_sized_buckets():
    """Recorded in seconds, they took the SDK's millisecond-sized default buckets
    (0, 5, 10, ... 10000): every latency under 5 s fell in one bucket."""
    tracing = Tracing(env={})
    reader = InMemoryMetricReader()
    tracing._meter_provider = MeterProvider(metric_readers=[reader])  # noqa: SLF001
    tracing._instruments()  # noqa: SLF001
    for ttft in (0.05, 0.2, 0.8, 2.0, 4.5):
        tracing.request_done(
            record(ttft_s=ttft, stats=RequestStats(0.01, ttft, 2.0, CacheReport())), {}
        )
    occupied: dict[str, int] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.unit == "s":
                    (point,) = metric.data.data_points
                    occupied[metric.name] = sum(1 for c in point.bucket_counts if c)
    assert occupied["gen_ai.server.time_to_first_token"] == 5
    assert occupied["kvwarm.request.prefill_time"] == 5


def test_the_measured_decode_rate_counts_only_requests_the_engine_finished():
    """A client that leaves mid-stream has tokens but no decode time: they were
    added to /fit's per-stream rate all the same (10 tok/s read as 20)."""
    metrics = Metrics()
    metrics.observe_request(
        record(completion_tokens=101, stats=RequestStats(0.0, 0.1, 10.0, CacheReport()))
    )
    metrics.observe_request(
        record(completion_tokens=101, stats=None, finish="abort", disconnected=True)
    )
    assert metrics.decode_rate() == pytest.approx(10.0)


def test_a_request_the_step_budget_never_started_counts_its_wait_as_queueing(monkeypatch):
    """Admitted, its cache report sent, never started, then ended by the watchdog
    (503 queue_timeout): the longest waits were missing from the queue histogram."""
    from dataclasses import replace

    def admitted_then_expired(self, req):
        expired = RequestOutput.failure(req.request_id, "waited too long", "queue_timeout")
        return replace(expired, cache=CacheReport(tier="none"))

    monkeypatch.setattr(FakeRunner, "add", admitted_then_expired)
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r))
    with serve_app(app) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 503
        text = httpx.get(url + "/metrics").text
    assert _value(text, "kvwarm:request_queue_time_seconds_count") == 1


def test_process_series_are_exported_where_there_is_no_proc():
    """prometheus_client's ProcessCollector reads /proc: on macOS it exported
    nothing and the dashboard's RSS line stayed empty. The psutil stand-in gives
    the same series, with the same values to within the process's own growth."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    from observability.metrics import _PsutilProcessCollector

    def series(collector) -> dict[str, float]:
        registry = CollectorRegistry()
        registry.register(collector)
        return {s.name: s.value for m in registry.collect() for s in m.samples}

    linux = series(ProcessCollector(registry=None))
    ours = series(_PsutilProcessCollector())
    wanted = {
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_cpu_seconds_total",
        "process_start_time_seconds",
    }
    assert wanted <= set(linux) and wanted <= set(ours)
    rss = ours["process_resident_memory_bytes"]
    assert 0.5 < rss / linux["process_resident_memory_bytes"] < 2
    assert abs(ours["process_start_time_seconds"] - linux["process_start_time_seconds"]) < 2


def test_a_warm_first_token_lands_in_a_bucket_of_its_own():
    """The first latency bucket was 50 ms: every warm turn's first token fell in it."""
    from observability.metrics import LATENCY_BUCKETS
    from scheduler.step_timings import PREFILL_TOKENS_BOUNDS, STEP_SECONDS_BOUNDS

    assert LATENCY_BUCKETS[0] <= 0.005 and list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    assert STEP_SECONDS_BOUNDS[0] <= 0.001 and PREFILL_TOKENS_BOUNDS[-1] >= 65536


def test_a_session_id_with_a_lone_surrogate_gets_its_reply_and_its_trace_line(tmp_path):
    """Claude Code's metadata.user_id is JSON the server parses itself: an escaped lone
    surrogate there made a session id that failed the request after generation (the
    trace file's encode; on chat and messages already healing's scope hash)."""
    app = create_app(
        Settings(_env_file=None, cache_trace_dir=str(tmp_path)),
        lambda s, r: FakeEngine(s, r, eos_after=3),
    )
    metadata = {"user_id": '{"session_id": "\\ud800x"}'}
    msgs = [{"role": "user", "content": "hi"}]
    calls = [
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 8}),
        ("/v1/messages", {"model": "c", "messages": msgs, "max_tokens": 8}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
    ]
    with serve_app(app) as url:
        for path, body in calls:
            for stream in (False, True):
                r = httpx.post(url + path, json={**body, "stream": stream, "metadata": metadata})
                assert r.status_code == 200, (path, r.text)
                assert "error" not in r.text, (path, r.text)
        app.state.kvwarm.obs.log.flush()
        text = httpx.get(url + "/metrics").text
    assert _value(text, "kvwarm:request_success_total", finished_reason="stop", adapter="") == 6
    (trace_file,) = tmp_path.iterdir()
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert [line["dialect"] for line in lines] == [
        d for d in ("chat", "messages", "completions") for _ in range(2)
    ]
    assert {line["session"] for line in lines} == {"\\ud800x"}


def test_a_trace_line_for_a_session_that_is_not_valid_text_is_still_written(tmp_path):
    log = RequestLog(tmp_path)
    log.write(record(session="a\ud800"))  # raised UnicodeEncodeError on the caller
    log.close()
    (trace_file,) = tmp_path.iterdir()
    assert json.loads(trace_file.read_text())["request_id"] == "req-1"


def test_one_observer_that_fails_neither_fails_the_request_nor_silences_the_others(
    tmp_path, monkeypatch, caplog
):
    from observability.hub import Observability

    obs = Observability(trace_dir=tmp_path, env={})

    def broken(rec: RequestRecord) -> None:
        raise RuntimeError("observer bug")

    monkeypatch.setattr(obs.metrics, "observe_request", broken)
    with caplog.at_level(logging.WARNING):
        obs.request_done(record(session="s"), {})  # raised into Generation._close
    obs.shutdown()
    assert json.loads((tmp_path / "s.jsonl").read_text())["request_id"] == "req-1"
    assert any("req-1" in m for m in caplog.messages)


def test_a_request_that_timed_out_in_the_queue_shows_its_wait_in_log_and_trace():
    """It carries its wait (waited_s) and no engine stats: /metrics had its 30 s in
    the queue histogram while its log line said queue=- and its trace had no child."""
    from observability.request_log import plain_line

    rec = record(
        completion_tokens=0,
        cached_tokens=0,
        finish="error",
        e2e_s=30.2,
        ttft_s=None,
        stats=None,
        prepare_s=0.2,
        waited_s=30.0,
    )
    assert rec.fields()["queue_s"] == 30.0
    assert "queue=30.00s" in plain_line(rec)
    receiver = OTLPReceiver()
    try:
        tracing = Tracing(env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces"})
        tracing.request_done(rec, {})
        tracing.flush()
        tracing.shutdown()
        spans = {s.name: s for s in receiver.spans}
        assert set(spans) == {"chat m", "kvwarm.prepare", "kvwarm.queue"}
        queue = spans["kvwarm.queue"]
        assert queue.parent_span_id == spans["chat m"].span_id
        assert queue.end_time_unix_nano - queue.start_time_unix_nano == pytest.approx(
            30e9, rel=0.01
        )
    finally:
        receiver.close()


@pytest.mark.parametrize(
    "env,name",
    [
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=agents-box,deployment.environment=prod"},
            "agents-box",
        ),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=a%20b", "OTEL_SERVICE_NAME": "kv"}, "kv"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=a%20b"}, "a b"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"}, "kvwarm"),
        ({}, "kvwarm"),
    ],
)
def test_the_service_name_is_kvwarm_only_where_the_environment_names_none(monkeypatch, env, name):
    """kvwarm's default overrode a service.name set in OTEL_RESOURCE_ATTRIBUTES: its
    traces and metrics showed up under a service nobody configured."""
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    tracing = Tracing()
    try:
        resource = tracing._tracer_provider.resource.attributes  # noqa: SLF001
        assert resource["service.name"] == name
        if "deployment.environment" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            assert resource["deployment.environment"] == "prod"  # the others still apply
    finally:
        tracing.shutdown()


def test_a_request_that_ended_before_its_first_token_is_no_prefill_or_decode_time():
    """One failed or cut off in prefill carries stats whose prefill runs until it
    ended and whose decode is 0: the prefill histograms took its time until the
    failure as a prefill time, the decode histogram a 0 s decode."""
    failed = record(
        completion_tokens=0, ttft_s=None, finish="error",
        stats=RequestStats(0.1, 5.0, 0.0, CacheReport()),
    )  # fmt: skip
    metrics = Metrics()
    metrics.ensure_model("m")
    metrics.observe_request(failed)
    assert sample(metrics, "kvwarm:request_prefill_time_seconds_count") == 0
    assert sample(metrics, "kvwarm:request_decode_time_seconds_count") == 0
    assert sample(metrics, "kvwarm:request_queue_time_seconds_count") == 1  # it did queue
    tracing = Tracing(env={})
    reader = InMemoryMetricReader()
    tracing._meter_provider = MeterProvider(metric_readers=[reader])  # noqa: SLF001
    tracing._instruments()  # noqa: SLF001
    tracing.request_done(failed, {})
    names = {
        metric.name
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert "kvwarm.request.queue_time" in names and "kvwarm.request.prefill_time" not in names
