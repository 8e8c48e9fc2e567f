"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

``mx.load`` reads GGUF tensors (Q4_0/Q4_1/Q8_0 arrive already in MLX's affine
quantized layout) and the tokenizer metadata. What no library does is the last
mile: rename tensors to mlx-lm's llama names, write ``config.json``, and rebuild
a Hugging Face ``tokenizer.json`` from the GGUF vocabulary and merges so that
``mlx_lm.load`` can open the directory like any other model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.model_errors import UnsupportedModelError

log = logging.getLogger("kvwarm.engine.gguf")

# GGUF tensor name -> mlx-lm llama parameter name
_BLOCK_RENAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_RENAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GROUP_SIZE = 32  # every GGUF block quantisation mx.load understands uses 32
_CONVERTER_VERSION = "1"

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _rename(name: str) -> str:
    base, _, suffix = name.rpartition(".")  # suffix: weight / scales / biases
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match:
        layer, part = match.groups()
        if part not in _BLOCK_RENAMES:
            raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_BLOCK_RENAMES[part]}.{suffix}"
    if base not in _TOP_RENAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    return f"{_TOP_RENAMES[base]}.{suffix}"


def _llama_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; only 'llama' GGUF files are"
        )
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        # GGUF stores q/k permuted for interleaved RoPE.
        "rope_traditional": True,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length", 2048)),
        "vocab_size": int(_scalar(meta, "llama.vocab_size", 0))
        or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    return config


def _tokenizer_files(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """Build tokenizer.json / tokenizer_config.json from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit, then GPT-2's regex.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_ in zip(tokens, types)
        if kind_ in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_special_tokens(special)

    def token(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
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
    generation = {
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    return {
        "tokenizer.json": json.loads(tokenizer.to_str()),
        "tokenizer_config.json": config,
        "generation_config.json": generation,
    }


def _convert_weights(
    weights: dict[str, mx.array], dequantize: bool
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    out: dict[str, mx.array] = {}
    quantized_bits: set[int] = set()
    for name, value in weights.items():
        if not name.endswith(".weight"):
            continue
        prefix = name[: -len(".weight")]
        new_prefix = _rename(name)[: -len(".weight")]
        scales = weights.get(f"{prefix}.scales")
        if scales is None:
            out[f"{new_prefix}.weight"] = value.astype(mx.float32) if dequantize else value
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


def cache_root() -> Path:
    if env := os.environ.get("KVWARM_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvwarm"


def converted_dir(gguf: Path, dequantize: bool) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{_CONVERTER_VERSION}"
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
        raise UnsupportedModelError(f"cannot read GGUF file {gguf}: {exc}") from exc
    config = _llama_config(meta, weights)
    files = _tokenizer_files(meta, config["max_position_embeddings"])
    converted, quant = _convert_weights(weights, dequantize)
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
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(v.nbytes for v in converted.values())
    progress(f"converted {gguf.name}: {len(converted)} tensors, {nbytes / 2**20:.0f} MiB")
    return target
