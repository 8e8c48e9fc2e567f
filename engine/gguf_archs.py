"""What each GGUF architecture needs to become an mlx-lm model directory.

The GGUF keys every decoder shares (layers, heads, sizes, rope base, norm eps)
are renamed with transformers' own table (``GGUF_CONFIG_MAPPING``); what is
left per architecture is what llama.cpp's converter did to the checkpoint and
must be undone, and the config fields mlx-lm's model class wants:

- **llama**: q/k rows permuted for interleaved RoPE -> ``rope_traditional``.
- **qwen2**: q/k/v biases; NEOX RoPE (no permutation).
- **qwen3**: per-head q/k RMSNorms (``attn_q_norm``/``attn_k_norm``).
- **gemma, gemma2, gemma3**: every RMSNorm weight stored as ``1 + w`` (the
  models compute ``x * (1 + w)``) -> 1 is subtracted back; gemma2/3 add norms
  after attention and around the MLP; gemma2 soft-caps logits; gemma3 (text)
  alternates five sliding-window layers with one global layer. llama.cpp does
  not store ``query_pre_attn_scalar``; it derives the attention scale from the
  model size, and so do we.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.model_errors import UnsupportedModelError

Meta = Callable[[str, Any], Any]  # (key without the arch prefix, default) -> value

COMMON_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
LLAMA_BLOCK = {**COMMON_BLOCK, "ffn_norm": "post_attention_layernorm"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA2_BLOCK = {
    **COMMON_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF ``general.architecture`` as mlx-lm serves it."""

    model_type: str  # mlx-lm's module
    block: dict[str, str]  # GGUF block tensor -> mlx-lm module path in the layer
    rope_traditional: bool = False
    norm_offset: float = 0.0  # subtracted from every *norm weight (gemma: 1)
    # norms kept float32 beside quantized weights, so activations and KV are too:
    # Gemma and Gemma 2 overflow float16 in their residual stream (mlx-lm clips it
    # for Gemma 3 alone)
    float32_activations: bool = False
    # extra config fields from the metadata: (meta, config so far) -> fields
    extra: Callable[[Meta, dict[str, Any]], dict[str, Any]] = field(default=lambda m, c: {})


