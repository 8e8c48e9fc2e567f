"""Text appended after the rendered prompt (an Anthropic prefill, a forced tool
call's opening) is tokenised across the seam as the whole text would be."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.prompt_format import ChatFormatter
from tests.engine.test_prompt_format import smollm2_dir  # noqa: F401 - a fixture

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def formatter(smollm2_dir):  # noqa: F811
    return ChatFormatter(load_tokenizer(smollm2_dir))


@pytest.mark.parametrize("appended", ["\n\nSure", " {", '<tool_call>\n{"name": "f"', "Hi"])
def test_appended_text_tokenises_as_the_whole_text_would(formatter, appended):
    """ "\\n\\n" after "assistant\\n" went in as two tokens, where the whole text has
    one: the model read an odd tokenisation, and the next turn (whose render holds
    the reply whole) missed the cache from the seam on."""
    rendered = formatter.render_chat(MESSAGES)
    text = formatter._template([dict(m) for m in MESSAGES], True, {})
    key = formatter.continued(rendered, appended)
    assert list(key.model_tokens) == formatter.encode(text + appended)
    assert key.message_ends == rendered.key.message_ends
    assert key.stable_prefix_end == rendered.key.stable_prefix_end


def test_decode_gives_the_text_of_token_ids(formatter):
    """What legacy completions echo for a prompt sent as token ids."""
    text = "Hello world, ünïcödé 🙂"
    assert formatter.decode(formatter.encode(text)) == text
