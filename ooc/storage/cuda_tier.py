"""The slower tier on a GPU: pinned host memory, filled and drained by two copy streams.

:class:`PinnedTier` is :class:`~ooc.storage.FileTier`'s counterpart for CUDA devices, with the
same interface (``write_async`` / ``read_async`` / ``discard`` / ``stats`` / ``close``), where
sources and destinations are :class:`~ooc.runtime.cuda_seam.DevicePtr` (device address + bytes)
instead of host buffers, and transfers are asynchronous device copies ordered with CUDA events
instead of jobs on I/O threads.

Written against the documented driver API of cuda-python and run on an H100
(benchmarks/results/gpu.md, ``pytest -m gpu``); without a GPU, tested against a fake driver that
enforces the same contract (``ooc/testing/fake_cuda_copies.py``: copies only within mapped,
accessible device ranges and pinned ranges, events recorded before they are waited on, stream
order, copies run lazily so a missing wait shows stale bytes).

Every driver call goes through :class:`vmm.cuda_driver.CudaDriver` (the one module that calls
the driver); their order, and what each is for, is listed in :mod:`ooc.storage.copy_streams`.
Every result is checked and a failure raises :class:`~ooc.errors.StorageError` naming the call,
the error, the key and the bytes.

The tier's parts: :mod:`ooc.storage.copy_streams` (the streams, events and copies in flight,
:class:`CopyFuture`), :mod:`ooc.storage.pinned_slabs` (the pinned slabs, each key's pieces,
and the resources a finalizer gives back); this module keeps the keys and the public API.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ooc.errors import StorageError
from ooc.storage.copy_streams import CopyFuture, CopyStreams, InFlightCopy
from ooc.runtime.cuda_seam import device_range
from ooc.runtime.labels import label
from ooc.storage.pinned_slabs import (ALIGN, DEFAULT_SLAB, KeyBytes, PinnedSlabs, TierResources,
                                      half_the_ram, release_resources)
from ooc.storage.extents import room_to_write, round_up
from vmm.cuda_driver import CudaDriver, import_driver, in_own_context
from vmm.units import format_size, parse_size

__all__ = ["PinnedTier", "CopyFuture", "import_driver"]   # import_driver: vmm.cuda_driver's


class PinnedTier:
    """Swapped-out bytes of a GPU in pinned host memory, moved by two copy streams.

    ``write_async(key, src, nbytes)`` copies the first ``nbytes`` of the device range ``src``
    into pinned memory under ``key``; ``read_async(key, dst)`` copies them back into the device
    range ``dst``. ``src`` and ``dst`` are :class:`~ooc.runtime.cuda_seam.DevicePtr` (anything
    with int ``address`` and ``nbytes``). Both return a :class:`CopyFuture`. Conforms to
    :class:`~ooc.storage.tier.SlowerTier`.

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

    Ordering: a copy starts after the work queued on the compute stream before the call; a
    read waits (on the device) for its key's write; pinned space is reused only once no copy
    of it is in flight (the reasons: :mod:`ooc.storage.copy_streams`). The caller keeps
    ``src``/``dst`` alive and untouched until the future resolves (or ``wait_on(stream)``).

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
        cap = half_the_ram() if capacity_bytes is None else parse_size(capacity_bytes,
                                                                        what="pinned capacity")
        self.capacity_bytes = round_up(cap, ALIGN)
        slab = DEFAULT_SLAB if slab_bytes is None else parse_size(slab_bytes, what="slab size")
        self.slab_bytes = min(round_up(slab, ALIGN), self.capacity_bytes)
        self.verify = bool(verify)
        self._lock = threading.RLock()
        self._ctx: Any = None           # the device's primary context, once retained
        self._records: dict[int, KeyBytes] = {}
        self._closed = False
        self._live_bytes = 0
        self._peak_live_bytes = 0
        self._stats = dict(bytes_written=0, bytes_read=0, writes=0, reads=0, failed=0)
        self._res = TierResources(self._cu)
        self._slabs = PinnedSlabs(self.capacity_bytes, self.slab_bytes, self._res.slabs)
        self._copies = CopyStreams(self._cu, self._res, self._lock, compute_stream,
                                   self._booked)
        self._finalizer = weakref.finalize(self, release_resources, self._res)
        try:
            self._ctx = self._copies.open()
        except BaseException:
            self._finalizer()
            raise

    # -- public API ------------------------------------------------------------------------

    @in_own_context
    def write_async(self, key: int, src: Any, nbytes: int, *, stream: Any = None) -> CopyFuture:
        """Copy ``src[:nbytes]`` (device) into pinned memory under ``key``, replacing its old
        bytes. The copy starts after the work already queued on the compute stream
        (``stream=`` or the tier's ``compute_stream``)."""
        nbytes = int(nbytes)
        address, size = device_range(src, "src")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if size < nbytes:
            raise ValueError(f"key {key}: src holds {size} bytes, fewer than nbytes={nbytes}")
        copies = self._copies
        with label("ooc.swap_out key=", key), self._lock:
            self._check_open()
            copies.poll()
            old = self._records.pop(key, None)
            if old is not None:
                self._retire(old)
            rec = KeyBytes(nbytes, self._allocate(key, nbytes))
            self._live_bytes += nbytes
            self._peak_live_bytes = max(self._peak_live_bytes, self._live_bytes)
            self._records[key] = rec
            try:
                # (1) the bytes exist only once the compute stream's queued kernels have run
                self._order_after(copies.d2h, copies.compute(stream), "write", key, nbytes)
                for host, pos, n in self._slabs.segments(rec):
                    copies.call("cuMemcpyDtoHAsync", host, address + pos, n, copies.d2h,
                                op="write", key=key, nbytes=nbytes)
                t = copies.submit("write", key, nbytes, rec, copies.d2h)
            except BaseException:
                # Nothing was submitted as a transfer: drop the record. Copies already queued
                # into its pieces must have run before the pieces are reused.
                self._records.pop(key, None)
                self._live_bytes -= nbytes
                rec.retired = True
                self._after_failure(rec, copies.d2h)
                raise
            rec.refs += 1
            rec.write = t
            return CopyFuture(copies, t)

    @in_own_context
    def read_async(self, key: int, dst: Any, *, stream: Any = None) -> CopyFuture:
        """Copy ``key``'s bytes into the start of the device range ``dst``. The copy starts
        after the key's write and after the work already queued on the compute stream."""
        address, size = device_range(dst, "dst")
        copies = self._copies
        with label("ooc.swap_in key=", key), self._lock:
            self._check_open()
            copies.poll()
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
                self._order_after(copies.h2d, copies.compute(stream), "read", key, rec.nbytes)
                w = rec.write
                if w is not None:
                    # (2) the pinned bytes are there only once the key's write has run: the
                    #     h2d stream waits for it on the device, the host does not.
                    copies.call("cuStreamWaitEvent", copies.h2d, w.event, 0,
                                op="read", key=key, nbytes=rec.nbytes)
                for host, pos, n in self._slabs.segments(rec):
                    copies.call("cuMemcpyHtoDAsync", address + pos, host, n, copies.h2d,
                                op="read", key=key, nbytes=rec.nbytes)
                t = copies.submit("read", key, rec.nbytes, rec, copies.h2d)
            except BaseException:
                rec.refs -= 1
                self._after_failure(rec, copies.h2d)
                raise
            return CopyFuture(copies, t)

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
            self._copies.settle_all()

    @in_own_context
    def drain(self) -> None:
        """Block until every copy submitted so far is complete, with one host synchronization
        at most (see :meth:`CopyStreams.drain <ooc.storage.copy_streams.CopyStreams.drain>`).
        Afterwards no copy touches any range handed to the tier. A closed tier has nothing in
        flight."""
        with self._lock:
            if not self._closed:
                self._copies.drain()

    @in_own_context
    def reserve(self, writes: "list[tuple[int | None, int]]") -> None:
        """Make sure that ``writes``, pairs ``(key, nbytes)`` (``key=None``: a new key), will
        find pinned room without allocating, by allocating the slabs now: the engine calls it
        before the optimizer step, so that a full capacity or a refused ``cuMemHostAlloc``
        raises StorageError before any parameter changes (as ``FileTier.reserve`` does for a
        full disk). A rewrite of a key with no copy in flight reuses its room."""
        with self._lock:
            self._check_open()
            self._copies.poll()
            need = room_to_write(self._records, writes, ALIGN)
            if need > self._slabs.headroom():
                self._drain_retired()   # copies of discarded keys may still hold room
            self._slabs.reserve(need, self._live_bytes, self.device, lambda n: self._copies.call(
                "cuMemHostAlloc", n, 0, op="reserve", nbytes=need))

    @in_own_context
    def trim(self) -> int:
        """Free the pinned slabs above the highest live byte (waits for retired copies);
        return the pinned bytes still allocated."""
        with self._lock:
            self._check_open()
            self._drain_retired()
            return self._slabs.trim(lambda ptr, n: self._copies.call(
                "cuMemFreeHost", ptr, op="trim", key=None, nbytes=n))

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
                self._copies.poll()
            out = dict(self._stats)
            out.update(
                wait_s=self._copies.wait_s, host_syncs=self._cu.host_syncs,
                live_bytes=self._live_bytes, peak_live_bytes=self._peak_live_bytes,
                keys=len(self._records), pinned_bytes=self._slabs.pinned_bytes,
                peak_pinned_bytes=self._slabs.span(self._slabs.extents.peak_end),
                slabs=len(self._res.slabs), in_flight=len(self._copies.inflight),
                capacity_bytes=self.capacity_bytes, slab_bytes=self.slab_bytes,
                verify=self.verify, device=self.device,
            )
        return out

    @in_own_context
    def close(self) -> None:
        """Wait for every copy in flight (their futures resolve), then destroy the events and
        streams, free the pinned memory and release the context. Idempotent. Raises
        StorageError if a step failed (after trying every step)."""
        copies = self._copies
        with self._lock:
            if self._closed:
                return
            self._closed = copies.closed = True
            failed: list[str] = []
            try:
                for s in (copies.d2h, copies.h2d):
                    try:
                        copies.call("cuStreamSynchronize", s, op="close", key=None, nbytes=None)
                    except StorageError as e:
                        failed.append(str(e))
                for t in list(copies.inflight.values()):
                    copies.settle(t)
                self._records.clear()
            finally:
                failed += self._finalizer() or []
                self._ctx = copies._ctx = None   # released: later calls must not switch to it
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

    # -- the keys' bytes (under self._lock) ------------------------------------------------

    def _order_after(self, copy_stream: Any, compute: Any, op: str, key: int,
                     nbytes: int) -> None:
        """Make ``copy_stream`` wait, on the device, for the work queued on ``compute`` so far."""
        self._copies.order_after(copy_stream, compute, op, key, nbytes)

    def _booked(self, t: InFlightCopy, error: StorageError | None) -> None:
        """What a completed (or failed) copy changes: its key's record and the counters."""
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
                    rec.crc = self._slabs.crc(rec)
            else:
                self._stats["bytes_read"] += t.nbytes
                self._stats["reads"] += 1
        else:
            self._stats["failed"] += 1
        if rec.retired and rec.refs == 0:
            self._slabs.free(rec.pieces)

    def _allocate(self, key: int, nbytes: int) -> list[tuple[int, int]]:
        if round_up(max(nbytes, 1), ALIGN) > self._slabs.headroom():
            self._drain_retired()  # copies of discarded keys may still hold space
        return self._slabs.allocate_key(key, nbytes, self._live_bytes, self.device,
                                        lambda n: self._copies.call(
                                            "cuMemHostAlloc", n, 0, op="write", key=key,
                                            nbytes=nbytes))

    def _retire(self, rec: KeyBytes) -> None:
        rec.retired = True
        self._live_bytes -= rec.nbytes
        if rec.refs == 0:
            self._slabs.free(rec.pieces)

    def _drain_retired(self) -> None:
        self._copies.settle_all(only=lambda t: t.rec.retired)

    def _after_failure(self, rec: KeyBytes, stream: Any) -> None:
        """A submission failed half-way: some copies of ``rec`` may be queued on ``stream``.
        Its pieces are reused only once they are known to have run (else never: see
        :meth:`CopyStreams.recover <ooc.storage.copy_streams.CopyStreams.recover>`)."""
        if not self._copies.recover(stream, sum(n for _, n in rec.pieces)):
            rec.refs += 1   # leaked until close()
        elif rec.retired and rec.refs == 0:
            self._slabs.free(rec.pieces)

    def _check_crc(self, key: int, rec: KeyBytes) -> None:
        if rec.write is not None:
            self._copies.settle(rec.write)   # the checksum is taken from the completed write
        self._slabs.check_crc(key, rec, self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("PinnedTier is closed")
