"""A model whose KV cost per token cannot be read from its config is reported
as not assessed: priced at one byte a token, it "fit" with millions of sequences."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from app.fit_api import listed_entry
from app.model_library import dir_facts
from scheduler.fit import MachineFacts, NotAssessable, apple_matrix, assess

GB = 10**9
MACHINE = MachineFacts("cpu", 64 * GB, 100e9, "known")


def write_model(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    raw = json.dumps({"w": {"dtype": "BF16", "shape": [1024], "data_offsets": [0, 2048]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 2048)
    return path


def test_olmo1_names_are_read_from_the_header(tmp_path):
    """OLMo 1 (mlx-lm's olmo): d_model, n_layers, n_heads, max_sequence_length."""
    olmo = dict(
        model_type="olmo", d_model=4096, n_layers=32, n_heads=32, max_sequence_length=2048
    )  # fmt: skip
    facts = dir_facts(write_model(tmp_path / "olmo", olmo))
    assert facts.kv_bytes_per_token == 32 * 32 * 128 * 2 * 2
    assert (facts.num_heads, facts.context_length) == (32, 2048)


def test_a_model_with_attention_and_no_readable_kv_is_not_assessed(tmp_path):
    odd = dict(model_type="llama", depth=32, attention_heads=32, width=4096)
    facts = dir_facts(write_model(tmp_path / "odd", odd))
    assert facts.kv_bytes_per_token == 0
    with pytest.raises(NotAssessable):
        assess(facts, 16 * GB, None)
    entry = listed_entry(facts, MACHINE, 16 * GB)
    assert "fit" not in entry and entry["why_unsupported"].startswith("could not be assessed")
    assert apple_matrix(facts) == []
