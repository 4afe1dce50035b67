"""Device chunks through the CUDA virtual memory management driver API (cuda-python).

The calls, in the order the driver wants them (``from cuda.bindings import driver``,
imported lazily by the constructor, so the rest of ``vmm`` works without cuda-python):

- setup: ``cuInit(0)``; ``cuDeviceGet(device)``; ``cuDevicePrimaryCtxRetain`` (the primary
  context is the one PyTorch uses, so pointers mapped here are valid in its kernels); ``cuMemGetAllocationGranularity`` for pinned device
  memory on that device (``CU_MEM_ALLOC_GRANULARITY_MINIMUM``, 2 MiB on current GPUs).
- chunks: ``cuMemCreate(size, prop, 0)`` / ``cuMemRelease(handle)``.
- ranges: ``cuMemAddressReserve(size, alignment, 0, 0)`` / ``cuMemAddressFree``.
- mapping: ``cuMemMap(ptr, size, 0, handle, 0)`` per chunk, then ``cuMemSetAccess`` over
  the mapped span (read/write for the device: a new mapping is not accessible until
  then); unmapping: ``cuCtxSynchronize`` (or ``cuStreamSynchronize`` on the stream given)
  so no kernel still reads the memory, then ``cuMemUnmap`` per chunk (the driver unmaps
  only whole mappings).

Context: every public method runs in the device's primary context and leaves the calling
thread's current context as it found it (:func:`vmm.cuda_driver.own_context`:
``cuCtxGetCurrent``, and only if another context, or none, is current, ``cuCtxSetCurrent``
there and back), so that a process that drives another GPU from the same thread is not
switched to this one behind its back.

Every driver call goes through :class:`vmm.cuda_driver.CudaDriver` (the one module that
calls the driver, and the seam where a fake one is injected): every ``err`` is checked and a
failure raises :class:`vmm.backend.BackendCallError` (``DeviceOutOfMemory`` for
``CUDA_ERROR_OUT_OF_MEMORY``) naming the call, its arguments and the error name.

No GPU exists on the project's machines: this module is tested against the fake driver in
``ooc/testing/fake_cuda_driver.py`` (shipped with ooc; vmm does not import it), which
enforces the same contract, and by GPU tests that skip without a device.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator, Sequence

from vmm.backend import Backend, BackendCallError, Ledger
from vmm.cuda_driver import (CudaDriver, format_call_args, in_own_context,  # noqa: F401
                             own_context)
from vmm.errors import VMMError

# format_call_args, own_context, in_own_context: re-exported from vmm.cuda_driver, their home


class CudaBackend(Backend):
    """Physical chunks of GPU memory mapped into reserved device address ranges.

    Args:
        device: CUDA device ordinal.
        driver: the ``cuda.bindings.driver`` module, or a stand-in with the same
            interface (tests pass a fake). Default: imported here.
        stream: a ``CUstream`` to synchronize before unmapping instead of the whole
            context (only correct if every kernel touching this memory runs on it).
        fence_stream: the stream whose work uses this memory (a handle, or a callable
            returning PyTorch's current one): :meth:`fence` records an event on it when
            memory is let go, and an unmap whose fence has passed skips the synchronization
            (``cuEventQuery``, which never blocks). None: every unmap synchronizes.

    Every public method runs in the device's primary context, from any thread, and leaves
    the thread's current context as it was (:func:`own_context`).
    :meth:`close` unmaps, releases and frees everything, then releases the context.
    Handles given to the allocators are ints (``int(CUmemGenericAllocationHandle)``).
    """

    name = "cuda"

    def __init__(self, device: int = 0, *, driver: Any = None, stream: Any = None,
                 fence_stream: Any = None) -> None:
        self._cu = CudaDriver(driver, label="cuda backend", device=device,
                              what="the cuda backend",
                              hint=" (or use SimBackend to plan without a GPU)")
        self.device = device
        self.calls = self._cu.calls   # every driver call by name
        self._stream = stream
        self._fence_stream = fence_stream
        self._fences: collections.deque = collections.deque()   # (seq, event), oldest first
        self._spare_events: list[Any] = []
        self._fence_seq = 0      # the last fence handed out
        self._passed_seq = 0     # every fence up to this one has passed
        self.fences_passed = 0   # unmaps that skipped the synchronization thanks to a fence
        self._ctx = None
        self._batch = 0          # depth of one_synchronization blocks
        self._synced = False     # inside one: the device was synchronized already
        self._dev, self._ctx = self._cu.retain_primary_context()
        with self._cu.context(self._ctx):
            self._setup()

    def _setup(self) -> None:
        self._prop = self._cu.allocation_prop()
        self.granularity = int(self._call("cuMemGetAllocationGranularity", self._prop,
                                          self._cu.granularity_minimum()))
        self._access = [self._cu.access_desc()]
        self.ledger = Ledger(self.granularity, "cuda")
        self._handles: dict[int, Any] = {}  # int handle -> the driver's handle object
        self._closed = False

    def _call(self, name: str, *args: Any) -> Any:
        return self._cu.call(name, *args)

    # -- chunks ------------------------------------------------------------------------
    @in_own_context
    def create_chunk(self, nbytes: int) -> int:
        self._check_open()
        self.ledger.check_size("create_chunk", nbytes)
        handle = self._call("cuMemCreate", nbytes, self._prop, 0)
        key = int(handle)
        self._handles[key] = handle
        self.ledger.add_chunk(key, nbytes)
        return key

    @in_own_context
    def release_chunk(self, handle: Any) -> None:
        self.ledger.remove_chunk(handle)
        self._call("cuMemRelease", self._handles.pop(handle))

    # -- address ranges ----------------------------------------------------------------
    @in_own_context
    def reserve_range(self, nbytes: int, alignment: int = 0) -> int:
        self._check_open()
        self.ledger.check_size("reserve_range", nbytes)
        address = int(self._call("cuMemAddressReserve", nbytes, alignment, 0, 0))
        self.ledger.add_range(address, nbytes)
        return address

    @in_own_context
    def free_range(self, address: int, nbytes: int) -> None:
        self.ledger.remove_range(address, nbytes)
        self._call("cuMemAddressFree", address, nbytes)

    # -- mappings ----------------------------------------------------------------------
    def map(self, address: int, handle: Any, nbytes: int) -> None:
        self.map_many(address, (handle,), nbytes)

    @in_own_context
    def map_many(self, address: int, handles: Sequence[Any], chunk_bytes: int) -> None:
        self._check_open()
        self.ledger.add_mappings(address, handles, chunk_bytes)
        done = 0
        try:
            for i, handle in enumerate(handles):
                self._call("cuMemMap", address + i * chunk_bytes, chunk_bytes, 0,
                           self._handles[handle], 0)
                done += 1
        except BackendCallError:
            self.ledger.remove_mappings(address, len(handles) * chunk_bytes)
            for i in range(done):  # undo the mappings that did succeed
                self._cu.attempt("cuMemUnmap", address + i * chunk_bytes, chunk_bytes)
            raise

    @in_own_context
    def set_access(self, address: int, nbytes: int) -> None:
        # Mappings start inaccessible; one call covers the whole mapped span.
        self._call("cuMemSetAccess", address, nbytes, self._access, len(self._access))

    @in_own_context
    def unmap(self, address: int, nbytes: int, fence: Any = None) -> None:
        removed = self.ledger.remove_mappings(address, nbytes)
        # A kernel queued earlier may still read or write these pages: wait for it before
        # the physical memory can be mapped elsewhere (once per one_synchronization block),
        # unless the span's fence shows that everything queued before its release has run.
        if not self._synced:
            if self.fence_passed(fence):
                self.fences_passed += 1
            else:
                self.synchronize()
                self._synced = self._batch > 0
        for start, (end, _) in removed:
            self._call("cuMemUnmap", start, end - start)

    @in_own_context
    def fence(self) -> int | None:
        if self._fence_stream is None or self._closed:
            return None
        self._poll_fences()
        stream = self._fence_stream() if callable(self._fence_stream) else self._fence_stream
        event = self._spare_events.pop() if self._spare_events else self._call(
            "cuEventCreate", self._cu.event_no_timing())
        self._call("cuEventRecord", event, stream)
        self._fence_seq += 1
        self._fences.append((self._fence_seq, event))
        return self._fence_seq

    @in_own_context
    def fence_passed(self, fence: Any) -> bool:
        if fence is None:
            return False
        if fence > self._passed_seq:
            self._poll_fences()
        return fence <= self._passed_seq

    def _poll_fences(self) -> None:
        """Retire the fences that have passed, oldest first (events recorded on one stream
        complete in order; on several, a later one waits behind an earlier: safe)."""
        cu = self._cu
        while self._fences:
            seq, event = self._fences[0]
            err = cu.raw("cuEventQuery", event)[0]
            if err == cu.not_ready:
                return
            if err != cu.ok:
                raise cu.error("cuEventQuery", err)
            self._fences.popleft()
            self._spare_events.append(event)
            self._passed_seq = seq

    @contextlib.contextmanager
    def one_synchronization(self) -> Iterator[None]:
        self._batch += 1
        try:
            yield
        finally:
            self._batch -= 1
            if not self._batch:
                self._synced = False

    @in_own_context
    def synchronize(self) -> None:
        if self._stream is not None:
            self._call("cuStreamSynchronize", self._stream)
        else:
            self._call("cuCtxSynchronize")

    # -- lifetime ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise VMMError("cuda backend: used after close()")

    @in_own_context
    def close(self) -> None:
        """Synchronize, unmap every chunk, release every chunk, free every range, release
        the primary context. Safe to call twice."""
        if self._closed:
            return
        mappings = self.ledger.mappings()
        if mappings:
            self.synchronize()
            for address, nbytes, _ in mappings:
                self.ledger.remove_mappings(address, nbytes)
                self._call("cuMemUnmap", address, nbytes)
        for handle in list(self.ledger.chunks):
            self.release_chunk(handle)
        for address, nbytes in self.ledger.ranges():
            self.free_range(address, nbytes)
        for event in [e for _, e in self._fences] + self._spare_events:
            self._call("cuEventDestroy", event)
        self._fences.clear()
        self._spare_events.clear()
        self._closed = True
        if self._ctx is not None:
            self._call("cuDevicePrimaryCtxRelease", self._dev)
            self._ctx = None

    def __repr__(self) -> str:
        return (f"<CudaBackend device={self.device} granularity={self.granularity} "
                f"chunks={len(self.ledger.chunks)} ranges={len(self.ledger.ranges())}>")
