"""`kvwarm serve` / `kvwarm prepare`: the composition root.

This is the one place the HTTP layer meets the engine: it preloads OpenBLAS
before anything imports mlx, validates --model, and hands the app a factory
that builds the engine thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ByteSize, ValidationError

from app.settings import Settings

if TYPE_CHECKING:
    from engine.boot_deadline import BootDeadline
    from engine.model_source import ModelSource

log = logging.getLogger("kvwarm")
LEAVE_GROUP_S = 0.5  # a distributed rank waits this long for its last sends before exiting

_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"metavar": "PATH"},
    "host": {},
    "port": {"type": int},
    "batch": {"type": int, "metavar": "N"},
    "memory_budget": {"metavar": "SIZE"},
    "max_queue": {"type": int, "metavar": "N"},
    "max_tokens": {"type": int, "metavar": "N"},
    "prefill_step_size": {"type": int, "metavar": "N"},
    "max_step_ms": {"metavar": "MS"},
    "log_level": {"type": str.lower, "choices": ["debug", "info", "warning", "error"]},
    "log_json": {"action": argparse.BooleanOptionalAction},  # --no-*: undo the env
    "cache_trace_dir": {"metavar": "DIR"},
    "api_key": {"metavar": "KEY"},
    "max_body_bytes": {"metavar": "SIZE"},
    "max_bodies_bytes": {"metavar": "SIZE"},
    "body_timeout": {"type": float, "metavar": "SECONDS"},
    "header_timeout": {"type": float, "metavar": "SECONDS"},
    "prompt_cache_bytes": {"metavar": "SIZE"},
    "prompt_cache_ttl": {"type": float, "metavar": "SECONDS"},
    "cache_block_size": {"type": int, "metavar": "N"},
    "volatile_policy": {"choices": ["reuse", "strict", "relocate"]},
    "cache_dir": {"metavar": "DIR"},
    "kv_dir": {"metavar": "DIR"},
    "kv_disk_bytes": {"metavar": "SIZE"},
    "kv_tier": {"metavar": "KIND"},
    "kv_block_size": {"type": int, "metavar": "N"},
    "kv_eviction": {"choices": ["cost-aware", "lru"]},
    "kv_bits": {"type": int, "choices": [4, 8]},
    "kv_group_size": {"type": int, "choices": [32, 64, 128]},
    "quantized_kv_start": {"type": int, "metavar": "N"},
    "request_timeout": {"type": float, "metavar": "SECONDS"},
    "stall_timeout": {"type": float, "metavar": "SECONDS"},
    "thinking": {"choices": ["on", "off"]},
    "strip_thinking": {"action": argparse.BooleanOptionalAction},  # --no-*: undo the env
    "adapter": {"action": "append", "metavar": "ID=PATH"},
    "model_dir": {"action": "append", "metavar": "DIR"},
    "shutdown_timeout": {"type": float, "metavar": "SECONDS"},
    "allowed_hosts": {"metavar": "HOSTS"},
    "cors_origins": {"metavar": "ORIGINS"},
    "vision": {"choices": ["auto", "on", "off"]},
    "images": {"choices": ["reject", "placeholder"]},
    "max_images": {"type": int, "metavar": "N"},
    "max_image_bytes": {"metavar": "SIZE"},
    "max_images_bytes": {"metavar": "SIZE"},
    "max_image_inputs_bytes": {"metavar": "SIZE"},
    "max_image_pixels": {"type": int, "metavar": "N"},
    "min_pixels": {"type": int, "metavar": "N"},
    "max_pixels": {"type": int, "metavar": "N"},
    "fetch_urls": {"action": argparse.BooleanOptionalAction},
    "fetch_private_urls": {"action": argparse.BooleanOptionalAction},
    "fetch_timeout": {"type": float, "metavar": "SECONDS"},
    "allowed_media_domains": {"metavar": "DOMAINS"},
    "video_frames": {"type": int, "metavar": "N"},
    "max_video_bytes": {"metavar": "SIZE"},
    "distributed": {"action": argparse.BooleanOptionalAction},  # --no-*: undo the env
    "distributed_mode": {"choices": ["auto", "tensor", "pipeline"]},
    "distributed_server_rank": {"type": int, "metavar": "RANK"},
    "distributed_backend": {"choices": ["any", "ring", "jaccl", "mpi"]},
    "distributed_rank": {"type": int, "metavar": "RANK"},
    "distributed_world_size": {"type": int, "metavar": "N"},
    "distributed_hosts": {"metavar": "HOSTS"},
    "distributed_port": {"type": int, "metavar": "PORT"},
    "rank_timeout": {"type": float, "metavar": "SECONDS"},
    "distributed_boot_timeout": {"type": float, "metavar": "SECONDS"},
}


def _add_settings_flags(parser: argparse.ArgumentParser, names: list[str]) -> None:
    for name in names:
        field = Settings.model_fields[name]
        flag = _flag(name)
        default = field.default if field.default_factory is None else "none"
        if default is None:
            # unset means what the description says ("default: off"), else nothing
            said = "" if "default" in (field.description or "") else "default: none; "
        elif isinstance(default, ByteSize):
            said = f"default: {default.human_readable(separator=' ')}; "
        else:
            said = f"default: {getattr(default, 'value', default)}; "
        # argparse %-formats help: a description's "90%" must reach it as "90%%"
        help_text = f"{field.description} [{said}env KVWARM_{name.upper()}]".replace("%", "%%")
        parser.add_argument(flag, dest=name, default=None, help=help_text, **_FLAGS[name])


def _positive_int(text: str) -> int:
    """A count of at least 1 (chat's --max-tokens 0 or -5 had every turn refused)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwarm",
        description="KV-cache-aware OpenAI-compatible inference server on MLX. "
        "Every flag can also be set as a KVWARM_* environment variable or in a .env file; "
        "flags win over the environment.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="start the HTTP server",
        description="Serve one model over OpenAI chat completions, Responses and completions and "
        "Anthropic Messages, with Prometheus /metrics (OpenTelemetry when OTEL_* is set).",
    )
    _add_settings_flags(serve, list(_FLAGS))
    prepare = sub.add_parser(
        "prepare",
        help="convert/load-check the model once and exit (used by `make serve`)",
        description="Convert a GGUF model (the default one included) into the MLX cache dir, "
        "or check an MLX model directory's config and weight headers, and print its path.",
    )
    _add_settings_flags(prepare, ["model", "cache_dir", "log_level"])
    fit = sub.add_parser(
        "fit",
        help="will a model fit this machine, how much context, how fast (no server)",
        description="Assess models without loading them (config and weight-file headers "
        "only): size, parameters, quantisation, the context admission would allow on this "
        "machine, and the predicted decode rate. With no MODEL, lists the models in the "
        "Hugging Face hub cache, kvwarm's model cache and --model-dir folders.",
    )
    fit.add_argument("models", nargs="*", metavar="MODEL", help="model directories or .gguf files")
    fit.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fit.add_argument(
        "--matrix", action="store_true", help="also show which Apple memory sizes run each"
    )
    _add_settings_flags(fit, ["model_dir", "cache_dir", "log_level"])
    chat = sub.add_parser(
        "chat",
        help="chat with kvwarm or any OpenAI-compatible server from the terminal",
        description="A terminal REPL against any OpenAI-compatible server. Replies stream as "
        "they are generated, reasoning shown apart from the answer, and each turn ends with "
        "TTFT, tokens/s and the prompt tokens the server had cached. In the prompt: "
        '""" alone on a line opens or closes a message of several lines, a line ending in '
        "\\ goes on to the next, image:PATH attaches an image (several allowed), /reset or "
        "Ctrl-N starts a new conversation, /quit, /exit or Ctrl-D leaves, Ctrl-C drops the "
        "line being typed or stops a streaming reply.",
    )
    chat.add_argument(
        "--host",
        metavar="URL",
        help="server base URL or HOST:PORT; /v1 is appended to a URL without a path "
        "[default: KVWARM_HOST and KVWARM_PORT from the environment or ./.env, as the "
        "server reads them, else http://127.0.0.1:8080]",
    )
    chat.add_argument(
        "--api-key",
        metavar="KEY",
        help="bearer token [default: KVWARM_API_KEY from the environment or ./.env, else "
        "OPENAI_API_KEY]",
    )
    chat.add_argument(
        "--model", metavar="ID", help="model to ask for [default: the first id of GET /v1/models]"
    )
    chat.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="reply length limit [default: %(default)s]",
    )
    chat.add_argument("--system", metavar="TEXT", help="system prompt of every conversation")
    return parser


