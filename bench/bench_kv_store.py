"""KV store benchmark: restarts, RAM->disk eviction, shared blocks, a small RAM tier.

SmolLM2-135M float32 on this machine's CPU, one server at a time, in one run:

  restart    a ~4k-token conversation: TTFT of its next turn cold (no cache),
             warm in RAM, warm after a restart (read from disk), and warm after
             another conversation pushed it out of RAM (read from disk)
  sharing    eight agents with one ~2k-token system prompt: bytes the RAM tier
             holds against the bytes of their distinct tokens (and of full copies)
  kv-bits    --kv-bits 8 and 4: bytes per cached token, and greedy agreement of
             warm turns (prefix read from quantized blocks) with cold ones
  small-ram  RAM tier sized for two agents' contexts, eight agents taking turns:
             prompt tokens reused / the agent-aware ideal, kvwarm with the SSD
             tier, kvwarm RAM-only, and mlx_vlm.server with its APC SSD tier
             (APC_ENABLED=1) when --vlm-python points at a venv that has it

    python bench/bench_kv_store.py [--only restart,sharing,small-ram]
                                   [--vlm-python /tmp/vlm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import BIN, OPENBLAS, RESULTS, prepare_model, server_env, start, stop  # noqa: E402

PORT = 8931
URL = f"http://127.0.0.1:{PORT}"
WORDS = (
    "the build failed because the cache key ignored the volatile header so every agent "
    "recomputed its whole prompt while the scheduler waited on memory admission and the "
    "tool result changed between turns which is exactly what the store must survive"
).split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13) % len(WORDS)] for i in range(n_words))


def kvwarm(kv_dir: Path, log: Path, *args: str):
    cmd = [
        str(BIN / "kvwarm"),
        "serve",
        "--port",
        str(PORT),
        "--batch",
        "1",
        "--volatile-policy",
        "strict",
        "--kv-dir",
        str(kv_dir),
        *args,
    ]
    return start(cmd, PORT, log, server_env(False))


def ttft(messages: list[dict], model: str = "m", **extra) -> tuple[float, dict]:
    """Seconds to the first streamed content token, and the usage at the end."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    started = time.perf_counter()
    first = None
    usage: dict = {}
    with httpx.stream("POST", URL + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if first is None and choices and choices[0]["delta"].get("content"):
                first = time.perf_counter() - started
    return (first if first is not None else time.perf_counter() - started), usage


def stats() -> dict:
    return httpx.get(URL + "/stats", timeout=10).json()["prompt_cache"]


def warm_up() -> None:
    """One untimed request on a fresh server: its first pays one-off set-up
    (kernels, allocator), which belongs to neither tier's figure."""
    ttft([{"role": "user", "content": "Say hello."}], use_kv_cache=False)


def settle() -> None:
    deadline = time.monotonic() + 120
    while stats()["disk_pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.2)


# -- restart ---------------------------------------------------------------
def long_conversation(seed: int, turns: int = 14) -> list[dict]:
    """~4k tokens: a system prompt and turns of user text and replies."""
    msgs = [{"role": "system", "content": f"Agent {seed}. " + text(400, seed)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t}: " + text(180, seed + t)})
        msgs.append({"role": "assistant", "content": text(20, seed * 3 + t)})
    msgs.append({"role": "user", "content": "What should we change first?"})
    return msgs


def next_turn(msgs: list[dict], k: int) -> list[dict]:
    return msgs + [
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": f"And after that, step {k}?"},
    ]


def bench_restart(tmp: Path, repeats: int) -> dict:
    kv = tmp / "kv-restart"
    cold, ram, disk, evicted = [], [], [], []
    # RAM tier for about 1.5 conversations: a second one pushes the first to disk
    proc = kvwarm(kv, tmp / "restart.log", "--prompt-cache-bytes", "300MiB")
    tokens = 0
    try:
        warm_up()
        for r in range(repeats):
            x, y = long_conversation(10 + r), long_conversation(20 + r)
            t, usage = ttft(x, use_kv_cache=False)  # cold: the whole prompt computed
            cold.append(t)
            tokens = usage.get("prompt_tokens", 0)
            ttft(x)  # stores x's KV
            t, usage = ttft(next_turn(x, 1))
            ram.append(t)
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0.9 * tokens
            ttft(y)  # stored last: survives the restart in RAM's place on disk
        settle()
    finally:
        stop(proc)
    proc = kvwarm(kv, tmp / "restart.log", "--prompt-cache-bytes", "300MiB")
    try:
        restored = stats()["restored_entries"]
        warm_up()
        for r in range(repeats):
            t, usage = ttft(next_turn(long_conversation(20 + r), 1))
            disk.append(t)
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0.9 * tokens
        # evicted: z stored, w pushes it out of RAM, z's next turn reads the disk
        for r in range(repeats):
            z, w = long_conversation(30 + r), long_conversation(40 + r)
            ttft(z)
            ttft(w)
            settle()
            before = stats()["disk_hits"]
            t, usage = ttft(next_turn(z, 1))
            evicted.append(t)
            assert stats()["disk_hits"] > before, "the evicted turn was not read from disk"
        st = stats()
    finally:
        stop(proc)
    med = statistics.median
    out = {
        "prompt_tokens": tokens,
        "cold_s": med(cold),
        "warm_ram_s": med(ram),
        "warm_after_restart_s": med(disk),
        "warm_after_eviction_s": med(evicted),
        "restored_entries": restored,
        "disk_hits": st["disk_hits"],
        "demotions": st["demotions"],
        "disk_load_seconds": st["disk_load_seconds"],
        "disk_load_tokens": st["disk_load_tokens"],
    }
    print(f"\n== restart / eviction, ~{tokens}-token context (medians of {repeats}) ==")
    print(f"cold TTFT                 {out['cold_s']:7.2f} s")
    print(f"warm in RAM               {out['warm_ram_s']:7.2f} s")
    for name, key in (
        ("after restart (disk)", "warm_after_restart_s"),
        ("after eviction (disk)", "warm_after_eviction_s"),
    ):
        v = out[key]
        print(
            f"{name:25} {v:7.2f} s  = {v / out['warm_ram_s']:.2f}x RAM-warm, "
            f"{100 * v / out['cold_s']:.1f}% of cold"
        )
    print(f"disk loads: {st['disk_load_tokens']} tokens in {st['disk_load_seconds']:.2f} s")
    return out


# -- sharing ---------------------------------------------------------------
def bench_sharing(tmp: Path) -> dict:
    system = "You are one of eight coding agents on one repository. " + text(1850, 1)
    proc = kvwarm(tmp / "kv-share", tmp / "share.log", "--kv-disk-bytes", "0")
    rows = []
    try:
        for i in range(8):
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Agent {i}: " + text(120, 100 + i)},
            ]
            _, usage = ttft(msgs)
            rows.append(usage)
        st = stats()
    finally:
        stop(proc)
    shared = max(u["prompt_tokens_details"]["cached_tokens"] for u in rows[1:])
    distinct = shared + sum(u["prompt_tokens"] - shared + u["completion_tokens"] for u in rows)
    logical = st["ram"]["bytes"] + st["ram"]["shared_saved_bytes"]
    entry_tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for u in rows)
    per_token = logical / entry_tokens
    out = {
        "system_tokens": shared,
        "distinct_tokens": distinct,
        "ram_bytes": st["ram"]["bytes"],
        "full_copy_bytes": logical,
        "distinct_bytes": distinct * per_token,
        "ratio": st["ram"]["bytes"] / (distinct * per_token),
        "blocks": st["ram"]["blocks"],
    }
    print(f"\n== eight agents sharing a {shared}-token system prompt ==")
    print(
        f"RAM tier holds {out['ram_bytes'] / 2**20:.1f} MiB for {distinct} distinct tokens "
        f"({out['distinct_bytes'] / 2**20:.1f} MiB): {out['ratio']:.2f}x; full copies "
        f"would be {logical / 2**20:.1f} MiB ({logical / out['distinct_bytes']:.2f}x)"
    )
    return out


# -- small RAM tier, eight agents taking turns -------------------------------
def agent_turns(agent: int, turns: int) -> list[list[dict]]:
    msgs = [{"role": "system", "content": f"Agent {agent} of eight. " + text(700, agent)}]
    out = []
    for t in range(turns):
        msgs = msgs + [{"role": "user", "content": f"Step {t}: " + text(60, agent * 11 + t)}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": text(12, agent + t)}]
    return out


def run_agents(model: str, rounds: int, extra_body: dict) -> dict:
    """Rounds of one turn per agent. The agent-aware ideal of a turn is the
    agent's previous prompt, which this one extends (the reply it echoes is new)."""
    convs = [agent_turns(a, rounds) for a in range(8)]
    previous = [0] * 8
    reused = ideal = 0
    ttfts = []
    reported = True
    for r in range(rounds):
        for a in range(8):
            t, usage = ttft(convs[a][r], model=model, **extra_body)
            details = usage.get("prompt_tokens_details") or {}
            if r > 0:
                ideal += previous[a]
                reused += min(details.get("cached_tokens") or 0, previous[a])
                reported = reported and "cached_tokens" in details
                ttfts.append(t)
            previous[a] = usage.get("prompt_tokens", 0)
    return {
        "reused": reused,
        "ideal": ideal,
        "ratio": reused / max(1, ideal) if reported else float("nan"),
        "warm_ttft_median_s": statistics.median(ttfts) if ttfts else float("nan"),
    }


def bench_small_ram(tmp: Path, model_dir: str, vlm_python: str | None, rounds: int) -> dict:
    # two agents' contexts: ~1.1k tokens x 46 KiB/token x 2
    ram = "110MiB"
    out: dict = {}
    for name, args in (("kvwarm RAM+SSD", ()), ("kvwarm RAM only", ("--kv-disk-bytes", "0"))):
        proc = kvwarm(
            tmp / f"kv-{len(out)}",
            tmp / f"small-{len(out)}.log",
            "--prompt-cache-bytes",
            ram,
            *args,
        )
        try:
            out[name] = run_agents("m", rounds, {})
        finally:
            stop(proc)
    if vlm_python:
        env = dict(
            os.environ,
            APC_ENABLED="1",
            APC_DISK_PATH=str(tmp / "apc"),
            HF_HUB_OFFLINE="1",
            HF_HUB_CACHE=str(tmp / "hf"),
        )
        if os.path.exists(OPENBLAS):
            env["LD_PRELOAD"] = OPENBLAS
        cmd = [
            vlm_python,
            "-m",
            "mlx_vlm.server",
            "--model",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(PORT),
        ]
        proc = start(cmd, PORT, tmp / "vlm.log", env)
        try:
            out["mlx_vlm.server APC+SSD"] = run_agents(model_dir, rounds, {})
        finally:
            stop(proc)
    print(f"\n== RAM tier for two agents ({ram}), eight agents x {rounds} rounds ==")
    for name, row in out.items():
        print(
            f"{name:24} reuse {row['reused']:6d} / ideal {row['ideal']:6d} = "
            f"{row['ratio']:.2f}   warm TTFT median {row['warm_ttft_median_s']:.2f} s"
        )
    return out


# -- KV quantization ----------------------------------------------------------
def reply_tokens(messages: list[dict], **extra) -> tuple[list[str], dict]:
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": 32,
        "temperature": 0,
        "logprobs": False,
        **extra,
    }
    r = httpx.post(URL + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"].split(), data["usage"]


def bench_kv_bits(tmp: Path, prompts: int) -> dict:
    """Bytes per cached token and greedy agreement: each warm turn (its prefix read
    from stored, possibly quantized blocks) against the same turn computed cold."""
    out: dict = {}
    for bits in (None, 8, 4):
        args = ("--kv-bits", str(bits)) if bits else ()
        name = f"{bits}-bit" if bits else "float32"
        proc = kvwarm(tmp / f"kv-bits-{name}", tmp / f"bits-{name}.log", *args)
        same = words = equal_replies = 0
        try:
            for p in range(prompts):
                conv = long_conversation(50 + p, turns=4)
                ttft(conv)  # stores its KV (quantized with --kv-bits)
                warm, usage = reply_tokens(next_turn(conv, 1))
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0
                cold, _ = reply_tokens(next_turn(conv, 1), use_kv_cache=False)
                agree = next(
                    (i for i, (a, b) in enumerate(zip(warm, cold)) if a != b),
                    min(len(warm), len(cold)),
                )
                same += agree
                words += max(len(warm), len(cold))
                equal_replies += warm == cold
            st = stats()
        finally:
            stop(proc)
        per_token = (st["ram"]["bytes"] + st["ram"]["shared_saved_bytes"]) / st["ram"]["tokens"]
        out[name] = {
            "bytes_per_token": per_token,
            "agreement": same / max(1, words),
            "identical_replies": equal_replies,
            "prompts": prompts,
        }
    print(
        f"\n== stored KV quantization ({prompts} conversations of ~1.4k tokens, 32 greedy "
        "tokens each, warm vs cold) =="
    )
    base = out["float32"]["bytes_per_token"]
    for name, row in out.items():
        print(
            f"{name:8} {row['bytes_per_token']:9.0f} B/token ({row['bytes_per_token'] / base:.2f}x)"
            f"   greedy agreement {row['agreement']:.3f} (prefix of words), "
            f"{row['identical_replies']}/{prompts} replies identical"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="restart,sharing,small-ram,kv-bits")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vlm-python", default=None)
    args = parser.parse_args()
    model_dir = prepare_model()
    only = set(args.only.split(","))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvwarm-kvbench-") as tmp_name:
        tmp = Path(tmp_name)
        if "restart" in only:
            results["restart"] = bench_restart(tmp, args.repeats)
        if "sharing" in only:
            results["sharing"] = bench_sharing(tmp)
        if "kv-bits" in only:
            results["kv_bits"] = bench_kv_bits(tmp, args.prompts)
        if "small-ram" in only:
            results["small_ram"] = bench_small_ram(tmp, model_dir, args.vlm_python, args.rounds)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "kv_store.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
