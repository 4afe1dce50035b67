"""The recorder's replay flags (``ooc.record.replay``): which functions a plan may recompute.

- per op, from the schema and tags: a table of ops and their verdicts;
- on meta traces of the zoo's ``small_cnn`` and ``tiny_transformer`` and a tiny Hugging Face
  GPT-2: convolutions, matmuls, ReLU, add, GELU and layer norm replayable; dropout's random
  op ``rng``; BatchNorm in training ``updates_stats``; views, ``.item()``, in-place updates of
  what existed before the step and the whole optimizer update not replayable;
- the engine's recording step gives the same flags (``ooc.record.compare.canonical``
  includes them; ``test_one_recorder.py`` compares the whole zoo) and measured seconds;
- the property behind ``replayable``: on a real CPU step, every function the recorder marks
  replayable, rerun right after it ran on the same inputs (the generator state restored for
  ``rng``, the running statistics for ``updates_stats``, the pre-write bytes for an in-place
  op), gives bitwise the same results.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ooc
from ooc import models
from ooc.engine import OutOfCore
from ooc.record.compare import canonical, first_difference, op_name
from ooc.record.op_schema import op_info
from ooc.record.recorder import StepRecorder
from scheduler.replay import chain_for

aten = torch.ops.aten

PLAIN = [aten.convolution.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
         aten.relu.default, aten.add.Tensor, aten.gelu.default, aten.native_layer_norm.default,
         aten.convolution_backward.default, aten.empty_like.default, aten._to_copy.default,
         aten._native_batch_norm_legit_no_training.default, aten._batch_norm_no_update.default]
RANDOM = [aten.native_dropout.default, aten.bernoulli.p, aten.bernoulli_.float, aten.rand.default,
          aten.randn.default, aten.normal.Tensor_float]
IN_PLACE = [aten.relu_.default, aten.add_.Tensor, aten.div_.Scalar, aten.mul_.Tensor]
NEVER = [aten.copy_.default, aten.set_.source_Tensor, aten.resize_.default, aten.add.out,
         aten._local_scalar_dense.default, aten.view.default, aten.t.default, aten.detach.default,
         aten._foreach_add_.List, aten.native_batch_norm.out, aten.bernoulli.out,
         torch.ops._c10d_functional.all_reduce.default, torch.ops.c10d.allreduce_.default]
BATCH_NORM = [aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
              aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default,
              aten._batch_norm_with_update.default]


@pytest.mark.parametrize("op", PLAIN + IN_PLACE, ids=str)
def test_functional_and_in_place_ops_are_replayable(op):
    rule = op_info(op).replay
    assert rule.replayable and not rule.rng and rule.running_mean is None, rule


@pytest.mark.parametrize("op", RANDOM, ids=str)
def test_random_ops_replay_with_their_generator_state(op):
    rule = op_info(op).replay
    assert rule.replayable and rule.rng, rule


@pytest.mark.parametrize("op", NEVER, ids=str)
def test_ops_with_effects_outside_their_results_are_not_replayable(op):
    rule = op_info(op).replay
    assert not rule.replayable and rule.why, rule


@pytest.mark.parametrize("op", BATCH_NORM, ids=str)
def test_batch_norm_updates_stats_only_when_training_with_running_stats(op):
    rule = op_info(op).replay
    assert rule.replayable and not rule.rng
    x, mean = torch.ones(2, 3, 4), torch.zeros(3)
    names = [a.name for a in op._schema.arguments]
    def call(training, running_mean):
        args = [None] * len(names)
        args[0], args[names.index("running_mean")] = x, running_mean
        if "training" in names:
            args[names.index("training")] = training
        return tuple(args)
    assert rule.updates_stats(call(True, mean), {})
    assert rule.updates_stats(call(False, mean), {}) == (op is aten._batch_norm_with_update.default)
    assert not rule.updates_stats(call(True, None), {})


# -- flags on whole steps ---------------------------------------------------------------------

ZOO = [("small_cnn", {"width": 8}, 32), ("tiny_transformer", {}, None)]


def _zoo(name, kw, size):
    torch.manual_seed(0)
    model = models.get(name, **kw)
    x, y = models.example_batch(name, 2, "cpu", image_size=size, **kw)
    return model, x, y, models.loss_fn(name)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def _traces():
    for name, kw, size in ZOO:
        model, x, y, loss = _zoo(name, kw, size)
        yield name, ooc.trace(model, x, y, loss_fn=loss, optimizer="adam", device="meta")
    model, batch = _gpt2()
    yield "gpt2-hf", ooc.trace(model, batch, loss_fn=lambda out: out.loss, optimizer="adamw",
                               device="meta")


@pytest.fixture(scope="module")
def traces():
    return dict(_traces())


REPLAYABLE = {"convolution", "mm", "addmm", "bmm", "relu", "add", "gelu", "native_layer_norm",
              "convolution_backward", "threshold_backward", "native_layer_norm_backward"}


def _op(f):
    return op_name(f.name).split(".")[1]


@pytest.mark.parametrize("name", ["small_cnn", "tiny_transformer", "gpt2-hf"])
def test_meta_traces_mark_what_may_be_recomputed(traces, name):
    seq = traces[name]
    update = seq.meta["optimizer_start"]
    step, optimizer = seq.functions[:update], seq.functions[update:]
    ops = {_op(f) for f in step}
    for f in step:
        op = _op(f)
        if op in REPLAYABLE:
            assert f.replayable and not f.rng and not f.updates_stats, f
        if op in ("native_batch_norm", "bernoulli_", "native_dropout"):
            assert f.replayable, f
        assert f.rng == (op in ("bernoulli_", "native_dropout")), f
        assert f.updates_stats == (op == "native_batch_norm"), f   # every BN of the step trains
        if not f.uses:   # views: kept as functions without uses
            assert not f.replayable, f
        if op == "_local_scalar_dense":
            assert not f.replayable, f
        for u in f.uses:   # in-place writes of what exists before the step: never
            if u.access.value == "write" and seq.variables[u.var].live_in:
                assert not f.replayable, f
    assert not any(f.replayable or f.rng or f.updates_stats for f in optimizer)
    assert {"add_", "lerp_", "addcdiv_", "sqrt"} <= {_op(f) for f in optimizer}
    assert {"small_cnn": {"convolution", "native_batch_norm", "relu_", "add_", "threshold_backward"},
            "tiny_transformer": {"mm", "addmm", "gelu", "native_layer_norm", "bernoulli_", "add"},
            "gpt2-hf": {"mm", "addmm", "tanh", "native_layer_norm", "bernoulli_", "add"}}[name] <= ops


def test_in_place_updates_join_the_chain_of_the_tensor_they_update(traces):
    """``relu_`` after a BatchNorm: the BatchNorm's output is recomputed by replaying both,
    once the ReLU has run; before it, by the BatchNorm alone (scheduler.replay folds every
    write of the target into its chain, and a chain with a non-replayable write has none)."""
    seq = traces["small_cnn"]
    relu = next(f for f in seq.functions if _op(f) == "relu_")
    bn = seq.functions[relu.index - 1]
    assert _op(bn) == "native_batch_norm"
    out = relu.uses[0].var
    assert seq.producer[out] == bn.index and out in [u.var for u in bn.uses]
    later = max(seq.uses_of[out])
    assert chain_for(seq, out, later).functions == (bn.index, relu.index)
    assert chain_for(seq, out, relu.index).functions == (bn.index,)
    frozen = dataclasses.replace(relu, replayable=False)
    fs = tuple(frozen if f.index == relu.index else f for f in seq.functions)
    assert chain_for(type(seq)(fs, seq.variables, seq.meta), out, later) is None


# -- the engine's recording step: the same flags, and seconds ---------------------------------


@pytest.mark.parametrize("name,kw,size", ZOO)
def test_engine_recording_has_the_same_flags_and_measured_seconds(name, kw, size):
    model, x, y, loss = _zoo(name, kw, size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    traced = ooc.trace(model, x, y, loss_fn=loss, optimizer=opt, device="meta")
    engine = OutOfCore(model, opt, budget="1GiB",
                       manage=("activations", "params", "grads", "optimizer_state"))
    try:
        with engine.step():
            loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        recorded = engine.last_recording
    finally:
        engine.close()
    a, b = canonical(traced), canonical(recorded)
    assert first_difference(a, b) is None
    assert [f[2] for f in a.functions] == [f[2] for f in b.functions]
    assert any("updates_stats" in f[2] or "rng" in f[2] for f in a.functions)
    assert all(f.cost.seconds is not None and f.cost.seconds >= 0 for f in recorded.functions)
    # the flags are part of the canonical form: a changed flag is a difference
    f0 = next(f for f in recorded.functions if f.replayable)
    flipped = tuple(dataclasses.replace(f, replayable=False) if f is f0 else f
                    for f in recorded.functions)
    other = canonical(type(recorded)(flipped, recorded.variables, recorded.meta))
    assert first_difference(a, other) is not None


# -- the property: a replay gives the same bytes ------------------------------------------------


class _Rerun(TorchDispatchMode):
    """Records every op with the recorder (its flags) and, for each op it marks replayable,
    reruns it right after on the same inputs: for an in-place op on a copy of the bytes it
    wrote taken before it ran; for ``rng`` with the generator state restored; for
    ``updates_stats`` on copies of the running statistics taken before. Results must be
    bitwise equal (``empty*``: bytes unspecified, shape and dtype only)."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = StepRecorder()
        self.checked: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        rule = info.replay
        before = None
        if rule.replayable:
            written = {id(t): t.clone() for t in info.written(args, kwargs)}
            at = rule.running_mean[0] if rule.running_mean is not None else len(args)
            stats = [t for t in args[at:at + 2] if isinstance(t, torch.Tensor)]   # mean, var
            stats_copy = [t.clone() for t in stats]
            rng = torch.get_rng_state()
            rargs = tuple(written.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
            before = (rargs, rng, stats, stats_copy)
        out = func(*args, **kwargs)
        i = self.rec.op(info, args, kwargs, out, info.name)
        replayable, rng_flag, updates = self.rec.fflags[i]
        if replayable:
            rargs, rng, stats, stats_copy = before
            after = [t.clone() for t in stats]
            if updates:   # replay on the statistics as they were: the same update again
                for t, c in zip(stats, stats_copy):
                    t.copy_(c)
            if rng_flag:
                torch.set_rng_state(rng)
            again = func(*rargs, **kwargs)
            got, want = _flat(again), _flat(out)
            assert len(got) == len(want), info.name
            for g, w in zip(got, want):
                if info.name.startswith("aten.empty"):
                    assert (g.shape, g.dtype) == (w.shape, w.dtype), info.name
                else:
                    assert torch.equal(g, w), info.name
            for t, a in zip(stats, after):
                assert torch.equal(t, a), info.name
            key = op_name(info.name) + (" rng" if rng_flag else "") + (" stats" if updates else "")
            self.checked[key] = self.checked.get(key, 0) + 1
        return out


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in (out if isinstance(out, (list, tuple)) else ()) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name,kw,size", ZOO)
def test_replaying_a_replayable_op_gives_the_same_bytes(name, kw, size):
    model, x, y, loss = _zoo(name, kw, size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mode = _Rerun()
    with mode:
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    checked = {k.split(".")[1] + k[len(k.split(" ")[0]):] for k in mode.checked}
    if name == "small_cnn":
        assert {"convolution", "native_batch_norm stats", "relu_", "add_", "convolution_backward",
                "native_batch_norm_backward", "threshold_backward"} <= checked
    else:
        assert {"mm", "addmm", "gelu", "native_layer_norm", "bernoulli_ rng", "div_",
                "_softmax"} <= checked


def test_a_random_op_given_its_own_generator_is_not_replayed():
    """Rule 7's call rule: a replay restores the default generator's state, so a random op
    called with a ``torch.Generator`` of its own is not replayable (its flags say so); without
    one, it is, with ``rng``."""
    g = torch.Generator().manual_seed(0)
    for op, args, given in ((aten.randn.generator, ((4, 4),), {"generator": g}),
                            (aten.randint.low_generator, (0, 10, (4,)), {"generator": g}),
                            (aten.bernoulli.default, (torch.full((4,), 0.5),), {"generator": g}),
                            (aten.normal_.default, (torch.empty(4), 0.0, 1.0), {"generator": g})):
        rule = op_info(op).replay
        assert rule.replayable and rule.generator is not None, (op, rule)
        assert rule.flags(args, given) == (False, False, False), op
        assert rule.flags(args, {**given, "generator": None})[:2] == (True, True), op
