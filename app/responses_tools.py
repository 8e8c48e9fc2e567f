"""A Responses request's tools and tool_choice, read into the chat pipeline's terms.

Function tools are rendered and parsed; built-in and custom tools (web_search,
file_search, mcp, custom, ...) are not served: echoed back as sent and named in
the ignored-fields header. ``tool_choice`` has more
shapes than chat's: ``allowed_tools`` narrows the callable functions to a list
under a mode, and a choice naming a built-in tool (as the Agents SDK sends for
``tool_choice="file_search"``) leaves the model free, which is said in the
ignored-fields header rather than refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.chat_pipeline import choice_of, parse_openai_tool_choice
from app.errors import APIError
from app.protocol.tool_schema import ToolChoice
from app.responses_schemas import ResponsesTool, ResponsesToolChoice
from app.schemas import MAX_TOOLS

# tool_choice types naming a tool kvwarm does not run (OpenAI's hosted tools, MCP,
# custom tools): the model chooses freely; any other type is a 400
UNSERVED_CHOICES = frozenset(
    {
        "file_search",
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "computer_use_preview",
        "computer_use",
        "code_interpreter",
        "image_generation",
        "mcp",
        "custom",
        "shell",
        "local_shell",
        "apply_patch",
    }
)


@dataclass(frozen=True)
class ResponsesTools:
    tools: list[dict[str, Any]]  # the function tools the model is shown, in chat shape
    choice: ToolChoice
    ignored: tuple[str, ...] = ()


def function_tools(tools: list[ResponsesTool] | None) -> list[dict[str, Any]]:
    """Flat Responses function tools in chat shape; built-in tool types are ignored."""
    out = []
    for tool in tools or ():
        if tool.type == "function" and tool.name:
            fn = tool.model_dump(include={"name", "description", "parameters", "strict"})
            out.append(
                {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}
            )
    return out


def unserved_tools(tools: list[ResponsesTool] | None) -> tuple[str, ...]:
    """Tools the model is not shown (custom, web_search, mcp, ...), as Messages names
    its server tools: in the ignored-fields header, never dropped in silence."""
    return tuple(dict.fromkeys(f"tools.{t.type}" for t in tools or () if t.type != "function"))


def read_tools(
    tools: list[ResponsesTool] | None, choice: str | ResponsesToolChoice | None
) -> ResponsesTools:
    functions = function_tools(tools)
    unserved = unserved_tools(tools)
    kind = getattr(choice, "type", None)
    if kind == "allowed_tools":
        mode, names = _allowed(choice.model_extra or {})
        # Only the allowed functions are shown. OpenAI keeps the full list in the
        # prompt (its cache survives a change of choice) and constrains sampling to
        # the allowed; without constrained decoding, a model shown a tool it may not
        # call calls it, and the call could only end as stray markup in the text.
        # Correct replies first: a turn whose allowed set changes re-renders the tools.
        shown = [t for t in functions if t["function"]["name"] in names]
        allowed = [t["function"]["name"] for t in shown]
        return ResponsesTools(shown, _allowed_choice(mode, allowed), unserved)
    if kind in UNSERVED_CHOICES:  # that tool is not served: the model chooses freely
        ignored = (*unserved, f"tool_choice.{kind}")
        return ResponsesTools(functions, choice_of("auto", functions), ignored)
    # chat's choices, and the 400 for any other type
    return ResponsesTools(functions, parse_openai_tool_choice(choice, functions), unserved)


def _allowed_choice(mode: str, allowed: list[str]) -> ToolChoice:
    """``mode`` over the allowed functions: required of one forces that one; with
    none allowed, nothing is called."""
    if not allowed and mode == "auto":
        return ToolChoice("none")
    if mode == "required":
        if not allowed:
            raise APIError(
                400,
                "tool_choice allowed_tools requires a tool call, but lists none of the "
                "request's function tools.",
                param="tool_choice",
            )
        if len(allowed) == 1:
            return ToolChoice("required", allowed[0], frozenset(allowed))
    return ToolChoice(mode, allowed=frozenset(allowed))


def _allowed(fields: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    """``allowed_tools``' mode and the function names it lists."""
    mode, listed = fields.get("mode", "auto"), fields.get("tools")
    if mode not in ("auto", "required") or not isinstance(listed, list) or len(listed) > MAX_TOOLS:
        raise APIError(
            400,
            f"tool_choice allowed_tools needs a mode (auto or required) and a list of at "
            f"most {MAX_TOOLS} tools.",
            param="tool_choice",
        )
    names = frozenset(
        t["name"]
        for t in listed
        if isinstance(t, Mapping) and t.get("type") == "function" and isinstance(t.get("name"), str)
    )
    return mode, names


def echoed_tool(tool: ResponsesTool) -> dict[str, Any]:
    """A tool as the client sent it: a function's declared fields (extra keys,
    never rendered nor counted against the context, would be copied into every
    response event on the loop); a built-in tool (ignored) whole, its size bounded
    at the boundary, so the SDK's models of them still validate."""
    if tool.type != "function":
        return tool.model_dump(exclude_none=True)
    return tool.model_dump(
        include={"type", "name", "description", "parameters", "strict"}, exclude_none=True
    )


def echoed_choice(choice: str | ResponsesToolChoice | None) -> str | dict[str, Any]:
    """The tool_choice as sent: its declared fields (allowed_tools' mode and list too)."""
    if not isinstance(choice, ResponsesToolChoice):
        return choice or "auto"
    out = choice.model_dump(include={"type", "name"}, exclude_none=True)
    if choice.type == "allowed_tools":
        extra = choice.model_extra or {}
        out.update(mode=extra.get("mode", "auto"), tools=extra.get("tools"))
    return out
