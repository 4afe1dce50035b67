"""Templates (``ooc/runtime/templates.py``): what a per-op step's recipes become, and what a
hook-driven step checks before it discards on their word.

The capture binds each tensor a recipe read to a parameter or buffer, or to the save of the
same storage at the same version (before or after the op), and gives no template where one
is left unbound or the op draws random numbers; a bound step refuses a save of another size
or node, a saved tensor or parameter written since, and a step whose op changed at the same
sizes (a model that swaps ``sigmoid`` for ``tanh``) leaves its plan and stays bitwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

from ooc import FORMS, OutOfCore
from ooc.runtime.bound_templates import BoundTemplates
from ooc.runtime.recipes import Recipe
from ooc.runtime.slots import Slot
from ooc.runtime.templates import PackArg, Persistent, Template, TemplateCapture, Templates, VarArg
from ooc.runtime.views import View
from scheduler.ir import Kind

pytestmark = pytest.mark.timeout(300)

aten = torch.ops.aten


def _recipe(func, args, rng=None, stats=None) -> Recipe:
    held = [(x, x._version) for x in args if isinstance(x, torch.Tensor)]
    return Recipe(func, tuple(args), {}, held, rng, stats, True, 1)


def test_a_recipe_binds_to_saves_before_and_after_it_and_to_parameters() -> None:
    model = nn.Linear(4, 4)
    cap = TemplateCapture(model)
    early, late = torch.randn(8).requires_grad_(), torch.randn(8)
    e = early * 2   # has a node: MulBackward0
    cap.saved(e, e.untyped_storage(), None, gap=1)                  # save 0, before the op
    cap.captured(3, _recipe(aten.add.Tensor, [e, late]))
    cap.captured(4, _recipe(aten.mul.Tensor, [model.weight, e]))
    cap.saved(late, late.untyped_storage(), None, gap=5)            # save 1, after the op
    t = cap.build({3: _recipe(aten.add.Tensor, [e, late]), 4: _recipe(aten.mul.Tensor, [model.weight, e])}, {})
    assert t.functions == {3, 4}
    first, second = t.calls[3].args
    assert isinstance(first, PackArg) and (first.k, first.gap, first.node) == (0, 1, "MulBackward0")
    assert isinstance(second, PackArg) and (second.k, second.gap, second.node) == (1, 5, "leaf")
    weight = t.calls[4].args[0]
    assert isinstance(weight, Persistent) and weight.tensor is model.weight and weight.checked
    assert t.ready() == {3: 5, 4: 1}


def test_no_template_for_an_unsaved_tensor_a_written_save_or_a_random_op() -> None:
    cap = TemplateCapture(nn.Linear(2, 2))
    unsaved, written = torch.randn(8), torch.randn(8)
    cap.saved(written, written.untyped_storage(), None, gap=0)
    written.add_(1)   # the op reads other bytes than were saved
    recipes = {1: _recipe(aten.neg.default, [unsaved]), 2: _recipe(aten.neg.default, [written]),
               3: _recipe(aten.bernoulli.p, [torch.randn(2)], rng=torch.get_rng_state())}
    for i, r in recipes.items():
        cap.captured(i, r)
    assert cap.build(recipes, {}).functions == frozenset()


def test_a_random_op_draws_from_the_state_at_the_last_save_if_nothing_drew_since() -> None:
    """A random op's template keeps which save's hook holds the generator state it drew from:
    the last save before it, proven by the state there being the recipe's. A draw between the
    save and the op (another random op, no save between) leaves the op with no template."""
    cap = TemplateCapture(nn.Linear(2, 2), rng_device=torch.device("cpu"))
    x, y = torch.randn(8), torch.randn(8)
    cap.saved(x, x.untyped_storage(), None, gap=3)
    r1 = _recipe(aten.bernoulli.p, [x, 0.5], rng=torch.get_rng_state())
    cap.captured(4, r1)
    torch.rand(1)   # an op no chain has draws
    cap.saved(y, y.untyped_storage(), None, gap=5)
    torch.rand(1)
    r2 = _recipe(aten.bernoulli.p, [y, 0.5], rng=torch.get_rng_state())
    cap.captured(6, r2)
    t = cap.build({4: r1, 6: r2}, {9: (4, 0)})
    assert t.functions == {4} and (t.calls[4].rng_at.k, t.calls[4].rng_at.gap) == (0, 3) and t.rng_device == torch.device("cpu")
    assert t.ready() == {4: 3}   # a discard for it waits for that save's hook

    bound = BoundTemplates(t, [(4,)])
    assert bound.why_not((4,)) is not None and bound.unsaved((4,))
    torch.manual_seed(7)
    z = torch.randn(8)
    bound.saved(z, z.untyped_storage())   # save 0 of this step: its state is taken
    assert bound.why_not((4,)) is None and not bound.unsaved((4,))
    want = torch.bernoulli(z, 0.5)   # what the op draws right after save 0, as it did in the capture
    torch.rand(3)   # the step goes on drawing: the replay draws from the state at save 0
    slot = Slot(9, Kind.ACTIVATION, 32, "v", in_place=False)
    made = []
    after = torch.get_rng_state()
    bound.replay(slot, (4,), {}, made.append)
    assert torch.equal(torch.empty(0).set_(made[0], 0, (8,), (1,)), want)
    assert torch.equal(torch.get_rng_state(), after)   # the step's generator is left as it was
    other = BoundTemplates(t, [(4,)])   # a step whose save there is another tensor: no state taken
    w = torch.randn(16)
    assert "the generator's state" in other.saved(w, w.untyped_storage()) and not other.states


def test_batchnorms_running_statistics_are_bound_unchecked() -> None:
    bn = nn.BatchNorm1d(3)
    cap = TemplateCapture(bn)
    x = torch.randn(4, 3)
    cap.saved(x, x.untyped_storage(), None, gap=0)
    args = [x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5]
    r = _recipe(aten.native_batch_norm.default, args, stats=(3, 4))
    cap.captured(0, r)
    t = cap.build({0: r}, {})
    bound = t.calls[0].args
    assert [a.checked for a in bound[1:5]] == [True, True, False, False]
    assert {id(p) for p in t.persistent} == {id(bn.weight), id(bn.bias)}


def _bound_one() -> tuple[BoundTemplates, torch.nn.Linear]:
    model = nn.Linear(2, 2)
    cap = TemplateCapture(model)
    x = torch.randn(16)
    cap.saved(x, x.untyped_storage(), None, gap=2)
    r = _recipe(aten.mul.Tensor, [x, model.weight])
    cap.captured(3, r)
    bound = BoundTemplates(cap.build({3: r}, {}), chains=[(3,), (3,)])
    assert bound.readers == {0: 2}   # two recomputes read save 0: held until the second ran
    return bound, model


def test_a_bound_step_refuses_another_size_a_written_save_and_a_written_parameter() -> None:
    bound, _ = _bound_one()
    y = torch.randn(8)
    assert "64 B" in bound.saved(y, y.untyped_storage()) and bound.why_not((3,)) is not None

    bound, _ = _bound_one()
    y = torch.randn(16)
    assert bound.unsaved((3,))
    assert bound.saved(y, y.untyped_storage()) is None and not bound.unsaved((3,))
    assert bound.why_not((3,)) is None
    y.mul_(2)
    assert "written since" in bound.why_not((3,))

    bound, model = _bound_one()
    y = torch.randn(16)
    bound.saved(y, y.untyped_storage())
    with torch.no_grad():
        model.weight.add_(1)
    assert "parameter" in bound.why_not((3,))


def test_a_parameter_written_before_its_op_read_it_is_checked_from_there() -> None:
    """A GAN's generator pass reads the discriminator's weights after their update: the
    template keeps the writes before its op read the weight, and a bound step refuses a
    discard only where the weight's writes since the step began are not that many."""
    model = nn.Linear(2, 2)
    cap = TemplateCapture(model)   # the step begins
    with torch.no_grad():
        model.weight.add_(1)       # the update, before the op
    x = torch.randn(16)
    cap.saved(x, x.untyped_storage(), None, gap=2)
    r = _recipe(aten.mul.Tensor, [x, model.weight])
    cap.captured(3, r)
    templates = cap.build({3: r}, {})
    assert templates.calls[3].checked == ((model.weight, 1),)

    def bound_after(writes: int) -> BoundTemplates:
        bound = BoundTemplates(templates, chains=[(3,)])
        with torch.no_grad():
            for _ in range(writes):
                model.weight.add_(1)
        y = torch.randn(16)
        bound.saved(y, y.untyped_storage())
        return bound

    assert bound_after(1).why_not((3,)) is None
    assert "parameter" in bound_after(0).why_not((3,))   # not updated yet: not the bytes the op read
    assert "parameter" in bound_after(2).why_not((3,))   # written after the op read it


