"""The pinned tier's memory: pinned host slabs, each key's pieces in them, and what the driver
must give back when the tier goes.

Pinning is slow and takes memory from the whole system, so :class:`PinnedSlabs` pins lazily,
in large slabs (``cuMemHostAlloc``), as the live bytes grow, and reuses them: keys live in
first-fit, page-aligned extents of the concatenated slabs (:class:`~ooc.storage.extents.
Extents`, the file tier's allocator). The driver calls themselves are the tier's (passed in
as ``host_alloc`` / ``free_host``), so that their errors name the key and the bytes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ooc.errors import StorageError
from ooc.storage.extents import Extents, round_up
from vmm.cuda_driver import CudaDriver, DriverCallError
from vmm.units import format_size

__all__ = ["ALIGN", "DEFAULT_SLAB", "KeyBytes", "PinnedSlabs", "TierResources",
           "half_the_ram", "release_resources"]

log = logging.getLogger(__name__)

ALIGN = 4096               # extents inside the slabs: page-aligned pieces
DEFAULT_SLAB = 64 << 20    # pinned memory is allocated in slabs of this size (at most)


def half_the_ram() -> int:
    """The pinned tier's default capacity."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        return 8 << 30


@dataclass(slots=True, eq=False)
class KeyBytes:
    """One key's bytes: pieces (offset, length) of the slab space. A new write of the key
    makes a new record; an old record's pieces go back to the free list only when no transfer
    still uses them (``refs == 0``)."""

    nbytes: int
    pieces: list[tuple[int, int]]
    refs: int = 0
    retired: bool = False
    crc: int | None = None
    # The key's write until it is known complete: a copy_streams.InFlightCopy (not imported:
    # copy_streams builds on this module, not the other way round).
    write: Any = None
    write_error: StorageError | None = None


class PinnedSlabs:
    """Pinned host slabs of ``slab_bytes`` (the last one smaller), at most ``capacity_bytes``
    in all, and the extents of them that keys hold. ``slabs`` is the list of
    ``(host pointer, bytes)`` that :class:`TierResources` frees (shared, so that a finalizer
    frees what was pinned even if the tier never closes)."""

    def __init__(self, capacity_bytes: int, slab_bytes: int, slabs: list) -> None:
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.slabs = slabs
        self.extents = Extents(ALIGN)

    def headroom(self) -> int:
        """Bytes that can still be allocated: free extents plus room under the capacity."""
        return self.extents.free_bytes + self.capacity_bytes - self.extents.end

    def allocate_key(self, key: int, nbytes: int, live_bytes: int, device: int,
                     host_alloc: Callable[[int], Any]) -> list[tuple[int, int]]:
        """Pieces for ``key``'s ``nbytes``; pins the slabs they reach. StorageError naming the
        key, the bytes and the capacity if they do not fit."""
        need = round_up(max(nbytes, 1), ALIGN)
        if need > self.headroom():
            raise StorageError(
                f"PinnedTier: no room for key {key}: it needs {format_size(need)} ({nbytes} "
                f"bytes) of pinned memory; {format_size(live_bytes)} are live and the "
                f"capacity is {format_size(self.capacity_bytes)} on device {device}. "
                "Raise capacity_bytes, or raise the budget so less is swapped out")
        return self.allocate(nbytes, host_alloc)

    def reserve(self, need: int, live_bytes: int, device: int,
                host_alloc: Callable[[int], Any]) -> None:
        """Pin slabs now so that ``need`` bytes of new pieces will not pin any (StorageError
        if the capacity cannot hold them)."""
        ext = self.extents
        grow = need - ext.free_bytes
        if grow <= 0:
            return
        if ext.end + grow > self.capacity_bytes:
            raise StorageError(
                f"PinnedTier: reserving room for the optimizer step: it may write "
                f"{format_size(need)} ({need} bytes) of pinned memory; "
                f"{format_size(live_bytes)} are live and the capacity is "
                f"{format_size(self.capacity_bytes)} on device {device}. Raise "
                "capacity_bytes, or raise the budget so less is swapped out")
        self.grow_to(ext.end + grow, host_alloc)

    def allocate(self, nbytes: int, host_alloc: Callable[[int], Any]) -> list[tuple[int, int]]:
        """Pieces for ``nbytes`` (the caller checked the headroom); pins the slabs they reach."""
        ext = self.extents
        pieces = ext.allocate(nbytes)
        try:
            self.grow_to(ext.end, host_alloc)
        except BaseException:
            ext.free(pieces)
            ext.trim_end()
            raise
        return pieces

    def grow_to(self, end: int, host_alloc: Callable[[int], Any]) -> None:
        """Pin slabs until they cover ``end`` bytes of slab space."""
        while len(self.slabs) * self.slab_bytes < end:
            n = min(self.slab_bytes, self.capacity_bytes - len(self.slabs) * self.slab_bytes)
            self.slabs.append((int(host_alloc(n)), n))

    def free(self, pieces: list[tuple[int, int]]) -> None:
        self.extents.free(pieces)

    def trim(self, free_host: Callable[[int, int], None]) -> int:
        """Unpin the slabs above the highest live byte; return the pinned bytes left."""
        end = self.extents.trim_end()
        keep = -(-end // self.slab_bytes)
        while len(self.slabs) > keep:
            ptr, n = self.slabs.pop()
            free_host(ptr, n)
        return self.pinned_bytes

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.slabs)

    def span(self, end: int) -> int:
        """Pinned bytes the slabs covering ``end`` bytes of slab space take."""
        full, part = divmod(end, self.slab_bytes)
        return min(self.capacity_bytes, (full + (1 if part else 0)) * self.slab_bytes)

    def segments(self, rec: KeyBytes) -> list[tuple[int, int, int]]:
        """(pinned host pointer, offset in the key, bytes) for each contiguous piece of the
        key's first ``nbytes``; pieces crossing a slab boundary are split."""
        out, left, pos = [], rec.nbytes, 0
        for off, length in rec.pieces:
            n = min(length, left)
            while n > 0:
                s, within = divmod(off, self.slab_bytes)
                ptr, size = self.slabs[s]
                step = min(n, size - within)
                out.append((ptr + within, pos, step))
                off += step
                pos += step
                n -= step
                left -= step
            if left == 0:
                break
        return out

    def check_crc(self, key: int, rec: KeyBytes, device: int) -> None:
        """StorageError if the key's pinned bytes changed since its write completed."""
        if rec.crc is not None and self.crc(rec) != rec.crc:
            raise StorageError(
                f"PinnedTier: key {key} is corrupted: CRC-32 mismatch over its "
                f"{format_size(rec.nbytes)} ({rec.nbytes} bytes) of pinned memory on device "
                f"{device}; the bytes changed after the swap-out completed (host memory "
                "fault, or something else wrote into the tier's pinned slabs)")

    def crc(self, rec: KeyBytes) -> int:
        """CRC-32 of the key's pinned bytes (read by the host: the copies must be complete)."""
        crc = 0
        for host, _, n in self.segments(rec):
            crc = zlib.crc32((ctypes.c_char * n).from_address(host), crc)
        return crc


