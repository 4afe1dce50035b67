"""Reads and writes between steps of managed tensors larger than the budget (issue 40, item 1).

With every kind managed and the parameters alone larger than the budget, a step ends with
parameters, gradients and Adam's state on the tier: 0-byte storages under tensors that keep
their shapes. ``sum(p.sum() for p in model.parameters())`` or a read of ``exp_avg`` there was a
segfault (``ooc/runtime/slots.py``'s ``release`` resizes the storage to 0 bytes, and PyTorch
does not bounds-check a kernel's read). Now every such tensor is watched between steps
(``ooc/runtime/watched.py``) and a use brings back what it uses, within the budget where it can
(``ooc/engine/between_steps.py``). Each scenario runs in a child process, against the same
loop in core, bitwise: before the fix the child died of SIGSEGV, which fails the test and
not pytest.
"""

from __future__ import annotations

import contextlib
import gc
import io

import pytest
import torch
import torch.nn.functional as F

import ooc
import ooc.testing
from test_reliability import ALL, CHUNK, batch, fresh, run_step
from in_child import run_in_child
from ooc.engine import Options, OutOfCore


def _in_child(name: str, *args: str) -> None:
    run_in_child(__file__, name, *args)


class _Pair:
    """The same MLP trained in core and under an engine managing every kind, with a budget of
    half the parameters' bytes (the parameters alone exceed it), on the same data."""

    def __init__(self, opt: str = "adam", device: str = "cpu") -> None:
        self.ref, self.ref_opt = fresh(opt, kind="mlp", depth=8)
        self.model, self.opt = fresh(opt, kind="mlp", depth=8)
        self.params = sum(p.untyped_storage().nbytes() for p in self.model.parameters())
        self.budget = self.params // 2
        self.engine = OutOfCore(self.model, self.opt, budget=self.budget, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL, device=device)
        self.steps = 0

    def step(self) -> None:
        run_step(self.ref, self.ref_opt, self.steps)
        run_step(self.model, self.opt, self.steps, self.engine)
        self.steps += 1
        assert self.on_tier(), "the test needs managed tensors on the tier between steps"

    def on_tier(self) -> set[str]:
        """What the engine holds on the tier now: "param", "grad", "optimizer_state"."""
        return {s.kind.value for s in self.engine._store.slots.values() if s.state.value == "host"}

    def both(self):
        return ((self.ref, self.ref_opt), (self.model, self.opt))

    def stat(self, key: str) -> int:
        return self.engine.stats()[f"between_steps.{key}"]

    def assert_same(self, when: str) -> None:
        """Parameters and optimizer state bitwise as in core (read plainly, between steps)."""
        for (n, a), b in zip(self.ref.named_parameters(), self.model.parameters(), strict=True):
            assert torch.equal(a, b), f"{n} differs {when}"
            for key, x in self.ref_opt.state[a].items():
                assert torch.equal(x, self.opt.state[b][key]), f"{n}.{key} differs {when}"


def _state(opt: torch.optim.Optimizer, key: str) -> list[torch.Tensor]:
    return [opt.state[p][key] for g in opt.param_groups for p in g["params"]]


def reads(device: str = "cpu") -> None:
    """The reads users make between steps: weight norms (grad mode on), Adam's ``exp_avg``
    and ``exp_avg_sq``, an EMA copy kept and updated across steps, ``model.state_dict()``,
    an evaluation forward under ``torch.no_grad()``; metadata-only reads bring nothing back."""
    with ooc.testing.fake_cuda(memory_bytes=1 << 30, granularity=CHUNK) if device == "cuda-fake" \
            else contextlib.nullcontext():
        pair = _Pair(device="cuda" if device == "cuda-fake" else "cpu")
        emas = [None, None]
        for _ in range(4):
            pair.step()
            assert {"param", "optimizer_state"} <= pair.on_tier()
            norms = [sum(p.sum() for p in m.parameters()) for m, _ in pair.both()]   # was a segfault
            assert torch.equal(*norms), "sum of the parameters"
            before = pair.stat("bytes_in")
            assert before > 0, "the sum brought bytes back"
            assert sum(p.numel() for p in pair.model.parameters()) > 0
            assert all(p.grad is None and p.requires_grad for p in pair.model.parameters())
            assert pair.stat("bytes_in") == before, "metadata reads brought bytes back"
            for key in ("exp_avg", "exp_avg_sq"):
                for a, b in zip(*(_state(o, key) for _, o in pair.both()), strict=True):
                    assert torch.equal(a, b) and torch.equal(a.norm(), b.norm()), key
            for i, (m, _) in enumerate(pair.both()):
                if emas[i] is None:
                    emas[i] = [p.detach().clone() for p in m.parameters()]
                else:
                    with torch.no_grad():
                        for e, p in zip(emas[i], m.parameters()):
                            e.mul_(0.9).add_(p, alpha=0.1)
            assert all(torch.equal(a, b) for a, b in zip(*emas, strict=True)), "EMA"
            with torch.no_grad():
                x, _ = batch(100 + pair.steps)
                outs = [m.eval()(x) for m, _ in pair.both()]
                [m.train() for m, _ in pair.both()]
            assert torch.equal(*outs), "evaluation forward"
            assert pair.stat("bytes_in") > before, "the reads brought bytes back"
            assert pair.stat("peak_resident_bytes") <= pair.budget, "reads under no_grad stay within the budget"
            sds = [m.state_dict() for m, _ in pair.both()]
            assert all(torch.equal(a, sds[1][k]) for k, a in sds[0].items()), "state_dict"
            del sds
        for _ in range(2):
            pair.step()
        pair.assert_same("after reads between steps")
        pair.engine.close()


