"""The per-op path of a planned step that moves nothing stays lean, and does the same work.

Issue 16 item 9: every aten op of a step passes through ``Stepper.on_op`` in Python, and on
small models that cost dominated (1.4-3.7x in-core with nothing moved). Time is not asserted
here (benchmarks/bench_overhead.py measures it); the work is, in counts that no load on the
machine changes: Python calls into ooc per op, and how often the saved-tensor hooks take the
dispatch modes off the stack. And the schema-driven argument scan that replaced a generic
flatten must find exactly the tensors the flatten found, for every kind of op.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ooc
from ooc import Options, OutOfCore
from ooc.runtime import saved_tensors as saved_tensors_module
from ooc.record.op_schema import OpInfo, op_info, tensors

pytestmark = pytest.mark.timeout(120)

OOC_DIR = os.path.dirname(ooc.__file__) + os.sep
# Python calls into ooc's own functions per op of a planned step that moves nothing, at
# most. Before issue 16 item 9 a step of this model made 26 per op (a generic flatten of
# every argument, two lookups keyed by the op, which call ``OpOverload.__hash__`` in Python,
# and the saved-tensor hooks taking the dispatch modes off the stack for every saved tensor);
# after it, 10-12. A change that puts work back on every op shows here first.
MAX_CALLS_PER_OP = 16


class Net(nn.Module):
    """Conv-BN-ReLU twice, the residual added in place, a linear head: BatchNorm buffers (copied
    for a rollback), views, in-place writes and saved activations of several sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(out))
        y += out
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(y), 1), 1))


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def _step(model, opt, engine, step: int) -> None:
    x, y = _batch(step)
    if engine is None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return
    with engine.step():
        F.cross_entropy(model(x), y).backward()
        engine.optimizer_step()


def _planned(min_bytes: str, plain: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, OutOfCore]:
    """An engine whose plan is in force and moves nothing (budget far above the step). Such a
    plan's steps run plain (no op intercepted, ooc/runtime/plain_step.py); ``plain=False``
    keeps them on the per-op path, which is what a plan that moves bytes runs."""
    model, opt = _fresh()
    engine = OutOfCore(model, opt, budget="64MiB", options=Options(chunk="8KiB", min_bytes=min_bytes))
    engine._plans.hooked.enabled = plain
    for step in range(3):   # record, re-plan once SGD's momentum exists, planned
        _step(model, opt, engine, step)
    stats = engine.stats()
    assert stats["last_planned"] and stats["last_diverged_at"] == -1
    assert stats["plan.bytes_in"] == stats["plan.bytes_out"] == 0
    return model, opt, engine


def _same_as_in_core(model: nn.Module, steps: int) -> None:
    ref, ref_opt = _fresh()
    for step in range(steps):
        _step(ref, ref_opt, None, step)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from in-core training"


@pytest.mark.parametrize("min_bytes", ["4KiB", "64MiB"], ids=["managed", "nothing-managed"])
def test_saved_tensor_hooks_of_a_planned_step_leave_the_dispatch_modes_alone(monkeypatch, min_bytes) -> None:
    """Taking the dispatch modes off the stack and putting them back cost more than the rest of
    a pack hook. A planned step's pack only looks a storage up and runs no op, so only an
    unpack (which rebuilds the view with ``torch.empty().set_()``, ops the step must not
    record) still does it: once per managed tensor brought back, never per saved tensor."""
    model, opt, engine = _planned(min_bytes)
    managed = engine.stats()["plan.variables"]
    counts = {"disable": 0, "pack": 0, "unpack": 0}
    saved = saved_tensors_module.SavedTensors
    disable, pack, unpack = saved_tensors_module._disable_current_modes, saved.pack, saved.rebuild

    def counting_disable():
        counts["disable"] += 1
        return disable()

    def counting_pack(self, t):
        counts["pack"] += 1
        return pack(self, t)

    def counting_unpack(self, p, nxt):   # the unpack of a managed tensor rebuilds its view
        counts["unpack"] += 1
        return unpack(self, p, nxt)

    monkeypatch.setattr(saved_tensors_module, "_disable_current_modes", counting_disable)
    monkeypatch.setattr(saved, "pack", counting_pack)
    monkeypatch.setattr(saved, "rebuild", counting_unpack)
    _step(model, opt, engine, 3)
    assert engine.stats()["last_planned"] and engine.stats()["last_diverged_at"] == -1
    assert counts["pack"] > counts["unpack"], counts   # more saved tensors than managed ones
    assert (counts["unpack"] > 0) == (managed > 0), (counts, managed)
    assert counts["disable"] == counts["unpack"], counts
    engine.close()
    _same_as_in_core(model, 4)


