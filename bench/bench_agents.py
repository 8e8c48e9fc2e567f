"""Agent-traffic benchmark: prompt-cache reuse and TTFT, kvwarm vs mlx_lm.server.

Scenarios (simulated coding agents, ~1.4k-token system prompt with tools, tool
results of ~400 tokens, greedy replies of up to 48 tokens):

  append     strict append: every turn adds the reply, a tool result, a question
  volatile   billing-header nonce, Inbound Context block and timestamp rewritten
             every turn, message ids and system reminders in new user turns
  think      replies carry <think> blocks the client strips before echoing them
  edit       after four turns the agent edits an early tool result, then goes on
  subagents  two sub-agents branch off an orchestrator's system prompt, then the
             orchestrator resumes
  mixed      4 agents at once (volatile, think, append, a short-prompt agent):
             aggregate tok/s, TTFT p95, the short agent's TTFT, longest stall

Per scenario it prints, over warm turns (an agent's turns >= 2, and a sub-agent's
first, which reuses its orchestrator's prefix): tokens reused / reusable tokens (those
of an earlier request plus its reply, volatile spans as equal, healed think
blocks restored, everything before an edit), warm TTFT vs the time a cold
prefill of only the new tokens takes (see below), and the cold
TTFT of the last prompt. Both servers are measured in one run, one at a time.

"New-token prefill" is measured in this process after the servers stop: the
model's forward pass over a turn's uncached tokens (in 512-token chunks, as the
servers prefill) on top of a KV cache as long as the reused prefix. It is the
compute a warm turn cannot avoid; the ratio shows what serving adds to it.

    python bench/bench_agents.py [--turns 6] [--skip-mlx-lm] [--only append,volatile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.blas import preload_openblas  # noqa: E402

preload_openblas()  # before anything imports mlx

from _common import (  # noqa: E402
    BIN,
    RESULTS,
    mlx_lm_server_cmd,
    pct,
    prepare_model,
    server_env,
    start,
    stop,
    write_results,
)
from agent_traffic import FOLLOW_UPS, TASKS, Agent, Msg, tool_output  # noqa: E402

MAX_TOKENS = 48


@dataclass
class Turn:
    scenario: str
    agent: str
    turn: int
    prompt_tokens: int
    cached: int
    reusable: int
    ttft: float
    completion_tokens: int
    max_gap: float  # longest pause between two content chunks of this stream
    wall: float
    new_prefill_s: float = float("nan")  # forward pass over the uncached tokens (measured later)


@dataclass
class Server:
    name: str
    url: str
    turns: list[Turn] = field(default_factory=list)
    last_prompt: dict[str, list[dict]] = field(default_factory=dict)  # scenario -> messages
    lock: threading.Lock = field(default_factory=threading.Lock)
    model: str = "default_model"  # mlx_lm.server loads any other name as a new model

    def chat(self, msgs: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
        body = {
            "model": self.model,
            "messages": msgs,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft = None
        last = None
        max_gap = 0.0
        text: list[str] = []
        thought: list[str] = []
        usage = {}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=1800) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # kvwarm sends a think block as reasoning_content, mlx_lm as
                    # content: the first token is whichever comes first
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                    piece = delta.get("content")
                    if reasoning or piece:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            max_gap = max(max_gap, now - last)
                        last = now
                    if reasoning:
                        thought.append(reasoning)
                    if piece:
                        text.append(piece)
        # the reply as the model wrote it, whichever way the server split it
        reply = "".join(text)
        if thought:
            reply = f"<think>{''.join(thought)}</think>{reply}"
        return {
            "text": reply,
            "ttft": ttft if ttft is not None else time.perf_counter() - start,
            "wall": time.perf_counter() - start,
            "max_gap": max_gap,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        }


class Reusable:
    """Counts the reusable tokens of a request against every earlier one in a scenario."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen: list[list[tuple[str, str]]] = []  # idents of earlier requests + reply

    def count(self, msgs: list[Msg]) -> tuple[int, int]:
        idents = [m.ident() for m in msgs]
        shared = 0
        for earlier in self.seen:
            n = 0
            while n < min(len(earlier), len(idents)) and earlier[n] == idents[n]:
                n += 1
            shared = max(shared, n)
        seen = [m.seen() for m in msgs]
        total = len(self.tok.apply_chat_template(seen, add_generation_prompt=True, tokenize=True))
        if shared == 0:
            return 0, total
        prefix = self.tok.apply_chat_template(
            seen[:shared], add_generation_prompt=False, tokenize=True
        )
        return min(len(prefix), total - 1), total

    def add(self, msgs: list[Msg], reply: str) -> None:
        self.seen.append([m.ident() for m in msgs] + [("assistant", reply)])


