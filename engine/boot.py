"""Bringing the real engine up on the engine thread: model, budget, KV store, runner."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.engine_thread import Booted, EngineConfig
from engine.model_errors import BudgetBeyondMachine, NoRoomForKV
from scheduler.admission import AdmissionController, MemoryBudget, plan_budget
from scheduler.contracts import ModelInfo, Runner

if TYPE_CHECKING:
    from engine.device_memory import DeviceMemory
    from engine.group_boot import GroupBoot

log = logging.getLogger("kvwarm.engine")
# --max-step-ms auto: a step's time budget by backend. On a CPU a decode step at
# a few thousand positions of context already takes a few hundred ms, so a second
# keeps streams readable and leaves prefill most of each step; a GPU decodes
# in tens of ms, and 200 ms steps are smooth to a reader.
AUTO_STEP_MS = {"cpu": 1000.0, "gpu": 200.0}


def step_budget_ms(configured: float | None, device: str) -> float:
    """The step time budget for ``device`` (``configured`` None: auto)."""
    if configured is not None:
        return configured
    return AUTO_STEP_MS["cpu" if "cpu" in device.lower() else "gpu"]


def no_room_for_kv(budget: MemoryBudget, cache_set: bool, auto: bool) -> MemoryError | None:
    """Why ``budget`` leaves requests no KV, as the error to raise; None: it leaves some.
    ``cache_set``: --prompt-cache-bytes is a size (not auto); ``auto``: --memory-budget
    auto, measured from what was free at this start."""
    if budget.kv_budget_bytes > 0:
        return None
    message = (
        f"memory budget {budget.total_bytes / 2**20:.0f} MiB leaves no room for KV after "
        f"{budget.weights_bytes / 2**20:.0f} MiB of weights and "
        f"{budget.reserve_bytes / 2**20:.0f} MiB reserve"
    )
    if cache_set and replace(budget, prompt_cache_bytes=0).kv_budget_bytes > 0:
        # the cache size the user set took the room: lasting, however much is free
        return NoRoomForKV(
            f"{message}, once --prompt-cache-bytes (KVWARM_PROMPT_CACHE_BYTES) takes its "
            f"{budget.prompt_cache_bytes / 2**20:.0f} MiB: lower it (0 turns the prefix "
            "cache off) or raise --memory-budget"
        )
    # --memory-budget auto measured what was free at this start: another
    # moment (a job finished) may leave room, so only a set budget is lasting
    if auto:
        return MemoryError(message + " (auto: what memory was free now)")
    return NoRoomForKV(message)


def check_budget(budget_bytes: int | None, machine: DeviceMemory) -> None:
    """A set --memory-budget must fit the machine: admission holds requests to it,
    and one beyond the memory there is let them grow until the OOM killer (or
    swap) ended the server instead of refusing them."""
    if budget_bytes is not None and budget_bytes > machine.total_bytes:
        raise BudgetBeyondMachine(
            f"--memory-budget {budget_bytes / 2**30:.1f} GiB is more than this machine's "
            f"{machine.total_bytes / 2**30:.1f} GiB of {machine.source}: set at most that "
            "(less what else runs), or auto"
        )


def boot_mlx(config: EngineConfig) -> Booted:
    """Load the model with mlx-lm and build the batch runner and its KV store (engine thread)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.adapters import adaptable_layers
    from engine.batch_runner import BatchRunner
    from engine.device_memory import auto_budget, machine_memory, measure_bandwidth
    from engine.loader import group_fingerprint, kv_namespace, load_model, prepare_model_dir
    from engine.prompt_format import ChatFormatter
    from engine.text_syntax import probe_syntax
    from kvcache.disk_budget import resolve_disk_bytes
    from kvcache.manager import DiskConfig, TieredKVManager

    device = str(mx.default_device())
    check_budget(config.memory_budget_bytes, machine_memory())  # before any weight is read
    measured = auto_budget() if config.memory_budget_bytes is None else None
    started = time.monotonic()
    log.info("loading model %s (%s) on %s", config.source.path, config.source.kind, device)
    ranks = _group_boot(config)
    if ranks is not None:
        if config.source.kind == "gguf":  # a first conversion runs within the boot deadline
            ranks.group.boot.stage(
                "converting the GGUF model (run `kvwarm prepare` on each machine first to "
                "keep a long conversion out of the start-up)"
            )
        ranks.check_same(group_fingerprint(prepare_model_dir(config.source)), _shared(config))
    loaded = load_model(
        config.source, shard=ranks.shard if ranks is not None else None, vision=config.vision
    )
    cfg = config
    total = cfg.memory_budget_bytes or measured.total_bytes
    front, vision_bytes = _image_front(loaded, cfg, device)
    prefill_rows = min(cfg.max_batch, 8)
    pc = cfg.prompt_cache
    budget = plan_budget(
        total,
        loaded.weights_bytes,
        loaded.layout.bytes_per_token,
        loaded.context_length,
        # its attention scores are what the transient reserve holds
        ranks.heads_per_rank(loaded.num_heads) if ranks is not None else loaded.num_heads,
        # the runner never prefills more than this per step (16-token floor per row)
        prefill_chunk=max(cfg.prefill_step_size, 16 * prefill_rows),
        source="--memory-budget" if measured is None else measured.source,
        layout=loaded.layout,
        prompt_cache=pc.resolve_bytes if pc else None,
        extra_reserve=vision_bytes,
    )
    cache_bytes = budget.prompt_cache_bytes
    if ranks is not None:
        budget, cache_bytes = ranks.tightest(budget)
    prefix_cache = None
    if pc is not None and cache_bytes > 0:
        disk = None
        if ranks is not None:
            log.info("KV SSD tier off on a distributed group: each rank keeps its shard in RAM")
        elif cfg.kv_dir is not None and cfg.kv_disk_bytes != 0:
            disk_bytes = resolve_disk_bytes(cfg.kv_dir, cfg.kv_disk_bytes)
            disk = DiskConfig(cfg.kv_dir, disk_bytes, kind=cfg.kv_tier) if disk_bytes > 0 else None
        prefix_cache = TieredKVManager(
            pc,
            cache_bytes,
            kv_namespace(
                loaded.model_dir,
                loaded.layout,
                cfg.kv_dir / ".weights-digests.json" if disk is not None else None,
                images=loaded.vision is not None,
            ),
            make_prompt_cache(loaded.model),
            disk,
            cfg.kv_quant,
            clock=ranks.clock if ranks is not None else time.monotonic,
        )
    runner = BatchRunner(
        loaded.model,
        loaded.tokenizer,
        max_batch=cfg.max_batch,
        prefill_step_size=cfg.prefill_step_size,
        prefill_batch=prefill_rows,
        prefix_cache=prefix_cache,
        max_step_s=step_budget_ms(cfg.max_step_ms, device) / 1e3,
        vision=loaded.vision,
    )
    if ranks is not None:
        ranks.same_randomness()
    bandwidth = measure_bandwidth()  # for /fit's predicted decode rate
    info = ModelInfo(
        model_id=loaded.model_id,
        path=str(loaded.model_dir),
        context_length=loaded.context_length,
        budget=budget,
        generation_defaults=loaded.generation_defaults,
        formatter=ChatFormatter(loaded.tokenizer, loaded.context_length),
        vocab_size=len(loaded.tokenizer),
        blas=cfg.blas,
        device=device,
        syntax=probe_syntax(loaded.tokenizer),
        bandwidth_bytes_s=bandwidth,
        vision=front,
        source_path=str(cfg.source.path) if cfg.source.kind == "gguf" else "",
        adapter_layers=adaptable_layers(loaded.model),
    )
    syntax = info.syntax
    log.info(
        "text syntax: reasoning %s...%s, tool calls %s, template reads %s",
        syntax.think_start,
        syntax.think_end,
        syntax.tool_family or "in any known format (no family in the template)",
        ", ".join(sorted(syntax.template_vars)) or "no thinking switches",
    )
    log.info(
        "model %s ready in %.1fs: context %d, weights %.0f MiB, KV %s, "
        "budget %.0f MiB (%s), up to %d tokens/request (%s), batch %d, "
        "prompt cache %.0f MiB (%s), decode bandwidth %.1f GB/s (measured)",
        loaded.model_id,
        time.monotonic() - started,
        loaded.context_length,
        loaded.weights_bytes / 2**20,
        loaded.layout.describe(),
        total / 2**20,
        budget.source,
        min(loaded.context_length, budget.ceiling_tokens),  # what /v1/models advertises
        "the model's context"
        if budget.ceiling_tokens >= loaded.context_length
        else "the memory budget's KV",
        cfg.max_batch,
        cache_bytes / 2**20,
        f"policy {pc.policy.value}, blocks of {pc.block_size}" if prefix_cache else "off",
        bandwidth / 1e9,
    )
    step_ms = runner.budget.max_step_s * 1e3
    if step_ms:
        log.info(
            "engine steps: prefill sized to keep each step within %.0f ms (--max-step-ms%s, "
            "learned cost model), %d-token chunks when nothing decodes",
            step_ms,
            " auto for " + device if cfg.max_step_ms is None else "",
            cfg.prefill_step_size,
        )
    else:
        log.info(
            "engine steps: a fixed budget of %d prompt tokens per step (--max-step-ms 0)",
            cfg.prefill_step_size,
        )
    if prefix_cache is not None:
        st = prefix_cache.stats()
        log.info(
            "KV store: RAM %.0f MiB in blocks of %d tokens%s, eviction %s; SSD tier %s",
            cache_bytes / 2**20,
            pc.kv_block_size,
            f" ({cfg.kv_quant.bits}-bit, groups of {cfg.kv_quant.group_size}, from position "
            f"{cfg.kv_quant.start})"
            if cfg.kv_quant
            else "",
            pc.eviction,
            f"{st.disk_dir} ({st.disk.max_bytes / 2**30:.1f} GiB, {st.restored_entries} "
            f"entries restored)"
            if st.disk_enabled
            else "off",
        )
    no_room = no_room_for_kv(
        budget,
        cache_set=pc is not None and pc.max_bytes is not None,
        auto=cfg.memory_budget_bytes is None,
    )
    if no_room is not None:
        raise no_room
    engine_runner: Runner = runner
    monitor = None
    if ranks is not None:
        if ranks.group.serving:
            engine_runner, monitor = ranks.lead(runner)
        else:
            ranks.follow()
    return Booted(
        engine_runner,
        info,
        AdmissionController(budget, loaded.context_length),
        read_allocator,
        ranks=monitor,
        group=ranks,
    )


