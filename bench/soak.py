"""Soak: four agents for N minutes, with one request in twenty a bad one.

Starts `kvwarm serve --batch 4` on the default model. Four agents hold
multi-turn conversations through chat completions, Anthropic Messages and
Responses (streaming and not, alternately); before a turn an agent sends, one
time in twenty, a bad request as well: a fuzzed sampling field (also inside
extra_body / metadata), a malformed tool, invalid JSON, a body over the size
limit, or a stream it drops after the first event. Every 10 s it samples
/health, the server's RSS and the prefix cache's bytes.

Prints: engine deaths, good requests lost / hung / failed, bad requests by
status (none may be a 5xx), good-request latency p95 in the first and last
5 minutes and its drift, RSS and cache bytes over the run; then a verdict on
each of the reliability targets (0 deaths, 0 lost or hung good requests, no
5xx for a bad one, p95 drift <= 10%, RSS flat: the last 5 minutes' median
within 10% of the second 5 minutes', cache bytes within their cap), and exits
1 when one is missed.

    python bench/soak.py [--minutes 20] [--bad-rate 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import httpx
import psutil
from _common import BIN, pct, prepare_model, server_env, start, stop
from pydantic import ByteSize, TypeAdapter

PORT = 8393
URL = f"http://127.0.0.1:{PORT}"
SYSTEM = (
    "You are a coding agent working in a repository. Read the task, think briefly, then "
    "answer with the next concrete step. Keep answers short. "
) * 6
DIALECTS = ("chat", "messages", "responses", "chat")
TURNS_PER_CONVERSATION = 6
MAX_TOKENS = 40
REQUEST_TIMEOUT_S = 120.0
BODY_LIMIT = "1MiB"
GARBAGE = [-1, 5, 1e20, 1.5, "x", [], {}, True, None, -1e9, "0.5"]
FUZZED = [
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "logit_bias",
    "max_tokens",
    "presence_penalty",
    "stop",
]


@dataclass
class Good:
    at: float  # seconds since the start
    latency: float
    ok: bool
    status: str


@dataclass
class Sample:
    at: float  # seconds since the start
    health: int
    rss: int
    anon: int  # RssAnon: the process's own heap, not mapped files
    cache: int  # the prefix cache's RAM bytes
    mlx_active: int  # MLX's allocator (/metrics; sampled by the engine while idle)
    mlx_cache: int
    disk_pending: int  # KV queued for the SSD tier: held in memory until written


@dataclass
class Tally:
    good: list[Good] = field(default_factory=list)
    bad: Counter = field(default_factory=Counter)
    samples: list[Sample] = field(default_factory=list)
    deaths: int = 0  # times the engine was seen alive, then dead (or the server gone)
    engine_seen_dead: bool = False


def good_body(dialect: str, history: list[dict], stream: bool, session: str) -> tuple[str, dict]:
    if dialect == "chat":
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": SYSTEM}, *history],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
            "temperature": 0.7,
            "metadata": {"session_id": session},
        }
        return "/v1/chat/completions", body
    if dialect == "messages":
        body = {
            "model": "m",
            "system": SYSTEM,
            "messages": history,
            "max_tokens": MAX_TOKENS,
            "stream": stream,
            "temperature": 0.7,
            "metadata": {"user_id": f"u_session_{session}"},
        }
        return "/v1/messages", body
    items = [{"role": m["role"], "content": m["content"]} for m in history]
    body = {
        "model": "m",
        "instructions": SYSTEM,
        "input": items,
        "max_output_tokens": MAX_TOKENS,
        "stream": stream,
        "temperature": 0.7,
        "prompt_cache_key": session,
    }
    return "/v1/responses", body


def reply_text(dialect: str, data: dict) -> str:
    if dialect == "chat":
        return data["choices"][0]["message"]["content"] or ""
    if dialect == "messages":
        return "".join(b.get("text", "") for b in data["content"] if b["type"] == "text")
    return "".join(
        part["text"]
        for item in data["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def streamed_text(dialect: str, lines: list[str]) -> tuple[str, bool]:
    """The reply's text and whether the stream ended with its terminal event."""
    text, done, errored = [], False, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        raw = line[6:]
        if raw == "[DONE]":
            done = True
            continue
        event = json.loads(raw)
        if dialect == "chat" and event.get("choices"):
            text.append(event["choices"][0]["delta"].get("content") or "")
        elif dialect == "messages":
            if event.get("type") == "content_block_delta":
                text.append(event["delta"].get("text", ""))
            done = done or event.get("type") == "message_stop"
        elif dialect == "responses":
            if event.get("type") == "response.output_text.delta":
                text.append(event["delta"])
            done = done or event.get("type") in ("response.completed", "response.incomplete")
        # a chat error event is followed by [DONE]: the stream still failed
        errored = errored or "error" in event or event.get("type") == "response.failed"
    return "".join(text), done and not errored