def run_turn(server: Server, scenario: str, agent: Agent, reusable: Reusable) -> Turn:
    msgs = agent.request()
    with server.lock:
        reuse, _ = reusable.count(msgs)
    r = server.chat([m.wire() for m in msgs])
    turn = Turn(
        scenario,
        agent.name,
        agent.turn + 1,
        r["prompt_tokens"],
        r["cached"],
        reuse,
        r["ttft"],
        r["completion_tokens"],
        r["max_gap"],
        r["wall"],
    )
    with server.lock:
        reusable.add(msgs, r["text"])
        server.turns.append(turn)
        server.last_prompt[scenario] = [m.wire() for m in msgs]
    agent.record_reply(r["text"])
    return turn


def tool_rounds(server, scenario, agent, reusable, rounds, lines=36):
    """``rounds`` turns, each answered by a tool result."""
    for _ in range(rounds):
        run_turn(server, scenario, agent, reusable)
        agent.tool(tool_output(agent.rng, lines=lines))


def converse(server, scenario, agent, reusable, turns, rng_offset=0):
    agent.user(TASKS[(agent.turn + rng_offset) % len(TASKS)])
    for t in range(turns):
        tool_rounds(server, scenario, agent, reusable, 1)
        if t % 2 == 1:
            agent.user(FOLLOW_UPS[(t + rng_offset) % len(FOLLOW_UPS)])


# -- scenarios -----------------------------------------------------------------
def sc_append(server, tok, turns):
    converse(server, "append", Agent("append", 1), Reusable(tok), turns)


def sc_volatile(server, tok, turns):
    converse(server, "volatile", Agent("volatile", 2, volatile=True), Reusable(tok), turns)


def sc_think(server, tok, turns):
    converse(server, "think", Agent("think", 3, strip=True), Reusable(tok), turns)


def sc_edit(server, tok, turns):
    agent, reusable = Agent("edit", 4), Reusable(tok)
    converse(server, "edit", agent, reusable, 4)
    # compaction: the first tool result is replaced by a stub, then the agent goes on
    first_tool = next(i for i, m in enumerate(agent.msgs) if m.role == "tool")
    agent.msgs[first_tool] = Msg("tool", "[output truncated: 36 lines, see above]")
    agent.user("Continue with the fix.")
    tool_rounds(server, "edit", agent, reusable, max(1, turns - 4))


def sc_subagents(server, tok, turns):
    reusable = Reusable(tok)
    orch = Agent("orchestrator", 5)
    converse(server, "subagents", orch, reusable, 3)
    for i in range(2):
        sub = Agent("orchestrator", 50 + i)  # same system prompt and tools
        sub.name = f"sub-agent-{i}"
        sub.user(f"Sub-task {i}: inspect module_{i}.py and report problems.")
        tool_rounds(server, "subagents", sub, reusable, 2, lines=20)
    orch.user("Both sub-agents reported back: module_0 has a stale cache, module_1 is fine.")
    tool_rounds(server, "subagents", orch, reusable, max(1, turns - 3))


