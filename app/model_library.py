"""The models on this machine and what each would cost, from headers only.

``GET /library`` and ``kvwarm fit`` list models found in the Hugging Face hub
cache, kvwarm's own model cache and ``--model-dir`` folders. Nothing here reads
tensor bytes: a model directory is its ``config.json`` plus each safetensors
file's JSON header (names, dtypes, shapes); a GGUF file is its key/value header
and tensor table. That is enough for the size, the parameter count (packed
quantized weights unpacked), the KV cost per token and the context.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.recurrent_state import state_layout
from engine import config_fields as fields
from engine.gguf_archs import ARCHS as GGUF_ARCHS  # what engine.gguf_convert converts
from engine.gguf_header import gguf_problem, read_gguf_header
from engine.model_errors import NotAModel, UnsupportedModelError
from engine.model_source import hub_roots, missing_shards
from engine.vision_families import SERVED_FAMILIES as VISION_FAMILIES
from kvcache.layout import KVLayout, LayerKind, LayerKV
from scheduler.fit import ModelFacts

CACHE_S = 30.0
_FLOAT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
# FP8 checkpoints: mlx-lm dequantises them to bfloat16 as it loads them (the models'
# ``sanitize``), so each value costs 2 bytes loaded and the KV is bfloat16 too
_FP8 = frozenset({"F8_E4M3", "F8_E5M2"})
# multi-head latent attention whose mlx-lm module caches every head's keys and values
# (the latent expanded), not the compressed latent its config describes
_MLA_FULL_HEADS = frozenset({"deepseek_v2", "minicpm3", "youtu_llm"})
# each layer's cache a CacheList of two KVCaches: DeepSeek V3.2 and GLM-5 (DSA) keep
# the sparse-attention indexer's keys beside the latent, and a values array of the
# same size; LongCat-Flash runs two latent attentions per layer
_DSA_INDEXER = frozenset({"deepseek_v32", "glm_moe_dsa"})
_TWO_MLA = frozenset({"longcat_flash", "longcat_flash_ngram"})
_EXPERT_MARKERS = (".experts.", ".switch_mlp.", ".block_sparse_moe.experts")


# what mlx-lm's model classes fill in where a config is silent: Gemma 3's vision
# checkpoints name neither heads nor head size in text_config (mlx-lm's wrapper
# gives 8 and 4 heads, gemma3_text a head size of 256), which read as one head of
# the whole hidden size (KV a quarter too large, attention reserve an eighth)
_ARG_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma3": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "gemma3_text": {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256},
}


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    merged = {**config, **text} if isinstance(text, dict) else config
    # the wrapper's first: it fills text_config before the text model reads its own
    for model_type in (config.get("model_type"), merged.get("model_type")):
        merged = {**_ARG_DEFAULTS.get(str(model_type), {}), **merged}
    return merged


def _int(config: dict[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


@functools.cache  # the installed mlx-lm does not change under a running process
def _mlx_lm_types() -> frozenset[str]:
    """Model types mlx-lm has a module for (found without importing mlx)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    root = Path(next(iter(spec.submodule_search_locations)))
    modules = {p.stem for p in (root / "models").glob("*.py") if not p.stem.startswith("_")}
    return frozenset(modules | _remapped(root / "utils.py"))


