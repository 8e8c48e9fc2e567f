from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tests.helpers.tiny_models import (
    write_byte_tokenizer,
    write_metaspace_tokenizer,
    write_tiny_llama,
)


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(path)
    return load_tokenizer(Path(path))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=3)


@pytest.fixture(scope="session")
def naive_bytes(byte_tokenizer):
    """The tests' byte tokenizer behind mlx-lm's naive detokenizer (multi-byte
    characters span tokens: the held-back case)."""
    return TokenizerWrapper(byte_tokenizer._tokenizer, NaiveStreamingDetokenizer)


@pytest.fixture(scope="session")
def metaspace(tmp_path_factory):
    """A Metaspace decoder (tests.helpers.tiny_models.METASPACE_WORDS): mlx-lm
    serves it with its naive detokenizer."""
    path = Path(tmp_path_factory.mktemp("metaspace"))
    write_metaspace_tokenizer(path)
    wrapper = load_tokenizer(path)
    assert type(wrapper.detokenizer) is NaiveStreamingDetokenizer
    return wrapper
