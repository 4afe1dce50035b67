"""How one key's bytes move between the caller's buffer and their pieces of the swap file, on
an I/O thread of :class:`~ooc.storage.FileTier`.

Each piece is moved in steps that never cross a ``chunk_bytes`` boundary of the key, so that
each step feeds one CRC-32 (``verify=True``). Aligned buffers go through O_DIRECT, the last
partial page through a bounce page of the thread's own; other buffers are written buffered
and their pages written back and dropped from the page cache before the transfer counts as
done, so that neither the page cache nor a dirty backlog hides the cost. Apart from the tier,
whose part is the bookkeeping under its lock (records, extents, counters, the thread pool).
"""

from __future__ import annotations

import threading
import time
import traceback
import zlib
from typing import Any, Callable

from ooc.errors import StorageError
from ooc.storage.swapfile import ALIGN, SwapFile

__all__ = ["TransferTasks", "transfer_key", "forget_buffers"]

#: The tier's bookkeeping of a finished task: (record, "write"/"read", bytes, seconds, ok, direct).
Done = Callable[[Any, str, int, float, bool, bool], None]
#: The tier's wording of a failed one: (op, key, bytes, the OSError) -> the StorageError to raise.
Worded = Callable[[str, int, int, OSError], StorageError]


class TransferTasks:
    """The tasks :class:`~ooc.storage.FileTier` submits to its I/O threads: one write or read
    of a key, timed, its errors turned into :class:`~ooc.errors.StorageError`, the caller's
    views released before the future resolves. A part the tier holds: it knows the file and
    how to flush. Each task gets the tier's bookkeeping (``done``, which takes the tier's lock)
    and error wording (``error``) with its arguments, not at construction: holding them would
    tie the tier to itself in a cycle, and its finalizer (descriptors closed, directory
    removed) must run as soon as the last reference goes."""

    def __init__(self, file: SwapFile, chunk_bytes: int, flush: str) -> None:
        self._file, self.chunk_bytes, self._flush = file, chunk_bytes, flush

    def write(self, key: int, rec: Any, base: memoryview, view: memoryview, direct: bool,
              done: Done, error: Worded) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            transfer_key(self._file, "pwrite", key, rec, view, direct, self.chunk_bytes,
                         self._flush)
            ok = True
        except OSError as e:
            forget_buffers(e)
            raise error("write", key, rec.nbytes, e) from e
        finally:
            # Release our views of the caller's buffer before the future resolves, so the
            # caller may free or resize it the moment it sees the result.
            view.release()
            base.release()
            done(rec, "write", rec.nbytes, time.perf_counter() - t0, ok, direct)

    def read(self, key: int, rec: Any, base: memoryview, view: memoryview, direct: bool,
             done: Done, error: Worded) -> None:
        t0 = None
        ok = False
        try:
            # The key's write was queued before this read (FIFO pool), so it is running or
            # done: this wait is short and cannot deadlock, even with one thread.
            exc = rec.write.exception()
            if exc is not None:
                err = StorageError(f"cannot read key {key}: its write failed: {exc}")
                err.errno = getattr(exc, "errno", None)
                raise err from exc
            t0 = time.perf_counter()
            transfer_key(self._file, "pread", key, rec, view, direct, self.chunk_bytes,
                         self._flush)
            ok = True
        except OSError as e:
            forget_buffers(e)
            if isinstance(e, StorageError):
                raise
            raise error("read", key, rec.nbytes, e) from e
        finally:
            view.release()
            base.release()
            seconds = 0.0 if t0 is None else time.perf_counter() - t0
            done(rec, "read", rec.nbytes, seconds, ok, direct)