# the settings each command besides serve reads: a bad value of any other one (a
# server setting in .env) is the server's business, not a reason to refuse them
READS = {
    "prepare": frozenset({"model", "cache_dir", "log_level", "log_json"}),
    "fit": frozenset({"model_dir", "cache_dir", "log_level", "log_json"}),
}


def load_settings(args: argparse.Namespace) -> Settings:
    local = {"command", "models", "json", "matrix"}  # the fit command's own arguments
    overrides = {k: v for k, v in vars(args).items() if k not in local and v is not None}
    try:
        return Settings(**overrides)
    except ValidationError:
        reads = READS.get(args.command)
        if reads is None:
            raise
        # what this command never reads keeps its default (a keyword beats .env): a
        # bad server setting, alone or against another one, is not its business; a
        # bad one it reads is still refused
        defaults = {
            f: info.get_default(call_default_factory=True)
            for f, info in Settings.model_fields.items()
            if f not in reads
        }
        return Settings(**{**defaults, **overrides})


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _named(field: str) -> str:
    """A setting under the names a user sets it by: flag and variable."""
    return f"{_flag(field)} (KVWARM_{field.upper()})"


def describe_invalid(exc: ValidationError) -> str:
    """Each bad setting under the names a user sets it by (flag and variable), once:
    not pydantic's field paths and one line per branch of a union."""
    said: dict[str, list[str]] = {}
    for error in exc.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        name = ""
        if error["loc"]:
            field = str(error["loc"][0])
            name = _named(field)
        if message not in said.setdefault(name, []):
            said[name].append(message)
    return "; ".join(
        f"{name}: {' or '.join(messages)}" if name else " or ".join(messages)
        for name, messages in said.items()
    )