def test_a_save_is_held_until_the_last_recompute_that_reads_it() -> None:
    from types import SimpleNamespace

    model = nn.Linear(2, 2)
    cap = TemplateCapture(model)
    x = torch.randn(2, 2)
    cap.saved(x, x.untyped_storage(), None, gap=1)
    r = _recipe(aten.mul.Tensor, [x, model.weight])
    cap.captured(3, r)
    bound = BoundTemplates(cap.build({3: r}, {7: (3, 0)}), chains=[(3,), (3,)])
    y = x.clone()
    bound.saved(y, y.untyped_storage())
    slot = SimpleNamespace(var=7, nbytes=16, name="product")
    made = []
    bound.replay(slot, (3,), {}, made.append)
    assert 0 in bound.packs   # a second recompute reads it
    bound.replay(slot, (3,), {}, made.append)
    assert bound.packs == {} and bound.recomputed == 32
    expected = (y * model.weight).detach()
    assert all(torch.equal(torch.empty(0).set_(s, 0, (2, 2), (2, 1)), expected) for s in made)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 512)
        self.hidden = nn.ModuleList(nn.Linear(512, 512) for _ in range(5))
        self.last = nn.Linear(512, 10)
        self.act = torch.sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.first(x))
        for layer in self.hidden:
            x = self.act(layer(x))
        return self.last(x)


