"""Issue 7, reliability: a swap failure never corrupts a model silently.

Each test is one promise of GUARANTEES.md: storage faults (full disk, I/O errors, short
transfers, corrupted bytes), exceptions and interrupts in the middle of a step, killed
processes, budget changes, bad arguments, and models the runtime cannot plan for. Faults
are injected through :class:`~ooc.storage.FileTier`'s ``_fault`` hook, by giving the engine
a tier made with it (:func:`faulty_engine`). "Unchanged" and "identical" are checked bitwise,
against the state before the failed step and against in-core training on the same data.

The model is a small conv-BN-ReLU stack (a training step takes a few milliseconds) whose
activations, parameters and optimizer state are all larger than ``min_bytes``, so a quarter
of its in-core peak swaps every kind of tensor.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.engine import Options, OutOfCore
from ooc.errors import OOCError, StorageError
from ooc.measure import update_in_backward
from ooc.storage import FileTier
from ooc.storage.file_tier import _filesystem
from ooc.storage.private_dir import PREFIX

CHUNK = 16 << 10
ALL = ("activations", "params", "grads", "optimizer_state")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny ops: on a shared 2-core machine OpenMP's second thread only contends (a step of
    these models takes ~40x longer with 2 threads). Results are compared under one setting;
    test_long_run.py checks both settings."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- a small model, its data, in-core references -------------------------------------------


class Tiny(nn.Module):
    """conv-BN-ReLU blocks and a linear head. ``fail`` makes a step fail on purpose:
    "forward" (after the BatchNorm statistics changed), "loss", "backward" (in the middle of
    it, after some gradients exist) or "interrupt" (a KeyboardInterrupt in the forward)."""

    def __init__(self, width: int = 16, blocks: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for _ in range(blocks):
            layers += [nn.Conv2d(cin, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            cin = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width * 16, 10)
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.fail == "forward":
            raise RuntimeError("shape mismatch (on purpose)")
        if self.fail == "interrupt":
            raise KeyboardInterrupt
        if self.fail == "backward":
            h.register_hook(_raise_in_backward)
        return self.head(F.adaptive_avg_pool2d(h, 4).flatten(1))


def _raise_in_backward(grad: torch.Tensor) -> None:
    raise RuntimeError("failure in the backward (on purpose)")


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


class MLP(nn.Module):
    """Parameters and optimizer state dominate (activations are small): under a quarter of its
    peak the optimizer step itself swaps parameters and state in and out."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(192, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(F.avg_pool2d(x, 2).flatten(1))


def fresh(opt: str = "adam", kind: str = "cnn", **kw) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny(**kw) if kind == "cnn" else MLP(**kw)
    if opt == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def run_step(model: nn.Module, opt, step: int, engine: OutOfCore | None = None,
             loss_fail: bool = False) -> torch.Tensor:
    """One training step, in core (``engine=None``) or through the engine."""
    x, y = batch(step)
    ctx = engine.step() if engine is not None else contextlib.nullcontext()
    with ctx:
        loss = F.cross_entropy(model(x), y)
        if loss_fail:
            raise ValueError("the loss failed (on purpose)")
        loss.backward()
        if engine is not None:
            engine.optimizer_step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return loss.detach()


def state_of(model: nn.Module, opt, engine: OutOfCore | None = None) -> dict:
    """Bitwise copy of parameters, buffers, grads and optimizer state."""
    with engine.resident() if engine is not None else contextlib.nullcontext():
        return {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "opt": copy.deepcopy(opt.state_dict()),
        }


def assert_same(a: dict, b: dict, what: str = "") -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"{what}: {k} differs"
    for k, v in a["grads"].items():
        w = b["grads"][k]
        assert (v is None) == (w is None) and (v is None or torch.equal(v, w)), f"{what}: grad of {k} differs"
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys(), f"{what}: optimizer state has other entries"
    for i in sa:
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f"{what}: state {i}.{k}"
    hyper = lambda s: [{k: v for k, v in g.items() if k != "foreach"} for g in s["param_groups"]]  # noqa: E731
    assert hyper(a["opt"]) == hyper(b["opt"]), f"{what}: hyperparameters differ"   # the engine sets foreach


_REF: dict = {}


def reference(opt: str, steps: int, **kw) -> list[dict]:
    """In-core states after steps 0..steps-1 (cached; results depend on the thread count)."""
    key = (opt, steps, tuple(sorted(kw.items())), torch.get_num_threads())
    if key not in _REF:
        model, o = fresh(opt, **kw)
        out = []
        for step in range(steps):
            run_step(model, o, step)
            out.append(state_of(model, o))
        _REF[key] = out
    return _REF[key]


_PEAK: dict = {}


def managed_peak(opt: str, manage: tuple[str, ...], **kw) -> int:
    key = (opt, manage, tuple(sorted(kw.items())))
    if key not in _PEAK:
        model, o = fresh(opt, **kw)
        with OutOfCore(model, o, budget="1GiB", options=Options(chunk=CHUNK, min_bytes=4096), manage=manage) as e:
            for step in range(2):
                run_step(model, o, step, e)
            _PEAK[key] = e._plans.schedule.sequence.in_core_peak_bytes
    return _PEAK[key]