# exit 2: the settings are wrong (a supervisor retrying gains nothing); exit 1: this
# start failed for now (a peer not up, the port still held, the engine died): retry
USAGE, NOT_NOW = 2, 1


def _fail(message: str, code: int = USAGE) -> int:
    print(f"kvwarm: error: {message}", file=sys.stderr)
    return code


def _prepare_runtime(settings: Settings):
    """Logging, BLAS and model resolution; must run before any mlx import."""
    from engine.blas import preload_openblas
    from engine.model_source import resolve_model
    from observability.logging_setup import setup_logging

    setup_logging(settings.log_level, settings.log_json)
    blas = preload_openblas()
    log.info("BLAS for MLX: %s", blas.describe())
    return blas, resolve_model(settings.model)


def cmd_prepare(settings: Settings) -> int:
    from engine.model_errors import UnsupportedModelError

    try:
        _, source = _prepare_runtime(settings)
        from engine.loader import prepare_model_dir

        path = prepare_model_dir(source)
    except UnsupportedModelError as exc:
        return _fail(str(exc))
    except OSError as exc:  # a cache folder it cannot write, a full disk: said, no traceback
        return _fail(
            f"cannot prepare the model: {_os_problem(exc)} (converted models are "
            f"kept under --cache-dir, now {settings.cache_root})",
            NOT_NOW,
        )
    problem = _unloadable(path)
    if problem:
        return _fail(problem)
    print(path)
    return 0


def _os_problem(exc: OSError, path: str | None = None) -> str:
    """An OSError as one line: the file it names (a read names none: ``path``), then why."""
    where = exc.filename or path
    return f"{where}: {exc.strerror or exc}" if where else str(exc.strerror or exc)