def _gemma_scale(meta: Meta, config: dict[str, Any], big_layers: int) -> int:
    """llama.cpp's attention scale for Gemma 2/3: 1/sqrt(hidden/heads) for the
    27B shape, 1/sqrt(head_dim) otherwise (HF's query_pre_attn_scalar, an int)."""
    if config["num_hidden_layers"] == big_layers:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "attn_logit_softcapping": float(meta("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _gemma_scale(meta, config, 46),
    }


def _gemma3(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "query_pre_attn_scalar": _gemma_scale(meta, config, 62),
        "sliding_window": int(meta("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,  # what llama.cpp and HF use for every Gemma 3 size
        "rope_local_base_freq": 10000.0,
    }
    kind = meta("rope.scaling.type", None)
    if kind == "linear":
        extra["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(meta("rope.scaling.factor", 1.0)),
        }
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF gemma3 rope scaling {kind!r} is not supported")
    return extra


def _no_rope_scaling(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    kind = meta("rope.scaling.type", None)
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    return {}


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", LLAMA_BLOCK, rope_traditional=True, extra=_no_rope_scaling),
    "qwen2": GGUFArch("qwen2", LLAMA_BLOCK, extra=_no_rope_scaling),
    "qwen3": GGUFArch("qwen3", {**LLAMA_BLOCK, **QK_NORMS}, extra=_no_rope_scaling),
    "gemma": GGUFArch("gemma", LLAMA_BLOCK, norm_offset=1.0, float32_activations=True),
    "gemma2": GGUFArch(
        "gemma2", GEMMA2_BLOCK, norm_offset=1.0, extra=_gemma2, float32_activations=True
    ),
    "gemma3": GGUFArch("gemma3_text", {**GEMMA2_BLOCK, **QK_NORMS}, norm_offset=1.0, extra=_gemma3),
}


# tensor types: what MLX's GGUF loader (mx.load) reads is kept, Q4_0/Q4_1/Q8_0
# quantized and the rest as float16; any other type fails the whole load
GGML_TYPES = {
    **{0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1"},
    **{10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K"},
    **{16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S"},
    **{22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"},
    **{29: "IQ1_M", 30: "BF16"},
}
READABLE_TYPES = frozenset({0, 1, 2, 3, 8, 10, 12, 14, 30})
READABLE_NAMES = "F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q2_K, Q4_K and Q6_K"
# llama.cpp writes Llama 3.1+'s rope scaling as this tensor: each rotary pair's
# period factor, computed from the config's llama3 rope_scaling (factor, low and
# high frequency factors, original context), which the file does not keep
ROPE_FREQS = "rope_freqs"
ROPE_FREQS_WHY = (
    "its rope_freqs tensor is no Llama 3.1+ rope scaling kvwarm recognises: serve the "
    "model's MLX version (e.g. from mlx-community) instead"
)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_CONTEXT = 8192  # llama.cpp's converter reads no other original context


def llama3_factors(scaling: dict[str, float], base: float, dims: int) -> list[float]:
    """The factors llama.cpp's converter writes for a llama3 ``rope_scaling``."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_scaling(factors: list[float], base: float, dims: int) -> dict[str, Any]:
    """The ``rope_scaling`` whose factors are ``factors`` (Llama 3.1: 8, 3.2: 32,
    the rest as every release has them); UnsupportedModelError when none is."""
    scaling: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": max(factors) if factors else 1.0,
        **LLAMA3_ROPE,
        "original_max_position_embeddings": LLAMA3_CONTEXT,
    }
    want = llama3_factors(scaling, base, dims)
    if len(want) != len(factors) or any(
        abs(w - f) > 1e-3 * max(1.0, abs(w)) for w, f in zip(want, factors)
    ):
        raise UnsupportedModelError(ROPE_FREQS_WHY)
    return scaling


MOE_WHY = "mixture-of-experts GGUFs are not converted: serve the MLX version of this model"
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)")


def tensor_problem(name: str, arch: GGUFArch) -> str | None:
    """Why the converter has no mlx-lm name for this GGUF tensor, or None. Only
    weights and biases are renamed; a llama's rope_freqs is taken out first."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    match = BLOCK_TENSOR.fullmatch(base)
    if match:
        part = match.group(2)
        # Mixtral and kin under the llama architecture: routed experts and their
        # router (ffn_*_exps, ffn_gate_inp), shared experts (ffn_*_shexp)
        if part.startswith("ffn_gate_inp") or part.endswith(("_exps", "_shexp")):
            return MOE_WHY
        if part not in arch.block:
            return f"unexpected GGUF tensor {name!r} for {arch.model_type}"
        return None
    if base == ROPE_FREQS:
        return None if arch.model_type == "llama" else ROPE_FREQS_WHY
    if base not in TOP:
        return f"unexpected GGUF tensor {name!r}"
    return None


def unreadable_types(types: set[int]) -> str | None:
    """Why MLX cannot load tensors of these types, or None when it can."""
    bad = sorted(types - READABLE_TYPES)
    if not bad:
        return None
    names = ", ".join(GGML_TYPES.get(t, f"type {t}") for t in bad)
    return (
        f"its {names} tensors are not read by MLX's GGUF loader (it reads {READABLE_NAMES}): "
        "use another quantization of the model (Q4_K_M, Q6_K, Q8_0, ...)"
    )


def split_file(count: object) -> str | None:
    """Why a shard of a split GGUF (its ``split.count``) is not served alone."""
    if isinstance(count, int) and count > 1:
        return (
            f"one of a split GGUF's {count} files: join them first "
            "(llama-gguf-split --merge FIRST-FILE OUT.gguf) and serve the result"
        )
    return None


def arch_of(name: object) -> GGUFArch:
    arch = ARCHS.get(str(name))
    if arch is None:
        raise UnsupportedModelError(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(sorted(ARCHS))}"
        )
    return arch


def base_config(name: str, meta: Meta) -> dict[str, Any]:
    """The fields every decoder shares, through transformers' GGUF key table."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    # transformers names gemma's keys like gemma2's, and has no table for gemma (v1)
    table = GGUF_CONFIG_MAPPING.get(name) or GGUF_CONFIG_MAPPING["gemma2"]
    config: dict[str, Any] = {}
    for key, hf_name in table.items():
        value = meta(key, None)
        if hf_name and value is not None:
            config[hf_name] = value
    return config
