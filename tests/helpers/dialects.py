"""Shared set-up of the dialect tests: a model-free engine playing scripted
replies (reasoning, text and tool-call markup split at awkward places) through
the real output pipeline, behind a real socket, for the official SDKs."""

from __future__ import annotations

import anthropic
import openai

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine, prompt_text

QWEN_CALL = [
    "<think>",
    "Need the ",
    "weather.</thi",
    "nk>\n\n",
    "Checking.\n<tool",
    "_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "is\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
]
THINK_ANSWER = ["<think>pl", "an</think>", "\n\nAnswer ", "done."]
FORCED_REST = ['{"city": "Os', 'lo"}}', "\n</tool_call>"]  # after a forced Hermes opening
TEXT_CALL_TEXT = [
    "Before.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "After.",
]
TWO_CALLS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
]
GLM_CALL = [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
]
SCRIPTS = {
    "GLM_CALL": GLM_CALL,
    "CALL_TOOL": QWEN_CALL,
    "TWO_CALLS": TWO_CALLS,
    "THINK": THINK_ANSWER,
    "FORCE": FORCED_REST,
    "SANDWICH": TEXT_CALL_TEXT,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": "w", "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


PROMPTS: list[str] = []  # what the engine was asked to continue, newest last
REQUESTS: list = []  # and the requests themselves


def scripted(req):
    text = prompt_text(req)
    PROMPTS.append(text)
    REQUESTS.append(req)
    last = text[text.rfind("<user>") :]
    return next((pieces for word, pieces in SCRIPTS.items() if word in last), None)


class Served:
    def __init__(self, url: str, app):
        self.url = url
        self.app = app

    @property
    def formatter(self):
        return self.app.state.kvwarm.engine.info.formatter

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="k", max_retries=0)


def serve_scripted(**settings):
    app = create_app(
        Settings(_env_file=None, **settings),
        lambda s, r: FakeEngine(s, r, script=scripted, eos_after=6),
    )
    return app
