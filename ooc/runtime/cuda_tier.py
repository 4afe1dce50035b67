"""The slower tier on a GPU: pinned host memory, filled and drained by two copy streams.

:class:`PinnedTier` is :class:`~ooc.storage.FileTier`'s counterpart for CUDA devices, with the
same interface (``write_async`` / ``read_async`` / ``discard`` / ``stats`` / ``close``), where
sources and destinations are :class:`~ooc.runtime.cuda_seam.DevicePtr` (device address + bytes)
instead of host buffers, and transfers are asynchronous device copies ordered with CUDA events
instead of jobs on I/O threads.

Written against the documented driver API of cuda-python (``cuda.bindings.driver``) and run on
an H100 (benchmarks/results/gpu.md, ``pytest -m gpu``). The project's machines and CI have no
GPU, so it is also tested against a fake driver that enforces the same contract (``ooc/testing/fake_cuda_copies.py``: copies only
within mapped, accessible device ranges and allocated pinned ranges, events recorded before
they are waited on, destroyed objects unusable, stream order, copies executed lazily so a
missing wait shows stale bytes). ``tests/ooc/test_cuda_gpu.py`` holds the real-GPU tests;
they skip without a device.

Driver calls, in order (each goes through :class:`vmm.cuda_driver.CudaDriver`, the one module
that calls the driver; each returns ``(CUresult, *values)``; every result is checked and a
failure raises :class:`~ooc.errors.StorageError` naming the call, the error, the key and the
bytes):

- setup: ``cuInit``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent`` (the
  primary context is PyTorch's, so its streams and our events work together);
  ``cuStreamCreate(CU_STREAM_NON_BLOCKING)`` twice: one stream device-to-host (swap-out), one
  host-to-device (swap-in), so that a prefetch never queues behind a swap-out (GPUs have a
  copy engine per direction);
- pinned memory: ``cuMemHostAlloc`` slabs, made as the live bytes grow, freed with
  ``cuMemFreeHost`` at close (pinning is slow and takes memory from the whole system, so it
  is done lazily, in large slabs, and reused: keys live in first-fit extents of the slabs);
- a transfer: ``cuEventRecord`` on the compute stream + ``cuStreamWaitEvent`` on the copy
  stream (the copy starts after the kernels queued so far: see ``_order_after``), one
  ``cuMemcpyDtoHAsync`` / ``cuMemcpyHtoDAsync`` per contiguous piece, ``cuEventRecord`` on
  the copy stream (the transfer's completion event);
- completion: ``cuEventQuery`` (polling, never blocks) or ``cuEventSynchronize`` (a future's
  ``result()``); ``cuStreamWaitEvent(compute, event)`` (a future's ``wait_on``: the compute
  stream waits for the copy with no host synchronization);
- teardown: ``cuStreamSynchronize`` both copy streams, ``cuEventDestroy``,
  ``cuStreamDestroy``, ``cuMemFreeHost``, ``cuDevicePrimaryCtxRelease``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

from ooc.errors import StorageError
from ooc.runtime.labels import label
from ooc.storage.extents import Extents, room_to_write, round_up
from vmm.cuda_driver import CudaDriver, DriverCallError, import_driver, in_own_context
from vmm.units import format_size, parse_size

__all__ = ["PinnedTier", "CopyFuture", "import_driver"]   # import_driver: from vmm.cuda_driver

log = logging.getLogger(__name__)

ALIGN = 4096               # extents inside the slabs: page-aligned pieces
_DEFAULT_SLAB = 64 << 20   # pinned memory is allocated in slabs of this size (at most)


def _half_the_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        return 8 << 30


@dataclass(slots=True, eq=False)
class _Record:
    """One key's bytes: pieces (offset, length) of the slab space. A new write of the key
    makes a new record; an old record's pieces go back to the free list only when no transfer
    still uses them (``refs == 0``)."""

    nbytes: int
    pieces: list[tuple[int, int]]
    refs: int = 0
    retired: bool = False
    crc: int | None = None
    write: "_Transfer | None" = None   # the key's write until it is known complete
    write_error: StorageError | None = None


@dataclass(slots=True, eq=False)
class _Transfer:
    """One copy in flight: its completion event on the copy stream, and who waits for it."""

    kind: str              # "write" (device -> pinned) or "read" (pinned -> device)
    key: int
    nbytes: int
    rec: _Record
    event: Any
    complete: bool = False
    error: StorageError | None = None
    waiters: int = 0       # threads inside cuEventSynchronize on ``event`` (outside the lock)


@dataclass(eq=False)
class _Resources:
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
            if err != cu.ok:
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


def _finalize(res: _Resources) -> list[str]:
    failed = res.release()
    for f in failed:
        log.warning("PinnedTier teardown: %s", f)
    return failed


class CopyFuture:
    """The handle of one transfer, returned by :meth:`PinnedTier.write_async` and
    :meth:`PinnedTier.read_async`; duck-compatible with ``concurrent.futures.Future`` for what
    the runtime uses (``result``, ``done``, ``exception``).

    - :meth:`result` blocks the calling thread until the copy is complete (a host
      synchronization on the copy's event), then returns ``None`` or raises
      :class:`~ooc.errors.StorageError`. After a swap-out's ``result()`` the source may be
      freed; after a swap-in's ``result()`` any stream may use the destination.
    - :meth:`wait_on` makes a stream wait for the copy *without* blocking the host: kernels
      queued on that stream afterwards see the copied bytes. This is the cheap way to finish
      a swap-in on the compute stream.
    """

    __slots__ = ("_tier", "_t")

    def __init__(self, tier: "PinnedTier", transfer: _Transfer) -> None:
        self._tier = tier
        self._t = transfer

    def result(self, timeout: float | None = None) -> None:
        """Wait for the copy (host synchronization); raise StorageError if it failed.
        ``timeout`` is accepted for interface compatibility and ignored (a device copy
        cannot be abandoned half-way)."""
        err = self._tier._wait(self._t)
        if err is not None:
            raise _fresh(err) from err

    def exception(self, timeout: float | None = None) -> StorageError | None:
        return self._tier._wait(self._t)

    def done(self) -> bool:
        """True once the copy is complete (asks the driver, never blocks)."""
        return self._tier._is_done(self._t)

    def wait_on(self, stream: Any) -> None:
        """Order ``stream`` (a ``CUstream`` or int handle) after the copy, with no host sync."""
        self._tier._stream_wait(self._t, stream)

    def wait_on_device(self) -> None:
        """Order the tier's compute stream after the copy (see :meth:`wait_on`): what the
        runtime does to finish a transfer without a host synchronization."""
        self._tier._stream_wait(self._t, self._tier._compute(None))

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def __repr__(self) -> str:
        t = self._t
        state = "error" if t.error else ("done" if t.complete else "in flight")
        return f"<CopyFuture {t.kind} key={t.key} {t.nbytes} B {state}>"


class PinnedTier:
    """Swapped-out bytes of a GPU in pinned host memory, moved by two copy streams.

    ``write_async(key, src, nbytes)`` copies the first ``nbytes`` of the device range ``src``
    into pinned memory under ``key``; ``read_async(key, dst)`` copies them back into the device
    range ``dst``. ``src`` and ``dst`` are :class:`~ooc.runtime.cuda_seam.DevicePtr` (anything
    with int ``address`` and ``nbytes``). Both return a :class:`CopyFuture`.

    Args:
        driver: ``cuda.bindings.driver`` or a stand-in with its interface (tests pass a fake);
            default: imported here (needs ``pip install 'ooc[cuda]'``).
        device: CUDA device ordinal.
        capacity_bytes: most pinned memory the tier may hold (int or size string; default:
            half the host RAM). Going over raises StorageError naming the key and bytes.
        verify: keep a CRC-32 of each key, computed from the pinned bytes once its write is
            complete and checked before each read (catches host-memory corruption and tier
            bugs; costs a host synchronization on the write and a pass over the bytes).
        compute_stream: the stream whose kernels produce the bytes swapped out and consume
            the bytes swapped in (an int handle, a ``CUstream``, or a callable returning one,
            evaluated at each transfer; PyTorch's is
            ``lambda: torch.cuda.current_stream().cuda_stream``). Default: 0, the legacy
            default stream. ``write_async``/``read_async`` take ``stream=`` to override it.
        slab_bytes: size of each ``cuMemHostAlloc`` (default 64 MiB, at most the capacity).

    Ordering guarantees (the reason for every event below):

    * A swap-out starts only after the work queued on the compute stream before
      ``write_async`` (which produced the bytes) has run: an event is recorded on the compute
      stream and the copy stream waits for it on the device.
    * A swap-in also starts only after that work: the destination range may just have been
      recycled by the pool, and a kernel queued earlier may still read its old contents.
    * A read of a key waits (on the device) for the key's write, so ``read_async`` may follow
      ``write_async`` without the caller waiting in between.
    * Pinned space of a discarded or overwritten key is reused only once no copy of it is in
      flight.
    * The caller keeps ``src`` alive and unchanged until the write's future resolves, and does
      not use ``dst`` until the read's ``result()`` or ``wait_on(stream)`` (then on that stream).

    Thread-safe: a thread blocked in ``result()`` holds no lock. The CUDA context is made
    current in each calling thread on its first call.

    Example (on a GPU; the runtime calls this for you)::

        tier = PinnedTier(capacity_bytes="4GiB")
        x = torch.randn(1 << 20, device="cuda")
        tier.write_async(1, DevicePtr(x.data_ptr(), x.nbytes), x.nbytes).result()
        y = torch.empty_like(x)
        tier.read_async(1, DevicePtr(y.data_ptr(), y.nbytes)).result()
        assert torch.equal(x, y)
        tier.close()
    """

    def __init__(self, driver: Any = None, device: int = 0, capacity_bytes: int | str | None = None,
                 verify: bool = False, *, compute_stream: Any = 0,
                 slab_bytes: int | str | None = None) -> None:
        self.device = int(device)
        self._cu = CudaDriver(driver, label="PinnedTier", device=self.device)
        cap = _half_the_ram() if capacity_bytes is None else parse_size(capacity_bytes,
                                                                         what="pinned capacity")
        self.capacity_bytes = round_up(cap, ALIGN)
        slab = _DEFAULT_SLAB if slab_bytes is None else parse_size(slab_bytes, what="slab size")
        self.slab_bytes = min(round_up(slab, ALIGN), self.capacity_bytes)
        self.verify = bool(verify)
        self.compute_stream = compute_stream
        self._lock = threading.RLock()
        self._ctx: Any = None           # the device's primary context, once retained
        self._records: dict[int, _Record] = {}
        self._inflight: dict[int, _Transfer] = {}     # id(transfer) -> transfer, oldest first
        self._extents = Extents(ALIGN)
        self._free_events: list[Any] = []
        self._closed = False
        self._live_bytes = 0
        self._peak_live_bytes = 0
        self._stats = dict(bytes_written=0, bytes_read=0, writes=0, reads=0, wait_s=0.0,
                           failed=0)
        self._res = _Resources(self._cu)
        self._finalizer = weakref.finalize(self, _finalize, self._res)
        try:
            self._setup()
        except BaseException:
            self._finalizer()
            raise

    def _setup(self) -> None:
        res = self._res
        try:
            res.dev, self._ctx = self._cu.retain_primary_context()
        except DriverCallError as e:
            raise self._error(e, "setup", None, None) from e.__cause__
        res.ctx, res.ctx_retained = self._ctx, True
        with self._cu.context(self._ctx):
            self._make_streams()

    def _make_streams(self) -> None:
        res = self._res
        non_blocking = self._cu.stream_non_blocking()
        # Non-blocking: no implicit synchronization with the legacy default stream, so a
        # copy never waits for unrelated compute; the events below order what must be.
        self._d2h = self._call("cuStreamCreate", non_blocking)
        res.streams.append(self._d2h)
        self._h2d = self._call("cuStreamCreate", non_blocking)
        res.streams.append(self._h2d)
        # The one event recorded on the compute stream before each copy. Reused at once:
        # cuStreamWaitEvent captures the work the event stands for at the time of the call,
        # a later cuEventRecord does not change what an earlier wait waits for.
        self._ready = self._new_event()

    # -- public API ------------------------------------------------------------------------

    @in_own_context
    def write_async(self, key: int, src: Any, nbytes: int, *, stream: Any = None) -> CopyFuture:
        """Copy ``src[:nbytes]`` (device) into pinned memory under ``key``, replacing its old
        bytes. The copy starts after the work already queued on the compute stream
        (``stream=`` or the tier's ``compute_stream``)."""
        nbytes = int(nbytes)
        address, size = _device_range(src, "src")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if size < nbytes:
            raise ValueError(f"key {key}: src holds {size} bytes, fewer than nbytes={nbytes}")
        with label(f"ooc.swap_out key={key}"), self._lock:
            self._check_open()
            self._poll()
            old = self._records.pop(key, None)
            if old is not None:
                self._retire(old)
            rec = _Record(nbytes, self._allocate(key, nbytes))
            self._live_bytes += nbytes
            self._peak_live_bytes = max(self._peak_live_bytes, self._live_bytes)
            self._records[key] = rec
            try:
                # (1) the bytes exist only once the compute stream's queued kernels have run
                self._order_after(self._d2h, self._compute(stream), "write", key, nbytes)
                for host, pos, n in self._segments(rec):
                    self._call("cuMemcpyDtoHAsync", host, address + pos, n, self._d2h,
                               op="write", key=key, nbytes=nbytes)
                t = self._submit("write", key, nbytes, rec, self._d2h)
            except BaseException:
                # Nothing was submitted as a transfer: drop the record. Copies already queued
                # into its pieces must have run before the pieces are reused.
                self._records.pop(key, None)
                self._live_bytes -= nbytes
                rec.retired = True
                self._after_failure(rec, self._d2h)
                raise
            rec.write = t
            return CopyFuture(self, t)

    @in_own_context
    def read_async(self, key: int, dst: Any, *, stream: Any = None) -> CopyFuture:
        """Copy ``key``'s bytes into the start of the device range ``dst``. The copy starts
        after the key's write and after the work already queued on the compute stream."""
        address, size = _device_range(dst, "dst")
        with label(f"ooc.swap_in key={key}"), self._lock:
            self._check_open()
            self._poll()
            rec = self._records.get(key)
            if rec is None:
                raise KeyError(f"PinnedTier: key {key} was never written, or was discarded")
            if size < rec.nbytes:
                raise ValueError(f"key {key}: dst holds {size} bytes, the key {rec.nbytes}")
            if self.verify:
                self._check_crc(key, rec)
            if rec.write_error is not None:
                raise StorageError(f"PinnedTier: key {key} cannot be swapped in: its swap-out "
                                   f"failed ({rec.write_error})")
            rec.refs += 1  # the pieces stay ours while the copy below may run
            try:
                # (1) dst may have been recycled by the pool while a kernel queued earlier on
                #     the compute stream still reads its old contents: start after that work.
                self._order_after(self._h2d, self._compute(stream), "read", key, rec.nbytes)
                w = rec.write
                if w is not None:
                    # (2) the pinned bytes are there only once the key's write has run: the
                    #     h2d stream waits for it on the device, the host does not.
                    self._call("cuStreamWaitEvent", self._h2d, w.event, 0,
                               op="read", key=key, nbytes=rec.nbytes)
                for host, pos, n in self._segments(rec):
                    self._call("cuMemcpyHtoDAsync", address + pos, host, n, self._h2d,
                               op="read", key=key, nbytes=rec.nbytes)
                t = self._submit("read", key, rec.nbytes, rec, self._h2d, counted=True)
            except BaseException:
                rec.refs -= 1
                self._after_failure(rec, self._h2d)
                raise
            return CopyFuture(self, t)

    @in_own_context
    def discard(self, key: int) -> None:
        """Forget ``key``; its pinned space is reused once no copy of it is in flight.
        Discarding an unknown key does nothing."""
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is not None:
                self._retire(rec)

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self._records

    def nbytes(self, key: int) -> int:
        """Bytes stored under ``key`` (KeyError if none)."""
        with self._lock:
            return self._records[key].nbytes

    @in_own_context
    def synchronize(self) -> None:
        """Block until every copy submitted so far is complete (errors go to their futures)."""
        with self._lock:
            self._check_open()
            for t in list(self._inflight.values()):
                if not t.complete and not t.waiters:
                    self._settle(t)

    @in_own_context
    def drain(self) -> None:
        """Block until every copy submitted so far is complete, with one host synchronization
        at most: the host-to-device stream waits, on the device, for the device-to-host
        stream's last copy, and the host waits for that stream alone. Nothing in flight (what
        a poll finds complete is booked first): no synchronization at all. Afterwards no copy
        touches any range handed to the tier. A closed tier has nothing in flight."""
        with self._lock:
            if self._closed:
                return
            self._poll()
            pending = [t for t in self._inflight.values() if not t.waiters]
            if not pending:
                return
            if any(t.kind == "write" for t in pending):
                self._call("cuEventRecord", self._ready, self._d2h, op="drain")
                self._call("cuStreamWaitEvent", self._h2d, self._ready, 0, op="drain")
            try:
                self._call("cuStreamSynchronize", self._h2d, op="drain")
            except StorageError as e:
                for t in pending:
                    self._finish(t, e)
                raise
            for t in pending:
                self._finish(t)

    @in_own_context
    def reserve(self, writes: "list[tuple[int | None, int]]") -> None:
        """Make sure that ``writes``, pairs ``(key, nbytes)`` (``key=None``: a new key), will
        find pinned room without allocating, by allocating the slabs now: the engine calls it
        before the optimizer step, so that a full capacity or a refused ``cuMemHostAlloc``
        raises StorageError before any parameter changes (as ``FileTier.reserve`` does for a
        full disk). A rewrite of a key with no copy in flight reuses its room."""
        with self._lock:
            self._check_open()
            self._poll()
            need = room_to_write(self._records, writes, ALIGN)
            ext = self._extents
            if need > ext.free_bytes + self.capacity_bytes - ext.end:
                self._drain_retired()   # copies of discarded keys may still hold room
            grow = need - ext.free_bytes
            if grow <= 0:
                return
            if ext.end + grow > self.capacity_bytes:
                raise StorageError(
                    f"PinnedTier: reserving room for the optimizer step: it may write "
                    f"{format_size(need)} ({need} bytes) of pinned memory; "
                    f"{format_size(self._live_bytes)} are live and the capacity is "
                    f"{format_size(self.capacity_bytes)} on device {self.device}. Raise "
                    "capacity_bytes, or raise the budget so less is swapped out")
            while len(self._res.slabs) * self.slab_bytes < ext.end + grow:
                n = min(self.slab_bytes, self.capacity_bytes - len(self._res.slabs) * self.slab_bytes)
                ptr = self._call("cuMemHostAlloc", n, 0, op="reserve", nbytes=need)
                self._res.slabs.append((int(ptr), n))

    @in_own_context
    def trim(self) -> int:
        """Free the pinned slabs above the highest live byte (waits for retired copies);
        return the pinned bytes still allocated."""
        with self._lock:
            self._check_open()
            self._drain_retired()
            end = self._extents.trim_end()
            keep = -(-end // self.slab_bytes)
            while len(self._res.slabs) > keep:
                ptr, n = self._res.slabs.pop()
                self._call("cuMemFreeHost", ptr, op="trim", key=None, nbytes=n)
            return sum(n for _, n in self._res.slabs)

    @in_own_context
    def stats(self) -> dict:
        """Counters as a plain dict with stable keys.

        bytes_written, bytes_read, writes, reads: completed transfers (payload bytes), counted
        when the tier learns of their completion (a poll at each call, a ``result()``).
        wait_s: host time spent blocked in ``result()`` (summed over threads).
        failed: transfers that completed with an error.
        host_syncs: driver calls that blocked the host until device work was done
        (``cuEventSynchronize``, ``cuStreamSynchronize``): a step should need O(1).
        live_bytes, peak_live_bytes, keys: bytes and keys held now, and the peak of bytes.
        pinned_bytes, peak_pinned_bytes, slabs: pinned memory allocated now / at most, and
        its slabs (the analogue of FileTier's file_bytes).
        in_flight: copies submitted and not known complete.
        capacity_bytes, slab_bytes, verify, device: the configuration.
        """
        with self._lock:
            if not self._closed:
                self._poll()
            out = dict(self._stats)
            out.update(
                host_syncs=self._cu.host_syncs,
                live_bytes=self._live_bytes, peak_live_bytes=self._peak_live_bytes,
                keys=len(self._records),
                pinned_bytes=sum(n for _, n in self._res.slabs),
                peak_pinned_bytes=self._slab_span(self._extents.peak_end),
                slabs=len(self._res.slabs), in_flight=len(self._inflight),
                capacity_bytes=self.capacity_bytes, slab_bytes=self.slab_bytes,
                verify=self.verify, device=self.device,
            )
        return out

    @in_own_context
    def close(self) -> None:
        """Wait for every copy in flight (their futures resolve), then destroy the events and
        streams, free the pinned memory and release the context. Idempotent. Raises
        StorageError if a step failed (after trying every step)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failed: list[str] = []
            try:
                for s in (self._d2h, self._h2d):
                    try:
                        self._call("cuStreamSynchronize", s, op="close", key=None, nbytes=None)
                    except StorageError as e:
                        failed.append(str(e))
                for t in list(self._inflight.values()):
                    self._settle(t)
                self._records.clear()
            finally:
                failed += self._finalizer() or []
                self._ctx = None   # released: later calls must not switch to it
        if failed:
            raise StorageError("PinnedTier.close: " + "; ".join(failed))

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "PinnedTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} keys"
        return (f"PinnedTier(device={self.device}, {state}, capacity "
                f"{format_size(self.capacity_bytes)}, verify={self.verify})")

    # -- ordering --------------------------------------------------------------------------

    def _order_after(self, copy_stream: Any, compute: Any, op: str, key: int,
                     nbytes: int) -> None:
        """Make ``copy_stream`` wait, on the device, for the work queued on ``compute`` so far."""
        self._call("cuEventRecord", self._ready, compute, op=op, key=key, nbytes=nbytes)
        self._call("cuStreamWaitEvent", copy_stream, self._ready, 0, op=op, key=key,
                   nbytes=nbytes)

    def _compute(self, stream: Any) -> Any:
        s = self.compute_stream if stream is None else stream
        return s() if callable(s) else s

    # -- transfers and their completion (under self._lock unless said) ---------------------

    def _submit(self, kind: str, key: int, nbytes: int, rec: _Record, stream: Any,
                counted: bool = False) -> _Transfer:
        event = self._take_event()
        try:
            self._call("cuEventRecord", event, stream, op=kind, key=key, nbytes=nbytes)
        except BaseException:
            self._free_events.append(event)
            raise
        if not counted:
            rec.refs += 1
        t = _Transfer(kind, key, nbytes, rec, event)
        self._inflight[id(t)] = t
        return t

    def _finish(self, t: _Transfer, error: StorageError | None = None) -> None:
        """Book a transfer the tier now knows to be complete (or failed)."""
        if t.complete:
            return
        t.complete = True
        t.error = error
        del self._inflight[id(t)]
        rec = t.rec
        rec.refs -= 1
        if t.kind == "write" and rec.write is t:
            rec.write = None          # nothing to wait for any more
            rec.write_error = error
        if error is None:
            if t.kind == "write":
                self._stats["bytes_written"] += t.nbytes
                self._stats["writes"] += 1
                if self.verify and not rec.retired:
                    rec.crc = self._crc(rec)
            else:
                self._stats["bytes_read"] += t.nbytes
                self._stats["reads"] += 1
        else:
            self._stats["failed"] += 1
        if rec.retired and rec.refs == 0:
            self._extents.free(rec.pieces)
        if t.waiters == 0:
            self._free_events.append(t.event)
            t.event = None

    def _poll(self) -> None:
        """Book every transfer whose event has completed (cuEventQuery never blocks)."""
        cu = self._cu
        for t in list(self._inflight.values()):
            if t.waiters:
                continue
            err = self._raw("cuEventQuery", t.event)[0]
            if err == cu.ok:
                self._finish(t)
            elif err != cu.not_ready:
                self._finish(t, self._error(cu.error("cuEventQuery", err), t.kind, t.key,
                                            t.nbytes))

    def _settle(self, t: _Transfer) -> None:
        """Block (holding the lock) until ``t`` is complete; book it."""
        try:
            self._call("cuEventSynchronize", t.event, op=t.kind, key=t.key, nbytes=t.nbytes)
        except StorageError as e:
            self._finish(t, e)
        else:
            self._finish(t)

    @in_own_context
    def _wait(self, t: _Transfer) -> StorageError | None:
        """``result()``: host-synchronize on the transfer's event without holding the lock."""
        with self._lock:
            if t.complete:
                return t.error
            t.waiters += 1
            event = t.event
        t0 = time.perf_counter()
        err = None
        with label(f"ooc.wait {t.kind} key={t.key}"):
            try:
                self._call("cuEventSynchronize", event, op=t.kind, key=t.key, nbytes=t.nbytes)
            except StorageError as e:
                err = e
        with self._lock:
            self._stats["wait_s"] += time.perf_counter() - t0
            t.waiters -= 1
            self._finish(t, err)
            if t.complete and t.waiters == 0 and t.event is not None:
                self._free_events.append(t.event)
                t.event = None
            return t.error

    @in_own_context
    def _is_done(self, t: _Transfer) -> bool:
        with self._lock:
            if not t.complete and not t.waiters and not self._closed:
                self._poll()
            return t.complete

    @in_own_context
    def _stream_wait(self, t: _Transfer, stream: Any) -> None:
        with self._lock:
            if t.complete:
                if t.error is not None:
                    raise _fresh(t.error) from t.error
                return  # already complete: nothing left to order after
            self._call("cuStreamWaitEvent", stream, t.event, 0, op=t.kind, key=t.key,
                       nbytes=t.nbytes)

    def _take_event(self) -> Any:
        return self._free_events.pop() if self._free_events else self._new_event()

    def _new_event(self) -> Any:
        # Timing disabled: these events only order and signal, and such events are cheaper.
        event = self._call("cuEventCreate", self._cu.event_no_timing())
        self._res.events.append(event)
        return event

    # -- pinned space (under self._lock) ---------------------------------------------------

    def _allocate(self, key: int, nbytes: int) -> list[tuple[int, int]]:
        need = round_up(max(nbytes, 1), ALIGN)
        ext = self._extents
        if need > ext.free_bytes + self.capacity_bytes - ext.end:
            self._drain_retired()  # copies of discarded keys may still hold space
        if need > ext.free_bytes + self.capacity_bytes - ext.end:
            raise StorageError(
                f"PinnedTier: no room for key {key}: it needs {format_size(need)} ({nbytes} "
                f"bytes) of pinned memory; {format_size(self._live_bytes)} are live and the "
                f"capacity is {format_size(self.capacity_bytes)} on device {self.device}. "
                "Raise capacity_bytes, or raise the budget so less is swapped out")
        pieces = ext.allocate(nbytes)
        try:
            while len(self._res.slabs) * self.slab_bytes < ext.end:
                n = min(self.slab_bytes, self.capacity_bytes - len(self._res.slabs) * self.slab_bytes)
                ptr = self._call("cuMemHostAlloc", n, 0, op="write", key=key, nbytes=nbytes)
                self._res.slabs.append((int(ptr), n))
        except BaseException:
            ext.free(pieces)
            ext.trim_end()
            raise
        return pieces

    def _segments(self, rec: _Record) -> list[tuple[int, int, int]]:
        """(pinned host pointer, offset in the key, bytes) for each contiguous piece of the
        key's first ``nbytes``; pieces crossing a slab boundary are split."""
        out, left, pos = [], rec.nbytes, 0
        for off, length in rec.pieces:
            n = min(length, left)
            while n > 0:
                s, within = divmod(off, self.slab_bytes)
                ptr, size = self._res.slabs[s]
                step = min(n, size - within)
                out.append((ptr + within, pos, step))
                off += step
                pos += step
                n -= step
                left -= step
            if left == 0:
                break
        return out

    def _slab_span(self, end: int) -> int:
        full, part = divmod(end, self.slab_bytes)
        return min(self.capacity_bytes, (full + (1 if part else 0)) * self.slab_bytes)

    def _retire(self, rec: _Record) -> None:
        rec.retired = True
        self._live_bytes -= rec.nbytes
        if rec.refs == 0:
            self._extents.free(rec.pieces)

    def _drain_retired(self) -> None:
        for t in list(self._inflight.values()):
            if t.rec.retired and not t.complete and not t.waiters:
                self._settle(t)

    def _after_failure(self, rec: _Record, stream: Any) -> None:
        """A submission failed half-way: some copies of ``rec`` may be queued on ``stream``.
        Wait for them, so that neither the pinned pieces nor the caller's device range are
        reused under a copy; if even that fails (the context is likely broken), never reuse
        the pieces: leaking pinned space until close() is safe, reusing it under a copy is not."""
        try:
            self._call("cuStreamSynchronize", stream, op="recover", key=None, nbytes=None)
        except StorageError as e:
            log.warning("PinnedTier: %s; %d pinned bytes stay allocated until close()", e,
                        sum(n for _, n in rec.pieces))
            rec.refs += 1
            return
        if rec.retired and rec.refs == 0:
            self._extents.free(rec.pieces)

    # -- verify ----------------------------------------------------------------------------

    def _crc(self, rec: _Record) -> int:
        crc = 0
        for host, _, n in self._segments(rec):
            crc = zlib.crc32((ctypes.c_char * n).from_address(host), crc)
        return crc

    def _check_crc(self, key: int, rec: _Record) -> None:
        if rec.write is not None:
            self._settle(rec.write)   # the checksum is taken from the completed write
        if rec.crc is not None and self._crc(rec) != rec.crc:
            raise StorageError(
                f"PinnedTier: key {key} is corrupted: CRC-32 mismatch over its "
                f"{format_size(rec.nbytes)} ({rec.nbytes} bytes) of pinned memory on device "
                f"{self.device}; the bytes changed after the swap-out completed (host memory "
                "fault, or something else wrote into the tier's pinned slabs)")

    # -- driver calls (through vmm.cuda_driver, the one module that calls the driver) ------

    def _raw(self, name: str, *args: Any) -> tuple:
        """The call's whole result, unchecked; an exception inside the driver is StorageError."""
        try:
            return self._cu.raw(name, *args)
        except DriverCallError as e:
            raise self._error(e, "setup", None, None) from e.__cause__

    def _call(self, name: str, *args: Any, op: str = "setup", key: int | None = None,
              nbytes: int | None = None) -> Any:
        """Call the driver; raise StorageError naming the call, the error, the key and the
        bytes unless the result is CUDA_SUCCESS; return the values after the error code."""
        try:
            return self._cu.call(name, *args)
        except DriverCallError as e:
            raise self._error(e, op, key, nbytes) from e.__cause__

    def _error(self, e: DriverCallError, op: str, key: int | None,
               nbytes: int | None) -> StorageError:
        if e.cuda_error is None:   # raised inside the driver: say so, as it said it
            err = StorageError(f"PinnedTier: {e.detail} on device {self.device}")
        else:
            what = {"write": "swapping out", "read": "swapping in"}.get(op, op)
            where = f" while {what} key {key}" if key is not None else f" ({what})"
            size = f" ({format_size(nbytes)}, {nbytes} bytes)" if nbytes is not None else ""
            err = StorageError(f"PinnedTier: {e.detail}{where}{size} on device {self.device}")
        err.cuda_error = e.cuda_error
        err.call = e.call
        return err

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("PinnedTier is closed")


def _fresh(err: StorageError) -> StorageError:
    """A new exception with ``err``'s message, to raise in the caller's thread. Re-raising the
    stored one would append the caller's frames to its traceback, and the tier (which keeps
    the error) would then keep the caller's locals, device tensors included, alive."""
    new = StorageError(*err.args)
    for attr in ("cuda_error", "call"):
        if hasattr(err, attr):
            setattr(new, attr, getattr(err, attr))
    return new


def _device_range(obj: Any, what: str) -> tuple[int, int]:
    try:
        return int(obj.address), int(obj.nbytes)
    except AttributeError:
        raise TypeError(f"PinnedTier: {what} must be a DevicePtr (device address and nbytes), "
                        f"got {type(obj).__name__}") from None
