"""Real virtual addressing on the host (Linux): chunks in one memfd, ranges from mmap.

How the pieces map onto system calls (all through ctypes on libc, ``use_errno=True``;
every return value is checked and a failure raises
:class:`vmm.backend.BackendCallError` naming the call, its arguments and ``errno``):

- **chunks** live in one file: ``memfd_create`` (or, where that is missing, an unlinked
  temp file created 0600 in a private 0700 directory that is removed at once). Creating a
  chunk grows the file with ``ftruncate``; pages are only allocated when first touched.
  Chunk j of size c is the byte span ``[j*c, (j+1)*c)`` of the file; its handle is that
  file offset. Releasing a chunk punches a hole
  (``fallocate(PUNCH_HOLE | KEEP_SIZE)``), so its pages go back to the kernel at once,
  and the slot is reused by the next chunk of the same size.
- **address ranges** are ``mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS |
  MAP_NORESERVE)``: address space only, no memory, no swap reservation.
- **mapping** chunk j at address a is ``mmap(a, c, PROT_READ | PROT_WRITE, MAP_SHARED |
  MAP_FIXED, fd, j*c)``: the kernel replaces that part of the reservation with a window
  onto the file. The same chunk can be mapped at several addresses; all see the same bytes.
  Consecutive chunks that are also consecutive in the file are mapped with one call.
- **unmapping** maps ``PROT_NONE`` anonymous memory over the span again (``MAP_FIXED``),
  so the reservation stays and nothing else can land in the hole.

Granularity is the page size (4096 here), so chunk sizes such as 2 MiB are multiples,
and every address this backend hands out is page-aligned (what ``O_DIRECT`` needs).
Linux only (the flag values below are the generic Linux ones, as on x86-64 and arm64).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import logging
import mmap as _mmap
import os
import sys
import tempfile
import weakref
from typing import Any, Sequence

from vmm.backend import Backend, BackendCallError, ContractError, DeviceOutOfMemory, Ledger
from vmm.errors import VMMError
from vmm.units import format_size

log = logging.getLogger(__name__)

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value
_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


def _errname(err: int) -> str:
    return f"{_errno.errorcode.get(err, 'errno')} ({err}): {os.strerror(err)}"


class _Libc:
    """The libc calls we need (mmap, munmap, fallocate), typed, with errno captured."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        self.munmap = lib.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.fallocate = lib.fallocate
        self.fallocate.restype = ctypes.c_int
        self.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


_LIBC: _Libc | None = None


def _libc() -> _Libc:
    global _LIBC
    if _LIBC is None:
        _LIBC = _Libc()
    return _LIBC


def _call_error(call: str, err: int) -> BackendCallError:
    cls = DeviceOutOfMemory if err in (_errno.ENOMEM, _errno.ENOSPC) else BackendCallError
    return cls(f"host backend: {call} failed with {_errname(err)}")


_PROT_NAMES = {PROT_NONE: "PROT_NONE", PROT_READ | PROT_WRITE: "PROT_READ|PROT_WRITE"}
_FLAG_NAMES = ((MAP_SHARED, "MAP_SHARED"), (MAP_PRIVATE, "MAP_PRIVATE"), (MAP_FIXED, "MAP_FIXED"),
               (MAP_ANONYMOUS, "MAP_ANONYMOUS"), (MAP_NORESERVE, "MAP_NORESERVE"))


def _mmap_error(result: int | None, err: int, addr: int | None, length: int, prot: int,
                flags: int, fd: int, offset: int) -> BackendCallError:
    """The error for a failed mmap call, naming it (built only on failure)."""
    where = "NULL" if addr is None else f"0x{addr:x}"
    names = "|".join(n for bit, n in _FLAG_NAMES if flags & bit)
    call = (f"mmap({where}, {length}, {_PROT_NAMES.get(prot, prot)}, {names}, "
            f"{'memfd' if fd >= 0 else -1}, {offset})")
    if result is None or result == _MAP_FAILED:
        return _call_error(call, err)
    return BackendCallError(f"host backend: {call} returned 0x{result:x}, not the fixed address")


