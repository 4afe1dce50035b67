"""The one module through which every CUDA driver call goes (cuda-python, or a fake).

``vmm.CudaBackend`` (VMM chunks: ``cuMem*``) and ooc's ``PinnedTier`` (pinned host memory,
streams and events) hold a :class:`CudaDriver`; neither calls the driver module itself. This
is also the one seam where a fake driver is injected: pass it as ``driver=`` (tests do, and
``ooc.testing.fake_cuda()`` does through ooc's CUDA seam); without it the real one is imported
by :func:`import_driver`, lazily, so the rest of ``vmm`` works without cuda-python.

What lives here, and nowhere else:

- the import of ``cuda.bindings.driver`` (:func:`import_driver`);
- the checked call (:meth:`CudaDriver.call`): every call returns ``(CUresult, *values)``;
  every result is checked, and a failure raises :class:`DriverCallError` (a
  ``vmm.backend.BackendCallError``; :class:`DriverOutOfMemory` for
  ``CUDA_ERROR_OUT_OF_MEMORY``) naming the call, its arguments and the error name; an
  exception raised inside cuda-python (no driver library, say) is wrapped the same way;
- the primary context: retain and release it (:meth:`CudaDriver.retain_primary_context`),
  and run code with it current, leaving the caller's current context as it was
  (:func:`own_context`, :func:`in_own_context`);
- the driver's structures and flags the callers need (allocation properties, access
  descriptors, stream and event flags).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

from vmm.backend import BackendCallError, DeviceOutOfMemory
from vmm.errors import VMMError

__all__ = ["CudaDriver", "DriverCallError", "DriverOutOfMemory", "HOST_SYNCS", "error_name",
           "format_call_args", "import_driver", "in_own_context", "own_context"]

#: Driver calls that block the host until device work is done.
HOST_SYNCS = frozenset({"cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize"})


def import_driver(what: str = "the CUDA path", hint: str = "") -> Any:
    """``cuda.bindings.driver`` (cuda-python), or :class:`~vmm.errors.VMMError` (an
    ``OOCError``) saying ``what`` needs it and how to install it. The only import of
    cuda-python in the project; code that is given a ``driver=`` never calls it."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python layout
        except ImportError as exc:
            raise VMMError(f"{what} needs cuda-python: pip install 'ooc[cuda]'{hint}") from exc
    return driver


class DriverCallError(BackendCallError):
    """A driver call failed (``cuda_error`` is its CUresult) or raised (``cuda_error`` is None
    and the exception is the cause). ``call`` names it, ``detail`` is the message without the
    caller's label and device, for callers that say more (the key, the bytes)."""

    def __init__(self, message: str, *, call: str, cuda_error: Any, detail: str) -> None:
        super().__init__(message)
        self.call = call
        self.cuda_error = cuda_error
        self.detail = detail


class DriverOutOfMemory(DriverCallError, DeviceOutOfMemory):
    """``CUDA_ERROR_OUT_OF_MEMORY``: also an ``OutOfBudget``."""


class CudaDriver:
    """The driver module (``cuda.bindings.driver`` or a fake with its interface) behind
    checked calls.

    Args:
        driver: the module, or None to import the real one (:func:`import_driver`).
        label: prefixes every error message (``"cuda backend"``, ``"PinnedTier"``).
        device: the CUDA ordinal, named in every error message.
        what, hint: for the "needs cuda-python" error when the real driver is imported.

    ``calls`` counts every call by name; ``host_syncs`` counts those in :data:`HOST_SYNCS`.
    """

    def __init__(self, driver: Any = None, *, label: str, device: int, what: str = "",
                 hint: str = "") -> None:
        self.module = driver if driver is not None else import_driver(what or label, hint)
        self.label = label
        self.device = int(device)
        self.ok = self.module.CUresult.CUDA_SUCCESS
        self.not_ready = getattr(self.module.CUresult, "CUDA_ERROR_NOT_READY", None)
        self.calls: dict[str, int] = {}
        self.host_syncs = 0

    # -- calls -----------------------------------------------------------------------------
    def raw(self, name: str, *args: Any) -> tuple:
        """Call ``name``; return its whole result tuple, unchecked (``cuEventQuery``'s "not
        ready" is an answer, not an error). An exception inside the driver raises
        :class:`DriverCallError`."""
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in HOST_SYNCS:
            self.host_syncs += 1
        try:
            return getattr(self.module, name)(*args)
        except Exception as exc:
            detail = f"{name}({format_call_args(args)}) raised {type(exc).__name__}: {exc}"
            raise DriverCallError(f"{self.label}: {detail} on device {self.device}", call=name,
                                  cuda_error=None, detail=detail) from exc

    def call(self, name: str, *args: Any) -> Any:
        """Call ``name``; raise :class:`DriverCallError` unless it returned CUDA_SUCCESS;
        return the values after the error code (None, one value, or a tuple)."""
        result = self.raw(name, *args)
        if result[0] != self.ok:
            raise self.error(name, result[0], args)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def error(self, name: str, err: Any, args: tuple = ()) -> DriverCallError:
        """The error for ``name`` having returned ``err``."""
        text = error_name(self.module, err)
        detail = f"{name}({format_call_args(args)}) failed with {text}"
        cls = DriverOutOfMemory if "CUDA_ERROR_OUT_OF_MEMORY" in text else DriverCallError
        return cls(f"{self.label}: {detail} on device {self.device}", call=name, cuda_error=err,
                   detail=detail)

    def attempt(self, name: str, *args: Any) -> str | None:
        """Call ``name`` for teardown: never raises; returns what went wrong, or None."""
        try:
            self.call(name, *args)
        except DriverCallError as e:
            return e.detail
        return None

    # -- context ---------------------------------------------------------------------------
    def retain_primary_context(self) -> tuple[Any, Any]:
        """``cuInit``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``: ``(CUdevice, context)``.
        The primary context is PyTorch's, so its streams, pointers and ours work together."""
        self.call("cuInit", 0)
        dev = self.call("cuDeviceGet", self.device)
        return dev, self.call("cuDevicePrimaryCtxRetain", dev)

    def context(self, ctx: Any) -> "contextlib.AbstractContextManager[None]":
        """:func:`own_context` over this driver."""
        return own_context(self.module, ctx)

    # -- structures and flags --------------------------------------------------------------
    def allocation_prop(self) -> Any:
        """``CUmemAllocationProp`` for pinned device memory on this device."""
        drv = self.module
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        return prop

    def access_desc(self) -> Any:
        """``CUmemAccessDesc`` granting this device read/write access."""
        drv = self.module
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def granularity_minimum(self) -> Any:
        return self.module.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM

    def event_no_timing(self) -> int:
        """Flags of an event that only orders and signals (cheaper than a timing one)."""
        return int(self.module.CUevent_flags.CU_EVENT_DISABLE_TIMING)

    def stream_non_blocking(self) -> int:
        """Flags of a stream with no implicit synchronization with the legacy default one."""
        return int(self.module.CUstream_flags.CU_STREAM_NON_BLOCKING)


