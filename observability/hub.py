"""Every observer of finished requests behind one call: metrics, traces, the log line."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from observability.metrics import Metrics
from observability.records import RequestRecord, ServerSnapshot
from observability.request_log import RequestLog
from observability.tracing import Tracing

log = logging.getLogger("kvwarm.obs")


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
        """Each observer alone: called as a request ends (after its reply, perhaps
        inside its stream), a bug in one must neither fail the request nor keep
        the others from seeing it."""
        observers: tuple[Callable[[], None], ...] = (
            lambda: self.metrics.observe_request(rec),
            lambda: self.tracing.request_done(rec, headers),
            lambda: self.log.write(rec),
        )
        for observe in observers:
            try:
                observe()
            except Exception:  # noqa: BLE001 - observing must never fail a request
                log.warning("observing %s failed", rec.request_id, exc_info=True)

    def adapter_mounted(self, adapter_id: str) -> None:
        self.metrics.adapter_mounted(adapter_id)

    def adapter_unmounted(self, adapter_id: str) -> None:
        self.metrics.forget_adapter(adapter_id)

    def shutdown(self) -> None:
        self.tracing.shutdown()
        self.log.close()
