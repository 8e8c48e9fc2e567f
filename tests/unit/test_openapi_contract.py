"""The OpenAPI document is part of the API: schemathesis checks that the server
does what it says, with every check on, against a model-free engine.

Statuses a schema-valid body may still get: 400 (a prompt over the context, a
forced tool that is not in ``tools``, an image for a text model, a
``previous_response_id`` nobody stored: semantics no JSON schema states) and 404
(an adapter nobody mounted). No 5xx
is ever acceptable here: the fake engine is healthy and the queue is large.
"""

from __future__ import annotations

import schemathesis
from hypothesis import settings

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine

CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"max-examples": 6, "deterministic": True, "database": "none"},
        "output": {"sanitization": {"enabled": False}},
        "phases": {
            "stateful": {"max-steps": 6},
            # responses echo request fields: feeding them back makes runs flaky
            "fuzzing": {"extra-data-sources": {"responses": False}},
        },
        "checks": {
            "enabled": True,
            "max_response_time": 10.0,
            "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "404"]},
            # a body over --max-body-bytes is refused before it is read: 413
            "negative_data_rejection": {"expected-statuses": ["400", "404", "405", "413"]},
            "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx"]},
        },
    }
)


def _app():
    settings = Settings(_env_file=None, allowed_hosts="*", max_queue=4096, batch=16)
    return create_app(
        settings, lambda s, r: FakeEngine(s, r, step_delay=0.0, eos_after=3, context_length=4096)
    )


schema = schemathesis.openapi.from_asgi("/openapi.json", _app(), config=CONFIG)


@schema.parametrize()
@settings(deadline=None)
def test_every_operation_keeps_its_documented_contract(case):
    case.call_and_validate()


Workflow = schema.as_state_machine()
Workflow.TestCase.settings = settings(
    max_examples=4, stateful_step_count=6, deadline=None, database=None
)
TestStoredResponsesWorkflow = Workflow.TestCase


def test_the_middlewares_answers_are_documented_on_the_routes_they_guard():
    """The body limits' 408/413/415 on every route with a body; the Host check's 400
    (in the route's error shape) on every route when it is on."""
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=3))
    doc = app.openapi()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "400" in codes, (method, path)
            if "requestBody" in op:
                assert {"408", "413", "415"} <= codes, (method, path)
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]["408"]
    assert messages["content"]["application/json"]["schema"]["$ref"].endswith("AnthropicError")
    health = doc["paths"]["/health"]["get"]["responses"]
    assert "400" in health and "413" not in health


def test_the_document_is_built_once_while_loading_and_once_when_loaded():
    """Until the model loaded, every /openapi.json call rebuilt the whole document
    on the event loop (~25 ms each)."""
    from fastapi import FastAPI

    from app.openapi_doc import install_openapi
    from app.schemas import ChatCompletionRequest

    app = FastAPI()
    limit: list[int | None] = [None]
    install_openapi(app, Settings(_env_file=None), [ChatCompletionRequest], lambda: limit[0])
    loading = app.openapi()
    assert app.openapi() is loading  # kept, not rebuilt
    messages = loading["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
    assert "maxItems" not in messages
    limit[0] = 4096  # the model is ready: its bounds go in, once
    loaded = app.openapi()
    assert loaded is not loading and app.openapi() is loaded
    messages = loaded["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["maxItems"] == 4096