def own_context(drv: Any, ctx: Any) -> contextlib.AbstractContextManager:
    """Run the block with ``ctx`` current in the calling thread, then put back the context
    that was current (or none). Costs one ``cuCtxGetCurrent`` when ``ctx`` is current already
    (PyTorch's threads on the same device): the common case pays no switch, and no generator
    either (the tier's calls ask ~300 times a step). ``drv`` is the driver module.

    Raises :class:`VMMError` if the driver refuses either call; a failure to switch back is
    raised only if the block itself succeeded (the block's own error is the one to see)."""
    err, prev = drv.cuCtxGetCurrent()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise VMMError(f"cuCtxGetCurrent failed with {_name_of(err)}")
    if prev is not None and int(prev) == int(ctx):
        return _CURRENT
    return _switched(drv, ctx, prev)


_CURRENT = contextlib.nullcontext()


@contextlib.contextmanager
def _switched(drv: Any, ctx: Any, prev: Any) -> Iterator[None]:
    """``own_context`` where another context (or none) was current: ``ctx`` for the block."""
    ok = drv.CUresult.CUDA_SUCCESS
    err, = drv.cuCtxSetCurrent(ctx)
    if err != ok:
        raise VMMError(f"cuCtxSetCurrent(device's primary context) failed with {_name_of(err)}")
    try:
        yield
    except BaseException:
        drv.cuCtxSetCurrent(prev)   # best effort: the block's error is the one to see
        raise
    err, = drv.cuCtxSetCurrent(prev)
    if err != ok:
        raise VMMError(f"cuCtxSetCurrent(back to the caller's context) failed with "
                       f"{_name_of(err)}")


_M = TypeVar("_M", bound=Callable[..., Any])


def in_own_context(method: _M) -> _M:
    """Decorate a method of an object with ``_cu`` (a :class:`CudaDriver`) and ``_ctx`` (None:
    not set up, or released) so that it runs under :func:`own_context`."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._ctx is None:
            return method(self, *args, **kwargs)
        with own_context(self._cu.module, self._ctx):
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def error_name(drv: Any, err: Any) -> str:
    """``CUDA_ERROR_...`` for a CUresult (asks the driver; never hides the original error)."""
    try:
        e2, text = drv.cuGetErrorName(err)
        if e2 == drv.CUresult.CUDA_SUCCESS and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - the name lookup must never hide the original error
        pass
    name = getattr(err, "name", None)
    try:
        return f"{name} ({int(err)})" if name else f"CUresult {err}"
    except (TypeError, ValueError):
        return str(err)


def _name_of(err: Any) -> str:
    return getattr(err, "name", None) or str(err)


def format_call_args(args: tuple) -> str:
    """Driver-call arguments for an error message: addresses in hex, handles by type."""
    out = []
    for a in args:
        if isinstance(a, int) and a >= 1 << 32:  # an address
            out.append(f"0x{a:x}")
        elif isinstance(a, (int, float, str)):
            out.append(repr(a))
        else:
            out.append(type(a).__name__)
    return ", ".join(out)
