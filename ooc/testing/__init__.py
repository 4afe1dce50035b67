"""Testing helpers shipped with ooc (like ``torch.testing``): run the CUDA path with no GPU.

:func:`fake_cuda` makes ``OutOfCore(model, opt, device="cuda", ...)`` run over a FAKE CUDA
driver: the model and its batches stay on the CPU, CPU memory stands in for device memory,
and the real :class:`~ooc.storage.cuda_tier.PinnedTier` (copy streams, events, pinned
memory), :class:`~ooc.runtime.cuda_pool.CudaDevicePool` (``vmm.CudaBackend`` VMM chunks) and
the engine's CUDA branches (device-side waits, drain, reserve, op timing) run above it.

THE FAKE IS NOT CUDA. It is a strict model of the driver's documented contract: VMM call
order and granularity, reserve before map, no double map, access before use, unmap before
release; copies only within mapped, accessible device ranges and allocated pinned ranges;
events recorded before they are waited on; copies run lazily, in stream order, only when
something waits for them (so a missing wait shows stale bytes). Breaches are refused and
listed in ``driver.violations``. It says nothing about speed, and a GPU may still find what
a CPU stand-in cannot (kernels that really run concurrently with copies): the real-GPU
tests in ``tests/ooc/test_cuda_gpu.py`` and ``benchmarks/bench_gpu.py`` are for that.

The fake driver modules: :mod:`ooc.testing.fake_cuda_driver` (the VMM contract, over
:mod:`~ooc.testing.fake_cuda_types` and :mod:`~ooc.testing.fake_cuda_contexts`),
:mod:`ooc.testing.fake_cuda_copies` (pinned memory, async copies with real bytes, over the
streams and events of :mod:`~ooc.testing.fake_cuda_streams`), :mod:`ooc.testing.fake_cuda_host`
(device memory in host memory at the device addresses, what :func:`fake_cuda` uses).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from typing import Any, Iterator

import torch

from ooc.runtime.cuda_seam import CudaRuntime, set_cuda_runtime

__all__ = ["FakeCudaRuntime", "fake_cuda"]


class _HostEvent:
    """A timing event on the host: under the fake, kernels run synchronously on the CPU, so
    the time an op's "kernel" ran is the host time around it."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


class FakeCudaRuntime(CudaRuntime):
    """The CUDA seam (:class:`ooc.runtime.cuda_seam.CudaRuntime`) over a FAKE driver: one device
    (index 0), tensors on the CPU, the compute stream is the fake's stream 0 (PyTorch's CPU
    kernels run at once), pool ranges become CPU tensors over the fake's host-backed device
    addresses, op timing uses host clocks. Every CPU storage counts as device memory: run
    only ``device="cuda"`` engines while it is installed."""

    fake = True

    def __init__(self, driver: Any) -> None:
        self.fake_driver = driver

    def driver(self, what: str = "the CUDA path") -> Any:
        return self.fake_driver

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def compute_stream(self, index: int) -> Any:
        return 0

    def tensor_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def holds(self, storage: torch.UntypedStorage) -> bool:
        return storage.device.type == "cpu"

    def device_ptr(self, storage: torch.UntypedStorage) -> Any:
        self.fake_driver.register_storage(storage)   # the fake checks copies against it
        return super().device_ptr(storage)

    def can_wrap_ranges(self) -> bool:
        return True

    def wrap_range(self, address: int, nbytes: int, device: int, owner: Any) -> torch.Tensor:
        buf = (ctypes.c_char * max(nbytes, 1)).from_address(address)
        buf.owner = owner   # the storage keeps buf alive, buf the owner (whose death frees the range)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    def timing_event(self) -> Any:
        return _HostEvent()

    def keep_busy(self) -> None:
        """Nothing to keep busy: the fake's "kernels" run on the host, timed by its clock."""


@contextlib.contextmanager
def fake_cuda(*, memory_bytes: int = 16 << 30, granularity: int = 64 << 10,
              pinned_limit: int = 1 << 30, strict: bool = True, lazy: bool = True,
              ) -> Iterator[Any]:
    """Run ooc's CUDA path over a FAKE CUDA driver inside the block; yields the driver.

    Inside, ``OutOfCore(model, opt, device="cuda", ...)`` takes a model and batches on the
    CPU and trains them through the real pinned tier, CUDA pool and copy-stream logic; the
    results are bitwise those of plain CPU training, and whatever the engine breaks of the
    driver's contract is in the yielded driver's ``violations``. The driver also has
    ``calls`` (every driver call by name, in order) and ``outstanding()`` (streams, events,
    pinned allocations, chunks, mappings, ranges, contexts and queued copies still alive: all
    zero once every engine made inside is closed). THE DRIVER IS A FAKE: see the module
    docstring for what it checks and what it cannot.

    Args:
        memory_bytes: the fake device's memory (``cuMemCreate`` past it is out of memory).
        granularity: the VMM granularity the fake reports (64 KiB: the engine's ``chunk`` must
            be a multiple; a real GPU says 2 MiB).
        pinned_limit: most pinned host memory the fake grants.
        strict: refuse (and record) what the real driver tolerates but ooc's contract forbids.
        lazy: copies run only when something waits for them (``cuEventQuery`` answers "not
            ready" instead of running them): the strictest test of the waits.

    Engines made inside must be closed inside. One block at a time (the seam is global).

    Example::

        import ooc, ooc.testing, torch

        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ooc.testing.fake_cuda() as driver:
            engine = ooc.OutOfCore(model, opt, device="cuda", budget="1MiB",
                                   manage=("activations", "params"), options=ooc.Options(chunk="64KiB"))
            for _ in range(3):
                x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
                with engine.step():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    engine.optimizer_step()
            engine.close()
        assert driver.violations == []
    """
    from ooc.testing.fake_cuda_host import HostBackedFakeDriver

    driver = HostBackedFakeDriver(memory_bytes=memory_bytes, granularity=granularity,
                                  pinned_limit=pinned_limit, strict=strict)
    driver.immediate_default_stream = True
    driver.compute_order = True
    driver.paused = lazy
    previous = set_cuda_runtime(FakeCudaRuntime(driver))
    try:
        yield driver
    finally:
        set_cuda_runtime(previous)