class Faults:
    """A switchable ``FileTier._fault`` hook: ``self.fn(op, key, offset, length)`` decides."""

    def __init__(self) -> None:
        self.fn = None

    def __call__(self, op: str, key: int, offset: int, length: int):
        fn = self.fn
        return None if fn is None else fn(op, key, offset, length)


def faulty_engine(model, opt, faults: Faults, storage, *, fraction: int = 4,
                  manage: tuple[str, ...] = ("activations",), verify: bool = False,
                  opt_name: str = "adam", kind: str = "cnn", recompute: str = "auto") -> OutOfCore:
    """An engine at ``1/fraction`` of the in-core managed peak whose tier has the fault hook
    (the engine's own tier is closed and replaced before any step)."""
    budget = managed_peak(opt_name, manage, kind=kind) // fraction
    e = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096, verify=verify), manage=manage,
                  storage=str(storage), recompute=recompute)
    e._mem.tier.close()
    e._mem.tier = FileTier(storage, threads=2, verify=verify, chunk_bytes=CHUNK, _fault=faults)
    return e


def enospc(op, key, offset, length):
    if op in ("pwrite", "reserve"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def disk_of(room: list[int]):
    """A file system with ``room[0]`` bytes for the swap file: writes and reservations that
    would reach past it fail with ENOSPC, writes into space already held succeed."""
    def fault(op, key, offset, length):
        if op in ("pwrite", "reserve") and offset + length > room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return fault


def live_pool_allocations(engine: OutOfCore) -> int:
    gc.collect()
    engine._mem.pool.reap()
    return engine._mem.pool.stats()["allocations"]


def assert_storage_error_names_the_filesystem(err: StorageError, storage) -> None:
    msg = str(err)
    assert "no space left on the file system at" in msg
    assert _filesystem(str(storage))["mount"] in msg
    assert re.search(r"needs [\d.]+ \w*B \(\d+ bytes\)", msg), msg
    assert err.errno == errno.ENOSPC


# -- faults: full disk ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_full_disk_in_the_forward_fails_the_step_before_the_optimizer_and_a_retry_matches(tmp_path):
    """Every write fails with ENOSPC from step 2 on: the step raises StorageError naming the file
    system, the swapped variable and the bytes; parameters, buffers, grads and optimizer state are
    bitwise as before the step; with room again, the retried step and the next match in core."""
    model, opt = fresh()
    faults = Faults()
    e = faulty_engine(model, opt, faults, tmp_path)
    ref = reference("adam", 4)
    for step in range(2):
        run_step(model, opt, step, e)
    before = state_of(model, opt, e)
    faults.fn = enospc
    with pytest.raises(StorageError) as err:
        run_step(model, opt, 2, e)
    assert_storage_error_names_the_filesystem(err.value, tmp_path)
    assert re.search(r"swap-(out|in) of aten\.\w+\.\w+#\d+ \(activation", str(err.value)), str(err.value)
    assert_same(before, state_of(model, opt, e), "after the failed step")
    del err
    assert live_pool_allocations(e) == 0 and e._mem.tier.stats()["keys"] == 0, "transfers and pool released"
    faults.fn = None
    for step in (2, 3):
        run_step(model, opt, step, e)
        assert_same(ref[step], state_of(model, opt, e), f"step {step} after the retry")
    assert e.stats()["last_planned"], "the plan survives a failed step"
    e.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_full_disk_with_managed_state_fails_before_the_update_then_room_again(tmp_path):
    """manage=all (the optimizer step itself swaps): a disk too small for what the update will
    write fails at the commit point of ``optimizer_step`` (the room for updated parameters and
    state is reserved before the first one changes), never halfway through the update. Given
    room, the retry trains as in core; a disk that is full after that (the swap file already has
    its room) does not disturb the planned steps."""
    ref = reference("adam", 5, kind="mlp")
    # Trial run: how big the swap file is when the first optimizer step starts.
    model, opt = fresh(kind="mlp")
    probe = Faults()
    e = faulty_engine(model, opt, probe, tmp_path, manage=ALL, kind="mlp")
    x, y = batch(0)
    with e.step():
        F.cross_entropy(model(x), y).backward()
        before_update = e._mem.tier.stats()["file_bytes"]
        e.optimizer_step()
    e.close()

    model, opt = fresh(kind="mlp")
    room = [before_update + (256 << 10)]   # the forward fits (with slack), the update does not
    faults = Faults()
    faults.fn = disk_of(room)
    e = faulty_engine(model, opt, faults, tmp_path, manage=ALL, kind="mlp")
    before = state_of(model, opt, e)
    with pytest.raises(StorageError) as err:
        run_step(model, opt, 0, e)
    assert_storage_error_names_the_filesystem(err.value, tmp_path)
    assert "reserving room" in str(err.value), "the commit point reserves before the update"
    assert not opt.state, "the optimizer must not have run"
    assert_same(before, state_of(model, opt, e), "after the failed step")
    del err
    room[0] = 1 << 40
    for step in range(3):
        run_step(model, opt, step, e)
        assert_same(ref[step], state_of(model, opt, e), f"step {step}")
    room[0] = e._mem.tier.stats()["file_bytes"]   # the disk is full now
    for step in (3, 4):
        run_step(model, opt, step, e)
        assert e.stats()["last_planned"]
    assert_same(ref[4], state_of(model, opt, e), "steps on a full disk")
    e.close()


def test_reserve_fails_before_anything_and_then_writes_cannot_fail_for_space(tmp_path):
    """FileTier.reserve: ENOSPC raised (with the file system and bytes) while nothing changed;
    once it succeeds, writes up to the reserved room never grow the file."""
    import numpy as np

    room = [1 << 20]
    with FileTier(tmp_path, _fault=disk_of(room)) as t:
        with pytest.raises(StorageError) as err:
            t.reserve([(None, 2 << 20)])
        assert_storage_error_names_the_filesystem(err.value, tmp_path)
        assert t.stats()["file_bytes"] == 0 and t.stats()["keys"] == 0
        t.reserve([(1, 600 << 10), (2, 400 << 10)])
        assert t.stats()["file_bytes"] == 1000 << 10
        room[0] = t.stats()["file_bytes"]   # the disk is full: writes into the reserved room succeed
        a = np.arange(600 << 8, dtype=np.float32)
        b = np.arange(400 << 8, dtype=np.float32)
        t.write_async(1, a, a.nbytes).result()
        t.write_async(2, b, b.nbytes).result()
        t.write_async(1, a, a.nbytes).result()   # a rewrite reuses its room
        t.reserve([(1, a.nbytes), (2, b.nbytes)])   # nothing more needed
        assert t.stats()["file_bytes"] == 1000 << 10
        out = np.empty_like(a)
        t.read_async(1, out).result()
        assert (out == a).all()


# -- faults: I/O errors, short transfers, corruption -----------------------------------------


def _eio(which):
    def fault(op, key, offset, length):
        if op == which:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    return fault


def _short(which):
    def fault(op, key, offset, length):
        if op == which:
            return 0   # the call moves nothing: a short read at once, a stalled write
    return fault


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["pwrite", "pread"])
@pytest.mark.parametrize("kind", ["eio", "short"])
def test_io_error_or_short_transfer_raises_in_the_training_thread(tmp_path, op, kind):
    """An I/O error or a short transfer on swap-out (pwrite) or swap-in (pread) is raised by the
    step in the training thread (at the next wait, at the latest at the commit point before the
    optimizer), never lost in an I/O thread, never a hang; the step is rolled back and the next
    one trains as in core."""
    model, opt = fresh()
    faults = Faults()
    e = faulty_engine(model, opt, faults, tmp_path)
    ref = reference("adam", 4)
    for step in range(2):
        run_step(model, opt, step, e)
    before = state_of(model, opt, e)
    faults.fn = (_eio if kind == "eio" else _short)(op)
    with pytest.raises(StorageError) as err:
        run_step(model, opt, 2, e)
    msg = str(err.value)
    assert re.search(r"swap-(in|out) of aten\.\w+\.\w+#\d+", msg), msg
    assert ("short transfer" if kind == "short" else "Input/output error") in msg, msg
    assert_same(before, state_of(model, opt, e), "after the failed step")
    faults.fn = None
    for step in (2, 3):
        run_step(model, opt, step, e)
    assert_same(ref[3], state_of(model, opt, e), "after the retry")
    e.close()


