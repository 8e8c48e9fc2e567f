"""Will a model fit this machine, how much context, and how fast will it decode?

One model of memory and speed, shared by admission and the /fit, /library and
``kvwarm fit`` views. Memory is admission's own ``MemoryBudget`` (weights, the
transient reserve, KV per token): the ceiling a view predicts is the ceiling
the server enforces. Speed is the bandwidth bound of decoding: every generated
token streams the active weights (all of them for a dense model, the routed
experts' share for a mixture of experts) and the sequence's KV once, so

    tokens/s per stream ~= memory bandwidth / (active weight bytes + KV bytes at the context)

which holds for batch-1 decode on Apple silicon and GPUs; a CPU with a slow
matmul falls short of it (the views show the measured rate beside it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvcache.entries import PromptCacheConfig
from kvcache.layout import KVLayout
from scheduler.admission import MemoryBudget, plan_budget

GiB = 2**30
# unified memory sizes Apple ships (GB), for the "which Mac runs it" matrix
APPLE_MEMORY_GB = (8, 16, 18, 24, 32, 36, 48, 64, 96, 128, 192, 256, 512)
# Metal's recommended working set (recommendedMaxWorkingSetSize), an estimate: about
# 2/3 of a Mac's memory in GiB up to 36 GB and 3/4 above (recent macOS gives 128 GB+
# Macs more; 3/4 is the conservative figure). A Mac's "16 GB" is 16 GiB.
SMALL_MAC_GB = 36
WORKING_SET_FROM = "estimate: 2/3 of the memory up to 36 GB, 3/4 above (Metal's recommended)"
TYPICAL_CONTEXT = 4096  # the context the predicted decode rate is quoted at
PREFILL_CHUNK = 512  # --prefill-step-size's default: sizes the transient reserve
COMFORTABLE_CONTEXT = 8192  # below this ceiling an agent's context runs tight


class NotAssessable(ValueError):
    """A model whose KV cost could not be read from its config (layers, heads or
    widths under names nothing here knows): priced at nothing, any memory would
    seem to hold millions of its sequences."""


@dataclass(frozen=True)
class ModelFacts:
    """What a model costs, read from its config and weight-file headers only."""

    name: str
    path: str
    kind: str  # "mlx" (a directory mlx-lm loads) or "gguf"
    model_type: str
    weights_bytes: int
    params: int  # parameters, from the tensor shapes (packed quantized weights unpacked)
    active_params: int  # per generated token (a mixture of experts routes to a few)
    kv_bytes_per_token: int
    context_length: int
    num_heads: int
    quant_bits: int | None = None  # None: not quantized
    vision: bool = False
    supported: bool = True
    why_unsupported: str = ""
    # a GGUF as mx.load reads it on Metal/CUDA (Q4_0/Q4_1/Q8_0 stay quantized, the
    # K-quants become float16); 0: not a GGUF
    gpu_weights_bytes: int = 0
    # per layer, where some keep a sliding window only (Gemma 3, gpt-oss): their KV
    # stops growing at the window; None: every attention layer grows with the context
    layout: KVLayout | None = None
    # bytes per cached key/value element the KV above is priced at (a GGUF's width
    # beside its weights: float32 for Gemma and Gemma 2, float16 otherwise)
    kv_value_bytes: int = 2

    @property
    def priced(self) -> bool:
        """Its sequences cost something: KV per token, or (a state-space model) a state."""
        return self.kv_bytes_per_token > 0 or (
            self.layout is not None and self.layout.sequence_bytes(1) > 0
        )

    @property
    def active_weight_bytes(self) -> int:
        if not self.params:
            return self.weights_bytes
        return round(self.weights_bytes * self.active_params / self.params)


@dataclass(frozen=True)
class MachineFacts:
    """The machine a model would run on."""

    name: str  # chip or CPU model
    memory_bytes: int  # unified memory / RAM / device memory
    bandwidth_bytes_s: float  # memory bandwidth
    bandwidth_source: str  # "measured (copy benchmark)" or "known for <chip>"
    device: str = "cpu"  # cpu / gpu (Metal, CUDA)

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        out["bandwidth_gb_s"] = round(self.bandwidth_bytes_s / 1e9, 1)
        return out


@dataclass(frozen=True)
class Assessment:
    """A model on a memory budget: does it fit, how much context, how fast."""

    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    ceiling_tokens: int  # the most KV positions admission gives one request
    max_context: int  # min(ceiling, the model's context length)
    sequences_at_typical: int  # requests of TYPICAL_CONTEXT positions that fit at once
    verdict: str  # fits / tight / no
    predicted_decode_tok_s: float | None = None  # per stream at TYPICAL_CONTEXT
    notes: tuple[str, ...] = field(default=())

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        if self.predicted_decode_tok_s is not None:
            out["predicted_decode_tok_s"] = round(self.predicted_decode_tok_s, 1)
        return out


def as_loaded(model: ModelFacts, device: str) -> ModelFacts:
    """What the model costs once loaded on ``device``. On the CPU backend a GGUF
    is dequantised to float32 (engine.loader.prefers_float32: BLAS makes it ~10x
    faster there than the quantised form), weights and KV at 4 bytes; on Metal and
    CUDA it costs what mx.load makes of it (K-quants become float16)."""
    if model.kind != "gguf" or not model.params:
        return model
    if "cpu" not in device.lower():
        return replace(model, weights_bytes=model.gpu_weights_bytes or model.weights_bytes)
    # float32 KV, from whatever width it was priced at (Gemma's is float32 already)
    width = max(1, model.kv_value_bytes)
    return replace(
        model,
        weights_bytes=model.params * 4,
        kv_bytes_per_token=model.kv_bytes_per_token * 4 // width,
        layout=_rescaled(model.layout, 4, width),
        kv_value_bytes=4,
        quant_bits=None,
    )


def _rescaled(layout: KVLayout | None, to: int, width: int) -> KVLayout | None:
    """``layout`` with each value ``to`` bytes wide instead of ``width``."""
    if layout is None:
        return None
    layers = tuple(
        replace(
            la,
            bytes_per_token=la.bytes_per_token * to // width,
            state_bytes=la.state_bytes * to // width,
        )
        for la in layout.layers
    )
    return replace(layout, layers=layers)


def predicted_decode_tok_s(
    active_weight_bytes: int, kv_bytes_per_token: int, context: int, bandwidth_bytes_s: float
) -> float:
    """The bandwidth bound of one stream's decode at ``context`` positions."""
    per_token = active_weight_bytes + kv_bytes_per_token * context
    return bandwidth_bytes_s / per_token if per_token > 0 else 0.0


