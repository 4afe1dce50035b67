"""The swap file itself: one unlinked 0600 file, an optional O_DIRECT descriptor on it, and
full-length positioned transfers (loops over short reads and writes).

Why two descriptors: O_DIRECT bypasses the page cache, so the cost the planner measures is
the device's and the swapped bytes do not linger in RAM; but it needs 4096-aligned offsets,
lengths and buffer addresses. Offsets and lengths are ours to align (the extent allocator
rounds to 4096); buffer addresses are the caller's: pages of the runtime's pool are aligned,
tensors from torch's CPU allocator (64-byte aligned) usually are not. So aligned transfers use
a second open file description with O_DIRECT (opened through /proc/self/fd/N, the only way to
reopen an O_TMPFILE file; fcntl(F_SETFL) would flip the flag for both), and the rest use the
buffered descriptor followed by sync_file_range + POSIX_FADV_DONTNEED on the range: DONTNEED
drops only clean pages, so the range must be written back first. Both descriptors see the same
bytes: the kernel writes cached pages back before an O_DIRECT read of them and invalidates them
after an O_DIRECT write.

Measured here (benchmarks/results/storage.md, ext4 on a virtio disk, 2 cores):

* O_DIRECT costs about 4x less CPU per GB than buffered+write-back+DONTNEED (about 0.05-0.1
  vs 0.3-0.4 CPU s/GB): the buffered path copies every byte through the page cache, and on
  2 cores that CPU is taken from compute. In wall time the two are close on this shared,
  noisy machine, buffered often ahead (write-back merges writes and runs ahead of the
  caller). Hence the default: O_DIRECT for page-aligned buffers (the runtime's pool),
  buffered only where alignment forbids O_DIRECT; ``FileTier(direct=False)`` for a run
  that is I/O-bound with idle CPU.
* For the buffered write-back, sync_file_range (waits for this range only) is 2.5-4x faster
  than fdatasync (which also flushes metadata and every other dirty range of the file).
* A bounce buffer (memcpy into an aligned page, then O_DIRECT) for unaligned sources measured
  slower than the buffered path (1.1 vs 3.7 GB/s in a quiet moment) and is not used.

``os.preadv``/``os.pwritev`` release the GIL, which is what lets the tier's I/O threads
overlap with compute.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Callable

__all__ = ["ALIGN", "Fault", "ShortTransfer", "SwapFile", "buffer_address"]

ALIGN = 4096
# Test hook: fault(op, key, offset, length) -> None (no fault) | int (pretend the call moved
# only that many bytes) ; raising OSError simulates the call failing. ops: "pwrite", "pread",
# "sync", "open_tmpfile", "open_direct", "reserve" (allocating file space ahead: offset, length).
Fault = Callable[[str, int, int, int], "int | None"]

_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class ShortTransfer(OSError):
    """A read hit the end of the file, or a call kept moving no bytes."""


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer (read-only ones too)."""
    import numpy as np  # numpy gives the address of read-only buffers, ctypes does not

    if view.nbytes == 0:
        return 0
    arr = np.frombuffer(view, dtype=np.uint8)
    try:
        return arr.ctypes.data
    finally:
        del arr  # drop the export at once, so the view can be released