@pytest.mark.timeout(60)
def test_io_error_during_a_swapping_optimizer_step_is_raised_and_says_so(tmp_path):
    """manage=all: an I/O error on a read *during* the optimizer step (parameters and state are
    swapped in one by one) cannot be rolled back (GUARANTEES.md says so); it is raised in the
    training thread, says that the update was partial, and the engine closes cleanly."""
    baseline = set(threading.enumerate())
    model, opt = fresh(kind="mlp")
    faults = Faults()
    e = faulty_engine(model, opt, faults, tmp_path, manage=ALL, kind="mlp")
    for step in range(2):
        run_step(model, opt, step, e)
    started = threading.Event()
    opt.register_step_pre_hook(lambda *a: started.set())   # runs after the commit point
    faults.fn = lambda op, key, off, n: _eio("pread")(op, key, off, n) if started.is_set() else None
    with pytest.raises(StorageError) as err:
        run_step(model, opt, 2, e)
    assert "during the optimizer step" in str(err.value) and "checkpoint" in str(err.value)
    faults.fn = None
    del err
    e.close()
    assert set(threading.enumerate()) <= baseline
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_io_error_after_the_first_update_inside_the_backward_is_raised_and_says_so(tmp_path):
    """PyTorch's recipe of the update inside the backward applies a step one parameter at a
    time: an I/O error once the first update has begun cannot be rolled back either. It is
    raised in the training thread, says that some parameters were updated, and the engine
    closes cleanly."""
    baseline = set(threading.enumerate())
    model, opt = fresh(kind="mlp")
    faults = Faults()
    e = faulty_engine(model, opt, faults, tmp_path, manage=ALL, kind="mlp")
    update_in_backward(model, opt)

    def step(k: int) -> None:
        x, y = batch(k)
        with e.step():
            F.cross_entropy(model(x), y).backward()

    for k in range(2):
        step(k)
    started = threading.Event()
    opt.register_step_pre_hook(lambda *a: started.set())   # runs after the commit point
    faults.fn = lambda op, key, off, n: _eio("pread")(op, key, off, n) if started.is_set() else None
    with pytest.raises(StorageError) as err:
        step(2)
    message = str(err.value)   # inside an update's step(), or between two of them
    assert ("during the optimizer step" in message or "after the step's first update" in message), message
    assert "keep their new values" in message and "checkpoint" in message, message
    assert err.value.step_applied is True   # not taken back: some parameters are updated
    faults.fn = None
    del err
    e.close()
    assert set(threading.enumerate()) <= baseline
    assert os.listdir(tmp_path) == []


