"""A FAKE ``cuda.bindings.driver`` with copies: the VMM fake plus streams, events, pinned host
memory and async memcpy, with REAL bytes. Not CUDA; tests only.

:class:`FakeCopyDriver` extends :class:`ooc.testing.fake_cuda_driver.FakeDriver` (which keeps
enforcing the VMM contract) with the calls the pinned tier makes, and is just as strict:

- every call returns ``(CUresult, *values)`` and never raises; ``fail_next`` injects errors;
- *device memory holds bytes*: each physical chunk (``cuMemCreate`` handle) owns a bytearray,
  so bytes follow the chunk wherever it is mapped; device addresses are the VMM fake's;
- *copies* (``cuMemcpyDtoHAsync`` / ``cuMemcpyHtoDAsync``) must lie within mapped device
  ranges with read/write access set and within one allocated pinned range
  (``cuMemHostAlloc``), else ``CUDA_ERROR_INVALID_VALUE``; a pageable (unpinned) host pointer
  is refused too (the real driver would silently fall back to a synchronous copy);
- *copies run lazily*, in stream order, only when something waits for them:
  ``cuStreamSynchronize``, ``cuEventSynchronize``, ``cuEventQuery`` (unless ``paused``) and
  ``cuCtxSynchronize``. Running is demand-driven: completing a stream runs only that stream's
  queue, and another stream's work only through a ``cuStreamWaitEvent`` on it. So a copy that
  should have waited for a kernel on the compute stream but did not reads the *old* bytes, and
  a destination read before the right synchronize shows stale bytes: tests can see a
  missing wait;
- *events*: a wait or synchronize on an event never recorded is refused
  (``CUDA_ERROR_NOT_PERMITTED``, ``strict``; the real driver treats it as "no work" and
  succeeds, which hides the bug); ``cuStreamWaitEvent`` captures the event's work at the time
  of the call (a later record does not change it), as documented; flags must be 0;
- *destroyed or unknown streams and events* give ``CUDA_ERROR_INVALID_HANDLE``; the default
  stream (handle 0) exists always and cannot be destroyed; destroying a stream first runs
  its queued work (the driver finishes it);
- *use after free*: ``cuMemUnmap`` of device memory or ``cuMemFreeHost`` of pinned memory
  that a queued, not yet run copy still touches is refused (``strict``) and recorded in
  ``violations``; a copy whose memory disappeared anyway fails at run time with a sticky
  ``CUDA_ERROR_ILLEGAL_ADDRESS`` that every later synchronize returns (like a real context).

Streams are modelled as independent (``CU_STREAM_NON_BLOCKING``); the legacy default stream's
implicit synchronization with blocking streams is not modelled (stricter than the driver).

Fake-only helpers: :meth:`write_device` / :meth:`read_device` (immediate access, like a
finished kernel: ``read_device`` does NOT run queued copies), :meth:`kernel_write` (a pretend
kernel writing bytes, queued on a stream), :meth:`outstanding` (live streams, events, pinned
allocations, queued ops, plus the VMM counts), ``paused`` (``cuEventQuery`` answers
``CUDA_ERROR_NOT_READY`` instead of running work: a slow GPU).

Where the pieces are: streams, events and the order work runs in are
:mod:`ooc.testing.fake_cuda_streams`; the VMM contract is :mod:`ooc.testing.fake_cuda_driver`;
here pinned host memory, the copies, the device bytes and the fake-only helpers.
"""

from __future__ import annotations

import ctypes
import threading
from bisect import bisect_right, insort
from typing import Any, Callable

from ooc.testing import fake_cuda_driver as base
from ooc.testing.fake_cuda_streams import (_BAD_HANDLE, _INVALID, _OK, CUevent, CUevent_flags,
                                           CUresult, CUstream_flags, FakeStreams, _Event, _Op,
                                           _Stream)
from ooc.testing.fake_cuda_types import CUmemAccess_flags, _addr

__all__ = ["FakeCopyDriver", "CUresult", "new"]

CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02
CU_MEMHOSTALLOC_WRITECOMBINED = 0x04


