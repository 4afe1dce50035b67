"""replay(): the shared trace interface, its errors, and the fragmentation comparison."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vmm import CachingAllocator, ChunkPool, SimBackend, VirtualAllocator, VMMError
from vmm.replay import MAX_SAMPLES, Event, ReplayError, ReplayResult, replay, swap_trace

MiB = 1 << 20
CHUNK = 2 * MiB


def vmm_alloc(capacity: int = 80 << 30, **kw) -> VirtualAllocator:
    return VirtualAllocator(ChunkPool(SimBackend(), CHUNK, capacity), **kw)


def test_interface_shapes() -> None:
    ev = Event("alloc", 1, 10)
    assert ev.time == 0.0 and dataclasses.is_dataclass(ev)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.nbytes = 3  # type: ignore[misc]
    assert not hasattr(ev, "__dict__")                       # slots
    fields = [f.name for f in dataclasses.fields(ReplayResult)]
    assert fields == ["allocator", "events", "peak_live_bytes", "peak_reserved_bytes",
                      "final_stats", "samples", "oom_index", "oom_request",
                      "largest_free_at_oom", "map_calls", "unmap_calls"]


def test_docstring_example() -> None:
    events = [Event("alloc", "a", 3 << 20), Event("alloc", "b", 5 << 20),
              Event("free", "a", 0), Event("free", "b", 0)]
    r1 = replay(events, CachingAllocator(SimBackend()), name="caching")
    r2 = replay(events, vmm_alloc(16 << 30), name="vmm-2MiB")
    assert (r1.peak_reserved_bytes, r2.peak_reserved_bytes) == (20 * MiB, 10 * MiB)
    assert r1.allocator == "caching" and r1.events == 4 and r1.peak_live_bytes == 8 * MiB
    assert r1.oom_index is None and r2.map_calls == 5 and r2.unmap_calls == 0
    assert r1.samples.shape == (4, 3) and r1.samples.dtype == np.int64
    assert r1.samples[:, 1].tolist() == [3 * MiB, 8 * MiB, 5 * MiB, 0]
    assert r2.samples[:, 2].tolist() == [4 * MiB, 10 * MiB, 6 * MiB, 0]
    assert r2.final_stats["requested_bytes"] == 0


def test_trace_errors_name_key_and_index() -> None:
    with pytest.raises(ReplayError, match=r"event 1: free of key 'x'.*not live"):
        replay([Event("alloc", "a", 1), Event("free", "x", 0)], vmm_alloc(), name="v")
    with pytest.raises(ReplayError, match=r"event 2: alloc of key 7.*allocated at event 0"):
        replay([Event("alloc", 7, 1), Event("alloc", 8, 1), Event("alloc", 7, 1)],
               CachingAllocator(SimBackend()), name="c")
    with pytest.raises(ReplayError, match="unknown action 'malloc'"):
        replay([Event("malloc", 1, 1)], vmm_alloc(), name="v")
    assert issubclass(ReplayError, VMMError)


def test_oom_stops_the_replay_and_reports() -> None:
    events = [Event("alloc", i, 5 * MiB) for i in range(10)]
    r = replay(events, vmm_alloc(capacity=20 * MiB), name="vmm")    # 10 chunks: 3 fit
    assert (r.oom_index, r.oom_request, r.events) == (3, 5 * MiB, 3)
    assert r.largest_free_at_oom == 2 * MiB
    c = replay(events, CachingAllocator(SimBackend(), 32 * MiB), name="caching")
    # four 5 MiB blocks fill one 20 MiB segment; the fifth needs a second one: 40 > 32
    assert c.oom_index == 4 and c.largest_free_at_oom == 0
    assert c.samples[-1, 0] == 3 and c.final_stats["num_alloc_retries"] == 1


def test_samples_are_decimated_and_progress_reported() -> None:
    events = swap_trace(60_000, seed=1)
    seen = []
    r = replay(events, vmm_alloc(), name="v", progress=seen.append)
    assert len(r.samples) <= MAX_SAMPLES + 1 and r.samples[-1, 0] == len(events) - 1
    assert np.all(np.diff(r.samples[:, 0]) > 0)
    assert seen == [len(events)]                             # < 65,536 events: once, at the end
    # an iterator of unknown length is decimated on the fly
    r2 = replay(iter(events), vmm_alloc(), name="v")
    assert len(r2.samples) <= MAX_SAMPLES + 1 and r2.samples[-1, 0] == len(events) - 1
    assert r2.peak_reserved_bytes == r.peak_reserved_bytes


def test_swap_trace_is_balanced_and_deterministic() -> None:
    t = swap_trace(10_001, seed=3, jitter=0.2)
    assert len(t) == 10_000 and t == swap_trace(10_001, seed=3, jitter=0.2)
    live = set()
    for ev in t:
        if ev.action == "alloc":
            assert ev.key not in live and ev.nbytes > 0
            live.add(ev.key)
        else:
            live.remove(ev.key)
    assert not live


def _n_max(events) -> int:
    live = peak = 0
    for ev in events:
        live += 1 if ev.action == "alloc" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("jitter", [0.0, 0.3])
def test_fragmentation_bound_vmm_vs_caching(jitter, capsys) -> None:
    """On a swap-like trace, virtual addressing maps at most one chunk per live
    allocation beyond what is requested; the caching allocator reserves far more."""
    events = swap_trace(40_000, jitter=jitter, seed=11)
    n_max = _n_max(events)
    v = replay(events, vmm_alloc(), name="vmm-2MiB")
    c = replay(events, CachingAllocator(SimBackend()), name="caching")
    assert v.peak_live_bytes == c.peak_live_bytes
    assert v.final_stats["peak_mapped_bytes"] == v.peak_reserved_bytes
    assert v.peak_reserved_bytes <= v.peak_live_bytes + n_max * CHUNK
    assert c.peak_reserved_bytes > 1.3 * c.peak_live_bytes
    with capsys.disabled():
        print(f"\n[jitter={jitter}] peak live {v.peak_live_bytes / MiB:.0f} MiB, N_max {n_max}: "
              f"vmm mapped x{v.overhead:.3f}, caching reserved x{c.overhead:.2f}")


def test_benchmark_quick_runs(tmp_path) -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vmm.py"
    out = tmp_path / "vmm.md"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "| " in text and "events/s" in text and "Python" in text
