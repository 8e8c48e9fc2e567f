"""Samplers from clients' values: a bounded set, since each distinct value mlx-lm
compiles into its sampling steps costs a compile on the engine thread."""

from __future__ import annotations

import mlx.core as mx

from engine.sampling import SHARED_SAMPLERS, SamplerFactory, compiled_values
from scheduler.request import SamplingParams


def test_values_are_used_to_two_decimals_never_rounding_to_off():
    p = compiled_values(SamplingParams(temperature=0.7349, top_p=0.9461, min_p=0.0512))
    assert (p.temperature, p.top_p, p.min_p) == (0.73, 0.95, 0.05)
    tiny = compiled_values(SamplingParams(temperature=0.004, top_p=0.004, min_p=0.004))
    assert not tiny.greedy and tiny.temperature == 0.01 and tiny.top_p == 0.01
    assert tiny.min_p == 0.01  # a filter asked for stays on (0.004 cuts most of a vocabulary)
    assert compiled_values(SamplingParams(temperature=0.0)).greedy


def test_a_thousand_distinct_temperatures_share_a_bounded_set_of_samplers():
    factory = SamplerFactory(vocab_size=32)
    samplers = [factory.sampler(SamplingParams(temperature=0.5 + i / 10_000)) for i in range(1000)]
    assert len({id(s) for s in samplers}) == 11  # 0.50 .. 0.60
    for i in range(200):
        factory.sampler(SamplingParams(temperature=1.0, top_p=0.01 + i / 1000))
    assert len(factory._shared) <= SHARED_SAMPLERS  # noqa: SLF001
    # the most recently used are kept: the same settings still share one sampler
    again = factory.sampler(SamplingParams(temperature=1.0, top_p=0.2))
    assert factory.sampler(SamplingParams(temperature=1.0, top_p=0.2004)) is again


def test_a_rounded_sampler_still_samples():
    factory = SamplerFactory(vocab_size=8)
    logprobs = mx.log(mx.array([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]) + 1e-9)
    for params in (
        SamplingParams(temperature=0.7349, top_p=0.9461),
        SamplingParams(temperature=0.004, seed=3, min_p=0.0512),
    ):
        token = factory.sampler(params)(logprobs)
        assert token.item() == 2
