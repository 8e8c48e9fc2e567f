"""Real `kvwarm serve` processes on the real small model (SmolLM2-135M)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.http_server import free_port, wait_for_process

KVWARM = str(Path(sys.executable).with_name("kvwarm"))
READY_TIMEOUT_S = 240


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One conversion of the embedded GGUF per test session."""
    cache = Path(os.environ.get("KVWARM_TEST_CACHE_DIR") or tmp_path_factory.mktemp("kvwarm-cache"))
    env = {**os.environ, "KVWARM_CACHE_DIR": str(cache)}
    subprocess.run([KVWARM, "prepare"], env=env, check=True, capture_output=True, timeout=600)
    return cache


@contextmanager
def kvwarm_server(cache: Path, *args: str, log: Path) -> Iterator[str]:
    port = free_port()
    # each server its own SSD tier: one test's cached KV never warms another's
    env = {**os.environ, "KVWARM_CACHE_DIR": str(cache), "KVWARM_KV_DIR": str(log.parent / "kv")}
    env.pop("KVWARM_API_KEY", None)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [KVWARM, "serve", "--port", str(port), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,  # no stray .env
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_process(proc, base + "/health", log, "kvwarm", READY_TIMEOUT_S)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def server(model_cache, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve-batch8") / "kvwarm.log"
    with kvwarm_server(model_cache, "--batch", "8", log=log) as base:
        yield base


@pytest.fixture(scope="session")
def small_server(model_cache, tmp_path_factory) -> Iterator[str]:
    """--batch 1, one queue slot, a 1 GB budget (a KV ceiling of a few hundred
    tokens: no prompt cache carved out of it), an API key."""
    log = tmp_path_factory.mktemp("serve-batch1") / "kvwarm.log"
    args = ("--batch", "1", "--max-queue", "1", "--memory-budget", "1GB", "--api-key", "sekrit")
    args += ("--prompt-cache-bytes", "0")
    with kvwarm_server(model_cache, *args, log=log) as base:
        yield base


@pytest.fixture(scope="session")
def strict_server(model_cache, tmp_path_factory) -> Iterator[str]:
    """--batch 4 with --volatile-policy strict: only exact token prefixes are reused."""
    log = tmp_path_factory.mktemp("serve-strict") / "kvwarm.log"
    args = ("--batch", "4", "--volatile-policy", "strict", "--cache-block-size", "8")
    with kvwarm_server(model_cache, *args, log=log) as base:
        yield base
