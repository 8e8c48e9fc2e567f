"""Conversation ids at /v1/conv_kv: the ids chat requests use, and the derived
``auto-`` ids no client owns."""

from __future__ import annotations

from concurrent.futures import Future

import httpx
import pytest

from app.session_id import DERIVED_PREFIX, session_id_from
from kvcache.interface import ConversationNotFound, SavedConversation
from kvcache.sessions import fallback_session_id
from tests.helpers.http_server import serve_app
from tests.unit.test_http_api import CHAT, make_app, msgs

DERIVED = "auto-0123456789abcdef"


class Store:
    """The KV manager's conversation calls, recorded; ``saved``: its pins."""

    def __init__(self, saved: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.saved = saved

    def _done(self, op: str, conversation_id: str) -> SavedConversation:
        self.calls.append((op, conversation_id))
        return SavedConversation(conversation_id, None, 10, 100, "ram", None)

    def save_conversation(self, conversation_id: str, title: str | None) -> SavedConversation:
        return self._done("save", conversation_id)

    def load_conversation(self, conversation_id: str) -> SavedConversation:
        return self._done("load", conversation_id)

    def delete_conversation(self, conversation_id: str) -> SavedConversation:
        if conversation_id not in self.saved and conversation_id.startswith(DERIVED_PREFIX):
            raise ConversationNotFound(conversation_id)  # not reached: refused before
        return self._done("delete", conversation_id)

    def saved_conversations(self) -> list[SavedConversation]:
        return [SavedConversation(c, None, 10, 100, "disk", 1.0) for c in self.saved]


@pytest.fixture
def served():
    """(base url, store) of an app whose KV manager is ``Store``."""
    store = Store()
    app = make_app()

    def kv(op):
        future: Future = Future()
        try:
            future.set_result(op(store))
        except Exception as exc:  # noqa: BLE001 - the route maps it
            future.set_exception(exc)
        return future

    with serve_app(app) as base:
        app.state.kvwarm.engine.kv = kv
        yield base, store


def test_derived_ids_carry_the_reserved_prefix():
    assert fallback_session_id(list(range(200))).startswith(DERIVED_PREFIX)


def test_a_derived_id_is_neither_saved_nor_deleted_but_loads(served):
    """Every client without a conversation id whose prompt starts alike shares its
    derived id: a save pinned whichever client's turn was longest, a delete forgot
    all their KV. A load only warms the cache, so it stays."""
    base, store = served
    chat = httpx.post(base + CHAT, json={"messages": msgs(), "max_tokens": 2})
    derived = chat.headers["x-conv-id"]
    assert derived.startswith(DERIVED_PREFIX)
    refused = [
        httpx.post(base + "/v1/conv_kv/save", json={"conversation_id": derived}),
        httpx.delete(base + "/v1/conv_kv/" + derived),
    ]
    for r in refused:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "derived_conversation_id"
        for field in ("conversation_id", "session_id", "X-Session-Id"):
            assert field in error["message"]
    loaded = httpx.post(base + "/v1/conv_kv/load", json={"conversation_id": derived})
    assert loaded.status_code == 200, loaded.text
    assert store.calls == [("load", derived)]


def test_a_derived_id_saved_by_an_earlier_version_can_be_deleted(served):
    """Saves of derived ids made before they were refused stay deletable: their pin
    would otherwise hold disk for good."""
    base, store = served
    store.saved = (DERIVED,)
    r = httpx.delete(base + "/v1/conv_kv/" + DERIVED)
    assert r.status_code == 200, r.text
    assert store.calls == [("delete", DERIVED)]


@pytest.mark.parametrize(
    "body, headers, param",
    [
        ({"conversation_id": "auto-mine"}, {}, "conversation_id"),
        ({"metadata": {"session_id": " auto-1"}}, {}, "metadata.session_id"),
        ({"extra_body": {"conversation": {"id": "auto-x"}}}, {}, "extra_body.conversation"),
        ({"prompt_cache_key": "auto-app"}, {}, "prompt_cache_key"),
        ({"metadata": {"user_id": "user_1_session_auto-9"}}, {}, "metadata.user_id"),
        ({}, {"X-Session-Id": "auto-h"}, None),
    ],
)
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_client_cannot_name_a_derived_id(served, path, body, headers, param):
    """A client sending "auto-..." would join (and, were it allowed, save or delete)
    the conversations of every client its id's prompt head names."""
    base, _ = served
    payload = {"messages": msgs()} if path == CHAT else {"prompt": "x"}
    r = httpx.post(base + path, json={**payload, **body, "max_tokens": 2}, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "reserved_conversation_id" and error["param"] == param
    assert DERIVED_PREFIX in error["message"]


def test_ids_that_merely_contain_the_prefix_are_the_clients_own():
    assert session_id_from({"conversation_id": "my-auto-1"}, {}) == "my-auto-1"
    assert session_id_from({"conversation_id": "Auto-1"}, {}) == "Auto-1"


@pytest.mark.parametrize("sent", [5, " abc ", "x" * 300, "\tteam/alice\n"])
def test_conv_kv_reads_an_id_as_a_chat_request_does(served, sent):
    """Chat took "conversation_id": 5 as "5" and stripped spaces; save and load
    answered 400 for 5 and 404 for " abc": the id X-Conv-Id showed was unreachable."""
    base, store = served
    chat = httpx.post(
        base + CHAT, json={"messages": msgs(), "max_tokens": 2, "conversation_id": sent}
    )
    own = chat.headers["x-conv-id"]
    for route in ("save", "load"):
        r = httpx.post(base + f"/v1/conv_kv/{route}", json={"conversation_id": sent})
        assert r.status_code == 200, r.text
        assert r.json()["conversation_id"] == own
    assert store.calls == [("save", own), ("load", own)]


def test_conv_kv_refuses_what_names_no_conversation(served):
    base, store = served
    for sent in ("  ", True, 5.0, None, {"id": "x"}):
        r = httpx.post(base + "/v1/conv_kv/save", json={"conversation_id": sent})
        assert r.status_code == 400, (sent, r.text)
        assert r.json()["error"]["param"] == "conversation_id"
    assert store.calls == []


def test_a_derived_id_with_spaces_around_it_is_still_derived(served):
    base, store = served
    r = httpx.post(base + "/v1/conv_kv/save", json={"conversation_id": " " + DERIVED})
    assert r.status_code == 400 and r.json()["error"]["code"] == "derived_conversation_id"
    r = httpx.delete(base + "/v1/conv_kv/%20" + DERIVED)
    assert r.status_code == 400 and r.json()["error"]["code"] == "derived_conversation_id"
    assert store.calls == []


def test_delete_reads_the_path_id_as_save_does(served):
    base, store = served
    r = httpx.delete(base + "/v1/conv_kv/%20abc%20")
    assert r.status_code == 200, r.text
    assert store.calls == [("delete", "abc")]
