"""Replay speed of ``ooc frag``: events per second through each allocator, and end to end.

    python benchmarks/bench_frag.py [--quick] [--events N] [--runs N] [--out PATH]

Builds a synthetic snapshot of ``--events`` allocation events (1,000,000; ``--quick``:
200,000): the allocation trace of a swap schedule repeated step after step
(``vmm.replay.swap_trace``, 48 layers, sizes 64 KiB-96 MiB, 5% size jitter between steps),
written in PyTorch's snapshot format by the caching allocator model (``segment_alloc``,
``alloc``, ``free_requested`` + ``free_completed`` per event: 1.5 entries per event). Then,
median of ``--runs`` (3; quick: 1):

- load: safe unpickle + parse into events (``ooc.frag.load``);
- replay: events/s through the caching model and virtual addressing at 2, 20 and 40 MiB
  chunks, as ``ooc frag`` runs it (``ooc.frag.analyze``, which watches the allocator
  between events), and ``vmm.replay.replay`` alone for comparison;
- end to end: wall time of ``python -m ooc frag SNAPSHOT --json`` in a fresh process.

Target: at least 200,000 events/s replayed. Writes benchmarks/results/frag.md
(``--quick``: frag-quick.md).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ooc
from ooc import frag
from ooc.frag.inputs import Trace, gc_paused
from ooc.frag.report import DEFAULT_CHUNKS, allocator_name, make_allocator
from vmm.replay import replay, swap_trace
from vmm.units import format_size

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 200_000


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200k events, one run")
    ap.add_argument("--events", type=int, help="events in the synthetic snapshot (default 1M)")
    ap.add_argument("--runs", type=int, help="runs per measurement (default 3; quick 1)")
    ap.add_argument("--out", type=Path, help="Markdown output (default results/frag.md)")
    args = ap.parse_args(argv)
    n = args.events or (200_000 if args.quick else 1_000_000)
    runs = max(1, args.runs or (1 if args.quick else 3))
    load0 = load_average()

    t0 = time.perf_counter()
    events = swap_trace(n, jitter=0.05, seed=0)
    gen_s = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix="bench-frag-"))
    snap_path = tmp / "synthetic.pickle"
    t0 = time.perf_counter()
    info = frag.export_snapshot(Trace(name="synthetic", kind="csv", events=events), snap_path)
    export_s = time.perf_counter() - t0
    size = snap_path.stat().st_size
    print(f"snapshot: {n:,} events, {info.entries:,} entries, {format_size(size)} "
          f"(generated {gen_s:.1f} s, exported {export_s:.1f} s)", flush=True)
    del events

    load_t: list[float] = []
    trace = None
    for _ in range(runs):
        trace = None
        t0 = time.perf_counter()
        trace = frag.load(snap_path)
        load_t.append(time.perf_counter() - t0)
    assert trace is not None and len(trace.events) == n, len(trace.events)
    print(f"load: {statistics.median(load_t):.2f} s ({n / statistics.median(load_t):,.0f} events/s)",
          flush=True)

    names = [allocator_name(c) for c in (None, *DEFAULT_CHUNKS)]
    frag_rate: dict[str, list[float]] = {k: [] for k in names}
    frag_cpu: dict[str, list[float]] = {k: [] for k in names}
    raw_rate: dict[str, list[float]] = {k: [] for k in names}
    raw_cpu: dict[str, list[float]] = {k: [] for k in names}
    peaks: dict[str, tuple[int, int, int, int]] = {}
    analyze_t: list[float] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        rep = frag.analyze(trace, chunks=DEFAULT_CHUNKS)
        analyze_t.append(time.perf_counter() - t0)
        for a in rep.allocators:
            frag_rate[a.name].append(a.events / a.seconds)
            frag_cpu[a.name].append(a.events / a.cpu_seconds)
            peaks[a.name] = (a.peak_live_bytes, a.peak_reserved_bytes, a.map_calls, a.unmap_calls)
        for chunk in (None, *DEFAULT_CHUNKS):
            alloc = make_allocator(chunk, None)
            with gc_paused():
                t0, c0 = time.perf_counter(), time.process_time()
                replay(trace.events, alloc, name="raw")
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
            raw_rate[allocator_name(chunk)].append(n / dt)
            raw_cpu[allocator_name(chunk)].append(n / dc)
    for k in names:
        print(f"replay {k:<10} {statistics.median(frag_rate[k]):>10,.0f} events/s in ooc frag "
              f"({statistics.median(frag_cpu[k]):,.0f} per CPU s), "
              f"{statistics.median(raw_rate[k]):>10,.0f} in vmm.replay alone "
              f"({statistics.median(raw_cpu[k]):,.0f} per CPU s)", flush=True)

    e2e_t: list[float] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ooc", "frag", str(snap_path), "--json",
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL, env=env)
        e2e_t.append(time.perf_counter() - t0)
    print(f"end to end: {statistics.median(e2e_t):.2f} s", flush=True)
    snap_path.unlink()
    tmp.rmdir()

    out = args.out or RESULTS / ("frag-quick.md" if args.quick else "frag.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    med = statistics.median
    lines = [
        "# `ooc frag`: replay speed and end-to-end time",
        "",
        f"- machine: {machine()}",
        f"- Python {platform.python_version()}, numpy {__import__('numpy').__version__}, "
        f"ooc {ooc.__version__}, commit {commit()}",
        f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}; load average "
        f"(1/5/15 min) at start {load0}, at end {load_average()} (machine shared with other jobs: "
        f"times are wall-clock)",
        f"- input: synthetic snapshot, {n:,} events ({info.entries:,} trace entries, "
        f"{format_size(size)} pickle): `vmm.replay.swap_trace({n}, jitter=0.05)` exported through "
        f"the caching allocator model; medians of {runs} run(s)",
        "",
        "Wall-clock events/s is what a user waits for; events per CPU second (time.process_time of "
        "the process) is the same run with the other jobs' share of the 2 cores taken out.",
        "",
        "| allocator | events/s in `ooc frag` (median, wall) | min-max | per CPU s "
        "| `vmm.replay` alone, wall | alone, per CPU s | peak live | peak reserved/mapped "
        "| map / unmap | target 200k/s (wall) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k in names:
        r = frag_rate[k]
        live, resv, maps, unmaps = peaks[k]
        ok = "met" if med(r) >= TARGET else "**not met**"
        lines.append(f"| {k} | **{med(r):,.0f}** | {min(r):,.0f}-{max(r):,.0f} | {med(frag_cpu[k]):,.0f} "
                     f"| {med(raw_rate[k]):,.0f} | {med(raw_cpu[k]):,.0f} "
                     f"| {format_size(live)} | {format_size(resv)} | {maps:,} / {unmaps:,} | {ok} |")
    total = n * len(names)
    lines += [
        "",
        "| stage | median s | min-max s | events/s |",
        "|---|---:|---:|---:|",
        f"| load (safe unpickle + parse) | {med(load_t):.2f} | {min(load_t):.2f}-{max(load_t):.2f} "
        f"| {n / med(load_t):,.0f} |",
        f"| analyze (4 replays) | {med(analyze_t):.2f} | {min(analyze_t):.2f}-{max(analyze_t):.2f} "
        f"| {total / med(analyze_t):,.0f} (over {len(names)} x {n:,}) |",
        f"| end to end, `python -m ooc frag SNAPSHOT --json` | {med(e2e_t):.2f} "
        f"| {min(e2e_t):.2f}-{max(e2e_t):.2f} | {n / med(e2e_t):,.0f} |",
        f"| (setup) export of the snapshot through the caching model | {export_s:.2f} | | "
        f"{n / export_s:,.0f} |",
        "",
    ]
    slow = [k for k in names if med(frag_rate[k]) < TARGET]
    if slow:
        lines.append(f"Target (>= {TARGET:,} events/s replayed) not met for: {', '.join(slow)}. "
                     f"The replay loop and the allocators are vmm's (`vmm.replay.replay`); the "
                     f"`vmm.replay alone` column is their speed without ooc frag's watcher.")
    else:
        lines.append(f"Target (>= {TARGET:,} events/s replayed through every allocator): met.")
    lines.append("")
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
