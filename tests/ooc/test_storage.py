"""The CPU slower tier (ooc.storage.FileTier): bytes round-trip, space is reused, the file is
private and nameless, errors arrive through the future, and a SIGKILL leaves no swap bytes."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ooc.errors import StorageError
from ooc.storage import FileTier
from ooc.storage import private_dir
from ooc.storage.extents import Extents, round_up
from vmm.units import format_size

MiB = 1 << 20


def aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer (what the runtime's pool hands out)."""
    return mmap.mmap(-1, max(nbytes, 1))


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def direct_io_works(directory: str) -> bool:
    """An independent probe: can a file here be written with O_DIRECT?"""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT)
        try:
            return os.pwritev(dfd, [mmap.mmap(-1, 4096)], 0) == 4096
        finally:
            os.close(dfd)
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def tier(tmp_path):
    with FileTier(tmp_path, threads=2) as t:
        yield t


# -- round trips ---------------------------------------------------------------------------

SIZES = [1, 4095, 4096, 4097, 3 * MiB + 123, 5 * MiB]


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("verify", [False, True])
def test_round_trip_aligned_buffers(tmp_path, direct, verify):
    with FileTier(tmp_path, direct=direct, verify=verify) as t:
        data = {}
        for i, n in enumerate(SIZES):
            src = aligned(n)
            src[:n] = random_bytes(n, i).tobytes()
            data[i] = (src, n)
        futs = [t.write_async(i, src, n) for i, (src, n) in data.items()]
        for f in futs:
            assert f.result(timeout=30) is None
        dsts = {i: aligned(n) for i, (_, n) in data.items()}
        for f in [t.read_async(i, dsts[i]) for i in data]:
            f.result(timeout=30)
        for i, (src, n) in data.items():
            assert dsts[i][:n] == src[:n], f"key {i} ({n} bytes) differs"
        s = t.stats()
        assert s["writes"] == s["reads"] == len(SIZES)
        assert s["bytes_written"] == s["bytes_read"] == sum(SIZES)
        if t.direct_io:
            assert s["direct_transfers"] == 2 * len(SIZES) and s["buffered_transfers"] == 0
        assert s["verify"] is verify


def test_round_trip_unaligned_torch_tensors(tier):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tensors = [torch.randn(n) for n in (1, 1000, 300_001, 1 << 20)]
    tensors.append(torch.randn(257, 1031).to(torch.bfloat16))  # numpy has no bfloat16
    for k, x in enumerate(tensors):
        view = memoryview(x.numpy()) if x.dtype != torch.bfloat16 else x
        tier.write_async(k, view, x.numel() * x.element_size())
    for k, x in enumerate(tensors):
        y = torch.full_like(x, float("nan"))
        dst = memoryview(y.numpy()) if y.dtype != torch.bfloat16 else y
        tier.read_async(k, dst).result(timeout=30)
        assert torch.equal(x, y), k
    # torch's CPU allocator aligns to 64 bytes, so most of these went buffered
    assert tier.stats()["buffered_transfers"] > 0


def test_tensor_storage_stays_resizable(tier):
    """Passing a tensor itself must not pin its storage (numpy export would, for good): the
    runtime releases swapped storages in place with resize_(0)."""
    torch = pytest.importorskip("torch")
    x = torch.arange(100_000, dtype=torch.float32)
    expect = x.clone()
    tier.write_async(1, x, x.nbytes).result()
    x.untyped_storage().resize_(0)  # raises if the storage was made non-resizable
    x.untyped_storage().resize_(expect.nbytes)
    tier.read_async(1, x).result()
    assert torch.equal(x, expect)


def test_unaligned_into_aligned_and_back(tier):
    """A key written buffered (unaligned source) and read with O_DIRECT (aligned dst), and the
    reverse: both descriptors see the same bytes, tails included."""
    n = 2 * MiB + 1234
    raw = random_bytes(n + 64, 1)
    src = raw[1:n + 1]  # certainly not page-aligned
    tier.write_async(1, src, n).result()
    dst = aligned(n + 4096)
    dst[n:n + 16] = b"\xee" * 16
    tier.read_async(1, dst).result()
    assert dst[:n] == src.tobytes()
    assert dst[n:n + 16] == b"\xee" * 16, "a read must not write past the key's bytes"
    src2 = aligned(n)
    src2[:n] = random_bytes(n, 2).tobytes()
    tier.write_async(2, src2, n).result()
    out = np.zeros(n + 64, np.uint8)
    tier.read_async(2, out[3:n + 3]).result()
    assert out[3:n + 3].tobytes() == src2[:n]


