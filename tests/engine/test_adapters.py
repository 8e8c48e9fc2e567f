"""LoRA / DoRA adapters mounted into a running BatchRunner.

The reference is mlx-lm itself: ``load(model, adapter_path=...)`` +
``generate_step`` with greedy sampling. A mounted adapter must give exactly its
tokens, whether its row decodes alone or beside rows of other adapters and of
the base model; the KV one adapter computed must never serve another.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from engine.adapter_files import read_adapter_files
from engine.batch_runner import BatchRunner
from engine.lora import MultiLoRALinear
from kvcache.index import PromptCacheConfig
from kvcache.manager import TieredKVManager
from kvcache.prompt_key import PromptKey
from scheduler.contracts import AdapterError, AdapterInUse, AdapterNotFound
from scheduler.request import CacheHints, Request, SamplingParams
from tests.helpers.adapters import write_adapter

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    list(b"The adapter writes this: "),
    list(b"Another prompt, a bit longer than that one. "),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": write_adapter(tiny_llama_dir, root / "a", seed=1),
        "b": write_adapter(
            tiny_llama_dir, root / "b", seed=2, rank=8, keys=["self_attn.v_proj", "mlp.down_proj"]
        ),
        "dora": write_adapter(tiny_llama_dir, root / "dora", seed=3, scale=8.0, dora=True),
    }


def reference(model_dir, prompt, adapter_dir=None) -> list[int]:
    """mlx-lm's own greedy tokens, with the adapter loaded its way."""
    model, _ = load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        out.append(int(token))
    return out


def make_runner(model_dir, cache: bool = False, max_batch: int = 4) -> BatchRunner:
    model, tokenizer = load(str(model_dir))
    prefix = (
        TieredKVManager(
            PromptCacheConfig(block_size=8, kv_block_size=16),
            64 * 2**20,
            "tiny",
            make_prompt_cache(model),
        )
        if cache
        else None
    )
    return BatchRunner(
        model,
        tokenizer,
        max_batch=max_batch,
        prefill_step_size=64,
        prefill_batch=max_batch,
        prefix_cache=prefix,
    )


def mount(runner: BatchRunner, adapter_id: str, path):
    """What POST /v1/adapters does: read the files off the engine thread, mount on it."""
    return runner.mount_adapter(adapter_id, read_adapter_files(path))


def request(rid: str, prompt, adapter=None, cache=False) -> Request:
    hints = CacheHints(PromptKey.build(prompt), session_id=rid) if cache else None
    return Request(
        list(prompt),
        MAX_TOKENS,
        GREEDY,
        ignore_eos=True,
        request_id=rid,
        adapter=adapter,
        cache=hints,
    )


def run(runner: BatchRunner, requests: list[Request]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    firsts = {}
    for r in requests:
        firsts[r.request_id] = runner.add(r)
    while runner.active:
        for out in runner.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.token_ids)
            if firsts[out.request_id] is None:  # a disk hit's report comes once read
                firsts[out.request_id] = out
    run.firsts = firsts  # type: ignore[attr-defined]
    return tokens


@pytest.mark.parametrize("name", ["a", "b", "dora"])
def test_mounted_adapter_gives_mlx_lm_tokens(tiny_llama_dir, adapters, name):
    runner = make_runner(tiny_llama_dir)
    info = mount(runner, name, adapters[name])
    assert info.mounted_layers > 0 and info.size_bytes > 0
    got = run(runner, [request("r", PROMPTS[0], adapter=name)])["r"]
    assert got == reference(tiny_llama_dir, PROMPTS[0], adapters[name])
    assert got != reference(tiny_llama_dir, PROMPTS[0]), "the adapter must change the output"


