"""The KV manager: one object the engine asks for reusable KV and hands KV to keep.

Runs on the engine thread (it touches MLX arrays through ``kvcache.payloads``).
The pure-Python index decides what is reused and what leaves which tier; this
class keeps the payloads in step with it: RAM blocks shared between entries,
files on disk written by the disk tier's writer thread, loads from disk on a
hit, and the session layer that remembers which entry each conversation turn
left behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvcache.blocks import Digest, EntryBytes, TierLedger, block_digests
from kvcache.conversations import SavedConversations
from kvcache.disk import FORMAT_VERSION, CorruptBlock, WriteEntry
from kvcache.disk_reads import (
    DiskReader,
    PendingHit,
    ReadFiles,
    ReadPlan,
    SharedRead,
    read_files,
)
from kvcache.entry_files import key_manifest, mlx_arrays, numpy_arrays
from kvcache.index import CacheEntry, Lookup, PrefixIndex, PromptCacheConfig
from kvcache.interface import SavedConversation
from kvcache.layout import KVQuant
from kvcache.namespaces import prune_other_namespaces
from kvcache.os_memory import MemoryReturner
from kvcache.payloads import BlockArrays, KVLayoutOps, PrivatePart, rebuild_private
from kvcache.prompt_key import PromptKey
from kvcache.restore import restore_entries
from kvcache.safetensors_io import GONE, CorruptFile
from kvcache.sessions import SessionStore
from kvcache.stats import KVCacheStats, TierStats
from kvcache.tiers import PERSISTENT_TIERS, PersistentTier
from observability.escape import ascii_escaped
from scheduler.request import CacheHints, CacheReport

log = logging.getLogger("kvwarm.kvcache")


WRITE_QUEUE_SHARE = 4  # the SSD tier's write queue holds at most 1/4 of the RAM cap


@dataclass(frozen=True)
class DiskConfig:
    """``--kv-dir`` / ``--kv-disk-bytes``: where and how much (0 bytes: no disk tier)."""

    root: Path
    max_bytes: int
    max_pending_bytes: int = 1 << 30
    kind: str = "ssd"  # a key of kvcache.tiers.PERSISTENT_TIERS


@dataclass
class Reuse:
    """What a request starts from: KV for ``kv_key`` and the prompt tokens after it."""

    entry_id: int
    caches: list[Any]
    kv_key: PromptKey  # the prompt the reused KV stands for (old volatile values)
    kv_depth: int  # KV positions reused (== entry depth)
    request_depth: int  # the request's prompt tokens this KV stands for
    layer: str


class TieredKVManager:
    """RAM tier of shared blocks, optional SSD tier, one index over both."""

    def __init__(
        self,
        config: PromptCacheConfig,
        max_bytes: int,
        namespace: str,
        template: Sequence[Any],
        disk: DiskConfig | None = None,
        quant: KVQuant | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.namespace = namespace
        self.quant = quant  # --kv-bits: how stored blocks are kept unless a request says
        self.ops = KVLayoutOps(template, config.kv_block_size, quant)
        self._ops: dict[str, KVLayoutOps] = {self._variant(quant): self.ops}
        self._template = list(template)
        self._blocks: dict[Digest, BlockArrays] = {}
        self._private: dict[int, PrivatePart] = {}
        self._freed = False
        self._give_back = MemoryReturner()
        self.restored = 0
        # blocks of saved entries this run could not index (kept on disk for a later
        # one): never deleted when the indexed entries sharing them go
        self._kept_blocks: set[Digest] = set()
        self.conversations = SavedConversations(self)
        self.disk: PersistentTier | None = None
        self._reader: DiskReader | None = None  # disk hits read off the engine thread
        self._reads: dict[int, SharedRead] = {}  # entry id -> its read in flight
        # reads a conversation's load began (its entry held): ``poll`` takes them up
        self._loads: list[tuple[CacheEntry, SharedRead]] = []
        disk_bytes = 0
        ram_bytes = max_bytes
        if disk is not None and disk.max_bytes > 0:
            # A queued write holds its KV until written, also once the entry has left
            # RAM (a slow disk fell 800 MiB behind in the soak): the queue's share
            # comes out of the RAM cap, so the two together stay within max_bytes.
            pending = min(disk.max_pending_bytes, max_bytes // WRITE_QUEUE_SHARE)
            try:
                make = PERSISTENT_TIERS[disk.kind]
                self.disk = make(disk.root, self.namespace, pending)
                disk_bytes = disk.max_bytes
                ram_bytes = max_bytes - pending
            except OSError as exc:
                log.warning("KV disk tier off: %s is not usable (%s)", disk.root, exc)
            else:
                try:
                    prune_other_namespaces(disk.root, self.namespace, disk.max_bytes)
                except Exception:  # noqa: BLE001 - the others stay as they are; we start
                    log.exception("KV dir %s: other namespaces not pruned", disk.root)
        self._clock = clock  # a distributed group's ranks share the serving rank's
        self.index = self._new_index(ram_bytes, disk_bytes)
        self.sessions = SessionStore()
        if self.disk is not None:
            try:
                self._restore()
            except Exception as exc:  # noqa: BLE001 - start without the tier, not at all
                self._restore_failed(exc, ram_bytes)

    def _new_index(self, ram_bytes: int, disk_bytes: int) -> PrefixIndex:
        config = self.config
        return PrefixIndex(
            max_bytes=ram_bytes,
            max_entries=config.max_entries,
            block_size=config.block_size,
            ttl_s=config.ttl_s,
            namespace=self.namespace,
            policy=config.policy,
            listener=self,
            disk_bytes=disk_bytes,
            eviction=config.eviction,
            clock=self._clock,
        )

    def _restore_failed(self, exc: Exception, ram_bytes: int) -> None:
        """The files could not be read at start (an I/O error listing the dir): the
        server runs with the tier off, rather than failing every restart. Nothing is
        indexed, written, deleted or overwritten (saved.json included) this run."""
        assert self.disk is not None
        self.disk.degraded = f"reading it at start failed: {type(exc).__name__}: {exc}"
        log.error(
            "the KV disk tier at %s is off for this run (%s); cached KV stays in RAM "
            "only, and its files are left as they are for the next start",
            self.disk.dir,
            self.disk.degraded,
            exc_info=exc,
        )
        # a restore cut short indexed some entries: their eviction would delete files
        self.index = self._new_index(ram_bytes, 0)
        self.restored = 0
        self._kept_blocks.clear()
        self.conversations = SavedConversations(self)

    @property
    def trimmable(self) -> bool:
        return self.ops.trimmable

    @staticmethod
    def _variant(quant: KVQuant | None, adapter: str = "") -> str:
        """Entries of one variant only ever serve requests of the same: KV of
        another precision or computed under another adapter is other data."""
        tag = quant.tag() if quant else ""
        return f"{tag}+{adapter}" if adapter else tag

    def _quant_for(self, kv_bits: int | None) -> KVQuant | None:
        """A request's ``kv_bits`` over the server's --kv-bits (same groups and start)."""
        if kv_bits is None:
            return self.quant
        base = self.quant or KVQuant()
        return KVQuant(kv_bits, base.group_size, base.start)

    def _ops_for(self, kv_bits: int | None) -> tuple[str, KVLayoutOps]:
        quant = self._quant_for(kv_bits)
        variant = self._variant(quant)
        if variant not in self._ops:
            self._ops[variant] = KVLayoutOps(self._template, self.config.kv_block_size, quant)
        return variant, self._ops[variant]

    # -- TierListener (called by the index) ------------------------------------
    def left_ram(self, entry: CacheEntry, freed: list[Digest]) -> None:
        self._private.pop(entry.entry_id, None)
        for digest in freed:
            self._blocks.pop(digest, None)
        self._freed = True

    def left_disk(self, entry: CacheEntry, freed: list[Digest]) -> None:
        if self.disk is not None:  # its manifest goes whether or not it stays in RAM
            self.disk.delete_entry(entry.uid, [d for d in freed if d not in self._kept_blocks])

    def _return_memory(self) -> None:
        if self._freed:
            self._give_back()  # freed KV buffers back to the OS
            self._freed = False

    # -- lookup ----------------------------------------------------------------
    def lookup(
        self, request_id: str, hints: CacheHints, max_growth: int, defer_disk: bool = False
    ) -> tuple[Reuse | PendingHit | None, CacheReport]:
        """The KV a request starts from. ``defer_disk``: a hit on an entry only on
        the disk tier comes back as a ``PendingHit`` whose files a reader thread
        reads (``finish_read`` once done), with the miss's report until then."""
        self.poll()
        key = hints.key
        promised = self.sessions.promised_tokens(
            hints.session_id, hints.message_hashes, key.message_ends
        )
        result = self.index.lookup(
            key,
            self.sessions.candidates(hints.session_id, hints.message_hashes),
            promised,
            max_growth=max_growth,
            variant=self._variant(self._quant_for(hints.kv_bits), hints.adapter),
            count_hit=False,
            session=hints.session_id if hints.own_conversation else None,
        )
        for reason in result.rejected:
            log.info("%s: prefix cache rejected %s", request_id, reason)
        rejected = tuple(str(r) for r in result.rejected)
        known = self._known_session(hints.session_id)
        miss = CacheReport(candidates=result.candidates, rejected=rejected, known_session=known)
        if result.hit is None:
            log.info(
                "%s: prefix cache miss (%d candidates, session %s)",
                request_id,
                result.candidates,
                ascii_escaped(hints.session_id),  # a client's: no forged log lines
            )
            self._return_memory()
            return None, miss
        entry = result.hit.entry
        if defer_disk and not entry.in_ram and self.disk is not None:
            return self._begin_read(request_id, hints, result, miss, known), miss
        reading = not entry.in_ram  # errors until its files are MLX arrays may pass
        keep = result.hit.alignment.entry_depth
        try:
            blocks, private = self._loaded(entry, keep)
            reading = False
            caches = self._assemble(blocks, private, keep)
        except Exception as exc:  # noqa: BLE001 - sorted out by _unusable
            self.index.release(entry.entry_id)
            self._unusable(request_id, result, exc, reading)
            return None, miss
        try:
            return self._hit(request_id, hints, result, caches, known, rejected)
        except BaseException:
            self.index.release(entry.entry_id)  # no Reuse names it: nobody else would
            raise

    def _unusable(self, request_id: str, result: Lookup, exc: Exception, reading: bool) -> None:
        """A hit whose KV could not be served: the lookup misses, and the entry goes
        unless ``exc`` is a disk read that may pass (``reading``: raised while its
        files were read or made MLX arrays)."""
        assert result.hit is not None
        entry = result.hit.entry
        self.index.unusable_hit(result)
        if isinstance(exc, CorruptFile):
            log.warning("%s: cached KV on disk discarded: %s", request_id, exc)
            self.damaged(entry, exc)
        elif _out_of_memory(exc) or (reading and _may_pass(exc)):
            # not damage: discarded, a shared block took every entry naming it,
            # saves and all; the files stay for the next (and memory short for a
            # moment says nothing of the entry's arrays, wherever they are)
            log.warning(
                "%s: cached KV not served this time, kept (%s: %s)",
                request_id,
                type(exc).__name__,
                exc,
            )
        else:
            # its own arrays do not fit together: kept, it stayed the best hit with
            # no ref, and every lookup for its prefix missed for good
            log.error(
                "%s: cached KV %s (entry %d) discarded: it could not be assembled (%s: %s)",
                request_id,
                "on disk" if result.tier == "disk" else "in RAM",
                entry.entry_id,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            self._discard(entry)

    def _hit(
        self,
        request_id: str,
        hints: CacheHints,
        result: Lookup,
        caches: list[Any],
        known: bool,
        rejected: tuple[str, ...],
    ) -> tuple[Reuse, CacheReport]:
        assert result.hit is not None
        key = hints.key
        entry, al = result.hit.entry, result.hit.alignment
        tier = result.tier
        self.index.served(result)
        log.info(
            "%s: prefix cache hit (%s layer, %s): %d of %d prompt tokens from entry %d "
            "(%d tokens), %d stale volatile tokens, session %s",
            request_id,
            result.layer,
            tier,
            al.request_depth,
            len(key.model_tokens),
            entry.entry_id,
            entry.length,
            al.stale_tokens,
            ascii_escaped(hints.session_id),
        )
        reuse = Reuse(
            entry.entry_id,
            caches,
            entry.key.spliced(al.entry_depth, key, al.request_depth),
            al.entry_depth,
            al.request_depth,
            result.layer,
        )
        report = CacheReport(
            result.layer,
            al.request_depth,
            entry.length,
            al.stale_tokens,
            result.candidates,
            rejected,
            tier=tier,
            known_session=known,
        )
        self._return_memory()
        return reuse, report

    def _known_session(self, session: str) -> bool:
        if self.sessions.get(session) is not None:
            return True
        return any(e.session == session and not e.forgotten for e in self.index.entries())

    # -- disk hits read on the reader thread --------------------------------------
    def _begin_read(
        self, request_id: str, hints: CacheHints, result: Lookup, miss: CacheReport, known: bool
    ) -> PendingHit:
        """Hand the disk entry's files this hit needs to the reader thread, or join
        a read of them already in flight that goes as deep; the entry stays held
        (the lookup's ref, this row's own) until ``finish_read`` or ``cancel_read``."""
        assert result.hit is not None and self.disk is not None
        entry = result.hit.entry
        plan = self._read_plan(entry, result.hit.alignment.entry_depth)
        read = self._reads.get(entry.entry_id)
        # a failed one: a fresh read may work; a shallower one: this row reads its
        # own (the other's rows keep theirs, and it stays theirs to drop)
        if read is not None and not read.failed and read.plan.covers(plan):
            read.rows += 1
            log.info(
                "%s: prefix cache hit on disk, entry %d: joins its read",
                request_id,
                entry.entry_id,
            )
        else:
            read = self._submit_read(entry, plan)
            part = f"its first {plan.blocks} of {len(entry.held.blocks)} blocks"
            log.info(
                "%s: prefix cache hit on disk, entry %d: reading %s",
                request_id,
                entry.entry_id,
                "it" if plan.whole else part,
            )
        return PendingHit(request_id, hints, entry, result, read, miss, known)

    def _submit_read(self, entry: CacheEntry, plan: ReadPlan) -> SharedRead:
        """Hand ``plan``'s files to the reader thread: the entry's read in flight."""
        assert self.disk is not None
        if self._reader is None:
            self._reader = DiskReader()
        disk, uid, private = self.disk, entry.uid, entry.held.private
        need, whole = plan.need, plan.whole
        ticket = self._reader.submit(lambda: read_files(disk, uid, private, need, whole))
        read = self._reads[entry.entry_id] = SharedRead(ticket, plan)
        return read

    def _leave_read(self, entry_id: int, read: SharedRead) -> None:
        """A row (or a load) is done with ``read``: the last one's going drops it
        (skipped if not begun, its bytes and MLX arrays let go)."""
        read.rows -= 1
        if read.rows > 0:
            return
        read.ticket.cancel()
        read.plan.have.clear()
        read.loaded = None
        if self._reads.get(entry_id) is read:
            del self._reads[entry_id]

    # -- a saved conversation's load: its read on the reader thread too ------------
    def read_ahead(self, entry: CacheEntry) -> None:
        """Begin reading a disk entry whole on the reader thread (a conversation's
        load, a control job on the engine thread: a multi-GB read there paused
        every running stream); ``poll`` makes it MLX arrays in RAM once read. A
        whole read in flight is joined; the entry is held until then."""
        if self.disk is None or entry.in_ram or not entry.on_disk or self.loading(entry):
            return
        plan = self._read_plan(entry, entry.length)
        read = self._reads.get(entry.entry_id)
        if read is not None and not read.failed and read.plan.covers(plan):
            read.rows += 1
        else:
            read = self._submit_read(entry, plan)
        entry.refs += 1  # as a hit's: nothing evicts or deletes it while read
        self._loads.append((entry, read))
        log.info("entry %d: a saved conversation's load reads it", entry.entry_id)

    def loading(self, entry: CacheEntry) -> bool:
        """Whether a load's read of ``entry`` is under way."""
        return any(e is entry for e, _ in self._loads)

    def _finish_loads(self) -> None:
        """Loads whose files are read: their KV made MLX arrays and counted into
        RAM (damage discarded, a read that may pass kept on disk)."""
        done = [(e, r) for e, r in self._loads if r.ticket.done]
        self._loads = [(e, r) for e, r in self._loads if not r.ticket.done]
        for entry, read in done:
            try:
                if self.index.get(entry.entry_id) is entry and not read.failed:
                    self._load(entry, read)
            finally:
                self._leave_read(entry.entry_id, read)
                self.index.release(entry.entry_id)
        self._return_memory()

    def _load(self, entry: CacheEntry, read: SharedRead) -> None:
        if read.loaded is not None:  # a row sharing the read made its arrays first
            return
        try:
            read.loaded = self._to_mlx(entry, read.plan, read.ticket.outcome())
        except CorruptFile as exc:
            read.failed = True
            log.warning("a saved conversation's KV on disk discarded: %s", exc)
            self.damaged(entry, exc)
        except Exception as exc:  # noqa: BLE001 - a read that may pass: the save stays
            read.failed = True  # the rows sharing it miss (and read it afresh next time)
            log.warning(
                "entry %d not loaded this time, kept on disk (%s: %s)",
                entry.entry_id,
                type(exc).__name__,
                exc,
            )

    def wait_reads(self, timeout: float) -> None:
        """Until a disk read finishes or ``timeout`` passes (nothing else to run)."""
        if self._reader is not None:
            self._reader.wait_any(timeout)

    def finish_read(self, pending: PendingHit) -> tuple[Reuse | None, CacheReport]:
        """A finished read's KV as MLX arrays (engine thread): the hit, or the
        miss (damage discarded, a failed read's files kept) with nothing claimed.
        The first of the rows sharing a read makes the arrays and sorts a failure
        out; the others take what it left."""
        assert pending.done and not pending.released and pending.result.hit is not None
        pending.released = True  # the ref goes once, below: to the hit, or given back
        entry, result, read = pending.entry, pending.result, pending.read
        keep = pending.result.hit.alignment.entry_depth
        served = False
        try:
            self.poll()
            if self.index.get(entry.entry_id) is not entry or read.failed:
                # lost meanwhile (a damaged block), or a row before this one found the
                # read unusable and kept or discarded the entry: nothing more to do
                log.info("%s: cached KV could not be read for it", pending.request_id)
                self.index.unusable_hit(result)
                return None, pending.miss
            reading = True
            try:
                if read.loaded is None:
                    read.loaded = self._to_mlx(entry, read.plan, read.ticket.outcome())
                blocks, private = read.loaded
                reading = False
                caches = self._assemble(blocks, private, keep)
            except Exception as exc:  # noqa: BLE001 - sorted out by _unusable
                read.failed = True
                self._unusable(pending.request_id, result, exc, reading)
                return None, pending.miss
            rejected = pending.miss.rejected
            hit = self._hit(
                pending.request_id, pending.hints, result, caches, pending.known_session, rejected
            )
            served = True
            return hit
        finally:
            self._leave_read(entry.entry_id, read)
            if not served:  # whatever raised: marked released, it must be (else held for good)
                self.index.release(entry.entry_id)
                self._return_memory()

    def cancel_read(self, pending: PendingHit) -> None:
        """Its row went away mid-read: the entry is let go; the read goes on for
        the other rows sharing it, or is dropped with the last."""
        if not pending.released:
            pending.released = True
            self._leave_read(pending.entry.entry_id, pending.read)
            self.index.release(pending.entry.entry_id)

    def _caches(self, entry: CacheEntry, keep: int) -> list[Any]:
        """Fresh caches of the entry's first ``keep`` positions (from disk if need be)."""
        return self._assemble(*self._loaded(entry, keep), keep)

    def _loaded(self, entry: CacheEntry, keep: int) -> tuple[list[BlockArrays], PrivatePart]:
        """The entry's blocks and private part, or from disk what its first ``keep``
        positions need (``_read_plan``)."""
        if entry.in_ram:
            blocks = [self._blocks[d] for d, _ in entry.held.blocks]
            return blocks, self._private[entry.entry_id]
        return self.read_back(entry, keep)

    def _assemble(self, blocks: list[BlockArrays], private: PrivatePart, keep: int) -> list[Any]:
        """Fresh caches of the entry's first ``keep`` positions."""
        bs = self.ops.block_size
        used = blocks if keep >= len(blocks) * bs else blocks[: -(-keep // bs)]
        if len(used) < len(blocks):  # a trimmable hit short of the stored tail
            return self.ops.assemble(used, _empty_tail(private), keep)
        return self.ops.assemble(blocks, private, keep)

    def read_back(
        self, entry: CacheEntry, keep: int | None = None
    ) -> tuple[list[BlockArrays], PrivatePart]:
        """Read what a disk entry's first ``keep`` positions need (None: all of it),
        verified; an entry read whole is counted back into RAM. Raises CorruptFile
        for damage; what may pass instead, ``_may_pass`` says."""
        assert self.disk is not None
        plan = self._read_plan(entry, entry.length if keep is None else keep)
        files = read_files(self.disk, entry.uid, entry.held.private, plan.need, plan.whole)
        return self._to_mlx(entry, plan, files)

    def _read_plan(self, entry: CacheEntry, keep: int) -> ReadPlan:
        """What a hit ``keep`` positions deep reads of a disk entry: a trimmable
        entry's first ceil(keep / block size) blocks when a whole block or more is
        left out (its private tail, under one block, lies past them); else every
        block and its own file. An entry that cannot be cut hits only whole."""
        stored = entry.held.blocks
        cut = -(-keep // self.ops.block_size) if entry.trimmable and keep > 0 else len(stored)
        whole = cut >= len(stored)
        used = stored if whole else stored[:cut]
        have = {d: self._blocks[d] for d, _ in used if d in self._blocks}
        need = [(d, n) for d, n in used if d not in have]
        return ReadPlan(have, need, len(used), whole)

    def _to_mlx(
        self, entry: CacheEntry, plan: ReadPlan, files: ReadFiles
    ) -> tuple[list[BlockArrays], PrivatePart]:
        """A read's files as MLX arrays, evaluated; an entry read whole is counted
        back into RAM, a partial read's arrays serve its rows alone (RAM's ledger
        holds none of them: they go with the rows' caches)."""
        assert self.disk is not None
        started = time.monotonic()
        blocks: list[BlockArrays] = []
        for digest, _ in entry.held.blocks[: plan.blocks]:
            arrays = plan.have.get(digest)
            blocks.append(arrays if arrays is not None else mlx_arrays(files.blocks[digest]))
        if plan.whole:
            private = self._private_from(entry, files)
        else:
            private = self.ops.empty_tails(blocks[-1])
        mx.eval([a for blk in blocks for a in blk.values()] + list(private.arrays().values()))
        c = self.disk.counters
        c.loads += 1
        c.load_tokens += entry.length if plan.whole else plan.blocks * self.ops.block_size
        c.load_bytes += files.nbytes
        c.load_seconds += files.seconds + time.monotonic() - started
        if plan.whole and self.index.promote(entry.entry_id):
            for (digest, _), arrays in zip(entry.held.blocks, blocks):
                self._blocks.setdefault(digest, arrays)
            self._private[entry.entry_id] = private
        return blocks, private

    def _private_from(self, entry: CacheEntry, files: ReadFiles) -> PrivatePart:
        """The private part in an entry's own file, on the model's cache types."""
        assert files.private is not None and files.manifest is not None
        arrays = mlx_arrays(files.private)
        try:
            return rebuild_private(
                self._template, arrays, files.manifest["private_meta"], entry.held.private
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            # a verified file whose arrays its manifest does not describe: damage
            raise CorruptFile(f"{entry.uid}: its arrays do not fit its manifest: {exc!r}") from exc

    def damaged(self, entry: CacheEntry, exc: CorruptFile) -> None:
        """``entry`` could not be read back; a damaged shared block takes every
        disk copy naming it along (kvcache.index.lose_block)."""
        if isinstance(exc, CorruptBlock):  # a kept save naming it is damaged too
            self._kept_blocks.discard(exc.digest)
        self._discard(entry)
        if isinstance(exc, CorruptBlock):
            lost = self.index.lose_block(exc.digest)
            if lost:
                log.warning("%d more cached entries on disk named the damaged block", lost)
                self.conversations.settle()  # saves among them are taken back

    def _discard(self, entry: CacheEntry) -> None:
        if self.disk is not None and (entry.on_disk or entry.persisting):  # files go
            self.disk.counters.files_discarded += 1
        self.index.remove(entry.entry_id)
        if entry.pinned:  # a save's KV: taken back, not listed for an unsaved turn
            self.conversations.settle()

    def release(self, entry_id: int) -> None:
        self.index.release(entry_id)

    # -- store -----------------------------------------------------------------
    def store(
        self,
        key: PromptKey,
        caches: list[Any],
        session: str | None = None,
        kv_bits: int | None = None,
        adapter: str = "",
        own_session: bool = False,
    ) -> int | None:
        """Keep ``caches`` (KV of exactly ``key.model_tokens``) for later requests,
        at the precision ``kv_bits`` asks for (None: the server's --kv-bits),
        in the namespace of the adapter that computed it ("" = the base model)."""
        self.poll()
        length = len(key.model_tokens)
        _, ops = self._ops_for(kv_bits)
        variant = self._variant(self._quant_for(kv_bits), adapter)
        # blocks of another precision are other bytes: their own address space
        digests = (
            block_digests(key.model_tokens, ops.block_size, f"{self.namespace}/{variant}")
            if ops.plain
            else []
        )
        held = ops.measure(caches, length, digests)
        disk = self.disk
        nbytes = self._write_bytes(held)
        # write-through: disk room is reserved with the insert, before the shorter
        # entries it supersedes leave (their blocks are this entry's: kept, not rewritten)
        persist = disk is not None and disk.usable and disk.room_for(nbytes)
        entry_id = self.index.insert(
            key, held, ops.trimmable, session, variant, persist, own_session=own_session
        )
        if entry_id is not None:
            try:
                self._keep(entry_id, ops, caches, length, held)
            except BaseException:
                # no payload (a copy that ran out of memory): indexed, it stayed
                # persisting for good with its disk bytes reserved, never evicted
                self.index.remove(entry_id)
                raise
        self._return_memory()
        return entry_id

    def _keep(
        self, entry_id: int, ops: KVLayoutOps, caches: list[Any], length: int, held: EntryBytes
    ) -> None:
        """Copy a newly indexed entry's KV into its blocks and queue its write."""
        want = {d for d, _ in held.blocks if d not in self._blocks}
        split = ops.split(caches, length, held, want)
        self._blocks.update(split.blocks)
        assert split.private is not None
        self._private[entry_id] = split.private
        entry = self.index.get(entry_id)
        disk = self.disk
        if entry is not None and entry.persisting:
            self._submit_write(entry)
        elif disk is not None and disk.usable:
            disk.counters.writes_skipped += 1

    def _write_bytes(self, held: EntryBytes) -> int:
        """Bytes a write of ``held`` would queue: its private part and blocks not on disk."""
        refs = self.index.disk.refs
        return held.private + sum(n for d, n in held.blocks if d not in refs)

    def persist(self, entry_id: int) -> bool:
        """Reserve disk room for a RAM entry and queue its write (save_conversation)."""
        disk = self.disk
        entry = self.index.get(entry_id)
        if disk is None or entry is None or not disk.usable or not entry.in_ram:
            return False
        nbytes = self._write_bytes(entry.held)
        if not disk.room_for(nbytes) or not self.index.begin_persist(entry_id):
            disk.counters.writes_skipped += 1
            return False
        self._submit_write(entry)
        return True

    def _submit_write(self, entry: CacheEntry) -> None:
        """Hand the writer numpy views of the entry's new blocks and its manifest.
        New: no other entry on disk (or being written) holds them, whatever room
        making just deleted; the writer's queue order does the rest."""
        assert self.disk is not None
        refs = self.index.disk.refs
        new_blocks = [d for d, _ in entry.held.blocks if refs.get(d) == 1]
        private = self._private[entry.entry_id]
        manifest = {
            "format": FORMAT_VERSION,
            "key": key_manifest(entry.key),
            "blocks": [[d.hex(), n] for d, n in entry.held.blocks],
            "private_bytes": entry.held.private,
            "private_meta": private.meta(),
            "trimmable": entry.trimmable,
            "session": entry.session,
            "own_session": entry.own_session,
            "variant": entry.variant,
            "created": entry.stored_at,
        }
        blocks = [(d, numpy_arrays(self._blocks[d])) for d in new_blocks]
        job = WriteEntry(
            entry.entry_id,
            entry.uid,
            blocks,
            numpy_arrays(private.arrays()),
            manifest,
            entry.writes,
        )
        # a write past the queue's share went alone into an empty queue (DiskTier.room_for)
        entry.holds_queue = job.nbytes > self.disk.max_pending_bytes
        self.disk.submit(job)

    def poll(self) -> None:
        """Apply the disk writes and loads' reads that finished since the last call."""
        if self.disk is None:
            return
        if self._loads:
            self._finish_loads()
        saved = False
        for entry_id, write, ok in self.disk.completed():
            entry = self.index.get(entry_id)
            saved = saved or (entry is not None and entry.pinned)
            self.index.end_persist(entry_id, ok, write)
        if saved:  # a save's write landed or failed
            self.conversations.settle()

    def _restore(self) -> None:
        """Index every complete entry on disk: the first turn after a restart is warm."""
        assert self.disk is not None
        done = restore_entries(self.disk, self.index, self._addresses_match, self._kept_blocks)
        self.restored = done.count
        known = {e.uid for e in self.index.entries()}
        self.conversations.adopt(done.pins, known, set(done.kept_aside))

    def _addresses_match(self, key: PromptKey, held: EntryBytes, variant: str) -> bool:
        """Whether a stored entry's blocks are where this server would put its
        tokens' KV: another --kv-block-size (or a damaged manifest) puts them elsewhere."""
        want = (
            block_digests(
                key.model_tokens, self.config.kv_block_size, f"{self.namespace}/{variant}"
            )
            if self.ops.plain
            else []
        )
        return [d for d, _ in held.blocks] == want

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- conversations (save/load for people who resume work later) -----------
    def save_conversation(self, conversation_id: str, title: str | None) -> SavedConversation:
        return self.conversations.save(conversation_id, title)

    def load_conversation(self, conversation_id: str) -> SavedConversation:
        return self.conversations.load(conversation_id)

    def saved_conversations(self) -> list[SavedConversation]:
        return self.conversations.listing()

    def delete_conversation(self, conversation_id: str) -> SavedConversation:
        return self.conversations.delete(conversation_id)

    def record_turn(self, hints: CacheHints, entry_id: int | None) -> None:
        self.sessions.record_turn(
            hints.session_id, hints.message_hashes, hints.key.message_ends, entry_id
        )

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued disk writes and loads' reads, and apply them (tests)."""
        if self.disk is not None:
            deadline = time.monotonic() + timeout
            self.disk.flush(timeout)
            for _, read in self._loads:
                read.ticket.wait(max(0.0, deadline - time.monotonic()))
            self.poll()

    def close(self, timeout: float = 15.0) -> None:
        """Let queued writes reach the disk (bounded: a restart discards what is torn);
        reads in flight are left to end on their own (never waited for)."""
        if self._reader is not None:
            self._reader.close()
        if self.disk is not None:
            # re-saves whose writes land now: their list goes out before the writer stops
            deadline = time.monotonic() + timeout
            self.disk.flush(timeout)
            self.poll()
            self.disk.close(max(0.0, deadline - time.monotonic()))
            self.poll()

    # -- stats -----------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        idx = self.index
        disk = self.disk
        entries = idx.entries()
        # the index's counters and the disk's (prefixed disk_) carry the stats' names
        disk_counters = asdict(disk.counters) if disk is not None else {}
        return KVCacheStats(
            policy=self.config.policy.value,
            block_size=self.config.block_size,
            kv_block_size=self.ops.block_size,
            eviction=idx.eviction.name,
            entries=idx.ram_entries(),
            bytes=idx.ram.nbytes,
            max_bytes=idx.ram.max_bytes,
            sessions=len(self.sessions),
            ram=_tier_stats(idx.ram, [e for e in entries if e.in_ram]),
            disk=_tier_stats(idx.disk, [e for e in entries if e.on_disk]),
            disk_enabled=idx.disk_enabled,
            disk_dir=str(disk.dir) if disk is not None else "",
            disk_degraded=disk.degraded if disk is not None else None,
            disk_pending_bytes=disk.pending_bytes() if disk is not None else 0,
            restored_entries=self.restored,
            **asdict(idx.counters),
            **{f"disk_{name}": value for name, value in disk_counters.items()},
        )


def _tier_stats(ledger: TierLedger, entries: list[CacheEntry]) -> TierStats:
    return TierStats(
        ledger.nbytes,
        ledger.max_bytes,
        ledger.blocks,
        len(entries),
        ledger.shared_saved_bytes,
        sum(e.length for e in entries),
    )


# what MLX's allocators say when memory runs out (a RuntimeError, not MemoryError)
_OUT_OF_MEMORY = ("out of memory", "insufficient memory", "unable to allocate")


def _may_pass(exc: BaseException) -> bool:
    """Whether reading or converting a disk entry's files may work next time: an
    I/O error (EMFILE, EIO, EACCES; a file gone is damage) or no memory now."""
    if isinstance(exc, OSError):
        return not isinstance(exc, GONE)
    return _out_of_memory(exc)


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(
        words in str(exc).lower() for words in _OUT_OF_MEMORY
    )


def _empty_tail(private: PrivatePart) -> PrivatePart:
    """The private part with its plain-KV tails dropped (a hit within the blocks)."""
    layers = [
        (layer[0][..., :0, :], layer[1][..., :0, :]) if isinstance(layer, tuple) else layer
        for layer in private.layers
    ]
    return PrivatePart(layers, 0)