def _ooc_calls(engine: OutOfCore, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> int:
    """Python calls into ooc during one step."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(OOC_DIR):
            calls += 1

    sys.setprofile(profile)
    try:
        _step(model, opt, engine, step)
    finally:
        sys.setprofile(None)
    return calls


def test_a_planned_step_makes_few_python_calls_per_op() -> None:
    """Deterministic stand-in for the per-op time: every Python function call into ooc during
    one planned step (forward, backward, optimizer, step start and end), per op."""
    model, opt, engine = _planned("4KiB")
    ops = engine.stats()["plan.functions"]
    calls = _ooc_calls(engine, model, opt, 3)
    assert engine.stats()["last_planned"] and engine.stats()["last_diverged_at"] == -1
    engine.close()
    assert calls <= MAX_CALLS_PER_OP * ops, (
        f"{calls} Python calls into ooc for {ops} ops ({calls / ops:.1f} per op): the per-op path "
        f"of a planned step does more than it did (at most {MAX_CALLS_PER_OP} per op)")
    _same_as_in_core(model, 4)


def test_a_plain_step_makes_a_python_call_per_saved_tensor_only() -> None:
    """The same step with plain steps on: no op goes through the engine. Its Python calls
    are autograd's hooks (a pack and an unpack per saved tensor) and a fixed number at the
    step's start and end, whatever the number of ops."""
    model, opt, engine = _planned("4KiB", plain=True)
    ops = engine.stats()["plan.functions"]
    calls = {"hooks": 0, "other": 0}

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(OOC_DIR):
            calls["hooks" if frame.f_code.co_name in ("pack", "unpack") else "other"] += 1

    _step(model, opt, engine, 3)   # the first plain step
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        _step(*_fresh(), None, 3)   # in core, another copy: how many tensors autograd saves
    sys.setprofile(profile)
    try:
        _step(model, opt, engine, 4)
    finally:
        sys.setprofile(None)
    stats = engine.stats()
    assert stats["steps.plain"] == 2 and stats["last_diverged_at"] == -1
    engine.close()
    assert calls["hooks"] == 2 * len(saved), (calls, len(saved))
    assert calls["other"] <= 100, f"{calls['other']} Python calls into ooc besides the hooks for {ops} ops"


@pytest.mark.parametrize("recompute", ["never", "prefer"])
def test_a_planned_step_only_runs_the_ops_its_plan_gives_no_role(monkeypatch, recompute: str) -> None:
    """Ops with no action around them, no variable used or made, in no chain
    (``scheduler.schedule.quiet_functions``) skip the per-op checks of their inputs and
    outputs: a planned step that swaps (and recomputes) makes fewer Python calls with them
    than with every op looked at, runs its plan the same (bytes moved and recomputed) and
    trains bitwise as in core, BatchNorm statistics included (copied at the step's start,
    as no op's use of them is seen)."""
    from ooc.engine import plan_cache
    from ooc.runtime.step_recording import StepRecording

    quiet_op, ran_quietly = StepRecording.quiet_op, []
    monkeypatch.setattr(StepRecording, "quiet_op", lambda self, *a: ran_quietly.append(1) or quiet_op(self, *a))
    runs = {}
    for quiet in (True, False):
        if not quiet:
            monkeypatch.setattr(plan_cache, "quiet_functions", lambda schedule, made=(): frozenset())
        model, opt = _fresh()
        peak = OutOfCore(*_fresh(), budget="64MiB", options=Options(chunk="8KiB", min_bytes="4KiB"))
        for step in range(2):
            _step(peak.model, peak.optimizer, peak, step)
        budget = peak._plans.schedule.sequence.in_core_peak_bytes * 11 // 20
        peak.close()
        engine = OutOfCore(model, opt, budget=budget, recompute=recompute,
                           options=Options(chunk="8KiB", min_bytes="4KiB", hook_steps=False))
        for step in range(3):
            _step(model, opt, engine, step)
        ran_quietly.clear()
        calls = _ooc_calls(engine, model, opt, 3)
        stats = engine.stats()
        assert stats["last_planned"] and stats["last_diverged_at"] == -1
        assert stats["plan.bytes_out"] > 0 and (stats["plan.bytes_recomputed"] > 0) == (recompute == "prefer")
        runs[quiet] = (calls, len(ran_quietly), stats["plan.bytes_out"], stats["plan.bytes_recomputed"])
        engine.close()
        _same_as_in_core(model, 4)
    assert runs[True][1] > 0 and runs[False][1] == 0, runs
    assert runs[True][2:] == runs[False][2:], runs   # the same plan
    assert runs[True][0] < runs[False][0], runs


def _tiny_gpt() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    from ooc.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(depth=2, width=64, heads=4, seq_len=64, vocab=128, dropout=0.1)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 128, (4, 65), generator=g)

    def step(engine) -> None:
        with engine.step():
            out = model(idx[:, :-1])
            F.cross_entropy(out.reshape(-1, 128), idx[:, 1:].reshape(-1)).backward()
            engine.optimizer_step()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), step


