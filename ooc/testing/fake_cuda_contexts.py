"""Initialisation, devices, primary contexts, the per-thread current context and the
synchronize calls of the FAKE ``cuda.bindings.driver``. Not CUDA; tests only.

Apart from :mod:`ooc.testing.fake_cuda_driver` (the VMM calls and their contract) because
this is the part every driver user goes through before any memory call: nothing works
before ``cuInit``, memory calls need a current context, and the current context is per
thread. :class:`FakeContexts` is a mixin of :class:`~ooc.testing.fake_cuda_driver.FakeDriver`,
whose constructor makes the state (``devices``, ``initialized``, ``retained``,
``pending_work``, the thread-local ``_thread``) and whose ``_enter`` checks and logs each call.
"""

from __future__ import annotations

from typing import Any

from ooc.testing.fake_cuda_types import _INVALID, _OK, CUcontext, CUdevice, CUresult, CUstream

__all__ = ["FakeContexts"]


class FakeContexts:
    """The context and device calls of the fake driver (see the module docstring)."""

    @property
    def current(self) -> "CUcontext | None":
        """The calling thread's current context (None: none)."""
        return getattr(self._thread, "ctx", None)

    @current.setter
    def current(self, ctx: "CUcontext | None") -> None:
        self._thread.ctx = ctx

    def cuInit(self, flags: int) -> tuple:  # noqa: N802 - the driver's names
        if (r := self._enter("cuInit", needs_init=False)) is not None:
            return r
        if flags != 0:
            return (_INVALID,)
        if self.devices == 0:
            return (CUresult.CUDA_ERROR_NO_DEVICE,)
        self.initialized = True
        return _OK

    def cuDeviceGetCount(self) -> tuple:  # noqa: N802
        if (r := self._enter("cuDeviceGetCount")) is not None:
            return r + (None,)
        return (CUresult.CUDA_SUCCESS, self.devices)

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuDeviceGet")) is not None:
            return r + (None,)
        if not isinstance(ordinal, int) or not 0 <= ordinal < self.devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (CUresult.CUDA_SUCCESS, CUdevice(ordinal))

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple:  # noqa: N802
        if (r := self._enter("cuDevicePrimaryCtxRetain")) is not None:
            return r + (None,)
        if not isinstance(dev, CUdevice) or not 0 <= int(dev) < self.devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        self.retained[int(dev)] = self.retained.get(int(dev), 0) + 1
        return (CUresult.CUDA_SUCCESS, CUcontext(0xC0 + int(dev)))

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> tuple:  # noqa: N802
        if (r := self._enter("cuDevicePrimaryCtxRelease")) is not None:
            return r
        if not isinstance(dev, CUdevice) or not self.retained.get(int(dev)):
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.retained[int(dev)] -= 1
        if not self.retained[int(dev)]:
            del self.retained[int(dev)]
            if self.current is not None and int(self.current) == 0xC0 + int(dev):
                self.current = None
        return _OK

    def cuCtxSetCurrent(self, ctx: Any) -> tuple:  # noqa: N802
        if (r := self._enter("cuCtxSetCurrent")) is not None:
            return r
        if ctx is None or (isinstance(ctx, CUcontext) and int(ctx) == 0):
            self.current = None     # NULL: no context current in this thread
            return _OK
        if not isinstance(ctx, CUcontext) or int(ctx) - 0xC0 not in self.retained:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.current = ctx
        return _OK

    def cuCtxGetCurrent(self) -> tuple:  # noqa: N802
        if (r := self._enter("cuCtxGetCurrent")) is not None:
            return r + (None,)
        ctx = self.current
        return (CUresult.CUDA_SUCCESS, ctx if ctx is not None else CUcontext(0))

    def cuCtxSynchronize(self) -> tuple:  # noqa: N802
        if (r := self._enter("cuCtxSynchronize", needs_ctx=True)) is not None:
            return r
        self.pending_work = False
        return _OK

    def cuStreamSynchronize(self, stream: Any) -> tuple:  # noqa: N802
        if (r := self._enter("cuStreamSynchronize", needs_ctx=True)) is not None:
            return r
        if not isinstance(stream, (CUstream, int)):
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        self.pending_work = False
        return _OK

    def cuGetErrorName(self, error: Any) -> tuple:  # noqa: N802
        self.calls.append("cuGetErrorName")
        try:
            return (CUresult.CUDA_SUCCESS, CUresult(int(error)).name.encode())
        except (ValueError, TypeError):
            return (_INVALID, None)
