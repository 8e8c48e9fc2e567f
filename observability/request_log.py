"""One log line per request, and optional per-session cache trace files.

The line is plain text by default and one JSON object with ``--log-json`` (the
fields ride on the record as ``kvwarm``; the JSON formatter emits them). Cache
trace files (``--cache-trace-dir``) get one JSON line per request of a session:
what the prefix cache reused, from which entry, and why other candidates were
turned down — the file to read when a turn that should have been warm was cold.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from pathlib import Path

from observability.escape import ascii_escaped
from observability.records import RequestRecord

log = logging.getLogger("kvwarm.request")
# a client choosing a new session id each request made a file each, without end
MAX_TRACE_BYTES = 1 << 30
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def plain_line(rec: RequestRecord) -> str:
    f = rec.fields()

    def secs(key: str) -> str:
        return f"{f[key]:.2f}s" if f[key] is not None else "-"

    if rec.cache_report is None:
        cache = "-"  # never reached the prefix cache
    elif f["cache_layer"]:
        cache = f"{f['cache_layer']}:{f['cache_depth']}"
    else:
        cache = "miss"
    return (
        f"{rec.request_id} {rec.dialect} done: prompt={rec.prompt_tokens} cached={rec.cached_tokens} "
        f"completion={rec.completion_tokens} queue={secs('queue_s')} prefill={secs('prefill_s')} "
        f"decode={secs('decode_s')} ttft={secs('ttft_s')} total={rec.e2e_s:.2f}s "
        f"({f['tokens_per_s']:.1f} tok/s) finish={rec.finish} tool_calls={rec.tool_calls} "
        # a client-chosen id: escaped, so a newline in it cannot forge a log line
        f"cache={cache} session={ascii_escaped(rec.session or '-')}"
        + (f" adapter={rec.adapter}" if rec.adapter else "")
    )


class RequestLog:
    def __init__(self, trace_dir: str | Path | None = None, max_trace_bytes: int = MAX_TRACE_BYTES):
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.max_trace_bytes = max_trace_bytes
        self._trace_bytes = 0  # what the trace files hold, earlier runs' included
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            self._trace_bytes = sum(p.stat().st_size for p in self.trace_dir.glob("*.jsonl"))
        self._lock = threading.Lock()
        if self._trace_bytes > self.max_trace_bytes:
            self._stop_tracing()
        # file writes happen here, not on the event loop that finishes requests
        self._lines: queue.Queue[tuple[Path, bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    def _stop_tracing(self) -> None:
        """Said once; the count then stays over the limit."""
        log.warning(
            "cache traces stopped: %s holds %d bytes, the limit is %d",
            self.trace_dir,
            self._trace_bytes,
            self.max_trace_bytes,
        )
        self._trace_bytes = self.max_trace_bytes + 1

    def write(self, rec: RequestRecord) -> None:
        log.info("%s", plain_line(rec), extra={"kvwarm": rec.fields()})
        if self.trace_dir is not None:
            self._trace(rec)

    def trace_path(self, session: str | None) -> Path:
        assert self.trace_dir is not None
        name = _UNSAFE.sub("_", session or "no-session")[:120] or "no-session"
        return self.trace_dir / f"{name}.jsonl"

    def _trace(self, rec: RequestRecord) -> None:
        cache = rec.cache_report
        line = {
            "ts": rec.started_at,
            **rec.fields(),
            "cache_entry_tokens": cache.entry_tokens if cache else 0,
            "cache_stale_tokens": cache.stale_tokens if cache else 0,
            "cache_candidates": cache.candidates if cache else 0,
            "cache_rejected": list(cache.rejected) if cache else [],
        }
        # a lone surrogate (in a session id) cannot be UTF-8: escaped, not raised into
        # the request that is ending
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
        with self._lock:
            if self._trace_bytes + len(data) > self.max_trace_bytes:
                if self._trace_bytes <= self.max_trace_bytes:
                    self._stop_tracing()
                return
            self._trace_bytes += len(data)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_lines, name="kvwarm-cache-trace", daemon=True
                )
                self._writer.start()
        self._lines.put((self.trace_path(rec.session), data))

    def _write_lines(self) -> None:
        while (item := self._lines.get()) is not None:
            path, data = item
            try:
                with path.open("ab") as out:
                    out.write(data)
            except OSError as exc:  # a full disk must not fail requests
                log.warning("cache trace not written: %s", exc)
            finally:
                self._lines.task_done()
        self._lines.task_done()

    def flush(self) -> None:
        """Wait until every queued trace line is written."""
        if self._writer is not None:
            self._lines.join()

    def close(self) -> None:
        if self._writer is not None:
            self._lines.put(None)
            self._writer.join(timeout=5)
            self._writer = None