def writes() -> None:
    """Writes between steps: an in-place edit under ``torch.no_grad()``, one state tensor
    zeroed, weights loaded by ``copy_``, by ``load_state_dict`` and by ``.data =``; training
    goes on bitwise as in core doing the same."""
    pair = _Pair()
    pair.step()
    pair.step()
    saved = {k: v.clone() for k, v in pair.ref.state_dict().items()}
    edits = [
        lambda m, o: [p.mul_(0.5) for p in m.parameters()],
        lambda m, o: _state(o, "exp_avg")[2].zero_(),
        lambda m, o: [p.copy_(saved[n]) for n, p in m.named_parameters()],
        lambda m, o: m.load_state_dict({k: v.clone() for k, v in saved.items()}),
        lambda m, o: [setattr(p, "data", saved[n].clone() * 2) for n, p in m.named_parameters()],
    ]
    for edit in edits:
        with torch.no_grad():
            for m, o in pair.both():
                edit(m, o)
        pair.assert_same("right after an edit between steps")
        pair.step()
        pair.step()
        pair.assert_same("after an edit between steps")
    pair.engine.close()


def gradients() -> None:
    """Gradients kept between steps (a backward-only step, then the update in a step of its
    own): ``clip_grad_norm_`` outside a step reads and scales them (its norm and the training
    as in core); a backward between steps (a penalty) adds into them, after reads that make
    room; a gradient the user keeps while ``zero_grad()`` drops it keeps its values."""
    pair = _Pair()
    pair.step()

    def backward(m, e, i):
        x, y = batch(i)
        with e.step() if e is not None else contextlib.nullcontext():
            F.cross_entropy(m(x), y).backward()

    def update(o, e):
        with e.step() if e is not None else contextlib.nullcontext():
            o.step()
            o.zero_grad(set_to_none=True)

    engines = (None, pair.engine)
    for i in range(3):
        for (m, o), e in zip(pair.both(), engines):
            backward(m, e, 10 + i)
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) for m, _ in pair.both()]
        assert torch.equal(*norms), "clip_grad_norm_ between steps"
        for (m, o), e in zip(pair.both(), engines):
            penalty = sum((p * p).sum() for p in m.parameters())
            with torch.no_grad():   # reads that make room (autograd holds the parameters)
                _ = [s.norm() for s in _state(o, "exp_avg")]
            penalty.backward()
        grads = [[p.grad for p in m.parameters()] for m, _ in pair.both()]
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), "gradients"
        for (m, o), e in zip(pair.both(), engines):
            update(o, e)
        pair.assert_same(f"after update {i}")
    for (m, o), e in zip(pair.both(), engines):
        backward(m, e, 20)
    kept = [[p.grad for p in m.parameters()] for m, _ in pair.both()]
    for m, o in pair.both():
        o.zero_grad(set_to_none=True)
    pair.step()
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True)), "a kept gradient after zero_grad()"
    pair.assert_same("at the end")
    pair.engine.close()