async def good_turn(
    client: httpx.AsyncClient,
    dialect: str,
    history: list[dict],
    stream: bool,
    session: str,
    tally: Tally,
    t0: float,
) -> str | None:
    path, body = good_body(dialect, history, stream, session)
    started = time.monotonic()
    ok, status, text = False, "?", None
    try:
        if stream:
            async with client.stream("POST", URL + path, json=body) as r:
                status = str(r.status_code)
                lines = [line async for line in r.aiter_lines()]
            text, done = streamed_text(dialect, lines)
            ok = status == "200" and done
        else:
            r = await client.post(URL + path, json=body)
            status = str(r.status_code)
            if r.status_code == 200:
                text, ok = reply_text(dialect, r.json()), True
    except httpx.TimeoutException:
        status = "hung"
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    tally.good.append(Good(started - t0, time.monotonic() - started, ok, status))
    return text if ok else None


async def bad_turn(
    client: httpx.AsyncClient, dialect: str, rng: random.Random, tally: Tally
) -> None:
    path, body = good_body(dialect, [{"role": "user", "content": "hi"}], False, "bad")
    kind = rng.choice(["field", "envelope", "tool", "json", "oversize", "disconnect"])
    content = None
    if kind == "field":
        body[rng.choice(FUZZED)] = rng.choice(GARBAGE)
    elif kind == "envelope":
        body[rng.choice(["extra_body", "metadata"])] = {rng.choice(FUZZED): rng.choice(GARBAGE)}
    elif kind == "tool":
        body["tools"] = [{"type": "function", "function": {"name": {"x": 1}}, "name": 7}]
    elif kind == "json":
        content = json.dumps(body)[:-7].encode()
    elif kind == "oversize":
        body["padding"] = "x" * (2 * 2**20)
    try:
        if kind == "disconnect":
            body["stream"] = True
            body["max_tokens"] = body["max_output_tokens"] = 200
            async with client.stream("POST", URL + path, json=body) as r:
                async for _ in r.aiter_lines():
                    break  # the client goes away after the first event
            tally.bad[f"{kind}:dropped"] += 1
            return
        if content is not None:
            r = await client.post(
                URL + path, content=content, headers={"content-type": "application/json"}
            )
        else:
            r = await client.post(URL + path, json=body)
        tally.bad[f"{kind}:{r.status_code}"] += 1
    except httpx.HTTPError as exc:
        tally.bad[f"{kind}:{type(exc).__name__}"] += 1


async def agent(k: int, deadline: float, bad_rate: float, tally: Tally, t0: float) -> None:
    rng = random.Random(k)
    dialect = DIALECTS[k]
    conversation = 0
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            conversation += 1
            session = f"agent{k}-{conversation}"
            history: list[dict] = []
            for turn in range(TURNS_PER_CONVERSATION):
                if time.monotonic() >= deadline:
                    return
                if rng.random() < bad_rate:
                    await bad_turn(client, dialect, rng, tally)
                history.append(
                    {
                        "role": "user",
                        "content": f"Task {conversation}.{turn}: "
                        f"list the files to change for feature {rng.randrange(1000)}.",
                    }
                )
                reply = await good_turn(client, dialect, history, turn % 2 == 0, session, tally, t0)
                if reply is None:
                    break
                history.append({"role": "assistant", "content": reply})


async def monitor(pid: int, deadline: float, tally: Tally, t0: float) -> None:
    proc = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            health, cache, alive, mlx, pending = 0, 0, False, {}, 0
            try:
                health = (await client.get(URL + "/health")).status_code
                stats = (await client.get(URL + "/stats")).json()
                cache = (stats.get("prompt_cache") or {}).get("bytes", 0)
                pending = (stats.get("prompt_cache") or {}).get("disk_pending_bytes", 0)
                alive = bool(stats["engine"]["alive"])
                mlx = gauges((await client.get(URL + "/metrics")).text)
            except httpx.HTTPError:
                pass
            if not alive and not tally.engine_seen_dead:
                tally.deaths += 1
            tally.engine_seen_dead = not alive
            rss, anon = resident(proc)
            tally.samples.append(
                Sample(
                    time.monotonic() - t0,
                    health,
                    rss,
                    anon,
                    cache,
                    int(mlx.get("kvwarm:mlx_active_memory_bytes", 0)),
                    int(mlx.get("kvwarm:mlx_cache_memory_bytes", 0)),
                    pending,
                )
            )
            await asyncio.sleep(10)


def gauges(metrics: str) -> dict[str, float]:
    """Unlabelled-by-request gauges of a /metrics text: name -> value."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("kvwarm:mlx_"):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            out[name] = float(value)
    return out


def resident(proc: psutil.Process) -> tuple[int, int]:
    """RSS and its anonymous part (heap and MLX buffers, not mapped files)."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return (proc.memory_info().rss if proc.is_running() else 0), 0
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kib = lambda name: int(fields.get(name, "0 kB").split()[0]) * 1024  # noqa: E731
    return kib("VmRSS"), kib("RssAnon")


async def soak(pid: int, minutes: float, bad_rate: float) -> Tally:
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + minutes * 60
    await asyncio.gather(
        monitor(pid, deadline, tally, t0),
        *(agent(k, deadline, bad_rate, tally, t0) for k in range(4)),
    )
    return tally


