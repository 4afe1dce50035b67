"""Virtual-memory allocator speed: host mapping costs and allocation-trace replay rates.

    python benchmarks/bench_vmm.py [--quick] [--runs N] [--out PATH]

Measures, with medians of ``--runs`` repetitions (5 in full mode):

1. host backend (memfd + mmap MAP_FIXED, 2 MiB chunks): time to alloc + free 64 MiB
   (32 chunks) and 1 GiB (512 chunks) through ``VirtualAllocator``: *map + unmap* (chunks
   cached in the pool, mapped at alloc and unmapped at free: ``keep_mapped=False``),
   *exact reuse* (the default: a freed range stays mapped and the next equal request takes
   it with no system call) and *first touch* (writing every page once, for scale);
2. host chunk mapping rate: one ``mmap(MAP_FIXED)`` per chunk (chunks mapped in shuffled
   file order so no two can share a call) and per-chunk unmapping; target < 10 us per chunk;
3. replay rate (events/s) of ``CachingAllocator`` and ``VirtualAllocator`` over
   ``SimBackend`` on a synthetic swap trace of 1,000,000 events (``vmm.replay.swap_trace``:
   48 layers, sizes 64 KiB-96 MiB, with and without 30% size jitter); target >= 200,000/s.
   Peaks are reported too: the trace's live bytes, the caching allocator's reserved
   segments, the virtual allocator's mapped chunks, physical memory held; then the same
   trace on a device of peak live + 10%: does it fit?

``--quick`` (a few seconds): 64 MiB only, 3 runs, 50,000 events. Writes a Markdown table
to benchmarks/results/vmm.md (``--quick``: vmm-quick.md).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import common
from vmm import CachingAllocator, ChunkPool, HostBackend, SimBackend, VirtualAllocator
from vmm.replay import replay, swap_trace
from vmm.units import format_size

MiB, GiB = 1 << 20, 1 << 30
CHUNK = 2 * MiB


class Clock:
    """Wall-clock and CPU time (this process, user + system) of one measured span.

    The machine is shared: wall-clock medians include waiting for a core while other jobs
    run; CPU time does not (system calls count, since the kernel works on our behalf)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self) -> "Clock":
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall.append(time.perf_counter() - self._w)
        self.cpu.append(time.process_time() - self._c)

    def us(self, per: int = 1) -> tuple[float, float]:
        """Medians in microseconds (per ``per`` items): (wall, cpu)."""
        return (statistics.median(self.wall) * 1e6 / per, statistics.median(self.cpu) * 1e6 / per)


def _fmt_us(pair: tuple[float, float], digits: int = 1) -> str:
    return f"{pair[0]:,.{digits}f} us (CPU {pair[1]:,.{digits}f})"


def bench_host_alloc(size: int, runs: int) -> dict:
    backend = HostBackend()
    out = {}
    # map + unmap: chunks come from the pool's cache, are mapped at alloc, unmapped at free.
    va = VirtualAllocator(ChunkPool(backend, CHUNK, size), keep_mapped=False)
    va.free(va.alloc(size))                      # create the chunks once (not timed)
    calls0 = backend.calls["mmap"]
    clock = Clock()
    for _ in range(runs):
        with clock:
            va.free(va.alloc(size))
    out["map_unmap"] = clock.us()
    out["mmap_per_alloc"] = (backend.calls["mmap"] - calls0) / runs
    # the same with the cached chunks in random file order (after long churn): no two
    # neighbours share an mmap call, so this is one call per chunk.
    rng = random.Random(1)
    clock = Clock()
    for _ in range(runs):
        rng.shuffle(va.pool._cache)
        with clock:
            va.free(va.alloc(size))
    out["scattered"] = clock.us()
    va.close()
    # exact reuse: the default; the freed range stays mapped for the next equal request.
    va = VirtualAllocator(ChunkPool(backend, CHUNK, size))
    va.free(va.alloc(size))
    clock = Clock()
    for _ in range(runs):
        with clock:
            va.free(va.alloc(size))
    out["reuse"] = clock.us()
    # first touch of every page, for scale (page faults + zeroing, not the allocator).
    clock = Clock()
    for _ in range(max(1, min(runs, 3))):
        a = va.alloc(size)
        view = np.frombuffer(a.buffer(), dtype=np.uint8)
        with clock:
            view[::4096] = 1
        del view
        gc.collect()
        va.free(a)
        va.trim()                                 # punch the pages out so the next run faults
    out["touch"] = clock.us()
    va.close()
    backend.close()
    return out


