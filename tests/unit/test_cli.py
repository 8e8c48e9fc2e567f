"""`kvwarm serve` / `kvwarm chat` refusing what can never work: one line, exit 2."""

from __future__ import annotations

import pytest

from app.cli import main


@pytest.mark.parametrize("host", ["192.168..1", "..", "a" * 64 + ".lan"])
def test_a_host_name_idna_cannot_encode_is_a_settings_error(host, capsys):
    """getaddrinfo raised UnicodeError ("encoding with 'idna' codec failed") out of
    the start-up: a traceback and exit 1, which a supervisor retried for ever."""
    from app.lifecycle import unbindable

    assert main(["serve", "--host", host, "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwarm: error: invalid settings: --host") and "Traceback" not in err
    problem = unbindable(host, 8080)  # a caller that skipped the settings: lasting too
    assert problem is not None and problem.lasting
