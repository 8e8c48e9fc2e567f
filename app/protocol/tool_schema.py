"""Tools in the one internal shape (OpenAI function tools) and argument
decoding against their JSON schemas."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: none, auto or required; ``name`` set when one function is forced;
    ``allowed``: the functions a call may name (Responses' allowed_tools), None: any.
    Every tool is still shown: the tools block stays one prefix turn after turn."""

    mode: str = "auto"
    name: str | None = None
    allowed: frozenset[str] | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def function_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI chat tools, keeping only function tools (built-in tool types are ignored)."""
    out = []
    for tool in tools or ():
        fn = tool.get("function")
        if (
            tool.get("type", "function") == "function"
            and isinstance(fn, Mapping)
            and fn.get("name")
        ):
            out.append({"type": "function", "function": dict(fn)})
    return out


def parameter_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' ``properties``."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") or {}
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn.get("name", "")] = dict(props) if isinstance(props, Mapping) else {}
    return out


def parameter_types(
    schemas: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, frozenset[str]]]:
    """Each function's parameters' types, worked out once per request (in its
    preparation): walked again for every decoded call, on the event loop, a
    client's schema of 120,000 anyOf branches cost 60 ms a call."""
    return {
        name: {key: _types(schema) for key, schema in props.items()}
        for name, props in schemas.items()
    }


def _types(schema: Any) -> frozenset[str]:
    if not isinstance(schema, Mapping):
        return frozenset()
    typ = schema.get("type")
    if isinstance(typ, str):
        return frozenset({typ})
    if isinstance(typ, list):
        return frozenset(t for t in typ if isinstance(t, str))
    found: set[str] = set()
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else ():  # a client's schema: any shape
            found |= _types(sub)
    if not found - {"null"}:  # typed by its shape alone (pydantic's and MCP's schemas)
        if "properties" in schema or "additionalProperties" in schema:
            found.add("object")
        elif "items" in schema:
            found.add("array")
    enum = schema.get("enum")
    if not found and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        found = {"string"}
    return frozenset(found)


def _number(text: str, integer_only: bool) -> int | float | None:
    text = text.strip()
    if _INT.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # past Python's digit limit for int(): as a float, infinite
            return None
    if integer_only:
        try:
            value = float(text)
        except ValueError:
            return None
        return int(value) if math.isfinite(value) and value.is_integer() else None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def wants_text(schema: Any, types: frozenset[str] | None = None) -> bool:
    """A parameter whose value must be a string (null not allowed); ``types``:
    its schema's, if worked out already."""
    types = _types(schema) if types is None else types
    return "string" in types and "null" not in types


def _container(text: str) -> dict[str, Any] | list[Any] | None:
    """``text`` as a JSON object or array, else None."""
    try:
        decoded = json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return None
    return decoded if isinstance(decoded, (dict, list)) else None


def coerce_value(
    value: Any, schema: Any, from_text: bool = True, types: frozenset[str] | None = None
) -> Any:
    """One argument value decoded against its schema. Never raises: a value that
    does not fit its declared type is passed on as the model wrote it.
    ``from_text``: the markup writes every value as text (XML parameters), so a
    string is all a value can be; in JSON markup the model typed its values.
    ``types``: the schema's (``parameter_types``), if worked out already."""
    types = _types(schema) if types is None else types
    untyped = not types - {"null"} and isinstance(schema, Mapping)
    if untyped and from_text and isinstance(value, str):
        # declared, but its type is elsewhere (a $ref): JSON the model wrote for an
        # object or an array is one (mlx-lm's parsers, given the schema, do the same)
        decoded = _container(value)
        if decoded is not None:
            return decoded
    if not types:
        return value
    if value is None and "null" in types:
        return None
    if "string" in types:
        if isinstance(value, str):
            return value
        if len(types) == 1:
            return value if value is None else json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        return value
    if types & {"integer", "number"}:
        number = _number(value, integer_only="number" not in types)
        if number is not None:
            return number
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if types & {"object", "array"}:
        found = _container(value)
        if isinstance(found, dict) and "object" in types:
            return found
        if isinstance(found, list) and "array" in types:
            return found
    if "null" in types and value.strip().lower() in ("null", "none"):
        return None
    return value


def coerce_arguments(
    arguments: Mapping[str, Any],
    properties: Mapping[str, Any],
    from_text: bool = True,
    types: Mapping[str, frozenset[str]] | None = None,
) -> dict[str, Any]:
    known = types or {}
    return {
        key: coerce_value(value, properties.get(key), from_text, known.get(key))
        for key, value in arguments.items()
    }
