"""GGUF files of the qwen2, qwen3, gemma, gemma2 and gemma3 families round-trip.

Each test builds a tiny random-weight model of mlx-lm's own class, writes it as
llama.cpp would (GGUF tensor names, Gemma's RMSNorm weights stored as 1 + w,
the family's tokenizer metadata), converts it with kvwarm and loads the result
with mlx-lm: logits and greedy tokens must equal the original model's, and the
tokenizer must give the ids the vocabulary implies."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma, gemma2, gemma3_text, qwen2, qwen3
from tokenizers import pre_tokenizers

from engine.gguf_convert import convert_gguf, converted_dir
from engine.model_errors import UnsupportedModelError

MODULES = {"qwen2": qwen2, "qwen3": qwen3, "gemma": gemma, "gemma2": gemma2, "gemma3": gemma3_text}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


# llama.cpp's tensor names (its convert_hf_to_gguf.py), written out here rather
# than read from kvwarm's table, so a wrong entry there fails these tests
LLAMA_CPP_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
POST_ATTENTION = {"post_attention_layernorm": "ffn_norm"}  # llama, qwen, gemma (v1)
SANDWICH = {  # gemma2, gemma3: norms after attention and around the MLP
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
NORMS_STORED_PLUS_ONE = {"gemma", "gemma2", "gemma3"}


def gguf_name(name: str, arch: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    names = {**LLAMA_CPP_NAMES, **(SANDWICH if arch in ("gemma2", "gemma3") else POST_ATTENTION)}
    return f"blk.{layer}.{names[module]}.{suffix}"


def sentencepiece_vocab() -> tuple[list[str], list[int]]:
    """A Gemma-style vocabulary: controls, byte fallback, pieces with ▁ for spaces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 4, 4]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types += [6] * 256
    pieces = ["\u2581", *LETTERS, *("\u2581" + c for c in LETTERS), "he", "ll", "llo"]
    return tokens + pieces, types + [1] * len(pieces)


SP = {name: i for i, name in enumerate(sentencepiece_vocab()[0])}
BPE_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + [
    "he",
    "ll",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
]


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(arch: str) -> dict:
    layers = 6 if arch == "gemma3" else 2  # gemma3: five sliding layers, then a global one
    config = {
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch),
        "hidden_size": 32,
        "num_hidden_layers": layers,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "vocab_size": 400,  # padded past the tokenizer, as real checkpoints are
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    }
    if arch == "gemma2":
        config["query_pre_attn_scalar"] = 8
    if arch == "gemma3":
        config.update(query_pre_attn_scalar=8, sliding_window=4, rope_local_base_freq=10000.0)
    return config


def write_family_gguf(path: Path, arch: str, seed: int = 0):
    """The model, written as llama.cpp's converter writes it."""
    config = tiny_config(arch)
    module = MODULES[arch]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith(("norm.weight", ".bias")):
            value = mx.random.normal(value.shape) * 0.5  # not the init's ones and zeros
        params[name] = value
    model.load_weights(list(params.items()), strict=False)
    if hasattr(model, "sanitize"):
        model.sanitize({})  # gemma3: no lm_head in the file means tied
    tensors = {}
    for name, value in params.items():
        if arch in NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp stores Gemma norms as 1 + w
        tensors[gguf_name(name, arch)] = value
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": u32(32),
        f"{arch}.block_count": u32(config["num_hidden_layers"]),
        f"{arch}.feed_forward_length": u32(64),
        f"{arch}.attention.head_count": u32(4),
        f"{arch}.attention.head_count_kv": u32(2),
        f"{arch}.attention.key_length": u32(8),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-6, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{arch}.context_length": u32(512),
    }
    if arch.startswith("gemma"):
        tokens, types = sentencepiece_vocab()
        meta.update(
            {
                "tokenizer.ggml.model": "llama",
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": mx.array([-float(i) for i in range(len(tokens))]),
                "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
                "tokenizer.ggml.bos_token_id": u32(2),
                "tokenizer.ggml.eos_token_id": u32(1),
                "tokenizer.ggml.unknown_token_id": u32(3),
                "tokenizer.ggml.padding_token_id": u32(0),
                "tokenizer.ggml.eot_token_id": u32(5),
                "tokenizer.ggml.add_bos_token": mx.array(True),
            }
        )
        if arch == "gemma3":
            meta[f"{arch}.attention.sliding_window"] = u32(4)
    else:
        meta.update(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "qwen2",
                "tokenizer.ggml.tokens": BPE_TOKENS,
                "tokenizer.ggml.merges": ["h e", "l l"],
                "tokenizer.ggml.token_type": mx.array([1] * 258 + [3, 3, 3], dtype=mx.int32),
                "tokenizer.ggml.bos_token_id": u32(258),
                "tokenizer.ggml.eos_token_id": u32(260),
                "tokenizer.chat_template": QWEN_TEMPLATE,
            }
        )
    mx.save_gguf(str(path), tensors, meta)
    return model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def greedy(model, prompt: list[int], n: int = 12) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.parametrize("arch", sorted(MODULES))