def test_the_commit_point_inside_the_backward_does_not_wait_for_transfers(monkeypatch):
    """With the update inside the backward, the transfers after the first update follow it
    whatever the commit point waits for: it waits for none (only those already failed raise).
    After the backward, as ``optimizer.step()`` is usually called, it drains them."""
    from ooc.runtime.executor import PlanExecutor

    calls: list[bool] = []
    wait = PlanExecutor.wait_for_transfers

    def spy(self, drain: bool = True) -> None:
        calls.append(drain)
        wait(self, drain)

    monkeypatch.setattr(PlanExecutor, "wait_for_transfers", spy)
    for inside in (False, True):
        model, opt = fresh(kind="mlp")
        e = OutOfCore(model, opt, budget=managed_peak("adam", ALL, kind="mlp") // 4, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
        if inside:
            update_in_backward(model, opt)
        calls.clear()
        for k in range(3):
            x, y = batch(k)
            with e.step():
                F.cross_entropy(model(x), y).backward()
                if not inside:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        e.close()
        assert calls and all(drain is not inside for drain in calls), (inside, calls)


def test_a_planned_step_reserves_its_writes_at_its_first_update_only(monkeypatch):
    """With the update inside the backward, ``optimizer.step()`` runs once per parameter and
    each call is a commit point; a planned step reserves the tier's room for all its writes at
    the first one (each later call still raises the transfers that failed), a step without a
    plan at every one (the optimizer's state may be born in between)."""
    from ooc.storage.file_tier import FileTier

    reserves: list[int] = []
    reserve = FileTier.reserve

    def spy(self, writes) -> None:
        reserves.append(len(writes))
        reserve(self, writes)

    monkeypatch.setattr(FileTier, "reserve", spy)
    model, opt = fresh(kind="mlp")
    e = OutOfCore(model, opt, budget=managed_peak("adam", ALL, kind="mlp") // 4, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    update_in_backward(model, opt)
    updates = sum(p.requires_grad for p in model.parameters())
    per_step = []
    for k in range(4):
        x, y = batch(k)
        reserves.clear()
        with e.step():
            F.cross_entropy(model(x), y).backward()
        per_step.append((e.stats()["last_planned"], len(reserves)))
    e.close()
    assert updates > 1 and per_step[-1] == (1, 1), per_step
    assert all(n == updates for planned, n in per_step if not planned), per_step


@pytest.mark.timeout(60)
def test_corrupted_swap_bytes_are_detected_and_named(tmp_path):
    """verify=True: one byte flipped in the swap file between swap-out and swap-in raises
    StorageError naming the variable (the plan's name of the activation) and the chunk; the step
    is rolled back and the next one trains as in core."""
    model, opt = fresh()
    faults = Faults()
    e = faulty_engine(model, opt, faults, tmp_path, verify=True)
    ref = reference("adam", 4)
    for step in range(2):
        run_step(model, opt, step, e)
    before = state_of(model, opt, e)
    flipped = []

    def flip(op, key, offset, length):
        if op == "pread" and not flipped:   # the bytes on storage change before they are read
            fd = os.open(f"/proc/self/fd/{e._mem.tier._file.fd}", os.O_RDWR)
            try:
                b = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            flipped.append(offset)

    faults.fn = flip
    with pytest.raises(StorageError) as err:
        run_step(model, opt, 2, e)
    msg = str(err.value)
    assert flipped and "corrupted" in msg and "CRC-32 mismatch" in msg, msg
    name = re.search(r"swap-in of (\S+) \(activation", msg).group(1)
    assert name in {v.name for v in e._plans.schedule.sequence.variables.values()}, name
    assert_same(before, state_of(model, opt, e), "after the failed step")
    faults.fn = None
    for step in (2, 3):
        run_step(model, opt, step, e)
    assert_same(ref[3], state_of(model, opt, e), "after the retry")
    e.close()


# -- exceptions and interrupts in the middle of a step ----------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where, manage", [
    ("forward", ("activations",)), ("loss", ("activations",)), ("backward", ("activations",)),
    ("forward", ALL), ("backward", ALL), ("interrupt", ("activations",)),
])
def test_exception_in_the_step_rolls_back_and_training_continues(tmp_path, where, manage):
    """An exception in the user's forward (after BatchNorm updated its statistics), in the loss,
    or in the middle of the backward (after some gradients exist), or a KeyboardInterrupt, on
    step 3: the same exception reaches the caller; transfers are finished, the pool and the
    tier hold nothing of the step; parameters, buffers, grads and optimizer state are bitwise
    as before; the next steps train exactly as in core."""
    model, opt = fresh()
    e = faulty_engine(model, opt, Faults(), tmp_path, manage=manage)
    ref = reference("adam", 5)
    for step in range(3):
        run_step(model, opt, step, e)
    persistent_keys = e._mem.tier.stats()["keys"]
    before = state_of(model, opt, e)
    model.fail = None if where == "loss" else where
    expected = {"forward": RuntimeError, "backward": RuntimeError, "loss": ValueError,
                "interrupt": KeyboardInterrupt}[where]
    with pytest.raises(expected):
        run_step(model, opt, 3, e, loss_fail=where == "loss")
    model.fail = None
    assert_same(before, state_of(model, opt, e), f"after a failure in the {where}")
    assert live_pool_allocations(e) == 0
    assert e._mem.tier.stats()["keys"] <= persistent_keys, "the failed step's activations left the tier"
    for step in (3, 4):
        run_step(model, opt, step, e)
    assert_same(ref[4], state_of(model, opt, e), "after the failed step")
    e.close()


