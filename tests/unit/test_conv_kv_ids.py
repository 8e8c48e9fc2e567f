"""Conversation ids at /v1/conv_kv: the ids chat requests use, and the derived
``auto-`` ids no client owns."""

from __future__ import annotations

from concurrent.futures import Future

import httpx
import pytest

from app.session_id import session_id_from
from kvcache.interface import ConversationNotFound, SavedConversation
from kvcache.sessions import DERIVED_PREFIX, fallback_session_id, is_derived_id
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
        if conversation_id not in self.saved and is_derived_id(conversation_id):
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


def test_derived_ids_have_the_reserved_shape():
    for head in ([], [1], list(range(200))):
        assert is_derived_id(fallback_session_id(head))


def test_a_derived_id_is_neither_saved_nor_deleted_but_loads(served):
    """Every client without a conversation id whose prompt starts alike shares its
    derived id: a save pinned whichever client's turn was longest, a delete forgot
    all their KV. A load only warms the cache, so it stays."""
    base, store = served
    chat = httpx.post(base + CHAT, json={"messages": msgs(), "max_tokens": 2})
    derived = chat.headers["x-conv-id"]
    assert is_derived_id(derived)
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
        ({"conversation_id": DERIVED}, {}, "conversation_id"),
        ({"metadata": {"session_id": f" {DERIVED}"}}, {}, "metadata.session_id"),
        ({"extra_body": {"conversation": {"id": DERIVED}}}, {}, "extra_body.conversation"),
        ({"prompt_cache_key": DERIVED}, {}, "prompt_cache_key"),
        ({"metadata": {"user_id": f"user_1_session_{DERIVED}"}}, {}, "metadata.user_id"),
        ({}, {"X-Session-Id": DERIVED}, None),
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


@pytest.mark.parametrize(
    "sent",
    ["my-auto-1", "Auto-1", "auto-summarizer", "auto-", DERIVED + "0", DERIVED.upper()],
)
def test_ids_not_of_the_derived_shape_are_the_clients_own(sent):
    """OpenAI takes any prompt_cache_key and metadata value ("auto-summarizer"
    included): only the derived ids' exact shape is reserved."""
    assert session_id_from({"conversation_id": sent}, {}) == sent
    assert session_id_from({"prompt_cache_key": sent}, {}) == sent
    assert session_id_from({"metadata": {"conversation_id": sent}}, {}) == sent


def test_a_clients_own_auto_named_conversation_saves_and_deletes(served):
    base, store = served
    own = "auto-summarizer"
    saved = httpx.post(base + "/v1/conv_kv/save", json={"conversation_id": own})
    deleted = httpx.delete(base + "/v1/conv_kv/" + own)
    assert (saved.status_code, deleted.status_code) == (200, 200), (saved.text, deleted.text)
    assert store.calls == [("save", own), ("delete", own)]


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