def bench_map_rate(n_chunks: int, runs: int) -> dict:
    backend = HostBackend()
    handles = [backend.create_chunk(CHUNK) for _ in range(n_chunks)]
    rng = random.Random(0)
    base = backend.reserve_range(n_chunks * CHUNK)
    maps, unmaps, batch = Clock(), Clock(), Clock()
    for _ in range(runs):
        order = handles[:]
        rng.shuffle(order)                        # no two neighbours share a system call
        with maps:
            for i, h in enumerate(order):
                backend.map(base + i * CHUNK, h, CHUNK)
        with unmaps:
            for i in range(n_chunks):
                backend.unmap(base + i * CHUNK, CHUNK)
        with batch:                               # in file order: one mmap for all
            backend.map_many(base, handles, CHUNK)
        backend.unmap(base, n_chunks * CHUNK)
    backend.close()
    return {"map": maps.us(n_chunks), "unmap": unmaps.us(n_chunks), "batch": batch.us(n_chunks)}


def bench_replay(events: list, runs: int) -> list[dict]:
    """Replay ``events`` through each allocator; the two the target is about get ``runs``
    repetitions, the others one. A second group runs under a tight budget: 10% above the
    trace's peak live bytes (rounded up to whole chunks)."""
    unlimited = 80 * GiB

    def vmm_maker(capacity: int, **kw):
        return lambda: VirtualAllocator(ChunkPool(SimBackend(), CHUNK, capacity), **kw)

    makers = [
        ("caching", "80 GiB", lambda: CachingAllocator(SimBackend(), unlimited), runs),
        ("vmm-2MiB", "80 GiB", vmm_maker(unlimited), runs),
        ("vmm-2MiB lean", "80 GiB", vmm_maker(unlimited, lean=True), 1),
        ("vmm-2MiB keep_mapped=False", "80 GiB", vmm_maker(unlimited, keep_mapped=False), 1),
    ]
    rows = [_replay_row(events, name, budget, make, n) for name, budget, make, n in makers]
    live = rows[0]["result"].peak_live_bytes
    tight = -(-int(live * 1.10) // CHUNK) * CHUNK
    label = f"{format_size(tight)} (live +10%)"
    makers = [
        ("caching", label, lambda: CachingAllocator(SimBackend(), tight), 1),
        ("vmm-2MiB", label, vmm_maker(tight), 1),
        ("vmm-2MiB lean", label, vmm_maker(tight, lean=True), 1),
    ]
    rows += [_replay_row(events, name, budget, make, n) for name, budget, make, n in makers]
    return rows


def _replay_row(events: list, name: str, budget: str, make, runs: int) -> dict:
    clock, result = Clock(), None
    for _ in range(runs):
        alloc = make()
        gc.collect()
        with clock:
            result = replay(events, alloc, name=name)
    n = result.events
    return {"name": name, "budget": budget, "runs": runs, "result": result,
            "rate": n / statistics.median(clock.wall), "cpu_rate": n / statistics.median(clock.cpu),
            "min": n / max(clock.wall), "max": n / min(clock.wall)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    ap.add_argument("--runs", type=int, default=5, help="repetitions in full mode (default 5)")
    ap.add_argument("--out", type=Path, help="Markdown output (default results/vmm.md)")
    args = ap.parse_args(argv)
    runs = 3 if args.quick else max(1, args.runs)
    sizes = [64 * MiB] if args.quick else [64 * MiB, GiB]
    n_events = 50_000 if args.quick else 1_000_000
    replay_runs = 1 if args.quick else 3

    load_before = common.load_average()
    host_rows = []
    for size in sizes:
        r = bench_host_alloc(size, runs)
        r["size"] = size
        host_rows.append(r)
        print(f"host alloc+free {format_size(size):>8}: map+unmap {_fmt_us(r['map_unmap'])}, "
              f"scattered chunks {_fmt_us(r['scattered'])}, "
              f"exact reuse {_fmt_us(r['reuse'])}, first touch {_fmt_us(r['touch'], 0)}",
              flush=True)
    rate = bench_map_rate(32 if args.quick else 512, runs)
    print(f"host per chunk: map {_fmt_us(rate['map'], 2)}, unmap {_fmt_us(rate['unmap'], 2)}, "
          f"map in file order {_fmt_us(rate['batch'], 3)}", flush=True)

    traces = []
    for jitter in (0.0, 0.3):
        events = swap_trace(n_events, jitter=jitter, seed=0)
        rows = bench_replay(events, replay_runs)
        for row in rows:
            res = row["result"]
            oom = "" if res.oom_index is None else f", OUT OF MEMORY at event {res.oom_index:,}"
            print(f"replay jitter={jitter:.1f} {row['name']:<28} budget {row['budget']:<22} "
                  f"{row['rate']:>10,.0f} events/s (CPU {row['cpu_rate']:,.0f})  peak live "
                  f"{format_size(res.peak_live_bytes)}, peak reserved/mapped "
                  f"{format_size(res.peak_reserved_bytes)} (x{res.overhead:.2f}), map calls "
                  f"{res.map_calls:,}{oom}", flush=True)
        traces.append((jitter, rows))
    load_after = common.load_average()

    lines = common.header(
        "Virtual-memory allocator: host mapping costs and replay rates (`bench_vmm.py`)",
        quick=args.quick, notes=[
            f"medians of {runs} run(s) (replays: {replay_runs} for the two targeted allocators, "
            f"1 for the others); 2 MiB chunks.",
            f"load average (1/5/15 min) {load_before} before, {load_after} after: the machine is "
            "shared with other jobs. Every time is given as wall-clock (median) and as this "
            "process's CPU time (user + system, median), which does not count waiting for a "
            "core.",
        ])
    table = []
    for r in host_rows:
        n = r["size"] // CHUNK
        w, c = r["map_unmap"]
        table.append([format_size(r["size"]), n, _fmt_us(r["map_unmap"]),
                      f"{w / n:.2f} us (CPU {c / n:.2f})", f"{r['mmap_per_alloc']:.0f}",
                      _fmt_us(r["scattered"]),
                      f"{r['scattered'][0] / n:.2f} us (CPU {r['scattered'][1] / n:.2f})",
                      _fmt_us(r["reuse"]), _fmt_us(r["touch"], 0)])
    lines += ["## Host backend (memfd + mmap MAP_FIXED): alloc + free through VirtualAllocator",
              ""]
    lines += common.md_table(
        ["size", "chunks", "map + unmap (keep_mapped=False)", "per chunk", "mmap calls per alloc",
         "map + unmap, chunks scattered in the file", "per chunk", "exact reuse (default)",
         "first touch of every page"], table, align="r" * 9)
    lines += [
        "",
        "Map + unmap: chunks already exist (cached in the pool); `alloc` maps chunks that are "
        "consecutive in the memfd with one `mmap` call (a range freed and allocated again gets "
        "its chunks back in the same order), `free` maps PROT_NONE over the range in one call. "
        "Scattered: the cached chunks shuffled first, as after long churn, so `alloc` makes "
        "one `mmap` per chunk (the worst case). "
        "Exact reuse: the freed range stays mapped (parked) and the next equal request takes "
        "it without a system call. First touch: writing one byte per page (page faults and "
        "zeroing by the kernel), for scale.",
        "",
        "## Host chunk mapping rate (one `mmap(MAP_FIXED)` per chunk)",
        "",
    ]
    lines += common.md_table(
        ["map, chunks in shuffled order", "unmap (PROT_NONE over it)",
         "map in file order (one call)", "target < 10 us per chunk"],
        [[f"{_fmt_us(rate['map'], 2)} per chunk ({1e6 / rate['map'][0]:,.0f} maps/s)",
          _fmt_us(rate["unmap"], 2), _fmt_us(rate["batch"], 3),
          f"wall: {'met' if rate['map'][0] < 10 else 'NOT met'}, "
          f"CPU: {'met' if rate['map'][1] < 10 else 'NOT met'}"]], align="rrrl")
    lines += ["", f"## Replay of a synthetic swap trace over SimBackend ({n_events:,} events)", ""]
    table = []
    for jitter, rows in traces:
        label = f"swap, jitter {int(jitter * 100)}%"
        for row in rows:
            res = row["result"]
            fits = "yes" if res.oom_index is None else \
                f"**no**: OOM at event {res.oom_index:,}"
            spread = (f"{row['min']:,.0f}-{row['max']:,.0f} ({row['runs']})" if row["runs"] > 1
                      else "(1)")
            table.append([label, row["name"], row["budget"], f"**{row['rate']:,.0f}**",
                          f"{row['cpu_rate']:,.0f}", spread, fits,
                          format_size(res.peak_live_bytes), format_size(res.peak_reserved_bytes),
                          f"x{res.overhead:.3f}",
                          format_size(res.final_stats["peak_physical_bytes"]),
                          f"{res.map_calls:,}", f"{res.unmap_calls:,}"])
    lines += common.md_table(
        ["trace", "allocator", "budget", "events/s (median)", "CPU events/s", "min-max (runs)",
         "fits?", "peak live", "peak reserved / mapped", "overhead", "peak physical held",
         "map calls", "unmap calls"], table, align="lllrrrlrrrrrr")
    targeted = [row for _, rows in traces for row in rows[:2]]
    worst, worst_cpu = min(r["rate"] for r in targeted), min(r["cpu_rate"] for r in targeted)
    lines += [
        "",
        "Caching = the model of PyTorch's best-fit caching allocator (peak reserved = segment "
        "bytes); vmm = VirtualAllocator (peak mapped = chunks under live allocations; the "
        "default keeps freed ranges mapped for reuse within the budget, `lean` reclaims them "
        "before creating chunks, `keep_mapped=False` unmaps at every free). Peak physical "
        "held: memory the device really holds (caching: segments; vmm: every chunk created, "
        "in use, parked or cached). With an 80 GiB budget the default VirtualAllocator keeps "
        "parked ranges as a cache (as the caching allocator keeps segments); under a real "
        "budget it steals them back before a request would fail, and `lean` holds no more "
        "than the peak mapped bytes. The tight-budget rows give each allocator a device of "
        "the trace's peak live bytes + 10%: the caching allocator runs out of memory (it "
        "needs its peak reserved bytes), virtual addressing fits (it needs peak live + less "
        "than one chunk per live allocation), at the cost of map/unmap calls. Events/s counts "
        "the events applied (up to an OOM). Map calls count segment allocations (caching) or "
        "chunk mappings (vmm). Trace generation is not timed.",
        "",
        f"Target (>= 200,000 events/s for CachingAllocator and the default VirtualAllocator "
        f"with the 80 GiB budget): wall-clock {'met' if worst >= 200_000 else 'NOT met'} "
        f"(slowest {worst:,.0f} events/s), CPU time {'met' if worst_cpu >= 200_000 else 'NOT met'}"
        f" (slowest {worst_cpu:,.0f} events/s).",
    ]
    common.write_report(args.out or common.result_path("vmm", args.quick), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