@pytest.mark.timeout(60)
def test_failed_step_during_gradient_accumulation_names_the_partial_gradients(tmp_path):
    """The limit GUARANTEES.md states: gradients accumulated by earlier steps that the failed
    backward already added to cannot be restored; the exception says which, everything else
    is rolled back."""
    model, opt = fresh()
    e = faulty_engine(model, opt, Faults(), tmp_path)
    x, y = batch(0)
    with e.step():   # accumulate, no optimizer step
        F.cross_entropy(model(x), y).backward()
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    model.fail = "backward"
    with pytest.raises(RuntimeError) as err:
        with e.step():
            F.cross_entropy(model(x), y).backward()
    notes = getattr(err.value, "__notes__", [])
    assert any("head.weight" in n and "zero_grad" in n for n in notes), notes
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in buffers.items())
    e.close()


@pytest.mark.timeout(60)
def test_keyboard_interrupt_leaves_no_thread_and_no_file(tmp_path):
    baseline = set(threading.enumerate())
    model, opt = fresh()
    e = OutOfCore(model, opt, budget=managed_peak("adam", ALL) // 4, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL, storage=str(tmp_path))
    for step in range(2):
        run_step(model, opt, step, e)
    assert set(threading.enumerate()) > baseline, "the tier's I/O threads run"
    model.fail = "interrupt"
    with pytest.raises(KeyboardInterrupt):
        run_step(model, opt, 2, e)
    e.close()
    assert set(threading.enumerate()) <= baseline
    assert os.listdir(tmp_path) == []


# Subprocess scenarios: a child trains the tiny model, prints "ready" from inside a step, and
# the parent signals it (no timing: the child waits for the signal there).
_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from test_reliability import fresh, run_step, managed_peak, ALL, CHUNK
    from ooc.engine import Options, OutOfCore

    mode, storage = sys.argv[1], sys.argv[2]
    if mode == "sigterm-exit":   # the user's choice: turn SIGTERM into SystemExit
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))
    model, opt = fresh()
    e = OutOfCore(model, opt, budget=managed_peak("adam", ALL) // 4, manage=ALL, storage=storage,
                  options=Options(chunk=CHUNK, min_bytes=4096))
    for step in range(2):
        run_step(model, opt, step, e)

    def wait_here(module, inputs, output):
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{{fd}}"))
            except OSError:   # the descriptor listdir itself used
                pass
        inside = [f for f in fds if f.startswith(e._mem.tier.directory + "/")]   # files, not the dir
        print("ready", json.dumps(inside), flush=True)
        while True:
            time.sleep(0.05)

    model.body[6].register_forward_hook(wait_here)   # mid-forward, swaps in flight
    run_step(model, opt, 2, e)