@pytest.mark.parametrize("name", ["net", "gpt"])
def test_a_step_that_leaves_its_plan_after_quiet_ops_records_what_the_per_op_path_would(monkeypatch, name) -> None:
    """A step that diverges is the recording its next plan is made from: its quiet ops record
    the reads and in-place writes of storages born in the step (a chain's ``needs``: the
    scores a softmax reads, scaled and masked by ops nobody saves; ``Recording.promote``) as
    the per-op path does, so the plan made after a divergence at the forward's end is the same
    with quiet ops as without (a re-plan that missed them, in an earlier version, kept
    diverging: Hugging Face GPT-2's cached causal mask)."""
    from ooc.engine import plan_cache

    sequences = {}
    for quiet in (True, False):
        if not quiet:
            monkeypatch.setattr(plan_cache, "quiet_functions", lambda schedule, made=(): frozenset())
        if name == "net":
            model, opt = _fresh()
            last, step = model.fc, lambda e, k: _step(model, opt, e, k)
        else:
            model, opt, gpt_step = _tiny_gpt()
            last, step = model.lm_head, lambda e, k: gpt_step(e)
        extra = [False]
        last.register_forward_hook(lambda m, a, out: out * 1.0 if extra[0] else out)   # one op more
        engine = OutOfCore(model, opt, budget="600KiB" if name == "net" else "2MiB", recompute="prefer",
                           options=Options(chunk="8KiB", min_bytes="4KiB", hook_steps=False))
        for k in range(4):
            step(engine, k)
        assert engine.stats()["plan.bytes_recomputed"] > 0
        extra[0] = True
        torch.manual_seed(7)
        step(engine, 4)
        stats = engine.stats()
        assert stats["last_diverged_at"] > 0, stats
        seq = engine._plans.schedule.sequence
        sequences[quiet] = [(f.name, f.uses, f.needs, f.replayable) for f in seq.functions]
        engine.close()
    assert sequences[True] == sequences[False]