def _remapped(utils: Path) -> set[str]:
    """Model types mlx-lm loads through another's module (its MODEL_REMAPPING:
    mistral -> llama, kimi_k2 -> deepseek_v3, ...), read from its source."""
    try:
        tree = ast.parse(utils.read_text())
    except (OSError, SyntaxError, ValueError):
        return set()
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return set()


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise NotAModel(f"{path}: truncated ({len(head)} bytes: no safetensors header)")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 2**20:
            raise NotAModel(f"{path}: implausible safetensors header ({size} bytes)")
        raw = f.read(size)
        if len(raw) < size:
            raise NotAModel(f"{path}: truncated (its header is cut off)")
        try:
            header = json.loads(raw)
        except ValueError:
            raise NotAModel(f"{path}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise NotAModel(f"{path}: the safetensors header is not an object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("shape"), list)
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
        ):
            raise NotAModel(f"{path}: tensor {name!r} has no shape and offsets")
    # an interrupted download or copy: mlx failed reading it, naming no file
    data = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    have = path.stat().st_size
    if have < 8 + size + data:
        raise NotAModel(
            f"{path}: truncated ({have} bytes where its header describes {8 + size + data}: "
            "an interrupted download or copy?)"
        )
    return header


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def dir_facts(
    path: Path, name: str | None = None, mlx_types: frozenset[str] | None = None
) -> ModelFacts:
    """Facts of an mlx-lm / Hugging Face model directory."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise NotAModel(f"{path}: no readable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise NotAModel(f"{path}: config.json is not an object")
    incomplete = missing_shards(path)
    if incomplete:
        raise NotAModel(f"{path}: {incomplete}")
    text = _text_config(config)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    weights = params = expert_params = 0
    float_numel: dict[int, int] = {}  # float width -> elements stored at it
    # the files mlx-lm loads (a repo may also ship consolidated.safetensors)
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    for file in files:
        for tname, info in _safetensors_header(file).items():
            start, end = info["data_offsets"]
            numel = _numel(info["shape"])
            if info["dtype"] in _FP8:
                weights += numel * 2
                float_numel[2] = float_numel.get(2, 0) + numel
            elif tname.endswith("_scale_inv"):
                continue  # an FP8 block's scale: gone once dequantised
            else:
                weights += end - start
            if info["dtype"] == "U32" and bits and tname.endswith(".weight"):
                numel = numel * 32 // int(bits)  # packed quantized weights
            elif tname.endswith((".scales", ".biases")) and bits:
                continue  # quantization metadata, not parameters
            params += numel
            if any(m in tname for m in _EXPERT_MARKERS):
                expert_params += numel
            width = _FLOAT_BYTES.get(info["dtype"], 0)
            if width:
                float_numel[width] = float_numel.get(width, 0) + _numel(info["shape"])
    if not weights:
        raise NotAModel(f"{path}: no safetensors weights")
    experts = _int(text, "num_local_experts", "num_experts", "n_routed_experts")
    per_token = _int(text, "num_experts_per_tok", "moe_topk")
    active = params
    if experts and per_token and expert_params:
        active = params - expert_params + expert_params * per_token // experts
    heads = fields.first_int(text, fields.HEADS, default=1)
    kv_heads = fields.kv_heads(text, heads)
    head_dim = _int(text, "head_dim", default=fields.first_int(text, fields.WIDTH) // max(1, heads))
    layers = fields.first_int(text, fields.LAYERS)
    # activations (and so the KV) have the width most of the float tensors have: a
    # few kept float32 by mlx-lm (router biases) do not make a bf16 model's KV float32
    act_bytes = max(float_numel, key=lambda w: float_numel[w]) if float_numel else 2
    model_type = str(config.get("model_type", "?"))
    per_layer = _kv_per_layer(model_type, text, kv_heads, head_dim) * act_bytes
    family = str(text.get("model_type", model_type))  # a vision model's text model
    # Mamba, RWKV-7: a constant state per sequence, no KV that grows
    states = state_layout(family, text, layers, act_bytes)
    vision = "vision_config" in config
    types = _mlx_lm_types() if mlx_types is None else mlx_types
    why = ""
    if vision and model_type not in VISION_FAMILIES:
        why = (
            f"vision model type {model_type!r} is not served yet (kvwarm serves "
            f"{', '.join(sorted(VISION_FAMILIES))})"
        )
    elif not vision and types and model_type not in types:
        why = f"mlx-lm has no {model_type!r} model class"
    return ModelFacts(
        name=name or path.name,
        path=str(path),
        kind="mlx",
        model_type=model_type,
        weights_bytes=weights,
        params=params,
        active_params=active,
        kv_bytes_per_token=0 if states else per_layer * _attention_layers(text, layers),
        context_length=_context(config),
        num_heads=heads,
        quant_bits=int(bits) if bits else None,
        vision=vision,
        supported=not why,
        why_unsupported=why,
        layout=states or _window_layout(family, text, layers, per_layer),
        kv_value_bytes=act_bytes,
    )


def _context(config: dict[str, Any]) -> int:
    """What serve reads (engine.loader, through the same reader); 4096 where the
    config is silent (serve asks the tokenizer then, which fit has not loaded)."""
    found = fields.context_length(config)
    return 4096 if found is None else found


# mlx-lm families whose make_cache gives sliding-window layers a RotatingKVCache:
# by "layer_types", or every layer but each n-th (the family's default n)
WINDOWS_BY_LAYER_TYPE = frozenset({"llama", "ministral3", "gpt_oss", "olmo3"})
WINDOWS_BY_PATTERN = {"gemma3_text": 6, "gemma3": 6, "cohere2": 4}
MAX_LAYERS = 4096  # past this a layout would only cost the listing time


def _window_layout(
    model_type: str, text: dict[str, Any], layers: int, per_layer: int
) -> KVLayout | None:
    """Per-layer KV where mlx-lm keeps some layers to a sliding window (their KV
    stops growing there: Gemma 3's 5 of 6 layers at 1024 tokens hold 128k of context
    in a sixth of the memory); None where every layer grows, or nothing says."""
    window = _int(text, "sliding_window")
    kinds = text.get("layer_types")
    if window <= 0 or not 0 < layers <= MAX_LAYERS:  # a config is only a file anyone wrote
        return None
    if model_type in WINDOWS_BY_LAYER_TYPE and isinstance(kinds, list) and len(kinds) == layers:
        windowed = [kind == "sliding_attention" for kind in kinds]
    elif model_type in WINDOWS_BY_PATTERN:
        every = _int(text, "sliding_window_pattern", default=WINDOWS_BY_PATTERN[model_type])
        windowed = [every > 0 and i % every != every - 1 for i in range(layers)]
    else:
        return None
    if not any(windowed):
        return None
    return KVLayout(
        tuple(
            LayerKV(LayerKind.WINDOW, per_layer, window)
            if slides
            else LayerKV(LayerKind.ATTENTION, per_layer)
            for slides in windowed
        ),
        ("sliding-window layers (from config)",),
    )


def _kv_per_layer(model_type: str, text: dict[str, Any], kv_heads: int, head_dim: int) -> int:
    """KV values one attention layer caches per token: multi-head latent attention
    (DeepSeek V3, Kimi K2) caches one compressed latent and its rotary part, not
    every head's keys and values, except where mlx-lm's module expands it first;
    DSA models add their indexer's cache, LongCat-Flash caches two latents."""
    latent = _int(text, "kv_lora_rank")
    if latent and model_type in _MLA_FULL_HEADS:
        # each module's own defaults; MiniCPM3's value heads are always hidden / heads
        heads = _int(text, "num_attention_heads", default=1)
        key = _int(text, "qk_nope_head_dim", default=128) + _int(
            text, "qk_rope_head_dim", default=64
        )
        value = (
            _int(text, "hidden_size") // heads
            if model_type == "minicpm3"
            else _int(text, "v_head_dim", default=128)
        )
        return heads * (key + value)
    if latent:
        one = latent + _int(text, "qk_rope_head_dim")
        if model_type in _DSA_INDEXER:  # deepseek_v32's ModelArgs default: 128
            return one + 2 * _int(text, "index_head_dim", default=128)
        return 2 * one if model_type in _TWO_MLA else one
    return kv_heads * head_dim * 2


