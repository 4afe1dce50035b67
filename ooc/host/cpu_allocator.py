"""A recycling CPU allocator for the managed step, built from ``cpu_allocator.cpp`` on first use.

Why: out-of-core training on a CPU frees memory all through the step (every swapped-out
activation) and must give it back, or the process keeps the memory swapping was meant to
save. glibc either keeps freed blocks in its heap (fast, but the heap does not shrink: no
saving) or, with a fixed mmap threshold, unmaps every large block on free, and the kernel then
zeroes fresh pages for the next allocation of the same size. On the 2-core VM this project is
measured on, zeroing runs at about 1 GB/s: plain PyTorch training slows by ~30% under that
threshold. This allocator keeps freed large blocks while a step runs and hands them to the
next requests (best fit, split, neighbours merged), so the step's tensors land on pages that
are already there; a request no cached block holds gathers the pages of smaller ones
(``mremap``: moved, not copied or zeroed again) and maps fresh only what the cache lacks.
PyTorch resizes a storage through the allocator it was made with, so the engine hands the
parameters built before it to this one (:func:`claim`): each of their swap-ins asked glibc for
fresh pages otherwise (VGG16 at 1/4 of its peak, all kinds managed: ~19,000 page faults and
0.66-0.73 s a step, 1,500 and 0.55-0.57 s once claimed). ooc's device pool takes the pages of
its chunks from the same cache and gives them back to it (:func:`lend`, :func:`adopt`; the chunks are anonymous memory moved with
``mremap``, ``vmm.anon_host``): with the pool's pages in a file of their own, a swap-in could
not land on a freed activation's pages nor an activation on a swapped-in tensor's, and on this
project's VM that churn cost ResNet-50 batch 8 at 1/4 of its peak ~70 fresh blocks and ~44k
page faults per step (1.42 -> 1.22-1.26 s a step once shared, rise 505 -> 497 MiB). The cache
is bounded by the step's own live peak (:func:`external` adds the pool's bytes): idle memory
may fill what separates the live bytes (live blocks + the pool's used bytes) from their peak in
this step or the one before (or a small floor). Before mapping anything new the cache drops its
oldest blocks, so it never makes the process larger than its tensors already did. There is
no cap below that bound: one only made the kernel zero pages again each step
(``ooc.engine.lifetime.recycle_bytes`` says why).
Between steps it only shrinks (it serves large requests, then gives back what they need),
and :func:`release` (``engine.close()``) unmaps it. Blocks are 2 MiB-rounded anonymous mmaps,
page-aligned for the swap file's O_DIRECT: transparent huge pages where the kernel allows
(``madvise``), but not under a budget for the whole step (a cap, :func:`begin`), where blocks
are page-rounded and mapped without huge pages: there a huge page made a block's rounding
resident, memory no budget counted for the managed tensors in such blocks.

PyTorch lets only C++ replace its CPU allocator (``c10::SetCPUAllocator``), so the source is
compiled against the installed torch's headers with the system's C++ compiler (about a second),
smoke-tested in a child process (a crash there costs nothing), cached in a private directory
and loaded. Anything missing (no compiler, no headers, an unsafe cache directory, a failed
smoke test) is logged and the engine falls back to glibc with a fixed mmap threshold
(:func:`ooc.host.malloc.release_freed_memory`): slower, same results. ``OOC_CPU_ALLOCATOR=0``
in the environment skips it.

An engine installs it at its first step (:func:`acquire`), not when it is made, and gives
PyTorch its own allocator back when it closes or is collected (:func:`relinquish`, once no
other engine holds it). The library stays loaded for the life of the process: tensors it
handed out keep its deleter. Outside engine steps it caches nothing new and otherwise hands
requests to PyTorch's ``alloc_cpu`` unchanged.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_allocator.cpp")
STAT_KEYS = ("cached_bytes", "mapped_bytes", "peak_mapped_bytes", "hits", "misses", "floor_bytes", "enabled",
             "peak_live_bytes", "external_bytes", "idle_external_bytes", "bound_peak_bytes",
             "fresh_bytes", "gathered_bytes", "huge_pages", "block_round_bytes")

_TEMP_PREFIX = "ooc-alloc-"   # a private temporary build directory, removed once loaded
# Reentrant: a pool or an engine collected without close() reports to this module from its
# finalizer, and the garbage collector runs finalizers at any allocation of the thread that
# triggers it, this module's own locked sections included (a plain Lock deadlocked the suite:
# ``external`` -> a tuple -> gc -> a dead pool's ``external(0, 0)`` -> the same lock). Every
# locked section leaves the state whole at each allocation, so a nested call sees it whole.
_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_tried = False
_reason: str | None = None
_holders = 0   # engines that acquired it and have not relinquished it: installed while > 0
NO_CAP = 2**64 - 1   # SIZE_MAX: no cap (the cache's bound is the live peak alone), no total
# id(owner) -> (floor, cap, total) it asked for (``begin``), while its step runs
_active: dict[int, tuple[int, int | None, int | None]] = {}
_pools: dict[int, tuple[int, int]] = {}   # pool -> (used, idle) bytes it last reported

_SMOKE_TEST = """
import ctypes, sys, torch
torch.manual_seed(0)
x = torch.randn(4, 16, 96, 96)
conv = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU())
def run():
    conv.zero_grad(set_to_none=True)
    y = conv(x).square().mean()
    y.backward()
    return y.detach().clone(), conv[0].weight.grad.clone()
