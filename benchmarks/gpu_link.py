"""The GPU's link to pinned host memory and the cost of the driver's VMM calls.

``bandwidth`` measures one large pinned copy each way (the simulator prices swaps with it);
``vmm_costs`` times ``cuMemCreate``/``cuMemMap``/``cuMemSetAccess``/``cuMemUnmap``/
``cuMemRelease`` per 2 MiB chunk through ``vmm.CudaBackend``, chunk by chunk, in ranges, and
with bigger chunks (what the pool's ``chunk`` trades).
"""

from __future__ import annotations

import statistics
import time

import common

MiB = 1 << 20


def bandwidth(quick: bool) -> tuple[list[str], dict[str, float]]:
    """A Markdown table and ``{"h2d": bytes/s, "d2h": bytes/s}`` (median of 5 copies)."""
    import torch

    n = (256 if quick else 2048) * MiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows, rates = [], {}
    for key, name, fn in [("h2d", "host -> device", lambda: dev.copy_(host, non_blocking=True)),
                          ("d2h", "device -> host", lambda: host.copy_(dev, non_blocking=True))]:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        rates[key] = n / statistics.median(times)
        rows.append([name, common_size(n), f"{rates[key] / 1e9:.1f} GB/s"])
    return common.md_table(["direction", "bytes", "median of 5"], rows), rates


def common_size(n: int) -> str:
    from vmm.units import format_size

    return format_size(n)


def vmm_costs(quick: bool) -> list[str]:
    import torch

    from vmm.cuda import CudaBackend

    torch.cuda.init()
    backend = CudaBackend(torch.cuda.current_device())
    g = backend.granularity
    n = 32 if quick else 256
    t: dict[str, list[float]] = {k: [] for k in ("cuMemCreate", "cuMemMap", "cuMemSetAccess",
                                                  "cuMemUnmap", "cuMemRelease")}

    def timed(key: str, fn, *a):
        t0 = time.perf_counter()
        r = fn(*a)
        t[key].append(time.perf_counter() - t0)
        return r

    try:
        handles = [timed("cuMemCreate", backend.create_chunk, g) for _ in range(n)]
        base = backend.reserve_range(n * g)
        for j, h in enumerate(handles):
            timed("cuMemMap", backend.map, base + j * g, h, g)
            timed("cuMemSetAccess", backend.set_access, base + j * g, g)
        torch.cuda.synchronize()
        for j in range(n):
            # unmap one chunk at a time (vmm unmaps synchronize first: that is part of its cost)
            timed("cuMemUnmap", backend.unmap, base + j * g, g)
        for h in handles:
            timed("cuMemRelease", backend.release_chunk, h)
        backend.free_range(base, n * g)
    finally:
        backend.close()
    rows = [[k, f"{statistics.median(v) * 1e6:.1f} us", f"{max(v) * 1e6:.1f} us"] for k, v in t.items()]
    single = statistics.median(t["cuMemMap"]) + statistics.median(t["cuMemSetAccess"])
    per_range = _vmm_range_costs(n)
    return (common.md_table([f"call (per {common_size(g)} chunk, {n} chunks)", "median", "max"], rows)
            + ["", f"Mapping one chunk at a time (cuMemMap + cuMemSetAccess per chunk, medians): "
               f"{single * 1e6:.1f} us per chunk. cuMemUnmap includes the device synchronization "
               "vmm does before it.", "",
               *common.md_table(["range of k chunks (map_many: k cuMemMap, one cuMemSetAccess)",
                                 "per chunk (median of ranges)"],
                                [[f"k = {k}", f"{c * 1e6:.1f} us"] for k, c in per_range]),
               "", f"Target < 10 us per 2 MiB chunk: {'met' if min(c for _, c in per_range) < 10e-6 else 'NOT met'} "
               f"(best: {min(c for _, c in per_range) * 1e6:.1f} us, in ranges of "
               f"{min(per_range, key=lambda kc: kc[1])[0]} chunks).", "",
               "The other lever: bigger physical chunks (the pool's `chunk`), one cuMemCreate, "
               "one cuMemMap and one cuMemSetAccess per chunk, host time per 2 MiB mapped:", "",
               *common.md_table(["chunk", "create per 2 MiB", "map + access per 2 MiB"],
                                _vmm_chunk_size_costs(32 if quick else 256))])


def _vmm_chunk_size_costs(n2: int) -> list[list[str]]:
    """Per 2 MiB of ``n2 * 2 MiB``, mapped in chunks of 2, 8, 32 and 128 MiB (medians)."""
    import torch

    from vmm.cuda import CudaBackend

    backend = CudaBackend(torch.cuda.current_device())
    g = backend.granularity
    rows = []
    try:
        for c in (g, 4 * g, 16 * g, 64 * g):
            k = max(1, n2 * g // c)
            create, mapping = [], []
            base = backend.reserve_range(k * c)
            handles = []
            for j in range(k):
                t0 = time.perf_counter()
                handles.append(backend.create_chunk(c))
                create.append((time.perf_counter() - t0) * g / c)
                t0 = time.perf_counter()
                backend.map(base + j * c, handles[-1], c)
                backend.set_access(base + j * c, c)
                mapping.append((time.perf_counter() - t0) * g / c)
            torch.cuda.synchronize()
            backend.unmap(base, k * c)
            for h in handles:
                backend.release_chunk(h)
            backend.free_range(base, k * c)
            rows.append([common_size(c), f"{statistics.median(create) * 1e6:.1f} us",
                         f"{statistics.median(mapping) * 1e6:.1f} us"])
    finally:
        backend.close()
    return rows


def _vmm_range_costs(n: int) -> list[tuple[int, float]]:
    """Host time per chunk of mapping whole ranges of k chunks the way the pool does
    (``CudaBackend.map_many``: one cuMemMap per chunk, one cuMemSetAccess per range)."""
    import torch

    from vmm.cuda import CudaBackend

    backend = CudaBackend(torch.cuda.current_device())
    g = backend.granularity
    out = []
    try:
        handles = [backend.create_chunk(g) for _ in range(n)]
        for k in [k for k in (1, 4, 16, 64) if k <= n]:
            per = []
            for r in range(0, n - k + 1, k):
                base = backend.reserve_range(k * g)
                t0 = time.perf_counter()
                backend.map_many(base, handles[r:r + k], g)
                backend.set_access(base, k * g)
                per.append((time.perf_counter() - t0) / k)
                backend.unmap(base, k * g)
                backend.free_range(base, k * g)
            out.append((k, statistics.median(per)))
        for h in handles:
            backend.release_chunk(h)
    finally:
        backend.close()
    return out