""")


def _signal_child(tmp_path, mode: str, sig: int) -> tuple[int, str, str]:
    storage = tmp_path / "swap"
    storage.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(tests=str(Path(__file__).parent)), mode, str(storage)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = child.stdout.readline()
        assert line.startswith("ready"), child.stderr.read()
        swap_fds = json.loads(line.split(" ", 1)[1])
        assert swap_fds and all("(deleted)" in f for f in swap_fds), swap_fds
        os.kill(child.pid, sig)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, str(storage), err


def _files_under(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_mid_step_leaves_no_swapped_bytes_and_the_next_engine_sweeps(tmp_path, sig):
    """SIGTERM (no handler: the engine installs none, see GUARANTEES.md) or SIGKILL in the
    middle of a step: the swap file was unlinked from birth, so no file is left; only the
    empty private directory remains, and the next engine on the same parent removes it."""
    code, storage, err = _signal_child(tmp_path, "plain", sig)
    assert code == -sig, err
    assert _files_under(storage) == [], "no swapped byte may stay on disk"
    left = os.listdir(storage)
    assert len(left) == 1 and left[0].startswith(PREFIX)
    model, opt = fresh()
    e = OutOfCore(model, opt, budget="1MiB", options=Options(chunk=CHUNK), storage=storage)
    assert left[0] not in os.listdir(storage), "the stale directory of the dead process is swept"
    e.close()
    assert os.listdir(storage) == []


@pytest.mark.timeout(120)
def test_sigterm_turned_into_exit_by_the_user_cleans_up_everything(tmp_path):
    """With the usual handler (SIGTERM -> sys.exit), the step unwinds like any exception and
    the interpreter's exit closes the engine: the storage directory is empty."""
    code, storage, err = _signal_child(tmp_path, "sigterm-exit", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert os.listdir(storage) == [], "nothing left, not even the private directory"


_SIGINT_CHILD = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from test_reliability import (ALL, Faults, assert_same, faulty_engine, fresh, reference, run_step,
                                  state_of)

    storage, where = sys.argv[1], sys.argv[2]
    # Python leaves SIGINT ignored if it started ignored (a job run with & by a shell):
    # this child needs Ctrl-C's KeyboardInterrupt whatever it inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    baseline = set(threading.enumerate())
    model, opt = fresh()
    faults = Faults()
    # Swap only: the plan does not depend on measured op times, so the reads are the same each step.
    e = faulty_engine(model, opt, faults, storage, manage=ALL, recompute="never")
    updating = []
    opt.register_step_pre_hook(lambda *a: updating.append(1))
    # Writes from the update's start to the step's end: counted once the tier has drained
    # (the I/O threads may write them after the update returned).
    writes = []
    faults.fn = lambda op, *a: writes.append(1) if op == "pwrite" and updating else None
    for step in range(2):
        run_step(model, opt, step, e)
        e._mem.tier.drain()
        updating.clear()
    opt.register_step_post_hook(lambda *a: updating.clear())
    before = state_of(model, opt, e)
    seen = []

    def interrupt_then_stall(op, key, offset, length):
        # "before": Ctrl-C at the step's first read before the update, while the training
        # thread may wait for it
        if op == "pread" and not updating and not seen:
            seen.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)

    def halves(params, *rest, **kw):
        # "update": Ctrl-C between two parameters' updates, from the training thread, which
        # acts on it at its next instruction: with the signal not held, the second half of
        # the parameters would not be updated
        n, cut = len(params) // 2, lambda part: [x[part] if isinstance(x, list) and len(x) == len(params) else x
                                                 for x in rest]
        single(params[:n], *cut(slice(0, n)), **kw)
        seen.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        single(params[n:], *cut(slice(n, None)), **kw)

    if where == "update":
        import torch.optim.adam as adam_module
        single, adam_module._single_tensor_adam = adam_module._single_tensor_adam, halves
    else:
        faults.fn = interrupt_then_stall
    try:
        run_step(model, opt, 2, e)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    if where == "update":
        adam_module._single_tensor_adam = single
    faults.fn = None
    ref = reference("adam", 4)
    after = state_of(model, opt, e)
    outcome = "partial"
    # Completed: the update is whole; the gradients are as plain PyTorch leaves them when
    # Ctrl-C comes between optimizer.step() and zero_grad(), except the managed ones, given
    # back after the update as the plan does: None. Either way the next step zeroes them.
    for name, expected in (("rolled back", before), ("completed", {{**ref[2], "grads": {{}}}})):
        try:
            assert_same(expected, after)
            outcome = name
        except AssertionError:
            pass
    opt.zero_grad(set_to_none=True)
    for step in ((2, 3) if outcome == "rolled back" else (3,)):
        run_step(model, opt, step, e)
    assert_same(ref[3], state_of(model, opt, e), "after the retry")
    e.close()
    print(json.dumps({{"interrupted": interrupted, "sent": bool(seen), "outcome": outcome,
                      "update_writes": len(writes),
                      "threads_left": sorted(t.name for t in set(threading.enumerate()) - baseline)}}))