def _run(model: nn.Module, opt: torch.optim.Optimizer, budget: int | None,
         steps: Iterable[Callable[[], torch.Tensor]], **options: Any) -> tuple[list, list]:
    """A step per loss of ``steps`` (each made as its step begins: what comes before, outside
    it), under an engine at ``budget`` or in core; the losses and, under the engine, each
    step's form, where it left its plan (-1) and the bytes recomputed so far."""
    engine = OutOfCore(model, opt, budget=budget, **options) if budget is not None else None
    losses, forms = [], []
    for loss_of in steps:
        with engine.step() if engine is not None else torch.enable_grad():
            loss = loss_of()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
        if engine is not None:
            s = engine.stats()
            forms.append((FORMS[s["last_form"]], s["last_diverged_at"], s["bytes_recomputed"]))
    if engine is not None:
        engine.close()
    return losses, forms


def _steps(model: nn.Module, budget: int | None, acts: list, attr: str = "act", inside: bool = False,
           **options: Any) -> tuple[list, list]:
    """A step per entry of ``acts``, which the model gets as ``attr`` before it, or as it
    begins (``inside``: set by the loop inside ``engine.step()``) (``_run``)."""
    def steps() -> Iterator[Callable[[], torch.Tensor]]:
        for i, act in enumerate(acts):
            if not inside:
                setattr(model, attr, act)
            torch.manual_seed(i)
            x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
            if inside:
                yield lambda: (setattr(model, attr, act), nn.functional.cross_entropy(model(x), y))[1]
            else:
                yield lambda: nn.functional.cross_entropy(model(x), y)
    return _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), budget, steps(), **options)


def _pow(p: float):
    return lambda x: torch.sigmoid(x).pow(p)   # bounded: six powers of a linear layer overflow


def _div(tau: float):
    return lambda x: x / tau


def _tempered(tau: float):
    return lambda x: torch.softmax(x / tau, -1) * 100   # (scaled: a softmax of 512 is small)


# (what the model runs: 9 settled steps, then a change, then the first again; whether the
# changed step leaves its plan, and what the warning names)
CHANGES = {
    # another op at the same sizes: the discarded activation's node type differs
    "sigmoid-to-tanh": ([torch.sigmoid] * 9 + [torch.tanh, torch.sigmoid], "was made by TanhBackward0 ("),
    # a number the template would replay as captured, which the node saves: its exponent
    "pow-2-to-3": ([_pow(2.0)] * 9 + [_pow(3.0), _pow(2.0)], "was made by PowBackward0[3.0] ("),
    # a number no hook sees (``x / tau`` reaches the op as a Python number, saved unhooked) that
    # changes every step: the per-op steps' templates differ there, so no template reruns it
    # (``Templates.ready``) and the anchored form swaps it; nothing to leave
    "div-by-a-schedule": ([_div(1.0 + k / 10) for k in range(11)], None),
    "softmax-temperature-by-a-schedule": ([_tempered(1.0 + k / 10) for k in range(11)], None),
    # the same number changed once the form settled: the node keeps it as a 0-dim tensor that
    # no hook sees (``made_by._number``); replayed as captured, every later step was wrong
    "div-once": ([_div(1.0)] * 9 + [_div(2.0), _div(1.0)], "was made by DivBackward0[2.0] ("),
    "softmax-temperature-once": ([_tempered(1.0)] * 9 + [_tempered(4.0), _tempered(1.0)],
                                 "DivBackward0[4.0]"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_step_whose_op_changed_at_the_same_sizes_leaves_its_plan_and_stays_bitwise(
        change: str, monkeypatch, caplog) -> None:
    """After the template form settled, the model changes what makes a discarded activation at
    the same sizes: another op, or another number for it. The templates would rerun what they
    captured: the step sees it where the activation is saved (its autograd node's type and
    saved numbers, ``templates.signature``), leaves its plan before discarding it, and every
    step stays bitwise with in-core training under the same change. A number no hook sees that
    changes every step keeps its function out of the templates, and the signatures that hold it
    match any (``Templates.vary_from``): the form keeps its plan."""
    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)
    acts, said = CHANGES[change]
    torch.manual_seed(0)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    ref_losses, _ = _steps(ref, None, acts)
    with caplog.at_level(logging.WARNING, logger="ooc.engine.step_end"):
        losses, forms = _steps(model, 6 << 20, acts)
    before = forms[8]
    assert before[0] == "anchored" and before[1] == -1, forms
    if said is None:   # kept its plan
        assert all(f[0] == "anchored" and f[1] == -1 for f in forms[9:]), forms
        if change == "div-by-a-schedule":   # its chains all divide by the schedule: it swaps them
            assert all(f[2] == before[2] for f in forms[9:]), forms
    else:
        assert before[2] > forms[7][2], forms   # the anchored steps recomputed
        assert forms[9][1] != -1 and said in caplog.text, (forms, caplog.text)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_signature_is_the_same_however_the_graphs_python_objects_come_and_go() -> None:
    """Autograd may make a node's Python object for the walk that reads it and free it with
    its level (torch 2.11 did, on an H200: a hook-driven step's first walk of a graph nobody
    had read from Python skipped nodes, and every ResNet-50 and Llama step with a discard left
    its plan). Here a graph whose objects are made on each read and live only while something
    holds them, as PyTorch's: ``signature`` must see every node once, in breadth order."""
    import weakref
    from types import SimpleNamespace

    from ooc.runtime.made_by import signature

    names = ("MulBackward0", "AddBackward0", "SinBackward0")
    edges = {0: (1, 2), 1: (3,), 2: (3, 4), 3: (5,), 4: (5, 6), 5: (7,), 6: (7,)}
    edges.update({k: (k + 1,) for k in range(7, 40)})   # a long tail: levels made and freed in turn
    edges[40] = ()
    live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    class Node:
        def __init__(self, key: int) -> None:
            self.key = key

        @property
        def next_functions(self) -> tuple:
            return tuple((made(c), 0) for c in edges[self.key])

    kinds = {name: type(name, (Node,), {}) for name in names}

    def made(k: int) -> Node:   # the live object of node k, else a new one (PyTorch's weak cache)
        obj = live.get(k)
        if obj is None:
            obj = live[k] = kinds[names[k % 3]](k)
        return obj

    order, seen, level = [], {0}, [0]
    while level:   # the reference: breadth order over the nodes themselves
        order.extend(level)
        level = [c for k in level for c in edges[k] if not (c in seen or seen.add(c))]
    want = tuple((names[k % 3], ()) for k in order)
    for _ in range(3):
        assert signature(SimpleNamespace(grad_fn=made(0)), depth=60) == want


def test_walks_that_share_a_memo_read_what_walks_alone_read() -> None:
    """One step's walks share what they read of the graph (``signature``'s ``memo``): walked
    from each saved tensor of a real block, in any order, with one memo, each signature is
    the one a walk alone gives; an entry whose ``id`` now names another node is not trusted."""
    from ooc.runtime.made_by import signature

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    h = torch.nn.functional.leaky_relu(x @ w, 0.2)
    outs = [h, h.pow(3), (h * 2).clamp(-1, 1), torch.nn.functional.gelu(h).sum(0), h.t().tanh()]
    alone = [signature(t, 12) for t in outs]
    memo: dict[int, tuple] = {}
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0]):
        assert [signature(outs[i], 12, memo) for i in order] == [alone[i] for i in order]
    node = outs[1].grad_fn
    memo[id(node)] = (object(), ("SomethingElse", ()), [])   # a dead node's id, reused
    assert signature(outs[1], 12, memo) == alone[1]
    assert len({a for sig in alone for a in sig}) > 5   # the walks read different nodes