ref = run()
lib = ctypes.CDLL(sys.argv[1])
assert lib.ooc_cpu_allocator_install(64) == 1, "not installed"
lib.ooc_cpu_allocator_configure(1, ctypes.c_size_t(64 << 20), ctypes.c_size_t(2**64 - 1), ctypes.c_size_t(2**64 - 1))
for _ in range(3):
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "results differ"
out = (ctypes.c_size_t * 7)()
lib.ooc_cpu_allocator_stats(out, ctypes.c_size_t(7))
assert out[3] > 0, "no block was reused"
lib.ooc_cpu_allocator_configure(0, ctypes.c_size_t(0), ctypes.c_size_t(2**64 - 1), ctypes.c_size_t(2**64 - 1))
"""


def acquire() -> bool:
    """Build (once), load (once) and install the allocator for one more holder; False
    (reason in :func:`unavailable`) if it cannot be used here."""
    global _holders, _reason
    with _lock:
        lib = _loaded_locked()
        if lib is None:
            return False
        if _holders == 0 and lib.ooc_cpu_allocator_install(64) != 1:
            _reason = "another CPU allocator of higher priority is installed"
            log.info("ooc's recycling CPU allocator is not used (%s)", _reason)
            return False
        _holders += 1
        return True


def relinquish() -> None:
    """One holder is done with the allocator (its engine closed): the last one gives PyTorch
    its previous allocator back, after dropping the cache."""
    global _holders
    with _lock:
        if _lib is None or _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            if not _active:
                _lib.ooc_cpu_allocator_release()
            _lib.ooc_cpu_allocator_uninstall(64)


def installed() -> bool:
    """Whether PyTorch's CPU allocator is ooc's now (asked of c10, not of a counter here)."""
    return _lib is not None and bool(_lib.ooc_cpu_allocator_is_installed())


LARGE, ROUND, PAGE = 1 << 20, 2 << 20, mmap.PAGESIZE   # cpu_allocator.cpp's kLarge, kRound, kPage


def block_bytes(nbytes: int, pages: bool = False) -> int:
    """What a tensor of ``nbytes`` takes while this allocator is PyTorch's: from ``LARGE`` on,
    whole blocks, of 2 MiB (transparent huge pages) or, with ``pages``, whole pages (what a
    step under a budget for the whole step maps: :func:`begin` with a cap); a smaller one, its
    bytes (glibc's heap, PyTorch's ``alloc_cpu``). Asked by the engine for its own kind of
    step, not of the allocator's last one: that may be another engine's."""
    if nbytes < LARGE or not installed():
        return nbytes
    unit = PAGE if pages else ROUND
    return -(-nbytes // unit) * unit


def _loaded_locked() -> ctypes.CDLL | None:
    global _lib, _tried, _reason
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("OOC_CPU_ALLOCATOR", "1").strip() in ("0", "false", "off", "no"):
        _reason = "disabled by OOC_CPU_ALLOCATOR=0"
    else:
        try:
            path = _built()
            lib = ctypes.CDLL(str(path))
            if path.parent.name.startswith(_TEMP_PREFIX):   # not cached: leave nothing behind
                shutil.rmtree(path.parent, ignore_errors=True)   # (the mapping stays valid)
            lib.ooc_cpu_allocator_stats.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
            lib.ooc_cpu_allocator_configure.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
            lib.ooc_cpu_allocator_external.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
            lib.ooc_cpu_allocator_lend.restype = ctypes.c_void_p
            lib.ooc_cpu_allocator_lend.argtypes = [ctypes.c_size_t]
            lib.ooc_cpu_allocator_adopt.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.ooc_cpu_allocator_claim.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.ooc_cpu_allocator_owns.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                                   ctypes.POINTER(ctypes.c_ubyte)]
            _lib = lib
        except (_Unavailable, OSError) as e:
            _reason = str(e)
    if _lib is None:
        log.info("ooc's recycling CPU allocator is not used (%s); falling back to glibc with "
                 "a fixed mmap threshold: same results, slower steps", _reason)
    return _lib


def unavailable() -> str | None:
    """Why the allocator is not in use (None if it is, or if nobody asked yet)."""
    return _reason


def begin(owner: object, floor_bytes: int, cap_bytes: int | None = None, total_bytes: int | None = None) -> None:
    """A step of ``owner`` starts: recycle large blocks. The cache may hold ``floor_bytes``
    even where that takes the mapped total above the live peak (the first steps, small models),
    and never more than ``cap_bytes`` (None: no cap) unless this allocator's live and cached
    bytes together stay within ``total_bytes`` (None: the cap always binds). Why a cap: under
    a budget for the whole step the cache has its share of the budget, since the live peak
    this allocator sees is of its own blocks only, and PyTorch's smaller tensors (glibc's) peak
    at other times. Uncapped, a small Llama's cache held 32 MiB of a 78 MiB step budget (its
    share: 9.75 MiB) while glibc held its small weights, gradients and state: process peaks of
    93-107 MiB. Why a total: the budget less what glibc's tensors held at most has room for
    more; capped alone, ResNet-18 b32's cache unmapped what its backward freed and its next
    forward faulted it in again, 1.6 GiB of fresh pages a step (1.43 s a step, 1.15 uncapped)."""
    with _lock:
        _active[id(owner)] = (int(floor_bytes), None if cap_bytes is None else int(cap_bytes),
                              None if total_bytes is None else int(total_bytes))
        _configure_locked()


def end(owner: object) -> None:
    """``owner``'s step is over: when no step runs, stop caching; the cache stays for the next
    step and shrinks as requests between steps use it."""
    with _lock:
        _active.pop(id(owner), None)
        _configure_locked()


def external(used: int, idle: int, source: int = 0) -> None:
    """ooc's device pool ``source`` now holds tensors in ``used`` bytes and has ``idle`` bytes
    of chunks that hold none (the allocator hears the sum over pools: two engines, two pools).
    The used bytes count as live; the idle ones share the bound with the cache, which makes
    room for them."""
    with _lock:
        if used or idle:
            _pools[source] = (used, idle)
        else:
            _pools.pop(source, None)
        if _lib is not None:
            _lib.ooc_cpu_allocator_external(sum(u for u, _ in _pools.values()),
                                            sum(i for _, i in _pools.values()))


def lend(nbytes: int) -> int | None:
    """The address of ``nbytes`` of anonymous memory for a device-pool chunk, from the cache
    where a block holds them (pages already there: no fault, no zeroing), else freshly mapped
    once the cache has made room; None when the allocator is not installed (the pool maps its
    own)."""
    if not lending():
        return None
    return _lib.ooc_cpu_allocator_lend(nbytes) or None


def adopt(address: int, nbytes: int) -> bool:
    """Take a released pool chunk's pages into the cache (False, when the allocator is not
    installed: the pool unmaps them)."""
    return lending() and bool(_lib.ooc_cpu_allocator_adopt(address, nbytes))


def claim(storage: torch.UntypedStorage, move: bool = False) -> int:
    """Have a CPU storage made by PyTorch's default allocator (parameters built before the
    engine) allocate through this one when it is resized, as a swap-in does: otherwise its
    pages come fresh from glibc at every swap-in, beside the cache and unseen by it. ``move``:
    copy the bytes it holds now into a block of this allocator too (their old block is freed
    at once; the caller trims glibc's heap, where a later swap-out would leave them resident).
    0 when the allocator is not installed, or for a storage of another kind (another device, a
    file-backed or custom allocator), which is left as it was; 1 if it allocates here now; 2
    if its bytes were moved."""
    if not lending():
        return 0
    return int(_lib.ooc_cpu_allocator_claim(storage._cdata, int(move)))


def lending() -> bool:
    """Whether pool chunks come from and go back to the cache now (see :func:`lend`)."""
    return _lib is not None and _holders > 0


def release() -> None:
    """Unmap every cached block (an engine closes: no next step to keep them for)."""
    with _lock:
        if _lib is not None and not _active:
            _lib.ooc_cpu_allocator_release()


def stats() -> dict[str, int] | None:
    """Counters of the allocator (``STAT_KEYS``), or None when it is not in use."""
    if _lib is None:
        return None
    out = (ctypes.c_size_t * len(STAT_KEYS))()
    _lib.ooc_cpu_allocator_stats(out, len(STAT_KEYS))
    return dict(zip(STAT_KEYS, (int(v) for v in out)))


def live_bytes() -> int | None:
    """Bytes of the large blocks PyTorch holds from this allocator and of the device pool's
    used chunks, now (``live_bytes`` in cpu_allocator.cpp), or None while it is not PyTorch's
    allocator: how a step kept on demand sees what it holds beside ooc's own counts
    (``ooc.engine.step_budget.on_demand_bound``)."""
    if not installed():
        return None
    st = stats()
    return None if st is None else st["mapped_bytes"] - st["cached_bytes"] + st["external_bytes"]


def owns(pointers: list[int]) -> list[bool]:
    """For each data pointer, whether it starts a live large block of this allocator, whose
    bytes ``live_bytes`` counts (a tensor made before it was installed, or a small one: not)."""
    if _lib is None or not pointers:
        return [False] * len(pointers)
    n = len(pointers)
    out = (ctypes.c_ubyte * n)()
    _lib.ooc_cpu_allocator_owns((ctypes.c_void_p * n)(*pointers), n, out)
    return [bool(b) for b in out]


def _configure_locked() -> None:
    if _lib is not None:
        floor, cap, total = 0, NO_CAP, NO_CAP
        for f, c, t in _active.values():   # (no comprehension: a Python call in every step)
            floor = max(floor, f)
            cap = cap if c is None else min(cap, c)
            total = total if t is None else min(total, t)
        _lib.ooc_cpu_allocator_configure(int(bool(_active)), floor, cap, total)


class _Unavailable(Exception):
    pass


def _built() -> Path:
    """The compiled library for this torch and this source, building it if needed."""
    torch_dir = Path(torch.__file__).resolve().parent
    include, libdir = torch_dir / "include", torch_dir / "lib"
    if not (include / "c10" / "core" / "CPUAllocator.h").is_file():
        raise _Unavailable(f"this torch ({torch.__version__}) ships no C++ headers in {include}")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise _Unavailable("no C++ compiler (c++, g++ or $CXX) on PATH")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), str(torch_dir).encode(),
                                     cxx.encode(), str(abi).encode(), sys.platform.encode()])).hexdigest()[:16]
    directory = _cache_dir()
    target = directory / f"cpu_allocator-{key}.so"
    if target.exists():
        _check_private(target)
        return target
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{include}", str(SOURCE), f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}", "-o", str(tmp)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise _Unavailable(f"{cxx} failed to build {SOURCE.name}: {_last_line(done.stderr)}")
        smoke = subprocess.run([sys.executable, "-c", _SMOKE_TEST, str(tmp)], capture_output=True,
                               text=True, timeout=300)
        if smoke.returncode != 0:
            raise _Unavailable(f"the built allocator failed its smoke test "
                               f"(exit {smoke.returncode}): {_last_line(smoke.stderr)}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
        log.info("built ooc's CPU allocator in %.1fs: %s", time.perf_counter() - t0, target)
    except subprocess.TimeoutExpired as e:
        raise _Unavailable(f"building or testing the allocator took over {e.timeout:.0f}s") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ooc`` (or ``~/.cache/ooc``) if it is ours and private, else a fresh
    private temporary directory: a library loaded into the process must not be writable by
    anyone else. The temporary directory is removed as soon as the library is loaded."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ooc"
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(base)
        return base
    except (OSError, _Unavailable) as e:
        log.info("not caching the CPU allocator in %s (%s)", base, e)
        return Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))


def _check_private(path: Path) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise _Unavailable(f"{path} is a link, not owned by this user, or writable by others")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"
