"""Convert a GGUF file (llama, qwen2, qwen3, gemma, gemma2, gemma3) into an
mlx-lm model directory.

``mx.load`` reads GGUF tensors (Q4_0/Q4_1/Q8_0 arrive already in MLX's affine
quantized layout) and the metadata; transformers' GGUF tables rename the shared
config keys and rebuild the tokenizer (per-architecture vocabularies and
llama.cpp's pre-tokenizer splits). What is left here is the last mile: tensor
names in mlx-lm's spelling, what llama.cpp's converter did to each architecture
undone (engine.gguf_archs), and ``config.json`` / ``tokenizer.json`` written so
``mlx_lm.load`` opens the directory like any other model. The converted folder
is keyed by the file's content, not its path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.cache_dir import cache_root
from engine.file_digest import content_digest
from engine.gguf_archs import (
    BLOCK_TENSOR,
    READABLE_NAMES,
    ROPE_FREQS,
    ROPE_FREQS_WHY,
    TOP,
    GGUFArch,
    arch_of,
    base_config,
    llama3_rope_scaling,
    split_file,
    tensor_problem,
)
from engine.model_errors import UnsupportedModelError

log = logging.getLogger("kvwarm.engine.gguf")

_GROUP_SIZE = 32  # every GGUF block quantisation mx.load understands uses 32
_CONVERTER_VERSION = "3"  # 3: float16 norms beside quantized weights


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item() if value.size == 1 else value.tolist()
    return value


def architecture(meta: dict[str, Any]) -> str:
    return str(meta.get("general.architecture"))


def _rename(name: str, arch: GGUFArch) -> str:
    problem = tensor_problem(name, arch)
    if problem is not None:
        raise UnsupportedModelError(problem)
    base, _, suffix = name.rpartition(".")  # suffix: weight / bias / scales / biases
    match = BLOCK_TENSOR.fullmatch(base)
    if match:
        layer, part = match.groups()
        return f"model.layers.{layer}.{arch.block[part]}.{suffix}"
    if base == ROPE_FREQS:  # a llama's is taken out of the weights before (_rope_scaling)
        raise UnsupportedModelError(ROPE_FREQS_WHY)
    return f"{TOP[base]}.{suffix}"


def model_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """config.json for mlx-lm: the shared keys through transformers' table, then
    what this architecture's model class needs."""
    name = architecture(meta)
    arch = arch_of(name)

    def value(key: str, default: Any) -> Any:
        return _scalar(meta, f"{name}.{key}", default)

    config = base_config(name, value)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = value("attention.key_length", None) or value("rope.dimension_count", None)
    config.update(
        {
            "model_type": arch.model_type,
            "num_key_value_heads": int(config.get("num_key_value_heads", heads)),
            "head_dim": int(head_dim or hidden // heads),
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(config.get("rope_theta", 10000.0)),
            "rope_traditional": arch.rope_traditional,
            "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
            # the embedding's rows: models pad it past the tokenizer (Qwen2: 151936 vs 151665)
            "vocab_size": int(
                weights["token_embd.weight"].shape[0]
                if "token_embd.weight" in weights
                else config.get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
            ),
            "tie_word_embeddings": "output.weight" not in weights,
        }
    )
    if arch.model_type == "llama":
        config.update({"attention_bias": False, "mlp_bias": False})
    config.update(arch.extra(value, config))
    return config


def _rope_scaling(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1+: the ``rope_scaling`` its rope_freqs tensor was computed from
    (taken out of the weights: mlx-lm computes the factors itself)."""
    factors = weights.pop(f"{ROPE_FREQS}.weight", None)
    if factors is None:
        return {}
    if config["model_type"] != "llama":
        raise UnsupportedModelError(ROPE_FREQS_WHY)
    values = factors.astype(mx.float32).tolist()
    scaling = llama3_rope_scaling(values, config["rope_theta"], config["head_dim"])
    return {"rope_scaling": scaling}


def _tokenizer_files(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """tokenizer.json / tokenizer_config.json from GGUF metadata, built by
    transformers' GGUF tokenizer converter (per-architecture vocab handling and
    llama.cpp's pre-tokenizer splits)."""
    from tokenizers import pre_tokenizers, processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    arch = architecture(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    fields = {
        name: _scalar(meta, f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    fields["tokens"] = tokens
    if "merges" in fields:
        fields["merges"] = list(meta["tokenizer.ggml.merges"])
    try:
        tokenizer, _ = convert_gguf_tokenizer(arch, fields)
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"GGUF tokenizer cannot be rebuilt: {exc}") from exc
    if meta.get("tokenizer.ggml.pre") == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit, then GPT-2's regex
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )

    def token(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    default_bos = fields.get("tokenizer_type") == "llama"  # sentencepiece: llama.cpp adds BOS
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", default_bos)) and bos is not None
    # BOS exactly as the file says: the converter's own post-processor is replaced
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A" if add_bos else "$A",
        pair=f"{bos} $A {bos} $B" if add_bos else "$A $B",
        special_tokens=[(bos, tokens.index(bos))] if add_bos else [],
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    # a chat turn may end with an end-of-turn token other than EOS (Gemma's <end_of_turn>)
    stops = [
        _scalar(meta, k)
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if _scalar(meta, k) is not None
    ]
    generation = {
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(set(stops))
        if len(set(stops)) > 1
        else (stops[0] if stops else None),
    }
    return {
        "tokenizer.json": json.loads(tokenizer.to_str()),
        "tokenizer_config.json": config,
        "generation_config.json": generation,
    }


def _convert_weights(
    weights: dict[str, mx.array], dequantize: bool, arch: GGUFArch
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    out: dict[str, mx.array] = {}
    quantized_bits: set[int] = set()
    for name, value in weights.items():
        if name.endswith(".bias"):  # qwen2's q/k/v biases: never quantized
            out[_rename(name, arch)] = _float(value, dequantize)
            continue
        if not name.endswith(".weight"):
            continue
        prefix = name[: -len(".weight")]
        new_prefix = _rename(name, arch)[: -len(".weight")]
        scales = weights.get(f"{prefix}.scales")
        if scales is None:
            if arch.norm_offset and prefix.endswith("norm"):
                # llama.cpp stored Gemma's RMSNorm weights as 1 + w
                value = (value.astype(mx.float32) - arch.norm_offset).astype(value.dtype)
            keep = arch.float32_activations and prefix.endswith("norm")
            out[f"{new_prefix}.weight"] = _float(value, dequantize, keep_float32=keep)
            continue
        biases = weights[f"{prefix}.biases"]
        in_dims = scales.shape[-1] * _GROUP_SIZE
        bits = value.shape[-1] * 32 // in_dims
        if dequantize:
            out[f"{new_prefix}.weight"] = mx.dequantize(
                value, scales, biases, group_size=_GROUP_SIZE, bits=bits
            ).astype(mx.float32)
        else:
            quantized_bits.add(bits)
            out[f"{new_prefix}.weight"] = value
            out[f"{new_prefix}.scales"] = scales
            out[f"{new_prefix}.biases"] = biases
    quant = None
    if quantized_bits:
        # Per-layer bits (8-bit embeddings, 4-bit blocks) are inferred by mlx-lm
        # from each tensor's shape; the top-level value is only the default.
        quant = {"group_size": _GROUP_SIZE, "bits": max(quantized_bits)}
    return out, quant


def _float(value: mx.array, dequantize: bool, keep_float32: bool = False) -> mx.array:
    """An unquantized tensor: float32 beside dequantized weights; float16 beside
    quantized ones, as their scales are (a float32 norm weight made every
    activation after it, and the KV cache, float32: twice the KV fit priced),
    unless ``keep_float32`` (GGUFArch.float32_activations)."""
    if dequantize:
        return value.astype(mx.float32)
    if value.dtype == mx.float32 and not keep_float32:
        return value.astype(mx.float16)
    return value


def converted_dir(gguf: Path, dequantize: bool) -> Path:
    """Keyed by content and converter version, not path: every checkout (or copy)
    of the same file shares one converted folder."""
    digest = content_digest(gguf, cache_root() / "models" / ".gguf-digests.json")
    key = f"{digest}|{_CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    flavour = "f32" if dequantize else "q"
    return cache_root() / "models" / f"{gguf.stem}-{flavour}-{digest}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_abandoned(target: Path) -> None:
    """Delete half-written conversions of ``target`` whose process is gone (a
    kill -9 mid-conversion leaves one behind; a concurrent one is still alive)."""
    for tmp in target.parent.glob(f".{target.name}-*"):
        pid = tmp.name[len(target.name) + 2 :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by an interrupted conversion", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(
    gguf: Path,
    dequantize: bool,
    progress: Callable[[str], None] = log.info,
) -> Path:
    """Return an mlx-lm model directory for ``gguf``, converting it once."""
    target = converted_dir(gguf, dequantize)
    if (target / "config.json").exists():
        return target
    kind = "float32" if dequantize else "quantized"
    progress(f"converting {gguf.name} to an MLX {kind} model in {target} (once)")
    try:
        weights, meta = mx.load(str(gguf), return_metadata=True)
    except Exception as exc:  # mx.load raises bare RuntimeError/ValueError
        raise UnsupportedModelError(
            f"cannot read GGUF file {gguf}: {exc} (MLX reads {READABLE_NAMES} tensors)"
        ) from exc
    split = split_file(_scalar(meta, "split.count"))
    if split is not None:
        raise UnsupportedModelError(f"{gguf}: {split}")
    try:
        config = model_config(meta, weights)
        config.update(_rope_scaling(weights, config))
        files = _tokenizer_files(meta, config["max_position_embeddings"])
    except UnsupportedModelError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # a key missing, or of the wrong kind
        raise UnsupportedModelError(f"{gguf}: GGUF metadata lacks what it needs: {exc!r}") from exc
    converted, quant = _convert_weights(weights, dequantize, arch_of(architecture(meta)))
    if quant:
        config["quantization"] = quant
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-{os.getpid()}-", dir=target.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), converted, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, ensure_ascii=False))
        try:
            tmp.rename(target)
        except OSError as exc:  # another process finished first, or a broken folder is there
            shutil.rmtree(tmp, ignore_errors=True)
            if not (target / "config.json").exists():
                raise UnsupportedModelError(
                    f"cannot put the converted model at {target}: {exc.strerror or exc} "
                    "(delete that folder and start again)"
                ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(v.nbytes for v in converted.values())
    progress(f"converted {gguf.name}: {len(converted)} tensors, {nbytes / 2**20:.0f} MiB")
    return target
