"""Every observer of finished requests behind one call: metrics, traces, the log line."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from observability.metrics import Metrics
from observability.records import RequestRecord, ServerSnapshot
from observability.request_log import RequestLog
from observability.tracing import Tracing


class Observability:
    def __init__(
        self,
        snapshot: Callable[[], ServerSnapshot | None] = lambda: None,
        trace_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ):
        self.metrics = Metrics(snapshot)
        self.tracing = Tracing(snapshot, env)
        self.log = RequestLog(trace_dir)

    def request_done(self, rec: RequestRecord, headers: Mapping[str, str]) -> None:
        self.metrics.observe_request(rec)
        self.tracing.request_done(rec, headers)
        self.log.write(rec)

    def adapter_unmounted(self, adapter_id: str) -> None:
        self.metrics.forget_adapter(adapter_id)

    def shutdown(self) -> None:
        self.tracing.shutdown()
        self.log.close()
