"""`kvwarm fit` as a person runs it: a table or JSON, without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KVWARM = str(Path(sys.executable).with_name("kvwarm"))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KVWARM, "fit", "--log-level", "warning", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fit_prints_a_table_and_json_for_a_model_dir(tiny_llama_dir):
    out = run(str(tiny_llama_dir), "--matrix")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("machine: ") and "GB/s" in lines[0]
    assert lines[1].split()[:3] == ["model", "type", "size"]
    assert any(line.startswith(tiny_llama_dir.name) and " fits " in line for line in lines)
    assert "on Apple memory sizes: 8GB fits" in out.stdout
    assert "Metal's working set, estimate: 2/3 of the memory up to 36 GB" in out.stdout
    doc = json.loads(run(str(tiny_llama_dir), "--json").stdout)
    (entry,) = doc["data"]
    assert entry["type"] == "llama" and entry["params"] > 0
    assert entry["fit"]["max_context"] == 4096 or entry["fit"]["max_context"] > 0
    assert doc["machine"]["bandwidth_bytes_s"] > 0


def test_fit_says_what_it_cannot_read(tmp_path):
    out = run(str(tmp_path / "missing"))
    assert out.returncode == 1
    assert "neither a model directory nor a .gguf file" in out.stdout