@dataclass(eq=False)
class TierResources:
    """What the driver must give back, kept apart from the tier so that a finalizer can
    release it when a tier is garbage-collected without ``close()``."""

    cu: CudaDriver
    dev: Any = None
    ctx: Any = None
    ctx_retained: bool = False
    streams: list = field(default_factory=list)
    events: list = field(default_factory=list)
    slabs: list = field(default_factory=list)      # (host pointer, bytes)

    def release(self) -> list[str]:
        """Destroy events and streams, free the pinned slabs, release the context. Tries
        every step; returns what failed (the caller decides whether to raise or log)."""
        cu, failed = self.cu, []

        def step(name: str, *args: Any) -> None:
            what = cu.attempt(name, *args)
            if what is not None:
                failed.append(what)

        prev = None
        if self.ctx is not None:  # a finalizer may run in any thread: switch there and back
            try:
                err, prev = cu.raw("cuCtxGetCurrent")
            except DriverCallError:  # teardown must go on
                err = None
            if err != cu.ok or (prev is not None and int(prev) == int(self.ctx)):
                # None current, or ours already (as own_context does): switching back after the
                # release would name a context this release may have destroyed, if it was the last
                prev = None
            step("cuCtxSetCurrent", self.ctx)
        # No copy may still read or write the pinned slabs when they are freed (close() has
        # synchronized already; a garbage-collected tier has not).
        for s in self.streams:
            step("cuStreamSynchronize", s)
        for ev in self.events:
            step("cuEventDestroy", ev)
        self.events.clear()
        for s in self.streams:
            step("cuStreamDestroy", s)
        self.streams.clear()
        for ptr, _ in self.slabs:
            step("cuMemFreeHost", ptr)
        self.slabs.clear()
        if self.ctx_retained:
            step("cuDevicePrimaryCtxRelease", self.dev)
            self.ctx_retained = False
        if prev is not None:
            step("cuCtxSetCurrent", prev)
        self.ctx = None
        return failed


def release_resources(res: TierResources) -> list[str]:
    """The tier's finalizer: release, and log what failed."""
    failed = res.release()
    for f in failed:
        log.warning("PinnedTier teardown: %s", f)
    return failed