def test_rows_of_different_adapters_decode_together(tiny_llama_dir, adapters):
    runner = make_runner(tiny_llama_dir)
    for name in ("a", "b", "dora"):
        mount(runner, name, adapters[name])
    plan = [(None, 0), ("a", 0), ("b", 1), ("dora", 1), ("a", 1)]
    reqs = [request(f"r{i}", PROMPTS[p], adapter=a) for i, (a, p) in enumerate(plan)]
    got = run(runner, reqs[:4])
    got.update(run(runner, reqs[4:]))
    for i, (name, p) in enumerate(plan):
        want = reference(tiny_llama_dir, PROMPTS[p], adapters[name] if name else None)
        assert got[f"r{i}"] == want, (name, p)
    assert max(i for i, n in enumerate(runner.batch_sizes) if n) == 4  # decoded as one batch


def test_unmount_restores_the_base_model_and_refuses_while_in_use(tiny_llama_dir, adapters):
    runner = make_runner(tiny_llama_dir)
    mount(runner, "a", adapters["a"])
    runner.add(request("busy", PROMPTS[0], adapter="a"))
    with pytest.raises(AdapterInUse, match="in use by 1"):
        runner.unmount_adapter("a")
    while runner.active:
        runner.step()
    runner.unmount_adapter("a")
    assert not any(isinstance(m, MultiLoRALinear) for _, m in runner.model.named_modules())
    assert run(runner, [request("r", PROMPTS[0])])["r"] == reference(tiny_llama_dir, PROMPTS[0])
    with pytest.raises(AdapterNotFound, match="no adapter .a. is mounted"):
        runner.add(request("gone", PROMPTS[0], adapter="a"))


def test_no_cache_hit_crosses_adapters(tiny_llama_dir, adapters):
    runner = make_runner(tiny_llama_dir, cache=True)
    mount(runner, "a", adapters["a"])
    mount(runner, "b", adapters["b"])
    prompt = PROMPTS[1] * 2
    for turn, adapter in enumerate(["a", None, "b", "a", None, "b"]):
        got = run(runner, [request(f"t{turn}", prompt, adapter=adapter, cache=True)])
        first = run.firsts[f"t{turn}"]  # type: ignore[attr-defined]
        # the first turn of each namespace misses; the second reuses its own KV
        assert (first.cached_tokens > 0) == (turn >= 3), (turn, adapter, first.cached_tokens)
        want = reference(tiny_llama_dir, prompt, adapters[adapter] if adapter else None)
        assert got[f"t{turn}"] == want


def _mount_fails(runner, path, match):
    before = [type(m).__name__ for _, m in runner.model.named_modules()]
    with pytest.raises(AdapterError, match=match):
        mount(runner, "bad", path)
    # all or nothing: no layer was touched, nothing is listed
    assert [type(m).__name__ for _, m in runner.model.named_modules()] == before
    assert runner.adapters.infos() == []


