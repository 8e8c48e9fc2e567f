"""Every common way of asking for (or against) thinking, mapped onto one flag.

Clients say it in many dialects: ``enable_thinking``, ``chat_template_kwargs``,
``thinking`` (a bool, a level, or Anthropic's ``{"type": "enabled",
"budget_tokens": N}``), ``reasoning_effort`` and Responses' ``reasoning:
{"effort"}`` — at the top level or nested in ``metadata`` / ``extra_body``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

_OFF = {"off", "none", "false", "disabled", "disable", "no", "0", "minimal_off"}
_ON = {
    "on",
    "true",
    "enabled",
    "enable",
    "yes",
    "1",
    "minimal",
    "low",
    "medium",
    "high",
    "xhigh",
    "auto",
    "adaptive",
}


_SWITCH_KEYS = ("type", "effort", "enabled")  # where an object says on or off


def readable_switch(value: Any) -> Any:
    """A pydantic validator: a thinking switch a client sends must say on or off."""
    if thinking_flag(value) is None:
        raise ValueError(
            f"{value!r:.40} says neither on nor off; use true/false or one of "
            f"{', '.join(sorted(_ON | _OFF))}"
        )
    return value


def readable_if_said(value: Any) -> Any:
    """``thinking`` / ``reasoning``: an object may say nothing about thinking
    (Responses' ``{"summary": "auto"}``), but what it says must be on or off."""
    if isinstance(value, Mapping) and all(value.get(k) is None for k in _SWITCH_KEYS):
        return value
    return readable_switch(value)


def thinking_flag(value: Any) -> bool | None:
    """On, off, or None when the value says neither."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _OFF:
            return False
        if word in _ON:
            return True
        return None
    if isinstance(value, Mapping):  # Anthropic {"type": "enabled"|"disabled", ...}, {"effort": ...}
        for key in _SWITCH_KEYS:
            if value.get(key) is not None:  # {"effort": null, ...} says nothing by it
                return thinking_flag(value[key])
    return None


def _from_fields(fields: Mapping[str, Any]) -> bool | None:
    kwargs = fields.get("chat_template_kwargs")
    candidates = [
        kwargs.get("enable_thinking") if isinstance(kwargs, Mapping) else None,
        fields.get("enable_thinking"),
        fields.get("thinking"),
        fields.get("reasoning_effort"),
        fields.get("reasoning"),
    ]
    for value in candidates:
        flag = thinking_flag(value)
        if flag is not None:
            return flag
    return None


def _scopes(fields: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Where a request says it, most specific first: top-level fields, then
    ``extra_body``, then ``metadata``."""
    for scope in (fields, fields.get("extra_body"), fields.get("metadata")):
        if isinstance(scope, Mapping):
            yield scope


def resolve_thinking(fields: Mapping[str, Any], default: bool) -> bool:
    """The request's thinking switch; the most specific place that says wins
    (``_scopes``), then the server default."""
    for scope in _scopes(fields):
        flag = _from_fields(scope)
        if flag is not None:
            return flag
    return default


EFFORTS = frozenset({"minimal", "low", "medium", "high"})


def resolve_effort(fields: Mapping[str, Any]) -> str | None:
    """The request's reasoning level (``reasoning_effort``, Responses' ``reasoning:
    {"effort"}``), for a template that reads one (gpt-oss: "Reasoning: high"); the
    most specific place that says wins, as for the switch."""
    for scope in _scopes(fields):
        reasoning = scope.get("reasoning")
        for value in (
            scope.get("reasoning_effort"),
            reasoning.get("effort") if isinstance(reasoning, Mapping) else None,
        ):
            if isinstance(value, str) and value.strip().lower() in EFFORTS:
                return value.strip().lower()
    return None