def test_source_released_when_future_resolves(tier):
    """The runtime frees a source the moment its swap-out completes: no view may linger."""
    src = aligned(MiB)
    src[:10] = b"0123456789"
    tier.write_async(1, src, MiB).result()
    src.close()  # BufferError if the tier still held an export of it
    dst = aligned(MiB)
    tier.read_async(1, dst).result()
    dst.close()


def test_read_waits_for_inflight_write_and_overwrite(tmp_path):
    with FileTier(tmp_path, threads=2) as t:
        a, b = random_bytes(8 * MiB, 3), random_bytes(8 * MiB, 4)
        t.write_async(7, a, a.nbytes)
        out1 = np.zeros_like(a)
        r1 = t.read_async(7, out1)  # issued before the write finished
        t.write_async(7, b, b.nbytes)  # overwrite while the first read may be in flight
        out2 = np.zeros_like(b)
        r2 = t.read_async(7, out2)
        r1.result(timeout=30)
        r2.result(timeout=30)
        assert np.array_equal(out1, a) and np.array_equal(out2, b)


def test_zero_bytes_and_misuse(tier):
    tier.write_async(1, b"", 0).result()
    assert tier.nbytes(1) == 0
    tier.read_async(1, bytearray(0)).result()
    with pytest.raises(KeyError):
        tier.read_async(99, bytearray(10))
    tier.write_async(2, b"abcdef", 6).result()
    with pytest.raises(ValueError):
        tier.read_async(2, bytearray(5))
    with pytest.raises(ValueError):
        tier.read_async(2, b"readonly")
    with pytest.raises(ValueError):
        tier.write_async(3, b"abc", 4)
    with pytest.raises(ValueError):
        tier.write_async(3, np.zeros((4, 4))[:, ::2], 64)
    dst = bytearray(6)
    tier.read_async(2, dst).result()
    assert dst == b"abcdef"
    tier.discard(2)
    tier.discard(2)  # discarding twice is harmless
    assert 2 not in tier


# -- space management ----------------------------------------------------------------------


def test_many_keys_discard_and_reuse(tmp_path):
    rng = random.Random(5)
    with FileTier(tmp_path, threads=2, verify=True, chunk_bytes=256 * 1024) as t:
        model: dict[int, bytes] = {}
        pending = {}  # key -> its write's future; writes of other keys stay in flight
        bound = 0  # the peak of live bytes, each rounded to 4096: the file may not exceed it
        live = 0
        for step in range(400):
            key = rng.randrange(40)
            if key in pending:  # space of in-flight bytes is reused only after the transfer
                pending.pop(key).result(timeout=30)
            if key in model and rng.random() < 0.5:
                t.discard(key)
                live -= round_up(len(model.pop(key)), 4096)
                continue
            n = rng.choice([100, 4096, 5000, 70_000, 300_000, 1_100_000])
            payload = rng.randbytes(n)
            if key in model:
                live -= round_up(len(model[key]), 4096)
            pending[key] = t.write_async(key, payload, n)
            model[key] = payload
            live += round_up(n, 4096)
            bound = max(bound, live)
            if step % 50 == 0:
                for k, v in model.items():
                    out = bytearray(len(v))
                    t.read_async(k, out).result(timeout=30)
                    assert out == v, f"key {k} corrupted at step {step}"
        for k, v in model.items():
            out = bytearray(len(v))
            t.read_async(k, out).result(timeout=30)
            assert out == v
        s = t.stats()
        assert s["peak_file_bytes"] <= bound, (s["peak_file_bytes"], bound)
        assert s["file_bytes"] == os.fstat(t._file.fd).st_size
        for k in list(model):
            t.discard(k)
        assert t.stats()["live_bytes"] == 0
        assert t.trim() == 0
        assert os.fstat(t._file.fd).st_size == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3 * MiB), st.integers(0, 1000)),
                max_size=120))
def test_extents_never_grow_while_free_space_suffices(ops):
    """Invariants of the allocator: pieces are aligned and exact, every byte of the file is
    held or free exactly once, and the file never exceeds the peak of live (rounded) bytes."""
    ex = Extents(4096)
    held: list[list[tuple[int, int]]] = []
    live = peak = 0
    for alloc, n, pick in ops:
        if not alloc and held:
            pieces = held.pop(pick % len(held))
            ex.free(pieces)
            live -= sum(p for _, p in pieces)
        else:
            pieces = ex.allocate(n)
            assert sum(p for _, p in pieces) == round_up(n, 4096)
            assert all(o % 4096 == 0 and p % 4096 == 0 for o, p in pieces)
            held.append(pieces)
            live += round_up(n, 4096)
            peak = max(peak, live)
        assert ex.peak_end <= peak
        spans = sorted([p for ps in held for p in ps] + ex.free_extents())
        assert sum(n for _, n in spans) == ex.end
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + n1 <= o2