def test_what_a_chain_makes_is_found_per_function() -> None:
    """``Templates.born_in``: function -> the variables it makes (a replay finds what its chain
    makes itself from its functions, not from every variable of the step), and a chain's
    ``inputs`` are the managed variables it reads and does not make."""
    view = View.of(torch.zeros(2))
    read = {3: (VarArg(7, view),), 4: (VarArg(1, view), VarArg(8, view))}
    calls = {w: Template.make(torch.add, args, {}) for w, args in read.items()}
    t = Templates(calls, {1: (3, 0), 2: (3, 1), 5: (4, 0), 7: (0, 0), 8: (2, 0)}, {}, {}, ())
    assert t.born_in == {3: ((1, (3, 0)), (2, (3, 1))), 4: ((5, (4, 0)),), 0: ((7, (0, 0)),),
                         2: ((8, (2, 0)),)}
    assert BoundTemplates(t).inputs((3, 4), var=5) == [7, 8]   # 1 is made by function 3


def _dropped(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.dropout(torch.sigmoid(x), 0.1, training=True)


def test_dropout_in_a_chain_reruns_at_the_hooks_bitwise(monkeypatch) -> None:
    """Dropout after each layer: its output and mask are saved, and the chains that make them
    again draw random numbers. The template form replays them from the generator's state at the
    last save before the dropout (``Template.rng_at``), and every step stays bitwise with in-core
    training. Without that state (random ops untemplated, as before), the anchored steps
    recompute less: their plan swaps what the dropouts make."""
    from test_anchored_steps import templates_forced

    import ooc.runtime.saved_tensors as saved_tensors

    templates_forced(monkeypatch.setattr)
    acts = [_dropped] * 10
    torch.manual_seed(0)
    ref = Net()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses, _ = _steps(ref, None, acts)

    def run() -> tuple[list, list, Net]:
        model = Net()
        model.load_state_dict(state)
        losses, forms = _steps(model, 6 << 20, acts)
        return losses, forms, model

    losses, forms, model = run()
    assert all(f[0] == "anchored" and f[1] == -1 for f in forms[7:]), forms
    with_rng = forms[-1][2] - forms[-2][2]   # bytes recomputed by the last (anchored) step
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k

    real = saved_tensors.TemplateCapture
    monkeypatch.setattr(saved_tensors, "TemplateCapture",
                        lambda model, depth, rng_device, watch=True: real(model, depth, watch=watch))
    _, forms, _ = run()
    assert forms[-1][0] == "anchored" and with_rng > forms[-1][2] - forms[-2][2] >= 0, (with_rng, forms)


def test_a_save_sliced_from_a_storage_made_before_the_step_is_read_where_this_step_saved_it() -> None:
    """A batch sliced from a tensor made before the step (``x = xs[i:i + b]``) is saved at
    another offset of one storage at every step: a replay reads its view from where this
    step's save starts, not where the captured step's did; a save that looks otherwise at its
    storage (another stride) is refused where the op read a part of it."""
    from types import SimpleNamespace

    model = nn.Linear(2, 2)
    xs = torch.randn(3, 2, 2)
    cap = TemplateCapture(model)
    x = xs[0]
    cap.saved(x, x.untyped_storage(), None, gap=1)
    r = _recipe(aten.mul.Tensor, [x, model.weight])
    cap.captured(3, r)
    templates = cap.build({3: r}, {7: (3, 0)})
    bound = BoundTemplates(templates, chains=[(3,)])
    y = xs[2]   # the next step's batch: the same storage, 16 bytes on
    assert bound.saved(y, y.untyped_storage()) is None and bound.why_not((3,)) is None
    made = []
    bound.replay(SimpleNamespace(var=7, nbytes=16, name="product"), (3,), {}, made.append)
    assert torch.equal(torch.empty(0).set_(made[0], 0, (2, 2), (2, 1)), (y * model.weight).detach())

    bound = BoundTemplates(templates, chains=[(3,)])
    y = xs[:2, 0]   # the same storage and shape, read across it: the op read this save whole
    assert bound.saved(y, y.untyped_storage()) is None and bound.why_not((3,)) is None
    made = []
    bound.replay(SimpleNamespace(var=7, nbytes=16, name="product"), (3,), {}, made.append)
    assert torch.equal(torch.empty(0).set_(made[0], 0, (2, 2), (2, 1)), (y * model.weight).detach())

    cap = TemplateCapture(model)   # an op that read a part of the save
    cap.saved(x, x.untyped_storage(), None, gap=1)
    r = _recipe(aten.mul.Tensor, [x[1], model.weight[0]])
    cap.captured(3, r)
    bound = BoundTemplates(cap.build({3: r}, {7: (3, 0)}), chains=[(3,)])
    assert not bound.templates.wanted[0].whole
    assert "viewed as" in bound.saved(y, y.untyped_storage())


def test_a_save_the_op_read_whole_is_read_as_it_is_wherever_its_bytes_lie() -> None:
    """A decoder's next token is a column of the targets under teacher forcing and the last
    output's ``argmax`` without: the embedding saves a strided view of the targets' storage in
    one step and a tensor of its own in the next. The op read the save whole, so a replay reads
    this step's save as it is: any strides, storage and offset, of the captured dtype and
    shape, made by no node as before. Of several saves of one storage (a column per decoder
    step), the capture binds the one that is the tensor the op read."""
    from types import SimpleNamespace

    model = nn.Embedding(8, 2)
    tgt = torch.randint(0, 8, (4, 3))
    cap = TemplateCapture(model)
    columns = [tgt[:, k] for k in range(3)]   # (a save is held weakly: the step's node holds it)
    for k, column in enumerate(columns):
        cap.saved(column, tgt.untyped_storage(), None, gap=k)
    r = _recipe(aten.embedding.default, [model.weight, tgt[:, 2]])
    cap.captured(5, r)
    templates = cap.build({5: r}, {9: (5, 0)})
    assert templates.wanted[2].whole and set(templates.wanted) == {2}

    def bound_after(token: torch.Tensor) -> tuple[BoundTemplates, str | None]:
        bound = BoundTemplates(templates, chains=[(5,)])
        whys = [bound.saved(t, t.untyped_storage()) for t in (tgt[:, 0], tgt[:, 1], token)]
        return bound, next((w for w in whys if w is not None), None)

    token = torch.randint(0, 8, (4, 2)).argmax(-1)   # a tensor of its own, contiguous
    bound, why = bound_after(token)
    assert why is None and bound.why_not((5,)) is None
    made = []
    bound.replay(SimpleNamespace(var=9, nbytes=32, name="embedded"), (5,), {}, made.append)
    assert torch.equal(torch.empty(0).set_(made[0], 0, (4, 2), (2, 1)), model(token).detach())
    assert "Size([2])" in bound_after(token[:2])[1]                     # another shape
    assert "int32" in bound_after(token.int())[1]                       # another dtype
    assert "MulBackward0" in bound_after((token * 1.0).requires_grad_() * 2)[1]   # made by a node


def _resnet(budget: int | None, between: Callable[[int, nn.Module, torch.optim.Optimizer], None] = lambda *a: None,
            steps: int = 8) -> tuple[list, list, dict]:
    """Hugging Face's ResNet (BatchNorm, skip connections), SGD with momentum, on batches
    sliced from one tensor made before the loop; ``between(step, model, opt)`` before each
    step. The losses, the forms (``_run``) and the final state."""
    from test_mixed_batches import hf_resnet

    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, 10, (12,), generator=g)
    model = hf_resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def each() -> Iterator[Callable[[], torch.Tensor]]:
        for step in range(steps):
            between(step, model, opt)
            i = step % 3 * 4
            yield lambda: model(xs[i:i + 4], labels=ys[i:i + 4]).loss
    return (*_run(model, opt, budget, each()), model.state_dict())