def test_each_family_converts_to_the_model_it_was(tmp_path, cache_dir, arch):
    gguf = tmp_path / f"tiny-{arch}.gguf"
    original = write_family_gguf(gguf, arch)
    converted, tokenizer = load(str(convert_gguf(gguf, dequantize=True)))
    ids = mx.array([[5, 17, 99, 200, 3, 44, 7, 8, 9, 10, 11, 12]])
    assert mx.allclose(converted(ids), original(ids), atol=1e-5).item()
    prompt = [5, 17, 99, 200, 3, 44]
    assert greedy(converted, prompt) == greedy(original, prompt)
    if arch.startswith("gemma"):
        assert tokenizer.eos_token_ids == {1, 5}  # <eos> and <end_of_turn> both end a turn


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_tokenizer_gives_the_ids_its_vocabulary_implies(tmp_path, cache_dir, arch):
    gguf = tmp_path / f"tok-{arch}.gguf"
    write_family_gguf(gguf, arch)
    _, tokenizer = load(str(convert_gguf(gguf, dequantize=True)))
    bos = SP["<bos>"]
    # BOS first (add_bos_token), no dummy prefix, a space joins the next piece (▁a)
    assert tokenizer.encode("abc ab") == [bos, SP["a"], SP["b"], SP["c"], SP["\u2581a"], SP["b"]]
    assert tokenizer.encode("hello") == [bos, SP["he"], SP["llo"]]
    # control tokens stay whole; unknown characters fall back to their UTF-8 bytes
    turn = tokenizer.encode("<start_of_turn>hi<end_of_turn>")
    assert turn == [bos, SP["<start_of_turn>"], SP["h"], SP["i"], SP["<end_of_turn>"]]
    assert tokenizer.encode("é") == [bos, SP["<0xC3>"], SP["<0xA9>"]]
    for text in ("abc ab", "hello wörld 42", "a  b\nc"):
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_tokenizer_matches_transformers_qwen2_tokenizer(tmp_path, cache_dir, arch):
    from transformers import Qwen2Tokenizer

    gguf = tmp_path / f"tok-{arch}.gguf"
    write_family_gguf(gguf, arch)
    _, tokenizer = load(str(convert_gguf(gguf, dequantize=True)))
    vocab = {t: i for i, t in enumerate(BPE_TOKENS)}
    reference = Qwen2Tokenizer(vocab=vocab, merges=[("h", "e"), ("l", "l")])
    for text in ("hello world", "x = 12345;\n\n  indent", "it's we'll", "naïve 日本"):
        want = reference.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text, add_special_tokens=False) == want, text
    assert tokenizer.encode("<|im_start|>hi<|im_end|>")[0] == vocab["<|im_start|>"]
    # the file's chat template is the tokenizer's
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_architecture_is_named_and_nothing_is_kept(tmp_path, cache_dir):
    gguf = tmp_path / "other.gguf"
    write_family_gguf(gguf, "qwen2")
    raw, meta = mx.load(str(gguf), return_metadata=True)
    meta["general.architecture"] = "rwkv6"
    mx.save_gguf(str(gguf), raw, meta)
    with pytest.raises(UnsupportedModelError, match="'rwkv6' is not supported; supported: gemma"):
        convert_gguf(gguf, dequantize=True)
    assert not any((cache_dir / "models").glob("other*"))


