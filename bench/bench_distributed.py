"""Two ranks vs one on this machine (loopback ring), kvwarm and mlx_lm.server side by side.

What a distributed group costs when its ranks share one machine's cores: each
step crosses the ring at every layer (tensor) or once per rank (pipeline), and
the ranks split the CPU. Every server gets the same requests, one at a time on
this 2-core machine, nothing else running:

- a random-weight llama with SmolLM2's body (576 hidden, 30 layers) but 8 heads and
  2 KV heads, so it splits both ways; mlx_lm.server runs it tensor-parallel too
  (its llama has no pipeline split);
- the real SmolLM2-135M (9 heads: pipeline only, which only kvwarm offers for llama).

Printed: aggregate completion tokens/s of 4 concurrent streams and TTFT p50, the
median of ``--rounds`` rounds, and each group's ratio to the same server alone.

    python bench/bench_distributed.py [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import BIN, ROOT, prepare_model, server_env, start, stop, write_results

sys.path.insert(0, str(ROOT))

MLX_LAUNCH = str(BIN / "mlx.launch")
PROMPT = "Summarise the following notes about the build system in one paragraph. " * 3


def write_body_model(path: Path) -> Path:
    """SmolLM2's body with head counts that divide by two (random weights)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from tests.helpers.tiny_models import VOCAB_SIZE, write_byte_tokenizer

    config = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(path)
    return path


async def one(
    client: httpx.AsyncClient, url: str, model: str, tokens: int, i: int
) -> tuple[int, float]:
    body = {
        "model": model,  # mlx_lm.server loads whatever this names; kvwarm ignores it
        "messages": [{"role": "user", "content": f"[{i}] {PROMPT}"}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, count = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                count = d["usage"]["completion_tokens"]
            elif first is None and d.get("choices") and d["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    return count, (first or time.perf_counter()) - started


async def round_(url: str, model: str, streams: int, tokens: int, salt: int) -> tuple[float, float]:
    """``streams`` prompts no earlier round sent: every server prefills them cold
    (mlx_lm.server keeps a prompt cache; kvwarm's is off here)."""
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        ids = range(salt * streams, (salt + 1) * streams)
        results = await asyncio.gather(*(one(client, url, model, tokens, i) for i in ids))
        wall = time.perf_counter() - started
    return sum(n for n, _ in results) / wall, statistics.median(t for _, t in results)


def free_port_wait(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                time.sleep(1)  # and the ranks' ring ports with it
                return
        time.sleep(0.5)
    raise RuntimeError(f"port {port} still busy: a server from an earlier run is up")


def measure(cmd: list[str], model: str, port: int, log: Path, rounds: int, tokens: int) -> dict:
    free_port_wait(port)  # never measure the previous server still shutting down
    proc = start(cmd, port, log, server_env(for_mlx_lm=True))
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(round_(url, model, 1, 4, salt=1000))  # warm-up: kernels, allocator
        runs = [asyncio.run(round_(url, model, 4, tokens, salt=k)) for k in range(rounds)]
        if not all(r[0] > 0 for r in runs):
            raise RuntimeError(f"no tokens came back; see {log}")
    finally:
        stop(proc)
        if proc.poll() is None:
            proc.kill()
    return {
        "tok_s": statistics.median(r[0] for r in runs),
        "ttft_p50": statistics.median(r[1] for r in runs),
        "runs": runs,
    }


def kvwarm(model: str, port: int, *extra: str) -> list[str]:
    return [str(BIN / "kvwarm"), "serve", "--model", model, "--port", str(port), "--batch", "4",
            "--memory-budget", "4GB", "--prompt-cache-bytes", "0", *extra]  # fmt: skip


def mlx_lm(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port),
            "--decode-concurrency", "4", "--prompt-concurrency", "4"]  # fmt: skip


def launched(cmd: list[str], ring_port: int) -> list[str]:
    # two ranks on one machine's cores: one BLAS thread each, for both servers
    # (kvwarm would set this itself; mlx_lm.server would not)
    return [MLX_LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(ring_port),
            "--env", "OPENBLAS_NUM_THREADS=1", "--python", sys.executable, *cmd]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    port, ring = 18500, 36500
    logs = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    body = str(write_body_model(logs / "body-8h"))
    smol = prepare_model()
    mlx_lm_script = str(BIN / "mlx_lm.server")
    configs = [
        ("body-8h", "kvwarm", "1 rank", kvwarm(body, port)),
        ("body-8h", "kvwarm", "2 ranks tensor", launched(kvwarm(body, port, "--distributed-mode", "tensor"), ring)),
        ("body-8h", "kvwarm", "2 ranks pipeline", launched(kvwarm(body, port, "--distributed-mode", "pipeline"), ring)),
        ("body-8h", "mlx_lm.server", "1 rank", mlx_lm(body, port)),
        ("body-8h", "mlx_lm.server", "2 ranks tensor", launched([mlx_lm_script, *mlx_lm(body, port)[4:]], ring)),
        ("SmolLM2-135M", "kvwarm", "1 rank", kvwarm(smol, port)),
        ("SmolLM2-135M", "kvwarm", "2 ranks pipeline", launched(kvwarm(smol, port), ring)),
    ]  # fmt: skip
    results = []
    paths = {"body-8h": body, "SmolLM2-135M": smol}
    for model, server, ranks, cmd in configs:
        log = logs / f"{model}-{server}-{ranks.replace(' ', '-')}.log"
        r = measure(cmd, paths[model], port, log, args.rounds, args.tokens)
        results.append({"model": model, "server": server, "ranks": ranks, **r})
        print(f"  measured {model} {server} {ranks}: {r['tok_s']:.1f} tok/s", flush=True)
    print(
        f"\n4 concurrent streams x {args.tokens} tokens, median of {args.rounds} rounds (logs in {logs})"
    )
    print(
        f"{'model':<14} {'server':<14} {'ranks':<17} {'tok/s':>7} {'TTFT p50':>9} {'vs 1 rank':>10}"
    )
    for r in results:
        alone = next(
            a
            for a in results
            if (a["model"], a["server"], a["ranks"]) == (r["model"], r["server"], "1 rank")
        )
        ratio = r["tok_s"] / alone["tok_s"]
        print(f"{r['model']:<14} {r['server']:<14} {r['ranks']:<17} {r['tok_s']:>7.1f} "
              f"{r['ttft_p50']:>8.2f}s {ratio:>9.2f}x")  # fmt: skip
    write_results("distributed", {"tokens": args.tokens, "rounds": args.rounds, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