def _assert_same(ref: tuple, got: tuple) -> None:
    for i, (a, b) in enumerate(zip(ref[0], got[0])):
        assert torch.equal(a, b), f"loss of step {i}: {a.item()} vs {b.item()}"
    for k, a in ref[2].items():
        assert torch.equal(a, got[2][k]), k


def test_a_resnet_whose_batch_is_sliced_from_a_dataset_tensor_recomputes_at_the_hooks_bitwise(monkeypatch) -> None:
    """Batches sliced from one tensor made before the loop, the template form forced: the first
    convolution's chain replays from the batch autograd saved, which is a view at another
    offset of that tensor at every step. Read at the captured step's offset, the first
    hook-driven step that recomputed it replayed another batch's images, and every loss from
    the next step on differed (timm's ResNet-18 too, and one run in two without the form
    forced)."""
    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)
    ref, got = _resnet(None), _resnet(256 << 10)
    forms = got[1]
    anchored = [f for f in forms if f[0] == "anchored"]
    assert anchored and all(f[1] == -1 for f in anchored), forms
    assert forms[-1][2] > forms[-2][2], forms   # the last step recomputed
    _assert_same(ref, got)


def test_parameters_assigned_between_steps_are_not_replayed_from_the_old_ones(monkeypatch, caplog) -> None:
    """``load_state_dict(..., assign=True)`` between steps (a checkpoint loaded into the live
    model, its optimizer given the new parameters as it must be) puts other tensors in the
    model. The templates held the old ones and replayed the chains with them: every loss after
    the next step differed. Now the next hook-driven step leaves its plan at its first
    discard, saying which, and the step after it captures anew; bitwise throughout."""
    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)

    def load(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if step == 6:
            state = {k: v * 0.5 if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(state, assign=True)
            opt.param_groups[0]["params"] = list(model.parameters())
            opt.state.clear()

    ref = _resnet(None, load, steps=10)
    with caplog.at_level(logging.INFO, logger="ooc"):
        got = _resnet(256 << 10, load, steps=10)
    forms = got[1]
    assert forms[5][0] == "anchored" and forms[5][1] == -1, forms
    assert forms[6][0] == "anchored" and forms[6][1] != -1, forms
    assert "is another tensor than the one its templates read" in caplog.text
    _assert_same(ref, got)


def test_a_save_read_as_another_dtype_is_read_from_its_bytes() -> None:
    """An op that reads a save as another dtype (``view_as_real`` of a complex batch) at an
    offset that moves with the save: the view is kept in bytes from where the save starts."""
    from types import SimpleNamespace

    model = nn.Linear(2, 2)
    cs = torch.randn(3, 4, dtype=torch.complex64)
    cap = TemplateCapture(model)
    c = cs[0]
    cap.saved(c, c.untyped_storage(), None, gap=1)
    r = _recipe(aten.mul.Tensor, [torch.view_as_real(c), torch.view_as_real(c)])
    cap.captured(3, r)
    bound = BoundTemplates(cap.build({3: r}, {7: (3, 0)}), chains=[(3,)])
    now = cs[2]
    assert bound.saved(now, now.untyped_storage()) is None
    made = []
    bound.replay(SimpleNamespace(var=7, nbytes=32, name="square"), (3,), {}, made.append)
    real = torch.view_as_real(now)
    assert torch.equal(torch.empty(0).set_(made[0], 0, (4, 2), (2, 1)), real * real)


class _LayerDropNet(Net):
    """``Net`` whose hidden layers in ``skip`` are left out of the forward (LayerDrop, as
    Hugging Face's Wav2Vec2, BART and Whisper write it: a Python branch per layer)."""

    skip: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.first(x))
        for i, layer in enumerate(self.hidden):
            if i not in self.skip:
                x = self.act(layer(x))
        return self.last(x)


def test_a_step_that_skips_a_layer_is_not_replayed_with_the_skipped_layers_weights(monkeypatch, caplog) -> None:
    """After the template form settled, a step leaves out a hidden layer. The next layers'
    tensors are saved where the skipped one's were, of the same sizes from the same nodes: the
    templates replayed them with the skipped layer's weights, and every step after it trained
    wrong (Hugging Face's Wav2Vec2 at its default ``layerdrop=0.1``: losses differed from the
    step after the first hook-driven step that skipped a layer). The weights a layer's ops save
    show which layer ran (``Templates.at_saves``): the step leaves its plan there, bitwise."""
    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)
    skips = [frozenset()] * 9 + [frozenset({1}), frozenset(), frozenset({3})]
    torch.manual_seed(0)
    ref = _LayerDropNet()
    model = _LayerDropNet()
    model.load_state_dict(ref.state_dict())
    ref_losses, _ = _steps(ref, None, skips, "skip")
    with caplog.at_level(logging.INFO, logger="ooc"):
        losses, forms = _steps(model, 6 << 20, skips, "skip")
    assert forms[8][0] == "anchored" and forms[8][1] == -1 and forms[8][2] > forms[7][2], forms
    assert forms[9][0] == "anchored" and forms[9][1] != -1, forms
    assert "is not the parameter or buffer" in caplog.text
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_step_that_left_its_anchored_plan_gives_back_what_its_backward_read_back(monkeypatch) -> None:
    """A swapping plan run at the hooks; a step skips the last hidden layer and leaves the plan
    at the end of its forward. Its backward reads every activation back on demand, and each
    stayed in the pool to the step's end: at 4 MiB the pool ran out (``BudgetExceeded``; a
    Wav2Vec2 with LayerDrop at 20 MiB, one run in three). Each goes back when its node lets
    go of it now: the step finishes within the budget, bitwise."""
    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)
    skips = [frozenset()] * 9 + [frozenset({4}), frozenset()]
    torch.manual_seed(0)
    ref = _LayerDropNet()
    model = _LayerDropNet()
    model.load_state_dict(ref.state_dict())
    ref_losses, _ = _steps(ref, None, skips, "skip")
    losses, forms = _steps(model, 4 << 20, skips, "skip", recompute="never")
    assert forms[8] == ("anchored", -1, 0) and forms[9][0] == "anchored" and forms[9][1] != -1, forms
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