def test_quiet_ops_record_the_reads_and_writes_the_per_op_path_records(monkeypatch) -> None:
    """Temporaries the plan does not manage, made and written in place by quiet ops (``u.add_(t)``
    reads ``t``, writes ``u``): each birth's reads and writes, and the step's reads of them,
    are what the per-op path records, op for op."""
    from ooc.engine import plan_cache, planning

    def temporaries(module, args, out):   # ops with no role in the plan, on storages born here
        t = torch.ones_like(out) * 2.0
        u = torch.full_like(out, 3.0)
        u.add_(t)
        return out + u * 0.0

    recorded = {}
    facts = planning.Planner._facts
    for quiet in (True, False):
        if not quiet:
            monkeypatch.setattr(plan_cache, "quiet_functions", lambda schedule, made=(): frozenset())
        steps = []
        monkeypatch.setattr(planning.Planner, "_facts",
                            lambda self, st, report, **kw: steps.append(st) or facts(self, st, report, **kw))
        model, opt = _fresh()
        model.conv2.register_forward_hook(temporaries)
        engine = OutOfCore(model, opt, budget="64MiB", options=Options(chunk="8KiB", min_bytes="4KiB", hook_steps=False))
        for step in range(4):
            _step(model, opt, engine, step)
        engine.close()
        rec = steps[-1].rec
        assert steps[-1].planned and steps[-1].diverged_at is None
        recorded[quiet] = ({(b.op, b.out): (list(b.reads), list(b.writes)) for b in rec.births.values() if b.var is None},
                           [(i, b.op, b.out) for i, b in rec.anonymous_reads])
    assert recorded[True][0] and recorded[True] == recorded[False]


class _Capture(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _old_written(func, args, kwargs) -> list[torch.Tensor]:
    """What the stepper took for written tensors before: every argument whose schema marks it
    written, flattened."""
    out: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            tensors(args[i] if i < len(args) else kwargs.get(a.name), out)
    return out


def test_the_schema_scan_finds_the_tensors_the_generic_flatten_finds() -> None:
    """``OpInfo.inputs`` reads only the argument positions whose schema type may hold a tensor:
    over a training step and ops with lists of optional tensors (``index``), tensor lists
    (``cat``, foreach), ``out=`` keywords, list results (``split``) and in-place writes, it
    lists the same tensor objects in the same order as flattening every argument did, and the
    same written ones."""
    model, opt = _fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    out = torch.empty(6, 4)
    with _Capture() as cap:
        _step(model, opt, None, 0)
        _step(model, opt, None, 1)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters()], 1.0, foreach=True)
        a[torch.tensor([0, 2])] = b[torch.tensor([1, 3])]
        a[torch.tensor([True, False, True, False, True, False])] += 1
        torch.add(a, b, out=out)
        torch.cat([a, b, out], dim=1).split(3)
        torch.where(a > 0, a, b).sum(dim=(0,), keepdim=True)
        a.addcmul_(b, out, value=0.5)
    assert len(cap.calls) > 100
    kinds = set()
    for func, args, kwargs in cap.calls:
        info = op_info(func)
        got, want = info.inputs(args, kwargs), tensors((args, kwargs))
        assert len(got) == len(want) and all(x is y for x, y in zip(got, want)), str(func)
        got_w, want_w = info.written(args, kwargs), _old_written(func, args, kwargs)
        assert len(got_w) == len(want_w) and all(x is y for x, y in zip(got_w, want_w)), str(func)
        assert op_info(func) is info and info.name == str(func)
        kinds.update(str(a.type) for a in func._schema.arguments if a.alias_info is not None or "Tensor" in str(a.type))
        if kwargs:
            kinds.add("kwargs")
    # the scan met what it must handle: optional-tensor lists, tensor lists, out= keywords
    assert {"List[Optional[Tensor]]", "List[Tensor]", "kwargs"} <= kinds, kinds


def test_an_op_without_a_schema_is_scanned_whole() -> None:
    """Anything passed as ``func`` without an aten schema (never seen in practice) falls back
    to flattening every argument, and is taken to write nothing."""
    t, u = torch.ones(2), torch.zeros(2)
    info = OpInfo(lambda *a, **k: None)
    assert info.tensor_positions is None and info.writes == ()
    got = info.inputs((1, [t, None], {"k": u}), {"out": t})
    assert len(got) == 3 and all(x is y for x, y in zip(got, [t, u, t]))
