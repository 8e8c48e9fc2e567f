"""Real external programs some tests run against (Prometheus, LiteLLM)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def require(name: str, path: str | Path | None) -> str:
    """The program's path; a skip where it is not installed, a failure in CI
    (``KVWARM_REQUIRE_TEST_TOOLS=1``, set by .ci/run, which installs them)."""
    if path and Path(path).exists():
        return str(path)
    message = f"{name} is not installed (make test-tools installs it)"
    if os.environ.get("KVWARM_REQUIRE_TEST_TOOLS"):
        pytest.fail(message)
    pytest.skip(message)


def prometheus() -> str:
    return require("prometheus", shutil.which("prometheus"))


def litellm() -> str:
    venv = Path(os.environ.get("LITELLM_VENV", ROOT / ".venv-litellm"))
    return require("litellm", venv / "bin" / "litellm")