def _image_front(loaded, config: EngineConfig, device: str) -> tuple[Any, int]:
    """The processor side of a vision model, for request preparation, and the
    memory admission holds back for its images (engine.vision.VisionReserve)."""
    if loaded.vision is None:
        return None, 0
    from engine.vision import VisionFront, family, vision_reserve

    front = VisionFront.for_model(
        loaded.vision.vlm, loaded.processor, loaded.tokenizer, *config.image_pixels
    )
    reserve = vision_reserve(loaded.vision, front, device)
    log.info(
        "vision model (mlx-vlm, %s): images become %r tokens; the vision tower's weights "
        "are in the %.0f MiB above; reserved for images: %.0f MiB = %.0f MiB for the one in "
        "flight (the largest the processor makes: %d tokens from %d patches; --max-pixels "
        "shrinks it) + %.0f MiB of image features kept for re-sent images",
        family(loaded.vision.vlm),
        front.placeholder,
        loaded.weights_bytes / 2**20,
        reserve.total / 2**20,
        reserve.image / 2**20,
        reserve.image_tokens,
        reserve.patches,
        reserve.features / 2**20,
    )
    return front, reserve.total


def _group_boot(config: EngineConfig) -> GroupBoot | None:
    if config.group is None or config.distributed is None:
        return None
    from engine.distributed_config import heartbeat_port
    from engine.group_boot import GroupBoot
    from engine.lockstep import TickClock

    d = config.distributed
    port = heartbeat_port(d, config.group.size)
    return GroupBoot(config.group, d.mode, d.rank_timeout_s, TickClock(), monitor_port=port)


def _shared(config: EngineConfig) -> str:
    """Settings every rank must run with: each one decides the same batch and
    cache changes only if the engine's match; and the ranks must agree on which
    of them serves, and on how long silence means a rank is lost (a worker
    waiting less than the serving rank beats dropped out of every idle group)."""
    d = config.distributed
    named = {
        "--batch": config.max_batch,
        "--prefill-step-size": config.prefill_step_size,
        "prompt cache": config.prompt_cache,
        "--kv-bits": config.kv_quant,
        "--distributed-mode": d.mode if d else "",
        "--distributed-server-rank": d.server_rank if d else 0,
        "--rank-timeout": d.rank_timeout_s if d else 0.0,
    }
    return " ".join(f"{name}={value!r}" for name, value in named.items())


def read_allocator() -> dict[str, int]:
    from engine.device_memory import sample_memory

    m = sample_memory()
    return {"active": m.active_bytes, "peak": m.peak_bytes, "cache": m.cache_bytes}
