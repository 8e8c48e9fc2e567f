from __future__ import annotations

import pytest

from app.generation_params import resolve_max_tokens, resolve_sampling, valid_defaults
from app.request_fields import SamplingFields
from scheduler.admission import ContextLengthExceeded


def fields(**values) -> SamplingFields:
    return SamplingFields.model_validate(values)


def test_request_beats_model_defaults_beats_openai_defaults():
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    p = resolve_sampling(fields(temperature=0.0, seed=7), model)
    assert p.temperature == 0.0 and p.greedy  # explicit 0 is not "missing"
    assert p.top_p == 0.95 and p.top_k == 20  # from generation_config.json
    assert p.min_p == 0.0 and p.repetition_penalty == 1.0  # OpenAI defaults
    assert p.seed == 7


def test_no_defaults_anywhere_means_openai_sampling():
    p = resolve_sampling(fields(), {})
    assert (p.temperature, p.top_p, p.seed) == (1.0, 1.0, None)


def test_max_tokens_default_is_clipped_to_the_room_left():
    assert resolve_max_tokens(None, 100, 1000, 2048) == 900
    assert resolve_max_tokens(None, 100, 10_000, 2048) == 2048
    assert resolve_max_tokens(5000, 100, 1000, 2048) == 5000  # explicit: admission decides
    # an omitted limit stays under the memory ceiling too; past it admission says why
    assert resolve_max_tokens(None, 20_000, 131_072, 2048, 20_992) == 992
    assert resolve_max_tokens(5000, 20_000, 131_072, 2048, 20_992) == 5000
    assert resolve_max_tokens(None, 21_000, 131_072, 2048, 20_992) == 2048
    with pytest.raises(ContextLengthExceeded):
        resolve_max_tokens(None, 1000, 1000, 2048)


def test_logit_bias_is_validated_against_the_vocabulary():
    from app.errors import APIError

    p = resolve_sampling(fields(logit_bias={"7": -100, "3": 5}), {}, vocab_size=10)
    assert p.logit_bias == ((3, 5.0), (7, -100.0))
    with pytest.raises(APIError):
        resolve_sampling(fields(logit_bias={"10": 1}), {}, vocab_size=10)


def test_any_int64_seed_maps_into_mlx_key_range():
    assert resolve_sampling(fields(seed=-1), {}).seed == 2**64 - 1
    assert resolve_sampling(fields(seed=2**64 - 1), {}).seed == 2**64 - 1


def test_out_of_range_model_defaults_never_reach_the_sampler():
    assert valid_defaults({"temperature": 0.7, "min_p": 5, "top_k": -7, "foo": 1}) == {
        "temperature": 0.7
    }
