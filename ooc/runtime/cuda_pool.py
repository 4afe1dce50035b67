"""Device memory on a GPU, taken from a ``vmm`` chunk pool of CUDA VMM chunks sized to the budget.

:class:`CudaDevicePool` is :class:`~ooc.runtime.cpu_pool.CpuDevicePool`'s counterpart for CUDA
(both conform to :class:`~ooc.runtime.pool.DevicePool`): the same ``take`` / ``reap`` /
``trim`` / ``stats`` over ``vmm.VirtualAllocator(vmm.ChunkPool(vmm.CudaBackend(device)))``, so the pool's physical size is the budget and going over it is
:class:`~ooc.errors.OutOfBudget`, never a silent overflow. :func:`route_allocations` goes one
step further and sends PyTorch's own CUDA allocations of the current thread into the same pool.

Run on an H100 (``tests/ooc/test_cuda_gpu.py``). The code paths that need one (the zero-copy torch tensor through cupy, the
``torch.cuda.MemPool`` routing) are written from the documented APIs of cupy
(``cupy.cuda.UnownedMemory``, ``MemoryPointer``, DLPack) and PyTorch
(``torch._C._cuda_customAllocator``, ``torch.cuda.MemPool``, ``use_mem_pool``, as in
``torch.cuda.memory._use_uvm``) and covered by ``tests/ooc/test_cuda_gpu.py``, which skips
without CUDA. What runs here is tested against a fake driver: the allocator logic, the
lifetime rule, the callbacks behind the ctypes function pointers, and the guards.

Lifetime rule (a violation is a use-after-free on the device, not an exception): a pool range
is returned only when the last user lets go of it. ``take`` returns the owner object (a torch
tensor on a GPU, whose storage keeps a cupy ``UnownedMemory`` and through it an owner object
alive; a :class:`~ooc.runtime.cuda_seam.DevicePtr` with a fake driver); a ``weakref.finalize`` on
that owner queues the range, and the next ``take`` or ``reap`` hands it back to the allocator
(never inside the finalizer, which may run on any thread). A range freed while kernels queued
earlier still use it stays mapped (the allocator parks it) and is reused in stream order; the
swap-in copy into it waits for the compute stream (see ``PinnedTier``); unmapping synchronizes.

Lock order: :func:`route_allocations`' callbacks run inside PyTorch's caching allocator, with
its mutex held, and then take the pool's lock. So nothing done under the pool's lock calls
into PyTorch (a tensor made or freed there could wait for that mutex while the autograd
engine's device thread, holding it, waits for the pool's lock): ``take`` wraps the range as a
tensor after letting the lock go, and finalizers only queue ranges. What the lock still
cannot rule out is Python's cyclic garbage collector freeing some unrelated CUDA tensor while
it is held; the engine does not route allocations, so only users of ``route_allocations``
from several threads are exposed to that.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import threading
import weakref
from typing import Any, Iterator

import torch

import vmm
from ooc.errors import OOCError
from ooc.runtime.cuda_seam import DevicePtr, cuda_runtime, cuda_torch
from vmm.errors import OutOfBudget
from vmm.units import format_size

__all__ = ["CudaDevicePool", "close_lingering", "route_allocations", "make_callbacks", "ALLOC_FN",
           "FREE_FN"]

log = logging.getLogger(__name__)

# The signatures PyTorch's pluggable allocator calls (torch.cuda.memory._use_uvm uses the same):
#   void* alloc(size_t size, int device, cudaStream_t stream)
#   void  free(void* ptr, size_t size, int device, cudaStream_t stream)
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class _RangeOwner:
    """Kept alive by cupy's ``UnownedMemory`` (and so by the torch storage over it); its
    finalizer queues the allocation when the storage dies."""

    __slots__ = ("allocation", "__weakref__")

    def __init__(self, allocation: Any) -> None:
        self.allocation = allocation


class CudaDevicePool:
    """Budgeted device memory for managed tensors, backed by CUDA VMM chunks.

    Args:
        budget: bytes of device memory the pool may map (rounded down to whole chunks,
            at least one chunk).
        chunk: physical chunk size; a multiple of the device's VMM granularity (2 MiB on
            current GPUs).
        driver: ``cuda.bindings.driver`` or a stand-in (tests pass a fake); default: imported.
        device: CUDA device ordinal.
        as_tensor: what :meth:`take` returns. True: a flat uint8 CUDA tensor over the range
            (zero-copy, through cupy); False: a :class:`DevicePtr`. Default: a tensor when
            the real driver is used and cupy and a CUDA PyTorch are available, else DevicePtr.
        fence_stream: the compute stream (handle, or callable returning PyTorch's current
            one) the pool's fences are recorded on, so that a remap never waits for the
            device. Default: the runtime's compute stream when ``driver`` is None, else none.

    ``take(nbytes)`` maps a contiguous range of whole chunks; ``reap()`` hands back the ranges
    whose last user is gone; ``close()`` gives every chunk back to the driver.
    """

    def __init__(self, budget: int, chunk: int, driver: Any = None, device: int = 0, *,
                 as_tensor: bool | None = None, fence_stream: Any = None) -> None:
        # The CUDA seam (ooc.runtime.cuda_seam.cuda_runtime): PyTorch's CUDA and cupy, or the
        # fake of ooc.testing.fake_cuda; kept for the pool's lifetime.
        self._rt = cuda_runtime()
        if driver is None:
            driver = self._rt.driver("CudaDevicePool")
            real = True
        else:
            real = False
        self.device = int(device)
        # Fences on the compute stream: a remap never waits for the device (see
        # vmm.VirtualAllocator's quarantine). A driver passed in comes with its stream, or
        # none (then every unmap synchronizes).
        if fence_stream is None and real:
            fence_stream = self._rt.compute_stream(self.device)
        self.backend = vmm.CudaBackend(self.device, driver=driver, fence_stream=fence_stream)
        try:
            capacity = max(chunk, budget // chunk * chunk)
            self.pool = vmm.ChunkPool(self.backend, chunk_bytes=chunk, capacity_bytes=capacity)
        except BaseException:
            self.backend.close()
            raise
        # ooc's allocator with its default tiers (vmm.default_tiers; the one ``ooc frag``
        # replays as vmm-N): tensors below a chunk share chunks in 512-byte blocks, as
        # PyTorch's own allocator aligns them; those up to 4 chunks that round badly share
        # sparse slabs; larger ones get whole chunks whose unused tail takes small ones. It
        # never maps more than the plan's chunk-rounded sizes (vmm.small_blocks: the bound).
        # Reuse of a freed block is stream ordered, as for parked ranges (module doc).
        self.allocator = vmm.SmallBlockAllocator(vmm.VirtualAllocator(self.pool))
        if as_tensor is None:
            as_tensor = real and self._rt.can_wrap_ranges()
        elif as_tensor and not self._rt.can_wrap_ranges():
            raise OOCError("CudaDevicePool(as_tensor=True) needs a CUDA build of PyTorch with a "
                           "device and cupy: pip install 'ooc[cuda]'")
        self.as_tensor = bool(as_tensor)
        self._dead: list[Any] = []
        self._lock = threading.RLock()   # alloc/free come from take() and allocator callbacks
        self._routers: list[_Router] = []  # callbacks must outlive every block they handed out
        self._closed = False

    def take(self, nbytes: int) -> "torch.Tensor | DevicePtr":
        """A fresh pool range of ``nbytes`` (raises OutOfBudget): a flat uint8 CUDA tensor
        over it, or a :class:`DevicePtr` (see ``as_tensor``). The range goes back when that
        object (and everything viewing it) is gone.

        The tensor is made outside the pool's lock (see "Lock order" in the module doc)."""
        with self._lock:
            self._check_open()
            self.reap()
            allocation = self.allocator.alloc(nbytes)
        try:
            if self.as_tensor:
                owner = _RangeOwner(allocation)
                out = self._rt.wrap_range(allocation.address, nbytes, self.device, owner)
            else:
                owner = out = DevicePtr(allocation.address, nbytes)
        except BaseException:
            with self._lock:
                self.allocator.free(allocation)
            raise
        weakref.finalize(owner, self._dead.append, allocation)
        return out

    def reap(self) -> None:
        """Hand back the ranges whose last user died since the previous call."""
        with self._lock:
            while self._dead:
                self.allocator.free(self._dead.pop())

    def trim(self, limit: int | None = None) -> int:
        """Give unused chunks back to the driver (as the CPU pool does): every one, or whole
        chunks covering ``limit`` bytes. Returns the bytes given back."""
        with self._lock:
            self.reap()
            return self.allocator.trim(limit)

    @property
    def granularity(self) -> int:
        """The smallest chunk: the VMM granularity."""
        return self.backend.granularity

    @property
    def alignment(self) -> int:
        """What every range's address is a multiple of: 512 bytes (blocks packed in chunks;
        a range of whole chunks is aligned to the granularity)."""
        return self.allocator.alignment

    def stats(self) -> dict:
        """The allocator's statistics (see ``vmm.SmallBlockAllocator.stats``)."""
        with self._lock:
            return self.allocator.stats()

    def close(self) -> None:
        """Give every chunk back to the driver (synchronizing first) and release the context.
        Refuses while ranges are still in use (their owners alive): drop them first."""
        with self._lock:
            if self._closed:
                return
            self.reap()
            self.allocator.close()   # raises AllocationError while allocations are live
            self.backend.close()
            self._closed = True

    def close_or_linger(self) -> bool:
        """Close now if no range is in use (True); otherwise keep the pool, and so the memory
        of the tensors still in it, until they are gone (False): :func:`close_lingering`
        closes it then. An engine's ``close()`` uses this: a tensor the user kept from a step
        (an output, a swapped-in activation) must stay valid, and a close that raises after
        training would lose nothing but help no one."""
        gc.collect()   # torch storage -> cupy array -> owner chains may sit in a cycle
        with self._lock:
            self.reap()
            if self.allocator.live_allocations == 0:
                self.close()
                return True
            live, nbytes = self.allocator.live_allocations, self.allocator.requested_bytes
        _LINGERING.append(self)
        log.warning("closing an engine on cuda:%d: %d tensor(s) made during its steps (%s) "
                    "are still alive and live in its device pool; the pool stays mapped until "
                    "they are gone, and is closed at the next engine's close or at exit",
                    self.device, live, format_size(nbytes))
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise OOCError("CudaDevicePool is closed")

    def __repr__(self) -> str:
        return f"<CudaDevicePool device={self.device} {self.allocator!r}>"