def test_bad_adapter_dirs_are_refused_whole(tiny_llama_dir, adapters, tmp_path):
    runner = make_runner(tiny_llama_dir)
    _mount_fails(runner, tmp_path / "missing", "not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _mount_fails(runner, empty, "no adapter_config.json")
    # a rank that does not match the tensors: names the layer and both shapes
    wrong = tmp_path / "wrong-rank"
    wrong.mkdir()
    (wrong / "adapters.safetensors").write_bytes(
        (adapters["a"] / "adapters.safetensors").read_bytes()
    )
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 2
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    _mount_fails(
        runner, wrong, r"layer 'model\.layers\.0\.[a-z_.]+': lora_a \(\d+, 4\) .* at rank 2"
    )
    # an adapter made for another model shape (hidden 32): the first layer's shapes named
    other = tmp_path / "other-model"
    from tests.helpers.tiny_models import write_tiny_llama

    small = write_tiny_llama(tmp_path / "small-model", hidden=32)
    write_adapter(small, other, seed=1)
    _mount_fails(runner, other, r"lora_b \(4, 32\) do not fit a \(128 -> 64\) layer")
    full = tmp_path / "full"
    full.mkdir()
    (full / "adapters.safetensors").write_bytes(
        (adapters["a"] / "adapters.safetensors").read_bytes()
    )
    (full / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "full"}))
    _mount_fails(runner, full, "fine_tune_type 'full' cannot be mounted")
    for scale in ("NaN", "Infinity", "1e400"):  # json reads them all: every token was NaN
        odd = tmp_path / f"scale-{scale}"
        odd.mkdir()
        (odd / "adapters.safetensors").write_bytes(
            (adapters["a"] / "adapters.safetensors").read_bytes()
        )
        text = json.dumps(config).replace('"scale": 4.0', f'"scale": {scale}')
        assert scale in text
        (odd / "adapter_config.json").write_text(text)
        _mount_fails(runner, odd, "scale must be a finite number")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (adapters["a"] / "adapter_config.json").read_text()
    )
    (corrupt / "adapters.safetensors").write_bytes(b"not a safetensors file")
    _mount_fails(runner, corrupt, "not a readable safetensors file")
    ints = tmp_path / "ints"
    ints.mkdir()
    (ints / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    tensors = mx.load(str(adapters["a"] / "adapters.safetensors"))
    mx.save_safetensors(
        str(ints / "adapters.safetensors"), {k: v.astype(mx.int32) for k, v in tensors.items()}
    )
    _mount_fails(runner, ints, r"lora_[ab]' is I32, not a float")
    # a good adapter still mounts after all that
    assert mount(runner, "a", adapters["a"]).id == "a"
    with pytest.raises(AdapterError, match="already mounted"):
        mount(runner, "a", adapters["b"])
    # tensors named through the wrapper "a" put on its layers ("<layer>.base"): not a
    # layer of the model (it mounted, nested the wrappers, and unmounting then crashed)
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    mx.save_safetensors(
        str(nested / "adapters.safetensors"),
        {k.replace(".lora_", ".base.lora_"): v for k, v in tensors.items()},
    )
    with pytest.raises(AdapterError, match=r"\.base' does not exist"):
        mount(runner, "nested", nested)
    runner.unmount_adapter("a")
    assert "MultiLoRALinear" not in {type(m).__name__ for _, m in runner.model.named_modules()}


def test_an_adapters_kv_namespace_holds_its_exact_scale(tiny_llama_dir, adapters):
    """Remounted at another scale, the same files compute other KV: stored KV of
    the first mount must not serve the second (6 significant digits named both alike)."""
    runner = make_runner(tiny_llama_dir)
    files = read_adapter_files(adapters["a"])
    runner.mount_adapter("a", files, scale=1.0)
    before = runner.adapters.namespace("a")
    runner.unmount_adapter("a")
    runner.mount_adapter("a", files, scale=1.0000004)
    assert runner.adapters.namespace("a") != before


def test_adapter_kv_on_the_ssd_tier_is_found_again_after_a_restart(
    tiny_llama_dir, adapters, tmp_path
):
    """The adapter namespace is stored with each entry: after a restart, the same
    adapter files hit their KV on disk; another adapter still never does."""
    from kvcache.manager import DiskConfig

    def runner_with_disk() -> BatchRunner:
        runner = make_runner(tiny_llama_dir)
        runner.prefix_cache = TieredKVManager(
            PromptCacheConfig(block_size=8, kv_block_size=16),
            64 * 2**20,
            "tiny",
            make_prompt_cache(runner.model),
            DiskConfig(tmp_path, 2**30),
        )
        mount(runner, "a", adapters["a"])
        mount(runner, "b", adapters["b"])
        return runner

    prompt = PROMPTS[1] * 2
    first = runner_with_disk()
    want = run(first, [request("t0", prompt, adapter="a", cache=True)])["t0"]
    first.close()  # flushes the SSD writes
    second = runner_with_disk()
    got = run(second, [request("t1", prompt, adapter="b", cache=True)])["t1"]
    assert run.firsts["t1"].cached_tokens == 0  # type: ignore[attr-defined]
    got = run(second, [request("t2", prompt, adapter="a", cache=True)])["t2"]
    assert run.firsts["t2"].cached_tokens > 0  # type: ignore[attr-defined]
    assert run.firsts["t2"].cache.tier == "disk"  # type: ignore[attr-defined]
    assert got == want
    second.close()


def test_mixed_rows_route_through_layers_that_flatten_the_batch():
    """Some MoE blocks flatten (B, L, D) to (B*L, D) before an adapted linear:
    each row's tokens still get their own adapter."""
    import mlx.nn as nn

    from engine.lora import LoRAWeights, MultiLoRALinear, RowRouting

    mx.random.seed(0)
    base = nn.Linear(8, 6)
    routing = RowRouting()
    layer = MultiLoRALinear(base, routing)
    pair = LoRAWeights(mx.random.normal((8, 2)), mx.random.normal((2, 6)), 2.0)
    layer.adapters[1] = pair
    x = mx.random.normal((3, 4, 8))  # rows: base, adapter 1, base
    routing.set([0, 1, 0])
    batched = layer(x)
    flat = layer(x.reshape(12, 8)).reshape(3, 4, 6)
    routing.clear()
    want_base, want_lora = base(x), base(x) + 2.0 * ((x @ pair.a) @ pair.b)
    for out in (batched, flat):
        assert out.shape == (3, 4, 6)
        assert mx.allclose(out[0], want_base[0]).item() and mx.allclose(out[2], want_base[2]).item()
        assert mx.allclose(out[1], want_lora[1]).item()
    routing.set([0, 1])
    with pytest.raises(ValueError, match="cannot be split into 2 rows"):
        layer(mx.random.normal((3, 8)))


def test_the_weights_mounted_are_the_bytes_that_were_fingerprinted(
    tiny_llama_dir, adapters, tmp_path
):
    """The file was read again on the engine thread, checked only by size and
    mtime: rewritten meanwhile with both kept (cp -p, rsync -a), other weights ran
    under the first one's fingerprint, and their KV was later served to it."""
    import shutil

    moved = tmp_path / "a"
    shutil.copytree(adapters["a"], moved)
    files = read_adapter_files(moved)
    shutil.copy(adapters["b"] / "adapters.safetensors", moved / "adapters.safetensors")
    runner = make_runner(tiny_llama_dir)
    runner.mount_adapter("a", files)
    ours = run(runner, [request("x", PROMPTS[0], adapter="a")])["x"]
    assert ours == reference(tiny_llama_dir, PROMPTS[0], adapters["a"])


def _copy_with(source, dest, config=None, tensors=None):
    dest.mkdir()
    if config is None:
        (dest / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    else:
        (dest / "adapter_config.json").write_text(config)
    if tensors is None:
        (dest / "adapters.safetensors").write_bytes((source / "adapters.safetensors").read_bytes())
    else:
        mx.save_safetensors(str(dest / "adapters.safetensors"), tensors)
    return dest


def test_adapters_that_would_run_nan_or_fail_the_request_are_refused(
    tiny_llama_dir, adapters, tmp_path
):
    """Each mounted and answered token 0 over and over (a NaN tensor, a finite
    scale whose product with the mount's is not), or was a 500 (a 400-digit
    scale, a config of deep brackets, a NUL in the path)."""
    runner = make_runner(tiny_llama_dir)
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    huge = dict(config, lora_parameters={**config["lora_parameters"], "scale": 1e308})
    files = read_adapter_files(_copy_with(adapters["a"], tmp_path / "huge", json.dumps(huge)))
    with pytest.raises(AdapterError, match="no finite number"):
        runner.mount_adapter("huge", files, 2.0)
    tensors = mx.load(str(adapters["a"] / "adapters.safetensors"))
    name = next(k for k in tensors if k.endswith("lora_b"))
    nan = {**tensors, name: mx.full(tensors[name].shape, float("nan"))}
    with pytest.raises(AdapterError, match="NaN or infinity"):
        mount(runner, "nan", _copy_with(adapters["a"], tmp_path / "nan", tensors=nan))
    digits = json.dumps(config).replace('"scale": 4.0', '"scale": ' + "1" * 400)
    with pytest.raises(AdapterError, match="finite number"):
        read_adapter_files(_copy_with(adapters["a"], tmp_path / "digits", digits))
    with pytest.raises(AdapterError, match="not readable JSON"):
        read_adapter_files(_copy_with(adapters["a"], tmp_path / "deep", "[" * 100_000))
    with pytest.raises(AdapterError, match="NUL"):
        read_adapter_files(tmp_path / "a\x00b")
    assert runner.adapter_infos() == []  # nothing half-mounted


def test_finite_weights_whose_products_overflow_are_refused(tiny_llama_dir, adapters, tmp_path):
    """lora_a 1000 and lora_b 60000 are finite float16 values and passed the NaN
    check; mounted, every token of the adapter's rows was 0 (the logits collapsed
    once the products overflowed), answered with 200s for ever."""
    runner = make_runner(tiny_llama_dir)
    tensors = mx.load(str(adapters["a"] / "adapters.safetensors"))
    big = {
        k: mx.full(v.shape, 60000.0 if k.endswith("lora_b") else 1000.0, dtype=mx.float16)
        for k, v in tensors.items()
    }
    _mount_fails(runner, _copy_with(adapters["a"], tmp_path / "big", tensors=big), "overflow")
    assert mount(runner, "a", adapters["a"]).id == "a"  # a sound one still mounts beside
    before = [type(m).__name__ for _, m in runner.model.named_modules()]
    with pytest.raises(AdapterError, match="overflow"):
        mount(runner, "big2", _copy_with(adapters["a"], tmp_path / "big2", tensors=big))
    assert [type(m).__name__ for _, m in runner.model.named_modules()] == before
    assert [i.id for i in runner.adapter_infos()] == ["a"]
    got = run(runner, [request("r", PROMPTS[0], adapter="a")])["r"]
    assert got == reference(tiny_llama_dir, PROMPTS[0], adapters["a"])


class _ProbeFailed(Exception):
    pass


def test_a_probe_that_raises_leaves_no_half_mounted_adapter(tiny_llama_dir, adapters, monkeypatch):
    """The overflow probe ran after the pairs were in the model with nothing around
    it: when it raised (out of memory, say), the layers kept their wrappers and the
    adapter's pairs under a slot no adapter owns, and every later pass ran them."""
    from engine.adapters import AdapterSet

    def probe(self, slot):
        raise _ProbeFailed("the probe's forward pass failed")

    def slots(runner) -> dict[str, set[int]]:
        modules = runner.model.named_modules()
        return {p: set(m.adapters) for p, m in modules if isinstance(m, MultiLoRALinear)}

    runner = make_runner(tiny_llama_dir)
    bare = [(p, type(m).__name__) for p, m in runner.model.named_modules()]
    with monkeypatch.context() as patch:
        patch.setattr(AdapterSet, "_breaks_the_model", probe)
        with pytest.raises(_ProbeFailed):
            mount(runner, "b", adapters["b"])
    assert [(p, type(m).__name__) for p, m in runner.model.named_modules()] == bare  # unwrapped
    mount(runner, "a", adapters["a"])
    before = slots(runner)
    with monkeypatch.context() as patch:
        patch.setattr(AdapterSet, "_breaks_the_model", probe)
        with pytest.raises(_ProbeFailed):
            mount(runner, "dora", adapters["dora"])
    assert slots(runner) == before  # no pairs left under the failed mount's slot
    assert [i.id for i in runner.adapter_infos()] == ["a"]
    assert mount(runner, "b", adapters["b"]).id == "b"  # the id was never taken
    got = run(runner, [request("r", PROMPTS[0], adapter="a")])["r"]
    assert got == reference(tiny_llama_dir, PROMPTS[0], adapters["a"])
