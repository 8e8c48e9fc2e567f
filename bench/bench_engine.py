"""Engine overhead benchmark: kvwarm's BatchRunner vs mlx-lm's bare BatchGenerator.

Same random-weight model, same prompts, same batch sizes, in one process:
prints decode tokens/s for each, their ratio (what kvwarm's per-step work
costs: text deltas, stop matching, prefill budgeting, bookkeeping), and that
work's own time per step outside the generator, also as a share of the bare
generator's step (where a fast accelerator leaves the step host-bound, this is
what kvwarm adds; it is far steadier than the ratio on a noisy machine).

    python bench/bench_engine.py --shape smollm2 --batches 1 8      # CPU
    python bench/bench_engine.py --shape qwen3-8b --dtype bfloat16 --batches 1 8 64   # GPU
    python bench/bench_engine.py --shape qwen3-8b --dtype bfloat16 --bits 4 --batches 64  # 4-bit
    python bench/bench_engine.py --shape host-bound --batches 8 64 128  # host work alone
    python bench/bench_engine.py --shape smollm2 --batches 8 --logprobs 5  # every row asks
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.blas import preload_openblas  # noqa: E402

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.generate import BatchGenerator, StopSequences  # noqa: E402
from mlx_lm.models import llama, qwen3  # noqa: E402
from mlx_lm.tokenizer_utils import load as load_tokenizer  # noqa: E402

from engine.batch_runner import BatchRunner  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from tests.helpers.tiny_models import write_byte_tokenizer  # noqa: E402

SHAPES = {
    "smollm2": (
        llama,
        dict(
            model_type="llama",
            hidden_size=576,
            num_hidden_layers=30,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            rms_norm_eps=1e-5,
            vocab_size=49152,
            tie_word_embeddings=True,
        ),
    ),
    # a step computes in next to no time, as on a fast accelerator: what is left
    # is host work, the per-row Python kvwarm adds to the generator's
    "host-bound": (
        llama,
        dict(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=261,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": (
        qwen3,
        dict(
            model_type="qwen3",
            hidden_size=4096,
            num_hidden_layers=36,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
}


def build(shape: str, dtype: str, bits: int | None = None):
    module, cfg = SHAPES[shape]
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(getattr(mx, dtype))
    if bits is not None:  # as mlx_lm.convert -q quantizes: affine, groups of 64
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


def prompts(batch: int, length: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(length)] for i in range(batch)]


def decode_rate(step, finished) -> float:
    """Tokens/s from the first generated token on (prefill excluded)."""
    produced, first = 0, None
    while not finished(produced):
        n = len(step())
        if n and first is None:
            first = time.perf_counter()  # the first token of each row is not timed
        elif first is not None:
            produced += n
    return produced / (time.perf_counter() - first)


def bare(model, batch: int, length: int, tokens: int) -> float:
    gen = BatchGenerator(
        model, completion_batch_size=batch, prefill_batch_size=batch, prefill_step_size=2048
    )
    gen.insert(
        prompts(batch, length),
        max_tokens=[tokens] * batch,
        stop_sequences=[StopSequences()] * batch,
    )
    rate = decode_rate(lambda: gen.next()[1], lambda n: n >= batch * (tokens - 1))
    gen.close()
    return rate


class HostClock:
    """Splits each kvwarm decode step into the generator's call and kvwarm's own
    host work around it (text, stops, outputs, the step budget): the part to keep
    small, since on a fast accelerator it adds to every step."""

    def __init__(self, runner: BatchRunner):
        self.runner = runner
        self.inside = self.outside = 0.0
        self.steps = 0
        generator = runner._generator
        inner = generator.next

        def timed():
            began = time.perf_counter()
            try:
                return inner()
            finally:
                self.inside += time.perf_counter() - began

        generator.next = timed

    def step(self):
        began, inside = time.perf_counter(), self.inside
        out = self.runner.step()
        if out:  # a step that produced tokens (a prefill step produces none)
            self.steps += 1
            self.outside += time.perf_counter() - began - (self.inside - inside)
        return out


def kvwarm(
    model,
    tokenizer,
    batch: int,
    length: int,
    tokens: int,
    host: list | None = None,
    logprobs: int | None = None,
):
    runner = BatchRunner(
        model, tokenizer, max_batch=batch, prefill_step_size=2048 * batch, prefill_batch=batch
    )
    for i, p in enumerate(prompts(batch, length)):
        runner.add(
            Request(
                p,
                tokens,
                SamplingParams(temperature=0.0),
                ignore_eos=True,
                logprobs=logprobs,
                request_id=f"r{i}",
            )
        )
    clock = HostClock(runner)
    rate = decode_rate(clock.step, lambda _: runner.active == 0)
    runner.close()
    if host is not None and clock.steps:
        host.append(clock.outside / clock.steps)
    return rate


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="quantize the weights")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="kvwarm's rows ask for logprobs with N alternatives",
    )
    args = ap.parse_args()
    print(
        f"device {mx.default_device()}  BLAS {BLAS.name}  shape {args.shape} {args.dtype}"
        + (f" {args.bits}-bit" if args.bits else "")
        + (
            f"  kvwarm rows ask for logprobs ({args.logprobs} alternatives)"
            if args.logprobs is not None
            else ""
        ),
        flush=True,
    )
    model = build(args.shape, args.dtype, args.bits)
    with tempfile.TemporaryDirectory() as tmp:
        write_byte_tokenizer(Path(tmp))
        tokenizer = load_tokenizer(Path(tmp))
    bare(model, 1, 16, 4)  # warm-up (kernels, allocator)
    print(
        f"{'batch':>5} {'mlx-lm BatchGenerator':>22} {'kvwarm BatchRunner':>20} {'ratio*':>7}"
        f" {'kvwarm host/step':>17} {'of bare step':>12}"
    )
    for batch in args.batches:
        # untimed: a backend that compiles kernels per shape (CUDA) does it here
        bare(model, batch, args.prompt, 8)
        kvwarm(model, tokenizer, batch, args.prompt, 8)
        a: list[float] = []
        b: list[float] = []
        host: list[float] = []  # kvwarm's seconds per decode step outside the generator
        for i in range(args.repeats):  # interleaved, order alternating: drift hits both
            for engine in ("bare", "kvwarm") if i % 2 == 0 else ("kvwarm", "bare"):
                if engine == "bare":
                    a.append(bare(model, batch, args.prompt, args.tokens))
                else:
                    b.append(
                        kvwarm(
                            model, tokenizer, batch, args.prompt, args.tokens, host, args.logprobs
                        )
                    )
        ma, mb = statistics.median(a), statistics.median(b)
        # each repeat's two runs sit side by side: their ratio cancels drift that
        # moves both (clocks, a neighbour), which the ratio of medians does not
        paired = statistics.median(y / x for x, y in zip(a, b))
        outside = statistics.median(host)
        # kvwarm's own host work as a share of the bare generator's step: what it
        # costs where the step is host-bound, steadier than the ratio on a noisy machine
        share = outside / (batch / ma)
        print(
            f"{batch:>5} {ma:>18.1f} t/s {mb:>16.1f} t/s {paired:>6.2f}x"
            f" {outside * 1e6:>12.0f} us {share:>11.1%}",
            flush=True,
        )
    print("* the median of each repeat's kvwarm/bare ratio (runs side by side, order alternating)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