_LINGERING: list[CudaDevicePool] = []   # closed by engines while ranges were still in use


def close_lingering() -> int:
    """Close the pools whose ranges have all been let go since their engine closed; return
    how many are still waiting."""
    if not _LINGERING:
        return 0                      # (a full collection costs ~0.1-1 s in a large process)
    gc.collect()
    for pool in list(_LINGERING):
        with pool._lock:
            pool.reap()
            if pool.allocator.live_allocations:
                continue
            _LINGERING.remove(pool)
            try:
                pool.close()
            except Exception as exc:  # noqa: BLE001 - at exit, or on behalf of another engine
                log.warning("closing a lingering CUDA pool failed: %s", exc)
    return len(_LINGERING)


atexit.register(close_lingering)


# -- PyTorch's own allocations into the pool ---------------------------------------------------


class _Router:
    """The Python logic behind the two C callbacks: size -> an allocation of the pool,
    pointer -> its allocation back. Exceptions never cross into C (ctypes would print and
    return NULL anyway): a refused allocation returns NULL (PyTorch then raises its
    out-of-memory error) and is kept in ``error`` so :func:`route_allocations` can re-raise
    the budget error with its numbers."""

    def __init__(self, pool: CudaDevicePool) -> None:
        self.pool = pool
        self.live: dict[int, Any] = {}       # address -> vmm Allocation
        self.error: BaseException | None = None
        self.allocs = 0
        self.frees = 0

    def alloc(self, size: int, device: int, stream: int | None) -> int:
        if size == 0:
            return 0
        try:
            if device != self.pool.device:
                raise OOCError(f"route_allocations: an allocation of {size} bytes for device "
                               f"{device} reached the pool of device {self.pool.device}")
            with self.pool._lock:
                self.pool._check_open()
                self.pool.reap()
                allocation = self.pool.allocator.alloc(size)
                self.live[allocation.address] = allocation
            self.allocs += 1
            return allocation.address
        except BaseException as exc:  # noqa: BLE001 - must not propagate into C
            self.error = exc
            log.error("route_allocations: %d bytes on device %d refused: %s", size, device, exc)
            return 0

    def free(self, ptr: int | None, size: int, device: int, stream: int | None) -> None:
        if not ptr:
            return
        try:
            with self.pool._lock:
                allocation = self.live.pop(ptr, None)
                if allocation is None:
                    log.error("route_allocations: free of unknown pointer 0x%x (%d bytes)", ptr,
                              size)
                    return
                # Stream-ordered reuse is safe: the range stays mapped (parked) and is handed
                # out again only to work ordered after this stream's (see the module doc).
                self.pool.allocator.free(allocation)
            self.frees += 1
        except BaseException as exc:  # noqa: BLE001 - must not propagate into C
            log.error("route_allocations: free of 0x%x failed: %s", ptr, exc)


