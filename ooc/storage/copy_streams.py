"""The pinned tier's copies: two copy streams, the events that order them, and the copies in
flight until the tier knows them complete.

:class:`CopyStreams` owns the device-to-host stream (swap-out) and the host-to-device stream
(swap-in): one per direction, so that a prefetch never queues behind a swap-out (GPUs have a
copy engine per direction). Each copy is an :class:`InFlightCopy` with a completion event
recorded on its stream; :class:`CopyFuture` is the caller's handle on it. A completed copy is
booked once, by whoever learns of it first (a poll, a ``result()``, a drain), and handed to
the tier's ``on_complete`` (which owns the keys' bytes and counters).

Every driver call goes through :class:`vmm.cuda_driver.CudaDriver`; :meth:`CopyStreams.call`
turns its errors into :class:`~ooc.errors.StorageError` naming the call, the error, the key
and the bytes, for the tier's calls too.

Ordering guarantees (the reason for every event):

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

The pinned tier's driver calls, in order (each through :class:`vmm.cuda_driver.CudaDriver`;
each returns ``(CUresult, *values)``; every result is checked and a
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

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ooc.errors import StorageError
from ooc.runtime.labels import label
from vmm.cuda_driver import CudaDriver, DriverCallError, in_own_context
from vmm.units import format_size

if TYPE_CHECKING:
    from ooc.storage.pinned_slabs import KeyBytes, TierResources

__all__ = ["CopyFuture", "CopyStreams", "InFlightCopy", "fresh_error"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class InFlightCopy:
    """One copy in flight: its completion event on the copy stream, and who waits for it."""

    kind: str              # "write" (device -> pinned) or "read" (pinned -> device)
    key: int
    nbytes: int
    rec: "KeyBytes"
    event: Any
    complete: bool = False
    error: StorageError | None = None
    waiters: int = 0       # threads inside cuEventSynchronize on ``event`` (outside the lock)


class CopyFuture:
    """The handle of one transfer, returned by ``PinnedTier.write_async`` and ``read_async``;
    duck-compatible with ``concurrent.futures.Future`` for what the runtime uses (``result``,
    ``done``, ``exception``: the :class:`~ooc.storage.tier.Transfer` protocol).

    - :meth:`result` blocks the calling thread until the copy is complete (a host
      synchronization on the copy's event), then returns ``None`` or raises
      :class:`~ooc.errors.StorageError`. After a swap-out's ``result()`` the source may be
      freed; after a swap-in's ``result()`` any stream may use the destination.
    - :meth:`wait_on` makes a stream wait for the copy *without* blocking the host: kernels
      queued on that stream afterwards see the copied bytes. This is the cheap way to finish
      a swap-in on the compute stream.
    """

    __slots__ = ("_copies", "_t")

    def __init__(self, copies: "CopyStreams", transfer: InFlightCopy) -> None:
        self._copies = copies
        self._t = transfer

    def result(self, timeout: float | None = None) -> None:
        """Wait for the copy (host synchronization); raise StorageError if it failed.
        ``timeout`` is accepted for interface compatibility and ignored (a device copy
        cannot be abandoned half-way)."""
        err = self._copies.wait(self._t)
        if err is not None:
            raise fresh_error(err) from err

    def exception(self, timeout: float | None = None) -> StorageError | None:
        return self._copies.wait(self._t)

    def done(self) -> bool:
        """True once the copy is complete (asks the driver, never blocks)."""
        return self._copies.is_done(self._t)

    def wait_on(self, stream: Any) -> None:
        """Order ``stream`` (a ``CUstream`` or int handle) after the copy, with no host sync."""
        self._copies.stream_wait(self._t, stream)

    def wait_on_device(self) -> None:
        """Order the compute stream after the copy (see :meth:`wait_on`): what the runtime
        does to finish a transfer without a host synchronization."""
        self._copies.stream_wait(self._t, self._copies.compute(None))

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def __repr__(self) -> str:
        t = self._t
        state = "error" if t.error else ("done" if t.complete else "in flight")
        return f"<CopyFuture {t.kind} key={t.key} {t.nbytes} B {state}>"


class CopyStreams:
    """The tier's two copy streams and its copies in flight.

    ``lock`` is the tier's (the same state is booked under it); ``compute_stream`` the stream
    (or a callable returning it) whose kernels produce and consume the copied bytes;
    ``on_complete(copy, error)`` books a completed copy in the tier. Methods documented
    "under the lock" expect the caller to hold it.
    """

    def __init__(self, cu: CudaDriver, res: "TierResources", lock: Any, compute_stream: Any,
                 on_complete: Callable[[InFlightCopy, StorageError | None], None]) -> None:
        self._cu = cu
        self._res = res
        self._lock = lock
        self.compute_stream = compute_stream
        self._on_complete = on_complete
        self._ctx: Any = None     # the primary context, once the tier has retained it
        self.closed = False
        self.inflight: dict[int, InFlightCopy] = {}   # id(copy) -> copy, oldest first
        self._free_events: list[Any] = []
        self.wait_s = 0.0          # host time spent blocked in result(), summed over threads

    def open(self) -> Any:
        """Retain the device's primary context (PyTorch's, so that its streams and our events
        work together), make the streams and the ordering event in it; return the context."""
        res = self._res
        try:
            res.dev, self._ctx = self._cu.retain_primary_context()
        except DriverCallError as e:
            raise self.error(e, "setup", None, None) from e.__cause__
        res.ctx, res.ctx_retained = self._ctx, True
        with self._cu.context(self._ctx):
            self._create_streams()
        return self._ctx

    def _create_streams(self) -> None:
        non_blocking = self._cu.stream_non_blocking()
        # Non-blocking: no implicit synchronization with the legacy default stream, so a
        # copy never waits for unrelated compute; the events below order what must be.
        self.d2h = self.call("cuStreamCreate", non_blocking)
        self._res.streams.append(self.d2h)
        self.h2d = self.call("cuStreamCreate", non_blocking)
        self._res.streams.append(self.h2d)
        # The one event recorded on the compute stream before each copy. Reused at once:
        # cuStreamWaitEvent captures the work the event stands for at the time of the call,
        # a later cuEventRecord does not change what an earlier wait waits for.
        self.ready = self._new_event()

    def compute(self, stream: Any) -> Any:
        s = self.compute_stream if stream is None else stream
        return s() if callable(s) else s

    # -- ordering (under the lock) ---------------------------------------------------------
    def order_after(self, copy_stream: Any, compute: Any, op: str, key: int,
                    nbytes: int) -> None:
        """Make ``copy_stream`` wait, on the device, for the work queued on ``compute`` so far."""
        self.call("cuEventRecord", self.ready, compute, op=op, key=key, nbytes=nbytes)
        self.call("cuStreamWaitEvent", copy_stream, self.ready, 0, op=op, key=key,
                  nbytes=nbytes)

    # -- copies in flight (under the lock unless said) -------------------------------------
    def submit(self, kind: str, key: int, nbytes: int, rec: "KeyBytes",
               stream: Any) -> InFlightCopy:
        """Record the completion event of the copies just queued on ``stream``."""
        event = self._free_events.pop() if self._free_events else self._new_event()
        try:
            self.call("cuEventRecord", event, stream, op=kind, key=key, nbytes=nbytes)
        except BaseException:
            self._free_events.append(event)
            raise
        t = InFlightCopy(kind, key, nbytes, rec, event)
        self.inflight[id(t)] = t
        return t

    def finish(self, t: InFlightCopy, error: StorageError | None = None) -> None:
        """Book a copy known to be complete (or failed), once."""
        if t.complete:
            return
        t.complete = True
        t.error = error
        del self.inflight[id(t)]
        self._on_complete(t, error)
        if t.waiters == 0:
            self._free_events.append(t.event)
            t.event = None

    def poll(self) -> None:
        """Book every copy whose event has completed (cuEventQuery never blocks). A stream
        completes its copies in the order they were queued (``inflight``'s order, one stream
        per kind): past the first not done on a stream, the later ones are not asked (a
        Llama's step polled ~15 events a tier call, 2,077 queries a step, on the fake driver)."""
        cu = self._cu
        busy: set[str] = set()
        for t in list(self.inflight.values()):
            if t.waiters or t.kind in busy:
                continue
            err = self.raw("cuEventQuery", t.event)[0]
            if err == cu.ok:
                self.finish(t)
            elif err == cu.not_ready:
                busy.add(t.kind)
            else:
                self.finish(t, self.error(cu.error("cuEventQuery", err), t.kind, t.key,
                                          t.nbytes))

    def settle(self, t: InFlightCopy) -> None:
        """Block (holding the lock) until ``t`` is complete; book it."""
        try:
            self.call("cuEventSynchronize", t.event, op=t.kind, key=t.key, nbytes=t.nbytes)
        except StorageError as e:
            self.finish(t, e)
        else:
            self.finish(t)

    def settle_all(self, only: Callable[[InFlightCopy], bool] = lambda t: True) -> None:
        """:meth:`settle` every copy in flight (that ``only`` picks) no thread waits for."""
        for t in list(self.inflight.values()):
            if only(t) and not t.complete and not t.waiters:
                self.settle(t)

    def drain(self) -> None:
        """Block until every copy submitted so far is complete, with one host synchronization
        at most: the host-to-device stream waits, on the device, for the device-to-host
        stream's last copy, and the host waits for that stream alone. Nothing in flight (what
        a poll finds complete is booked first): no synchronization at all."""
        self.poll()
        pending = [t for t in self.inflight.values() if not t.waiters]
        if not pending:
            return
        if any(t.kind == "write" for t in pending):
            self.call("cuEventRecord", self.ready, self.d2h, op="drain")
            self.call("cuStreamWaitEvent", self.h2d, self.ready, 0, op="drain")
        try:
            self.call("cuStreamSynchronize", self.h2d, op="drain")
        except StorageError as e:
            for t in pending:
                self.finish(t, e)
            raise
        for t in pending:
            self.finish(t)

    @in_own_context
    def wait(self, t: InFlightCopy) -> StorageError | None:
        """``result()``: host-synchronize on the copy's event without holding the lock."""
        with self._lock:
            if t.complete:
                return t.error
            t.waiters += 1
            event = t.event
        t0 = time.perf_counter()
        err = None
        with label(f"ooc.wait {t.kind} key={t.key}"):
            try:
                self.call("cuEventSynchronize", event, op=t.kind, key=t.key, nbytes=t.nbytes)
            except StorageError as e:
                err = e
        with self._lock:
            self.wait_s += time.perf_counter() - t0
            t.waiters -= 1
            self.finish(t, err)
            if t.complete and t.waiters == 0 and t.event is not None:
                self._free_events.append(t.event)
                t.event = None
            return t.error

    @in_own_context
    def is_done(self, t: InFlightCopy) -> bool:
        with self._lock:
            if not t.complete and not t.waiters and not self.closed:
                self.poll()
            return t.complete

    @in_own_context
    def stream_wait(self, t: InFlightCopy, stream: Any) -> None:
        with self._lock:
            if t.complete:
                if t.error is not None:
                    raise fresh_error(t.error) from t.error
                return  # already complete: nothing left to order after
            self.call("cuStreamWaitEvent", stream, t.event, 0, op=t.kind, key=t.key,
                      nbytes=t.nbytes)

    def recover(self, stream: Any, nbytes: int) -> bool:
        """After a submission failed half-way, wait for the copies already queued on
        ``stream``, so that neither pinned pieces nor the caller's device range are reused
        under a copy. False if even that failed (the context is likely broken): then the
        ``nbytes`` of pinned pieces must never be reused; leaking them until close() is
        safe, reusing them under a copy is not."""
        try:
            self.call("cuStreamSynchronize", stream, op="recover", key=None, nbytes=None)
        except StorageError as e:
            log.warning("PinnedTier: %s; %d pinned bytes stay allocated until close()", e, nbytes)
            return False
        return True

    def _new_event(self) -> Any:
        # Timing disabled: these events only order and signal, and such events are cheaper.
        event = self.call("cuEventCreate", self._cu.event_no_timing())
        self._res.events.append(event)
        return event

    # -- driver calls (through vmm.cuda_driver, the one module that calls the driver) ------
    def raw(self, name: str, *args: Any) -> tuple:
        """The call's whole result, unchecked; an exception inside the driver is StorageError."""
        try:
            return self._cu.raw(name, *args)
        except DriverCallError as e:
            raise self.error(e, "setup", None, None) from e.__cause__

    def call(self, name: str, *args: Any, op: str = "setup", key: int | None = None,
             nbytes: int | None = None) -> Any:
        """Call the driver; raise StorageError naming the call, the error, the key and the
        bytes unless the result is CUDA_SUCCESS; return the values after the error code."""
        try:
            return self._cu.call(name, *args)
        except DriverCallError as e:
            raise self.error(e, op, key, nbytes) from e.__cause__

    def error(self, e: DriverCallError, op: str, key: int | None,
              nbytes: int | None) -> StorageError:
        if e.cuda_error is None:   # raised inside the driver: say so, as it said it
            err = StorageError(f"PinnedTier: {e.detail} on device {self._cu.device}")
        else:
            what = {"write": "swapping out", "read": "swapping in"}.get(op, op)
            where = f" while {what} key {key}" if key is not None else f" ({what})"
            size = f" ({format_size(nbytes)}, {nbytes} bytes)" if nbytes is not None else ""
            err = StorageError(f"PinnedTier: {e.detail}{where}{size} on device {self._cu.device}")
        err.cuda_error = e.cuda_error
        err.call = e.call
        return err


def fresh_error(err: StorageError) -> StorageError:
    """A new exception with ``err``'s message, to raise in the caller's thread. Re-raising the
    stored one would append the caller's frames to its traceback, and the tier (which keeps
    the error) would then keep the caller's locals, device tensors included, alive."""
    new = StorageError(*err.args)
    for attr in ("cuda_error", "call"):
        if hasattr(err, attr):
            setattr(new, attr, getattr(err, attr))
    return new
