"""Steps of varying shapes (dynamic padding) keep a plan per shape and run planned.

A plan is a sequence of ops with one step's sizes: before plans were kept per shape, a GPT
trained on sequence lengths in turn made a plan at every step (every step left the last
one's plan and was re-planned, none ran planned). Plans are now keyed by the step's start
and its shape (the tensors the model's forward is called with), at most ``max_plans``, the
least recently used out; a step switches to its shape's plan when its forward begins.
Small GPTs (2 blocks, width 64), 16 KiB chunks; every step checked bitwise against the same
loop in core, parameters and losses.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

import ooc
from ooc.engine import Options, OutOfCore
from test_second_backward import _model as residual_cnn

ALL = ("activations", "params", "grads", "optimizer_state")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ooc.models.tiny_transformer(depth=2, width=64, heads=4, seq_len=32, vocab=256)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)   # no state: no first-update divergence


def _batch(step: int, length: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, length), generator=torch.Generator().manual_seed(step))


def _train(lengths: list[int], engine_kw: dict | None, *, before=lambda x: x,
           setup=lambda e: None) -> tuple[list, list, list[dict]]:
    """Train on ``lengths`` in turn (in core with ``engine_kw`` None), ``before(x)`` run in the
    step before the model's forward; the losses, each step's parameters, and (under the
    engine) each step's stats."""
    model, opt = _model()
    engine = OutOfCore(model, opt, options=Options(chunk="16KiB", min_bytes=4096), **engine_kw) if engine_kw else None
    if engine is not None:
        setup(engine)
    losses, params, stats = [], [], []
    try:
        for step, length in enumerate(lengths):
            x = _batch(step, length)
            torch.manual_seed(step)   # dropout
            with engine.step() if engine is not None else contextlib.nullcontext():
                x = before(x)
                loss = ooc.models.lm_loss(model(x), x.roll(-1, 1))
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach().clone())
            with engine.resident() if engine is not None else contextlib.nullcontext():
                params.append([p.detach().clone() for p in model.parameters()])
            if engine is not None:
                stats.append(engine.stats())
    finally:
        if engine is not None:
            engine.close()
    return losses, params, stats


def _assert_bitwise(ref: tuple, got: tuple) -> None:
    for step, (a, b) in enumerate(zip(ref[0], got[0])):
        assert torch.equal(a, b), f"loss of step {step} differs"
    for step, (a, b) in enumerate(zip(ref[1], got[1])):
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"parameters after step {step} differ"


LENGTHS = [32, 16, 24] * 8   # dynamic padding: 3 shapes in turn


@pytest.mark.parametrize("case", ["per-op", "all-forms", "all-managed", "views-before-forward", "made-before-forward"])
def test_each_shape_keeps_its_plan_and_its_steps_run_planned(case: str) -> None:
    """Three sequence lengths in turn at 1 MiB (32 and 24 tokens swap, 16 fits: its plan moves
    nothing): each shape is recorded once, then every step runs its shape's plan and the
    number of plans stops at three; with the default forms the plain and anchored ones are
    taken up per shape too. Ops on the batch inside the step before the forward (a view,
    ``x[:, 1:]``) touch no managed memory: the step still switches to its shape's plan. So
    do ops that make the batch (``x.to(torch.int32).long()``), every kind managed at 512 KiB
    (the weights start on the tier): the step waits for its shape, then catches up with the
    plan's actions before those ops (the first weights' swap-ins) at the forward; without
    that, 23 of these 24 steps left their plan (18 plans). Before plans were kept per shape,
    every step made a plan."""
    made = case == "made-before-forward"
    kw = {"budget": "512KiB" if made else "1MiB",
          "manage": ALL if case == "all-managed" or made else ("activations",)}

    def per_op_only(e: OutOfCore) -> None:
        e._plans.hooked.enabled = False

    before = {"views-before-forward": lambda x: x[:, 1:],
              "made-before-forward": lambda x: x.to(torch.int32).long()}.get(case, lambda x: x)
    lengths = [n + 1 for n in LENGTHS] if case == "views-before-forward" else LENGTHS
    ref = _train(lengths, None, before=before)
    got = _train(lengths, kw, before=before, setup=per_op_only if case == "per-op" else lambda e: None)
    _assert_bitwise(ref, got)
    stats = got[2]
    planned = [s["last_planned"] for s in stats]
    plans = [s["plans"] for s in stats]
    assert all(planned[3:]), f"after each shape was seen once, every step runs planned: {planned}"
    assert plans[2] == plans[-1] == 3, f"one plan per shape, then no more: {plans}"
    assert stats[-1]["plans_kept"] == 3
    assert max(s["plan.bytes_out"] for s in stats) > 0, "the plans must move bytes"
    if case in ("all-forms", "views-before-forward"):
        assert stats[-1]["steps.plain"] > 0 and stats[-1]["steps.anchored"] > 0, stats[-1]


