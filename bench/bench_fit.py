"""How far off is /fit's predicted decode rate? Measured against this server.

Starts kvwarm (--batch 1), reads /fit (machine bandwidth, model bytes), then for
several context lengths streams one completion (a prompt of random token ids of
that length, 64 tokens generated, EOS ignored) and times its decode (first to
last token). Prints predicted (bandwidth bound at that context) vs measured,
and /fit's own measured rate (the engine's learned step costs) at 4k.

    python bench/bench_fit.py [--contexts 128 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import httpx
from _common import BIN, RESULTS, ROOT, server_env, start, stop, write_results

sys.path.insert(0, str(ROOT))
from scheduler.fit import predicted_decode_tok_s  # noqa: E402 - the server's own formula


def stream_decode_rate(url: str, prompt: list[int], tokens: int) -> float:
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "use_kv_cache": False,
    }
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18471)
    args = ap.parse_args()
    cmd = [str(BIN / "kvwarm"), "serve", "--batch", "1", "--port", str(args.port)]
    url = f"http://127.0.0.1:{args.port}"
    proc = start(cmd, args.port, RESULTS / "kvwarm-fit.log", server_env(False))
    rows = []
    try:
        fit = httpx.get(url + "/fit", timeout=60).json()
        machine, model = fit["machine"], fit["model"]
        print(
            f"machine: {machine['name']}, {os.cpu_count()} CPUs, decode bandwidth "
            f"{machine['bandwidth_gb_s']} GB/s ({machine['bandwidth_source']})\n"
            f"model: {model['id']}, weights {model['weights_bytes'] / 1e6:.0f} MB, "
            f"KV {model['kv_bytes_per_token']} B/token\n"
        )
        rng = random.Random(0)
        print(
            f"{'context':>8} {'predicted tok/s':>16} {'measured tok/s':>15} {'measured/pred':>14}"
        )
        for context in args.contexts:
            prompt = [rng.randrange(100, 40000) for _ in range(context)]
            measured = statistics.median(
                stream_decode_rate(url, prompt, args.tokens) for _ in range(2)
            )
            predicted = predicted_decode_tok_s(
                model["weights_bytes"],
                model["kv_bytes_per_token"],
                context + args.tokens // 2,
                machine["bandwidth_bytes_s"],
            )
            rows.append({"context": context, "predicted": predicted, "measured": measured})
            print(
                f"{context:>8} {predicted:>16.1f} {measured:>15.1f} {measured / predicted:>14.2f}"
            )
        fit = httpx.get(url + "/fit", timeout=60).json()
        d = fit["decode"]
        print(
            f"\n/fit at {d['at_context']}: predicted {d['predicted_tok_s']} tok/s, measured "
            f"(learned step costs) {d['measured_tok_s']} tok/s, ratio {d['measured_over_predicted']}"
        )
    finally:
        stop(proc)
    write_results("fit", {"rows": rows, "fit": fit})
    return 0


if __name__ == "__main__":
    sys.exit(main())