def test_the_converted_folder_is_keyed_by_content_not_path(tmp_path, cache_dir):
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    write_family_gguf(first, "qwen3", seed=1)
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    other = tmp_path / "c" / "model.gguf"
    other.parent.mkdir()
    write_family_gguf(other, "qwen3", seed=2)
    assert converted_dir(first, True) == converted_dir(copy, True)  # another checkout: shared
    assert converted_dir(other, True) != converted_dir(first, True)  # other bytes: its own
    out = convert_gguf(first, dequantize=True)
    lines: list[str] = []
    assert convert_gguf(copy, dequantize=True, progress=lines.append) == out
    assert not lines  # the copy converts nothing


def test_beside_quantized_weights_norms_are_float16_and_so_is_the_kv(tmp_path, cache_dir):
    """GGUF keeps norm weights float32: kept so beside float16 scales, they made
    every activation after the first norm float32, and the KV cache twice what
    fit priced (Metal and CUDA, where GGUFs stay quantized)."""
    gguf = tmp_path / "q.gguf"
    original = write_family_gguf(gguf, "qwen3")
    converted, _ = load(str(convert_gguf(gguf, dequantize=False)))
    norms = [v for k, v in tree_flatten(converted.parameters()) if k.endswith("norm.weight")]
    assert norms and all(v.dtype == mx.float16 for v in norms)
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(converted)
    ids = mx.array([[5, 17, 99, 200, 3, 44]])
    logits = converted(ids, cache=cache)
    assert logits.dtype == mx.float16 and cache[0].keys.dtype == mx.float16
    assert mx.allclose(logits.astype(mx.float32), original(ids), atol=0.05).item()


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda raw, meta: meta.update({"split.count": mx.array(2, dtype=mx.uint16)}), "split"),
        (lambda raw, meta: meta.pop("qwen3.attention.head_count"), "num_attention_heads"),
        (lambda raw, meta: meta.pop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
        (lambda raw, meta: raw.update({"rope_freqs.weight": mx.ones((4,))}), "3.1+"),
    ],
)
def test_a_gguf_the_converter_cannot_serve_says_why_and_keeps_nothing(
    tmp_path, cache_dir, change, why
):
    """A split file's first part converted into a model missing layers (cached,
    failing every start); missing keys were a bare KeyError traceback."""
    gguf = tmp_path / "odd.gguf"
    write_family_gguf(gguf, "qwen3")
    raw, meta = mx.load(str(gguf), return_metadata=True)
    change(raw, meta)
    mx.save_gguf(str(gguf), raw, meta)
    with pytest.raises(UnsupportedModelError, match=why.replace("+", r"\+")):
        convert_gguf(gguf, dequantize=True)
    assert not any((cache_dir / "models").glob("odd*"))


def test_a_file_rewritten_in_place_with_its_old_times_is_read_again(tmp_path):
    """cp -p, rsync -t --inplace and curl -R keep size, mtime and inode: the old
    digest named the new bytes (their old conversion, their old KV)."""
    import hashlib
    import os
    import time

    from engine.file_digest import content_digest

    path, memo = tmp_path / "w.bin", tmp_path / "memo.json"
    path.write_bytes(b"A" * 1000)
    before = path.stat()
    assert content_digest(path, memo) == hashlib.sha256(b"A" * 1000).hexdigest()
    time.sleep(0.01)  # a change time the clock can tell apart
    with open(path, "r+b") as f:
        f.write(b"B" * 1000)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_ino == before.st_ino and path.stat().st_mtime_ns == before.st_mtime_ns
    assert content_digest(path, memo) == hashlib.sha256(b"B" * 1000).hexdigest()