def _mmap_checked(libc: _Libc, addr: int | None, length: int, prot: int, flags: int,
                  fd: int, offset: int) -> int:
    result = libc.mmap(addr, length, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED or (flags & MAP_FIXED and result != addr):
        raise _mmap_error(result, ctypes.get_errno(), addr, length, prot, flags, fd, offset)
    return result


def _munmap_checked(libc: _Libc, addr: int, length: int) -> None:
    if libc.munmap(addr, length) != 0:
        raise _call_error(f"munmap(0x{addr:x}, {length})", ctypes.get_errno())


class HostRanges(Backend):
    """What both host backends share: address ranges reserved with ``mmap(PROT_NONE)``,
    buffers over mapped spans, the libc calls. Subclasses say where chunks live
    (:class:`HostBackend`: a memfd; :class:`vmm.anon_host.AnonHostBackend`: anonymous pages
    moved with ``mremap``) and set ``ledger`` and ``calls``."""

    granularity = _mmap.PAGESIZE
    alignment = _mmap.PAGESIZE
    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise VMMError(f"{self.name} backend: used after close()")

    # -- address ranges ----------------------------------------------------------------
    def reserve_range(self, nbytes: int, alignment: int = 0) -> int:
        self._check_open()
        self.calls["reserve_range"] += 1
        self.ledger.check_size("reserve_range", nbytes)
        align = max(alignment, self.granularity)
        if align & (align - 1):
            raise ContractError(f"host backend: alignment {alignment} is not a power of two")
        libc = self._libc
        if align == self.granularity:
            address = _mmap_checked(libc, None, nbytes, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        else:
            # Over-reserve, then give back the unaligned head and the tail.
            total = nbytes + align
            raw = _mmap_checked(libc, None, total, PROT_NONE, _RESERVE_FLAGS, -1, 0)
            address = -(-raw // align) * align
            if address > raw:
                _munmap_checked(libc, raw, address - raw)
            tail = raw + total - (address + nbytes)
            if tail:
                _munmap_checked(libc, address + nbytes, tail)
        self.ledger.add_range(address, nbytes)
        return address

    def free_range(self, address: int, nbytes: int) -> None:
        self.calls["free_range"] += 1
        self.ledger.remove_range(address, nbytes)
        _munmap_checked(self._libc, address, nbytes)

    def _protect_none(self, address: int, nbytes: int) -> None:
        _mmap_checked(self._libc, address, nbytes, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED, -1, 0)

    def buffer(self, address: int, nbytes: int) -> ctypes.Array:
        """A writable ctypes ``c_char`` array over a mapped span (zero-copy).

        It supports the buffer protocol (``memoryview``, ``numpy.frombuffer``,
        ``torch.frombuffer``) and weak references. It does not keep the mapping alive:
        use :meth:`vmm.Allocation.buffer`, which ties the two together.
        """
        if not self.ledger.is_mapped(address, nbytes):
            raise ContractError(f"host backend: buffer over [0x{address:x}, +{nbytes}) "
                                "which is not fully mapped")
        return (ctypes.c_char * nbytes).from_address(address)

    def close(self) -> None:
        """Give everything back: the subclass's finalizer (``_finalizer``, which also runs
        when the backend is collected) unmaps its chunks and ranges; later use raises."""
        self._closed = True
        if self._finalizer.alive:
            self._finalizer()


class HostBackend(HostRanges):
    """Chunks of one memfd file mapped with ``MAP_FIXED`` into reserved address ranges.

    Args:
        use_memfd: use ``memfd_create`` (default). ``False`` forces the fallback, an
            unlinked 0600 temp file in a private directory (tested, and used automatically
            where ``memfd_create`` is missing).
        directory: where the fallback file goes (default: the system temp directory).

    ``physical_bytes()`` reports the memory the file really holds (allocated pages).
    Everything is given back by :meth:`close`, or when the backend is garbage collected.
    Do not close a backend while anything still uses a buffer over its memory: the
    allocators keep their backend alive while an allocation or one of its buffers is, and
    refuse to free an allocation whose buffer is still referenced.
    """

    name = "host"

    def __init__(self, *, use_memfd: bool = True, directory: str | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise VMMError(f"the host backend needs Linux (memfd + mmap MAP_FIXED); this is "
                           f"{sys.platform}: use SimBackend to plan without real memory")
        self._libc = _libc()
        self.ledger = Ledger(self.granularity, "host")
        self.file_kind = "memfd"
        self._fd = self._open_file(use_memfd, directory)
        self.file_bytes = 0
        self._free_slots: dict[int, list[int]] = {}
        self._punch_ok = True
        self.calls: dict[str, int] = dict.fromkeys(
            ("create_chunk", "release_chunk", "reserve_range", "free_range", "map",
             "mmap", "set_access", "unmap"), 0)
        self._mmap = self._libc.mmap  # bound once: the per-chunk hot path
        self._closed = False
        self._finalizer = weakref.finalize(self, _teardown, self._libc, self.ledger, self._fd)

    def _open_file(self, use_memfd: bool, directory: str | None) -> int:
        if use_memfd and hasattr(os, "memfd_create"):
            try:
                return os.memfd_create("ooc-vmm-chunks", os.MFD_CLOEXEC)
            except OSError as exc:  # ENOSYS on old kernels or sandboxes
                log.info("memfd_create failed (%s); falling back to an unlinked temp file", exc)
        self.file_kind = "tempfile"
        private = tempfile.mkdtemp(prefix="ooc-vmm-", dir=directory)  # created 0700
        path = os.path.join(private, "chunks")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            os.rmdir(private)
            raise _call_error(f"open({path!r}, O_CREAT|O_EXCL, 0600)", exc.errno) from exc
        os.unlink(path)
        os.rmdir(private)
        return fd

    # -- chunks ------------------------------------------------------------------------
    def create_chunk(self, nbytes: int) -> int:
        self._check_open()
        self.calls["create_chunk"] += 1
        self.ledger.check_size("create_chunk", nbytes)
        slots = self._free_slots.get(nbytes)
        if slots:
            offset = slots.pop()
        else:
            offset = self.file_bytes
            try:
                os.ftruncate(self._fd, offset + nbytes)
            except OSError as exc:
                raise _call_error(f"ftruncate(fd, {offset + nbytes})", exc.errno) from exc
            self.file_bytes = offset + nbytes
        self.ledger.add_chunk(offset, nbytes)
        return offset

    def release_chunk(self, handle: Any) -> None:
        self.calls["release_chunk"] += 1
        nbytes = self.ledger.remove_chunk(handle)
        self._punch(handle, nbytes)
        self._free_slots.setdefault(nbytes, []).append(handle)

    def _punch(self, offset: int, nbytes: int) -> None:
        """Give the chunk's pages back to the kernel now (the file keeps its size)."""
        if not self._punch_ok:
            return
        if self._libc.fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                offset, nbytes) != 0:
            err = ctypes.get_errno()
            if err in (_errno.EOPNOTSUPP, _errno.ENOSYS):
                # A file system without hole punching: pages stay until close; say so once.
                self._punch_ok = False
                log.warning("host backend: fallocate(PUNCH_HOLE) unsupported here (%s); "
                            "released chunks keep their pages until the backend closes",
                            _errname(err))
                return
            raise _call_error(f"fallocate(fd, PUNCH_HOLE|KEEP_SIZE, {offset}, {nbytes})", err)

    def physical_bytes(self) -> int:
        """Bytes of memory the chunk file holds now (pages touched and not punched out)."""
        return os.fstat(self._fd).st_blocks * 512

    # -- mappings ----------------------------------------------------------------------
    def map(self, address: int, handle: Any, nbytes: int) -> None:
        # One chunk, one mmap: the per-chunk path, kept free of the batching logic.
        if self._closed:
            raise VMMError("host backend: used after close()")
        calls = self.calls
        calls["map"] += 1
        calls["mmap"] += 1
        self.ledger.add_mappings(address, (handle,), nbytes)  # checks before the syscall
        result = self._mmap(address, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                            self._fd, handle)
        if result != address:
            err = ctypes.get_errno()
            self.ledger.remove_mappings(address, nbytes)
            raise _mmap_error(result, err, address, nbytes, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_FIXED, self._fd, handle)

    def map_many(self, address: int, handles: Sequence[Any], chunk_bytes: int) -> None:
        self._check_open()
        self.calls["map"] += len(handles)
        self.ledger.add_mappings(address, handles, chunk_bytes)  # checks before any syscall
        libc, fd, n = self._libc, self._fd, len(handles)
        i = 0
        try:
            while i < n:
                # One mmap per run of chunks that are consecutive in the file too.
                j = i + 1
                while j < n and handles[j] == handles[j - 1] + chunk_bytes:
                    j += 1
                at, length = address + i * chunk_bytes, (j - i) * chunk_bytes
                self.calls["mmap"] += 1
                _mmap_checked(libc, at, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                              fd, handles[i])
                i = j
        except BackendCallError:
            # Put the reservation back the way it was before re-raising.
            self.ledger.remove_mappings(address, n * chunk_bytes)
            if i:
                self._protect_none(address, i * chunk_bytes)
            raise

    def unmap(self, address: int, nbytes: int, fence: Any = None) -> None:
        self.calls["unmap"] += 1
        self.ledger.remove_mappings(address, nbytes)
        result = self._mmap(address, nbytes, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED, -1, 0)
        if result != address:
            raise _mmap_error(result, ctypes.get_errno(), address, nbytes, PROT_NONE,
                              _RESERVE_FLAGS | MAP_FIXED, -1, 0)

    # -- lifetime ----------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"<HostBackend {self.file_kind} file={format_size(self.file_bytes)} "
                f"ranges={len(self.ledger.ranges())} page={self.granularity}>")


def _teardown(libc: _Libc, ledger: Ledger, fd: int) -> None:
    for address, nbytes in ledger.ranges():
        libc.munmap(address, nbytes)  # removes the mappings inside it as well
    os.close(fd)
    ledger.__init__(ledger.granularity, "host (closed)")