def test_plans_are_bounded_least_recently_used_out() -> None:
    """At most ``max_plans`` plans are kept: a third shape evicts the least recently used
    one, which is recorded again when it comes back; the shapes still kept run planned."""
    lengths = [32, 16, 32, 16, 24, 16, 24, 32, 24, 32]
    ref = _train(lengths, None)

    def two(e: OutOfCore) -> None:
        e._plans.max_plans = 2

    got = _train(lengths, {"budget": "1MiB"}, setup=two)
    _assert_bitwise(ref, got)
    stats = got[2]
    assert max(s["plans_kept"] for s in stats) == 2
    planned = [s["last_planned"] for s in stats]
    # 24 evicts 32 (16 was used later), 32 evicts 16, 24 is kept throughout the end
    assert planned == [0, 0, 1, 1, 0, 1, 1, 0, 1, 1], planned
    assert [s["plans"] for s in stats][-1] == 4


@pytest.mark.parametrize("made", ["fixed", "by-shape"])
def test_a_step_that_makes_tensors_before_its_forward_runs_its_shapes_plan(made: str) -> None:
    """Tensors as large as managed ones made in the step before the model's forward (the
    batch moved, converted or augmented inside the step), of a fixed size or of a size that
    follows the batch's: with plans for two shapes, the step waits for its shape before it
    binds them (``ooc/runtime/binding.py``), and when the forward shows it, the step runs its
    shape's plan. It began with its start's last step's plan and bound them at once: it could
    not switch (it had touched managed memory) and left its plan at its first differing op, or
    at the first made tensor whose size was not the plan's, finished on demand and was planned
    again (every other step here)."""
    def before(x: torch.Tensor) -> torch.Tensor:
        if made == "fixed":
            torch.ones(4096).add_(1)   # 16 KiB: above min_bytes
        else:
            torch.zeros(x.shape[1], 64).add_(1)   # 8 or 4 KiB
        return x

    lengths = [32, 32, 16, 16] * 3
    ref = _train(lengths, None, before=before)
    got = _train(lengths, {"budget": "1MiB"}, before=before)
    _assert_bitwise(ref, got)
    stats = got[2]
    planned = [s["last_planned"] for s in stats]
    assert all(planned[4:]), planned
    assert stats[-1]["plans"] == 2 and all(s["plans_kept"] == 2 for s in stats[3:])


