"""The KV store on the real model over HTTP: restarts (clean and kill -9), saved
conversations, the X-Conv-* headers. Every warm answer is checked against a
cold one (the same request with use_kv_cache: false, greedy, strict policy)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import KVWARM, READY_TIMEOUT_S
from tests.helpers.http_server import free_port, wait_for_process

RULES = "Answer in one short sentence. Never use lists. Be concrete and careful. " * 12
SYSTEM = f"You are a terse assistant for a team of engineers. {RULES}"


@contextmanager
def served(
    cache: Path, kv_dir: Path, log: Path, *args: str
) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    env = {**os.environ, "KVWARM_CACHE_DIR": str(cache)}
    env.pop("KVWARM_API_KEY", None)
    with log.open("a") as out:
        proc = subprocess.Popen(
            [
                KVWARM,
                "serve",
                "--port",
                str(port),
                "--kv-dir",
                str(kv_dir),
                "--volatile-policy",
                "strict",
                "--batch",
                "2",
                *args,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_process(proc, base + "/health", log, "kvwarm", READY_TIMEOUT_S)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def messages(turn: int) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"Question {t}: what is {t} plus {t}?"})
        if t < turn:
            msgs.append({"role": "assistant", "content": f"{t} plus {t} is {2 * t}."})
    return msgs


def chat(base: str, msgs: list[dict], conv: str = "conv-a", **extra) -> httpx.Response:
    body = {"messages": msgs, "max_tokens": 16, "temperature": 0, "conversation_id": conv, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r


def content(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def kv_stats(base: str) -> dict:
    return httpx.get(base + "/stats", timeout=10).json()["prompt_cache"]


def settle(base: str, timeout: float = 30) -> dict:
    """Wait until the writer has nothing queued."""
    deadline = time.monotonic() + timeout
    while True:
        st = kv_stats(base)
        if st["disk_pending_bytes"] == 0 and st["disk_files_written"] > 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.2)


def in_ram(base: str, conversation_id: str, timeout: float = 60.0) -> None:
    """Wait until a loaded conversation's KV is in RAM."""
    deadline = time.monotonic() + timeout
    while True:
        listed = httpx.get(base + "/v1/conv_kv/stats").json()["data"]
        tiers = [c["tier"] for c in listed if c["conversation_id"] == conversation_id]
        if tiers and "ram" in tiers[0]:
            return
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)


def test_restart_is_warm_and_saved_conversations_survive(model_cache, tmp_path):
    kv, log = tmp_path / "kv", tmp_path / "kvwarm.log"
    with served(model_cache, kv, log) as (base, _):
        first = chat(base, messages(0))
        assert first.headers["x-conv-kv"] == "fresh" and first.headers["x-conv-id"] == "conv-a"
        second = chat(base, messages(1))
        assert second.headers["x-conv-kv"] == "hit"
        assert int(second.headers["x-conv-cached-tokens"]) > 0
        settle(base)
        saved = httpx.post(
            base + "/v1/conv_kv/save", json={"conversation_id": "conv-a", "title": "sums"}
        )
        assert saved.status_code == 200, saved.text
        assert saved.json()["tokens"] > 0 and "disk" in saved.json()["tier"]
        missing = httpx.post(base + "/v1/conv_kv/save", json={"conversation_id": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["code"]
    with served(model_cache, kv, log) as (base, _):
        st = kv_stats(base)
        assert st["restored_entries"] >= 1 and st["entries"] == 0  # on disk, not in RAM
        listed = httpx.get(base + "/v1/conv_kv/stats").json()["data"]
        assert [c["conversation_id"] for c in listed] == ["conv-a"]
        assert listed[0]["title"] == "sums"
        loaded = httpx.post(base + "/v1/conv_kv/load", json={"conversation_id": "conv-a"})
        assert loaded.status_code == 200 and loaded.json()["tier"] in ("loading", "ram+disk")
        in_ram(base, "conv-a")  # read on the reader thread: in RAM shortly
        warm = chat(base, messages(2))
        assert warm.headers["x-conv-kv"] == "hit"
        assert int(warm.headers["x-conv-cached-tokens"]) > 0
        cold = chat(base, messages(2), conv="conv-cold", use_kv_cache=False)
        assert cold.headers["x-conv-kv"] == "disabled"
        assert content(warm) == content(cold)
        gone = httpx.delete(base + "/v1/conv_kv/conv-a")
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        assert httpx.delete(base + "/v1/conv_kv/conv-a").status_code == 404


def test_the_first_turn_after_a_restart_reads_the_disk(model_cache, tmp_path):
    kv, log = tmp_path / "kv", tmp_path / "kvwarm.log"
    with served(model_cache, kv, log) as (base, _):
        chat(base, messages(0))
        chat(base, messages(1))
        settle(base)
    with served(model_cache, kv, log) as (base, _):
        warm = chat(base, messages(2))
        assert warm.headers["x-conv-kv"] == "disk"
        st = kv_stats(base)
        assert st["disk_hits"] == 1 and st["disk_load_tokens"] > 0
        cold = chat(base, messages(2), conv="cold", use_kv_cache=False)
        assert content(warm) == content(cold)


def test_kill_9_mid_write_loads_only_whole_files(model_cache, tmp_path):
    kv, log = tmp_path / "kv", tmp_path / "kvwarm.log"
    with served(model_cache, kv, log) as (base, proc):
        for turn in range(3):
            chat(base, messages(turn), conv=f"c{turn}")
        os.kill(proc.pid, signal.SIGKILL)  # writes may be in flight
        proc.wait(10)
    torn = list(kv.rglob(".*.tmp-*"))
    with served(model_cache, kv, log) as (base, _):
        st = kv_stats(base)
        assert st["disk_files_discarded"] >= len(torn)
        assert not list(kv.rglob(".*.tmp-*"))
        warm = chat(base, messages(3), conv="c2")
        cold = chat(base, messages(3), conv="cold", use_kv_cache=False)
        assert content(warm) == content(cold)


def test_saving_beyond_the_disk_limit_is_507(model_cache, tmp_path):
    kv, log = tmp_path / "kv", tmp_path / "kvwarm.log"
    with served(model_cache, kv, log, "--kv-disk-bytes", "2MiB") as (base, _):
        chat(base, messages(1))
        r = httpx.post(base + "/v1/conv_kv/save", json={"conversation_id": "conv-a"})
        assert r.status_code == 507, r.text
        assert "--kv-disk-bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/conv_kv/load", "/v1/conv_kv/save"])
@pytest.mark.parametrize("conversation_id", [True, " ", {"id": "x"}, None])
def test_conv_routes_validate_their_body(server, path, conversation_id):
    """Ids are read as chat reads them (7 is "7", a 404 when unknown); what no
    request could name is a 400."""
    r = httpx.post(server + path, json={"conversation_id": conversation_id})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
    unknown = httpx.post(server + path, json={"conversation_id": 7})
    assert unknown.status_code == 404, unknown.text
