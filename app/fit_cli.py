"""`kvwarm fit [MODEL ...]`: the /library assessment as a table, no server.

Measures the decode bandwidth once on the device MLX runs on (unless the chip's
is published), budgets each model the way `kvwarm serve --memory-budget auto`
would on this machine, and prints size, context, verdict and the predicted
decode rate; ``--matrix`` adds which Apple memory sizes run each model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.fit_api import listed_entry
from app.machine import machine_facts
from app.model_library import Found, ModelLibrary, read_entry
from scheduler.fit import WORKING_SET_FROM, apple_matrix


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} PB"


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def gather(models: list[str], folders: list[Path]) -> list[Found]:
    if not models:
        return ModelLibrary(folders).scan()
    return [_read(m) for m in models]


def _read(model: str) -> Found:
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # "~name" of a user this machine does not have
        return (model, model, "no such home directory")
    return read_entry(path)


def table(entries: list[dict[str, Any]]) -> str:
    head = ("model", "type", "size", "params", "quant", "context", "fits", "max ctx", "tok/s")
    rows = [head]
    for e in entries:
        if "fit" not in e:
            rows.append((e["id"], "-", "-", "-", "-", "-", "unreadable", "-", "-"))
            continue
        fit = e["fit"]
        verdict = fit["verdict"] if e["supported"] else "unsupported"
        rate = fit.get("predicted_decode_tok_s")
        rows.append(
            (
                e["id"],
                f"{e['type']} ({e['format']})",
                _size(e["size_bytes"])
                + (
                    f" ({_size(e['loaded_bytes'])} loaded)"
                    if e["loaded_bytes"] != e["size_bytes"]
                    else ""
                ),
                _params(e["params"]) if e["params"] else "-",
                f"{e['quant_bits']}-bit" if e["quant_bits"] else "float",
                str(e["context_length"]),
                verdict,
                str(fit["max_context"]),
                f"{rate:.1f}" if rate else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_fit(models: list[str], folders: list[Path], as_json: bool, matrix: bool) -> int:
    """Prints the table (or JSON); mlx is imported here, after the BLAS preload."""
    import mlx.core as mx

    from engine.device_memory import auto_budget, measure_bandwidth

    machine = machine_facts(measure_bandwidth(), str(mx.default_device()))
    budget = auto_budget()
    found = gather(models, folders)
    entries = []
    for item in found:
        if isinstance(item, tuple):
            entries.append({"id": item[0], "path": item[1], "why_unsupported": item[2]})
            continue
        entry = listed_entry(item, machine, budget.total_bytes)
        if matrix and "fit" in entry:  # assessed: its matrix is the same arithmetic
            entry["apple_matrix"] = apple_matrix(item)
        entries.append(entry)
    if as_json:
        print(
            json.dumps(
                {"machine": machine.public(), "budget_bytes": budget.total_bytes, "data": entries},
                indent=2,
            )
        )
        return 0 if entries and all("fit" in e for e in entries) else 1
    print(
        f"machine: {machine.name}, {_size(machine.memory_bytes)} memory, budget "
        f"{_size(budget.total_bytes)} ({budget.source}), decode bandwidth "
        f"{machine.bandwidth_bytes_s / 1e9:.1f} GB/s ({machine.bandwidth_source})"
    )
    if not entries:
        print("no models found (pass paths, or --model-dir DIR)")
        return 1
    print(table(entries))
    print("tok/s: predicted batch-1 decode at 4k context (bandwidth bound)")
    for e in entries:
        if e.get("why_unsupported"):
            print(f"  {e['id']}: {e['why_unsupported']}")
        if matrix and "apple_matrix" in e:
            cells = ", ".join(
                f"{r['memory_gb']}GB {r['verdict']}"
                + (f" {r['max_context'] // 1024}k" if r["verdict"] != "no" else "")
                for r in e["apple_matrix"]
            )
            print(f"  {e['id']} on Apple memory sizes: {cells}")
    if matrix:  # the budgets are not measured: no Mac is at hand
        print(f"Apple memory sizes: budget = Metal's working set, {WORKING_SET_FROM}")
    return 0 if all("fit" in e for e in entries) else 1