""")


def _sigint_child(tmp_path, where: str) -> dict:
    from forked import run_python   # tests/ (the children, which import this file, lack it)

    child = run_python(["-c", _SIGINT_CHILD.format(tests=str(Path(__file__).parent)), str(tmp_path), where],
                       cwd=ROOT, timeout=100)
    assert child.returncode == 0, child.stderr[-3000:]
    r = json.loads(child.stdout.strip().splitlines()[-1])
    assert os.listdir(tmp_path) == []
    return r


@pytest.mark.timeout(120)
def test_ctrl_c_while_waiting_for_a_transfer_is_rolled_back(tmp_path):
    """SIGINT arrives while the training thread waits for a swap-in before the update: the
    engine waits for the transfer before it lets go of its buffer, rolls the step back and
    raises KeyboardInterrupt; the next steps train as in core; close leaves no thread, no file.
    (In a child process: a stray KeyboardInterrupt must not stop this test session.)"""
    r = _sigint_child(tmp_path, "before")
    assert r["interrupted"] and r["sent"] and r["threads_left"] == [], r
    # A signal is acted on at the main thread's next Python instruction: under load that can
    # be past the commit point, where the update it is held for completes (test below).
    assert r["outcome"] in ("rolled back", "completed"), r


@pytest.mark.timeout(120)
def test_ctrl_c_during_the_update_waits_for_the_whole_update(tmp_path):
    """SIGINT halfway through an optimizer update that swaps parameters and state: the update
    is past the point of rollback, so the engine holds the signal until the update is whole,
    then raises KeyboardInterrupt. The step is complete, never half-applied (before the
    signal was held, the interrupt left some parameters updated and the others not)."""
    r = _sigint_child(tmp_path, "update")
    assert r["update_writes"] >= 4, f"the update must write to the tier for this test to mean anything: {r}"
    assert r == {"interrupted": True, "sent": True, "outcome": "completed",
                 "update_writes": r["update_writes"], "threads_left": []}, r


@pytest.mark.timeout(120)
def test_gradients_given_back_after_the_update_are_never_read_as_freed_memory(tmp_path):
    """With grads managed, the plan gives a gradient's bytes back after its last use in the
    update when the recorded step set it to None there. A later step that reads it after
    ``optimizer.step()`` (logging a norm every N steps) raises OOCError naming the tensor and
    the op; a step that fails between ``optimizer.step()`` and ``zero_grad()`` leaves those
    gradients None. Both read freed memory before (a segfault). The update itself is whole
    and training continues bitwise."""
    model, opt = fresh()
    e = OutOfCore(model, opt, budget=managed_peak("adam", ALL) // 4, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL, storage=str(tmp_path), recompute="never")
    ref = reference("adam", 5)
    for step in range(2):
        run_step(model, opt, step, e)
    x, y = batch(2)
    with pytest.raises(OOCError, match=r"reads \S+\.grad .* gave back after its last use"):
        with e.step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sum(p.grad.norm() for p in model.parameters())
    opt.zero_grad(set_to_none=True)
    assert_same(ref[2], state_of(model, opt, e), "after the read")
    x, y = batch(3)
    with pytest.raises(ValueError, match="after the update") as err:
        with e.step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            raise ValueError("after the update")
    assert any("were given back after the update" in n for n in err.value.__notes__)
    managed = [n for n, p in model.named_parameters() if p.numel() * 4 >= 4096]
    assert managed and all(p.grad is None for n, p in model.named_parameters() if n in managed)
    opt.zero_grad(set_to_none=True)
    assert_same(ref[3], state_of(model, opt, e), "after the failure")
    run_step(model, opt, 4, e)
    assert_same(ref[4], state_of(model, opt, e), "next step")
    e.close()


# -- budget changes ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_budget_changes_between_steps_replan_and_stay_identical(tmp_path):
    model, opt = fresh()
    peak = managed_peak("adam", ALL)
    e = OutOfCore(model, opt, budget=peak // 2, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL,
                  storage=str(tmp_path))
    ref = reference("adam", 8)
    budgets = {2: peak // 4, 4: peak * 2, 6: peak // 3}
    for step in range(8):
        if step in budgets:
            plans = e.stats()["plans"]
            e.set_budget(budgets[step])
        run_step(model, opt, step, e)
        if step in budgets:
            assert e.stats()["plans"] > plans and e.stats()["budget"] == budgets[step]
            assert e._plans.schedule.budget == budgets[step]
        assert_same(ref[step], state_of(model, opt, e), f"step {step}")
    assert e.stats()["plan.peak_resident_bytes"] <= peak // 3
    e.close()


# -- bad input: arguments ---------------------------------------------------------------------


def test_budget_units_are_distinct_and_both_valid(tmp_path):
    model, opt = fresh()
    with OutOfCore(model, opt, budget="16 GB", storage=str(tmp_path)) as a:
        assert a.stats()["budget"] == 16 * 10**9
    with OutOfCore(model, opt, budget="16GiB", storage=str(tmp_path)) as b:
        assert b.stats()["budget"] == 16 * 2**30


@pytest.mark.parametrize("bad, words", [
    ({"budget": None}, "expected a byte size"), ({"budget": True}, "expected a byte size"),
    ({"budget": float("nan")}, "positive"), ({"budget": "-1GiB"}, "not a size"),
    ({"budget": ""}, "not a size"), ({"budget": "1 GiBs"}, "not a size"),
    ({"budget": "1GiB", "chunk": 0}, "chunk: must be"), ({"budget": "1GiB", "chunk": "1000"}, "granularity"),
    ({"budget": "1GiB", "window": -1}, "window: must be"), ({"budget": "1GiB", "min_bytes": "lots"}, "not a size"),
    ({"budget": "1GiB", "threads": 0}, "threads must be"),
    ({"budget": "1GiB", "manage": "everything"}, "unknown kind"),
    ({"budget": "1GiB", "arena": "gpu"}, "arena must be"),
    ({"budget": "1GiB", "arena": "pytorch"}, "for CUDA devices"),   # on the CPU: one arena already
    ({"budget": "1GiB", "budget_covers": "device"}, "budget_covers must be"),
])
def test_more_bad_arguments_fail_before_any_work(tmp_path, bad, words):
    """Extends test_engine.py's list: one clear OOCError, and nothing done — no directory, no
    thread, the optimizer untouched."""
    model, opt = fresh()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    threads = set(threading.enumerate())
    options = {k: bad.pop(k) for k in ("chunk", "window", "min_bytes", "threads", "arena", "budget_covers") if k in bad}
    with pytest.raises(OOCError, match=words):
        OutOfCore(model, opt, storage=str(tmp_path), manage=bad.pop("manage", ALL), options=Options(**options), **bad)
    assert os.listdir(tmp_path) == [] and set(threading.enumerate()) <= threads
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


@pytest.mark.parametrize("device, arena, resolved", [
    ("cpu", "auto", "pool"), ("cpu", "pool", "pool"), ("cuda", "auto", "pytorch"),
    ("cuda:1", "auto", "pytorch"), ("cuda", "pool", "pool"), ("cuda", "pytorch", "pytorch"),
])
def test_the_default_arena_is_one_arena_on_cuda_and_the_pool_on_the_cpu(tmp_path, device, arena, resolved):
    """Options(arena="auto"), the default: PyTorch's allocator on CUDA (measured on the H100:
    less peak at the same speed), ooc's pool on the CPU; and on the CPU the engine gets it."""
    from ooc.runtime.torch_arena import resolve_arena

    assert Options().arena == "auto" and resolve_arena(device, arena) == resolved
    if device == "cpu":
        model, opt = fresh()
        with OutOfCore(model, opt, budget="1MiB", storage=str(tmp_path), options=Options(chunk=CHUNK, arena=arena)) as e:
            assert e._mem.arena == "pool" and type(e._mem.pool).__name__ == "CpuDevicePool"


