"""Prefix reuse on the real model over HTTP: what is reused, and that it is never wrong."""

from __future__ import annotations

import uuid

import httpx

RULES = "Follow the house style. Keep answers short and precise. " * 8


def system(time: str, nonce: str = "ab12") -> str:
    return (
        f"x-anthropic-billing-header: cc_version=2.0; cch={nonce};\n"
        f"You are a coding assistant. {RULES}\nCurrent time is {time}\n"
    )


def chat(base: str, messages, key: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reply(r: dict) -> str:
    return r["choices"][0]["message"]["content"]


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def stats(base: str) -> dict:
    return httpx.get(base + "/stats", timeout=10).json()["prompt_cache"]


def test_multi_turn_reuses_prompt_and_reply(server):
    tag = uuid.uuid4().hex[:8]
    msgs = [
        {"role": "system", "content": system("10:00") + tag},
        {"role": "user", "content": "Name one prime number."},
    ]
    first = chat(server, msgs)
    assert cached(first) == 0
    msgs += [
        {"role": "assistant", "content": reply(first)},
        {"role": "user", "content": "And another one?"},
    ]
    second = chat(server, msgs)
    # everything up to the new user turn came from the cache
    assert cached(second) >= first["usage"]["prompt_tokens"] + 1
    assert cached(second) < second["usage"]["prompt_tokens"]
    s = stats(server)
    assert s["exact_key_rejected_by_model_lcp"] == 0 and s["hybrid_trim_miss"] == 0


def test_strict_hit_output_equals_cache_disabled_output(strict_server, small_server):
    tag = uuid.uuid4().hex[:8]
    msgs = [
        {"role": "system", "content": system("10:00") + tag},
        {"role": "user", "content": "Write a haiku about caches."},
    ]
    first = chat(strict_server, msgs)
    msgs += [
        {"role": "assistant", "content": reply(first)},
        {"role": "user", "content": "Now one about memory."},
    ]
    warm = chat(strict_server, msgs)
    assert cached(warm) > first["usage"]["prompt_tokens"]
    cold = chat(small_server, msgs, key="sekrit")
    assert cached(cold) == 0
    assert reply(warm) == reply(cold)


def test_strict_policy_stops_at_a_changed_nonce(strict_server):
    tag = uuid.uuid4().hex[:8]
    msgs = [{"role": "system", "content": system("10:00", nonce="aaaa") + tag}]
    msgs.append({"role": "user", "content": "hello"})
    chat(strict_server, msgs)
    msgs[0]["content"] = system("10:00", nonce="bbbb") + tag
    again = chat(strict_server, msgs)
    assert cached(again) < 40  # the nonce sits in the first line


def test_volatile_reuse_equals_a_fresh_prefill_of_the_cached_values(server, small_server):
    """Under the default policy a new timestamp and nonce reuse the old KV; the
    output must be exactly what a fresh prefill of the old values gives."""
    # the tag leads so that no other test's entry shares this prefix: the KV
    # then stands for exactly ``old``
    tag = uuid.uuid4().hex[:8]
    user = {"role": "user", "content": "List two colours."}
    old = [{"role": "system", "content": tag + "\n" + system("10:00:00 UTC", "aaaa")}, user]
    chat(server, old)
    before = stats(server)["stale_volatile_reuse"]
    new = [{"role": "system", "content": tag + "\n" + system("23:59:59 UTC", "ffff0123")}, user]
    warm = chat(server, new)
    assert cached(warm) == warm["usage"]["prompt_tokens"] - 1
    assert stats(server)["stale_volatile_reuse"] > before
    cold = chat(small_server, old, key="sekrit")
    assert reply(warm) == reply(cold)


def test_mid_history_edit_reuses_everything_before_it(server):
    tag = uuid.uuid4().hex[:8]
    msgs = [
        {"role": "system", "content": system("10:00") + tag},
        {"role": "user", "content": "Read the file."},
        {"role": "assistant", "content": "Reading it now."},
        {"role": "tool", "content": "line one\nline two\n" * 20},
        {"role": "user", "content": "Summarise it."},
    ]
    first = chat(server, msgs, session_id=f"s-{tag}")
    msgs[3]["content"] = "line one\nline 2 (edited)\n" * 20
    edited = chat(server, msgs, session_id=f"s-{tag}")
    # the system prompt, the first user turn and the assistant turn are reused, the
    # edited tool result (20 changed lines) is not
    assert 150 < cached(edited) < first["usage"]["prompt_tokens"] - 100


def test_stats_report_the_prompt_cache(server):
    s = stats(server)
    for field in ("entries", "bytes", "max_bytes", "hits", "misses", "tokens_reused"):
        assert field in s
    assert s["bytes"] <= s["max_bytes"] and s["policy"] == "reuse"