def _unloadable(path: Path, lenient: bool = False) -> str | None:
    """Why serve would refuse the model, as far as its config and weight headers
    tell (no weights are read): prepare is `make serve`'s check step. ``lenient``:
    a header this reader cannot take (no NotAModel) is left to the load to judge."""
    from app.model_library import model_facts
    from engine.model_errors import NotAModel

    try:
        found = model_facts(path)
    except NotAModel as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken file said, not raised
        return None if lenient else f"{path}: unreadable: {exc}"
    if not found.vision and not found.supported:  # a vision model's text half may still serve
        return f"{path}: {found.why_unsupported}"
    return None


def _unservable(settings: Settings, source: ModelSource) -> str | None:
    """What refuses this start whatever the moment, as far as the settings and the
    model's headers tell: said before the port is bound and the model loads (it was
    a traceback once /health answered). No mlx import unless a budget is set."""
    if settings.memory_budget_bytes is not None:
        from engine.boot import check_budget
        from engine.device_memory import machine_memory
        from engine.model_errors import BudgetBeyondMachine

        try:
            check_budget(settings.memory_budget_bytes, machine_memory())
        except BudgetBeyondMachine as exc:
            return str(exc)
    if source.kind == "gguf":  # resolve_model read its header; converting it is the engine's
        return None
    return _unloadable(source.path, lenient=True)


def cmd_fit(settings: Settings, models: list[str], as_json: bool, matrix: bool) -> int:
    from engine.blas import preload_openblas
    from observability.logging_setup import setup_logging

    setup_logging(settings.log_level, settings.log_json)
    preload_openblas()  # before mlx: the bandwidth pass uses the BLAS decode uses
    from app.fit_cli import run_fit

    return run_fit(models, settings.model_dirs, as_json, matrix)


def cmd_serve(settings: Settings) -> int:
    from engine.boot_deadline import BootDeadline

    boot = BootDeadline()  # armed once a distributed rank starts to join its group
    try:
        return _serve(settings, boot)
    finally:
        boot.done()  # however the start ended: no watchdog left armed behind it


