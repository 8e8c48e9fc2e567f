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


def test_a_model_file_it_cannot_read_is_one_line_in_serve_as_in_prepare(monkeypatch, capsys):
    """An OSError reading --model (EIO, a permission) was a traceback out of serve,
    while prepare said it in one line: both now say it, with the same exit code."""
    import errno

    from engine import model_source

    def unreadable(arg):
        raise OSError(errno.EIO, "Input/output error")  # as read() raises it: no file named

    monkeypatch.setattr(model_source, "resolve_model", unreadable)
    assert main(["prepare", "--model", "/m/x.gguf"]) == 1
    assert "Input/output error" in capsys.readouterr().err
    assert main(["serve", "--model", "/m/x.gguf", "--no-log-json"]) == 1
    err = capsys.readouterr().err
    assert "kvwarm: error: cannot read the model: /m/x.gguf: Input/output error" in err
    assert "Traceback" not in err