class _NumberedNet(Net):
    """``Net`` with two Python numbers its modules hold: a dropout probability after each
    hidden layer (on the CPU the mask is drawn by ``bernoulli_(1 - p)``, an op no autograd
    node records) and a shift added to each (an addition's node keeps no number)."""

    p, shift = 0.1, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.first(x))
        for layer in self.hidden:
            x = nn.functional.dropout(self.act(layer(x) + self.shift), self.p, self.training)
        return self.last(x)


@pytest.mark.parametrize("attr,before,after", [("p", 0.1, 0.3), ("shift", 0.0, 0.5)])
def test_a_number_a_module_holds_changed_inside_a_step_after_the_form_settled(
        attr: str, before: float, after: float, monkeypatch, caplog) -> None:
    """A number the model's module holds (``nn.Dropout.p``, a shift kept as an attribute),
    changed inside the step once the template form settled. No hook sees it (no autograd node
    keeps it), and the templates replayed it as captured: every step after it was wrong. The
    first discard compares the modules' numbers with the capture's (``Templates.numbers``),
    leaves the plan naming it, and the next step captures anew: bitwise."""
    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)
    values = [before] * 10 + [after] * 3
    torch.manual_seed(0)
    ref = _NumberedNet()
    model = _NumberedNet()
    model.load_state_dict(ref.state_dict())
    ref_losses, _ = _steps(ref, None, values, attr, inside=True)
    with caplog.at_level(logging.INFO, logger="ooc"):
        losses, forms = _steps(model, 6 << 20, values, attr, inside=True)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    assert forms[9][0] == "anchored" and forms[9][1] == -1 and forms[9][2] > forms[8][2], forms
    assert forms[10][1] != -1 and f"the model's {attr} is {after}, the templates' step ran with {before}" in caplog.text