def _serve(settings: Settings, boot: BootDeadline) -> int:
    from app.lifecycle import GracefulServer, raise_open_files_limit, server_config, unbindable
    from app.server import create_app
    from app.stray_variables import stray_variables
    from engine.distributed_config import share_cpu_threads
    from engine.engine_thread import EngineConfig, EngineThread
    from engine.model_errors import LastingLoadError, UnsupportedModelError

    problem = (
        stray_variables({field: _flag(field) for field in _FLAGS})
        or _unwritable("--cache-trace-dir", settings.cache_trace_dir)
        or _unmountable(settings.adapter)
    )
    kv_problem = _unusable_kv_dir(settings)
    # a place or size the user chose is refused now, not once the model has loaded
    # (exit 1, restarted for ever); the default place only said, as it served before
    chosen = {"kv_dir", "cache_dir", "kv_disk_bytes"} & settings.model_fields_set
    if problem is None and kv_problem is not None and chosen:
        problem = f"{kv_problem} (name a folder it can write, or --kv-disk-bytes 0 for RAM only)"
    if problem is not None:
        return _fail(problem)
    dist = settings.distributed_config
    shared = share_cpu_threads(dist) if dist is not None else None  # before BLAS loads
    try:
        blas, source = _prepare_runtime(settings)
    except UnsupportedModelError as exc:
        return _fail(str(exc))
    except OSError as exc:  # the model file unreadable (EIO, a permission): exit 1, as prepare
        return _fail(f"cannot read the model: {_os_problem(exc, settings.model)}", NOT_NOW)
    problem = _unservable(settings, source)
    if problem is not None:
        return _fail(problem)
    if shared:
        log.info("distributed: %s", shared)
    ignored = settings.ignored_settings()
    if ignored:  # a warning, not a refusal: a .env shared with a group's ranks may hold them
        log.warning(
            "ignored: %s",
            "; ".join(
                f"{', '.join(_named(f) for f in fields)} (only with {need})"
                for need, fields in ignored.items()
            ),
        )
    if kv_problem is not None:
        log.warning(
            "KV SSD tier off, prefix cache in RAM only: %s (--kv-dir names another folder)",
            kv_problem,
        )

    config = EngineConfig(
        source=source,
        max_batch=settings.batch,
        prefill_step_size=settings.prefill_step_size,
        max_step_ms=None if settings.max_step_ms == "auto" else float(settings.max_step_ms),
        memory_budget_bytes=settings.memory_budget_bytes,
        blas=blas.describe(),
        prompt_cache=settings.prompt_cache,
        kv_dir=settings.kv_disk_path,
        kv_disk_bytes=settings.kv_disk_limit,
        kv_quant=settings.kv_quant,
        kv_tier=settings.kv_tier,
        adapters=settings.adapters,
        vision=settings.vision,
        image_pixels=(settings.min_pixels, settings.max_pixels),
    )
    if dist is not None:
        if settings.adapters:
            return _fail("--adapter is not available on a distributed group")
        if settings.vision == "on":
            return _fail("--vision on is not available on a distributed group")
        from engine.distributed import RankGroup

        log.info(
            "joining a distributed group (%s mode, rank %s serves HTTP): waiting for every rank%s",
            dist.mode,
            dist.server_rank,
            f" (at most {dist.boot_timeout_s:.0f} s until the group is up)"
            if dist.boot_timeout_s
            else "",
        )
        boot.start(dist.boot_timeout_s)
        try:
            group = RankGroup.join(dist, boot)
        except ValueError as exc:  # its rank, world size or hosts: the settings
            return _fail(f"cannot join the distributed group: {exc}")
        except RuntimeError as exc:  # the transport: its peers are not up yet
            return _fail(f"cannot join the distributed group: {exc}", NOT_NOW)
        config = replace(config, distributed=dist, group=group)
        if not group.serving:
            from app.lifecycle import stopping_s
            from engine.rank_worker import run_worker

            try:  # a stop signal reaches every rank: it follows the serving rank's stop
                code = run_worker(config, stopping_s(settings.shutdown_timeout))
            except KeyboardInterrupt:  # Ctrl-C through mlx.launch: leave as the others do
                code = 130
            except LastingLoadError as exc:  # the next start fails alike: the unit stays down
                log.error("rank %d cannot start with these settings: %s", group.rank, exc)
                code = USAGE
            except Exception as exc:  # noqa: BLE001 - said once, then a non-zero exit
                log.error("rank %d could not start: %s", group.rank, exc)
                code = 1
            return _leave_group(code)
    problem = unbindable(settings.host, settings.port)  # the serving rank's, before loading
    if problem is None and dist is not None:  # and its heartbeat's (engine.group_boot.lead)
        from engine.distributed_config import heartbeat_port

        problem = unbindable(
            "0.0.0.0",
            heartbeat_port(dist, group.size),
            "--distributed-port (the heartbeat listens on the port after the ring's)",
        )
    if problem is not None:  # the port may be free on the next start; a permission not
        code = _fail(problem.message, USAGE if problem.lasting else NOT_NOW)
        return _leave_group(code) if dist is not None else code
    server: GracefulServer | None = None
    load_failure: list[tuple[str, bool]] = []

    def on_load_failure(reason: str, lasting: bool) -> None:
        load_failure.append((reason, lasting))
        if server is not None:
            server.should_exit = True

    def on_fatal(reason: str) -> None:
        if server is not None:
            server.engine_died(reason)

    def engine_factory(scheduler, router):
        return EngineThread(
            config, scheduler, router, on_load_failure=on_load_failure, on_fatal=on_fatal
        )

    app = create_app(settings, engine_factory)
    warning = _open_bind_warning(settings)
    if warning:
        log.warning("%s", warning)
    before, after = raise_open_files_limit()
    if after > before:
        log.info("open files limit raised from %d to %d (one per connection)", before, after)
    elif after < 4096:
        log.warning("open files limit is %d: at most about that many connections at once", after)
    server = GracefulServer(server_config(app, settings), app, settings.shutdown_timeout)
    log.info(  # bound next, but not serving yet: the engine says "ready" once loaded
        "kvwarm listening on http://%s:%d (batch %d, queue %d), loading model %s "
        "(/health answers 503 until it is ready)",
        f"[{settings.host}]" if ":" in settings.host else settings.host,  # IPv6, as URLs write it
        settings.port,
        settings.batch,
        settings.max_queue,
        source.path,
    )
    server.run()
    if load_failure:
        reason, lasting = load_failure[0]
        code = _fail(reason, USAGE if lasting else NOT_NOW)
        return _leave_group(code) if dist is not None else code
    code = server.leave()  # no return with the engine thread still busy: it exits now
    return _leave_group(code) if dist is not None else code


