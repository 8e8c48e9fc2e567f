"""Where kvwarm keeps what it makes (converted models, the KV SSD tier).

Its own module, importing no MLX: the CLI decides settings from it before the
OpenBLAS preload, which must come before MLX is first imported.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if env := os.environ.get("KVWARM_CACHE_DIR"):
        return Path(env).expanduser()  # "~/kvc" from a unit file's Environment=
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvwarm"
