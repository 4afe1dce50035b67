"""Throughput of the CPU slower tier (ooc.storage.FileTier) on this machine's real disk.

    python benchmarks/bench_storage.py [--quick] [--dir DIR] [--out PATH]

Sequential writes then reads of 2, 16 and 64 MiB transfers (--quick: 2 and 16 MiB) through
the tier, for O_DIRECT (page-aligned buffers, as the runtime's pool gives) vs buffered +
write-back + DONTNEED, 1 vs 2 I/O threads, verify off/on. Each run moves 512 MiB (--quick
32 MiB; at least two transfers) as the runtime would: every write submitted at once from one
shared source, reads kept 4 in flight into 4 reused destination buffers. The first pass over
a fresh tier (the file grows) is a warm-up; the medians of the following 5 runs (--quick 2)
are steady state (rewriting allocated blocks).
CPU s/GB is the process's CPU time per GB moved: what the I/O threads take from compute.

Extra rows: first write into a growing file, an unaligned (torch-like, 64-byte) source,
fdatasync vs sync_file_range for the buffered write-back, chunk size (64 MiB transfers;
--quick 16 MiB), and the checksum speed.
Writes a Markdown table to benchmarks/results/storage.md.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np

import common
from ooc.storage import FileTier

MiB = 1 << 20
WINDOW = 4  # reads in flight


def _aligned(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    buf[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return buf


def _unaligned(nbytes: int) -> memoryview:
    """A buffer 64 bytes past a page boundary: what torch's CPU allocator usually returns."""
    raw = np.random.default_rng(1).integers(0, 256, nbytes + 4096 + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096 + 64
    return memoryview(raw[start:start + nbytes])


def _write_pass(tier: FileTier, src, size: int, count: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    futs = [tier.write_async(k, src, size) for k in range(count)]
    for f in futs:
        f.result()
    return time.perf_counter() - t0, time.process_time() - c0


def _read_pass(tier: FileTier, dsts: list, count: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    futs: list = []
    for k in range(count):
        if len(futs) >= len(dsts):
            futs[k - len(dsts)].result()
        futs.append(tier.read_async(k, dsts[k % len(dsts)]))
    for f in futs:
        f.result()
    return time.perf_counter() - t0, time.process_time() - c0


class Case:
    """One configuration, measured one run at a time so that configurations interleave: the
    machine is shared, and interleaving spreads a busy minute over all of them alike."""

    def __init__(self, directory: str, size: int, total: int, *, direct: bool, threads: int,
                 verify: bool, src, dsts, chunk_bytes: int = 2 * MiB, flush: str = "range",
                 fresh: bool = False) -> None:
        self.size, self.count = size, max(total // size, 2)
        self.moved = self.count * size
        self.src, self.dsts, self.fresh = src, dsts, fresh
        self.kwargs = dict(threads=threads, verify=verify, direct=None if direct else False,
                           chunk_bytes=chunk_bytes, _flush=flush)
        self.directory, self.direct = directory, direct
        self.w: list[float] = []
        self.r: list[float] = []
        self.wc: list[float] = []
        self.rc: list[float] = []
        self.tier: FileTier | None = None
        self.stats: dict = {}
        self.supported = True

    def open(self) -> None:
        self.tier = FileTier(self.directory, **self.kwargs)
        if self.direct and not self.tier.direct_io:
            self.supported = False
        if not self.fresh:  # warm-up: the file grows to its steady size
            _write_pass(self.tier, self.src, self.size, self.count)
            _read_pass(self.tier, self.dsts, self.count)

    def run_once(self) -> None:
        if not self.supported:
            return
        if self.fresh:  # the first write into a new, growing file
            self.open()
        dt, cpu = _write_pass(self.tier, self.src, self.size, self.count)
        self.w.append(self.moved / dt / 1e9)
        self.wc.append(cpu / (self.moved / 1e9))
        if not self.fresh:
            dt, cpu = _read_pass(self.tier, self.dsts, self.count)
            self.r.append(self.moved / dt / 1e9)
            self.rc.append(cpu / (self.moved / 1e9))
        if self.kwargs["verify"]:  # the data really came back
            assert bytes(memoryview(self.dsts[0])[:64]) == bytes(memoryview(self.src)[:64])
        if self.fresh:
            self.close()

    def close(self) -> None:
        if self.tier is not None:
            self.stats = self.tier.stats()
            self.tier.close()
            self.tier = None

    def cell(self, values: list[float]) -> str:
        if not values:
            return ""
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    @staticmethod
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")


def run_interleaved(cases: list[Case], runs: int) -> None:
    for case in cases:
        if not case.fresh:
            case.open()
    try:
        for i in range(runs):
            order = cases[i % len(cases):] + cases[:i % len(cases)]  # rotate: no fixed position
            for case in order:
                case.run_once()
    finally:
        for case in cases:
            case.close()


def checksum_speed(nbytes: int = 64 * MiB, chunk: int = 2 * MiB) -> dict:
    data = memoryview(_aligned(nbytes))
    out = {}
    for name, fn in (("crc32", lambda b: zlib.crc32(b)),
                     ("blake2b-64", lambda b: hashlib.blake2b(b, digest_size=8).digest())):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for off in range(0, nbytes, chunk):
                fn(data[off:off + chunk])
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / min(times) / 1e9
    return out


def _summary(rows: list, extra: list) -> list[str]:
    """A few ratios the planner and the runtime care about, computed, not hand-written."""
    def pick(path, threads, verify):
        return [c for size, p, t, v, c in rows if p == path and t == threads and v == verify
                and c.supported and size >= 16]

    large = sorted({size for size, *_ in rows if size >= 16})
    span = f"{large[0]}-{large[-1]} MiB" if len(large) > 1 else f"{large[0]} MiB"
    out = []
    direct, buffered = pick("O_DIRECT", 2, False), pick("buffered+fadvise", 2, False)
    if direct and buffered:
        dcpu = statistics.median([Case.median(c.wc + c.rc) for c in direct])
        bcpu = statistics.median([Case.median(c.wc + c.rc) for c in buffered])
        out.append(f"- CPU per GB moved ({span}, 2 threads): O_DIRECT {dcpu:.2f} s, buffered "
                   f"{bcpu:.2f} s ({bcpu / dcpu:.1f}x more): the buffered path copies every "
                   "byte through the page cache, CPU that 2 cores take from compute.")
        dgb = statistics.median([Case.median(c.w + c.r) for c in direct])
        bgb = statistics.median([Case.median(c.w + c.r) for c in buffered])
        out.append(f"- wall-clock throughput (same rows, writes and reads): O_DIRECT {dgb:.2f} "
                   f"GB/s, buffered {bgb:.2f} GB/s. Buffered can be faster in wall time "
                   "(write-back merges and runs ahead); O_DIRECT is cheaper in CPU. The tier "
                   "uses O_DIRECT for page-aligned buffers by default; direct=False picks "
                   "buffered for an I/O-bound, CPU-idle run.")
    for path in ("O_DIRECT", "buffered+fadvise"):
        off, on = pick(path, 2, False), pick(path, 2, True)
        if off and on:
            w = statistics.median([Case.median(b.w) / Case.median(a.w) for a, b in zip(off, on)])
            r = statistics.median([Case.median(b.r) / Case.median(a.r) for a, b in zip(off, on)])
            out.append(f"- verify=True ({path}, {span}, 2 threads) keeps {w:.0%} of write and "
                       f"{r:.0%} of read throughput (CRC-32 per chunk, in the I/O threads).")
    one, two = pick("O_DIRECT", 1, False), pick("O_DIRECT", 2, False)
    if one and two:
        gain = statistics.median([Case.median(b.w + b.r) / Case.median(a.w + a.r)
                                  for a, b in zip(one, two)])
        out.append(f"- 2 I/O threads vs 1 (O_DIRECT, {span}): {gain:.2f}x throughput.")
    flush = {name: c for name, c, _ in extra if "write-back by" in name}
    if len(flush) == 2:
        sfr, fds = (Case.median(c.w) for c in flush.values())
        out.append(f"- buffered write-back: sync_file_range {sfr:.2f} GB/s vs fdatasync "
                   f"{fds:.2f} GB/s ({sfr / fds:.1f}x).")
    return out


def _fs_info(path: str) -> str:
    """File system type, device and mount point of ``path`` (the longest matching mount)."""
    real = os.path.realpath(path)
    best = ("?", "/", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, *_ = line.split()
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize / 1e9
    return f"{best[2]} on {best[0]} mounted at {best[1]}, {free:.0f} GB free"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 and 16 MiB transfers, 32 MiB per run, 2 runs")
    ap.add_argument("--dir", default=None, help="parent of the swap directory (default $TMPDIR)")
    ap.add_argument("--out", help="Markdown output (default benchmarks/results/storage.md, "
                                   "storage-quick.md with --quick)")
    args = ap.parse_args(argv)
    total, runs = (32 * MiB, 2) if args.quick else (512 * MiB, 5)
    sizes_mib, big = ((2, 16), 16 * MiB) if args.quick else ((2, 16, 64), 64 * MiB)
    directory = args.dir or tempfile.gettempdir()
    started = time.time()
    load_before = common.load_average()

    with FileTier(directory) as probe:
        direct_here = probe.direct_io
        reason = probe.stats()["direct_io_reason"]
    with FileTier("/tmp") as probe:
        direct_tmp = probe.direct_io

    rows = []
    for size_mib in sizes_mib:
        size = size_mib * MiB
        src = _aligned(size)
        dsts = [mmap.mmap(-1, size) for _ in range(WINDOW)]
        cases = []
        for direct in (True, False):
            for threads in (1, 2):
                for verify in (False, True):
                    case = Case(directory, size, total, direct=direct, threads=threads,
                                verify=verify, src=src, dsts=dsts)
                    cases.append(case)
                    rows.append((size_mib, "O_DIRECT" if direct else "buffered+fadvise",
                                 threads, verify, case))
        run_interleaved(cases, runs)
        for size_mib_, path, threads, verify, case in rows[-len(cases):]:
            if case.supported:
                print(f"{size_mib_:3d} MiB {path:17s} t={threads} verify={verify!s:5s} "
                      f"write {case.cell(case.w)} GB/s  read {case.cell(case.r)} GB/s", flush=True)
        del src, dsts

    size = 16 * MiB
    src, dsts = _aligned(size), [mmap.mmap(-1, size) for _ in range(WINDOW)]
    usrc, udsts = _unaligned(size), [_unaligned(size) for _ in range(WINDOW)]
    src_big, dsts_big = _aligned(big), [mmap.mmap(-1, big) for _ in range(WINDOW)]
    variants = [
        ("O_DIRECT, first write into a new file (it grows)",
         Case(directory, size, total, direct=True, threads=2, verify=False, src=src, dsts=dsts,
              fresh=True), "compare the steady-state 16 MiB O_DIRECT row"),
        ("unaligned 64-byte buffers (torch-like): buffered path",
         Case(directory, size, total, direct=True, threads=2, verify=False, src=usrc,
              dsts=udsts), "the tier picks buffered I/O by itself"),
        ("buffered, write-back by sync_file_range (the default)",
         Case(directory, size, total, direct=False, threads=2, verify=False, src=src,
              dsts=dsts, flush="range"), ""),
        ("buffered, write-back by fdatasync",
         Case(directory, size, total, direct=False, threads=2, verify=False, src=src,
              dsts=dsts, flush="fdatasync"), ""),
        (f"O_DIRECT {big // MiB} MiB transfers, chunk_bytes=2 MiB (the default)",
         Case(directory, big, total, direct=True, threads=2, verify=False, src=src_big,
              dsts=dsts_big, chunk_bytes=2 * MiB), "one syscall per chunk"),
        (f"O_DIRECT {big // MiB} MiB transfers, chunk_bytes=8 MiB",
         Case(directory, big, total, direct=True, threads=2, verify=False, src=src_big,
              dsts=dsts_big, chunk_bytes=8 * MiB), "one syscall per chunk"),
    ]
    run_interleaved([case for _, case, _ in variants], runs)
    extra = [(name, case, note) for name, case, note in variants if case.supported]
    for name, case, note in extra:
        print(f"{name}: write {case.cell(case.w)} read {case.cell(case.r)}", flush=True)
    sums = checksum_speed()
    for name, gbs in sums.items():
        print(f"{name}: {gbs:.2f} GB/s")

    lines = common.header("Storage tier (FileTier) throughput", quick=args.quick, notes=[
        f"swap directory parent: `{directory}` — {_fs_info(directory)}",
        f"O_DIRECT here: {'yes' if direct_here else 'no (' + str(reason) + ')'}; "
        f"on /tmp: {'yes' if direct_tmp else 'no'}",
        f"method: `python benchmarks/bench_storage.py{' --quick' if args.quick else ''}`; "
        f"{total // MiB} MiB per run, median of {runs} runs after one warm-up pass, the "
        "configurations of a table interleaved run by run; writes all "
        f"submitted at once, reads {WINDOW} in flight; GB = 1e9 bytes. CPU s/GB = process CPU "
        "time per GB moved (what the I/O takes from compute threads).",
        f"load average (1/5/15 min) {load_before} before, {common.load_average()} after "
        "(other jobs share this machine; I/O threads and checksums need CPU, so a busy machine "
        "lowers every figure).",
        "caveat: a virtual disk may be cached by the host; these are the numbers this "
        "machine's planner should use, not the device's datasheet.",
    ])
    lines += ["Median (min–max) over the runs.", ""]
    lines += common.md_table(
        ["transfer", "I/O path", "threads", "verify", "write GB/s", "read GB/s", "write CPU s/GB",
         "read CPU s/GB"],
        [[f"{size_mib} MiB", path, threads, "on" if verify else "off", c.cell(c.w), c.cell(c.r),
          f"{c.median(c.wc):.2f}", f"{c.median(c.rc):.2f}"]
         for size_mib, path, threads, verify, c in rows if c.supported],
        align="rlrlrrrr")
    lines += ["", "## Variants (16 MiB transfers, 2 threads unless said)", ""]
    lines += common.md_table(
        ["variant", "write GB/s", "read GB/s", "write CPU s/GB", "note"],
        [[name, c.cell(c.w), c.cell(c.r), f"{c.median(c.wc):.2f}", note]
         for name, c, note in extra], align="lrrrl")
    lines += ["", "## Checksums (one thread, 2 MiB chunks, 64 MiB)", ""]
    lines += common.md_table(["checksum", "GB/s"],
                             [[name, f"{gbs:.2f}"] for name, gbs in sums.items()])
    lines += ["", "## Summary (computed from the tables above)", ""] + _summary(rows, extra)
    lines += ["", f"Total benchmark time {time.time() - started:.0f} s.", ""]
    common.write_report(common.result_path("storage", args.quick, out=args.out), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