def _open_bind_warning(settings: Settings) -> str | None:
    """What to say of a bind beyond loopback with no --api-key; None: nothing."""
    from app.host_names import is_loopback

    if is_loopback(settings.host) or settings.api_key:
        return None
    return f"binding {settings.host} without --api-key: anyone who can reach it can use it"


def _unwritable(flag: str, folder: str | Path | None) -> str | None:
    """Why ``folder`` (made as its user would) cannot be written, named by its
    ``flag``: said at once, not as a traceback or a failure once the model loaded."""
    if not folder:
        return None
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return f"{flag} {folder}: not a folder"  # mkdir's "File exists" said nothing
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{flag} {folder}: {exc.strerror or exc}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {folder}: not writable"
    return None


def _unusable_kv_dir(settings: Settings) -> str | None:
    """Why the SSD tier could not use its folder, when it would be on (engine.boot:
    a prefix cache, --kv-disk-bytes not 0, no distributed group); None otherwise.
    Under auto sizing such a folder came to 0 bytes and the tier was quietly off."""
    if settings.prompt_cache is None or settings.kv_disk_limit == 0 or settings.joins_group:
        return None
    try:
        folder = settings.kv_disk_path
    except RuntimeError:  # expanduser: "~name" of a user this machine does not have
        return f"--kv-dir {settings.kv_dir or '(default)'}: no such home directory"
    return _unwritable("--kv-dir", folder)


def _unmountable(adapters: list[str]) -> str | None:
    """Why an --adapter ID=PATH could not be mounted, as far as its files tell
    without reading the weights: at once, not once the model has loaded (exit 1)."""
    from engine.adapter_files import check_adapter_dir
    from scheduler.contracts import AdapterError

    for item in adapters:  # the raw pairs: Settings.adapters raises on "~nobody/x"
        try:
            check_adapter_dir(item.partition("=")[2])
        except AdapterError as exc:
            return f"--adapter {item}: {exc}"
    return None


def _leave_group(code: int) -> int:
    """Exit a distributed rank without the interpreter's teardown: the group's
    transport threads were still joinable when their destructors ran, now and
    then (std::terminate: SIGABRT, status -6, after a clean stop), which a
    supervisor reads as a crash. A moment first, for their last sends."""
    from engine.engine_thread import exit_now

    time.sleep(LEAVE_GROUP_S)
    exit_now(code)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "chat":  # a client: none of the server's settings apply
        from app.chat_repl import run_chat

        return run_chat(args)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        return _fail(f"invalid settings: {describe_invalid(exc)}")
    except OSError as exc:  # a .env this user may not read (the server's, mode 600)
        return _fail(f"cannot read the settings: {exc}")
    if settings.cache_dir:  # from a flag or .env: where engine.cache_dir.cache_root looks
        os.environ["KVWARM_CACHE_DIR"] = settings.cache_dir
    if args.command == "prepare":
        return cmd_prepare(settings)
    if args.command == "fit":
        return cmd_fit(settings, args.models, args.json, args.matrix)
    return cmd_serve(settings)


if __name__ == "__main__":
    sys.exit(main())
