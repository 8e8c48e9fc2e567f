"""Simulated coding-agent traffic: what the agent-cache benchmark sends.

Agents resend their whole history every turn, with a large system prompt (rules
and tool definitions), tool results of a few hundred tokens, and the replies the
server produced. Scenario knobs reproduce what real agents do to that history:
volatile lines rewritten every turn, think blocks stripped from echoed replies,
a tool result edited mid-history, sub-agents branching off an orchestrator.

Every message carries, besides what is sent, the text the server *should* see
(``healed``: the reply as generated) and a ``key`` with volatile values masked;
the benchmark uses those to count the *reusable* tokens of each request.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

TOOLS = [
    (
        "read_file",
        "Read a file from the workspace and return its contents with line numbers.",
        {"path": "string", "offset": "integer", "limit": "integer"},
    ),
    (
        "write_file",
        "Create or overwrite a file with the given contents.",
        {"path": "string", "content": "string"},
    ),
    (
        "edit_file",
        "Replace an exact string in a file with another string.",
        {"path": "string", "old": "string", "new": "string", "replace_all": "boolean"},
    ),
    (
        "run_shell",
        "Run a shell command in the workspace and return stdout and stderr.",
        {"command": "string", "timeout_s": "integer"},
    ),
    (
        "grep",
        "Search file contents with a regular expression.",
        {"pattern": "string", "path": "string", "glob": "string"},
    ),
    ("list_dir", "List the entries of a directory.", {"path": "string", "depth": "integer"}),
    (
        "run_tests",
        "Run the project's test suite or a subset of it.",
        {"selector": "string", "verbose": "boolean"},
    ),
    ("web_fetch", "Fetch a URL and return it as markdown.", {"url": "string"}),
    ("todo_write", "Replace the task list shown to the user.", {"items": "array"}),
    (
        "spawn_agent",
        "Start a sub-agent on a self-contained task and return its report.",
        {"task": "string", "tools": "array"},
    ),
]

RULES = [
    "You are a coding agent working in the user's repository.",
    "Read the relevant files before you change anything.",
    "Prefer small, reviewable edits; never rewrite a file you have not read.",
    "Run the tests after every change and report failures verbatim.",
    "Keep answers short: the user reads them in a terminal.",
    "Never invent file contents, command output or test results.",
    "Ask before deleting files or running destructive commands.",
    "Use the todo list for tasks with more than three steps.",
    "Cite file paths with line numbers when you refer to code.",
    "When a command fails, read the error before retrying.",
    "Do not add dependencies without saying why.",
    "Match the code style of the surrounding file.",
]

TASKS = [
    "The parser drops the last line of the input file. Find out why.",
    "Add a --verbose flag to the CLI and document it.",
    "The cache hit rate metric is always zero. Investigate.",
    "Refactor the retry loop in client.py into a helper.",
    "Write a test for the date parsing edge cases.",
    "Why does the build fail on the CI machine but not locally?",
]

FOLLOW_UPS = [
    "Good. Now check the callers of that function.",
    "Run the tests again and tell me what fails.",
    "Look at the config loader as well.",
    "Make the change and show me the diff.",
    "What else could cause this?",
    "Summarise what you found so far.",
]


@dataclass
class Msg:
    role: str
    content: str  # what the client sends
    healed: str | None = None  # what the server should see (the reply as generated)
    key: str | None = None  # volatile values masked: equal keys = reusable

    def wire(self) -> dict:
        return {"role": self.role, "content": self.content}

    def seen(self) -> dict:
        return {
            "role": self.role,
            "content": self.healed if self.healed is not None else self.content,
        }

    def ident(self) -> tuple[str, str]:
        return (self.role, self.key if self.key is not None else self.seen()["content"])


def tools_block() -> str:
    specs = [
        {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": v, "description": f"The {k}."} for k, v in props.items()
                },
                "required": list(props)[:1],
            },
        }
        for name, desc, props in TOOLS
    ]
    return "# Tools\nYou may call these tools:\n" + json.dumps(specs, indent=1)


def system_prompt(agent: str) -> str:
    rules = "\n".join(f"- {r}" for r in RULES)
    return f"# Agent: {agent}\n{rules}\n\n{tools_block()}\n"


def tool_output(rng: random.Random, lines: int = 36) -> str:
    """A plausible file listing / source excerpt (~10 tokens per line)."""
    names = ["parse", "load", "retry", "cache", "render", "config", "client", "emit", "flush"]
    out = []
    for i in range(1, lines + 1):
        a, b = rng.choice(names), rng.choice(names)
        kind = rng.random()
        if kind < 0.3:
            out.append(f"{i:4d}  def {a}_{b}(self, value, *, strict=False):")
        elif kind < 0.6:
            out.append(f"{i:4d}      result = self.{a}(value) or {b}_default({i})")
        elif kind < 0.8:
            out.append(f"{i:4d}      if not result:  # {a} failed, fall back to {b}")
        else:
            out.append(f"{i:4d}      return {b}(result, limit={rng.randint(1, 512)})")
    return "\n".join(out)


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def strip_think(text: str) -> str:
    """What clients echo: think blocks removed, including one whose opening tag
    the model left out (templates that pre-open it), outer whitespace trimmed."""
    text = _THINK.sub("", text)
    if "</think>" in text:
        text = text.split("</think>", 1)[1]
    return text.strip()


THINK_SYSTEM_NOTE = (
    "Always think first inside <think> and </think> tags, then answer in one sentence."
)
THINK_SHOTS = [
    (
        "What does ls do?",
        "<think>\nThe user asks about ls. It lists files.\n</think>\nIt lists the files in a directory.",
    ),
    (
        "What does pwd do?",
        "<think>\nThe user asks about pwd. It prints the directory.\n</think>\nIt prints the current working directory.",
    ),
]


class Agent:
    """One agent's conversation; ``volatile`` rewrites its volatile lines every turn."""

    def __init__(
        self,
        name: str,
        seed: int,
        *,
        system: str | None = None,
        volatile: bool = False,
        strip: bool = False,
    ):
        self.name = name
        self.rng = random.Random(seed)
        self.volatile = volatile
        self.strip = strip
        self.turn = 0
        base = system if system is not None else system_prompt(name)
        if strip:
            base += "\n" + THINK_SYSTEM_NOTE
        self.base_system = base
        self.msgs: list[Msg] = [Msg("system", base)]
        if strip:
            for q, a in THINK_SHOTS:
                self.msgs += [Msg("user", q), Msg("assistant", a)]
        self._message_id = 1000 + seed * 100

    def _volatile_system(self) -> Msg:
        t = self.turn
        nonce = f"{self.rng.getrandbits(40):010x}"
        sender = self.rng.choice(["alice", "bob", "carol"])
        content = (
            f"x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch={nonce};\n"
            + self.base_system
            + "\n## Inbound Context (trusted metadata)\n```json\n"
            + json.dumps({"channel": "telegram", "sender": sender, "message_id": 5000 + t})
            + "\n```\n"
            + f"\nCurrent time is 2026-11-26 {9 + t // 60:02d}:{t % 60:02d}:{self.rng.randint(0, 59):02d} UTC\n"
        )
        return Msg("system", content, key=self.base_system + "\n<volatile>")

    def user(self, text: str) -> None:
        if self.volatile:
            self._message_id += 1
            reminder = f"<system-reminder>\nTodo list has {self.rng.randint(0, 5)} open items.\n</system-reminder>\n"
            content = f"{reminder}{text} [message_id: {self._message_id}]"
            self.msgs.append(Msg("user", content, key=text))
        else:
            self.msgs.append(Msg("user", text))

    def tool(self, text: str) -> None:
        self.msgs.append(Msg("tool", text))

    def request(self) -> list[Msg]:
        """The messages of this turn's request."""
        if self.volatile:
            self.msgs[0] = self._volatile_system()
        return list(self.msgs)

    def record_reply(self, reply: str) -> None:
        sent = strip_think(reply) if self.strip else reply
        self.msgs.append(Msg("assistant", sent, healed=reply, key=reply))
        self.turn += 1