def aliases() -> None:
    """What PyTorch shares with other tensors between steps: views kept while other reads make
    room, a ``state_dict()`` kept across a step (its entries alias the parameters), a NumPy
    export (the storage becomes non-resizable: the next step released it before), copies
    (``copy.deepcopy``, ``torch.save``) of parameters and state; training goes on bitwise."""
    import copy
    pair = _Pair()
    pair.step()
    views = [[p.t() for p in m.parameters()] for m, _ in pair.both()]
    with torch.no_grad():
        _ = [[s.norm() for s in _state(o, "exp_avg")] for _, o in pair.both()]
    assert all(torch.equal(a, b) for a, b in zip(*views, strict=True)), "views kept between reads"
    del views
    kept = [m.state_dict() for m, _ in pair.both()]
    pair.step()
    assert all(torch.equal(a, kept[1][k]) for k, a in kept[0].items()), "a state_dict kept across a step"
    del kept
    arrays = [[p.detach().numpy().sum() for p in m.parameters()] for m, _ in pair.both()]
    assert arrays[0] == arrays[1], "numpy"
    pair.step()
    copies = [copy.deepcopy([*m.parameters(), *_state(o, "exp_avg")]) for m, o in pair.both()]
    assert all(type(c) in (torch.Tensor, torch.nn.Parameter) for c in copies[1])
    assert all(torch.equal(a, b) for a, b in zip(*copies, strict=True)), "deepcopy"
    buf = io.BytesIO()
    torch.save([*pair.model.parameters(), *_state(pair.opt, "exp_avg_sq")], buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(torch.equal(a, b) for a, b in
               zip([*pair.ref.parameters(), *_state(pair.ref_opt, "exp_avg_sq")], loaded, strict=True)), "torch.save"
    pair.step()
    pair.assert_same("after aliases between steps")
    pair.engine.close()


def engine_gone() -> None:
    """A managed tensor read after its engine was collected without ``close()``: one on the tier
    (the engine held the only copy) raises an ``OOCError`` naming it, never a read of freed
    memory; one in memory reads as in core."""
    pair = _Pair()
    pair.step()
    params = dict(pair.model.named_parameters())
    ref = dict(pair.ref.named_parameters())

    def tensor(named, opt, name):
        owner, _, key = name.rpartition(".")
        return opt.state[named[owner]][key] if key in ("exp_avg", "exp_avg_sq") else named[name]

    pair.step()
    resident = "net.0.weight"
    tensor(params, pair.opt, resident).sum()   # a use brings it back from the tier
    states = {s.name: s.state.value for s in pair.engine._store.slots.values()}
    on_tier = "net.8.weight.exp_avg"
    assert states[on_tier] == "host" and states[resident] == "resident", states
    kept = [tensor(params, pair.opt, n) for n in (on_tier, resident)]
    expected = tensor(ref, pair.ref_opt, resident)
    del pair, params
    gc.collect()
    with pytest.raises(ooc.OOCError, match=r"net\.8\.weight\.exp_avg was on the tier .*collected without close"):
        kept[0].sum()
    assert torch.equal(kept[1], expected) and type(kept[1]) in (torch.Tensor, torch.nn.Parameter)


def distillation() -> None:
    """A teacher managed by one engine (every kind, over its budget) read inside the steps of
    another engine that trains a student: the teacher's reads bring its tensors back within
    its own budget, outside the student engine's dispatch mode; both bitwise as in core."""
    teacher, student = _Pair(), _Pair("sgd")
    teacher.step()
    models = ((teacher.ref, student.ref, student.ref_opt, None),
              (teacher.model, student.model, student.opt, student.engine))
    for i in range(4):
        for t, s, opt, engine in models:
            x, _ = batch(50 + i)
            with engine.step() if engine is not None else contextlib.nullcontext():
                with torch.no_grad():
                    target = t(x).softmax(-1)
                F.kl_div(s(x).log_softmax(-1), target, reduction="batchmean").backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert student.engine.stats()["last_planned"] == 1
    assert teacher.stat("bytes_in") > 0 and teacher.stat("peak_resident_bytes") <= teacher.budget
    teacher.assert_same("(teacher)")
    student.assert_same("(student)")


@pytest.mark.parametrize("device", ["cpu", "cuda-fake"])
def test_reads_between_steps_give_in_core_values_within_the_budget(device: str) -> None:
    _in_child("reads", device)


def test_writes_between_steps_land_and_training_stays_bitwise() -> None:
    _in_child("writes")


def test_gradients_read_clipped_and_accumulated_between_steps() -> None:
    _in_child("gradients")


def test_views_exports_and_copies_between_steps() -> None:
    _in_child("aliases")


def test_a_read_after_the_engine_is_gone_names_the_tensor() -> None:
    _in_child("engine_gone")


def test_a_teacher_read_inside_another_engines_steps() -> None:
    _in_child("distillation")
