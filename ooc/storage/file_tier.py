"""The CPU slower tier: swap bytes to one private, unlinked file with background I/O threads.

The runtime engine swaps a tensor out with :meth:`FileTier.write_async`, releases the tensor's
memory once the returned future resolves, and brings it back with :meth:`FileTier.read_async`
into a buffer of its pool. Everything else here — where the bytes live in the file, which
descriptor moves them, checksums, errors — is invisible to it.

This module is the tier's public API and its bookkeeping under one lock (a record per key,
the file's extents, the counters, the I/O thread pool). How a key's bytes move on an I/O
thread (CRC chunks, O_DIRECT and its bounce page, buffered write-back) is
:mod:`ooc.storage.swap_transfer`; which caller objects are accepted as bytes is
:mod:`ooc.storage.byte_views`; what a failed operation tells the user is
:mod:`ooc.storage.io_errors`; where the bytes go in the file is :mod:`ooc.storage.extents`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ooc.errors import StorageError
from ooc.storage.extents import Extents, room_to_write
from ooc.storage.byte_views import byte_view
from ooc.storage.io_errors import filesystem as _filesystem  # noqa: F401 - the old import path
from ooc.storage.io_errors import io_error
from ooc.storage import reaper
from ooc.storage.private_dir import make_private_dir, remove_private_dir
from ooc.storage.swap_transfer import TransferTasks
from ooc.storage.swapfile import ALIGN, Fault, SwapFile, buffer_address

__all__ = ["FileTier"]

log = logging.getLogger(__name__)

_THREAD_PREFIX = "ooc-swap-io"  # names of the tier's I/O threads


@dataclass(slots=True, eq=False)
class _Record:
    """One key's bytes in the file. A new write of the key makes a new record; an old record's
    pieces return to the free list only when no transfer still uses them (``refs == 0``)."""

    nbytes: int
    pieces: list[tuple[int, int]]
    crcs: list[int] | None
    refs: int = 1  # transfers submitted and not finished; the write counts as one
    retired: bool = False  # discarded or overwritten: free the pieces when refs reaches 0
    write: Future | None = None


class FileTier:
    """A swap file on local storage, with ``threads`` background I/O threads.

    ``write_async(key, src, nbytes)`` copies the first ``nbytes`` of ``src`` into the tier and
    ``read_async(key, dst)`` copies them back into ``dst``; both return a
    :class:`concurrent.futures.Future` that resolves (to ``None``) when the transfer is done, or
    raises :class:`~ooc.errors.StorageError` from ``future.result()`` in the caller's thread
    when it failed. I/O errors never escape any other way, and never hang.

    Guarantees:

    * *Private*: the file lives in ``<directory>/ooc-swap-<pid>-<random>/`` (mode 0700,
      ``directory=None`` means $TMPDIR or /tmp), has mode 0600 and no name (O_TMPFILE, else
      unlinked right after creation). Killed with SIGKILL, the process leaves no swap bytes on
      disk, at most that empty directory, which the next tier on the same parent removes.
      A parent anyone may write to without the sticky bit, a symlink owned by someone other than
      us or root, or a non-directory is refused.
    * *Ordering*: a read waits for the key's last write; a discard or an overwrite while a
      transfer of the old bytes is in flight defers reusing their space until it finishes.
      ``write_async``, ``read_async`` and ``discard`` may be called from any thread.
    * *Space*: file offsets and lengths are 4096-aligned; freed space is reused and the file
      grows only when the free space cannot hold a request, so it never exceeds the peak of live
      bytes (each rounded up to 4096). It is not shrunk implicitly (rewriting allocated blocks is
      cheaper than extending the file); :meth:`trim` gives the free tail back.
    * *Cost is real*: transfers whose buffer address is 4096-aligned (pages of the runtime's
      pool) go through O_DIRECT when the file system supports it; others (torch's CPU allocator
      aligns to 64) are buffered and their pages written back and dropped from the page cache
      before the future resolves, so neither the page cache nor a dirty backlog hides the cost.
    * ``verify=True`` keeps a CRC-32 per ``chunk_bytes`` of each key, computed from the source
      at write and checked at read: a mismatch raises StorageError naming the key and chunk.

    The caller keeps ``src`` alive and unchanged until the write's future resolves, and does
    not touch ``dst`` until the read's future resolves. The tier holds no reference to either
    after that (its memoryviews are released before the future resolves).

    Example::

        import numpy as np
        from ooc.storage import FileTier

        with FileTier(threads=2) as tier:
            a = np.arange(1 << 20, dtype=np.float32)
            tier.write_async(7, a, a.nbytes).result()
            b = np.empty_like(a)
            tier.read_async(7, b).result()
            assert (a == b).all()
            tier.discard(7)

    ``src`` and ``dst`` are C-contiguous buffer-protocol objects (numpy arrays, memoryviews,
    mmaps, bytearrays) or contiguous CPU torch tensors (any dtype, bfloat16 too).
    ``_fault`` is a test hook, see :data:`ooc.storage.swapfile.Fault`; ``_flush="fdatasync"``
    selects the slower write-back of buffered writes for the benchmark's comparison.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, threads: int = 2,
                 verify: bool = False, direct: bool | None = None, chunk_bytes: int = 2 << 20,
                 _fault: Fault | None = None, _flush: str = "range") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(
                f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
        if _flush not in ("range", "fdatasync"):
            raise ValueError(f"_flush must be 'range' or 'fdatasync', got {_flush!r}")
        self.verify = bool(verify)
        self.chunk_bytes = int(chunk_bytes)
        self.threads = int(threads)
        self._flush = _flush
        self.directory, dir_fd = make_private_dir(directory)
        try:
            self._file = SwapFile(dir_fd, self.directory, direct=direct, fault=_fault)
        except OSError as e:
            remove_private_dir(self.directory, dir_fd)
            raise StorageError(f"cannot create the swap file in {self.directory!r}: {e}") from e
        if direct is True and self._file.direct_fd is None:
            reason = self._file.direct_error
            _cleanup(None, self._file, self.directory, dir_fd)
            raise StorageError(
                f"direct=True but O_DIRECT does not work in {self.directory!r} ({reason}); "
                "pass direct=None to fall back to buffered I/O")
        self._tasks = TransferTasks(self._file, self.chunk_bytes, self._flush)   # what the I/O threads run
        # Reentrant: an engine collected without close() closes its tier from its finalizer,
        # which the collector may run in an I/O thread inside ``_done``'s locked section.
        self._lock = threading.RLock()
        self._records: dict[int, _Record] = {}
        self._extents = Extents(ALIGN)
        self._closed = False
        self._live_bytes = 0
        self._peak_live_bytes = 0
        self._stats = dict(bytes_written=0, bytes_read=0, writes=0, reads=0, write_s=0.0,
                           read_s=0.0, direct_transfers=0, buffered_transfers=0)
        reaper.start()   # before any thread of ours: a finalizer queues its cleanup there
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=_THREAD_PREFIX)
        self._inflight: set[Future] = set()   # submitted, not finished (for drain)
        # Runs at garbage collection (on the reaper thread) or at interpreter exit (after the
        # pool's own exit hook has drained its queue): descriptors closed, directory removed.
        self._finalizer = weakref.finalize(self, reaper.later, _retire, self._pool, self._file,
                                           self.directory, dir_fd)
        log.debug("FileTier in %s: O_TMPFILE=%s, O_DIRECT=%s", self.directory,
                  self._file.tmpfile, self.direct_io)

    # -- public API ------------------------------------------------------------------------

    @property
    def direct_io(self) -> bool:
        """True when aligned transfers go through O_DIRECT."""
        return self._file.direct_fd is not None

    def write_async(self, key: int, src, nbytes: int) -> Future:
        """Copy ``src[:nbytes]`` to the tier under ``key`` (replacing its old bytes, if any)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        base, view = byte_view(src, writable=False)
        if len(view) < nbytes:
            base.release()
            raise ValueError(f"key {key}: src holds {len(view)} bytes, fewer than nbytes={nbytes}")
        view = view[:nbytes]
        direct = self.direct_io and buffer_address(view) % ALIGN == 0
        with self._lock:
            self._check_open()
            old = self._records.pop(key, None)
            if old is not None:
                self._retire(old)
            pieces = self._extents.allocate(nbytes) if nbytes else []
            nchunks = -(-nbytes // self.chunk_bytes)
            rec = _Record(nbytes, pieces, [0] * nchunks if self.verify else None)
            self._records[key] = rec
            self._live_bytes += nbytes
            self._peak_live_bytes = max(self._peak_live_bytes, self._live_bytes)
            rec.write = self._submit(self._tasks.write, key, rec, base, view, direct)
            return rec.write

    def read_async(self, key: int, dst) -> Future:
        """Copy ``key``'s bytes into the start of ``dst`` (which holds at least that many)."""
        base, view = byte_view(dst, writable=True)
        with self._lock:
            self._check_open()
            rec = self._records.get(key)
            if rec is None:
                base.release()
                raise KeyError(f"FileTier: key {key} was never written, or was discarded")
            if len(view) < rec.nbytes:
                base.release()
                raise ValueError(f"key {key}: dst holds {len(view)} bytes, the key {rec.nbytes}")
            view = view[:rec.nbytes]
            direct = self.direct_io and buffer_address(view) % ALIGN == 0
            rec.refs += 1
            return self._submit(self._tasks.read, key, rec, base, view, direct)

    def discard(self, key: int) -> None:
        """Forget ``key``; its space is reused once no transfer of it is in flight.
        Discarding an unknown key does nothing."""
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is not None:
                self._retire(rec)

    def reserve(self, writes) -> None:
        """Make sure that ``writes``, pairs ``(key, nbytes)`` (``key=None``: a new key), will
        find room in the file without growing it, by growing it now if they would not.

        A rewrite of a key whose transfers are finished reuses its space, so only the excess
        counts. The space is allocated on the file system at once (``posix_fallocate``): when
        it is full, this raises the ENOSPC :class:`~ooc.errors.StorageError` (naming the file
        system and the bytes) *before* the caller changes anything, and later writes into the
        reserved space cannot fail for want of space on file systems that allocate in place
        (ext4, xfs, tmpfs; copy-on-write ones such as btrfs may still refuse a write).
        """
        with self._lock:
            self._check_open()
            need = room_to_write(self._records, writes, ALIGN)
            grow = need - self._extents.free_bytes
            if grow <= 0:
                return
            end = self._extents.end
            try:
                reserved = self._file.reserve(end, grow)
            except OSError as e:
                raise self._error("reserve", -1, grow, e) from e
            if reserved:
                self._extents.grow(end + grow)

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self._records

    def nbytes(self, key: int) -> int:
        """Bytes stored under ``key`` (KeyError if none)."""
        with self._lock:
            return self._records[key].nbytes

    def trim(self) -> int:
        """Give the free space at the end of the file back to the file system; return the new
        file size. Worth calling when the tier will stay small for a while (it costs the next
        writes there the slower, file-extending path)."""
        with self._lock:
            self._check_open()
            end = self._extents.trim_end()
            os.ftruncate(self._file.fd, end)
            return end

    def stats(self) -> dict:
        """Counters as a plain dict with stable keys.

        bytes_written, bytes_read, writes, reads: completed transfers (payload bytes).
        write_s, read_s: busy time of the I/O threads, summed over threads (can exceed wall time).
        file_bytes, peak_file_bytes: the file's size (allocated space) now and at most.
        live_bytes, peak_live_bytes, keys: bytes and keys held now, and the peak of bytes.
        direct_io: aligned transfers use O_DIRECT; direct_io_reason: why not, else None.
        direct_transfers, buffered_transfers: how transfers actually went.
        verify, threads, chunk_bytes, directory, o_tmpfile: the configuration.
        """
        with self._lock:
            out = dict(self._stats)
            out.update(
                file_bytes=self._extents.end, peak_file_bytes=self._extents.peak_end,
                live_bytes=self._live_bytes, peak_live_bytes=self._peak_live_bytes,
                keys=len(self._records), direct_io=self.direct_io,
                direct_io_reason=self._file.direct_error, verify=self.verify,
                threads=self.threads, chunk_bytes=self.chunk_bytes, directory=self.directory,
                o_tmpfile=self._file.tmpfile,
            )
        return out

    def close(self) -> None:
        """Cancel transfers not yet started (their futures are cancelled), wait for running
        ones, join the threads, close the file (its blocks return to the file system) and
        remove the private directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        parts = self._finalizer.detach()
        if parts is None:
            return
        _, _, (retire, *args), _ = parts   # (tier, reaper.later, (_retire, ...), {})
        if threading.current_thread().name.startswith(_THREAD_PREFIX):
            reaper.later(retire, *args)   # one of its own I/O threads: it cannot join itself
        else:
            retire(*args)   # at once, in this thread

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> FileTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} keys"
        return (f"FileTier({self.directory!r}, {state}, direct_io={self.direct_io}, "
                f"threads={self.threads}, verify={self.verify})")

    # -- bookkeeping (under self._lock) ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("FileTier is closed")

    def _submit(self, fn, key: int, rec: _Record, base: memoryview, view: memoryview,
                direct: bool) -> Future:
        try:
            future = self._pool.submit(fn, key, rec, base, view, direct, self._done, self._error)
        except RuntimeError as e:  # the pool is shutting down (interpreter exit)
            rec.refs -= 1
            view.release()
            base.release()
            raise StorageError(f"FileTier cannot start a transfer of key {key}: {e}") from e
        self._inflight.add(future)   # set operations are atomic under the GIL: no lock needed
        future.add_done_callback(self._inflight.discard)
        return future

    def drain(self) -> None:
        """Wait until every transfer submitted so far has finished (or was cancelled), whether
        or not its caller still holds the future: afterwards no I/O thread touches any buffer
        handed to the tier. A KeyboardInterrupt during the wait is raised once it is over."""
        interrupt: BaseException | None = None
        while True:
            try:
                wait(set(self._inflight))
                break
            except BaseException as e:  # noqa: B036 - re-raised below
                interrupt = interrupt or e
        if interrupt is not None:
            try:
                raise interrupt
            finally:   # (held here, a cycle through the frame its traceback keeps)
                del interrupt

    def _retire(self, rec: _Record) -> None:
        rec.retired = True
        self._live_bytes -= rec.nbytes
        if rec.refs == 0:
            self._extents.free(rec.pieces)

    def _done(self, rec: _Record, kind: str, nbytes: int, seconds: float, ok: bool,
              direct: bool) -> None:
        with self._lock:
            rec.refs -= 1
            if rec.retired and rec.refs == 0:
                self._extents.free(rec.pieces)
            self._stats[f"{kind}_s"] += seconds
            if ok:
                self._stats["bytes_written" if kind == "write" else "bytes_read"] += nbytes
                self._stats[f"{kind}s"] += 1
                self._stats["direct_transfers" if direct else "buffered_transfers"] += 1

    def _error(self, op: str, key: int, nbytes: int, e: OSError) -> StorageError:
        return io_error(op, key, nbytes, e, self.directory, self._extents.end)


def _retire(pool: ThreadPoolExecutor, file: SwapFile, directory: str, dir_fd: int) -> None:
    """A tier's end: at ``close()``, or on the reaper thread for a tier the collector
    finalized (``ooc/storage/reaper.py``: never inside the finalizer, where a join can hang)."""
    try:
        _cleanup(pool, file, directory, dir_fd)
    finally:
        reaper.release()


def _cleanup(pool: ThreadPoolExecutor | None, file: SwapFile, directory: str, dir_fd: int) -> None:
    """Join the I/O threads, close the file, remove the directory."""
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    file.close()
    remove_private_dir(directory, dir_fd)
