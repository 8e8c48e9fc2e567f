"""Two ranks on loopback: `kvwarm serve` under `mlx.launch --backend ring -n 2`
and through its own flags (the Kamiwaza seed's way), against one rank alone."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import KVWARM, READY_TIMEOUT_S, kvwarm_server
from tests.helpers.http_server import free_port, wait_for_process
from tests.helpers.tiny_models import write_tiny_llama

MLX_LAUNCH = str(Path(sys.executable).with_name("mlx.launch"))
CHAT = "/v1/chat/completions"
TINY = ("--memory-budget", "2GB", "--batch", "4")
PROMPTS = [
    "hello there, how are you doing today? tell me a story about a dragon",
    "the quick brown fox jumps over the lazy dog, again and again",
    "list three prime numbers and explain why they are prime",
    "write a haiku about the sea",
]
RANK_TIMEOUT_S = 2.0
TOKEN = re.compile(r'^data: \{.*"content":"[^"]')


def _ring_ports(n: int) -> int:
    """A base port with ``n`` + 1 free ports from it: rank r listens on base + r, the
    serving rank's heartbeat on base + n."""
    for _ in range(50):
        base = free_port()
        if base + n > 65000:
            continue
        try:
            socks = []
            for p in range(base, base + n + 1):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _env(cache: Path) -> dict[str, str]:
    env = {**os.environ, "KVWARM_CACHE_DIR": str(cache)}
    for name in ("KVWARM_API_KEY", "MLX_RANK", "MLX_HOSTFILE", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


@contextmanager
def launched_group(cache: Path, *args: str, log: Path) -> Iterator[str]:
    """`mlx.launch --backend ring -n 2 kvwarm serve ...`: rank 0 serves HTTP."""
    port = free_port()
    cmd = [MLX_LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(_ring_ports(2))]
    cmd += ["--python", sys.executable, KVWARM, "serve", "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            env=_env(cache),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_process(proc, base + "/health", log, "mlx.launch kvwarm", READY_TIMEOUT_S)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def flag_group(
    cache: Path,
    models: tuple[Path, Path],
    *args: str,
    log_dir: Path,
    per_rank: tuple[tuple[str, ...], ...] = ((), ()),
):
    """Each rank started by hand with --distributed (what a supervisor would run);
    ``per_rank``: flags for one rank only, after the others."""
    port, ring = free_port(), _ring_ports(2)
    procs = []
    for rank, model in enumerate(models):
        flags = ["--distributed", "--distributed-rank", str(rank), "--distributed-world-size"]
        flags += ["2", "--distributed-port", str(ring), "--rank-timeout", str(RANK_TIMEOUT_S)]
        with (log_dir / f"rank{rank}.log").open("w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        *(KVWARM, "serve", "--port", str(port), "--model", str(model)),
                        *(*flags, *args, *per_rank[rank]),
                    ],
                    env=_env(cache),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=log_dir,
                )
            )
    try:
        yield f"http://127.0.0.1:{port}", procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def ask(base: str, prompt: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, **extra}
    r = httpx.post(base + CHAT, json=body, timeout=300)
    assert r.status_code == 200, r.text
    d = r.json()
    return {
        "text": d["choices"][0]["message"]["content"],
        "cached": d["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def ask_together(base: str, **extra) -> list[dict]:
    """All prompts at once (continuous batching), seeded sampling: every token
    depends on the whole distribution, not only on its argmax."""
    results: list[dict] = [{}] * len(PROMPTS)

    def one(i: int) -> None:
        results[i] = ask(base, PROMPTS[i], temperature=1.0, seed=100 + i, **extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # 4 attention / 2 KV heads and 2 layers: splits both ways over two ranks
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-dist"), seed=3)


@pytest.fixture(scope="module")
def alone(model_cache, tiny, tmp_path_factory) -> Iterator[list[list[dict]]]:
    """What one rank answers: two rounds of the prompts (the second warm) plus
    greedy, and its /stats."""
    log = tmp_path_factory.mktemp("alone") / "kvwarm.log"
    with kvwarm_server(model_cache, "--model", str(tiny), *TINY, log=log) as base:
        rounds = [ask_together(base), ask_together(base), [ask(base, PROMPTS[0], temperature=0)]]
        yield [*rounds, [httpx.get(base + "/stats").json()]]


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ranks_answer_as_one_does_with_prefix_hits(mode, model_cache, tiny, alone, tmp_path):
    log = tmp_path / "group.log"
    args = ("--model", str(tiny), *TINY, "--distributed-mode", mode)
    with launched_group(model_cache, *args, log=log) as base:
        first, second = ask_together(base), ask_together(base)
        greedy = [ask(base, PROMPTS[0], temperature=0)]
        stats = httpx.get(base + "/stats").json()
    assert f"rank 0/2: {mode} parallel (serves HTTP)" in log.read_text()
    assert f"rank 1/2: {mode} parallel (follows the serving rank)" in log.read_text()
    assert [r["text"] for r in first] == [r["text"] for r in alone[0]]
    assert [r["text"] for r in second] == [r["text"] for r in alone[1]]
    assert greedy[0]["text"] == alone[2][0]["text"]
    # the second round reuses the first's KV, from every rank's shard of it
    assert all(r["cached"] > 0 for r in second)
    assert [r["cached"] for r in second] == [r["cached"] for r in alone[1]]
    assert stats["prompt_cache"]["hits"] >= len(PROMPTS)
    # a tensor-parallel rank computes half the heads: half their attention scores
    # (the transient reserve) fit beside the KV; a pipeline rank all of its layers'
    reserve, reserve_alone = (s["admission"]["reserve_bytes"] for s in (stats, alone[3][0]))
    assert reserve < reserve_alone if mode == "tensor" else reserve == reserve_alone


def test_smollm2_runs_pipeline_parallel_and_answers_as_one_rank_does(model_cache, server, tmp_path):
    """SmolLM2's 9 heads do not divide by two: auto picks the pipeline split,
    which mlx-lm's llama lacks and kvwarm adds (engine.model_shards)."""
    log = tmp_path / "group.log"
    # questions sharing no words with other tests' (the shared `server` fixture's
    # cache must not warm their prompts)
    questions = ["Which ocean is the largest on Earth?", "Name three colours of the rainbow."]
    with launched_group(model_cache, "--batch", "8", log=log) as base:
        together = [ask(base, q, temperature=0, max_tokens=20) for q in questions]
        again = ask(base, questions[0], temperature=0, max_tokens=20)
    assert "rank 0/2: pipeline parallel" in log.read_text()
    alone = [ask(server, q, temperature=0, max_tokens=20) for q in questions]
    assert [r["text"] for r in together] == [r["text"] for r in alone]
    assert all(r["text"].strip() for r in together)
    assert again["text"] == together[0]["text"] and again["cached"] > 0


def stream_until(base: str, act, max_tokens: int = 4000) -> tuple[dict, float]:
    """Open a stream (endless by default), ``act()`` once it flows; its last event
    and the seconds from ``act`` to the stream's end."""
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", base + CHAT, json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(ln for ln in lines if TOKEN.search(ln))  # a generated token, not the role chunk
        act()
        acted = time.monotonic()
        events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    return events[-1], time.monotonic() - acted


def test_a_killed_worker_fails_open_requests_and_stops_the_serving_rank(
    model_cache, tiny, tmp_path
):
    with flag_group(model_cache, (tiny, tiny), *TINY, log_dir=tmp_path) as (base, procs):
        leader, worker = procs
        wait_for_process(leader, base + "/health", tmp_path / "rank0.log", "rank 0", 240)
        last, ended = stream_until(base, worker.kill)
        assert "error" in last, last
        assert "rank of the distributed group was lost" in last["error"]["message"]
        assert ended < RANK_TIMEOUT_S + 5
        try:
            assert httpx.get(base + "/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass  # already gone: the exit below is what a supervisor acts on
        assert leader.wait(30) == 1
    assert "rank of the distributed group was lost" in (tmp_path / "rank0.log").read_text()


def test_a_hung_worker_is_noticed_within_the_rank_timeout(model_cache, tiny, tmp_path):
    with flag_group(model_cache, (tiny, tiny), *TINY, log_dir=tmp_path) as (base, procs):
        leader, worker = procs
        wait_for_process(leader, base + "/health", tmp_path / "rank0.log", "rank 0", 240)
        # alive, sockets open, doing nothing
        last, ended = stream_until(base, lambda: worker.send_signal(signal.SIGSTOP))
        assert ended < RANK_TIMEOUT_S + 5
        assert "rank 1 is lost: no heartbeat" in last["error"]["message"]
        assert leader.wait(30) == 1
        worker.send_signal(signal.SIGCONT)
        assert worker.wait(30) == 1  # its serving rank is gone: the group restarts whole


@pytest.mark.parametrize("serving", [0, 1])
def test_sigterm_on_the_serving_rank_stops_every_rank_cleanly(serving, model_cache, tiny, tmp_path):
    args = (*TINY, "--distributed-server-rank", str(serving))
    with flag_group(model_cache, (tiny, tiny), *args, log_dir=tmp_path) as (base, procs):
        leader, worker = procs[serving], procs[1 - serving]
        log = tmp_path / f"rank{serving}.log"
        wait_for_process(leader, base + "/health", log, f"rank {serving}", 240)
        assert ask(base, PROMPTS[1])["text"]
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(30) == 0
        assert worker.wait(30) == 0
    assert "stopped with the serving rank" in (tmp_path / f"rank{1 - serving}.log").read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_every_rank_drains_open_requests(signum, model_cache, tiny, tmp_path):
    """systemctl stop on an mlx.launch unit, or Ctrl-C under mlx.launch, signals
    every rank: the worker left at once and the serving rank's drain failed every
    open stream as a lost rank. The worker now follows on until the serving rank's
    stop: the stream finishes, every rank exits 0."""
    args = (*TINY, "--shutdown-timeout", "60")
    with flag_group(model_cache, (tiny, tiny), *args, log_dir=tmp_path) as (base, procs):
        wait_for_process(procs[0], base + "/health", tmp_path / "rank0.log", "rank 0", 240)
        last, _ = stream_until(base, lambda: [p.send_signal(signum) for p in procs], 120)
        assert last["choices"][0]["finish_reason"] == "length", last
        assert [p.wait(60) for p in procs] == [0, 0]
    assert "following the serving rank while it drains" in (tmp_path / "rank1.log").read_text()


def test_an_idle_worker_hears_a_stop_signal_and_a_second_one_ends_it(model_cache, tiny, tmp_path):
    """An idle group keeps the worker's main thread blocked in a collective, where
    no Python signal handler runs: SIGTERM waited for the supervisor's SIGKILL."""
    with flag_group(model_cache, (tiny, tiny), *TINY, log_dir=tmp_path) as (base, procs):
        leader, worker = procs
        wait_for_process(leader, base + "/health", tmp_path / "rank0.log", "rank 0", 240)
        worker.send_signal(signal.SIGTERM)
        log = tmp_path / "rank1.log"
        deadline = time.monotonic() + 5
        while "following the serving rank" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(5) == 128 + signal.SIGTERM
        assert leader.wait(30) == 1  # its rank is lost: the group restarts whole


def test_ranks_started_with_different_rank_timeouts_refuse_to_start(model_cache, tiny, tmp_path):
    """A worker waiting less than the serving rank's beat interval declared it
    lost about 10 s into every start: the group never stayed up."""
    longer = (("--rank-timeout", "60"), ())
    with flag_group(model_cache, (tiny, tiny), *TINY, log_dir=tmp_path, per_rank=longer) as (
        _,
        procs,
    ):
        codes = [p.wait(120) for p in procs]
    assert codes[0] != 0 and codes[1] != 0
    for rank in (0, 1):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert "the ranks disagree on the engine settings" in log and "--rank-timeout=60.0" in log


def test_ranks_started_against_different_weights_refuse_to_start(model_cache, tiny, tmp_path):
    other = write_tiny_llama(tmp_path / "other", seed=4)
    with flag_group(model_cache, (tiny, other), *TINY, log_dir=tmp_path) as (_, procs):
        codes = [p.wait(120) for p in procs]
    assert codes[0] != 0 and codes[1] != 0
    for rank in (0, 1):
        assert "the ranks disagree on the model files" in (tmp_path / f"rank{rank}.log").read_text()


def test_a_rank_whose_group_never_comes_up_exits_within_the_boot_timeout(
    model_cache, tiny, tmp_path
):
    """A rank waited for a missing peer for ever (every collective blocks until
    each rank joins it): a supervisor saw nothing wrong and restarted nothing."""
    ring = _ring_ports(2)
    flags = ["--distributed", "--distributed-rank", "0", "--distributed-world-size", "2"]
    flags += ["--distributed-port", str(ring), "--distributed-boot-timeout", "3"]
    log = tmp_path / "rank0.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [KVWARM, "serve", "--port", str(free_port()), "--model", str(tiny), *TINY, *flags],
            env=_env(model_cache),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # mlx.distributed.init waits holding the GIL: the GIL-free watchdog ends it,
    # the stage it was in logged as it began
    text = log.read_text()
    assert "start-up: joining the group" in text and "Timeout" in text, text[-2000:]
    assert "in join" in text, text[-2000:]  # the stack it hung in
