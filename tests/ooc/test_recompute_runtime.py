"""Recomputation at run time (ooc/runtime/recompute.py): a discarded activation comes back
by rerunning its chain, and training stays bitwise identical to in-core training: parameters,
losses, optimizer state AND BatchNorm's running statistics (torch.utils.checkpoint updates
those twice; ooc must not), with dropout's generator state replayed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ooc
from ooc.runtime import recompute as rc
from ooc.runtime.stepper import Stepper
from scheduler.schedule import Op

X, Y = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(5)), torch.arange(8) % 10


class Block(nn.Module):
    """conv-BN-ReLU(inplace)-dropout-conv-BN, a skip connection, ReLU(inplace)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu_(self.b1(self.c1(x))))
        y = self.b2(self.c2(y))
        y += x
        return torch.relu_(y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *[Block(32) for _ in range(3)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _train(opt_name: str, steps: int = 4, *, make=None, data=None, chunk: str = "256KiB", **engine_kw) -> dict:
    """Train ``make()`` (default ``_model``) on ``data`` (default ``(X, Y)``), in core when no
    engine keyword is given; returns losses, state, optimizer state, stats and the plan."""
    model = (make or _model)()
    x, y = data if data is not None else (X, Y)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    torch.manual_seed(1)   # dropout
    engine = ooc.OutOfCore(model, opt, options=ooc.Options(chunk=chunk), **engine_kw) if engine_kw else None
    losses = []
    try:
        for _ in range(steps):
            with engine.step() if engine is not None else torch.enable_grad():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            losses.append(loss.detach().clone())
        out = {"stats": engine.stats() if engine else {}, "schedule": engine and engine._plans.schedule}
    finally:
        if engine is not None:
            engine.close()
    out.update(losses=losses, state={k: v.clone() for k, v in model.state_dict().items()},
               opt=[{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                    for s in opt.state.values()])
    return out


_REF: dict[str, dict] = {}


def _reference(opt_name: str) -> dict:
    if opt_name not in _REF:
        _REF[opt_name] = _train(opt_name)
    return _REF[opt_name]


def _assert_bitwise(ref: dict, got: dict) -> None:
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert torch.equal(a, b), f"loss of step {i} differs"
    for k, a in ref["state"].items():   # parameters, running_mean/var, num_batches_tracked
        assert torch.equal(a, got["state"][k]), f"{k} differs"
    for s_ref, s in zip(ref["opt"], got["opt"]):
        for k, v in s_ref.items():
            assert torch.equal(v, s[k]), f"optimizer state {k} differs"


def _chains(schedule) -> set[tuple[str, ...]]:
    fs = schedule.sequence.functions
    return {tuple(fs[w].name for w in a.chain) for acts in schedule.before for a in acts
            if a.op is Op.RECOMPUTE}


# 3 MiB: the dropout masks and convolution outputs are recomputed; 8 MiB: BatchNorm + relu_.
@pytest.mark.parametrize("budget, expect", [("3MiB", "aten.bernoulli_.float"),
                                            ("8MiB", "aten.native_batch_norm.default")])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_recomputed_training_is_bitwise_in_core(opt_name: str, budget: str, expect: str) -> None:
    got = _train(opt_name, budget=budget, recompute="prefer")
    _assert_bitwise(_reference(opt_name), got)
    assert any(expect in chain for chain in _chains(got["schedule"])), _chains(got["schedule"])
    stats = got["stats"]
    assert stats["bytes_recomputed"] > 0 and stats["recompute_s"] > 0
    assert stats["plan.bytes_recomputed"] > 0 and stats["last_planned"] == 1


def test_swap_only_recomputes_nothing() -> None:
    got = _train("sgd", budget="3MiB", recompute="never")
    _assert_bitwise(_reference("sgd"), got)
    assert not _chains(got["schedule"])
    assert got["stats"]["bytes_recomputed"] == 0 and got["stats"]["plan.bytes_recomputed"] == 0


def test_recompute_takes_the_schedulers_words() -> None:
    """"auto", "never", "prefer", as ``scheduler.plan`` and ``ooc plan --recompute``; the
    booleans of 0.1 map to "auto" and "never" with a DeprecationWarning; anything else is
    refused."""
    with pytest.raises(ooc.OOCError, match="recompute must be"):
        ooc.OutOfCore(_model(), budget="8MiB", recompute="always")
    for old, word in ((True, "auto"), (False, "never")):
        with pytest.warns(DeprecationWarning, match=f"recompute='{word}'"):
            engine = ooc.OutOfCore(_model(), budget="8MiB", recompute=old)
        assert engine._planner.recompute == word
        engine.close()


def test_a_chain_input_written_since_keeps_the_activation(monkeypatch) -> None:
    """The safety valve: discard refuses when its chain's inputs changed since the capture
    (here: every time); the step diverges, the activation is written out on demand, and the
    results are still bitwise."""
    monkeypatch.setattr(rc.Recipe, "changed", lambda self: X)
    got = _train("sgd", budget="3MiB", recompute="prefer")
    _assert_bitwise(_reference("sgd"), got)
    assert got["stats"]["bytes_recomputed"] == 0
    assert got["stats"]["last_diverged_at"] >= 0


def test_a_diverged_step_recomputes_a_discarded_activation_on_demand(monkeypatch) -> None:
    """The plan's recompute never runs (the step diverges right before it): the backward's
    unpack finds the activation discarded, and on demand reruns its chain."""
    run = Stepper.run_actions

    def diverge_before_recompute(self, actions, where, phase="before"):
        if self.planned and any(a.op is Op.RECOMPUTE for a in actions):
            self._diverge(where, "test: diverged before a recompute")
        return run(self, actions, where, phase)

    monkeypatch.setattr(Stepper, "run_actions", diverge_before_recompute)
    got = _train("adam", budget="3MiB", recompute="prefer")
    _assert_bitwise(_reference("adam"), got)
    assert got["stats"]["bytes_recomputed"] > 0
    assert got["stats"]["last_diverged_at"] >= 0


def _Step(recipe: rc.Recipe, out: int = 0) -> rc.Recomputation:
    """Just what ``recompute`` reads of a step: one captured op, its output a slot."""
    from collections import Counter
    from types import SimpleNamespace

    from ooc.runtime.step_book import StepBook

    ctx = SimpleNamespace(device=torch.device("cpu"), counters=Counter(), model=nn.Module())
    course = SimpleNamespace(schedule=None, name=lambda i: "addmm")
    step = rc.Recomputation(ctx, StepBook(ctx), course, SimpleNamespace(born_at={7: (0, out)}))
    step.recipes = {0: recipe}
    return step


def _nothing(slot, i, keep=()) -> None:
    pass


def test_the_replay_runs_ops_as_recorded_whatever_autocast_says_then() -> None:
    """The dispatch mode records each op after autocast cast its inputs, so the replay runs
    them with autocast off. A backward (where replays run) inside an autocast region would
    otherwise rerun an fp32 addmm of an fp32 forward in bf16."""
    from ooc.runtime.slots import Slot, State
    from scheduler.ir import Kind

    g = torch.Generator().manual_seed(0)
    bias, a, b = torch.randn(64, generator=g), torch.randn(32, 48, generator=g), torch.randn(48, 64, generator=g)
    first = torch.ops.aten.addmm.default(bias, a, b)
    step = _Step(rc.Recipe(torch.ops.aten.addmm.default, (bias, a, b), {}, [], None, None, True, 1))
    slot = Slot(7, Kind.ACTIVATION, first.untyped_storage().nbytes(), "addmm#0", in_place=False,
                state=State.DISCARDED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step.recompute(slot, (0,), 1, _nothing)
    again = torch.empty(0).set_(slot.storage, 0, first.size(), first.stride())
    assert torch.equal(again, first)
    assert step.ctx.counters["bytes_recomputed"] == slot.nbytes


def test_the_replay_runs_ops_under_the_grad_mode_they_ran_under() -> None:
    """The CPU's LSTM kernel (``mkldnn_rnn_layer``) returns its workspace, a fourth tensor
    the backward reads, only with grad mode on. Replayed under ``no_grad`` it returned three:
    recomputing the workspace (an LSTM language model under recompute="prefer") failed with
    ``IndexError`` in the middle of a step. The replay runs below autograd, grad mode as
    recorded, and the backward given the replayed workspace is bitwise the same."""
    from ooc.runtime.slots import Slot, State
    from scheduler.ir import Kind

    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 16, batch_first=True), torch.randn(4, 5, 8)
    h = torch.zeros(4, 16)
    args = (x.transpose(0, 1).contiguous(), lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0,
            lstm.bias_hh_l0, h, h, False, [], 2, 16, 1, True, False, False, True)
    layer = torch.ops.aten.mkldnn_rnn_layer.default
    with torch._C._AutoDispatchBelowAutograd():
        first = layer(*args)
    step = _Step(rc.Recipe(layer, args, {}, [], None, None, True, 4), out=3)
    slot = Slot(7, Kind.ACTIVATION, first[3].untyped_storage().nbytes(), "workspace", in_place=False,
                state=State.DISCARDED)
    with torch.no_grad():   # replays run in the backward, where grad mode is off
        step.recompute(slot, (0,), 1, _nothing)
    workspace = torch.empty(0, dtype=first[3].dtype).set_(slot.storage, 0, first[3].size(), first[3].stride())
    backward = torch.ops.aten.mkldnn_rnn_layer_backward.default
    grads = (torch.randn_like(first[0]), None, None)
    rest = (False, 2, 16, 1, True, True, False, [], False)
    with torch._C._AutoDispatchBelowAutograd():
        ref = backward(*args[:7], *first[:3], *grads, *rest, first[3])
        got = backward(*args[:7], *first[:3], *grads, *rest, workspace)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


# -- pins: OutOfCore(pin=...), the user's say per op ------------------------------------------


def _fates(schedule, op_name: str) -> list[set]:
    """What the plan does to each variable that ``op_name`` produced."""
    seq = schedule.sequence
    acts = [a for side in (schedule.before, schedule.after) for step in side for a in step]
    out = []
    for v, var in seq.variables.items():
        writers = seq.writers[v]
        if var.kind.value == "activation" and writers and seq.functions[writers[0]].name.startswith(op_name):
            out.append({a.op for a in acts if a.var == v})
    return out


def test_pins_keep_and_must_recompute_steer_the_plan_and_stay_bitwise() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    ref = _reference("sgd")
    # keep the convolution outputs: the budget takes everything else, never them
    kept = _train("sgd", budget="10MiB", pin={torch.ops.aten.convolution: "keep"})
    _assert_bitwise(ref, kept)
    fates = _fates(kept["schedule"], "aten.convolution")
    assert fates and all(f <= {Op.FREE} for f in fates)
    assert kept["stats"]["bytes_in"] + kept["stats"]["bytes_recomputed"] > 0   # others did leave
    assert not all(f <= {Op.FREE} for f in _fates(_train("sgd", budget="10MiB")["schedule"], "aten.convolution"))
    # BatchNorm outputs must be recomputed, even at a budget where nothing has to move
    roomy = _train("sgd", budget="64MiB", recompute="auto")
    assert roomy["schedule"].bytes_recomputed == 0 and roomy["schedule"].bytes_in == 0
    must = _train("sgd", budget="64MiB",
                  pin=lambda op: CheckpointPolicy.MUST_RECOMPUTE if op is torch.ops.aten.native_batch_norm.default else None)
    _assert_bitwise(ref, must)
    assert must["schedule"].bytes_recomputed > 0 and must["stats"]["bytes_recomputed"] > 0
    assert any(Op.RECOMPUTE in f for f in _fates(must["schedule"], "aten.native_batch_norm"))


@pytest.mark.parametrize("pin, words", [
    ({"aten.convolution": "save"}, "expected one of keep"), ({3: "keep"}, "is not an op"),
    (["aten.convolution"], "mapping from ops to pins"),
])
def test_bad_pins_fail_at_construction(pin, words) -> None:
    model = _model()
    with pytest.raises(ooc.OOCError, match=words):
        ooc.OutOfCore(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="8MiB", pin=pin)


@pytest.mark.parametrize("hook_steps", [True, False])
def test_a_batch_drawn_inside_the_step_from_its_own_generator_trains_bitwise(hook_steps: bool) -> None:
    """A batch drawn inside ``engine.step()`` from a ``torch.Generator`` of its own (as a
    synthetic-data loop does): the first layer saves it, and a plan that recomputes it would
    replay ``randn`` from the default generator's state, not that generator's. Five steps,
    recompute on, per-op and hook-driven forms: bitwise as in core. Before 2026-11-29 it was
    recomputed (64 KiB a step) and the parameters differed from the first planned step on."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    model = copy.deepcopy(ref)
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))

    def step(m: nn.Module, o: torch.optim.Optimizer, k: int) -> None:
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
        o.zero_grad()

    with ooc.OutOfCore(model, opt, budget=256 << 10, recompute="auto",
                       options=ooc.Options(chunk="16KiB", hook_steps=hook_steps)) as engine:
        for k in range(5):
            step(ref, ref_opt, k)
            with engine.step():
                step(model, opt, k)
        stats = engine.stats()
    assert stats["steps.planned"] >= 2 and stats["bytes_out"] > 0, stats
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc"
