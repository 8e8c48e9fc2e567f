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


def _budget(weights_mib: int, cache_bytes: int | None):
    from kvcache.entries import PromptCacheConfig
    from scheduler.admission import plan_budget

    cache = PromptCacheConfig(max_bytes=cache_bytes)
    return plan_budget(
        2**30, weights_mib * 2**20, 4096, 4096, 8, 512, prompt_cache=cache.resolve_bytes
    )


@pytest.mark.parametrize("auto", [True, False])
def test_a_prompt_cache_too_large_for_the_budget_is_named_and_lasting(auto):
    """A --prompt-cache-bytes the budget could not hold was accepted and, once the
    model had loaded, "no room for KV after W MiB of weights and R MiB reserve"
    named no cache; under --memory-budget auto a MemoryError: exit 1, and the
    supervisor restarted it into the same wall for ever."""
    from engine.boot import no_room_for_kv
    from engine.model_errors import NoRoomForKV

    budget = _budget(300, 2 * 2**30)
    assert budget.kv_budget_bytes == 0 and budget.prompt_cache_bytes == 2 * 2**30
    error = no_room_for_kv(budget, cache_set=True, auto=auto)
    assert isinstance(error, NoRoomForKV)
    assert "--prompt-cache-bytes (KVWARM_PROMPT_CACHE_BYTES) takes its 2048 MiB" in str(error)


def test_a_memory_budget_is_checked_against_all_the_machine_has():
    from engine.boot import check_budget
    from engine.device_memory import DeviceMemory
    from engine.model_errors import BudgetBeyondMachine

    machine = DeviceMemory(16 * 2**30, "RAM")
    check_budget(None, machine)  # auto
    check_budget(16 * 2**30, machine)  # all of it: the user's call
    with pytest.raises(BudgetBeyondMachine, match="more than this machine's 16.0 GiB of RAM"):
        check_budget(16 * 2**30 + 1, machine)