def _attention_layers(text: dict[str, Any], layers: int) -> int:
    """Layers that keep a KV cache: hybrid models' linear-attention and state-space
    layers keep a fixed-size state instead (sliding-window layers count here; their
    window is in ``_window_layout``)."""
    pattern = text.get("hybrid_override_pattern")  # Nemotron-H: "*" is attention
    if isinstance(pattern, (str, list)) and pattern:
        return sum(1 for block in pattern if block == "*")
    kinds = text.get("layer_types") or text.get("layers_block_type")
    if isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds):
        attention = [k for k in kinds if "attention" in k and "linear" not in k]
        if attention or any("linear" in k or "mamba" in k for k in kinds):
            return len(attention)
    interval = _int(text, "full_attention_interval")  # Qwen3-Next, Qwen3.5
    if interval > 1:
        return layers // interval
    return layers


# -- GGUF: the header only (engine.gguf_header reads it) -------------------------
# ggml quantized types -> their nominal bits (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
# Q2_K..Q8_K); F32/F16/BF16 and anything else count as float
_GGML_BITS = {2: 4, 3: 4, 6: 5, 7: 5, 8: 8, 9: 8, 10: 2, 11: 3, 12: 4, 13: 5, 14: 6, 15: 8}


def _mlx_gguf_bytes(ttype: int, numel: int) -> int:
    """Bytes a tensor takes once mx.load has read it: Q4_0/Q4_1/Q8_0 stay
    quantized (with a float16 scale and bias per 32 values), F32 stays float32,
    every other type (the K-quants included) becomes float16."""
    if ttype in (2, 3):
        return numel * 5 // 8
    if ttype == 8:
        return numel * 9 // 8
    return numel * (4 if ttype == 0 else 2)


