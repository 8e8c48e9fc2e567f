"""One log format for kvwarm and uvicorn, set from --log-level."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; request lines carry their fields (``extra={"kvwarm": ...}``)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "kvwarm", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str, json_lines: bool = False) -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT, datefmt="%Y-%m-%d %H:%M:%S", force=True)
    if json_lines:
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # transformers/huggingface chatter is noise at info level
    for name in ("transformers", "huggingface_hub", "httpx"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
