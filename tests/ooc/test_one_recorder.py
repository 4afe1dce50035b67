"""``ooc plan`` plans the step the engine runs: one recorder, two drivers, the same sequence.

For each zoo model (small configurations) and a Hugging Face GPT-2, the same steady-state
step (after one plain warm-up step, so the optimizer's state exists, as ``ooc.trace``'s own
warm-up makes it) is recorded twice:

- by ``ooc.trace(..., device="meta")``: shapes only, no memory;
- by the engine's recording step, for real on the CPU, with every kind of tensor managed,
  so that the step swaps (activations come back in new storages, parameters and grads are
  released and restored in place) while it records: ``engine.last_recording``.

``test_meta_trace_and_engine_record_the_same_step`` asserts the canonical forms are equal
(``ooc.record.compare``): the same functions in the same order (aten op names: the engine
has no module scopes), the same uses per function (variables renumbered by first use, read
or write, in order), and the same variables (bytes, kind, live in, live out).

``test_engine_plans_the_managed_view_of_the_recording`` checks the filtering: the sequence
the engine planned from (only managed tensors, from ``min_bytes`` on) is the recording's
managed variables, with the same function stream and the same writes and reads.
"""

from __future__ import annotations

import collections

import pytest
import torch

import ooc
from ooc import models
from ooc.engine import Options, OutOfCore
from ooc.record.compare import canonical, first_difference
from ooc.record.op_schema import op_info
from scheduler.ir import Access, Kind

ALL = ("activations", "params", "grads", "optimizer_state")

ZOO = [
    ("small_cnn", {"width": 8}, 32),
    ("tiny_transformer", {}, None),
    ("gpt2", {"depth": 2, "width": 64, "heads": 2, "seq_len": 16, "vocab": 128}, None),
    ("unet", {"base": 4, "depth": 2}, 32),
    ("vgg16", {"small_input": True, "num_classes": 10}, 32),
    ("resnet18", {"num_classes": 10}, 32),
    pytest.param("resnet50", {"num_classes": 10}, 32, marks=pytest.mark.slow),
    pytest.param("densenet121", {"num_classes": 10}, 32, marks=pytest.mark.slow),
]


