"""One log format for kvwarm and uvicorn, set from --log-level."""

from __future__ import annotations

import logging

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT, datefmt="%Y-%m-%d %H:%M:%S", force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # transformers/huggingface chatter is noise at info level
    for name in ("transformers", "huggingface_hub", "httpx"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
