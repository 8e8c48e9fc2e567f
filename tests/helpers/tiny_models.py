"""Tiny models and a byte-level tokenizer for engine tests (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import ArraysCache, KVCache

EOS = "<|eos|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = [EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
BYTE_VOCAB = 256
VOCAB_SIZE = BYTE_VOCAB + len(SPECIALS)


def write_byte_tokenizer(path: Path) -> None:
    """One token per UTF-8 byte: multi-byte characters span several tokens,
    which is exactly what streaming detokenisation must cope with."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


METASPACE_WORDS = ["hello", "world", "!", ",", "x", "\n", "日本"]


def write_metaspace_tokenizer(
    path: Path, words: list[str] = METASPACE_WORDS, clean_spaces: bool = False
) -> None:
    """A word-level tokenizer with a Metaspace decoder (the leading space of a
    sequence's first word dropped): mlx-lm serves it with its naive detokenizer.
    Ids: 0 ``<unk>``, 1 a lone space, then one per word (with its space).
    ``clean_spaces``: Hugging Face's clean-up too ("it ' s" decodes to "it's")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\u2581": 1, **{f"\u2581{w}": i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<unk>"}
    if clean_spaces:
        config["clean_up_tokenization_spaces"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(config))


SPM_WORDS = ["\u2581hello", "\u2581world", "hello", "\u2581", ",", "\u2581日本", "\u2581\u2581"]


def write_spm_tokenizer(path: Path) -> None:
    """A SentencePiece-shaped tokenizer (byte fallback, the decoder mlx-lm reads
    with its SPMStreamingDetokenizer). Ids: ``<unk>``, ``<s>``, ``</s>``, the 256
    byte tokens ``<0x00>``..``<0xFF>``, then SPM_WORDS."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    names = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_WORDS]
    vocab = {name: i for i, name in enumerate(names)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_llama(
    path: Path,
    seed: int = 0,
    context: int = 8192,
    generation: dict | None = None,
    hidden: int = 64,
) -> Path:
    """A random-weight llama (hidden 64, 2 layers) saved as an mlx-lm directory."""
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    write_byte_tokenizer(path)
    return path


class KVSumModel(nn.Module):
    """Next token = f(sum, count) of the tokens in *its own* KV cache row.

    Keys are zeros and values are the token ids; the model reads the cache
    through the mask mlx-lm builds (causal, left padding of batch rows), so any
    cross-talk between rows, a wrong mask or a stale/padded position changes
    the sum or the count and therefore the token, exactly and deterministically.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self):
        super().__init__()
        self.layers = [None]  # one cache layer

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache=None, **_) -> mx.array:
        B, L = inputs.shape
        c = cache[0]
        mask = c.make_mask(L, return_array=True, window_size=None)
        vals = inputs.astype(mx.float32).reshape(B, 1, L, 1)
        _, values = c.update_and_fetch(mx.zeros((B, 1, L, 1)), vals)
        S = values.shape[2]
        if mask is None:
            mask = mx.ones((L, S), dtype=mx.bool_)
        mask = mx.broadcast_to(mask.reshape(-1, 1, L, S) if mask.ndim == 4 else mask, (B, 1, L, S))
        row = values.reshape(B, 1, 1, S)
        total = mx.sum(mx.where(mask, row, 0.0), axis=-1).reshape(B, L)
        count = mx.sum(mask.astype(mx.float32), axis=-1).reshape(B, L)
        nxt = self._next(total, count)
        return mx.where(mx.arange(self.vocab_size) == nxt[..., None], 10.0, -10.0)

    def _next(self, total: mx.array, count: mx.array) -> mx.array:
        return (total * 7 + count * 3).astype(mx.int32) % BYTE_VOCAB


class ScriptModel(KVSumModel):
    """Writes ``script``: a row's next token is ``script[tokens it has seen]``
    (prompt included), whatever they were: special tokens exactly where a test
    wants them."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.script = mx.array([*script, *[0] * 4096], dtype=mx.int32)

    def _next(self, total: mx.array, count: mx.array) -> mx.array:
        return self.script[count.astype(mx.int32)]


class RecurrentSumModel(nn.Module):
    """KVSumModel's rule on a *recurrent* state: the cache is an ArraysCache of
    (sum, count), which cannot be cut back to an earlier position, like the
    recurrent layers of hybrid models (can_trim_prompt_cache is False)."""

    vocab_size = VOCAB_SIZE

    def __init__(self):
        super().__init__()
        self.layers = [None]

    def make_cache(self):
        return [ArraysCache(1)]

    def __call__(self, inputs: mx.array, cache=None, **_) -> mx.array:
        B, L = inputs.shape
        c = cache[0]
        mask = c.make_mask(L)
        vals = inputs.astype(mx.float32)
        ones = mx.ones((B, L))
        if mask is not None:
            vals = mx.where(mask, vals, 0.0)
            ones = mx.where(mask, ones, 0.0)
        state = c[0] if c[0] is not None else mx.zeros((B, 2))
        total = state[:, :1] + mx.cumsum(vals, axis=1)
        count = state[:, 1:] + mx.cumsum(ones, axis=1)
        c[0] = mx.stack([total[:, -1], count[:, -1]], axis=1)
        c.advance(L)
        nxt = (total * 7 + count * 3).astype(mx.int32) % BYTE_VOCAB
        return mx.where(mx.arange(self.vocab_size) == nxt[..., None], 10.0, -10.0)


# Tiny random-weight instances of mlx-lm's own model classes, one per cache
# type the engine must serve (what make_prompt_cache gives each layer):
#   qwen3_next / lfm2: ArraysCache (recurrent) + KVCache, mixed per layer
#   gemma3_text / gpt_oss: RotatingKVCache (sliding window) + KVCache
#   falcon_h1: CacheList(ArraysCache, KVCache) in every layer
_BASE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
TINY_WINDOW = 24  # sliding window of the tiny rotating-cache models
ARCHITECTURES: dict[str, dict] = {
    "qwen3_next": {
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
    },
    "lfm2": {
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
        "norm_eps": 1e-5,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "gemma3_text": {
        "sliding_window": TINY_WINDOW,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "swiglu_limit": 7.0,
    },
    "falcon_h1": {
        "num_hidden_layers": 2,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
        "mamba_chunk_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
}


def write_tiny_arch(path: Path, arch: str, seed: int = 0) -> Path:
    """A random-weight ``arch`` model saved as an mlx-lm directory (byte tokenizer)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = {**_BASE, **ARCHITECTURES[arch], "model_type": arch}
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(path)
    return path