class SwapFile:
    """One unlinked file in ``dir_fd``; ``direct_fd`` is None when O_DIRECT is unavailable."""

    def __init__(self, dir_fd: int, dir_path: str, *, direct: bool | None,
                 fault: Fault | None = None) -> None:
        self.dir_path = dir_path
        self.fault = fault
        self.tmpfile = True
        self.fd = self._open_unlinked(dir_fd)
        self.direct_fd: int | None = None
        self.direct_error: str | None = None  # why O_DIRECT is off, for stats and errors
        if direct is False:
            self.direct_error = "disabled (direct=False)"
        else:
            self.direct_fd, self.direct_error = self._open_direct()
        # one zero-filled page per thread for the unaligned tail of an O_DIRECT transfer
        self._bounce: dict[int, mmap.mmap] = {}

    # -- opening ---------------------------------------------------------------------------

    def _open_unlinked(self, dir_fd: int) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            self._hook("open_tmpfile", -1, 0, 0)
            # The file has no name from birth: nothing to clean up after a SIGKILL.
            return os.open(".", flags | os.O_TMPFILE, 0o600, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
        # No O_TMPFILE on this file system: create with a fixed name, unlink at once.
        self.tmpfile = False
        from ooc.storage.private_dir import FALLBACK_NAME

        fd = os.open(FALLBACK_NAME, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=dir_fd)
        os.unlink(FALLBACK_NAME, dir_fd=dir_fd)
        return fd

    def _open_direct(self) -> tuple[int | None, str | None]:
        """Reopen the file with O_DIRECT and prove a 4096-byte write works (some file systems
        accept the flag at open and fail at the first transfer, tmpfs before Linux 6.6 fails
        the open with EINVAL)."""
        if not hasattr(os, "O_DIRECT"):
            return None, "O_DIRECT is not available on this platform"
        try:
            self._hook("open_direct", -1, 0, ALIGN)
            dfd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            return None, f"O_DIRECT open failed: {e.strerror or e}"
        page = mmap.mmap(-1, ALIGN)
        try:
            if os.pwritev(dfd, [page], 0) != ALIGN or os.preadv(dfd, [page], 0) != ALIGN:
                raise OSError(errno.EIO, "short probe transfer")
        except OSError as e:
            os.close(dfd)
            return None, f"O_DIRECT transfer failed: {e.strerror or e}"
        finally:
            page.close()
            os.ftruncate(self.fd, 0)
        return dfd, None

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.direct_fd = None
        self.fd = -1
        for page in self._bounce.values():
            page.close()
        self._bounce.clear()

    # -- transfers -------------------------------------------------------------------------

    def _hook(self, op: str, key: int, offset: int, length: int) -> int | None:
        return None if self.fault is None else self.fault(op, key, offset, length)

    def bounce_page(self, thread_id: int) -> mmap.mmap:
        page = self._bounce.get(thread_id)
        if page is None:
            page = self._bounce[thread_id] = mmap.mmap(-1, ALIGN)
        return page

    def transfer(self, op: str, key: int, direct: bool, view: memoryview, offset: int) -> None:
        """Move all of ``view`` to (pwrite) or from (pread) the file at ``offset``.

        Loops over short transfers; a read that returns 0 bytes before the end, or a call that
        keeps moving nothing, raises :class:`ShortTransfer`. With ``direct`` the view's address,
        its length and ``offset`` must be multiples of 4096.
        """
        fd = self.direct_fd if direct else self.fd
        call = os.pwritev if op == "pwrite" else os.preadv
        done, total, stalls = 0, len(view), 0
        while done < total:
            want = total - done
            limit = self._hook(op, key, offset + done, want)
            if limit is not None and limit <= 0:
                got = 0
            else:
                got = call(fd, [view[done:]], offset + done)
                if limit is not None:
                    got = min(got, limit)  # simulated short transfer
            if got == 0:
                if op == "pread":
                    raise ShortTransfer(
                        errno.EIO, f"unexpected end of file at offset {offset + done} "
                        f"({total - done} of {total} bytes still to read)")
                stalls += 1
                if stalls >= 3:
                    raise ShortTransfer(
                        errno.EIO, f"write made no progress at offset {offset + done} "
                        f"({total - done} of {total} bytes still to write)")
                continue
            before = done
            done += got
            if direct and done % ALIGN and done < total:
                # O_DIRECT needs the next call aligned too: redo the partial page (rewriting
                # or rereading the same bytes is harmless).
                done -= done % ALIGN
            if done == before:
                stalls += 1
                if stalls >= 3:
                    raise ShortTransfer(
                        errno.EIO, f"{op} kept returning less than one page at offset "
                        f"{offset + done}")
            else:
                stalls = 0

    def reserve(self, offset: int, length: int) -> bool:
        """Allocate ``[offset, offset + length)`` of the file on the file system now, so that
        writes there later cannot fail for want of space. ENOSPC raises; a file system that
        cannot preallocate returns False (its writes may still fail for space later)."""
        self._hook("reserve", -1, offset, length)
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return False
            raise
        return True

    def start_writeback(self, key: int, offset: int, length: int) -> None:
        """Begin writing a buffered range back, without waiting (pipelines with the next copy)."""
        if _sync_file_range is not None:
            self._sync(key, offset, length, _SYNC_WRITE)

    def drop_cache(self, key: int, offset: int, length: int, *, dirty: bool) -> None:
        """Make the buffered range leave the page cache: write it back first if ``dirty``
        (DONTNEED skips dirty pages), then drop it."""
        if dirty:
            if _sync_file_range is not None:
                self._sync(key, offset, length, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
            else:
                self._hook("sync", key, offset, length)
                os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def fdatasync_range(self, key: int, offset: int, length: int) -> None:
        """The slower alternative to sync_file_range, kept for the benchmark's comparison."""
        self._hook("sync", key, offset, length)
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _sync(self, key: int, offset: int, length: int, flags: int) -> None:
        self._hook("sync", key, offset, length)
        if _sync_file_range(self.fd, offset, length, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")
