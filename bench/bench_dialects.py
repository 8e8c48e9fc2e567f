"""One agent conversation through each API dialect: does the prefix cache hit the same?

Runs `kvwarm serve --batch 1` and replays the same kind of agent conversation
(a ~1.4k-token system prompt with tool definitions, then tool-output rounds of
~650 tokens, short greedy replies) through chat completions, Anthropic Messages
and Responses (chained with previous_response_id), each through its official
SDK and streaming, each with its own system-prompt tag so they cannot share
entries. mlx_lm.server runs the chat conversation as the reference. Then it
times the output classifier alone (reasoning + tool-call parsing per delta).

    python bench/bench_dialects.py [--turns 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anthropic  # noqa: E402
import openai  # noqa: E402
from _common import BIN, RESULTS, mlx_lm_server_cmd, prepare_model, server_env, start, stop  # noqa: E402
from agent_traffic import TASKS, system_prompt, tool_output  # noqa: E402

MAX_TOKENS = 32
PORT = 8391


def _user_turns(turns: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [TASKS[0]] + [f"Tool output:\n{tool_output(rng)}" for _ in range(turns - 1)]


def chat_run(base: str, system: str, users: list[str], model: str) -> list[dict]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=600)
    messages, out = [{"role": "system", "content": system}], []
    for text in users:
        messages.append({"role": "user", "content": text})
        t0, ttft, reply, usage = time.monotonic(), None, "", None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.monotonic() - t0
                reply += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        cached = (
            (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        )
        out.append(
            {
                "prompt": usage.prompt_tokens,
                "cached": cached,
                "out": usage.completion_tokens,
                "ttft": ttft,
            }
        )
        messages.append({"role": "assistant", "content": reply})
    return out


def messages_run(base: str, system: str, users: list[str]) -> list[dict]:
    client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=600)
    messages, out = [], []
    for text in users:
        messages.append({"role": "user", "content": text})
        t0, ttft = time.monotonic(), None
        with client.messages.stream(
            model="m",
            system=system,
            messages=messages,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
        ) as stream:
            for _ in stream.text_stream:
                ttft = ttft or time.monotonic() - t0
            final = stream.get_final_message()
        u = final.usage
        cached = u.cache_read_input_tokens or 0
        out.append(
            {
                "prompt": u.input_tokens + cached,
                "cached": cached,
                "out": u.output_tokens,
                "ttft": ttft,
            }
        )
        messages.append({"role": "assistant", "content": [b.model_dump() for b in final.content]})
    return out


def responses_run(base: str, system: str, users: list[str]) -> list[dict]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=600)
    previous, out = None, []
    for i, text in enumerate(users):
        items = ([{"role": "system", "content": system}] if i == 0 else []) + [
            {"role": "user", "content": text}
        ]
        t0, ttft, final = time.monotonic(), None, None
        for event in client.responses.create(
            model="m",
            input=items,
            previous_response_id=previous,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        ):
            if event.type == "response.output_text.delta":
                ttft = ttft or time.monotonic() - t0
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        u = final.usage
        out.append(
            {
                "prompt": u.input_tokens,
                "cached": u.input_tokens_details.cached_tokens,
                "out": u.output_tokens,
                "ttft": ttft,
            }
        )
        previous = final.id
    return out


def summary(turns: list[dict]) -> dict:
    warm = turns[1:]
    reusable = [p["prompt"] + p["out"] for p in turns[:-1]]
    ttfts = [t["ttft"] for t in warm if t["ttft"] is not None]
    return {
        "reused/reusable": sum(t["cached"] for t in warm) / sum(reusable),
        "reused/prompt": sum(t["cached"] for t in warm) / sum(t["prompt"] for t in warm),
        "warm TTFT p50": statistics.median(ttfts) if ttfts else float("nan"),
        "turn-1 TTFT": turns[0]["ttft"],
    }


def parser_cost(pieces: int = 20000) -> float:
    """Microseconds per streamed delta for the classifier with tools enabled."""
    from app.protocol.output_parser import OutputParser, Syntax
    from app.protocol.tool_formats import ToolCallDecoder

    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    chunk = [
        "<think>",
        "we ",
        "need to",
        " look",
        "</think>",
        "The ",
        "answer <",
        "b> is",
        " here.\n",
    ]
    parser = OutputParser(Syntax(), ToolCallDecoder(tools, "qwen3_coder"))
    t0 = time.perf_counter()
    for i in range(pieces):
        parser.feed(chunk[i % len(chunk)])
    parser.finish()
    return (time.perf_counter() - t0) / pieces * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    model_dir = prepare_model()
    RESULTS.mkdir(parents=True, exist_ok=True)
    users = _user_turns(args.turns, seed=7)
    tag = uuid.uuid4().hex[:6]
    rows: dict[str, dict] = {}
    base = f"http://127.0.0.1:{PORT}"

    proc = start(
        [str(BIN / "kvwarm"), "serve", "--port", str(PORT), "--batch", "1"],
        PORT,
        RESULTS / "dialects-kvwarm.log",
        server_env(False),
    )
    try:
        rows["kvwarm chat"] = summary(
            chat_run(base, f"[{tag}-chat]\n" + system_prompt("a"), users, "m")
        )
        rows["kvwarm messages"] = summary(
            messages_run(base, f"[{tag}-msgs]\n" + system_prompt("a"), users)
        )
        rows["kvwarm responses"] = summary(
            responses_run(base, f"[{tag}-resp]\n" + system_prompt("a"), users)
        )
    finally:
        stop(proc)
    cmd = mlx_lm_server_cmd(model_dir, "--port", str(PORT))
    proc = start(cmd, PORT, RESULTS / "dialects-mlx_lm.log", server_env(True))
    try:
        rows["mlx_lm.server chat"] = summary(
            chat_run(base, f"[{tag}-chat]\n" + system_prompt("a"), users, "default_model")
        )
    finally:
        stop(proc)

    print(f"\n{args.turns} turns, {MAX_TOKENS}-token greedy replies, turns >= 2 counted")
    print(
        f"{'server / dialect':24} {'reused/reusable':>16} {'reused/prompt':>14} {'warm TTFT p50':>14} {'turn-1 TTFT':>12}"
    )
    for name, r in rows.items():
        print(
            f"{name:24} {r['reused/reusable']:>15.1%} {r['reused/prompt']:>14.1%} "
            f"{r['warm TTFT p50']:>13.2f}s {r['turn-1 TTFT']:>11.2f}s"
        )
    print(
        f"\noutput classifier (reasoning + tool-call markup): {parser_cost():.1f} us per streamed delta"
    )


if __name__ == "__main__":
    main()