def test_extents_first_fit_and_double_free():
    ex = Extents(4096)
    a, b, c = ex.allocate(10_000), ex.allocate(4096), ex.allocate(50_000)
    assert a == [(0, 12288)] and b == [(12288, 4096)] and c == [(16384, 53248)]
    ex.free(a)
    assert ex.allocate(4000) == [(0, 4096)]  # first fit, at the lowest offset
    ex.free(c)
    assert ex.trim_end() == 16384
    pieces = ex.allocate(10_000)
    ex.free(pieces)
    with pytest.raises(ValueError, match="double free"):
        ex.free(pieces)


# -- privacy and cleanup -------------------------------------------------------------------


def test_file_mode_unlinked_and_private_dir(tmp_path):
    with FileTier(tmp_path) as t:
        t.write_async(1, b"x" * 10_000, 10_000).result()
        st = os.fstat(t._file.fd)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_nlink == 0
        assert os.readlink(f"/proc/self/fd/{t._file.fd}").endswith("(deleted)")
        assert t.stats()["o_tmpfile"] is True
        d = os.stat(t.directory)
        assert stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.geteuid()
        assert os.path.dirname(t.directory) == str(tmp_path)
        assert os.path.basename(t.directory).startswith(f"ooc-swap-{os.getpid()}-")
        assert os.listdir(t.directory) == []
        directory = t.directory
    assert not os.path.exists(directory)
    assert os.listdir(tmp_path) == []


def test_default_directory_is_private_under_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    t = FileTier()
    try:
        assert os.path.dirname(t.directory) == str(tmp_path)
    finally:
        t.close()
    t.close()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(StorageError, match="closed"):
        t.write_async(1, b"x", 1)


def test_fallback_without_o_tmpfile(tmp_path):
    def no_tmpfile(op, key, offset, length):
        if op == "open_tmpfile":
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported")

    with FileTier(tmp_path, _fault=no_tmpfile) as t:
        assert t.stats()["o_tmpfile"] is False
        assert os.fstat(t._file.fd).st_nlink == 0
        assert os.listdir(t.directory) == []
        t.write_async(1, b"abc" * 5000, 15000).result()
        out = bytearray(15000)
        t.read_async(1, out).result()
        assert out == b"abc" * 5000
    assert os.listdir(tmp_path) == []


def test_unsafe_parents_refused(tmp_path, monkeypatch):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(StorageError, match="world-writable without the sticky bit"):
        FileTier(open_dir)
    os.chmod(open_dir, 0o1777)  # /tmp-like: allowed
    FileTier(open_dir).close()

    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    FileTier(link).close()  # our own symlink is fine
    if os.geteuid() == 0:
        os.lchown(link, 65534, 65534)  # make it someone else's
    else:  # cannot chown: pretend our uid is not trusted
        monkeypatch.setattr(private_dir, "_trusted_uids", lambda: {0})
    with pytest.raises(StorageError, match="symlink owned by uid"):
        FileTier(link)
    afile = tmp_path / "file"
    afile.write_bytes(b"")
    with pytest.raises(StorageError, match="not a directory"):
        FileTier(afile)
    with pytest.raises(StorageError, match="does not exist"):
        FileTier(tmp_path / "missing")


# -- errors through the future -------------------------------------------------------------


def test_enospc_names_filesystem_and_bytes(tmp_path):
    def full(op, key, offset, length):
        if op == "pwrite":
            raise OSError(errno.ENOSPC, "No space left on device")

    with FileTier(tmp_path, _fault=full) as t:
        fut = t.write_async(3, aligned(5 * MiB), 5 * MiB)
        with pytest.raises(StorageError) as info:
            fut.result(timeout=30)
        msg = str(info.value)
        assert "no space left" in msg and "key 3" in msg
        assert format_size(5 * MiB) in msg and str(5 * MiB) in msg
        assert " free" in msg and t.directory in msg and "file system at /" in msg
        assert info.value.errno == errno.ENOSPC
        # the failed key cannot be read back as if it were fine
        with pytest.raises(StorageError, match="its write failed"):
            t.read_async(3, aligned(5 * MiB)).result(timeout=30)
        assert t.stats()["writes"] == 0


