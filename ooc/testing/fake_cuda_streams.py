"""Streams and events of the FAKE ``cuda.bindings.driver`` with copies: queues of work run
lazily, in stream order, only when something waits for them. Not CUDA; tests only.

The rules (demand-driven running, waits captured at the time of the call, events that were
never recorded refused, the sticky error of a copy that ran on freed memory) are those of
:mod:`ooc.testing.fake_cuda_copies`'s docstring. Apart from that module (pinned host memory,
the copies themselves and the device bytes) because ordering work is a separate concern from
moving bytes: the copies and the pretend kernels are queued here as opaque operations
(``_Op.run``). :class:`FakeStreams` is a mixin of
:class:`~ooc.testing.fake_cuda_copies.FakeCopyDriver`, whose constructor makes the state
(``streams``, ``events``, ``sticky``, ``paused``, the modes, ``_mutex``).
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Callable

from ooc.testing.fake_cuda_types import CUresult as _VmmCUresult
from ooc.testing.fake_cuda_types import CUstream, _Handle

__all__ = ["FakeStreams", "CUresult", "CUstream_flags", "CUevent_flags", "CUevent"]

# The base fake's CUresult plus the codes that copies, streams and events use.
CUresult = enum.IntEnum("CUresult", {**{m.name: int(m) for m in _VmmCUresult},
                                     "CUDA_ERROR_NOT_READY": 600})


class CUstream_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUevent_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2
    CU_EVENT_INTERPROCESS = 4


class CUevent(_Handle):
    pass


_OK = (CUresult.CUDA_SUCCESS,)
_INVALID = CUresult.CUDA_ERROR_INVALID_VALUE
_BAD_HANDLE = CUresult.CUDA_ERROR_INVALID_HANDLE


class _Mark:
    """One cuEventRecord: done once the stream it was recorded on has run up to it."""

    __slots__ = ("stream", "done")

    def __init__(self, stream: "_Stream") -> None:
        self.stream = stream
        self.done = False


class _Op:
    """Queued work: a copy or kernel (``run`` moves bytes), a record (``mark``) or a wait."""

    __slots__ = ("kind", "run", "mark", "device", "pinned", "label")

    def __init__(self, kind: str, *, run: Callable[[], None] | None = None,
                 mark: _Mark | None = None, device: tuple[int, int] | None = None,
                 pinned: tuple[int, int] | None = None, label: str = "") -> None:
        self.kind = kind
        self.run = run
        self.mark = mark
        self.device = device    # (address, bytes) of device memory the op touches
        self.pinned = pinned    # (address, bytes) of pinned memory the op touches
        self.label = label


class _Stream:
    __slots__ = ("handle", "queue", "destroyed", "flags", "ordered", "ctx")

    def __init__(self, handle: int, flags: int, ctx: int = 0) -> None:
        self.handle = handle
        self.ctx = ctx          # the context it was made in (0: the default stream, any)
        self.queue: collections.deque[_Op] = collections.deque()
        self.destroyed = False
        self.flags = flags
        self.ordered = False   # waited for the compute stream since its last record


class _Event:
    __slots__ = ("handle", "last", "destroyed", "flags")

    def __init__(self, handle: int, flags: int) -> None:
        self.handle = handle
        self.last: _Mark | None = None  # the most recent record
        self.destroyed = False
        self.flags = flags



class FakeStreams:
    """The stream and event calls of the fake driver with copies (see the module docstring)."""

    # -- streams -----------------------------------------------------------------------
    def cuStreamCreate(self, Flags: int) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuStreamCreate", needs_ctx=True)) is not None:
                return r + (None,)
            if not isinstance(Flags, int) or Flags not in (0, 1):
                return (_INVALID, None)
            handle = self._next_stream
            self._next_stream += 1
            self.streams[handle] = _Stream(handle, Flags, int(self.current))
            return (CUresult.CUDA_SUCCESS, CUstream(handle))

    def cuStreamDestroy(self, hStream: Any) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuStreamDestroy", needs_ctx=True)) is not None:
                return r
            s = self._stream(hStream)
            if s is None or s.handle == 0:
                return (_BAD_HANDLE,)
            self._run_all(s)   # the driver finishes queued work before freeing the stream
            s.destroyed = True
            return _OK

    def cuStreamSynchronize(self, hStream: Any) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuStreamSynchronize", needs_ctx=True)) is not None:
                return r
            s = self._stream(hStream)
            if s is None:
                return (_BAD_HANDLE,)
            self._run_all(s)
            if s.handle == 0:
                self.pending_work = False   # the base fake's launched kernels: stream 0
            return self._sticky_or_ok()

    def cuStreamWaitEvent(self, hStream: Any, hEvent: Any, Flags: int) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuStreamWaitEvent", needs_ctx=True)) is not None:
                return r
            s, e = self._stream(hStream), self._event(hEvent)
            if s is None or e is None:
                return (_BAD_HANDLE,)
            if Flags != 0:
                return (_INVALID,)
            if e.last is None:
                if (v := self._violation(f"cuStreamWaitEvent on event 0x{e.handle:x}, which "
                                         "was never recorded")):
                    return v
                return _OK
            if s.handle == 0 and self.immediate_default_stream:
                self._complete(e.last)   # the host's kernels after this wait see the work
                return self._sticky_or_ok()
            if e.last.stream.handle == 0:
                s.ordered = True
            s.queue.append(_Op("wait", mark=e.last, label=f"wait event 0x{e.handle:x}"))
            return _OK

    # -- events ------------------------------------------------------------------------
    def cuEventCreate(self, Flags: int) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuEventCreate", needs_ctx=True)) is not None:
                return r + (None,)
            if not isinstance(Flags, int) or Flags & ~0x7:
                return (_INVALID, None)
            handle = self._next_event
            self._next_event += 1
            self.events[handle] = _Event(handle, Flags)
            return (CUresult.CUDA_SUCCESS, CUevent(handle))

    def cuEventDestroy(self, hEvent: Any) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuEventDestroy", needs_ctx=True)) is not None:
                return r
            e = self._event(hEvent)
            if e is None:
                return (_BAD_HANDLE,)
            e.destroyed = True   # queued waits keep their mark: the driver defers the free
            return _OK

    def cuEventRecord(self, hEvent: Any, hStream: Any) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuEventRecord", needs_ctx=True)) is not None:
                return r
            e, s = self._event(hEvent), self._stream(hStream)
            if e is None or s is None:
                return (_BAD_HANDLE,)
            mark = _Mark(s)
            e.last = mark
            if s.handle == 0 and self.immediate_default_stream and not s.queue:
                mark.done = True         # the host's kernels so far have run
                return _OK
            s.ordered = False            # the next transfer on s must be ordered again
            s.queue.append(_Op("record", mark=mark, label=f"record event 0x{e.handle:x}"))
            return _OK

    def cuEventSynchronize(self, hEvent: Any) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuEventSynchronize", needs_ctx=True)) is not None:
                return r
            e = self._event(hEvent)
            if e is None:
                return (_BAD_HANDLE,)
            if e.last is None:
                if (v := self._violation(f"cuEventSynchronize on event 0x{e.handle:x}, which "
                                         "was never recorded")):
                    return v
                return _OK
            self._complete(e.last)
            return self._sticky_or_ok()

    def cuEventQuery(self, hEvent: Any) -> tuple:  # noqa: N802,N803
        with self._mutex:
            if (r := self._enter("cuEventQuery", needs_ctx=True)) is not None:
                return r
            e = self._event(hEvent)
            if e is None:
                return (_BAD_HANDLE,)
            if e.last is None:
                if (v := self._violation(f"cuEventQuery on event 0x{e.handle:x}, which was "
                                         "never recorded")):
                    return v
                return _OK
            if not e.last.done:
                if self.paused:
                    return (CUresult.CUDA_ERROR_NOT_READY,)
                self._complete(e.last)
            return self._sticky_or_ok()

    def cuCtxSynchronize(self) -> tuple:  # noqa: N802
        with self._mutex:
            if (r := self._enter("cuCtxSynchronize", needs_ctx=True)) is not None:
                return r
            for s in list(self.streams.values()):
                self._run_all(s)
            self.pending_work = False
            return self._sticky_or_ok()

    def cuGetErrorName(self, error: Any) -> tuple:  # noqa: N802
        self.calls.append("cuGetErrorName")
        try:
            return (CUresult.CUDA_SUCCESS, CUresult(int(error)).name.encode())
        except (ValueError, TypeError):
            return (_INVALID, None)


    # -- internals ---------------------------------------------------------------------
    def _stream(self, value: Any) -> _Stream | None:
        if isinstance(value, bool) or not isinstance(value, (CUstream, int)):
            return None
        s = self.streams.get(int(value))
        if s is None or s.destroyed:
            return None
        here = int(self.current) if self.current is not None else 0
        if s.ctx and s.ctx != here:
            # the driver refuses a stream of another context than the current one
            self._violation(f"stream {s.handle} of context 0x{s.ctx:x} used while context "
                            f"0x{here:x} is current")
            return None
        return s

    def _event(self, value: Any) -> _Event | None:
        if not isinstance(value, CUevent):
            return None
        e = self.events.get(int(value))
        return None if e is None or e.destroyed else e

    def _sticky_or_ok(self) -> tuple:
        return (self.sticky,) if self.sticky is not None else _OK

    def _fault(self, what: str) -> None:
        self.violations.append(what)
        self.sticky = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS

    def _run_head(self, s: _Stream) -> None:
        op = s.queue[0]
        if op.kind == "wait":
            self._complete(op.mark)      # demand-driven: run the other stream up to the mark
        elif op.kind == "record":
            op.mark.done = True
        else:
            op.run()
        s.queue.popleft()

    def _complete(self, mark: _Mark) -> None:
        s = mark.stream
        while not mark.done:
            self._run_head(s)

    def _run_all(self, s: _Stream) -> None:
        while s.queue:
            self._run_head(s)

    def _queued_touching(self, which: str, start: int, size: int) -> str:
        for s in self.streams.values():
            for op in s.queue:
                span = op.device if which == "device" else op.pinned
                if span is not None and span[0] < start + size and start < span[0] + span[1]:
                    return op.label
        return ""
