"""Host chunks as anonymous pages that move between addresses (``mremap``), not a file.

Why a second host backend: a memfd chunk's pages belong to the file, so they can only go
back to the kernel (a hole punched) and the next chunk faults fresh, zeroed pages in, 4 KiB at
a time where shared memory gets no transparent huge pages. On a CPU the device pool sits
beside PyTorch's own allocator (``ooc.host.cpu_allocator``), and both recycle memory
under one bound: with a file the pool's freed pages could never serve a tensor, nor a freed
tensor's pages a chunk, so memory churned between them (ResNet-50 batch 8 at 1/4 of its
peak: ~70 fresh blocks and ~44k page faults per step, ``clear_page_erms`` 9-12% of samples).
Anonymous pages can change hands: ``lend`` gives a new chunk pages the caller already has
(populated, huge pages kept where they were), and ``adopt`` takes a released chunk's pages
back instead of unmapping them.

How it maps onto system calls:

- a **chunk** is anonymous memory at its *home* address (the handle): from ``lend(nbytes)``
  or a fresh ``mmap(MAP_PRIVATE | MAP_ANONYMOUS)`` (``MADV_HUGEPAGE``).
- **mapping** chunk h at address a is ``mremap(h, n, n, MREMAP_MAYMOVE | MREMAP_FIXED |
  MREMAP_DONTUNMAP, a)``: its pages move into the reservation (no copy, no fault), and a
  ``PROT_NONE`` placeholder keeps the home address reserved, so the pages have somewhere to
  return to.
- **unmapping** moves each chunk's pages home again the same way and puts ``PROT_NONE``
  reservation back over the span.
- **releasing** a chunk hands its pages to ``adopt(home, nbytes)``; where that declines
  (returns False) or is absent, ``munmap``.

Why ``MREMAP_DONTUNMAP`` (Linux 5.7): a plain move leaves a hole where the pages were, and the
placeholder (``mmap(MAP_FIXED)``) comes one system call later. Any other thread's ``mmap`` in
between may be given that hole, and ``MAP_FIXED`` then replaces its memory without a word:
an I/O thread's bounce page (``mmap.mmap(-1, 4096)``) landed in a chunk's home that way, and
its transfers failed with EFAULT or wrote a tensor's tail into the pool's pages (op_db's
every sample under the engine, seen with a probe that looked at the hole before the
placeholder: ``tests/vmm/test_anon_host.py``). With ``MREMAP_DONTUNMAP`` the source stays
mapped (empty) until the placeholder replaces it: there is never a hole. A kernel without it
refuses the backend (``VMMError``); the CPU pool then uses :class:`vmm.HostBackend`.

The contract's one difference from :class:`vmm.HostBackend`: pages are in one place, so a
chunk is mapped at most once at a time (a second map raises ``ContractError``; the CUDA
driver allows several, and no ooc allocator needs them). Ranges whose size is a multiple of
2 MiB are reserved 2 MiB-aligned, so a chunk of whole huge pages stays huge where it moves.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Any, Callable, Sequence

from vmm.backend import ContractError, Ledger
from vmm.errors import VMMError
from vmm.host import (MAP_ANONYMOUS, MAP_PRIVATE, PROT_READ, PROT_WRITE, HostRanges, _call_error,
                      _libc, _Libc, _mmap_checked)

__all__ = ["AnonHostBackend"]

MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 0x1, 0x2, 0x4
_MOVE = MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


class _Mremap:
    """mremap and madvise, typed, errno captured (mremap is variadic in C; its fifth
    argument, the new address, is passed as the integer the kernel reads)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)
        self.mremap = lib.mremap
        self.mremap.restype = ctypes.c_void_p
        self.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                ctypes.c_int, ctypes.c_void_p]
        self.madvise = lib.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class AnonHostBackend(HostRanges):
    """Anonymous chunks moved into reserved ranges with ``mremap`` (see the module docstring).

    Args:
        lend: ``lend(nbytes)`` -> the address of ``nbytes`` of anonymous memory the caller
            gives up, or None (then a fresh mmap).
        adopt: ``adopt(address, nbytes)`` -> True if the caller took a released chunk's
            pages (it unmaps them when it likes), False to have them unmapped now.

    ``physical_bytes()`` is the bytes of chunks that exist (a fresh chunk's untouched pages
    included: an upper bound).
    """

    name = "anonymous host"

    def __init__(self, lend: Callable[[int], int | None] | None = None,
                 adopt: Callable[[int, int], bool] | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise VMMError(f"the anonymous host backend needs Linux (mremap); this is "
                           f"{sys.platform}: use SimBackend to plan without real memory")
        self._libc = _libc()
        self._sys = _Mremap()
        if not _moves_without_a_hole(self._libc, self._sys, self.granularity):
            raise VMMError("the anonymous host backend needs mremap(MREMAP_DONTUNMAP) (Linux "
                           "5.7 or later): without it another thread's mmap can land in the "
                           "hole a move leaves; use vmm.HostBackend")
        self._lend, self._adopt = lend, adopt
        self.ledger = Ledger(self.granularity, "anonymous host")
        self.file_kind = "anonymous"
        self.calls: dict[str, int] = dict.fromkeys(
            ("create_chunk", "release_chunk", "reserve_range", "free_range", "map", "mremap",
             "set_access", "unmap", "lent", "adopted"), 0)
        self._closed = False
        self._finalizer = weakref.finalize(self, _teardown, self._libc, self.ledger)

    # -- chunks ------------------------------------------------------------------------
    def create_chunk(self, nbytes: int) -> int:
        self._check_open()
        self.calls["create_chunk"] += 1
        self.ledger.check_size("create_chunk", nbytes)
        home = self._lend(nbytes) if self._lend is not None else None
        if home:
            self.calls["lent"] += 1
        else:
            home = _mmap_checked(self._libc, None, nbytes, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            self._sys.madvise(home, nbytes, MADV_HUGEPAGE)   # fewer faults; harmless if off
        self.ledger.add_chunk(home, nbytes)
        return home

    def release_chunk(self, handle: Any) -> None:
        self.calls["release_chunk"] += 1
        nbytes = self.ledger.remove_chunk(handle)   # refuses a chunk still mapped
        if self._adopt is not None and self._adopt(handle, nbytes):
            self.calls["adopted"] += 1
        elif self._libc.munmap(handle, nbytes) != 0:
            raise _call_error(f"munmap(0x{handle:x}, {nbytes})", ctypes.get_errno())

    def physical_bytes(self) -> int:
        return sum(self.ledger.chunks.values())

    # -- address ranges ----------------------------------------------------------------
    def reserve_range(self, nbytes: int, alignment: int = 0) -> int:
        if nbytes % HUGE_PAGE == 0:   # whole huge pages stay huge where they move
            alignment = max(alignment, HUGE_PAGE)
        return super().reserve_range(nbytes, alignment)

    # -- mappings ----------------------------------------------------------------------
    def _move(self, src: int, nbytes: int, dst: int) -> None:
        self.calls["mremap"] += 1
        # DONTUNMAP: ``src`` stays mapped (empty) for the placeholder that replaces it next;
        # a hole there could be handed to another thread's mmap in between (module docstring).
        got = self._sys.mremap(src, nbytes, nbytes, _MOVE, dst)
        if got != dst:
            raise _call_error(f"mremap(0x{src:x}, {nbytes}, {nbytes}, MAYMOVE|FIXED|DONTUNMAP, "
                              f"0x{dst:x})", ctypes.get_errno())

    def map(self, address: int, handle: Any, nbytes: int) -> None:
        self.map_many(address, (handle,), nbytes)

    def map_many(self, address: int, handles: Sequence[Any], chunk_bytes: int) -> None:
        self._check_open()
        ledger = self.ledger
        for h in handles:
            if ledger.mapcount(h):
                raise ContractError(f"anonymous host backend: chunk 0x{h:x} is already mapped; "
                                    "its pages are in one place at a time")
        self.calls["map"] += len(handles)
        ledger.add_mappings(address, handles, chunk_bytes)  # checks before any syscall
        done = 0
        try:
            for i, h in enumerate(handles):
                self._move(h, chunk_bytes, address + i * chunk_bytes)
                done += 1
                self._protect_none(h, chunk_bytes)   # home stays reserved for the way back
        except BaseException:
            # Put what moved back home and the reservation back the way it was.
            for i in range(done):
                self._move(address + i * chunk_bytes, chunk_bytes, handles[i])
            ledger.remove_mappings(address, len(handles) * chunk_bytes)
            if done:
                self._protect_none(address, done * chunk_bytes)
            raise

    def unmap(self, address: int, nbytes: int, fence: Any = None) -> None:
        self._check_open()
        self.calls["unmap"] += 1
        for start, (end, handle) in self.ledger.remove_mappings(address, nbytes):
            self._move(start, end - start, handle)
        self._protect_none(address, nbytes)

    # -- lifetime (close: HostRanges.close, which runs _teardown below) ----------------
    def __repr__(self) -> str:
        return (f"<AnonHostBackend chunks={len(self.ledger.chunks)} "
                f"ranges={len(self.ledger.ranges())} page={self.granularity}>")


_DONTUNMAP: bool | None = None   # whether the kernel takes MREMAP_DONTUNMAP: asked once


def _moves_without_a_hole(libc: _Libc, sys_: _Mremap, page: int) -> bool:
    """Whether this kernel moves anonymous pages with ``MREMAP_DONTUNMAP`` (one ``page`` tried,
    both mappings unmapped again)."""
    global _DONTUNMAP
    if _DONTUNMAP is None:
        src = _mmap_checked(libc, None, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        dst = _mmap_checked(libc, None, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        try:
            _DONTUNMAP = sys_.mremap(src, page, page, _MOVE, dst) == dst
        finally:
            libc.munmap(src, page)
            libc.munmap(dst, page)
    return _DONTUNMAP


def _teardown(libc: _Libc, ledger: Ledger) -> None:
    for home, nbytes in ledger.chunks.items():
        libc.munmap(home, nbytes)   # its pages, or the placeholder while they are in a range
    for address, nbytes in ledger.ranges():
        libc.munmap(address, nbytes)   # the ranges and the pages mapped in them
    ledger.__init__(ledger.granularity, "anonymous host (closed)")