@pytest.mark.parametrize("direct", [None, False])
def test_short_transfers_are_completed(tmp_path, direct):
    calls = {"pwrite": 0, "pread": 0}

    def short(op, key, offset, length):
        if op in calls:
            calls[op] += 1
            if calls[op] % 2 == 1 and length > 1000:
                return length // 3 + 5  # a short transfer, not page-aligned
        return None

    with FileTier(tmp_path, direct=direct, verify=True, _fault=short) as t:
        for src in (aligned(3 * MiB + 77), random_bytes(3 * MiB + 77, 9)):
            if isinstance(src, mmap.mmap):
                src[:] = random_bytes(len(src), 8).tobytes()
            expect = bytes(src)
            t.write_async(1, src, len(expect)).result(timeout=30)
            for dst in (aligned(len(expect)), np.zeros(len(expect), np.uint8)):
                t.read_async(1, dst).result(timeout=30)
                assert bytes(dst) == expect
    assert calls["pwrite"] > 2 and calls["pread"] > 2


def test_persistent_eio_and_eof(tmp_path):
    def eio(op, key, offset, length):
        if op == "pread" and key == 2:
            raise OSError(errno.EIO, "Input/output error")
        if op == "pread" and key == 3:
            return 0  # end of file before the end of the key
        if op == "pwrite" and key == 4:
            raise OSError(errno.EIO, "Input/output error")

    with FileTier(tmp_path, _fault=eio) as t:
        for k in (1, 2, 3):
            t.write_async(k, b"z" * 9000, 9000).result()
        t.read_async(1, bytearray(9000)).result()
        with pytest.raises(StorageError) as info:
            t.read_async(2, bytearray(9000)).result(timeout=30)
        assert "read of key 2" in str(info.value) and "9000 bytes" in str(info.value)
        assert info.value.errno == errno.EIO
        with pytest.raises(StorageError, match="key 3.*short transfer.*end of file"):
            t.read_async(3, bytearray(9000)).result(timeout=30)
        assert t.stats()["reads"] == 1
        src = aligned(9000)
        fut = t.write_async(4, src, 9000)
        assert isinstance(fut.exception(timeout=30), StorageError)
        src.close()  # the failed transfer's traceback must not pin the caller's buffer
        with pytest.raises(StorageError, match=r"write of key 4 \(.*9000 bytes\).*errno 5"):
            t.write_async(4, b"y" * 9000, 9000).result(timeout=30)
        assert t.stats()["writes"] == 3


def test_verify_detects_a_flipped_byte(tmp_path):
    chunk = 256 * 1024
    with FileTier(tmp_path, verify=True, chunk_bytes=chunk) as t:
        src = aligned(MiB)
        src[:] = random_bytes(MiB, 11).tobytes()
        t.write_async(42, src, MiB).result()
        (offset, _), = t._records[42].pieces
        where = offset + 3 * chunk + 17
        # flip one byte behind the tier's back, through another descriptor of the same file
        fd = os.open(f"/proc/self/fd/{t._file.fd}", os.O_RDWR)
        try:
            old = os.pread(fd, 1, where)
            os.pwrite(fd, bytes([old[0] ^ 0x40]), where)
        finally:
            os.close(fd)
        with pytest.raises(StorageError) as info:
            t.read_async(42, aligned(MiB)).result(timeout=30)
        msg = str(info.value)
        assert "key 42" in msg and f"byte {3 * chunk} of the key" in msg and "CRC" in msg
    with FileTier(tmp_path, verify=False) as t:  # without verify nothing is checked
        t.write_async(1, b"a" * 100, 100).result()
        assert t._records[1].crcs is None


