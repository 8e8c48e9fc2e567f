"""One model over several processes with mlx.distributed: joining the group, and
the two collectives kvwarm adds to the model's own (a byte broadcast from the
serving rank, a gather of small facts at start-up).

Everything travels through the distributed runtime the model shards over (ring,
JACCL, MPI), so one launch configures both; the only other channel is the
heartbeat (engine.rank_health), which must work while a collective hangs.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from engine.boot_deadline import BootDeadline
from engine.distributed_config import DistributedConfig, launched, write_hostfile


def _as_the_model() -> Any:
    """Collectives built as the model's own are (mlx-lm runs it in this context and
    its layers name no stream): the backend then puts them on the one stream the
    model's use, and the ranks meet every collective in the order they submit them.
    Naming the generation stream itself put them on the GPU on a Mac, where Metal
    has no collectives: every group failed at its first gather."""
    return mx.stream(generation_stream)


class RankGroup:
    """This process's place in the group, and byte collectives over it (engine thread)."""

    def __init__(self, group: Any, server_rank: int = 0, boot: BootDeadline | None = None):
        self.group = group
        # start-up's time limit: each stage named, ended once this rank is ready
        self.boot = boot or BootDeadline()
        self.rank = group.rank()
        self.size = group.size()
        if not 0 <= server_rank < self.size:
            raise ValueError(
                f"--distributed-server-rank {server_rank} is outside 0..{self.size - 1}"
            )
        self.server_rank = server_rank
        self._pending: list[mx.array] = []  # the serving rank's sends, kept alive

    @classmethod
    def join(cls, config: DistributedConfig, boot: BootDeadline | None = None) -> RankGroup:
        """Wait for every rank to connect (``boot`` already running: a rank that
        never comes holds this up for ever)."""
        if not launched():
            write_hostfile(config)
        if boot is not None:
            boot.stage("joining the group (waiting for every rank to connect)")
        group = mx.distributed.init(strict=True, backend=config.backend)
        if group.size() < 2:
            raise ValueError("a distributed group needs at least two ranks")
        return cls(group, config.server_rank, boot)

    @property
    def serving(self) -> bool:
        return self.rank == self.server_rank

    def _sum(self, x: mx.array, wait: bool = True) -> np.ndarray | None:
        with _as_the_model():
            out = mx.distributed.all_sum(x, group=self.group)
        if not wait:
            mx.async_eval(out)
            self._pending.append(out)
            return None
        mx.eval(out)
        return np.array(out)

    def broadcast(self, data: bytes | None) -> bytes:
        """The serving rank's ``data`` on every rank (others pass None). The serving
        rank does not wait for it: its in-flight step runs on meanwhile."""
        self._pending.clear()  # queued before anything submitted since: done by now
        if self.serving:
            payload = data or b""
            self._sum(mx.array([len(payload)], dtype=mx.int64), wait=False)
            if payload:
                self._sum(mx.array(np.frombuffer(payload, dtype=np.uint8)), wait=False)
            return payload
        sizes = self._sum(mx.array([0], dtype=mx.int64))
        n = int(sizes[0]) if sizes is not None else 0
        if n == 0:
            return b""
        out = self._sum(mx.zeros((n,), dtype=mx.uint8))
        return out.tobytes() if out is not None else b""

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        with _as_the_model():
            sizes = mx.distributed.all_gather(
                mx.array([len(data)], dtype=mx.int64), group=self.group
            )
        mx.eval(sizes)
        lengths = np.array(sizes).tolist()
        width = max(lengths) or 1
        padded = np.zeros((width,), dtype=np.uint8)
        padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        with _as_the_model():
            out = mx.distributed.all_gather(mx.array(padded), group=self.group)
        mx.eval(out)
        flat = np.array(out).tobytes()
        return [flat[r * width : r * width + n] for r, n in enumerate(lengths)]

    def agree(self, what: str, value: str) -> None:
        """Refuse to go on unless every rank holds the same ``value``."""
        values = [v.decode() for v in self.gather(value.encode())]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise RankMismatch(f"the ranks disagree on {what} ({shown})")


class RankMismatch(RuntimeError):
    """The ranks of one group were started against different models or settings."""