def assess_budget(
    budget: MemoryBudget,
    context_length: int,
    active_weight_bytes: int | None = None,
    bandwidth_bytes_s: float | None = None,
) -> Assessment:
    """The verdict for a budget admission already uses (the loaded model)."""
    ceiling = budget.ceiling_tokens
    max_context = min(ceiling, context_length)
    typical = max(1, min(TYPICAL_CONTEXT, context_length))  # a config may say 0
    per_seq = budget.sequence_bytes(typical)
    sequences = budget.kv_budget_bytes // per_seq if per_seq and ceiling >= typical else 0
    if budget.kv_budget_bytes <= 0 or ceiling == 0:
        verdict = "no"
    elif max_context < min(COMFORTABLE_CONTEXT, context_length):
        verdict = "tight"
    else:
        verdict = "fits"
    rate = None
    if bandwidth_bytes_s:
        weights = budget.weights_bytes if active_weight_bytes is None else active_weight_bytes
        # what one token's decode streams of the KV at that context (windows stop)
        per_token = (
            budget.layout.sequence_bytes(typical) // typical
            if budget.layout is not None
            else budget.kv_bytes_per_token
        )
        rate = predicted_decode_tok_s(weights, per_token, typical, bandwidth_bytes_s)
    notes = []
    if verdict == "no":
        need = budget.weights_bytes + budget.adapter_bytes + budget.reserve_bytes
        notes.append(
            f"weights + reserve need {need / GiB:.1f} GiB of {budget.total_bytes / GiB:.1f}"
        )
    elif verdict == "tight":
        notes.append(f"at most {max_context} tokens of context per request")
    return Assessment(
        budget_bytes=budget.total_bytes,
        weights_bytes=budget.weights_bytes,
        reserve_bytes=budget.reserve_bytes,
        kv_budget_bytes=budget.kv_budget_bytes,
        kv_bytes_per_token=budget.kv_bytes_per_token,
        ceiling_tokens=ceiling,
        max_context=max_context,
        sequences_at_typical=int(sequences),
        verdict=verdict,
        predicted_decode_tok_s=rate,
        notes=tuple(notes),
    )


def budget_for(model: ModelFacts, budget_bytes: int) -> MemoryBudget:
    """The MemoryBudget ``kvwarm serve`` would enforce for ``model`` on
    ``budget_bytes`` with its defaults (admission.plan_budget, as engine.boot
    calls it: 512-token prefill chunks, the prompt cache's automatic share)."""
    if not model.priced:
        raise NotAssessable(
            f"no KV cost per token could be read from its config ({model.model_type}: "
            "layers, heads or width under names kvwarm does not know)"
        )
    return plan_budget(
        budget_bytes,
        model.weights_bytes,
        model.kv_bytes_per_token,
        model.context_length,
        model.num_heads,
        PREFILL_CHUNK,
        source="fit",
        layout=model.layout,
        prompt_cache=PromptCacheConfig().resolve_bytes,
    )


def assess(model: ModelFacts, budget_bytes: int, bandwidth_bytes_s: float | None) -> Assessment:
    return assess_budget(
        budget_for(model, budget_bytes),
        model.context_length,
        model.active_weight_bytes,
        bandwidth_bytes_s,
    )


def metal_working_set(memory_gb: int) -> int:
    """The budget ``--memory-budget auto`` would likely get on a Mac of ``memory_gb``."""
    memory = memory_gb * GiB
    return memory * 2 // 3 if memory_gb <= SMALL_MAC_GB else memory * 3 // 4


def apple_matrix(model: ModelFacts) -> list[dict[str, Any]]:
    """Which Macs run it: per unified-memory size, the verdict and the context."""
    if not model.priced:
        return []  # nothing to say about any Mac (see NotAssessable)
    rows = []
    loaded = as_loaded(model, "gpu")  # Metal: a GGUF as mx.load reads it there
    for gb in APPLE_MEMORY_GB:
        working_set = metal_working_set(gb)
        a = assess(loaded, working_set, None)
        rows.append(
            {
                "memory_gb": gb,
                "working_set_bytes": working_set,
                "working_set_from": WORKING_SET_FROM,
                "verdict": a.verdict,
                "max_context": a.max_context,
                "sequences_at_4k": a.sequences_at_typical,
            }
        )
    return rows
