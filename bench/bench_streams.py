"""Smooth streams under mixed agents: inter-token gaps, throughput and TTFT,
kvwarm with its step time budget against kvwarm with a token budget (before
--max-step-ms), mlx_lm.server and mlx-openai-server, one server at a time.

The traffic is bench_agents' "mixed" scenario: 4 agents at once (three with a
~1.4k-token system prompt and tools, ~400-token tool results, greedy replies of
up to 48 tokens; one short-prompt agent asking quick questions), 4 turns each
(the short one 8), SmolLM2-135M float32. Per server it prints aggregate
completion tokens/s, TTFT p95 over warm turns (turn >= 2) and over all turns,
and the worst inter-token gap of each request (p50, p95, max). For kvwarm it
also prints the engine's step-time distribution and its cost model (/stats).

    python bench/bench_streams.py [--only kvwarm,kvwarm-tokens,mlx_lm,mlx-openai-server]
        [--mos-bin /tmp/mos-venv/bin/mlx-openai-server] [--max-step-ms auto]

mlx-openai-server 1.8.1 in a venv of its own: `pip install "mlx[cpu]==0.32.4"
"mlx-lm==0.31.3" mlx-vlm==0.7.10 torch==2.13.0`, `pip install --no-deps
mlx-openai-server==1.8.1`, then its other requirements without mflux (its fastapi
cap dropped: mlx-vlm 0.7 needs starlette 1.x), then `pip uninstall torchvision`.
It needs mlx-lm < 0.32: with 0.32 its continuous batching turns itself off
(SequenceStateMachine is gone) and it serves one request at a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BIN,
    OPENBLAS,
    RESULTS,
    mlx_lm_server_cmd,
    pct,
    prepare_model,
    server_env,
    start,
    stop,
    write_results,
)
from bench_agents import Server, sc_mixed  # noqa: E402

TURNS = 4


def kvwarm_cmd(*extra: str) -> list[str]:
    return [str(BIN / "kvwarm"), "serve", "--batch", "4", *extra]


def kvwarm_env() -> dict[str, str]:
    """Each kvwarm run starts with an empty SSD tier: none warms the next."""
    return dict(server_env(False), KVWARM_KV_DIR=tempfile.mkdtemp(prefix="bench-streams-kv-"))


def peer_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(home / "hf"), HOME=str(home))
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def summarise(server: Server, wall: float) -> dict:
    ts = [t for t in server.turns if t.scenario == "mixed"]
    warm = [t.ttft for t in ts if t.turn >= 2]
    gaps = [t.max_gap for t in ts if t.completion_tokens > 1]
    return {
        "server": server.name,
        "requests": len(ts),
        "wall_s": wall,
        "tok_per_s": sum(t.completion_tokens for t in ts) / wall,
        "warm_ttft_p95": pct(warm, 95),
        "warm_ttft_p50": statistics.median(warm),
        "ttft_p95": pct([t.ttft for t in ts], 95),
        "short_ttft_p50": statistics.median([t.ttft for t in ts if t.agent == "mixed-short"]),
        "worst_gap_p50": statistics.median(gaps),
        "worst_gap_p95": pct(gaps, 95),
        "worst_gap_max": max(gaps),
        "reused_share": sum(t.cached for t in ts) / max(1, sum(t.prompt_tokens for t in ts)),
        "turns": [
            {
                "agent": t.agent,
                "turn": t.turn,
                "prompt": t.prompt_tokens,
                "cached": t.cached,
                "ttft": round(t.ttft, 2),
                "max_gap": round(t.max_gap, 2),
                "wall": round(t.wall, 2),
            }
            for t in ts
        ],
    }


def step_report(url: str) -> dict:
    """The engine's step times and cost model from kvwarm's /stats."""
    return httpx.get(url + "/stats", timeout=10).json().get("engine", {}).get("step_budget") or {}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--port", type=int, default=18461)
    ap.add_argument("--only", default="kvwarm,kvwarm-tokens,mlx_lm,mlx-openai-server")
    ap.add_argument("--max-step-ms", default="auto", help="kvwarm's step budget under test")
    ap.add_argument(
        "--mos-bin",
        default="/tmp/mos-venv/bin/mlx-openai-server",
        help="mlx-openai-server launcher (its own venv; see DESIGN.md)",
    )
    args = ap.parse_args()
    only = args.only.split(",")

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    RESULTS.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model()
    tok = load_tokenizer(Path(model_dir))
    home = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    servers = {
        "kvwarm": (
            f"kvwarm --batch 4 --max-step-ms {args.max_step_ms}",
            kvwarm_cmd("--max-step-ms", args.max_step_ms),
            kvwarm_env(),
            "default_model",
        ),
        "kvwarm-tokens": (
            "kvwarm --batch 4 --max-step-ms 0",
            kvwarm_cmd("--max-step-ms", "0"),
            kvwarm_env(),
            "default_model",
        ),
        "mlx_lm": (
            "mlx_lm.server decode 8 / prompt 1",
            mlx_lm_server_cmd(model_dir, "--decode-concurrency", "8", "--prompt-concurrency", "1"),
            server_env(True),
            "default_model",
        ),
        "mlx-openai-server": (
            "mlx-openai-server 1.8.1",
            [args.mos_bin, "launch", "--model-path", model_dir, "--model-type", "lm"]
            + ["--host", "127.0.0.1", "--no-log-file"],
            peer_env(home),
            model_dir,
        ),
    }
    rows, steps = [], {}
    print(f"model: {model_dir}\n4 mixed agents x {TURNS} turns, one server at a time\n", flush=True)
    for key in only:
        name, cmd, env, model = servers[key]
        if key == "mlx-openai-server" and not Path(args.mos_bin).exists():
            print(f"  [{name}] skipped: {args.mos_bin} not found", flush=True)
            continue
        log = RESULTS / f"streams-{key}.log"
        proc = start([*cmd, "--port", str(args.port)], args.port, log, env, cwd=home)
        server = Server(name, f"http://127.0.0.1:{args.port}", model=model)
        try:
            wall = sc_mixed(server, tok, turns=TURNS)
            row = summarise(server, wall)
            if key.startswith("kvwarm"):
                steps[name] = step_report(server.url)
        finally:
            stop(proc)
        rows.append(row)
        print(
            f"  [{name}] {row['tok_per_s']:.2f} tok/s, warm TTFT p95 {row['warm_ttft_p95']:.1f}s, "
            f"worst gap p95 {row['worst_gap_p95']:.2f}s (max {row['worst_gap_max']:.2f}s), "
            f"{wall:.0f}s",
            flush=True,
        )

    print(
        "\n| server | aggregate tok/s | warm TTFT p95 | TTFT p95 (all) | short agent TTFT p50 "
        "| worst gap per request p50 / p95 / max |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['server']} | {r['tok_per_s']:.2f} | {r['warm_ttft_p95']:.1f} s | "
            f"{r['ttft_p95']:.1f} s | {r['short_ttft_p50']:.1f} s | {r['worst_gap_p50']:.2f} / "
            f"{r['worst_gap_p95']:.2f} / {r['worst_gap_max']:.2f} s |"
        )
    base = next((r for r in rows if r["server"].endswith("--max-step-ms 0")), None)
    for r in rows:
        if base is not None and r["server"].startswith("kvwarm") and r is not base:
            print(
                f"\n{r['server']} vs the token budget: tok/s x{r['tok_per_s'] / base['tok_per_s']:.2f}"
                f", warm TTFT p95 x{r['warm_ttft_p95'] / base['warm_ttft_p95']:.2f}, worst gap "
                f"p95 x{r['worst_gap_p95'] / base['worst_gap_p95']:.2f}"
            )
    for name, rep in steps.items():
        q = rep.get("step_seconds_quantiles", {})
        print(
            f"\n{name}: target {rep.get('max_step_ms')} ms; step time "
            + ", ".join(f"{k} <= {v}s" for k, v in q.items())
            + f" over {rep.get('steps')} steps; prefill tokens/step p50 <= "
            f"{rep.get('prefill_tokens_quantiles', {}).get('p50')}; cost model {rep.get('cost_model')}"
        )
    write_results("streams", {"rows": rows, "steps": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