def test_a_loose_view_is_left_out_of_the_trace_whatever_storage_it_views() -> None:
    """A column of a targets tensor held whole is as small as the ``argmax`` a decoder feeds
    itself instead; counted by its storage's bytes it was a save of the trace and the
    ``argmax`` none, and the two kinds of step did not line up. A view that gradients flow
    through, a tensor of its own and a view as large as the threshold count as before."""
    from ooc.runtime.hook_trace import loose_view

    targets = torch.randint(0, 32, (64 * 200, 8))
    column = targets[:64][:, 3]
    assert loose_view(column, 1 << 16) and not loose_view(column, column.nbytes)
    assert not loose_view(column.clone(), 1 << 16)                            # its own storage
    assert not loose_view(torch.randn(8, 8, requires_grad=True)[:, 0], 1 << 16)   # a gradient flows


class _Decoder(nn.Module):
    """A GRU-cell decoder whose next token is a column of the targets (teacher forcing) or its
    last output's ``argmax``, as the loop chooses per batch (PyTorch's seq2seq tutorial)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.cell, self.out = nn.Embedding(32, 256), nn.GRUCell(256, 256), nn.Linear(256, 32)

    def forward(self, h: torch.Tensor, tgt: torch.Tensor, forcing: bool | list[bool]) -> torch.Tensor:
        """``forcing``: for the batch, or per time step (scheduled sampling)."""
        token, logits = torch.zeros(tgt.shape[0], dtype=torch.long), []
        for t in range(tgt.shape[1]):
            h = self.cell(torch.sigmoid(self.emb(token)), h)
            logits.append(self.out(h))
            token = tgt[:, t] if (forcing[t] if isinstance(forcing, list) else forcing) else logits[-1].argmax(-1)
        return torch.stack(logits, 1)


def _decoded(model: _Decoder, budget: int | None, forcing: list) -> tuple[list, list]:
    """A step per entry of ``forcing``, its targets sliced from a dataset held whole (its
    columns are views of 800 KiB: their storage is above the threshold, they are not)."""
    targets = torch.randint(0, 32, (64 * 200, 8), generator=torch.Generator().manual_seed(0))

    def steps() -> Iterator[Callable[[], torch.Tensor]]:
        for i, f in enumerate(forcing):
            h, tgt = torch.randn(64, 256, generator=torch.Generator().manual_seed(i)), targets[64 * i:64 * (i + 1)]
            yield lambda f=f, h=h, tgt=tgt: nn.functional.cross_entropy(model(h, tgt, f).flatten(0, 1), tgt.flatten())
    return _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), budget, steps())


def _decoded_alike(forcing: list) -> list:
    """``_decoded`` in core and under the engine at 1 MiB, from the same weights: each step's
    loss and every parameter bitwise; the engine's forms."""
    torch.manual_seed(0)
    ref = _Decoder()
    model = _Decoder()
    model.load_state_dict(ref.state_dict())
    ref_losses, _ = _decoded(ref, None, forcing)
    losses, forms = _decoded(model, 1 << 20, forcing)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    return forms


