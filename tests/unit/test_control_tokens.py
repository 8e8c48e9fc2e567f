"""Control tokens in client text made plain (engine.control_tokens): the same
result as one flat alternation of every token, in time that does not grow with
how many tokens the tokenizer has."""

from __future__ import annotations

import re
from re import _parser as sre_parse  # type: ignore[attr-defined]

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.control_tokens import JOINER, ControlTokens


def _flat(tokens: list[str], value: str, keep: str | None = None) -> str:
    """The former implementation: one alternation, longest tokens first."""
    words = sorted({t for t in tokens if len(t) > 1}, key=len, reverse=True)
    if not words or not value:
        return value
    pattern = re.compile("|".join(map(re.escape, words)))
    kept = frozenset(pattern.findall(keep)) if keep else frozenset()
    return pattern.sub(lambda m: m[0] if m[0] in kept else m[0][0] + JOINER + m[0][1:], value)


ALPHABET = "<|>ab/"
TOKENS = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=12)


@settings(max_examples=500, deadline=None)
@given(tokens=TOKENS, value=st.text(alphabet=ALPHABET + "x", max_size=60), keep=st.booleans())
def test_the_same_text_as_one_flat_alternation(tokens, value, keep):
    kept = "".join(tokens[::2]) if keep else None
    assert ControlTokens(tokens).text(value, kept) == _flat(tokens, value, kept)


def test_the_longest_token_at_a_position_wins():
    control = ControlTokens(["<|im", "<|im_start|>", "<|"])
    assert control.text("<|im_start|><|im_end") == (
        f"<{JOINER}|im_start|><{JOINER}|im_end"  # "<|im" then "_end", not "<|" + "im_end"
    )


def _branches(pattern: str) -> list[list[object]]:
    """Every alternation in the pattern: the first element of each of its branches."""
    found: list[list[object]] = []

    def walk(items) -> None:
        for op, arg in items:
            if op is sre_parse.BRANCH:
                found.append([branch[0] if len(branch) else None for branch in arg[1]])
                for branch in arg[1]:
                    walk(branch)
            elif op is sre_parse.SUBPATTERN:
                walk(arg[-1])
            elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
                walk(arg[2])

    walk(sre_parse.parse(pattern))
    return found


def test_a_thousand_tokens_make_a_trie_not_a_thousand_alternatives():
    """Mistral Tekken's ~1000 <SPECIAL_n>: a flat alternation tried each at every
    "<" of the text (1 MB of HTML: 1.15 s holding the GIL). As a trie, each
    alternation's branches begin with distinct characters: at any position the
    engine follows one branch per character, whatever the count of tokens."""
    tokens = [f"<SPECIAL_{i}>" for i in range(1000)] + ["<s>", "</s>", "[INST]", "<unk>"]
    pattern = ControlTokens(tokens).pattern.pattern
    alternations = _branches(pattern)
    assert alternations
    for firsts in alternations:
        assert None not in firsts and len(set(map(str, firsts))) == len(firsts)
        assert all(op is sre_parse.LITERAL for op, _ in firsts)
        assert len(firsts) <= 11  # digits and ">" at most, not 1000 tokens
    # and no token is tried again: its characters appear once per trie edge
    assert len(pattern) < sum(map(len, tokens)) // 2