def _warm(model, opt, run):
    run(model)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _engine_recording(model, opt, run, manage=ALL, reload_state=False, **kw):
    engine = OutOfCore(model, opt, budget="1GiB", manage=manage, options=Options(**kw))
    if reload_state:   # the engine manages state it sees loaded (not state that was there)
        opt.load_state_dict(opt.state_dict())
    try:
        with engine.step():
            run(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return engine.last_recording, engine._plans.schedule, engine._mem.chunk, engine._mem.min_bytes
    finally:
        engine.close()


def _zoo_step(name, kw, size):
    torch.manual_seed(0)
    model = models.get(name, **kw)
    x, y = models.example_batch(name, 2, "cpu", image_size=size, **kw)
    loss = models.loss_fn(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    _warm(model, opt, lambda m: loss(m(x), y).backward())
    return model, opt, x, y, loss


def _assert_same(traced, recorded):
    a, b = canonical(traced), canonical(recorded)
    assert first_difference(a, b) is None
    assert a == b
    assert traced.meta["optimizer_start"] == recorded.meta["optimizer_start"]
    kinds = {v.kind for v in recorded.variables.values()}
    assert kinds >= {Kind.PARAM, Kind.GRAD, Kind.OPTIMIZER_STATE, Kind.ACTIVATION, Kind.INPUT}


@pytest.mark.parametrize("name,kw,size", ZOO)
def test_meta_trace_and_engine_record_the_same_step(name, kw, size):
    model, opt, x, y, loss = _zoo_step(name, kw, size)
    traced = ooc.trace(model, x, y, loss_fn=loss, optimizer=opt, device="meta")
    recorded, *_ = _engine_recording(model, opt, lambda m: loss(m(x), y).backward())
    _assert_same(traced, recorded)


def test_hugging_face_gpt2_records_the_same_step():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids}   # one tensor twice: one storage in both
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _warm(model, opt, lambda m: m(**batch).loss.backward())
    traced = ooc.trace(model, batch, loss_fn=lambda out: out.loss, optimizer=opt, device="meta")
    recorded, *_ = _engine_recording(model, opt, lambda m: m(**batch).loss.backward())
    _assert_same(traced, recorded)


def _signatures(seq, keep, nbytes=lambda v: v.nbytes):
    """Per variable kept: (kind, bytes, write indices) and its read indices."""
    writes, reads = collections.defaultdict(set), collections.defaultdict(set)
    for f in seq.functions:
        for u in f.uses:
            (writes if u.access is Access.WRITE else reads)[u.var].add(f.index)
    return [((v.kind, nbytes(v), frozenset(writes[v.id])), reads[v.id])
            for v in seq.variables.values() if keep(v)]


@pytest.mark.parametrize("manage", [ALL, ("activations",)])
def test_engine_plans_the_managed_view_of_the_recording(manage):
    """What the engine plans is the recording, filtered: the same function stream (plus the
    ops the recorder leaves out: profiler markers), and every managed variable is a variable
    of the recording, of its kind, with its bytes (activations rounded up to whole chunks),
    written at the same functions and read at least where the recording reads it (the
    engine adds the reads where autograd holds an unpacked tensor until its node returns)."""
    model, opt, x, y, loss = _zoo_step("small_cnn", {"width": 16}, 32)
    recorded, schedule, chunk, min_bytes = _engine_recording(
        model, opt, lambda m: loss(m(x), y).backward(), manage=manage, reload_state=True,
        chunk="64KiB", min_bytes="8KiB")
    planned = schedule.sequence

    names = [f.name for f in planned.functions]
    kept = [i for i, n in enumerate(names) if not _skipped(n)]
    assert [names[i] for i in kept] == [f.name for f in recorded.functions]
    at, j = {}, -1   # planned function index -> recorded index (a skipped op: the one before)
    for i, n in enumerate(names):
        j += not _skipped(n)
        at[i] = j

    kinds = {"activations": Kind.ACTIVATION, "params": Kind.PARAM, "grads": Kind.GRAD,
             "optimizer_state": Kind.OPTIMIZER_STATE}
    managed = {kinds[m] for m in manage}
    def rounded(v):
        return -(-v.nbytes // chunk) * chunk if v.kind is Kind.ACTIVATION else v.nbytes

    expected = collections.Counter()
    buffers = {n for n, _ in model.named_buffers()}   # PARAM in the recording, never managed
    for v in recorded.variables.values():
        if v.kind in managed and v.nbytes >= min_bytes and v.name not in buffers:
            expected[(v.kind, rounded(v))] += 1
    got = collections.Counter((v.kind, v.nbytes) for v in planned.variables.values())
    assert got == expected

    todo = _signatures(recorded, lambda v: v.kind in managed and v.nbytes >= min_bytes
                       and v.name not in buffers, rounded)
    for (kind, nbytes, writes), reads in _signatures(planned, lambda v: True):
        writes = frozenset(at[i] for i in writes)
        reads = {at[i] for i in reads}
        match = next(k for k, ((kd, nb, w), r) in enumerate(todo)
                     if (kd, nb, w) == (kind, nbytes, writes) and r <= reads)
        todo.pop(match)
    assert not todo


def _skipped(name):
    return name.startswith("profiler.") or name.startswith("aten.lift_fresh.")


def test_skipped_ops_are_the_recorders():
    assert op_info(torch.ops.aten.lift_fresh.default).skip
    assert not op_info(torch.ops.aten.add.Tensor).skip
    assert op_info(torch.ops.aten.t.default).view and not op_info(torch.ops.aten.add_.Tensor).view