def test_bad_budget_in_set_budget_keeps_the_old_one(tmp_path):
    model, opt = fresh()
    with OutOfCore(model, opt, budget="1MiB", options=Options(chunk=CHUNK), storage=str(tmp_path)) as e:
        for bad in (0, -1, "x", "1 KiB"):
            with pytest.raises(OOCError):
                e.set_budget(bad)
        assert e._mem.budget == 1 << 20
        run_step(model, opt, 0, e)


def test_model_on_another_device_is_refused(tmp_path):
    model, opt = fresh()
    model.to("meta")
    with pytest.raises(OOCError, match="is on meta.*model.to"):
        OutOfCore(model, opt, budget="1GiB", storage=str(tmp_path))
    assert os.listdir(tmp_path) == []


# -- models the plan cannot foresee ------------------------------------------------------------


class Branchy(Tiny):
    """Data-dependent control flow: an extra block when the batch mean is positive."""

    def __init__(self) -> None:
        super().__init__(blocks=3)
        self.extra = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if x.mean() > 0:
            h = h + self.extra(h)
        return self.head(F.adaptive_avg_pool2d(h, 4).flatten(1))


@pytest.mark.timeout(60)
def test_data_dependent_branch_diverges_and_stays_identical(tmp_path):
    torch.manual_seed(0)
    ref, ref_opt = Branchy(), None
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    branches = [bool(batch(s)[0].mean() > 0) for s in range(8)]
    assert len(set(branches)) == 2, "the data must take both branches"
    e = OutOfCore(model, opt, budget=managed_peak("sgd", ALL) // 2, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL, storage=str(tmp_path))
    diverged = 0
    for step in range(8):
        run_step(ref, ref_opt, step)
        run_step(model, opt, step, e)
        diverged += e.stats()["last_diverged_at"] != -1
        assert_same(state_of(ref, ref_opt), state_of(model, opt, e), f"step {step}")
    assert diverged >= 1
    e.close()


@pytest.mark.timeout(60)
def test_activation_held_by_the_user_across_steps_stays_correct(tmp_path):
    """The user keeps an activation of step k (one the plan swaps out and releases) and reads it
    in step k+1. Swapping copies bytes out and never writes into the user's tensor: it keeps its
    value (checked against a copy after each step), and training stays identical to in core
    doing the same."""
    def train(engine_kw):
        model, opt = fresh()
        held: list[torch.Tensor] = []
        model.body[3].register_forward_hook(lambda m, i, o: held.append(o))
        e = OutOfCore(model, opt, **engine_kw) if engine_kw else None
        prev = prev_copy = None
        reads = []
        for step in range(5):
            x, y = batch(step)
            with e.step() if e else contextlib.nullcontext():
                if prev is not None:   # read last step's activation inside this step
                    reads.append(prev.detach().double().sum())
                loss = F.cross_entropy(model(x), y)
                cur = held.pop()
                cur_copy = cur.detach().clone()
                loss.backward()
                if e:
                    e.optimizer_step()
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            assert torch.equal(cur, cur_copy), f"step {step}: the held activation changed"
            if prev is not None:
                assert torch.equal(prev, prev_copy), f"step {step}: last step's activation changed"
            prev, prev_copy = cur, cur_copy
        if e:
            assert e.stats()["bytes_out"] > 0
            e.close()
        return state_of(model, opt), reads

    ref_state, ref_reads = train(None)
    state, reads = train({"budget": managed_peak("adam", ALL) // 4, "options": Options(chunk=CHUNK, min_bytes=4096),
                          "manage": ALL, "storage": str(tmp_path)})
    assert_same(ref_state, state, "holding an activation")
    assert len(reads) == len(ref_reads) == 4
    assert all(torch.equal(a, b) for a, b in zip(ref_reads, reads))