def transfer_key(file: SwapFile, op: str, key: int, rec: Any, view: memoryview, direct: bool,
                 chunk_bytes: int, flush: str) -> None:
    """Move the key's bytes piece by piece, in steps that never cross a chunk boundary of
    the key's bytes (so each step feeds exactly one CRC).

    ``op`` is ``"pwrite"`` or ``"pread"``; ``rec`` is the key's record (``nbytes``,
    ``pieces`` of the file, ``crcs`` per ``chunk_bytes`` or None); ``direct``: the buffer is
    4096-aligned and goes through O_DIRECT; ``flush`` (``"range"`` or ``"fdatasync"``): how
    buffered writes are pushed out of the page cache."""
    f, chunk, nbytes = file, chunk_bytes, rec.nbytes
    writing = op == "pwrite"
    crc_now: dict[int, int] = {}
    chunk_file_off: dict[int, int] = {}
    pos = 0  # bytes of the key moved so far
    for off, plen in rec.pieces:
        data = min(plen, nbytes - pos)  # the last piece ends with < 4096 bytes of padding
        s = 0
        while s < data:
            step = min(data - s, chunk - (pos + s) % chunk)
            part = view[pos + s:pos + s + step]
            try:  # released on every path: a live slice would pin the caller's buffer
                foff = off + s
                idx = (pos + s) // chunk
                chunk_file_off.setdefault(idx, foff)
                if writing and rec.crcs is not None:
                    rec.crcs[idx] = zlib.crc32(part, rec.crcs[idx])
                if direct:
                    _direct_step(f, op, key, part, foff)
                else:
                    f.transfer(op, key, False, part, foff)
                    if writing:
                        if flush == "range":  # start write-back now, wait at the end
                            f.start_writeback(key, foff, step)
                    else:  # clean pages: drop them at once
                        f.drop_cache(key, foff, step, dirty=False)
                if not writing and rec.crcs is not None:
                    crc_now[idx] = zlib.crc32(part, crc_now.get(idx, 0))
                    end = min((idx + 1) * chunk, nbytes)
                    if pos + s + step == end and crc_now[idx] != rec.crcs[idx]:
                        raise StorageError(
                            f"FileTier: key {key} is corrupted: CRC-32 mismatch in the "
                            f"chunk at byte {idx * chunk} of the key ({end - idx * chunk} "
                            f"bytes, file offset {chunk_file_off[idx]}); the bytes changed "
                            "on storage after they were written (disk, file system or "
                            "memory fault)")
            finally:
                part.release()
            s += step
        if writing and not direct:
            written = data
            if data < plen:  # zero the padding so the file covers the extent (O_DIRECT reads)
                f.transfer(op, key, False, memoryview(bytes(plen - data)), off + data)
                written = plen
            # DONTNEED only drops clean pages: wait for the write-back, then drop.
            if flush == "range":
                f.drop_cache(key, off, written, dirty=True)
            else:
                f.fdatasync_range(key, off, written)
        pos += data


def _direct_step(f: SwapFile, op: str, key: int, part: memoryview, foff: int) -> None:
    """An O_DIRECT step: the aligned body straight from/to the caller's buffer, the last
    partial page through a page of our own (the caller's buffer may end mid-page)."""
    body = len(part) - len(part) % ALIGN
    if body:
        f.transfer(op, key, True, part[:body], foff)
    tail = len(part) - body
    if tail:
        page = f.bounce_page(threading.get_ident())
        if op == "pwrite":
            page[:tail] = part[body:]
            page[tail:] = bytes(ALIGN - tail)
            f.transfer(op, key, True, memoryview(page), foff + body)
        else:
            f.transfer(op, key, True, memoryview(page), foff + body)
            part[body:] = page[:tail]


def forget_buffers(e: BaseException) -> None:
    """Clear the locals of the failed transfer's frames. The exception lives on in the future,
    and its traceback would otherwise keep slices of the caller's buffer (and so the buffer's
    export) alive: an mmap could not be closed, a bytearray not resized."""
    if e.__traceback__ is not None:
        traceback.clear_frames(e.__traceback__.tb_next or e.__traceback__)