def gguf_facts(path: Path) -> ModelFacts:
    """Facts of a GGUF file, from its key/value header and tensor table."""
    header = read_gguf_header(path)
    params = gpu_bytes = expert_params = 0
    by_bits: dict[int, int] = {}  # parameters per nominal bit width (0: float)
    for t in header.tensors:
        params += t.numel
        if "_exps." in t.name:  # blk.N.ffn_up_exps.weight
            expert_params += t.numel
        gpu_bytes += _mlx_gguf_bytes(t.ttype, t.numel)
        bits = _GGML_BITS.get(t.ttype, 0)
        by_bits[bits] = by_bits.get(bits, 0) + t.numel
    quant_bits = max(by_bits, key=lambda b: by_bits[b]) if by_bits else 0
    arch, meta, arch_int = header.arch, header.meta, header.arch_int
    heads = arch_int("attention.head_count", 1) or 1
    kv_heads = arch_int("attention.head_count_kv", heads)
    shape = header.shape()
    head_dim, layers = shape["head_dim"], shape["num_hidden_layers"]
    experts, per_token = arch_int("expert_count"), arch_int("expert_used_count")
    act_bytes = _gguf_act_bytes(arch)
    why = gguf_problem(header)
    supported = why is None
    per_layer = kv_heads * head_dim * 2 * act_bytes
    layout = _gguf_layout(meta, arch, shape, per_layer)
    return ModelFacts(
        name=path.name,
        path=str(path),
        kind="gguf",
        model_type=arch,
        weights_bytes=path.stat().st_size,
        params=params,
        # only the routed experts' share is scaled: attention and embeddings always run
        active_params=params - expert_params + expert_params * per_token // experts
        if experts and per_token
        else params,
        # float16 KV beside quantized weights; float32 where norms stay float32
        kv_bytes_per_token=layers * per_layer,
        context_length=arch_int("context_length", 4096),
        num_heads=heads,
        quant_bits=quant_bits or None,
        supported=supported,
        why_unsupported=why or "",
        gpu_weights_bytes=gpu_bytes,
        kv_value_bytes=act_bytes,
        layout=layout,
    )


def _gguf_layout(
    meta: dict[str, Any], arch: str, config: dict[str, int], per_layer: int
) -> KVLayout | None:
    """The sliding-window layers of the model the GGUF converts to (Gemma 3: five
    of six), from the very config fields engine.gguf_convert writes for it."""
    known = GGUF_ARCHS.get(arch)
    if known is None:
        return None
    try:
        fields = known.extra(lambda key, default: meta.get(f"{arch}.{key}", default), config)
    except (UnsupportedModelError, TypeError, ValueError, OverflowError):
        return None  # what serve refuses, or metadata no model has: priced as growing
    return _window_layout(known.model_type, fields, config["num_hidden_layers"], per_layer)


def _gguf_act_bytes(arch: str) -> int:
    known = GGUF_ARCHS.get(arch)
    return 4 if known is not None and known.float32_activations else 2


def model_facts(
    path: Path, name: str | None = None, mlx_types: frozenset[str] | None = None
) -> ModelFacts:
    """A model directory or a .gguf file (``name``: how to list it; default its file name)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        facts = gguf_facts(path)
        return replace(facts, name=name) if name else facts
    if path.is_dir():
        return dir_facts(path, name, mlx_types)
    raise NotAModel(f"{path}: neither a model directory nor a .gguf file")


Found = ModelFacts | tuple[str, str, str]  # facts, or (name, path, why it could not be read)


def read_entry(
    path: Path, name: str | None = None, mlx_types: frozenset[str] | None = None
) -> Found:
    """``model_facts``, or why not: one unreadable model is reported, never fatal."""
    try:
        return model_facts(path, name, mlx_types)
    except NotAModel as exc:
        return (name or str(path), str(path), str(exc))
    except Exception as exc:  # noqa: BLE001 - a crafted or broken file must not hide the rest
        return (name or str(path), str(path), f"unreadable: {exc}")


def real_path(path: Path) -> str:
    """Where ``path`` really is; itself where that cannot be known (a symlink loop
    raised out of the scan, and one such link hid every other model)."""
    try:
        return str(path.resolve())
    except (OSError, RuntimeError):
        return str(path.absolute())


def _snapshots(repo: Path) -> list[Path]:
    """A hub repo's revisions, the one that loads by the repo's name first (the
    snapshot refs/main names, else the newest), then the rest newest first."""
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except (OSError, ValueError):
        main = ""  # only revisions fetched by hash or branch
    try:
        snaps = [s for s in (repo / "snapshots").iterdir() if s.is_dir()]
        snaps.sort(key=lambda s: s.stat().st_mtime, reverse=True)
    except OSError:
        return []
    return sorted(snaps, key=lambda s: s.name != main)  # stable: main's first


def _listing(folder: Path) -> list[Path]:
    """``folder``'s entries, sorted; none where it cannot be listed."""
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _model_dir(path: Path) -> bool:
    """A folder with a config.json; one this user may not look into counts (it
    is then listed as unreadable, not fatal to the scan: Python 3.11 raises)."""
    try:
        return path.is_dir() and (path / "config.json").is_file()
    except OSError:
        return True