def make_callbacks(pool: CudaDevicePool) -> tuple[_Router, Any, Any]:
    """``(router, alloc_cfunc, free_cfunc)``: the ctypes callbacks over ``pool``. The pool
    keeps all three alive for its own lifetime (blocks handed out by the caching allocator
    may be freed long after the routing context ended)."""
    router = _Router(pool)
    c_alloc = ALLOC_FN(router.alloc)
    c_free = FREE_FN(router.free)
    router._keep = (c_alloc, c_free)  # type: ignore[attr-defined]
    pool._routers.append(router)
    return router, c_alloc, c_free


@contextlib.contextmanager
def route_allocations(pool: CudaDevicePool) -> Iterator[Any]:
    """Send the current thread's CUDA allocations inside the block into ``pool``.

    Builds a ``torch.cuda.MemPool`` over ``torch._C._cuda_customAllocator(alloc, free)`` whose
    two functions are ctypes callbacks into the pool's ``VirtualAllocator``, and activates it
    with ``torch.cuda.use_mem_pool`` (the route PyTorch's ``_use_uvm`` takes). PyTorch's
    caching allocator still carves tensors out of the segments it gets from the pool, and
    keeps freed blocks cached in the MemPool; the pool sees segment-sized requests.

    Guarantees and limits:

    * Only the calling thread is routed (``use_mem_pool``'s rule): autograd's backward runs
      on its own threads for CUDA, so run it under
      ``torch.autograd.set_multithreading_enabled(False)`` to route its allocations too.
    * A request the budget cannot hold makes the callback return NULL, PyTorch raises its
      out-of-memory error, and this context manager re-raises it as the pool's
      :class:`~ooc.errors.OutOfBudget` (requested, in-use, budget bytes) chained to it.
    * The callbacks stay alive as long as ``pool``: keep the pool until every tensor made
      inside the block is gone.

    Raises :class:`~ooc.errors.OOCError` on a PyTorch without CUDA ("needs a CUDA build of
    PyTorch"). Yields the ``MemPool``. Run on an H100 in a test; the engine does not use it.
    """
    _require_cuda_torch()
    router, c_alloc, c_free = make_callbacks(pool)
    alloc_ptr = ctypes.cast(c_alloc, ctypes.c_void_p).value
    free_ptr = ctypes.cast(c_free, ctypes.c_void_p).value
    allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
    mem_pool = torch.cuda.MemPool(allocator)
    router._mem_pool = mem_pool  # type: ignore[attr-defined]
    try:
        with torch.cuda.use_mem_pool(mem_pool, device=pool.device):
            yield mem_pool
    except Exception as exc:
        err, router.error = router.error, None
        if isinstance(err, OutOfBudget) and not isinstance(exc, OutOfBudget):
            raise err from exc
        raise


def _require_cuda_torch() -> None:
    if not cuda_torch() or not hasattr(torch._C, "_cuda_customAllocator"):
        raise OOCError(
            "route_allocations needs a CUDA build of PyTorch with a visible device "
            f"(this is torch {torch.__version__}, CUDA build: {torch.version.cuda}, "
            f"device available: {torch.cuda.is_available()}); install a CUDA wheel of PyTorch, "
            "or leave PyTorch's allocations to its caching allocator")
