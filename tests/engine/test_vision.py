"""Vision rows on tiny random-weight SmolVLM (Idefics3) and Qwen2-VL models
built from mlx-vlm's own classes: exact against mlx-vlm's own full-prompt forward, cached by image content, and
batched with text rows without changing anyone's tokens."""

from __future__ import annotations

import base64
import logging
from functools import partial
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from PIL import Image

from app.errors import APIError
from app.image_prompt import attach_images, resolve_images
from app.images import ImageLimits, ImageSource
from engine.batch_runner import BatchRunner
from engine.loader import load_model
from engine.lora import BASE, is_tag
from engine.model_source import ModelSource
from engine.prompt_format import ChatFormatter
from engine.vision import VisionFront, pixel_bound, set_pixel_bound, vision_reserve
from kvcache.index import PromptCacheConfig
from kvcache.manager import TieredKVManager
from kvcache.payloads import plain_kv_only
from scheduler.request import CacheHints, Request, SamplingParams
from tests.helpers.colliding_images import collide
from tests.helpers.tiny_vlm import (
    make_video,
    png_bytes,
    write_tiny_gemma3,
    write_tiny_llava,
    write_tiny_pixtral,
    write_tiny_qwen2vl,
    write_tiny_smolvlm,
)

GREEN, RED = (10, 200, 30), (200, 10, 30)


# one family at sequential positions, one on multimodal RoPE (an image on a grid)
FAMILIES = {
    "smolvlm": write_tiny_smolvlm,
    "qwen2vl": write_tiny_qwen2vl,
    "qwen2_5vl": partial(write_tiny_qwen2vl, family="qwen2_5_vl"),
    "gemma3": write_tiny_gemma3,
    "llava": write_tiny_llava,
    "pixtral": write_tiny_pixtral,
    "mistral3": partial(write_tiny_pixtral, family="mistral3"),
}
# random weights whose greedy output is not one token
SEEDS = {
    "smolvlm": 5,
    "qwen2vl": 1,
    "qwen2_5vl": 1,
    "gemma3": 1,
    "llava": 1,
    "pixtral": 1,
    "mistral3": 1,
}
SIZE = (110, 80)  # Qwen2-VL: 4x3 tokens on a grid spanning 4 positions, so a delta of -8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    path = FAMILIES[request.param](folder, seed=SEEDS[request.param])
    loaded = load_model(ModelSource("mlx", Path(path), f"tiny-{request.param}"), vision="auto")
    front = VisionFront.for_model(loaded.vision.vlm, loaded.processor, loaded.tokenizer)
    return loaded, front, ChatFormatter(loaded.tokenizer, 8192)


def runner_for(loaded, cache=True) -> BatchRunner:
    kv = None
    if cache:
        kv = TieredKVManager(
            PromptCacheConfig(), 64 * 2**20, "ns", make_prompt_cache(loaded.model), None, None
        )
    return BatchRunner(
        loaded.model, loaded.tokenizer, 4, 512, 4, prefix_cache=kv, vision=loaded.vision
    )


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def request(vlm, text: str, *urls: str, max_tokens: int = 6, video: str | None = None) -> Request:
    loaded, front, fmt = vlm
    parts = [{"type": "image", "source": ImageSource(url=u)} for u in urls]
    if video is not None:
        parts.append({"type": "image", "source": ImageSource(url=video, video=True)})
    parts.append({"type": "text", "text": text})
    messages, images = resolve_images(
        [{"role": "user", "content": parts}], front, ImageLimits(video_frames=3), False
    )
    key, prompt, inputs = attach_images(
        fmt.render_chat(messages, image_placeholder=front.placeholder).key, images, front
    )
    return Request(
        prompt,
        max_tokens,
        SamplingParams(temperature=0.0),
        cache=CacheHints(key, "s"),
        images=inputs,
    )


