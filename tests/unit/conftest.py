"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from tests.helpers.dialects import Served, serve_scripted
from tests.helpers.http_server import serve_app


@pytest.fixture(scope="module")
def server():
    """The scripted model-free server of the dialect tests, one per test module."""
    app = serve_scripted()
    with serve_app(app) as url:
        yield Served(url, app)