class FakeCopyDriver(FakeStreams, base.FakeDriver):
    """The VMM fake plus streams, events, pinned memory and lazy async copies with real bytes.

    Args (beyond :class:`~ooc.testing.fake_cuda_driver.FakeDriver`'s):
        pinned_limit: most pinned host memory ``cuMemHostAlloc`` grants in total
            (``CUDA_ERROR_OUT_OF_MEMORY`` past it).
    """

    CUresult = CUresult
    CUstream_flags = CUstream_flags
    CUevent_flags = CUevent_flags
    CUevent = CUevent
    CU_MEMHOSTALLOC_PORTABLE = CU_MEMHOSTALLOC_PORTABLE
    CU_MEMHOSTALLOC_DEVICEMAP = CU_MEMHOSTALLOC_DEVICEMAP
    CU_MEMHOSTALLOC_WRITECOMBINED = CU_MEMHOSTALLOC_WRITECOMBINED

    def __init__(self, *, pinned_limit: int = 1 << 30, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pinned_limit = pinned_limit
        self.pinned_bytes = 0
        self.pinned: dict[int, tuple[int, Any]] = {}   # start -> (size, ctypes buffer)
        self._pinned_starts: list[int] = []
        self.chunk_bytes: dict[int, bytearray] = {}    # cuMemCreate handle -> its bytes
        self.streams: dict[int, _Stream] = {0: _Stream(0, 0)}  # 0: the default stream
        self.events: dict[int, _Event] = {}
        self.sticky: CUresult | None = None
        self.paused = False
        # Modes of ooc.testing.fake_cuda (off here, so the tier's own tests see plain streams):
        # ``immediate_default_stream``: stream 0 is the host's (PyTorch CPU "kernels" run at
        # once), so a record on it is complete at once and a wait on it runs the awaited work
        # now; ``compute_order``: a copy on another stream must follow a wait on an event
        # recorded on stream 0 since that stream's last record (each transfer is ordered
        # after the kernels queued before it), else a violation.
        self.immediate_default_stream = False
        self.compute_order = False
        self.copies_run = 0
        self._next_stream = 0x5000
        self._next_event = 0xE000
        self._mutex = threading.RLock()

    # -- fake-only helpers -------------------------------------------------------------
    def outstanding(self) -> dict[str, int]:
        """The VMM counts plus live streams (not the default one), events, pinned
        allocations and queued, not yet run operations."""
        out = super().outstanding()
        out.update(streams=sum(1 for h, s in self.streams.items() if h and not s.destroyed),
                   events=sum(1 for e in self.events.values() if not e.destroyed),
                   pinned=len(self.pinned), queued_ops=self.queued_ops())
        return out

    def queued_ops(self) -> int:
        return sum(len(s.queue) for s in self.streams.values())

    def write_device(self, address: int, data: bytes) -> None:
        """Write device bytes now (a kernel that already ran). Raises ValueError unless the
        range is mapped with read/write access."""
        with self._mutex:
            pieces = self._device_pieces(int(address), len(data))
            if pieces is None:
                raise ValueError(f"write_device: [0x{int(address):x}, +{len(data)}) is not "
                                 "mapped with read/write access")
            _scatter(pieces, memoryview(bytes(data)))

    def read_device(self, address: int, nbytes: int) -> bytes:
        """Device bytes as they are NOW: queued copies that have not run are not reflected."""
        with self._mutex:
            pieces = self._device_pieces(int(address), int(nbytes))
            if pieces is None:
                raise ValueError(f"read_device: [0x{int(address):x}, +{nbytes}) is not "
                                 "mapped with read/write access")
            return _gather(pieces)

    def kernel_write(self, stream: Any, address: int, data: bytes) -> tuple:
        """Queue a pretend kernel on ``stream`` that writes ``data`` at ``address`` when it
        runs (device range checked now and again when it runs). It stands for a kernel
        PyTorch launches, and PyTorch makes its own context current: no context is asked of
        the calling thread."""
        with self._mutex:
            if (r := self._enter("kernel_write")) is not None:
                return r
            s = self._stream(stream)
            if s is None:
                return (_BAD_HANDLE,)
            address, data = int(address), bytes(data)
            if self._device_pieces(address, len(data)) is None:
                return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)

            def run() -> None:
                pieces = self._device_pieces(address, len(data))
                if pieces is None:
                    return self._fault(f"kernel_write at 0x{address:x} ran on unmapped memory")
                _scatter(pieces, memoryview(data))

            s.queue.append(_Op("kernel", run=run, device=(address, len(data)),
                               label=f"kernel_write 0x{address:x}"))
            return _OK

    # -- pinned host memory ------------------------------------------------------------
    def cuMemHostAlloc(self, bytesize: int, Flags: int) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuMemHostAlloc", needs_ctx=True)) is not None:
                return r + (None,)
            allowed = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | \
                CU_MEMHOSTALLOC_WRITECOMBINED
            if (not isinstance(bytesize, int) or bytesize <= 0 or not isinstance(Flags, int)
                    or Flags & ~allowed):
                return (_INVALID, None)
            if self.pinned_bytes + bytesize > self.pinned_limit:
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            buf = (ctypes.c_char * bytesize)()   # real host memory: the CPU may read it
            ptr = ctypes.addressof(buf)
            self.pinned[ptr] = (bytesize, buf)
            insort(self._pinned_starts, ptr)
            self.pinned_bytes += bytesize
            return (CUresult.CUDA_SUCCESS, ptr)

    def cuMemFreeHost(self, p: Any) -> tuple:  # noqa: N802
        with self._mutex:
            if (r := self._enter("cuMemFreeHost", needs_ctx=True)) is not None:
                return r
            ptr = _addr(p)
            if ptr is None or ptr not in self.pinned:
                return (_INVALID,)
            size = self.pinned[ptr][0]
            busy = self._queued_touching("pinned", ptr, size)
            if busy and (v := self._violation(
                    f"cuMemFreeHost of 0x{ptr:x} while a queued copy still uses it ({busy})")):
                return v
            del self.pinned[ptr]
            self._pinned_starts.remove(ptr)
            self.pinned_bytes -= size
            return _OK
    # -- copies ------------------------------------------------------------------------
    def cuMemcpyDtoHAsync(self, dstHost: Any, srcDevice: Any, ByteCount: int,  # noqa: N802,N803
                          hStream: Any) -> tuple:
        return self._copy("cuMemcpyDtoHAsync", "d2h", dstHost, srcDevice, ByteCount, hStream)

    def cuMemcpyHtoDAsync(self, dstDevice: Any, srcHost: Any, ByteCount: int,  # noqa: N802,N803
                          hStream: Any) -> tuple:
        return self._copy("cuMemcpyHtoDAsync", "h2d", srcHost, dstDevice, ByteCount, hStream)

    def _copy(self, name: str, direction: str, host: Any, device: Any, n: Any,
              stream: Any) -> tuple:
        with self._mutex:
            if (r := self._enter(name, needs_ctx=True)) is not None:
                return r
            s = self._stream(stream)
            if s is None:
                return (_BAD_HANDLE,)
            h, d = _addr(host), _addr(device)
            if h is None or d is None or not isinstance(n, int) or n < 0:
                return (_INVALID,)
            if n == 0:
                return _OK
            if self._device_pieces(d, n) is None:
                self.violations.append(f"{name}: device range [0x{d:x}, +{n}) is not mapped "
                                       "with read/write access")
                return (_INVALID,)
            if self._pinned_of(h, n) is None:
                self.violations.append(f"{name}: host range [0x{h:x}, +{n}) is not inside one "
                                       "pinned allocation")
                return (_INVALID,)
            if self.compute_order and s.handle != 0 and not s.ordered:
                if (v := self._violation(
                        f"{name} of {n} bytes on stream 0x{s.handle:x} is not ordered after the "
                        "compute stream (no cuStreamWaitEvent on an event recorded on it since "
                        "the stream's last record): on a GPU it may run before the kernels "
                        "that produce or still read the device bytes")):
                    return v

            guard = self._device_guard(d, n)

            def run() -> None:
                pieces = self._device_pieces(d, n)
                if guard is not None and not guard():
                    pieces = None   # the memory it was issued on was freed or resized since
                if pieces is None or self._pinned_of(h, n) is None:
                    return self._fault(f"{name} of {n} bytes ran after its memory was unmapped "
                                       "or freed")
                host_view = (ctypes.c_char * n).from_address(h)
                if direction == "d2h":
                    ctypes.memmove(host_view, _gather(pieces), n)
                else:
                    _scatter(pieces, memoryview(bytes(host_view)))
                self.copies_run += 1

            s.queue.append(_Op("copy", run=run, device=(d, n), pinned=(h, n),
                               label=f"{name} 0x{h:x} 0x{d:x} {n}"))
            if s.handle == 0 and self.immediate_default_stream:
                self._run_all(s)
                return self._sticky_or_ok()
            return _OK

    # -- VMM calls that now also move or guard bytes -------------------------------------
    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:  # noqa: N802
        result = super().cuMemCreate(size, prop, flags)
        if result[0] == CUresult.CUDA_SUCCESS:
            self.chunk_bytes[int(result[1])] = bytearray(size)
        return result

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:  # noqa: N802
        result = super().cuMemMap(ptr, size, offset, handle, flags)
        if result[0] == CUresult.CUDA_SUCCESS:
            self.mappings[_addr(ptr)]["offset"] = offset
        return result

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple:  # noqa: N802
        with self._mutex:
            start = _addr(ptr)
            if start is not None and isinstance(size, int):
                busy = self._queued_touching("device", start, size)
                if busy:
                    self.calls.append("cuMemUnmap")
                    if (v := self._violation(f"cuMemUnmap of 0x{start:x} while a queued copy "
                                             f"still uses it ({busy})")):
                        return v
                    self.calls.pop()
            result = super().cuMemUnmap(ptr, size)
            self._forget_released()
            return result

    def cuMemRelease(self, handle: Any) -> tuple:  # noqa: N802
        result = super().cuMemRelease(handle)
        self._forget_released()
        return result

    # -- internals ---------------------------------------------------------------------
    def _forget_released(self) -> None:
        for h in [h for h in self.chunk_bytes if h not in self.handles]:
            del self.chunk_bytes[h]

    def _pinned_of(self, ptr: int, n: int) -> int | None:
        i = bisect_right(self._pinned_starts, ptr) - 1
        if i >= 0:
            start = self._pinned_starts[i]
            if ptr + n <= start + self.pinned[start][0]:
                return start
        return None

    def _device_pieces(self, start: int, size: int) -> list[tuple[bytearray, int, int]] | None:
        """(chunk bytes, offset in the chunk, length) covering the span, or None unless every
        byte is mapped with read/write access."""
        if size <= 0:
            return []
        outside = self._outside_device_pieces(start, size)
        if outside is not None:
            return outside
        out = []
        stop = start + size
        for m_start, m in self._covering(start, size):
            if m is None or m["access"] != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                return None
            lo, hi = max(start, m_start), min(stop, m_start + m["size"])
            off = m.get("offset", 0) + lo - m_start
            out.append((self.chunk_bytes[m["handle"]], off, hi - lo))
        return out


    def _device_guard(self, start: int, size: int) -> Callable[[], bool] | None:
        """For a copy issued now: a check, at run time, that its device memory is still the
        memory it was issued on (a subclass that knows PyTorch's memory gives one)."""
        return None

    def _outside_device_pieces(self, start: int, size: int) -> list | None:
        """Device memory outside the VMM ranges (a subclass may know some: see
        :class:`ooc.testing.fake_cuda_host.HostBackedFakeDriver`); here, none."""
        return None


def _gather(pieces: list[tuple[bytearray, int, int]]) -> bytes:
    return b"".join(bytes(buf[off:off + n]) for buf, off, n in pieces)


def _scatter(pieces: list[tuple[bytearray, int, int]], data: memoryview) -> None:
    pos = 0
    for buf, off, n in pieces:
        buf[off:off + n] = data[pos:pos + n]
        pos += n


def new(**kwargs: Any) -> FakeCopyDriver:
    """A fresh fake driver with copies (see :class:`FakeCopyDriver`)."""
    return FakeCopyDriver(**kwargs)