def run(runner: BatchRunner, *requests: Request) -> list[tuple[tuple[int, ...], int]]:
    """Greedy tokens and cached prompt tokens of each request, run together."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    cached: dict[str, int] = {}
    for r in requests:
        cached[r.request_id] = runner.add(r).cached_tokens
    while runner.active:
        for out in runner.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
    return [(tuple(tokens[r.request_id]), cached[r.request_id]) for r in requests]


def reference(loaded, req: Request) -> tuple[int, ...]:
    """mlx-vlm's own path: the whole prompt's embeddings at once, then greedy."""
    vlm = loaded.vision.vlm
    (image,) = req.images
    inputs = {k: mx.array(v) for k, v in image.inputs.items()}
    pixels = inputs.pop("pixel_values")
    prompt = mx.array([req.prompt_tokens])
    features = vlm.get_input_embeddings(prompt, pixels, mask=mx.ones(prompt.shape), **inputs)
    # multimodal RoPE: mlx-vlm's own positions for the whole prompt, then its deltas
    rope = {}
    if getattr(features, "rope_deltas", None) is not None:
        rope = {"rope_deltas": features.rope_deltas}
    cache = make_prompt_cache(loaded.model)
    logits = vlm.language_model(
        prompt,
        inputs_embeds=features.inputs_embeds,
        cache=cache,
        **({"position_ids": features.position_ids} if rope else {}),
        **rope,
    ).logits
    out = []
    for _ in range(req.max_tokens):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = vlm.language_model(mx.array([[token]]), cache=cache, **rope).logits
    return tuple(out)


def test_an_image_row_generates_what_mlx_vlm_does_with_the_whole_prompt(vlm):
    loaded = vlm[0]
    req = request(vlm, "what is in this picture?", data_url(png_bytes(*SIZE, GREEN)), max_tokens=10)
    if loaded.vision.merge is not None:  # the text after the image moved back
        assert req.images[0].rope_shift == -8
    ((tokens, _),) = run(runner_for(loaded, cache=False), req)
    assert tokens == reference(loaded, req)
    assert len(set(tokens)) > 1  # a model that ignores its input could not tell


ASK = "describe it, every part of it, in detail"  # past one KV block after the image


def ideal_reuse(loaded, req: Request) -> int:
    """All an ideal cache reuses of a re-sent prompt: all but its last token, or,
    where a layer cannot be cut back (Gemma 3's sliding window), up to the
    checkpoint stored at the end of its last message."""
    if plain_kv_only(make_prompt_cache(loaded.model)):
        return len(req.prompt_tokens) - 1
    return req.cache.key.message_ends[-1]


def test_the_same_image_re_sent_or_re_encoded_hits_and_skips_the_tower(vlm):
    loaded = vlm[0]
    runner = runner_for(loaded)
    png = png_bytes(*SIZE, GREEN)
    first = request(vlm, ASK, data_url(png))
    ((tokens, cached),) = run(runner, first)
    assert cached == 0
    runs = loaded.vision.counters.encoder_runs
    # the same pixels as a BMP: another encoding, the same image
    again = request(vlm, ASK, data_url(png_bytes(*SIZE, GREEN, "BMP"), "image/bmp"))
    assert again.cache.key.model_tokens == first.cache.key.model_tokens
    ((tokens2, cached2),) = run(runner, again)
    assert tokens2 == tokens
    assert cached2 == ideal_reuse(loaded, again) > again.images[0].end
    assert loaded.vision.counters.encoder_runs == runs  # the tower did not run


def test_a_re_sent_image_the_prefix_cache_cannot_cover_skips_the_tower(vlm):
    """Without a prefix to reuse (another server's cache, or the image twice in one
    prompt), the feature cache still spares the tower, and the row reads exactly
    as mlx-vlm's whole-prompt forward."""
    loaded = vlm[0]
    png = png_bytes(*SIZE, (40, 90, 160))
    run(runner_for(loaded, cache=False), request(vlm, ASK, data_url(png)))
    counters = loaded.vision.counters
    runs, hits = counters.encoder_runs, counters.feature_hits
    again = request(vlm, "and again: " + ASK, data_url(png), max_tokens=10)
    ((tokens, cached),) = run(runner_for(loaded, cache=False), again)
    # the reference reads on past an end-of-sequence token: compare up to it
    assert cached == 0 and tokens == reference(loaded, again)[: len(tokens)]
    assert (counters.encoder_runs, counters.feature_hits) == (runs, hits + 1)
    twice = request(
        vlm, "compare", data_url(png_bytes(*SIZE, RED)), data_url(png_bytes(*SIZE, RED))
    )
    run(runner_for(loaded, cache=False), twice)
    assert (counters.encoder_runs, counters.feature_hits) == (runs + 1, hits + 2)


@pytest.mark.parametrize("size", [(1000, 4), (4, 1000), (3000, 2), (1, 1)])
def test_an_image_of_any_shape_is_read_or_refused_with_a_400(vlm, size):
    """Processors refuse some shapes (Qwen2-VL: aspect ratio over 200; Pixtral:
    a side that resizes to 0): the client's image, so a 400 naming its size."""
    try:
        req = request(vlm, "what?", data_url(png_bytes(*size, GREEN)), max_tokens=2)
    except APIError as exc:
        assert exc.status == 400 and f"{size[0]}x{size[1]} image" in exc.message, exc.message
        return
    ((tokens, _),) = run(runner_for(vlm[0], cache=False), req)
    assert len(tokens) == 2


def test_identical_text_with_another_image_never_hits_past_the_image(vlm):
    loaded = vlm[0]
    runner = runner_for(loaded)
    green = request(vlm, ASK, data_url(png_bytes(*SIZE, GREEN)))
    red = request(vlm, ASK, data_url(png_bytes(*SIZE, RED)))
    assert green.prompt_tokens == red.prompt_tokens  # the model's ids agree...
    (_, cached_red) = run(runner, green, red)[1]  # ...the cache must not
    ((_, cached_again),) = run(runner, red)
    assert cached_red <= red.images[0].start
    assert cached_again == ideal_reuse(loaded, red)
    assert runner.prefix_cache.stats().vlm_retreat == 0  # clean traffic: no retreat


def test_images_whose_short_hashes_collide_never_share_kv(vlm, monkeypatch):
    """An image's tokens once carried one 48-bit id, and a birthday search found
    two images with one id: the second got a full hit on the first one's KV. Two
    images whose ids agree at every token but the last: no hit past the start."""
    collide(monkeypatch, keep=-1)
    loaded = vlm[0]
    runner = runner_for(loaded)
    first = request(vlm, ASK, data_url(png_bytes(*SIZE, (90, 20, 140))))
    second = request(vlm, ASK, data_url(png_bytes(*SIZE, (20, 140, 90))))
    (image,) = second.images
    one, two = first.cache.key.model_tokens, second.cache.key.model_tokens
    assert one[: image.end - 1] == two[: image.end - 1]  # the collision as simulated
    run(runner, first)
    ((tokens, cached),) = run(runner, second)
    assert cached <= image.start
    assert tokens == run(runner_for(loaded, cache=False), second)[0][0]
    assert one[image.end - 1] != two[image.end - 1]


def test_images_whose_short_hashes_collide_never_share_tower_features(vlm, monkeypatch):
    """With the prefix cache off, the tower's features kept for re-sent images
    were found by that 48-bit id too: a colliding image read the first one's.
    They are kept by the image's 256-bit key: ids that all collide change nothing."""
    collide(monkeypatch)  # every id of every image the same
    loaded = vlm[0]
    counters = loaded.vision.counters
    run(runner_for(loaded, cache=False), request(vlm, ASK, data_url(png_bytes(*SIZE, (5, 5, 5)))))
    runs, hits = counters.encoder_runs, counters.feature_hits
    other = request(vlm, ASK, data_url(png_bytes(*SIZE, (250, 250, 250))), max_tokens=10)
    ((tokens, _),) = run(runner_for(loaded, cache=False), other)
    assert (counters.encoder_runs, counters.feature_hits) == (runs + 1, hits)
    assert tokens == reference(loaded, other)[: len(tokens)]


def test_an_image_of_too_few_tokens_to_name_it_safely_is_never_reused_past(vlm):
    """An icon is 1 token to Qwen2-VL (under its --min-pixels), 2 to Pixtral: its
    ids carry under 128 bits, so a re-send reuses no KV past its start; the
    tower's features, kept by the image's 256-bit key, are still reused."""
    from kvcache.image_ids import MIN_RUN_TOKENS

    loaded = vlm[0]
    runner = runner_for(loaded)
    png = png_bytes(12, 12, (70, 70, 200))
    run(runner, request(vlm, ASK, data_url(png)))
    runs = loaded.vision.counters.encoder_runs
    again = request(vlm, ASK, data_url(png))
    (image,) = again.images
    ((tokens, cached),) = run(runner, again)
    if len(image.tokens) < MIN_RUN_TOKENS:
        assert cached <= image.start
    else:
        assert cached == ideal_reuse(loaded, again)
    assert loaded.vision.counters.encoder_runs == runs
    assert tokens == run(runner_for(loaded, cache=False), again)[0][0]


def test_image_and_text_rows_in_one_batch_keep_their_own_tokens(vlm):
    loaded = vlm[0]
    make = [
        lambda: request(vlm, "first picture", data_url(png_bytes(*SIZE, GREEN))),
        lambda: request(vlm, "no picture here, just text to read"),
        lambda: request(
            vlm,
            "two pictures",
            data_url(png_bytes(60, 120, RED)),
            data_url(png_bytes(20, 20, GREEN)),
        ),
    ]
    alone = [run(runner_for(loaded, cache=False), m())[0][0] for m in make]
    together = [t for t, _ in run(runner_for(loaded, cache=False), *(m() for m in make))]
    assert together == alone


def test_a_video_reaches_the_model_as_its_frames(vlm, tmp_path):
    """A video part reads exactly as its evenly spaced frames sent as images."""
    from app.video_frames import extract_frames

    clip = make_video(tmp_path, seconds=3.0, fps=2)
    frames = [data_url(f) for f in extract_frames(clip, 3, timeout=30)]
    loaded = vlm[0]
    as_video = request(
        vlm, "what happens?", video="data:video/mp4;base64," + base64.b64encode(clip).decode()
    )
    as_frames = request(vlm, "what happens?", *frames)
    assert len(as_video.images) == 3
    assert as_video.prompt_tokens == as_frames.prompt_tokens
    assert as_video.cache.key == as_frames.cache.key  # the same images to the cache
    runner = runner_for(loaded, cache=False)
    assert run(runner, as_video) == run(runner_for(loaded, cache=False), as_frames)


def test_an_image_prefilled_in_small_chunks_reads_the_same(vlm):
    """The vision prefill feeds the language model --prefill-step-size tokens at a
    time (its attention transient bounded like a text step's)."""
    loaded = vlm[0]
    make = lambda: request(vlm, "what is this?", data_url(png_bytes(*SIZE, GREEN)))  # noqa: E731
    whole = run(runner_for(loaded, cache=False), make())
    chunked = runner_for(loaded, cache=False)
    chunked.vision.chunk = 3
    try:
        assert run(chunked, make()) == whole
    finally:
        loaded.vision.chunk = 512


def test_admission_reserves_the_largest_image_the_processor_makes(vlm):
    loaded, front, _ = vlm
    cpu = vision_reserve(loaded.vision, front, "Device(cpu, 0)")
    gpu = vision_reserve(loaded.vision, front, "Device(gpu, 0)")
    assert cpu.features == gpu.features == loaded.vision.feature_bytes
    assert cpu.image > gpu.image > 0  # the CPU's attention materialises its scores
    # the largest image: at least as many tokens as any image a request can send
    biggest = request(vlm, "?", data_url(png_bytes(2000, 1500, GREEN)))
    assert cpu.image_tokens >= len(biggest.images[0].tokens)


def test_max_pixels_reaches_the_processor_or_is_reported_ignored(vlm, caplog):
    """Area-sized processors (Qwen2-VL) take --max-pixels: a large image makes fewer
    tokens; edge-sized ones cannot, and the start-up log says the flag is ignored."""
    loaded, front, _ = vlm
    image = Image.new("RGB", (600, 400), GREEN)
    full = len(front.expand(image).tokens)
    sizer = loaded.processor.image_processor
    saved = pixel_bound(sizer, "max_pixels")
    with caplog.at_level(logging.WARNING, logger="kvwarm.engine.vision"):
        small = VisionFront.for_model(
            loaded.vision.vlm, loaded.processor, loaded.tokenizer, max_pixels=28 * 28 * 4
        )
    try:
        if saved is None:
            assert "--max-pixels is ignored" in caplog.text
            assert len(small.expand(image).tokens) == full
        else:
            assert "ignored" not in caplog.text
            assert len(small.expand(image).tokens) < full
    finally:
        if saved is not None:
            set_pixel_bound(sizer, "max_pixels", saved)


def test_a_many_image_prompt_prefills_one_image_a_step(vlm):
    """Running rows wait for one image's prefill at a time, not for all of them."""
    loaded = vlm[0]
    runner = runner_for(loaded, cache=False)
    urls = [data_url(png_bytes(*SIZE, c)) for c in (GREEN, RED, (30, 30, 200))]
    req = request(vlm, "compare them", *urls)
    before = loaded.vision.counters.images_prefilled
    runner.add(req)
    runner.step()
    assert loaded.vision.counters.images_prefilled - before == 1
    assert req.request_id in runner._waiting  # still before the batch
    runner.step()
    assert loaded.vision.counters.images_prefilled - before == 2
    tokens = []
    while runner.active:
        for out in runner.step():
            assert out.error is None, out.error
            tokens += out.token_ids
    assert loaded.vision.counters.images_prefilled - before == 3
    assert (tuple(tokens), 0) == run(
        runner_for(loaded, cache=False), request(vlm, "compare them", *urls)
    )[0]


def test_an_image_is_read_through_the_rows_adapter_route(vlm):
    """The vision prefill goes through the routed model with the row's adapter
    tag, as the rest of its prompt does (a LoRA row reads its images with it)."""
    loaded = vlm[0]
    runner = runner_for(loaded, cache=False)
    routed, slots = runner.adapters.routed, []

    class Spy:
        def __call__(self, inputs, cache=None, **kwargs):
            slots.append(cache[-1].slots if cache and is_tag(cache[-1]) else None)
            return routed(inputs, cache=cache, **kwargs)

        def __getattr__(self, name):
            return getattr(routed, name)

    runner.adapters.routed = Spy()
    req = request(vlm, "what is this?", data_url(png_bytes(*SIZE, GREEN)))
    runner.add(req)
    runner.step()  # the image's prefill; nothing else has run yet
    assert slots and all(s == [BASE] for s in slots)


def test_a_vision_models_stored_kv_has_a_namespace_of_its_image_scheme(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """KV kept on disk before images had per-position ids was keyed by one id per
    image: a vision model's SSD namespace names the scheme, so none of it is read
    back as another image's. A text model's namespace is what it was: its stored
    KV stays warm across the change."""
    from engine import device_memory
    from engine.boot import boot_mlx
    from engine.engine_thread import EngineConfig
    from engine.loader import weights_digest
    from kvcache.disk import FORMAT_VERSION

    monkeypatch.setattr(device_memory, "measure_bandwidth", lambda: 1e10)
    names = {}
    for name, path in (
        ("text", tiny_llama_dir),
        ("vision", write_tiny_smolvlm(tmp_path / "vlm", seed=SEEDS["smolvlm"])),
    ):
        booted = boot_mlx(
            EngineConfig(
                ModelSource("mlx", Path(path), name),
                memory_budget_bytes=2**30,
                prompt_cache=PromptCacheConfig(),
                kv_dir=tmp_path / "kv",
                kv_disk_bytes=2**26,
            )
        )
        cache = booted.runner.prefix_cache
        names[name] = cache.namespace
        cache.close()
        memo = tmp_path / "kv" / ".weights-digests.json"
        weights, layout, version, *scheme = names[name].split("-")
        assert (weights, version) == (weights_digest(Path(path), memo), f"v{FORMAT_VERSION}")
        names[name] = scheme
    assert names == {"text": [], "vision": ["img2"]}  # the text model's as before


def _fed_per_step(loaded, monkeypatch, req, step: int):
    """Run ``req`` alone with prefill slices of ``step``: the tokens fed to the
    model in each engine step, and the reply's tokens."""
    fed: list[int] = []
    feed = loaded.vision._feed
    monkeypatch.setattr(
        loaded.vision, "_feed", lambda ids, *a, **k: (fed.append(ids.shape[1]), feed(ids, *a, **k))
    )
    runner = BatchRunner(loaded.model, loaded.tokenizer, 4, step, 4, vision=loaded.vision)
    runner.add(req)
    per_step, tokens = [], []
    while runner.active:
        fed.clear()
        for out in runner.step():
            assert out.error is None, out.error
            tokens += out.token_ids
        per_step.append(sum(fed))
    return per_step, tokens


def test_text_before_an_image_is_prefilled_within_the_step_budget(vlm, monkeypatch):
    """A long history before a screenshot was prefilled in one engine step, whatever
    --prefill-step-size or --max-step-ms said: every running row's next token waited
    for all of it. It is now sliced as text is, with the same tokens at the end."""
    loaded, front, fmt = vlm
    step = 64

    def screenshot_request() -> Request:
        history = " ".join(str(i) for i in range(400))
        parts = [
            {"type": "text", "text": history},
            {"type": "image", "source": ImageSource(url=data_url(png_bytes(*SIZE, GREEN)))},
            {"type": "text", "text": "what is this?"},
        ]
        messages, images = resolve_images(
            [{"role": "user", "content": parts}], front, ImageLimits(), False
        )
        key, prompt, inputs = attach_images(
            fmt.render_chat(messages, image_placeholder=front.placeholder).key, images, front
        )
        return Request(prompt, 6, SamplingParams(temperature=0.0), images=inputs)

    req = screenshot_request()
    (image,) = req.images
    assert image.start > 3 * step  # the text before it spans several steps
    per_step, tokens = _fed_per_step(loaded, monkeypatch, req, step)
    assert max(per_step) <= step + len(image.tokens)
    monkeypatch.undo()
    assert (tuple(tokens), 0) == run(runner_for(loaded, cache=False), screenshot_request())[0]


def test_the_image_marker_in_a_replys_tool_calls_or_reasoning_is_text(tmp_path):
    """Message content was made plain, but the model's own tool-call arguments,
    reasoning and the think block healing put back were rendered as they were:
    a reply that wrote "<image>" there (an RSS feed, a web page) rendered an
    image token with no image behind it, and every later turn was a 400."""
    import json

    from app.image_prompt import plain_replies
    from kvcache.healing import HealingStore

    path = write_tiny_smolvlm(tmp_path, seed=1)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (  # renders calls and reasoning, as agent models' templates do
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m.get('reasoning_content') or '' }}"
        "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}CALL "
        "{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}{% endfor %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_model(ModelSource("mlx", path, "m"), vision="auto")
    front = VisionFront.for_model(loaded.vision.vlm, loaded.processor, loaded.tokenizer)
    fmt = ChatFormatter(loaded.tokenizer, 8192)
    feed = {"text": "<rss><image><url>a.png</url></image></rss>"}
    call = {"id": "c1", "type": "function", "function": {"name": "write", "arguments": ""}}
    call["function"]["arguments"] = json.dumps(feed)
    user = {
        "role": "user",
        "content": [
            {"type": "image", "source": ImageSource(url=data_url(png_bytes(50, 40, GREEN)))},
            {"type": "text", "text": "write the feed"},
        ],
    }
    said = "<think>its <image> tag</think>done"
    store = HealingStore()
    for reply in (  # the echo of a healed reply, and one the client sent as it was
        {"role": "assistant", "content": "done", "tool_calls": [call]},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "an <image>",
            "tool_calls": [call],
        },
    ):
        first, _ = resolve_images([user], front, ImageLimits(), False)
        store.remember(said, [call], store.contexts(first)[-1])
        messages = [user, reply, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        messages, images = resolve_images(messages, front, ImageLimits(), False)
        healed = store.heal_all(messages, store.contexts(messages))
        renders = [
            fmt.render_chat(
                plain_replies(messages, healed, front), image_placeholder=front.placeholder
            )
            for _ in range(2)
        ]
        assert renders[0].key.model_tokens == renders[1].key.model_tokens  # a stable prefix
        key, prompt, inputs = attach_images(renders[0].key, images, front)
        (image,) = inputs
        assert prompt.count(front.placeholder_id) == list(image.tokens).count(front.placeholder_id)
    assert store.healed == 1


def flood_expansions(loaded) -> None:
    """4097 other images admitted: past what the engine keeps of image expansions."""
    import os

    from scheduler.request import ImageInput

    fakes = [ImageInput(3, (7,) * 6, key, key) for key in (os.urandom(32) for _ in range(4097))]
    loaded.vision.remember(fakes)


def test_a_rows_images_outlive_the_expansions_of_newer_ones(vlm, tmp_path):
    """The engine keeps 4096 image expansions: a long reply on a busy server lost
    its KV (store_final read its key's image as unknown: a KeyError logged), and a
    disk-tier hit read while others were admitted failed its request."""
    from kvcache.manager import DiskConfig

    loaded, front, fmt = vlm

    def runner_on_disk():
        kv = TieredKVManager(
            PromptCacheConfig(block_size=8, kv_block_size=16),
            64 * 2**20,
            "ns",
            make_prompt_cache(loaded.model),
            DiskConfig(tmp_path, 2**30),
        )
        return BatchRunner(
            loaded.model, loaded.tokenizer, 4, 512, 4, prefix_cache=kv, vision=loaded.vision
        )

    def drain(runner, req, flood):
        first = runner.add(req)
        tokens: list[int] = []
        while runner.active:
            if flood:  # while it waits on its read, or decodes
                flood_expansions(loaded)
                flood = False
            for out in runner.step():
                assert out.error is None, out.error
                tokens += out.token_ids
                first = first or (out if out.cache is not None else None)
        return tuple(tokens), first.cached_tokens

    url = data_url(png_bytes(*SIZE, GREEN))
    runner = runner_on_disk()
    cold = drain(runner, request(vlm, "what is it?", url, max_tokens=8), flood=True)
    runner.prefix_cache.close()  # its reply's KV on disk only: read back off the engine thread
    again = request(vlm, "what is it?", url, max_tokens=8)
    tokens, cached = drain(runner_on_disk(), again, flood=True)
    assert cached == len(again.prompt_tokens) - 1  # stored, and read back
    assert tokens == cold[0]


def test_an_image_is_prefilled_within_the_step_budget_across_steps(vlm, monkeypatch):
    """An image's tokens went through the language model in one engine step,
    whatever --prefill-step-size or --max-step-ms said: every running row's next
    token waited for all of them. They are now sliced by the step's budget (the
    tower still runs once, whole), with the same tokens at the end."""
    loaded = vlm[0]
    req = request(vlm, "what is this?", data_url(png_bytes(*SIZE, (77, 1, 99))))
    (image,) = req.images
    step = max(2, len(image.tokens) // 3)  # the image spans three steps or more
    runs = loaded.vision.counters.encoder_runs
    per_step, tokens = _fed_per_step(loaded, monkeypatch, req, step)
    assert max(per_step) <= step and sum(per_step) == image.end
    assert loaded.vision.counters.encoder_runs - runs == 1
    monkeypatch.undo()
    whole = request(vlm, "what is this?", data_url(png_bytes(*SIZE, (77, 1, 99))))
    assert (tuple(tokens), 0) == run(runner_for(loaded, cache=False), whole)[0]


MID_IMAGE = ((5, 90, 40), (90, 5, 40))


def picture(vlm, colour) -> Request:
    return request(vlm, "what is this?", data_url(png_bytes(*SIZE, colour)))


def two_rows_mid_image(vlm, monkeypatch, room: float):
    """Two rows with images of their own, an image's features counted, and the
    feature cache's cap set to ``room`` images' worth."""
    loaded = vlm[0]
    a, b, probe = (picture(vlm, c) for c in (*MID_IMAGE, (40, 5, 90)))
    one = loaded.vision._embeddings(probe.images[0]).nbytes
    monkeypatch.setattr(loaded.vision, "feature_bytes", int(room * one))
    step = max(2, len(a.images[0].tokens) // 3)  # each image spans three steps or more
    return BatchRunner(loaded.model, loaded.tokenizer, 4, step, 4, vision=loaded.vision), a, b


def test_rows_mid_image_do_not_rerun_the_tower_for_each_others_evictions(vlm, monkeypatch):
    """Two rows part-way through their images, with room for one and a half
    images' features: each slice's features evicted the other row's, so the
    tower ran again every step. The first row's are kept to its last slice; the
    second's image, with no room to keep its features, runs whole in its step."""
    loaded = vlm[0]
    runner, a, b = two_rows_mid_image(vlm, monkeypatch, 1.5)
    runs = loaded.vision.counters.encoder_runs
    got = run(runner, a, b)
    assert loaded.vision.counters.encoder_runs - runs == 2  # once per image
    assert loaded.vision.pinned() == {}
    assert loaded.vision.held_features() <= loaded.vision.feature_bytes
    monkeypatch.undo()
    for (tokens, _), colour in zip(got, MID_IMAGE):  # the same as each alone, whole
        assert tokens == run(runner_for(loaded, cache=False), picture(vlm, colour))[0][0]


def test_a_row_leaving_mid_image_lets_its_features_go(vlm, monkeypatch):
    """A row cancelled or failed part-way through its image unpins its features
    (they become an ordinary cache entry): none are held for a row gone."""
    loaded = vlm[0]
    runner, a, b = two_rows_mid_image(vlm, monkeypatch, 2.5)
    runner.add(a), runner.add(b)
    for _ in range(8):
        if set(loaded.vision.pinned()) == {a.request_id, b.request_id}:
            break
        runner.step()
    assert set(loaded.vision.pinned()) == {a.request_id, b.request_id}
    runner.remove(a.request_id)  # the client went away
    assert set(loaded.vision.pinned()) == {b.request_id}

    def broken(*_, **__):
        raise RuntimeError("the language model failed")

    monkeypatch.setattr(loaded.vision, "_feed", broken)
    errors = [out.error for out in runner.step() if out.request_id == b.request_id]
    assert errors and "the language model failed" in errors[0]
    assert loaded.vision.pinned() == {} and not runner.active
