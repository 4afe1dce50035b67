"""Finalizers that call back into a module-level lock's owner from inside its locked section.

A device pool or an engine dropped without ``close()`` reports to ``ooc.host.cpu_allocator``
(and closes its swap file's tier) from a ``weakref.finalize``; the garbage collector runs
finalizers at any allocation of the thread that triggers it, the locked sections of those
very modules included.
With a plain ``Lock`` that deadlocked CI (``external`` built a tuple, the collector ran a dead
pool's ``external(0, 0)``, which waited on the lock its own thread held). pytest-timeout did not
save the run: its ``SIGALRM`` exception is raised inside the finalizer, where the collector
swallows it, so each such hang cost the test's whole timeout and then passed.

Each case forces a collection inside the locked section (a dict that collects before it
stores) with a dead object whose finalizer calls the same module, and runs in a
daemon thread: a deadlock leaves the thread alive at the join's deadline, and the test fails
instead of hanging the suite. The deadline is generous: it only tells a hang from a slow
machine, nothing here is timed.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Callable

import pytest

from ooc.host import cpu_allocator
from ooc.runtime.cpu_pool import CpuDevicePool
from ooc.storage.file_tier import FileTier
from in_child import run_in_child

HANG = 120.0   # seconds: far beyond the milliseconds each case takes, even on a busy machine


class _Cycle:
    """Garbage only the collector frees (a reference cycle), so its finalizer runs at the
    collector's choosing: inside whatever allocated when the collection began."""

    def __init__(self) -> None:
        self.me = self


class _CollectingDict(dict):
    """A dict whose item assignment first runs the collector, as an allocation may."""

    def __setitem__(self, key, value) -> None:
        gc.collect()
        super().__setitem__(key, value)


def _finishes(body: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - reported in the test's thread
            errors.append(e)

    worker = threading.Thread(target=run, daemon=True, name="finalizer-reentry")
    worker.start()
    worker.join(HANG)
    assert not worker.is_alive(), "deadlock: a finalizer waited on a lock its own thread held"
    if errors:
        raise errors[0]


def _dead_with_finalizer(callback: Callable, *args) -> None:
    dead = _Cycle()
    weakref.finalize(dead, callback, *args)
    del dead


def test_a_dead_pools_report_inside_external_does_not_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_allocator, "_pools", _CollectingDict())

    def body() -> None:
        _dead_with_finalizer(cpu_allocator.external, 0, 0, 99)
        cpu_allocator.external(4096, 8192, 98)

    _finishes(body)
    assert dict(cpu_allocator._pools) == {98: (4096, 8192)}   # the outer report stands
    cpu_allocator.external(0, 0, 98)


def test_a_real_pool_collected_inside_external_reports_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's own finalizer (``CpuDevicePool(on_physical=...)``), not a stand-in."""
    monkeypatch.setattr(cpu_allocator, "_pools", _CollectingDict())

    def body() -> None:
        heard: list[tuple[int, int]] = []

        def hear(used: int, idle: int) -> None:
            heard.append((used, idle))
            cpu_allocator.external(used, idle, 97)

        pool = CpuDevicePool(1 << 20, 1 << 16, on_physical=hear)
        pool.self_ref = pool   # a cycle: only the collector frees it
        t = pool.take(1 << 16)
        del t, pool
        cpu_allocator.external(4096, 0, 96)
        assert heard[-1] == (0, 0), heard

    _finishes(body)
    assert 97 not in cpu_allocator._pools
    cpu_allocator.external(0, 0, 96)


def test_a_tier_closed_by_a_finalizer_inside_its_own_io_thread_does_not_deadlock(tmp_path) -> None:
    """An engine collected while its swap-out is in flight closes its tier from its finalizer
    (``ooc.engine.lifetime.collected``); the collector may run it in the tier's I/O thread,
    inside ``_done``'s locked section, where the transfer books its bytes."""
    tier = FileTier(tmp_path, threads=1)
    tier._stats = _CollectingDict(tier._stats)
    _dead_with_finalizer(tier.close)
    data = bytearray(b"x" * 8192)
    future = tier.write_async(1, data, len(data))
    _finishes(lambda: future.exception())   # the write finishes (done or failed), no hang
    assert tier.closed
    tier.close()


def _collect_while_a_thread_registers(what: str, storage: str) -> None:
    """In the child: drop a tier (or an engine, whose tier has running I/O threads) in a
    cycle, and let the collector find it while a thread holds threading's
    ``_shutdown_locks_lock``, as a starting thread does (``_maintain_shutdown_locks``, where
    an outside-loop probe hung). A join of the dead tier's threads there needs that lock."""
    import torch

    import ooc
    from ooc.storage import reaper

    if what == "tier":
        tier = FileTier(storage, threads=2)
        tier.write_async(1, bytearray(8192), 8192).result()   # its I/O threads run
        tier.self_ref = tier
        del tier
    else:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = ooc.OutOfCore(model, opt, budget="1MiB", storage=storage,
                               options=ooc.Options(chunk=4096, min_bytes=1))
        with engine.step():
            model(torch.randn(16, 64)).sum().backward()
            opt.step()
        engine.self_ref = engine
        del engine, model, opt
    done = threading.Event()

    def holder() -> None:
        with threading._shutdown_locks_lock:   # what a thread's start holds while it registers
            gc.collect()
        done.set()

    threading.Thread(target=holder, daemon=True).start()
    assert done.wait(HANG), "deadlock: a finalizer joined threads under threading's lock"
    assert reaper.settled(HANG), "the reaper did not finish the dead tier's cleanup"
    import os
    assert os.listdir(storage) == [], os.listdir(storage)


@pytest.mark.parametrize("what", ["tier", "engine"])
def test_a_tier_collected_while_a_thread_starts_is_cleaned_up_without_a_deadlock(what: str, tmp_path) -> None:
    """In a child process: a regression leaves threading's lock held for good, which would
    hang every later thread start of the suite."""
    if not hasattr(threading, "_shutdown_locks_lock"):   # CPython 3.11's; later ones changed it
        pytest.skip("this Python's threading has no _shutdown_locks_lock to hold")
    run_in_child(__file__, "_collect_while_a_thread_registers", what, str(tmp_path), timeout=2 * HANG + 60)