def sc_mixed(server, tok, turns):
    """4 agents at once; the short one must not queue behind long prefills."""
    reusable = Reusable(tok)
    agents = [
        Agent("mixed-volatile", 11, volatile=True),
        Agent("mixed-think", 12, strip=True),
        Agent("mixed-append", 13),
        Agent("mixed-short", 14, system="You are terse."),
    ]

    def drive(agent: Agent, i: int) -> None:
        if agent.name == "mixed-short":
            for t in range(turns * 2):
                agent.user(f"Quick question {t}: yes or no?")
                run_turn(server, "mixed", agent, reusable)
            return
        converse(server, "mixed", agent, reusable, turns, rng_offset=i)

    threads = [threading.Thread(target=drive, args=(a, i)) for i, a in enumerate(agents)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


SCENARIOS = {
    "append": sc_append,
    "volatile": sc_volatile,
    "think": sc_think,
    "edit": sc_edit,
    "subagents": sc_subagents,
}


class PrefillTimer:
    """Times the model's forward pass over ``new`` tokens after ``cached`` cached
    ones. The cache holds random KV: the cost does not depend on its values."""

    def __init__(self, model_dir: str, step: int = 512):
        import mlx.core as mx
        from mlx_lm import load

        self.mx = mx
        self.model, _ = load(model_dir)
        self.step = step
        self._memo: dict[tuple[int, int], float] = {}
        self._time(256, 32)  # untimed: the first call pays kernel and allocator set-up

    def __call__(self, cached: int, new: int) -> float:
        key = (cached // 256, new // 32)  # nearby shapes cost the same
        if key not in self._memo:
            self._memo[key] = self._time(cached, new)
        return self._memo[key]

    def _time(self, cached: int, new: int) -> float:
        from mlx_lm.models.cache import make_prompt_cache

        mx = self.mx
        cache = make_prompt_cache(self.model)
        if cached:
            for c, layer in zip(cache, self.model.layers):
                attn = layer.self_attn
                shape = (
                    1,
                    attn.n_kv_heads,
                    cached,
                    attn.head_dim
                    if hasattr(attn, "head_dim")
                    else self.model.args.hidden_size // self.model.args.num_attention_heads,
                )
                c.keys = mx.random.normal(shape)
                c.values = mx.random.normal(shape)
                c.offset = cached
            mx.eval([c.state for c in cache])
        tokens = mx.random.randint(0, 1000, (1, max(new, 1)))
        start = time.perf_counter()
        for i in range(0, tokens.shape[1], self.step):
            out = self.model(tokens[:, i : i + self.step], cache=cache)
            mx.eval(out)
        return time.perf_counter() - start


def cold_ttft(server: Server, msgs: list[dict]) -> float:
    """TTFT of the same prompt with a unique first line: a full prefill."""
    msgs = [dict(m) for m in msgs]
    msgs[0]["content"] = uuid.uuid4().hex + "\n" + msgs[0]["content"]
    return server.chat(msgs, max_tokens=2)["ttft"]


def summarise(server: Server, scenario: str, cold: float | None) -> dict:
    # warm turns: an agent's later turns, and a sub-agent's first (its orchestrator's
    # prefix is what it reuses)
    turns = [t for t in server.turns if t.scenario == scenario and (t.turn >= 2 or t.reusable > 0)]
    ratios = [t.ttft / t.new_prefill_s for t in turns if t.new_prefill_s == t.new_prefill_s]
    reusable = sum(t.reusable for t in turns)
    return {
        "server": server.name,
        "scenario": scenario,
        "turns": len(turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "reusable": reusable,
        "reused": sum(min(t.cached, t.prompt_tokens) for t in turns),
        "reuse_share": sum(t.cached for t in turns) / reusable if reusable else float("nan"),
        "prompt_share": sum(t.cached for t in turns) / max(1, sum(t.prompt_tokens for t in turns)),
        "warm_ttft_p50": statistics.median([t.ttft for t in turns]) if turns else float("nan"),
        "warm_vs_new_prefill_p50": statistics.median(ratios) if ratios else float("nan"),
        "cold_ttft": cold,
    }


def measure(server: Server, tok, turns: int, only: set[str], mixed: bool) -> list[dict]:
    rows = []
    for name, fn in SCENARIOS.items():
        if name not in only:
            continue
        t0 = time.perf_counter()
        fn(server, tok, turns)
        cold = cold_ttft(server, server.last_prompt[name])
        row = summarise(server, name, cold)
        rows.append(row)
        print(
            f"  [{server.name}] {name:<10} reused {row['reuse_share'] * 100:6.1f}% of reusable "
            f"({row['reused']}/{row['reusable']}), warm TTFT p50 {row['warm_ttft_p50']:.2f}s, "
            f"cold {cold:.2f}s ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    if mixed:
        wall = sc_mixed(server, tok, turns=4)
        ts = [t for t in server.turns if t.scenario == "mixed"]
        short = [t.ttft for t in ts if t.agent == "mixed-short"]
        long_ = [t.ttft for t in ts if t.agent != "mixed-short"]
        row = summarise(server, "mixed", None)
        row.update(
            wall_s=wall,
            tok_per_s=sum(t.completion_tokens for t in ts) / wall,
            ttft_p95=pct([t.ttft for t in ts], 95),
            short_ttft_p50=statistics.median(short),
            short_ttft_max=max(short),
            long_ttft_p50=statistics.median(long_),
            max_stall=max(t.max_gap for t in ts),
        )
        rows.append(row)
        print(
            f"  [{server.name}] mixed x4: {row['tok_per_s']:.2f} tok/s aggregate, TTFT p95 "
            f"{row['ttft_p95']:.2f}s, short agent TTFT p50 {row['short_ttft_p50']:.2f}s max "
            f"{row['short_ttft_max']:.2f}s, longest stall {row['max_stall']:.2f}s, reused "
            f"{row['reuse_share'] * 100:.1f}% of reusable",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--port", type=int, default=18441)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    ap.add_argument("--no-mixed", action="store_true")
    args = ap.parse_args()
    only = set(args.only.split(","))

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    RESULTS.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model()
    tok = load_tokenizer(Path(model_dir))
    print(f"model: {model_dir}\n", flush=True)

    servers = [("kvwarm --batch 4", [str(BIN / "kvwarm"), "serve", "--batch", "4"])]
    if not args.skip_mlx_lm:
        servers.append(
            (
                "mlx_lm.server",
                mlx_lm_server_cmd(
                    model_dir, "--decode-concurrency", "4", "--prompt-concurrency", "4"
                ),
            )
        )
    rows: list[dict] = []
    stats = {}
    measured: list[Server] = []
    for name, cmd in servers:
        log = RESULTS / f"agents-{name.split()[0]}.log"
        proc = start([*cmd, "--port", str(args.port)], args.port, log, server_env("mlx_lm" in name))
        server = Server(name, f"http://127.0.0.1:{args.port}")
        measured.append(server)
        try:
            rows += measure(server, tok, args.turns, only, not args.no_mixed)
            if name.startswith("kvwarm"):
                stats = httpx.get(server.url + "/stats").json().get("prompt_cache", {})
        finally:
            stop(proc)

    print("\ntiming the new-token prefill of each warm turn in-process ...", flush=True)
    timer = PrefillTimer(model_dir)
    for server in measured:
        for t in server.turns:
            # every warm turn, misses included (cached 0): the ratio's median is
            # over the same turns as warm_ttft_p50's
            if t.turn >= 2 or t.reusable > 0:
                t.new_prefill_s = timer(t.cached, t.prompt_tokens - t.cached)
        for row in rows:
            if row["server"] == server.name:
                cold = row["cold_ttft"]
                extra = {
                    k: row[k] for k in row if k not in summarise(server, row["scenario"], cold)
                }
                row.update(summarise(server, row["scenario"], cold), **extra)
    for server in measured:
        # a 512-token prefill chunk at the deepest context the mixed agents reached
        deepest = max((t.prompt_tokens for t in server.turns if t.scenario == "mixed"), default=0)
        for row in rows:
            if row["scenario"] == "mixed" and row["server"] == server.name:
                row["prefill_chunk_s"] = timer(max(deepest - 512, 0), 512)

    print("\nper scenario, warm turns (turns >= 2, and a sub-agent's first):")
    print(
        f"  {'scenario':<10} {'server':<18} {'reused/reusable':>15} {'of prompt':>9} {'warm TTFT':>9} {'x new prefill':>13} {'cold TTFT':>9}"
    )
    for row in sorted(
        rows,
        key=lambda r: (
            list(SCENARIOS).index(r["scenario"]) if r["scenario"] in SCENARIOS else 99,
            r["server"],
        ),
    ):
        print(
            f"  {row['scenario']:<10} {row['server']:<18} {row['reuse_share'] * 100:14.1f}% "
            f"{row['prompt_share'] * 100:8.1f}% {row['warm_ttft_p50']:8.2f}s "
            f"{row['warm_vs_new_prefill_p50']:12.2f}x "
            + (f"{row['cold_ttft']:8.2f}s" if row.get("cold_ttft") else "        -")
        )
    if stats:
        keys = (
            "hits",
            "misses",
            "tokens_reused",
            "stale_volatile_reuse",
            "exact_key_rejected_by_model_lcp",
            "hybrid_trim_miss",
            "entries",
            "bytes",
            "evictions",
        )
        print("\nkvwarm /stats prompt_cache: " + ", ".join(f"{k}={stats.get(k)}" for k in keys))
    for row in rows:
        if row["scenario"] == "mixed":
            print(
                f"mixed x4 [{row['server']}]: {row['tok_per_s']:.2f} tok/s, TTFT p95 "
                f"{row['ttft_p95']:.2f}s, short agent TTFT p50 {row['short_ttft_p50']:.2f}s / max "
                f"{row['short_ttft_max']:.2f}s, longer agents TTFT p50 {row['long_ttft_p50']:.2f}s, "
                f"longest stall {row['max_stall']:.2f}s (one 512-token prefill chunk at the "
                f"deepest context: {row['prefill_chunk_s']:.2f}s)"
            )
    write_results("agents", {"rows": rows, "kvwarm_prompt_cache": stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
