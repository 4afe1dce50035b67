"""What a failed swap-file operation tells the user: the file system it happened on, its free
space, the key and the bytes, and what to do (free space, point the swap directory elsewhere,
raise the budget).

Apart from the tier so that the I/O code paths share one wording, and the tests can check the
message names the file system the same way (:func:`filesystem`).
"""

from __future__ import annotations

import errno
import os

from ooc.errors import StorageError
from ooc.storage.swapfile import ShortTransfer
from vmm.units import format_size

__all__ = ["io_error", "filesystem"]


def io_error(op: str, key: int, nbytes: int, e: OSError, directory: str,
             file_bytes: int) -> StorageError:
    """The :class:`~ooc.errors.StorageError` for a failed transfer or reservation: for ENOSPC
    the file system, its free bytes, what was being done and what to do; else the operation,
    the key, the bytes and the errno. ``file_bytes``: the swap file's allocated size."""
    if isinstance(e, StorageError):
        return e
    where = filesystem(directory)
    if e.errno == errno.ENOSPC:
        doing = ("reserving room for the writes ahead" if op == "reserve"
                 else f"writing key {key}")
        err = StorageError(
            f"FileTier: no space left on the file system at {where['mount']} "
            f"({format_size(where['free'])} free; swap directory {directory}) while "
            f"{doing}: it needs {format_size(nbytes)} ({nbytes} bytes); the swap "
            f"file has {format_size(file_bytes)} allocated. Free space there, point the "
            "swap directory (OutOfCore(storage=...), FileTier(directory=...)) at a larger "
            "disk, or raise the budget so less is swapped")
    else:
        kind = "short transfer" if isinstance(e, ShortTransfer) else "error"
        err = StorageError(
            f"FileTier: {op} of key {key} ({format_size(nbytes)}, {nbytes} bytes) failed "
            f"with an I/O {kind}: {e.strerror or e} [errno {e.errno}] (file system at "
            f"{where['mount']}, swap directory {directory})")
    err.errno = e.errno
    return err


def filesystem(path: str) -> dict:
    """Mount point and free bytes of the file system holding ``path`` (for error messages)."""
    mount = os.path.realpath(path)
    while not os.path.ismount(mount) and mount != os.path.dirname(mount):
        mount = os.path.dirname(mount)
    try:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return {"mount": mount, "free": free}