def test_shapes_compose_with_the_start_state() -> None:
    """Gradient accumulation over two micro-batches (two start states: without and with
    gradients) and two shapes: a plan per (start, shape), four in all; every step after the
    warm-up runs planned, bitwise as in core."""
    def run(engine: OutOfCore | None) -> tuple[list, list]:
        model, opt = _model()
        if engine is not None:
            engine = OutOfCore(model, opt, budget="1MiB", options=Options(chunk="16KiB", min_bytes=4096))
        losses, planned = [], []
        for step in range(16):
            x = _batch(step, (32, 16)[step // 2 % 2])
            torch.manual_seed(step)
            with engine.step() if engine is not None else contextlib.nullcontext():
                loss = ooc.models.lm_loss(model(x), x.roll(-1, 1))
                loss.backward()
                if step % 2:
                    opt.step()
                    opt.zero_grad()
            losses.append(loss.detach().clone())
            if engine is not None:
                planned.append(engine.stats()["last_planned"])
        if engine is not None:
            assert engine.stats()["plans_kept"] == 4
            engine.close()
        return losses + [p.detach().clone() for p in model.parameters()], planned

    ref, _ = run(None)
    got, planned = run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(planned[8:]), planned


@pytest.mark.parametrize("manage", [("activations",), ALL], ids=["activations", "all-managed"])
def test_training_and_evaluation_steps_in_turn_each_keep_a_plan(manage: tuple[str, ...]) -> None:
    """A training step, then an evaluation step (``model.eval()`` and ``torch.no_grad()``
    inside ``engine.step()``) on a batch of the same shape, in turn: each kind keeps its own
    plan (the shape includes the model's training mode and autograd's), and after each was
    seen once every step runs planned. Keyed by the batch alone they replaced each other's
    plan: every step diverged and ran on demand. Losses, evaluation outputs and parameters
    bitwise as the same loop in core."""
    def run(engine_kw: dict | None) -> tuple[list, list]:
        model, opt = _model()
        engine = OutOfCore(model, opt, options=Options(chunk="16KiB", min_bytes=4096), **engine_kw) if engine_kw else None
        outs, planned = [], []
        for step in range(12):
            x = _batch(step, 32)
            torch.manual_seed(step)   # dropout
            with engine.step() if engine is not None else contextlib.nullcontext():
                if step % 2 == 0:
                    model.train()
                    loss = ooc.models.lm_loss(model(x), x.roll(-1, 1))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    outs.append(loss.detach().clone())
                else:
                    model.eval()
                    with torch.no_grad():
                        outs.append(model(x))
                    model.train()
            if engine is not None:
                planned.append(engine.stats()["last_planned"])
        if engine is not None:
            with engine.resident():
                outs += [p.detach().clone() for p in model.parameters()]
            assert engine.stats()["steps.diverged"] == 0
            engine.close()
        return outs, planned

    ref, _ = run(None)
    got, planned = run({"budget": "1MiB", "manage": manage})
    for k, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"output {k} differs"
    assert all(planned[4:]), planned


def _cnn_steps(engine_kw: dict | None) -> tuple[torch.nn.Module, dict]:
    """A residual CNN with BatchNorm and dropout under Adam, on batches of 4, 8 or 12 images in
    a shuffled order, each made inside the step from bytes (``raw.float() / 255``, as a loader's
    ``x.to(device)`` and normalization are written inside the loop): the first conv saves it."""
    model = residual_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = OutOfCore(model, opt, **engine_kw) if engine_kw is not None else None
    sizes = random.Random(0).choices([4, 8, 12], k=24)
    for step, n in enumerate(sizes):
        g = torch.Generator().manual_seed(step)
        raw = torch.randint(0, 255, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 10, (n,), generator=g)
        torch.manual_seed(step)   # dropout
        with engine.step() if engine is not None else contextlib.nullcontext():
            x = raw.float() / 255
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    stats = engine.stats() if engine is not None else {}
    if engine is not None:
        engine.close()
    return model, stats


@pytest.mark.parametrize("manage", ["activations", "all"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_batches_of_shuffled_sizes_made_inside_the_step_run_planned(device: str, manage: str) -> None:
    """Each size is recorded once (and the first Adam update once more), then every step runs
    its size's plan with the batch it made bound to the plan's variable; with every kind
    managed, the plan's first actions (the first weights' swap-ins, before the ops that made
    the batch) are caught up with at the forward. Before steps waited for their shape, 16 of
    these 24 steps left their plan (activations) and 15 (every kind), each planned from again.
    On ``cuda``: FAKE DRIVER (``ooc.testing.fake_cuda``), every call within the real driver's
    contract."""
    import ooc.testing

    ref, _ = _cnn_steps(None)
    with ooc.testing.fake_cuda() if device == "cuda" else contextlib.nullcontext() as driver:
        got, stats = _cnn_steps({"budget": "3MiB", "device": device, "manage": ALL if manage == "all" else
                                 ("activations",), "options": Options(chunk="64KiB", min_bytes=4096)})
        assert driver is None or driver.violations == [], driver.violations
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), name
    assert stats["bytes_out"] > 0
    assert stats["steps.diverged"] <= 4 and stats["plans"] <= 5, stats


def test_shapes_of_one_size_are_the_same_tensors_within_a_factor_of_two_of_elements() -> None:
    """``step_forms.same_size``: what may run one plan whose sizes vary. The same tensors but
    for their sizes (rank and dtype each), the same modes, and elements within one of the
    fixed steps of ``SIZE_STEP``."""
    from ooc.engine.step_forms import same_size

    def shape(*dims: tuple, dtype: torch.dtype = torch.int64, training: bool = True) -> tuple:
        return tuple((d, dtype) for d in dims), training, True

    assert same_size(shape((8, 100), (8, 100)), shape((8, 120), (8, 120)))
    assert not same_size(shape((8, 100), (8, 100)), shape((8, 20), (8, 20))), "five times fewer elements"
    assert not same_size(shape((8, 100)), shape((8, 100), (8, 100))), "another tensor"
    assert not same_size(shape((8, 100)), shape((8, 100, 1))), "another rank"
    assert not same_size(shape((8, 100)), shape((8, 100), dtype=torch.int32)), "another dtype"
    assert not same_size(shape((8, 100)), shape((8, 100), training=False)), "evaluation"
    assert not same_size(None, shape((8, 100))), "no forward seen"