def test_teacher_forcing_chosen_per_batch_settles_in_the_anchored_form(monkeypatch) -> None:
    """Teacher forcing on or off per batch: the forward's ops differ (``select`` against
    ``argmax``), its saves do not. A per-op step of the other kind leaves the plan (here the
    trial's per-op turn, step 6) while the anchored steps before it held: the trial ends for
    them (``Decision.hook_wins``), and every later step of either kind runs anchored and
    recomputes, bitwise. Before, each change of kind left the plan and was planned from (the
    next change left that plan too), and an anchored step of the other kind left at the
    embedding's saved tokens: a view of the targets' storage then, a tensor of its own now,
    read as the captured view (``PackArg.whole``) and counted in the trace by the storage's
    bytes (``hook_trace.loose_view``)."""
    from test_anchored_steps import templates_forced

    from ooc.engine.hook_forms import HookPlan
    from ooc.testing.forced_forms import decided

    templates_forced(monkeypatch.setattr)
    monkeypatch.setattr(HookPlan, "judge", decided(True, runs=3))   # a trial long enough to be left
    forms = _decoded_alike([True] * 6 + [False, True, False, False, True, True, False])
    assert forms[6][0] == "diverged", forms
    assert all(f == "anchored" and at == -1 for f, at, _ in forms[7:]), forms
    assert all(b > a for (*_, a), (*_, b) in zip(forms[6:], forms[7:])), forms   # each recomputes


def test_teacher_forcing_chosen_per_token_settles_in_the_anchored_form_of_a_traced_recording(monkeypatch) -> None:
    """Teacher forcing drawn per time step (scheduled sampling, the bentrevett seq2seq
    tutorials): no two steps run the same ops, no per-op step keeps to any plan, and no
    anchored form was ever made from one; every step ran on demand from where it left its plan.
    The streak's first re-plan drops the plan instead (``Decision.trace``): the next step
    records with its hook trace, and its plan gets its anchored form at once; the steps of any
    pattern then run anchored, bitwise."""
    import random

    from test_anchored_steps import templates_forced

    templates_forced(monkeypatch.setattr)
    draw = random.Random(0)
    forms = _decoded_alike([[draw.random() < 0.5 for _ in range(8)] for _ in range(14)])
    first = next(i for i, (f, _, _) in enumerate(forms) if f == "anchored")
    assert forms[first - 1][0] == "recorded" and first <= 8, forms
    assert sum(f != "anchored" or at != -1 for f, at, _ in forms[first:]) <= 1, forms   # the trial's per-op turn
    assert all(f == "anchored" and at == -1 for f, at, _ in forms[first + 3:]), forms


def test_a_signature_names_the_parameters_each_node_read_through_views() -> None:
    """A one-node signature of ``relu(x) + b`` names ``b`` read as itself and through any view
    op (``b[None, None]`` is two ``unsqueeze``), and ``b2`` where ``b2`` was read instead. A
    block skipped by LayerDrop whose bias was read as ``b[None, None]`` had its chains replayed
    with that bias (at default settings, two runs in three): the walk looked through ``view``
    and ``reshape`` nodes only, and a short plan's walk ended before the ``unsqueeze``."""
    from ooc.runtime.made_by import matches, signature

    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, requires_grad=True)
    b, b2 = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    reads = [lambda p: p, lambda p: p[None, None], lambda p: p.unsqueeze(0).expand(3, 4), lambda p: p.view(1, 4)]
    for read in reads:
        sig = signature(torch.relu(x) + read(b), 1)
        assert sig == (("AddBackward0", (1,), (id(b),)),), sig
        assert matches(signature(torch.relu(x) + read(b2), 1), sig) == 0
    assert signature(torch.relu(x) + read(b.detach()), 1) == (("AddBackward0", (1,)),)
