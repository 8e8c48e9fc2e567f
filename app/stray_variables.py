"""KVWARM_* variables that set nothing: a misspelt one was ignored without a word
(KVWARM_APIKEY served without a key), so serve refuses them, each named with the
setting it may have meant."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from dotenv import dotenv_values
from dotenv.parser import parse_stream
from pydantic import AliasChoices

from app.settings import Settings

# KVWARM_* names kvwarm and its tools read outside Settings: not misspelt settings
OTHER_VARIABLES = frozenset(
    {
        "KVWARM_NO_OPENBLAS",  # engine/blas.py: read before anything imports mlx
        "KVWARM_API_BASE",  # deploy/litellm: LiteLLM's config reads these two
        "KVWARM_UPSTREAM_KEY",
        "KVWARM_REQUIRE_TEST_TOOLS",  # set by .ci/run for tests/helpers/tools.py
        "KVWARM_TEST_CACHE_DIR",  # tests/e2e/conftest.py
    }
)
# what a Kubernetes Service named kvwarm(-*) puts in every pod beside it, besides
# its X_PORT=tcp://... (KVWARM_PORT is the port setting, which takes that as unset)
_SERVICE_LINK = re.compile(
    r"^KVWARM_(\w+_)?(SERVICE_(HOST|PORT)(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)\w*)$"
)


def service_link(name: str, value: str) -> bool:
    """Whether KVWARM_* variable ``name`` is a Service's link, not a setting of ours."""
    return bool(_SERVICE_LINK.match(name)) or (name.endswith("_PORT") and "://" in value)


def setting_variables() -> dict[str, str]:
    """Each variable that sets a field, upper-case: the field it sets."""
    names: dict[str, str] = {}
    for field, info in Settings.model_fields.items():
        alias = info.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias] if alias else []
        for name in choices or [f"KVWARM_{field}"]:
            names[str(name).upper()] = field
    return names


def _unparsed(env_file: str) -> list[str]:
    """The lines of ``env_file`` naming KVWARM_* that python-dotenv cannot read: it
    dropped them with a warning of its own (KVWARM_API_KEY secret: served keyless)."""
    with open(env_file, encoding="utf-8") as stream:
        return [
            f"line {b.original.line} of {env_file} ({b.original.string.rstrip(chr(10))!r}) "
            "does not parse"
            for b in parse_stream(stream)
            if b.error and "KVWARM_" in b.original.string.upper()
        ]


def stray_variables(flags: Mapping[str, str]) -> str | None:
    """The KVWARM_* lines of .env that do not parse, else the KVWARM_* variables of
    the environment and .env that set nothing, each with the setting it may have
    meant (``flags``: field -> its flag, where it has one); None: none of either."""
    sources: list[tuple[str, dict[str, str | None]]] = [("the environment", dict(os.environ))]
    env_file = Settings.model_config.get("env_file")
    if isinstance(env_file, str) and Path(env_file).is_file():
        sources.append((env_file, dict(dotenv_values(env_file))))
    known = setting_variables()
    # matched without the prefix all share, which made any name look close to any other
    suffixes = {n.removeprefix("KVWARM_"): n for n in known if n.startswith("KVWARM_")}
    unparsed = _unparsed(str(env_file)) if len(sources) > 1 else []
    if unparsed:
        return (
            f"{'; '.join(unparsed)}: it would be dropped, its setting left unset (write NAME=VALUE)"
        )
    stray: list[str] = []
    for where, variables in sources:
        for name, value in variables.items():
            upper = name.upper()  # pydantic-settings reads names in any case
            if not upper.startswith("KVWARM_") or upper in known or upper in OTHER_VARIABLES:
                continue
            if service_link(upper, value or ""):
                continue
            close = difflib.get_close_matches(upper.removeprefix("KVWARM_"), suffixes, n=1)
            hint = ""
            if close:
                meant = suffixes[close[0]]
                flag = flags.get(known[meant])
                hint = f" (did you mean {f'{flag} / ' if flag else ''}{meant}?)"
            stray.append(f"{name} in {where}{hint}")
    if not stray:
        return None
    return f"unknown KVWARM_* variable: {'; '.join(stray)} (no setting reads it: fix or unset it)"