def _candidates(hub: list[Path], folders: list[Path]) -> Iterable[tuple[str, Path]]:
    for root in hub:  # models--org--name/snapshots/<rev>/
        for repo in sorted(root.glob("models--*")):
            name = repo.name.removeprefix("models--").replace("--", "/")
            snaps = _snapshots(repo)
            if snaps and _model_dir(snaps[0]):  # one revision: each was listed as a model
                yield name, snaps[0]
            ggufs: dict[str, Path] = {}  # a quant fetched at an older revision is still there
            for snap in snaps:
                for g in _listing(snap):
                    if g.suffix.lower() == ".gguf":
                        ggufs.setdefault(g.name, g)
            yield from ((f"{name}/{g}", path) for g, path in sorted(ggufs.items()))
    for folder in folders:
        if _model_dir(folder):  # --model-dir naming one model
            yield folder.name, folder
            continue
        try:
            children = sorted(folder.iterdir()) if folder.is_dir() else []
        except OSError:  # one this user may not list: shown as unreadable, not skipped
            yield folder.name, folder
            continue
        yield from _in_folder(children, "", FOLDER_DEPTH)


# plain folders looked into below a --model-dir: publisher/repo/ (LM Studio's
# layout, `hf download --local-dir models/org/name`'s); a whole tree is not walked
FOLDER_DEPTH = 2


def _in_folder(entries: list[Path], prefix: str, levels: int) -> Iterable[tuple[str, Path]]:
    """GGUFs and model folders among ``entries``, then in the plain folders among
    them, ``levels`` levels down (hidden ones, such as hf's .cache, skipped)."""
    for entry in entries:
        name = prefix + entry.name
        if entry.suffix.lower() == ".gguf" or _model_dir(entry):
            yield name, entry
        elif levels > 0 and not entry.name.startswith(".") and entry.is_dir():
            yield from _in_folder(_listing(entry), f"{name}/", levels - 1)


class ModelLibrary:
    """Models in the hub cache and local folders, rescanned at most every 30 s."""

    def __init__(self, folders: list[Path], hub: list[Path] | None = None):
        self.folders = folders
        self.hub = hub_roots() if hub is None else hub
        self._lock = threading.Lock()
        self._at = -CACHE_S
        self._found: list[Found] = []
        # a GGUF's facts by where it is, while its stamp holds: its header (a 152k
        # vocabulary: ~0.5 s) was parsed again on every rescan, under the lock
        self._ggufs: dict[str, tuple[tuple[Any, ...], Found]] = {}

    def scan(self) -> list[Found]:
        """ModelFacts per model; (name, path, why) for what could not be read."""
        with self._lock:
            if time.monotonic() - self._at < CACHE_S:
                return self._found
            found: list[Found] = []
            types = _mlx_lm_types()
            seen: set[str] = set()
            ggufs: dict[str, tuple[tuple[Any, ...], Found]] = {}
            for name, path in _candidates(self.hub, self.folders):
                key = real_path(path)
                if key in seen:
                    continue
                seen.add(key)
                found.append(self._entry(path, name, types, key, ggufs))
            self._found, self._at, self._ggufs = found, time.monotonic(), ggufs
            return found

    def _entry(
        self,
        path: Path,
        name: str,
        types: frozenset[str],
        key: str,
        ggufs: dict[str, tuple[tuple[Any, ...], Found]],
    ) -> Found:
        if path.suffix.lower() != ".gguf":
            return read_entry(path, name, types)
        try:
            st = path.stat()
        except OSError:
            return read_entry(path, name, types)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, name)
        known = self._ggufs.get(key)
        entry = known[1] if known is not None and known[0] == stamp else None
        if entry is None:
            entry = read_entry(path, name, types)
        ggufs[key] = (stamp, entry)
        return entry
