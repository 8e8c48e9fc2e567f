from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tests.helpers.tiny_models import write_byte_tokenizer, write_tiny_llama


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(path)
    return load_tokenizer(Path(path))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=3)
