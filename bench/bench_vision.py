"""Vision agents: kvwarm against mlx-vlm 0.7.10's own server on one vision model,
one server at a time (a fresh server each), greedy replies of --max-tokens.

The model (bench/vision_model.py, built once into ~/.cache/kvwarm/bench-models):
real SmolLM2-135M-Instruct text weights behind a random 4-layer SigLIP tower,
SmolVLM-256M-shaped (mlx-vlm's idefics3 classes); each image is one 512 px tile,
67 prompt tokens. Its replies about images are English, not descriptions.

Per server, after one warm-up request with an image of its own (not counted):

  A  --agents agents (default 4) at once, each a streaming chat completion with its
     own image (a distinct PIL-drawn PNG, 500x400, as a data URL) and a question.
     Aggregate completion tokens/s = all completion tokens / wall time from the
     first send to the last finish; TTFT (first content chunk) per request; the
     completion tokens of each request (lengths may differ between servers:
     tok/s counts generated tokens either way).
  B  each agent's second turn, all at once: turn 1's messages (its image re-sent
     as the same data URL, as agents resend their history) + the assistant's
     reply + a new text question. Per request:
     prompt tokens, usage.prompt_tokens_details.cached_tokens (both servers
     report it), reuse = cached / ideal, turn-2 TTFT against turn-1 TTFT.
     ideal = min(turn-1 prompt + turn-1 completion tokens, turn-2 prompt - 1),
     each from that server's own usage: the KV that exists after turn 1 (its
     prompt with the image, and the reply) that turn 2 starts with; at least
     one prompt token is always recomputed. raw results also hold cached /
     turn-1 prompt tokens.

Vision encoder time: kvwarm's GET /stats "vision" ({encoder_runs,
encoder_seconds, feature_hits, images_prefilled}), read before A, after A and
after B: runs and seconds spent in each phase (B should run the tower 0 times:
the re-sent images' features or KV are reused). mlx_vlm.server keeps a vision
feature cache (VisionFeatureCache, 20 images, keyed by a hash of the pixel
values) but counts nothing about it: its encoder time is n/a; its APC stats
(GET /v1/cache/stats: lookups hit/miss, matched tokens) are shown instead.

Servers: kvwarm serve --model DIR --batch 4 (defaults otherwise: --vision auto
finds the vision model; a fresh, empty SSD KV tier). mlx_vlm.server --model DIR
--max-num-seqs 4 (its continuous batching is always on for a text-generation
model; --max-num-seqs caps the batch) with APC_ENABLED=1 (its block-hash prefix
cache, 16-token blocks, each block's key carrying the image hash) and its SSD
tier in a fresh folder, OpenBLAS preloaded, HF_HUB_OFFLINE=1, an empty HF cache
and a fresh HOME.

    python bench/bench_vision.py [--only kvwarm,mlx_vlm] [--agents 4] [--max-tokens 64]
        [--batch 4] [--peer-python /tmp/vlm-venv/bin/python] [--model-dir DIR]

mlx_vlm.server in a venv of its own (no torch gets pulled):
    python3 -m venv /tmp/vlm-venv
    /tmp/vlm-venv/bin/pip install "mlx[cpu]==0.32.4" "mlx-vlm==0.7.10"
    /tmp/vlm-venv/bin/python -m mlx_vlm.server --help   # check
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.blas import preload_openblas  # noqa: E402

preload_openblas()  # before anything imports mlx (building the model does)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BIN, OPENBLAS, RESULTS, pct, server_env, start, stop, write_results  # noqa: E402
from vision_model import write_bench_smolvlm  # noqa: E402

PALETTE = [  # (name, rgb) of backgrounds and shapes: every agent's image differs
    ("blue", (40, 90, 200)),
    ("yellow", (240, 200, 30)),
    ("green", (40, 160, 70)),
    ("red", (210, 40, 40)),
    ("purple", (130, 60, 170)),
    ("orange", (240, 140, 30)),
    ("white", (245, 245, 245)),
    ("black", (15, 15, 15)),
]
SHAPES = ["circle", "square", "triangle", "star", "stripes", "cross"]
QUESTIONS_1 = [
    "What do you see in this picture? Describe it.",
    "Describe this image for a blind reader.",
    "What shapes and colours are in this image?",
    "Tell me about this picture in a few sentences.",
]
QUESTIONS_2 = [
    "What colour is the background? Answer briefly.",
    "Could this image be a logo? Why?",
    "Write a short title for this picture.",
    "What would you change to make it prettier?",
]


def draw_image(i: int, width: int = 500, height: int = 400) -> bytes:
    """Agent ``i``'s PNG: its own background, shape and colour."""
    from PIL import Image, ImageDraw

    bg = PALETTE[i % len(PALETTE)][1]
    fg = PALETTE[(i * 3 + 1) % len(PALETTE)][1]
    if fg == bg:
        fg = PALETTE[(i + 4) % len(PALETTE)][1]
    shape = SHAPES[i % len(SHAPES)]
    image = Image.new("RGB", (width, height), bg)
    d = ImageDraw.Draw(image)
    box = (width // 4, height // 5, 3 * width // 4, 4 * height // 5)
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
    if shape == "circle":
        d.ellipse(box, fill=fg)
    elif shape == "square":
        d.rectangle(box, fill=fg)
    elif shape == "triangle":
        d.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fg)
    elif shape == "star":
        d.regular_polygon((cx, cy, (y1 - y0) // 2), 5, fill=fg)
        d.regular_polygon((cx, cy, (y1 - y0) // 2), 5, rotation=36, fill=fg)
    elif shape == "stripes":
        for k in range(0, width, 50):
            d.rectangle((k, 0, k + 24, height), fill=fg)
    else:
        d.rectangle((cx - 30, y0, cx + 30, y1), fill=fg)
        d.rectangle((x0, cy - 30, x1, cy + 30), fill=fg)
    d.text((10, 10), f"image {i}", fill=fg)  # distinct pixels even when shapes repeat
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def user_turn(image_url: str | None, text: str) -> dict:
    parts: list[dict] = []
    if image_url:
        parts.append({"type": "image_url", "image_url": {"url": image_url}})
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat completion: TTFT, usage, text; an HTTP error as its text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    timings = None
    finish = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        if r.status_code >= 400:
            r.read()
            return {"error": f"HTTP {r.status_code}: {r.text}", "sent": sent}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):
                return {"error": f"stream error: {json.dumps(event['error'])}", "sent": sent}
            if event.get("usage"):
                usage = event["usage"]
            if event.get("timings"):
                timings = event["timings"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - sent
                    text.append(piece)
                finish = choice.get("finish_reason") or finish
    done = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "sent": sent,
        "done": done,
        "ttft": ttft if ttft is not None else done - sent,
        "wall": done - sent,
        "text": "".join(text),
        "finish_reason": finish,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "cached_tokens": details.get("cached_tokens"),  # None: not reported
        "timings": timings,
    }


def run_phase(url: str, model: str, convs: list[list[dict]], max_tokens: int) -> tuple:
    """Every conversation's next request at once; (results, wall from first send to
    last finish)."""
    results: list[dict] = [{} for _ in convs]
    gate = threading.Barrier(len(convs))

    def one(i: int) -> None:
        gate.wait()
        try:
            results[i] = stream_chat(url, model, convs[i], max_tokens)
        except httpx.HTTPError as exc:
            results[i] = {"error": f"{type(exc).__name__}: {exc}", "sent": time.perf_counter()}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    return results, wall


def vision_stats(key: str, url: str) -> dict | None:
    """What a server says about its encoder and caches (None: nothing)."""
    try:
        if key == "kvwarm":
            stats = httpx.get(url + "/stats", timeout=10).json()
            return {"vision": stats.get("vision"), "prompt_cache": stats.get("prompt_cache")}
        apc = httpx.get(url + "/v1/cache/stats", timeout=10).json()
        return {"vision": None, "apc": apc}
    except (httpx.HTTPError, ValueError):
        return None


def encoder_delta(before: dict | None, after: dict | None) -> dict | None:
    """Encoder runs / seconds / feature hits between two /stats reads (kvwarm)."""
    a = (before or {}).get("vision")
    b = (after or {}).get("vision")
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    return {k: b.get(k, 0) - a.get(k, 0) for k in b if isinstance(b.get(k), (int, float))}


def apc_delta(before: dict | None, after: dict | None) -> dict | None:
    a = (before or {}).get("apc")
    b = (after or {}).get("apc")
    if not isinstance(a, dict) or not isinstance(b, dict) or not b.get("enabled"):
        return None
    keys = ("lookups_hit", "lookups_miss", "matched_tokens", "stored_tokens", "exact_hits")
    return {k: b.get(k, 0) - a.get(k, 0) for k in keys}


def measure(key: str, url: str, model: str, images: list[bytes], args) -> dict:
    warm = [user_turn(data_url(draw_image(len(images) + 7)), "Hello! What is this?")]
    stream_chat(url, model, warm, 4)  # warm-up: its own image, not counted
    s0 = vision_stats(key, url)
    convs = [
        [user_turn(data_url(png), QUESTIONS_1[i % len(QUESTIONS_1)])]
        for i, png in enumerate(images)
    ]
    a, wall_a = run_phase(url, model, convs, args.max_tokens)
    s1 = vision_stats(key, url)
    for i, conv in enumerate(convs):
        conv.append({"role": "assistant", "content": a[i]["text"]})
        conv.append(user_turn(None, QUESTIONS_2[i % len(QUESTIONS_2)]))
    b, wall_b = run_phase(url, model, convs, args.max_tokens)
    s2 = vision_stats(key, url)

    per_agent = []
    for i, (r1, r2) in enumerate(zip(a, b)):
        ideal = min(r1["prompt_tokens"] + r1["completion_tokens"], r2["prompt_tokens"] - 1)
        cached = r2["cached_tokens"]
        per_agent.append(
            {
                "agent": i,
                "t1_prompt": r1["prompt_tokens"],
                "t1_completion": r1["completion_tokens"],
                "t1_finish": r1["finish_reason"],
                "t1_ttft": r1["ttft"],
                "t1_wall": r1["wall"],
                "t1_text": r1["text"],
                "t1_cached": r1["cached_tokens"],
                "t2_prompt": r2["prompt_tokens"],
                "t2_completion": r2["completion_tokens"],
                "t2_cached": cached,
                "t2_ideal": ideal,
                "t2_reuse": None if cached is None or ideal <= 0 else cached / ideal,
                "t2_cached_of_t1_prompt": (
                    None
                    if cached is None or not r1["prompt_tokens"]
                    else cached / r1["prompt_tokens"]
                ),
                "t2_ttft": r2["ttft"],
                "t2_wall": r2["wall"],
                "t2_text": r2["text"],
                "timings": [r1["timings"], r2["timings"]],
            }
        )
    cached = [p["t2_cached"] for p in per_agent]
    reported = all(c is not None for c in cached)
    return {
        "wall_a": wall_a,
        "wall_b": wall_b,
        "tok_per_s_a": sum(r["completion_tokens"] for r in a) / wall_a,
        "tok_per_s_b": sum(r["completion_tokens"] for r in b) / wall_b,
        "ttft_a_p50": statistics.median(r["ttft"] for r in a),
        "ttft_a_p95": pct([r["ttft"] for r in a], 95),
        "ttft_b_p50": statistics.median(r["ttft"] for r in b),
        "ttft_b_p95": pct([r["ttft"] for r in b], 95),
        "reuse_b": (
            sum(cached) / max(1, sum(p["t2_ideal"] for p in per_agent)) if reported else None
        ),
        "encoder_a": encoder_delta(s0, s1),
        "encoder_b": encoder_delta(s1, s2),
        "apc_a": apc_delta(s0, s1),
        "apc_b": apc_delta(s1, s2),
        "stats": [s0, s1, s2],
        "agents": per_agent,
    }


def fmt_encoder(d: dict | None) -> str:
    if d is None:
        return "n/a"
    return f"{d.get('encoder_runs', 0)} runs {d.get('encoder_seconds', 0.0):.1f} s"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", default="kvwarm,mlx_vlm", help="servers, comma-separated")
    ap.add_argument("--agents", type=int, default=4, help="concurrent image conversations")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion length per request")
    ap.add_argument(
        "--batch", type=int, default=4, help="kvwarm --batch and mlx_vlm --max-num-seqs"
    )
    ap.add_argument("--port", type=int, default=18481)
    ap.add_argument(
        "--peer-python",
        default="/tmp/vlm-venv/bin/python",
        help="python of the venv with mlx-vlm 0.7.10 (see above)",
    )
    ap.add_argument(
        "--model-dir",
        default=None,
        help="a vision model directory (default: bench/vision_model.py's, built once)",
    )
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - {"kvwarm", "mlx_vlm"}
    if unknown:
        ap.error(f"unknown servers {sorted(unknown)}: kvwarm, mlx_vlm")

    RESULTS.mkdir(parents=True, exist_ok=True)
    model_dir = (
        str(Path(args.model_dir).resolve()) if args.model_dir else str(write_bench_smolvlm())
    )
    images = [draw_image(i) for i in range(args.agents)]
    home = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    kv_env = dict(server_env(False), KVWARM_KV_DIR=str(home / "kvwarm-kv"))
    peer_env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(home / "hf"),
        HOME=str(home),
        APC_ENABLED="1",
        APC_DISK_PATH=str(home / "apc"),
    )
    if os.path.exists(OPENBLAS):
        peer_env["LD_PRELOAD"] = OPENBLAS
    servers = {
        "kvwarm": (
            f"kvwarm --batch {args.batch}",
            [str(BIN / "kvwarm"), "serve", "--model", model_dir, "--batch", str(args.batch)],
            kv_env,
            "default_model",
        ),
        "mlx_vlm": (
            f"mlx_vlm.server APC, max-num-seqs {args.batch}",
            [args.peer_python, "-m", "mlx_vlm.server", "--model", model_dir]
            + ["--host", "127.0.0.1", "--max-num-seqs", str(args.batch)],
            peer_env,
            model_dir,
        ),
    }
    print(
        f"model: {model_dir}\n{args.agents} agents, an image each, max_tokens "
        f"{args.max_tokens}, greedy; one server at a time\n",
        flush=True,
    )
    rows: dict[str, dict] = {}
    for key in only:
        name, cmd, env, model = servers[key]
        if key == "mlx_vlm" and not Path(args.peer_python).exists():
            print(f"  [{name}] skipped: {args.peer_python} not found", flush=True)
            continue
        log = RESULTS / f"vision-{key}.log"
        url = f"http://127.0.0.1:{args.port}"
        proc = start([*cmd, "--port", str(args.port)], args.port, log, env, cwd=home)
        try:
            row = measure(key, url, model, images, args)
        except RuntimeError as exc:
            print(f"  [{name}] failed: {exc} (log: {log})", flush=True)
            continue
        finally:
            stop(proc)
        row["server"] = name
        rows[key] = row
        print(
            f"  [{name}] A: {row['tok_per_s_a']:.2f} tok/s, TTFT p50 {row['ttft_a_p50']:.1f}s; "
            f"B: TTFT p50 {row['ttft_b_p50']:.1f}s, reuse "
            + (f"{row['reuse_b']:.2f}" if row["reuse_b"] is not None else "n/a"),
            flush=True,
        )

    print(
        "\n| server | phase A agg tok/s | TTFT p50 (A) | phase B reuse (cached / ideal) "
        "| turn-2 TTFT p50 (B) | B/A TTFT | encoder (A / B) |\n|---|---|---|---|---|---|---|"
    )
    for r in rows.values():
        reuse = "n/a"
        if r["reuse_b"] is not None:
            cached = sum(p["t2_cached"] for p in r["agents"])
            ideal = sum(p["t2_ideal"] for p in r["agents"])
            reuse = f"{r['reuse_b']:.2f} ({cached} / {ideal})"
        print(
            f"| {r['server']} | {r['tok_per_s_a']:.2f} | {r['ttft_a_p50']:.2f} s | {reuse} | "
            f"{r['ttft_b_p50']:.2f} s | {r['ttft_b_p50'] / r['ttft_a_p50']:.2f} | "
            f"{fmt_encoder(r['encoder_a'])} / {fmt_encoder(r['encoder_b'])} |"
        )
    print("\nper request: turn 1 prompt+completion tokens, TTFT -> turn 2 prompt, cached, TTFT")
    for r in rows.values():
        for p in r["agents"]:
            print(
                f"  {r['server']:<34} agent {p['agent']}: A {p['t1_prompt']}+"
                f"{p['t1_completion']} tok ({p['t1_finish']}), TTFT {p['t1_ttft']:.2f}s -> "
                f"B {p['t2_prompt']} tok, cached {p['t2_cached']}, TTFT {p['t2_ttft']:.2f}s"
            )
        if r["apc_b"] is not None:
            print(f"  {r['server']}: APC during A {r['apc_a']}, during B {r['apc_b']}")
    if "kvwarm" in rows and "mlx_vlm" in rows:
        k, m = rows["kvwarm"], rows["mlx_vlm"]
        print(
            f"\nkvwarm / mlx_vlm.server: phase A tok/s x{k['tok_per_s_a'] / m['tok_per_s_a']:.2f}, "
            f"phase B tok/s x{k['tok_per_s_b'] / m['tok_per_s_b']:.2f}, "
            f"turn-2 TTFT p50 x{k['ttft_b_p50'] / m['ttft_b_p50']:.2f} "
            f"(TTFT p50 in A x{k['ttft_a_p50'] / m['ttft_a_p50']:.2f})"
        )
    print(
        "\nideal = min(turn-1 prompt + completion tokens, turn-2 prompt - 1) per request; "
        "encoder: kvwarm /stats vision (mlx_vlm.server counts nothing about its tower)"
    )
    write_results(
        "vision",
        {
            "model": model_dir,
            "agents": args.agents,
            "max_tokens": args.max_tokens,
            "batch": args.batch,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
