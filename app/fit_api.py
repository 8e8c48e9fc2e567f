"""GET /fit (the loaded model on this machine) and GET /library (every model found).

Both use scheduler.fit: /fit assesses the budget admission really enforces;
/library assesses each model found on disk against this machine's memory the
way engine.boot would budget it. The predicted decode rate is the bandwidth
bound; /fit shows the rate this server measured beside it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from app.machine import machine_facts
from app.model_library import ModelLibrary, NotAModel, dir_facts, gguf_facts, real_path
from app.openapi_doc import OPENAI_ERROR, errors, json_content
from app.state import AppState
from scheduler.contracts import ModelInfo
from scheduler.fit import (
    TYPICAL_CONTEXT,
    MachineFacts,
    ModelFacts,
    NotAssessable,
    apple_matrix,
    as_loaded,
    assess,
    assess_budget,
)
from scheduler.step_timings import StepReport

router = APIRouter()
OBJECT = {"type": "object"}
LIST = {"type": "object", "required": ["object", "data"], "properties": {"data": {"type": "array"}}}


def _responses(ok: dict[str, Any]) -> dict[int | str, Any]:
    return {
        200: {"description": "Done.", "content": json_content(ok)},
        **errors(OPENAI_ERROR, [503]),
    }


def _machine(info: ModelInfo) -> MachineFacts:
    return machine_facts(info.bandwidth_bytes_s, info.device)


def measured_decode(report: StepReport | None, context: int) -> float | None:
    """Batch-1 decode tok/s at ``context`` from the engine's learned step costs
    (None until it has timed enough decode steps)."""
    cost = report.cost if report else None
    if cost is None or cost.decode_samples < 8:
        return None
    ms = (
        cost.decode_base_ms
        + cost.decode_per_row_ms
        + cost.decode_per_row_per_1k_positions_ms * context / 1000
    )
    return 1000.0 / ms if ms > 0 else None


def fit_view(state: AppState) -> dict[str, Any]:
    info = state.model_info()
    machine = _machine(info)
    facts: ModelFacts | None
    try:
        facts = dir_facts(Path(info.path))
    except (NotAModel, OSError, ValueError, KeyError):
        facts = None
    budget = info.budget
    active = None
    if facts is not None and facts.params:
        active = round(budget.weights_bytes * facts.active_params / facts.params)
    typical = min(TYPICAL_CONTEXT, info.context_length)
    assessment = assess_budget(budget, info.context_length, active, machine.bandwidth_bytes_s)
    predicted = assessment.predicted_decode_tok_s
    measured = measured_decode(state.engine.engine_stats().steps_report, typical)
    return {
        "machine": machine.public(),
        "model": {
            "id": info.model_id,
            "path": info.path,
            "context_length": info.context_length,
            "weights_bytes": budget.weights_bytes,
            "adapter_bytes": budget.adapter_bytes,
            "kv_bytes_per_token": budget.kv_bytes_per_token,
            "transient_reserve_bytes": budget.reserve_bytes,
            "params": facts.params if facts else None,
            "active_params": facts.active_params if facts else None,
        },
        "admission": {**assessment.public(), "budget_source": budget.source},
        "decode": {
            "at_context": typical,
            "predicted_tok_s": round(predicted, 1) if predicted else None,
            "predicted_from": "memory bandwidth / (active weights + KV at the context)",
            "measured_tok_s": round(measured, 1) if measured else None,
            "measured_from": "this engine's decode step times (learned cost model), one row",
            "measured_over_predicted": round(measured / predicted, 2)
            if measured and predicted
            else None,
            "per_stream_tok_s": _round(state.obs.metrics.decode_rate()),
        },
        "apple_matrix": apple_matrix(_as_shipped(info.source_path) or facts) if facts else [],
    }


def _as_shipped(source_path: str) -> ModelFacts | None:
    """A GGUF's own facts: the folder it was converted into holds what the CPU
    backend runs (float32), not what a Mac would load (apple_matrix prices that).
    Set for GGUF sources only: a hub cache's is a blob with no .gguf suffix."""
    if not source_path:
        return None
    try:
        return gguf_facts(Path(source_path))
    except (NotAModel, OSError):
        return None


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def listed_entry(facts: ModelFacts, machine: MachineFacts, budget_bytes: int) -> dict[str, Any]:
    """``library_entry``, or the model as unsupported with why: one config's odd
    values must not take the whole listing (every other model) down with it."""
    try:
        return library_entry(facts, machine, budget_bytes)
    except NotAssessable as exc:  # what serve would refuse says so first
        why = facts.why_unsupported or f"could not be assessed: {exc}"
        return {"id": facts.name, "path": facts.path, "supported": False, "why_unsupported": why}
    except Exception as exc:  # noqa: BLE001 - a config nothing else checked
        return {
            "id": facts.name,
            "path": facts.path,
            "supported": False,
            "why_unsupported": f"could not be assessed: {type(exc).__name__}: {exc}",
        }


def library_entry(facts: ModelFacts, machine: MachineFacts, budget_bytes: int) -> dict[str, Any]:
    loaded = as_loaded(facts, machine.device)
    a = assess(loaded, budget_bytes, machine.bandwidth_bytes_s)
    return {
        "id": facts.name,
        "path": facts.path,
        "type": facts.model_type,
        "format": facts.kind,
        "size_bytes": facts.weights_bytes,
        "params": facts.params,
        "active_params": facts.active_params,
        "quant_bits": facts.quant_bits,
        "context_length": facts.context_length,
        "loaded_bytes": loaded.weights_bytes,
        "vision": facts.vision,
        "supported": facts.supported,
        "why_unsupported": facts.why_unsupported or None,
        "fit": a.public(),
    }


def library_view(state: AppState, library: ModelLibrary) -> dict[str, Any]:
    info = state.model_info()
    machine = _machine(info)
    # a GGUF served is listed as its file, not as the folder it was converted into
    serving = {real_path(Path(p)) for p in (info.path, info.source_path) if p}
    data = []
    for found in library.scan():
        if isinstance(found, tuple):
            name, path, why = found
            data.append({"id": name, "path": path, "supported": False, "why_unsupported": why})
            continue
        entry = listed_entry(found, machine, info.budget.total_bytes)
        entry["serving"] = real_path(Path(found.path)) in serving
        data.append(entry)
    return {"object": "list", "machine": machine.public(), "data": data}


@router.get("/fit", responses=_responses(OBJECT))
async def fit(http: HTTPRequest) -> dict[str, Any]:
    state: AppState = http.app.state.kvwarm
    return await asyncio.to_thread(fit_view, state)  # reads files: off the event loop


@router.get("/library", responses=_responses(LIST))
async def library(http: HTTPRequest) -> dict[str, Any]:
    state: AppState = http.app.state.kvwarm
    lib = getattr(http.app.state, "library", None)
    if lib is None:
        lib = http.app.state.library = ModelLibrary(state.settings.model_dirs)
    return await asyncio.to_thread(library_view, state, lib)