def report(tally: Tally, minutes: float, cache_cap: int) -> bool:
    """Print the figures and the verdict; True when every target is met."""
    good = tally.good
    lost = [g for g in good if not g.ok]
    hung = [g for g in good if g.status == "hung"]
    window = min(5.0, minutes / 4) * 60
    end = max((g.at for g in good), default=0.0)
    first = [g.latency for g in good if g.ok and g.at < window]
    last = [g.latency for g in good if g.ok and g.at >= end - window]
    p95_first, p95_last = pct(first, 95), pct(last, 95)
    print(f"\nsoak: {minutes:.0f} min, 4 agents (chat, Messages, Responses, chat), batch 4")
    print(
        f"engine deaths: {tally.deaths}; /health non-200 samples: "
        f"{sum(1 for s in tally.samples if s.health != 200)} of {len(tally.samples)}"
    )
    print(
        f"good requests: {len(good)}, failed or lost: {len(lost)} "
        f"({Counter(g.status for g in lost)}), hung: {len(hung)}"
    )
    bad5xx = sum(n for k, n in tally.bad.items() if k.split(":")[1].startswith("5"))
    print(f"bad requests: {sum(tally.bad.values())}, answered 5xx: {bad5xx}")
    for key, n in sorted(tally.bad.items()):
        print(f"  {key:28} {n}")
    drift = (p95_last - p95_first) / p95_first * 100 if first and last else float("nan")
    print(
        f"good latency p95: first {window / 60:.0f} min {p95_first:.2f} s ({len(first)} req), "
        f"last {window / 60:.0f} min {p95_last:.2f} s ({len(last)} req), drift {drift:+.1f}%"
    )
    rss = [s.rss for s in tally.samples]
    cache = [s.cache for s in tally.samples]
    if rss:
        step = max(1, len(tally.samples) // 8)
        marks = tally.samples[::step] + tally.samples[-1:]
        print(
            "    min   RSS MiB  anon MiB  prefix cache MiB  MLX active / cache MiB  disk queue MiB"
        )
        for m in marks:
            print(
                f"{m.at / 60:7.1f} {m.rss / 2**20:9.0f} {m.anon / 2**20:9.0f} "
                f"{m.cache / 2**20:17.1f}  {m.mlx_active / 2**20:10.0f} / "
                f"{m.mlx_cache / 2**20:<10.0f} {m.disk_pending / 2**20:14.0f}"
            )
        print(f"RSS max {max(rss) / 2**20:.0f} MiB; prefix cache max {max(cache) / 2**20:.1f} MiB")
    # RSS settles once the model, the compiled kernels and the cache have filled: compare
    # the last window with the second, not the first (which includes the warm-up)
    second = [s.rss for s in tally.samples if window <= s.at < 2 * window]
    final = [s.rss for s in tally.samples if s.at >= end - window]
    rss_growth = (
        (median(final) - median(second)) / median(second) * 100
        if second and final
        else float("nan")
    )
    checks = [
        ("engine deaths 0", tally.deaths == 0),
        ("good requests lost 0", not lost),
        ("good requests hung 0", not hung),
        ("bad requests answered 5xx 0", bad5xx == 0),
        (f"good latency p95 drift {drift:+.1f}% <= 10%", drift <= 10.0),
        (f"RSS last vs second window {rss_growth:+.1f}% <= 10%", rss_growth <= 10.0),
        (
            f"prefix cache max {max(cache, default=0) / 2**20:.0f} MiB <= cap "
            f"{cache_cap / 2**20:.0f} MiB",
            max(cache, default=0) <= cache_cap,
        ),
    ]
    print("verdict:")
    for name, met in checks:
        print(f"  {'PASS' if met else 'FAIL'}  {name}")
    return all(met for _, met in checks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--bad-rate", type=float, default=0.05)
    parser.add_argument(
        "--prompt-cache-bytes",
        default="512MiB",
        help="the prefix cache's cap: small enough that the run fills it and evicts",
    )
    args = parser.parse_args()
    prepare_model()
    try:  # an earlier run's server still draining would answer in place of ours
        httpx.get(URL + "/health", timeout=2)
        raise SystemExit(f"something already answers on {URL}: stop it first")
    except httpx.TransportError:
        pass
    log = Path(tempfile.gettempdir()) / "kvwarm-soak.log"
    cmd = [
        str(BIN / "kvwarm"),
        "serve",
        "--port",
        str(PORT),
        "--batch",
        "4",
        "--max-body-bytes",
        BODY_LIMIT,
        "--request-timeout",
        "300",
        "--prompt-cache-bytes",
        args.prompt_cache_bytes,
    ]
    # request lines in the log: where the time went, if latency drifts
    env = {**server_env(for_mlx_lm=False), "KVWARM_LOG_LEVEL": "info"}
    proc = start(cmd, PORT, log, env)
    try:
        tally = asyncio.run(soak(proc.pid, args.minutes, args.bad_rate))
    finally:
        stop(proc)
    passed = report(
        tally, args.minutes, TypeAdapter(ByteSize).validate_python(args.prompt_cache_bytes)
    )
    print(f"server log: {log}")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
