"""The private directory that holds a tier's swap file: created safely, removed at close,
and swept when a killed process left it behind.

Layout: ``<parent>/ooc-swap-<pid>-<random>/`` with mode 0700, created by ``tempfile.mkdtemp``
(O_EXCL semantics, so nobody can pre-create it for us). The swap file inside is unlinked
from birth (O_TMPFILE) or right after creation, so the directory is empty while the tier runs.

What a SIGKILL leaves behind: the kernel frees the unlinked file's blocks when the process's
descriptors close, so no swap bytes survive; only the empty directory remains. The pid in its
name identifies the owner: :func:`sweep_stale` (run by every new tier on the same parent)
removes directories named ``ooc-swap-<pid>-*`` that we own and whose pid is dead. In the narrow
window of the create-then-unlink fallback (file systems without O_TMPFILE) a killed process can
also leave its named swap file (``swap.tmp``): the sweep deletes that file too, and nothing else.

Caveat: a pid is judged by ``kill(pid, 0)`` in our pid namespace. Two containers sharing one
parent directory could see each other's live tiers as dead; the sweep would then remove the
other's (empty) directory, which does not harm its already-open swap file, and its close()
tolerates the directory being gone. Give each container its own parent to avoid that.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile

from ooc.errors import StorageError

__all__ = ["PREFIX", "FALLBACK_NAME", "check_parent", "make_private_dir", "remove_private_dir",
           "sweep_stale"]

log = logging.getLogger(__name__)

PREFIX = "ooc-swap-"
FALLBACK_NAME = "swap.tmp"  # the file's name in the create-then-unlink fallback


def _trusted_uids() -> set[int]:
    """Owners whose symlinks we follow: ourselves and root."""
    return {os.geteuid(), 0}


def check_parent(parent: str | os.PathLike) -> str:
    """Return ``parent`` as a str if it is safe to create our private directory in.

    Refused (StorageError): a missing path, a non-directory, a symlink owned by someone other
    than us or root, or a directory anyone may write to without the sticky bit (another user
    could rename our directory away and substitute theirs).
    """
    path = os.fspath(parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StorageError(
            f"swap directory {path!r} does not exist; create it or pass directory=None "
            "for a private directory under $TMPDIR") from None
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in _trusted_uids():
            raise StorageError(
                f"swap directory {path!r} is a symlink owned by uid {st.st_uid} (not us, not "
                "root): refusing to follow it; pass the real directory")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise StorageError(f"swap directory {path!r} is a dangling symlink") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"swap directory {path!r} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise StorageError(
            f"swap directory {path!r} is world-writable without the sticky bit "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could replace our files; "
            "use a directory only you can write to, or set the sticky bit (chmod +t)")
    return path


def make_private_dir(parent: str | os.PathLike | None) -> tuple[str, int]:
    """Create ``<parent>/ooc-swap-<pid>-<random>`` (0700); return its path and an O_DIRECTORY fd.

    ``parent=None`` means ``tempfile.gettempdir()`` ($TMPDIR, else /tmp), checked the same way.
    """
    base = check_parent(tempfile.gettempdir() if parent is None else parent)
    sweep_stale(base)
    try:
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
    except OSError as e:
        raise StorageError(f"cannot create a private swap directory in {base!r}: {e}") from e
    # Open it without following symlinks and confirm it is ours and private: every later
    # operation goes through this fd, not the path.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise StorageError(f"cannot open the private swap directory {path!r}: {e}") from e
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        os.close(fd)
        raise StorageError(
            f"private swap directory {path!r} has owner {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}; expected ours with 0700")
    return path, fd


def remove_private_dir(path: str, dir_fd: int | None) -> None:
    """Remove our (empty) private directory; a directory already gone is fine."""
    if dir_fd is not None:
        try:  # the fallback file is normally unlinked already; this covers a failed unlink
            os.unlink(FALLBACK_NAME, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s in %s: %s", FALLBACK_NAME, path, e)
        os.close(dir_fd)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove the private swap directory %s: %s", path, e)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


def sweep_stale(parent: str) -> list[str]:
    """Remove ``ooc-swap-<pid>-*`` directories in ``parent`` left by dead processes of ours.

    Only directories we own, whose pid is dead, and which hold nothing but (at most) the
    fallback swap file are removed. Returns the removed paths. Never raises.
    """
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            inside = os.listdir(path)
            if set(inside) - {FALLBACK_NAME}:
                log.warning("stale swap directory %s holds unexpected files %s; left alone",
                            path, sorted(inside))
                continue
            for leftover in inside:
                os.unlink(os.path.join(path, leftover))
            os.rmdir(path)
            removed.append(path)
            log.info("removed stale swap directory %s (pid %s is gone)", path, pid_text)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                log.warning("could not remove stale swap directory %s: %s", path, e)
    return removed