def test_close_with_transfers_in_flight(tmp_path):
    """close() cancels what has not started and waits for what runs: the one I/O thread held
    in its first write, the eleven queued behind it are cancelled before that write may end
    (a bound on close()'s time stood for this, which a busy machine could break)."""
    t = FileTier(tmp_path, threads=1)
    gate, write = threading.Event(), t._tasks.write

    def held(*args):
        gate.wait(timeout=120)
        return write(*args)

    t._tasks.write = held
    src = aligned(16 * MiB)
    futs = [t.write_async(k, src, 16 * MiB) for k in range(12)]
    closer = threading.Thread(target=t.close)
    closer.start()
    deadline = time.monotonic() + 120   # (a guard against a hang, not a measure)
    while not all(f.cancelled() for f in futs[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    cancelled = [f.cancelled() for f in futs]
    assert closer.is_alive() and not futs[0].done()   # close() waits for the running write
    gate.set()
    closer.join(timeout=120)
    assert not closer.is_alive()
    assert cancelled == [False] + [True] * 11
    assert futs[0].exception() is None
    assert os.listdir(tmp_path) == []


def test_buffered_writes_leave_no_page_cache(tmp_path):
    """A buffered write is written back and dropped before its future resolves."""
    libc = ctypes.CDLL(None, use_errno=True)
    n = 4 * MiB
    with FileTier(tmp_path, direct=False) as t:
        t.write_async(1, random_bytes(n, 2), n).result()
        m = mmap.mmap(t._file.fd, n, prot=mmap.PROT_READ)
        vec = (ctypes.c_ubyte * (n // 4096))()
        addr = np.frombuffer(m, np.uint8).ctypes.data
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) == 0
        resident = sum(v & 1 for v in vec)
        del addr
        m.close()
        assert resident <= 2, f"{resident} of {n // 4096} pages still cached"


# -- O_DIRECT detection --------------------------------------------------------------------


def test_direct_io_used_when_the_filesystem_supports_it(tmp_path, record_property):
    supported = direct_io_works(str(tmp_path))
    record_property("o_direct_on_tmp", supported)
    print(f"O_DIRECT on {tmp_path}: {'supported' if supported else 'not supported'}")
    with FileTier(tmp_path) as t:
        assert t.direct_io is supported
        assert t.stats()["direct_io"] is supported
    with FileTier(tmp_path, direct=False) as t:
        assert t.direct_io is False and "direct=False" in t.stats()["direct_io_reason"]


def test_direct_io_fallback_and_refusal(tmp_path):
    def no_direct(op, key, offset, length):
        if op == "open_direct":
            raise OSError(errno.EINVAL, "Invalid argument")

    with FileTier(tmp_path, _fault=no_direct) as t:
        assert t.direct_io is False and "O_DIRECT open failed" in t.stats()["direct_io_reason"]
        src = aligned(MiB)
        src[:5] = b"hello"
        t.write_async(1, src, MiB).result()
        dst = aligned(MiB)
        t.read_async(1, dst).result()
        assert dst[:5] == b"hello" and t.stats()["buffered_transfers"] == 2
    with pytest.raises(StorageError, match="direct=True but O_DIRECT does not work"):
        FileTier(tmp_path, direct=True, _fault=no_direct)
    assert os.listdir(tmp_path) == []


# -- SIGKILL -------------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import mmap, sys
    from ooc.storage import FileTier
    t = FileTier(sys.argv[1], threads=2)
    src = mmap.mmap(-1, 16 << 20)
    src[:] = b"\\xab" * (16 << 20)
    t.write_async(0, src, 16 << 20).result()
    print(t.directory, flush=True)
    k = 1
    while True:  # keep writing until killed
        t.write_async(k, src, 16 << 20)
        if k % 4 == 0:
            t.write_async(k, src, 16 << 20).result()
        k += 1
""")


def test_sigkill_leaves_no_swap_bytes(tmp_path):
    parent = tmp_path / "swap"
    parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(parent)], stdout=subprocess.PIPE,
                            text=True)
    try:
        directory = proc.stdout.readline().strip()
        assert directory.startswith(str(parent)), directory
        time.sleep(0.3)  # mid-write
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the private directory remains, empty: no regular file, no blocks
    assert os.path.isdir(directory)
    assert os.listdir(directory) == []
    du = subprocess.run(["du", "-sk", str(parent)], capture_output=True, text=True, check=True)
    assert int(du.stdout.split()[0]) <= 16, du.stdout
    # the next tier on the same parent sweeps it: its pid is dead
    with FileTier(parent) as t:
        assert os.listdir(parent) == [os.path.basename(t.directory)]
    assert os.listdir(parent) == []


def test_sweep_leaves_live_and_foreign_dirs(tmp_path):
    mine = tmp_path / f"ooc-swap-{os.getpid()}-live"
    mine.mkdir()
    other = tmp_path / "ooc-swap-notapid-x"
    other.mkdir()
    dead = tmp_path / "ooc-swap-999999999-x"  # beyond pid_max: dead
    dead.mkdir()
    (dead / private_dir.FALLBACK_NAME).write_bytes(b"left by a kill mid-fallback")
    busy = tmp_path / "ooc-swap-999999998-y"
    busy.mkdir()
    (busy / "precious").write_bytes(b"not ours to delete")
    removed = private_dir.sweep_stale(str(tmp_path))
    assert removed == [str(dead)]
    assert mine.exists() and other.exists() and busy.exists()