def test_a_broken_folder_where_the_conversion_goes_is_named_not_returned(tmp_path, cache_dir):
    """The rename failing was taken for another process having finished first: the
    broken folder was returned, and every start failed loading it."""
    gguf = tmp_path / "m.gguf"
    write_family_gguf(gguf, "qwen3")
    target = converted_dir(gguf, True)
    (target / "leftover").mkdir(parents=True)  # not empty, no config.json
    with pytest.raises(UnsupportedModelError, match="delete that folder"):
        convert_gguf(gguf, dequantize=True)


def _llama_cpp_rope_factors(scaling: dict, base: float, dims: int) -> list[float]:
    """convert_hf_to_gguf.py's rope_freqs for a llama3 rope_scaling, as llama.cpp
    writes them (its own arithmetic here, not kvwarm's)."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = 8192  # llama.cpp reads original_max_position_embeddings from the top level: 8192
    out = []
    for i in range(0, dims, 2):
        freq = 1.0 / (base ** (i / dims))
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama_cpp_permute(w: mx.array, heads: int) -> mx.array:
    """llama.cpp's q/k row order for its interleaved rotary embedding."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_a_llama_3_gguf_converts_with_its_rope_scaling(tmp_path, cache_dir, factor):
    """llama.cpp writes Llama 3.1+'s rope scaling as a rope_freqs tensor: it was an
    'unexpected tensor', and every Llama 3.1/3.2/3.3 GGUF refused."""
    from mlx_lm.models import llama

    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # base 1e6 over 8 rotary dims: the pairs fall below, inside and above the band
    config = {**tiny_config("qwen2"), "model_type": "llama", "rope_theta": 1e6}
    config["rope_scaling"] = scaling
    mx.random.seed(0)
    original = llama.Model(llama.ModelArgs.from_dict(config))
    params = {}
    for name, value in tree_flatten(original.parameters()):
        if name.endswith("norm.weight"):
            value = mx.random.normal(value.shape) * 0.5
        params[name] = value
    original.load_weights(list(params.items()), strict=False)
    tensors = {}
    for name, value in params.items():
        if name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, 4)
        elif name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, 2)
        tensors[gguf_name(name, "llama")] = value
    tensors["rope_freqs.weight"] = mx.array(_llama_cpp_rope_factors(scaling, 1e6, 8))
    gguf = tmp_path / "llama3.gguf"
    write_family_gguf(tmp_path / "donor.gguf", "gemma")  # its SentencePiece metadata
    _, meta = mx.load(str(tmp_path / "donor.gguf"), return_metadata=True)
    meta = {k.replace("gemma.", "llama."): v for k, v in meta.items()}
    meta["general.architecture"] = "llama"
    meta["llama.rope.freq_base"] = mx.array(1e6, dtype=mx.float32)
    mx.save_gguf(str(gguf), tensors, meta)
    converted, _ = load(str(convert_gguf(gguf, dequantize=True)))
    ids = mx.array([[5, 17, 99, 200, 3, 44, 7, 8, 9, 10, 11, 12]])
    assert mx.allclose(converted(ids), original(ids), atol=1e-4).item()
    assert converted.args.rope_scaling["factor"] == factor


def test_gemma_and_gemma2_keep_float32_norms_beside_quantized_weights(tmp_path, cache_dir):
    """Their residual stream overflows float16 (mlx-lm clips it for Gemma 3 only):
    their norms, and so activations and KV, stay float32; other weights float16."""
    gguf = tmp_path / "g2.gguf"
    original = write_family_gguf(gguf, "gemma2")
    converted, _ = load(str(convert_gguf(gguf, dequantize=False)))
    flat = dict(tree_flatten(converted.parameters()))
    assert all(v.dtype == mx.float32 for k, v in flat.items() if k.endswith("norm.weight"))
    assert flat["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float16
    ids = mx.array([[5, 17, 99, 200, 3, 44]])
    assert mx.allclose(converted(ids).astype(mx.float32), original(ids), atol=0.05).item()
