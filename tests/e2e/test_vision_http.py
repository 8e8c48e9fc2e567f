"""Images over real HTTP against `kvwarm serve` on tiny SmolVLM- and Qwen2-VL-shaped models:
every dialect, tool results, each limit's 400, corrupt data, the cache."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.e2e.conftest import kvwarm_server
from tests.helpers.tiny_vlm import make_video, png_bytes, write_tiny_qwen2vl, write_tiny_smolvlm

PNG = png_bytes(50, 40, (10, 200, 30))
B64 = base64.b64encode(PNG).decode()
URL = f"data:image/png;base64,{B64}"


@pytest.fixture(scope="module")
def vision_server(model_cache, tmp_path_factory):
    model = write_tiny_smolvlm(tmp_path_factory.mktemp("tiny-smolvlm"), seed=2)
    log = tmp_path_factory.mktemp("serve-vision") / "kvwarm.log"
    args = ("--model", str(model), "--max-images", "2", "--max-image-bytes", "100KB")
    args += ("--max-image-pixels", "1000000", "--no-fetch-urls")
    with kvwarm_server(model_cache, *args, log=log) as base:
        yield base


def chat(base: str, content, **extra) -> httpx.Response:
    body = {"model": "m", "max_tokens": 4, "temperature": 0, **extra}
    body.setdefault("messages", [{"role": "user", "content": content}])
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def image_part(url: str = URL) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_images_reach_the_model_in_every_dialect_and_hit_the_cache(vision_server):
    base = vision_server
    first = chat(base, [image_part(), {"type": "text", "text": "what is this?"}])
    assert first.status_code == 200, first.text
    again = chat(base, [image_part(), {"type": "text", "text": "what is this?"}])
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert (
        again.json()["choices"][0]["message"]["content"]
        == (first.json()["choices"][0]["message"]["content"])
    )
    # the repeat came from the prefix cache: the tower ran for the first request only
    vision = httpx.get(base + "/stats", timeout=10).json()["vision"]
    assert vision["encoder_runs"] == 1 and vision["images_prefilled"] == 1
    assert vision["encoder_seconds"] > 0
    metrics = httpx.get(base + "/metrics", timeout=10).text
    runs = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvwarm:vision_encoder_runs_total{")
    ]
    assert runs and runs[0].endswith(" 1.0")

    anthropic = httpx.post(
        base + "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": B64},
                        },
                        {"type": "text", "text": "what is this?"},
                    ],
                }
            ],
        },
        timeout=120,
    )
    assert anthropic.status_code == 200, anthropic.text
    responses = httpx.post(
        base + "/v1/responses",
        json={
            "model": "m",
            "max_output_tokens": 4,
            "temperature": 0,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": URL},
                        {"type": "input_text", "text": "what is this?"},
                    ],
                }
            ],
        },
        timeout=120,
    )
    assert responses.status_code == 200, responses.text
    # the same conversation in every dialect: the same tokens, so a warm hit each time
    assert anthropic.json()["usage"]["cache_read_input_tokens"] > 0
    assert responses.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_screenshot_in_a_tool_result_reaches_the_model(vision_server):
    messages = [
        {"role": "user", "content": "take a screenshot"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [image_part()]},
    ]
    with_image = chat(vision_server, None, messages=messages)
    assert with_image.status_code == 200, with_image.text
    red = image_part(
        f"data:image/png;base64,{base64.b64encode(png_bytes(50, 40, (200, 0, 0))).decode()}"
    )
    messages[-1]["content"] = [red]
    other = chat(vision_server, None, messages=messages)
    # a different screenshot: the same text, but nothing past the image is reused
    first_usage, other_usage = with_image.json()["usage"], other.json()["usage"]
    assert first_usage["prompt_tokens"] == other_usage["prompt_tokens"]
    assert other_usage["prompt_tokens_details"]["cached_tokens"] < other_usage["prompt_tokens"] - 20


def vision_stats(base: str) -> tuple[int, int]:
    vision = httpx.get(base + "/stats", timeout=10).json()["vision"]
    return vision["images_prefilled"], vision["encoder_runs"]


def b64_png(color: tuple[int, int, int]) -> str:
    return base64.b64encode(png_bytes(50, 40, color)).decode()


def anthropic_image(color: tuple[int, int, int]) -> dict:
    source = {"type": "base64", "media_type": "image/png", "data": b64_png(color)}
    return {"type": "image", "source": source}


def input_image(color: tuple[int, int, int]) -> dict:
    return {"type": "input_image", "image_url": f"data:image/png;base64,{b64_png(color)}"}


def towers_run(base: str, path: str, body: dict) -> tuple[int, int]:
    """Images prefilled and tower runs one request added."""
    before = vision_stats(base)
    resp = httpx.post(base + path, json={"model": "m", **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    after = vision_stats(base)
    return after[0] - before[0], after[1] - before[1]


def test_messages_and_responses_images_reach_the_model_plain_and_in_tool_results(vision_server):
    """Each request's image is new to the server: the tower runs for it, so the
    image reached the model rather than being dropped or turned into a note."""
    ask = {"role": "user", "content": "take a screenshot"}
    call = {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image((1, 2, 250))]}
    tool_turn = [
        ask,
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    messages = {"max_tokens": 4, "messages": tool_turn}
    assert towers_run(vision_server, "/v1/messages", messages) == (1, 1)
    output = {"type": "function_call_output", "call_id": "c1", "output": [input_image((250, 2, 1))]}
    call = {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"}
    responses = {"max_output_tokens": 4, "input": [ask, call, output]}
    assert towers_run(vision_server, "/v1/responses", responses) == (1, 1)
    # and as plain content, each with an image of its own
    plain = [anthropic_image((3, 250, 3)), {"type": "text", "text": "?"}]
    messages = {"max_tokens": 4, "messages": [{"role": "user", "content": plain}]}
    assert towers_run(vision_server, "/v1/messages", messages) == (1, 1)
    responses = {
        "max_output_tokens": 4,
        "input": [{"role": "user", "content": [input_image((90, 90, 3))]}],
    }
    assert towers_run(vision_server, "/v1/responses", responses) == (1, 1)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ([image_part()] * 3, "Too many images: 3"),
        ([image_part(f"data:image/png;base64,{'A' * 200_000}")], "--max-image-bytes"),
        (
            [
                image_part(
                    "data:image/png;base64,"
                    + base64.b64encode(png_bytes(1200, 1000, (1, 2, 3))).decode()
                )
            ],
            "--max-image-pixels",
        ),
        (
            [image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())],
            "not an image",
        ),
        ([image_part("data:image/png;base64," + base64.b64encode(PNG[:60]).decode())], "image"),
        ([image_part("https://example.com/cat.png")], "--no-fetch-urls"),
        ([image_part("ftp://example.com/cat.png")], "data:, http: or https:"),
    ],
)
def test_each_limit_and_bad_image_is_a_400_and_the_server_stays_healthy(
    vision_server, content, needle
):
    resp = chat(vision_server, content)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert httpx.get(vision_server + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def qwen_server(model_cache, tmp_path_factory):
    model = write_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2vl"), seed=1)
    log = tmp_path_factory.mktemp("serve-qwen2vl") / "kvwarm.log"
    with kvwarm_server(model_cache, "--model", str(model), "--vision", "on", log=log) as base:
        yield base


def test_a_qwen2_vl_conversation_about_an_image_reuses_every_earlier_turn(qwen_server):
    """Multimodal RoPE over HTTP: the image's grid of positions, then a second turn
    whose prefix (image included) comes from the cache."""
    base = qwen_server
    big = "data:image/png;base64," + base64.b64encode(png_bytes(110, 80, (200, 10, 30))).decode()
    turn = [{"role": "user", "content": [image_part(big), {"type": "text", "text": "what?"}]}]
    first = chat(base, None, messages=turn, max_tokens=6)
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"]
    turn += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and the colour?"},
    ]
    second = chat(base, None, messages=turn, max_tokens=6)
    assert second.status_code == 200, second.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first.json()["usage"]["prompt_tokens"]
    # the model's markers in client text are text (a 400 left such a conversation
    # unservable): one image, and the markers' characters
    plain = chat(base, [image_part(big), {"type": "text", "text": "a <x> here"}], max_tokens=1)
    forged = chat(
        base,
        [image_part(big), {"type": "text", "text": "a <|vision_start|><|image_pad|> here"}],
        max_tokens=1,
    )
    assert plain.status_code == 200 and forged.status_code == 200, forged.text
    extra = forged.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    # the tiny model reads bytes: the markers' characters (a word joiner in each), no image
    assert extra == len("<\u2060|vision_start|><\u2060|image_pad|>".encode()) - len("<x>")
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_image_tokens_count_against_the_context(vision_server):
    """A request whose image tokens take it past the context is refused before it
    runs, with the same 400 as a text prompt over the ceiling."""
    content = [image_part(), {"type": "text", "text": "what is this?"}]
    text_only = chat(vision_server, "what is this?", max_tokens=1).json()["usage"]
    with_image = chat(vision_server, content, max_tokens=1).json()["usage"]
    image_tokens = with_image["prompt_tokens"] - text_only["prompt_tokens"]
    assert image_tokens >= 20  # tiles of 4 tokens, a global view, their markers
    context = 8192  # the tiny model's max_position_embeddings
    over = chat(vision_server, content, max_tokens=context - with_image["prompt_tokens"] + 1)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


def test_an_image_the_processor_cannot_read_is_a_400_and_the_server_stays_healthy(qwen_server):
    """Qwen2-VL's processor refuses an aspect ratio over 200: the client's image,
    so a 400 naming it (it was a 500)."""
    thin = "data:image/png;base64," + base64.b64encode(png_bytes(1000, 4, (9, 9, 9))).decode()
    resp = chat(qwen_server, [image_part(thin), {"type": "text", "text": "what?"}])
    assert resp.status_code == 400, resp.text
    assert "1000x4 image" in resp.json()["error"]["message"]
    assert httpx.get(qwen_server + "/health", timeout=10).status_code == 200


def test_a_video_url_reaches_the_model_as_frames(vision_server, tmp_path):
    base = vision_server
    clip = base64.b64encode(make_video(tmp_path, seconds=2.0, fps=4)).decode()

    def video(data: str) -> list[dict]:
        url = f"data:video/mp4;base64,{data}"
        return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]

    def prefilled() -> int:
        return httpx.get(base + "/stats", timeout=10).json()["vision"]["images_prefilled"]

    before = prefilled()
    resp = chat(base, video(clip))
    assert resp.status_code == 200, resp.text
    assert prefilled() - before == 8  # --video-frames 8: each frame an image
    bad = chat(base, video(base64.b64encode(b"no video here" * 50).decode()))
    assert bad.status_code == 400 and "not a video" in bad.text
    assert httpx.get(base + "/health", timeout=10).status_code == 200