def test_no_room_the_prompt_cache_did_not_take_keeps_its_old_verdicts():
    from engine.boot import no_room_for_kv
    from engine.model_errors import NoRoomForKV

    weights = _budget(2048, 64 * 2**20)  # the weights alone overflow: not the cache's doing
    auto = no_room_for_kv(weights, cache_set=True, auto=True)
    assert type(auto) is MemoryError and "prompt-cache" not in str(auto)
    assert isinstance(no_room_for_kv(weights, cache_set=True, auto=False), NoRoomForKV)
    assert no_room_for_kv(_budget(300, 64 * 2**20), cache_set=True, auto=True) is None


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("KVWARM_DISTRIBUTED_RANK", "-1", "--distributed-rank -1 is negative"),
        ("KVWARM_DISTRIBUTED_WORLD_SIZE", "abc", "--distributed-world-size (KVWARM_DIST"),
    ],
)
def test_a_malformed_kvwarm_rank_variable_is_refused_not_dropped(
    name, value, said, monkeypatch, capsys
):
    """The leniency meant for other tools' plain RANK / WORLD_SIZE swallowed the
    KVWARM_ names too: the value was dropped and the user told to set what they had."""
    for plain in ("RANK", "WORLD_SIZE", "MLX_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(plain, raising=False)
    monkeypatch.setenv("KVWARM_DISTRIBUTED_RANK", "0")
    monkeypatch.setenv("KVWARM_DISTRIBUTED_WORLD_SIZE", "2")
    monkeypatch.setenv(name, value)
    argv = ["serve", "--distributed", "--distributed-hosts", "127.0.0.1", "--no-log-json"]
    assert main(argv) == 2
    assert said in capsys.readouterr().err
    monkeypatch.setenv(name.removeprefix("KVWARM_DISTRIBUTED_"), value)  # another tool's
    monkeypatch.delenv(name)
    from app.settings import Settings

    settings = Settings(_env_file=None)  # not distributed: theirs, ignored
    assert settings.distributed_rank in (None, 0) and settings.distributed_world_size in (None, 2)


def test_a_misspelt_kvwarm_variable_is_refused_with_the_setting_it_may_mean(
    tmp_path, monkeypatch, capsys
):
    """extra="ignore" dropped every KVWARM_* name that is no setting: KVWARM_APIKEY
    served with no key at all, and nothing said so."""
    from app import cli

    def loads(settings):
        raise AssertionError("serve went on to load the model")

    monkeypatch.setattr(cli, "_prepare_runtime", loads)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("KVWARM_MAXQUEUE=3\n")
    monkeypatch.setenv("KVWARM_APIKEY", "secret")
    assert main(["serve", "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert "KVWARM_APIKEY in the environment (did you mean --api-key / KVWARM_API_KEY?)" in err
    assert "KVWARM_MAXQUEUE in .env (did you mean --max-queue / KVWARM_MAX_QUEUE?)" in err


def test_kvwarm_variables_that_are_no_misspelling_pass():
    """Settings (by any alias), what kvwarm and its tools read outside Settings,
    and a Kubernetes Service's links: none is refused."""
    from app.cli import _FLAGS, _flag
    from app.stray_variables import stray_variables

    env = {
        "KVWARM_API_KEY": "k",
        "KVWARM_PAIRED_HOST": "10.0.0.1",
        "KVWARM_NO_OPENBLAS": "1",
        "KVWARM_REQUIRE_TEST_TOOLS": "1",
        "KVWARM_UPSTREAM_KEY": "k",
        "KVWARM_PORT": "tcp://10.96.0.12:8080",
        "KVWARM_SERVICE_HOST": "10.96.0.12",
        "KVWARM_SERVICE_PORT_HTTP": "8080",
        "KVWARM_PORT_8080_TCP_ADDR": "10.96.0.12",
        "KVWARM_METRICS_PORT": "tcp://10.96.0.13:9090",  # a Service named kvwarm-metrics
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("os.environ", env)
        assert stray_variables({f: _flag(f) for f in _FLAGS}) is None
        env["KVWARM_METRICS_PORT"] = "9090"  # a number: no link, a setting misspelt
        assert "KVWARM_METRICS_PORT" in str(stray_variables({f: _flag(f) for f in _FLAGS}))


@pytest.mark.parametrize("value", ["-5", "0", "many"])
def test_chat_refuses_a_reply_limit_no_server_takes(value, capsys):
    """--max-tokens -5 started the REPL, and every turn then came back a 400."""
    from app.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["chat", "--max-tokens", value])
    assert exit_.value.code == 2
    assert f"--max-tokens: {value!r} is not a whole number of at least 1" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("host", ["ftp://127.0.0.1:1", "file:///tmp/x", "ws://h:1"])
def test_chat_refuses_a_url_it_could_never_reach(host, monkeypatch, capsys):
    """ftp://... said "will retry on the next message", of a URL no turn can reach."""
    from app import chat_repl

    def repl(*args):
        raise AssertionError("the REPL started")

    monkeypatch.setattr(chat_repl, "ChatRepl", repl)
    assert main(["chat", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvwarm: error: --host {host!r}: a ") and "http://" in err


class _Started(Exception):
    """serve got past its checks to where it binds the port (the model not loaded)."""


def _serve_stubbed(monkeypatch, tmp_path) -> None:
    """serve up to the port check, with no model, BLAS or logging set up; no .env,
    launcher or cache-dir variable of this machine's in the way."""
    from types import SimpleNamespace

    from app import cli, lifecycle

    monkeypatch.chdir(tmp_path)
    for name in ("KVWARM_CACHE_DIR", "RANK", "WORLD_SIZE", "MLX_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    blas = SimpleNamespace(describe=lambda: "stub")
    # a model its headers pass: serve checks them before the port
    source = SimpleNamespace(
        path=_model_dir(tmp_path / "model", '{"model_type": "llama"}'), kind="mlx"
    )
    monkeypatch.setattr(cli, "_prepare_runtime", lambda settings: (blas, source))

    def unbindable(host, port):
        raise _Started

    monkeypatch.setattr(lifecycle, "unbindable", unbindable)


@pytest.mark.parametrize("size", [[], ["--kv-disk-bytes", "1GB"]])
def test_a_kv_dir_it_cannot_make_is_refused_before_the_model_loads(
    size, tmp_path, monkeypatch, capsys
):
    """Under auto sizing a --kv-dir it cannot make came to 0 bytes: the SSD tier
    quietly off; with a size the folder failed only once the model had loaded
    (exit 1, which a supervisor restarted for ever)."""
    _serve_stubbed(monkeypatch, tmp_path)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for kv_dir in (blocker, blocker / "kv"):
        assert main(["serve", "--no-log-json", "--kv-dir", str(kv_dir), *size]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvwarm: error: --kv-dir {kv_dir}: ") and "--kv-disk-bytes 0" in err
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the default place, chosen by size
    if size:
        assert main(["serve", "--no-log-json", *size]) == 2
        assert f"--kv-dir {blocker / 'kvwarm' / 'kv'}: " in capsys.readouterr().err
    for off in (["--kv-disk-bytes", "0"], ["--prompt-cache-bytes", "0"]):  # no SSD tier
        with pytest.raises(_Started):
            main(["serve", "--no-log-json", "--kv-dir", str(blocker / "kv"), *off])
    made = tmp_path / "new" / "kv"
    with pytest.raises(_Started):
        main(["serve", "--no-log-json", "--kv-dir", str(made), *size])
    assert made.is_dir()  # made as the engine would have


def test_the_default_kv_dir_unusable_is_said_not_refused(tmp_path, monkeypatch, caplog):
    """Nothing chosen (no --kv-dir, --cache-dir or size): a home it cannot write keeps
    serving with KV in RAM only, as before, but says so at start."""
    _serve_stubbed(monkeypatch, tmp_path)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with caplog.at_level("WARNING", logger="kvwarm"), pytest.raises(_Started):
        main(["serve", "--no-log-json"])
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("SSD tier" in m and str(blocker / "kvwarm" / "kv") in m for m in said), said


def test_an_adapter_it_could_not_mount_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    """--adapter ID=/nonexistent was read only once the model had loaded: exit 1,
    which a supervisor restarted for ever into the same missing folder."""
    import json

    _serve_stubbed(monkeypatch, tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 20.0}}
    (good / "adapter_config.json").write_text(json.dumps(config))
    (good / "adapters.safetensors").write_bytes(b"")  # its tensors are the mount's to check
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps(config))
    cases = {
        str(tmp_path / "nonexistent"): "is not a directory",
        str(no_weights): "has no adapters.safetensors",
        str(tmp_path): "has no adapter_config.json",
        "~no-such-user-kvwarm/a": "no such home directory",
    }
    for path, why in cases.items():
        argv = ["serve", "--no-log-json", "--adapter", f"ok={good}", "--adapter", f"sql={path}"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvwarm: error: --adapter sql={path}: ") and why in err, err
        assert "Traceback" not in err
    with pytest.raises(_Started):
        main(["serve", "--no-log-json", "--adapter", f"ok={good}"])


def _warnings(caplog, argv: list[str]) -> list[str]:
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvwarm"), pytest.raises(_Started):
        main(["serve", "--no-log-json", *argv])
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_flags_that_need_another_are_named_once_when_it_is_missing(tmp_path, monkeypatch, caplog):
    """--kv-group-size and --quantized-kv-start without --kv-bits, or a --distributed-*
    flag on a server alone, were dropped without a word: the user believed them on."""
    _serve_stubbed(monkeypatch, tmp_path)
    monkeypatch.setenv("KVWARM_DISTRIBUTED_PORT", "4000")  # the environment is set too
    said = _warnings(
        caplog,
        ["--kv-group-size", "32", "--quantized-kv-start", "128", "--distributed-mode", "tensor"],
    )
    ignored = [m for m in said if "ignored" in m]
    assert len(ignored) == 1, said
    for flag in ("--kv-group-size", "--quantized-kv-start", "--distributed-mode"):
        assert flag in ignored[0]
    assert "--distributed-port (KVWARM_DISTRIBUTED_PORT)" in ignored[0]
    assert "--kv-bits" in ignored[0] and "--distributed" in ignored[0]
    assert "--distributed-rank" not in ignored[0] and "--batch" not in ignored[0]
    monkeypatch.delenv("KVWARM_DISTRIBUTED_PORT")
    # what they need is there, or nothing was set: not a word
    assert _warnings(caplog, ["--kv-bits", "8", "--kv-group-size", "32"]) == []
    # a launcher's or another tool's RANK / WORLD_SIZE are read leniently, not the user's
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _warnings(caplog, []) == []
    said = _warnings(caplog, ["--no-distributed", "--distributed-rank", "1"])
    assert len(said) == 1 and "--distributed-rank" in said[0]
    assert "--distributed-world-size" not in said[0]


def _serve_help(capsys) -> dict[str, str]:
    """`kvwarm serve --help`, each flag's help on one line, by flag."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    lines = capsys.readouterr().out.split("\n  --")[1:]
    return {line.split()[0]: " ".join(line.split()[1:]) for line in lines}


def test_a_flag_whose_help_says_its_default_says_it_once(capsys):
    """--model read "(default: the embedded SmolLM2 ...) [default: none; ...]": two
    defaults, and "none" the wrong one (as for --cors-origins, --kv-bits, ...)."""
    helps = _serve_help(capsys)
    model = helps["model"]
    assert model.count("default") == 1 and "SmolLM2-135M-Instruct" in model
    assert "[env KVWARM_MODEL]" in model
    for flag in ("cache-dir", "kv-bits", "cors-origins", "min-pixels", "allowed-hosts"):
        assert "[default: none" not in helps[flag], flag
    assert "[default: none; env KVWARM_API_KEY]" in helps["api-key"]  # none is its default


def test_the_help_names_the_gguf_architectures_as_the_gguf_ones(capsys):
    """ "(llama, qwen2, ...)" read as all --model could load: it is the GGUF
    converter's list; an mlx-lm directory takes any architecture mlx-lm has."""
    from engine.gguf_archs import ARCHS

    model = _serve_help(capsys)["model"]
    assert f"(GGUF: {', '.join(ARCHS)})" in model and "mlx-lm" in model


def test_the_auto_memory_budget_help_says_what_auto_budget_does(capsys):
    """It said "CUDA memory": auto_budget takes 90% of it."""
    from engine.device_memory import GPU_FRACTION, LINUX_RAM_FRACTION

    budget = _serve_help(capsys)["memory-budget"]
    assert f"{GPU_FRACTION:.0%} of CUDA device memory" in budget
    assert f"{LINUX_RAM_FRACTION:.0%} of the RAM available" in budget
    assert "Metal's recommended working set" in budget


def test_a_settings_description_says_percent_as_it_is_read():
    """The descriptions wrote "75%%" for argparse's sake, and the CLI's escaping
    (.replace("%%", "%%")) did nothing: the doubled sign showed wherever else the
    description is read (the settings' schema)."""
    from app.settings import Settings

    schema = Settings.model_json_schema()["properties"]
    assert all("%%" not in str(p.get("description")) for p in schema.values())


@pytest.mark.parametrize(
    "host", ["127.0.0.1:8080", "http://0.0.0.0", "0.0.0.0/0", "mybox.lan:80", "[::1]:8080"]
)
def test_a_host_with_a_port_scheme_or_prefix_is_a_settings_error(host, capsys):
    """They ended in "cannot resolve --host ...", exit 1: a supervisor retried for
    ever what no start could bind. Refused at once, pointing at --port."""
    assert main(["serve", "--host", host, "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwarm: error: invalid settings: --host") and "--port" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("host", ["::1", "[::1]", "fe80::1%eth0", "::"])
def test_an_ipv6_host_is_no_port(host):
    from app.settings import Settings

    assert Settings(_env_file=None, host=host).host == host.strip("[]")


@pytest.mark.parametrize("key", ["", " abc ", "abc\n", "\tabc"])
def test_an_empty_key_or_one_with_surrounding_blanks_is_refused(key, monkeypatch, capsys):
    """--api-key "$KEY" with KEY unset served with no key at all, and a key with
    blanks around it never matched (the presented one is stripped): every call 401."""
    from app import cli

    def loads(settings):
        raise AssertionError("serve went on to load the model")

    monkeypatch.setattr(cli, "_prepare_runtime", loads)
    monkeypatch.delenv("KVWARM_API_KEY", raising=False)
    assert main(["serve", "--api-key", key, "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwarm: error: invalid settings: --api-key (KVWARM_API_KEY)")
    assert err.count("\n") == 1
    from app.settings import Settings

    assert Settings(_env_file=None, api_key="a b").api_key == "a b"  # inner blanks are its own


@pytest.mark.parametrize("line", ["KVWARM_API_KEY secret", "KVWARM_PORT: 9100", 'KVWARM_X="open'])
def test_a_kvwarm_line_of_env_that_does_not_parse_is_refused(line, tmp_path, monkeypatch, capsys):
    """python-dotenv dropped such a line with a warning of its own, and the server
    started without the key (or on another port) it was meant to set."""
    from app import cli

    def loads(settings):
        raise AssertionError("serve went on to load the model")

    monkeypatch.setattr(cli, "_prepare_runtime", loads)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text(f"# a comment\nOTHER_TOOL x\n{line}\nKVWARM_BATCH=2\n")
    assert main(["serve", "--no-log-json"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("kvwarm: error: ") and f"line 3 of .env ({line!r})" in err
    assert "NAME=VALUE" in err


def _no_http(monkeypatch) -> None:
    """Make binding (create_app) fail the test: the refusal must come before it."""
    from app import server

    def binds(*args, **kwargs):
        raise AssertionError("serve went on to build the HTTP app")

    monkeypatch.setattr(server, "create_app", binds)


def _model_dir(path, config: str, weights: bytes | None = None):
    from tests.unit.test_fit import write_safetensors

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(config)
    write_safetensors(path / "model.safetensors", {"w": ("F16", [4])})
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    return path


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("foomodel", "no 'foomodel' model class"),
        ("five bytes", "model.safetensors: truncated"),
        ("data cut", "model.safetensors: truncated"),
    ],
)
def test_a_model_its_headers_refuse_is_refused_before_http(
    case, fragment, tmp_path, monkeypatch, capsys
):
    """An unknown model_type or a truncated weight file bound the port, said
    loading, then died in tracebacks ("Unable to read 3 bytes from file", naming
    no file): one line now, exit 2, nothing bound, as `kvwarm prepare` says it."""
    from tests.unit.test_fit import write_safetensors

    _no_http(monkeypatch)
    model = _model_dir(tmp_path / "m", '{"model_type": "foomodel"}')
    if case != "foomodel":
        model = _model_dir(tmp_path / "m", '{"model_type": "llama"}')
        write_safetensors(model / "model.safetensors", {"w": ("F16", [64])})
        whole = (model / "model.safetensors").read_bytes()
        cut = whole[:5] if case == "five bytes" else whole[:-3]
        (model / "model.safetensors").write_bytes(cut)
    assert main(["serve", "--model", str(model), "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert f"kvwarm: error: {model}" in err and fragment in err and "Traceback" not in err
    assert main(["prepare", "--model", str(model)]) == 2  # the same check
    assert fragment in capsys.readouterr().err


def test_a_memory_budget_beyond_the_machine_is_refused_before_http(monkeypatch, capsys):
    """--memory-budget 10TB bound the port, said loading, then a traceback, exit 2."""
    _no_http(monkeypatch)
    from types import SimpleNamespace

    from app import cli

    blas = SimpleNamespace(describe=lambda: "stub")
    source = SimpleNamespace(path="/nonexistent-model", kind="mlx")  # the budget comes first
    monkeypatch.setattr(cli, "_prepare_runtime", lambda settings: (blas, source))
    assert main(["serve", "--memory-budget", "10PB", "--no-log-json"]) == 2
    err = capsys.readouterr().err
    assert "kvwarm: error: --memory-budget" in err and "more than this machine's" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "host, url", [("::1", "http://[::1]:18948"), ("127.0.0.1", "http://127.0.0.1:18948")]
)
def test_the_start_line_says_listening_and_loading_with_a_url_one_can_open(
    host, url, tmp_path, monkeypatch, caplog
):
    """It said "kvwarm serving on http://::1:18948" (no URL) before the model
    had loaded, while /health still answered 503."""
    import logging

    from app import lifecycle, server

    _serve_stubbed(monkeypatch, tmp_path)
    monkeypatch.setattr(lifecycle, "unbindable", lambda *args, **kwargs: None)
    monkeypatch.setattr(server, "create_app", lambda settings, factory: object())
    monkeypatch.setattr(lifecycle, "server_config", lambda app, settings: None)

    class Server:
        def __init__(self, *args):
            pass

        def run(self):
            raise _Started

    monkeypatch.setattr(lifecycle, "GracefulServer", Server)
    with caplog.at_level(logging.INFO, logger="kvwarm"), pytest.raises(_Started):
        main(["serve", "--no-log-json", "--host", host, "--port", "18948"])
    (line,) = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert line.startswith(f"kvwarm listening on {url}") and "loading model" in line
    assert "serving" not in line


def test_the_model_help_names_hub_ids(capsys):
    """--model resolves org/name from the Hugging Face hub cache, as README says;
    the help named only directories and .gguf files."""
    model = _serve_help(capsys)["model"]
    assert "Hugging Face hub" in model and "org/name" in model
