"""The Python numbers a forward reads that no autograd node keeps (``ooc/runtime/model_numbers.py``).

The template form replays each op's numbers as captured. A number held where the engine did
not look, changed once the form settled (at an epoch's end), was replayed stale: a shift passed
to the model's forward, to each block's, or kept in a config object the modules share, and a
margin the training loop subtracts from a distance matrix. Every step after the change trained
wrong (the losses differed from in core's from the step after it), on the code before.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.nn as nn

from ooc.runtime.forward_numbers import Forwards, loose_numbers
from ooc.runtime.model_numbers import changed_since, first_change, held, same
from ooc.runtime.recipes import Recipe
from ooc.runtime.templates import TemplateCapture
from test_anchored_steps import templates_forced
from test_templates import _run

aten = torch.ops.aten


_SHIFT = 0.0   # the "global" source's (a script's model reads its module's global)
_STATE = types.SimpleNamespace(shift=0.0)   # the "object" source's: a global object's attribute
# the "module" and "helper" sources': another Python module's global, read as its attribute or by
# a function of that module the forward calls
_helpers = types.ModuleType("_helpers")
exec("SHIFT = 0.0\ndef shifted(h):\n    return h + SHIFT\n", vars(_helpers))


_HOOK_SHIFT = 0.0   # the "hook" source's: a forward hook on each block's layer adds it


def _shift_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(out + _HOOK_SHIFT)


def _adding(shift: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda h: h + shift


class _Block(nn.Module):
    lift = 0.0   # the "class" source's: an attribute of the block's class

    def __init__(self, config: object, source: str) -> None:
        super().__init__()
        self.layer, self.config, self.source = nn.Linear(512, 512), config, source
        self.rates = [0.0]   # the "list" source's
        self.fn = _adding(0.0)   # the "function" source's

    def forward(self, x: torch.Tensor, shift: float | None = None) -> torch.Tensor:
        h = torch.relu(self.layer(x))
        if self.source == "helper":
            return torch.sigmoid(_helpers.shifted(h))
        if self.source == "global":
            shift = _SHIFT
        elif self.source == "object":
            shift = _STATE.shift
        elif self.source == "module":
            shift = _helpers.SHIFT
        elif self.source == "class":
            shift = self.lift
        elif self.source == "list":
            shift = self.rates[0]
        elif self.source == "function":
            return torch.sigmoid(self.fn(h))
        elif self.source == "options":
            shift = shift["shift"]
        elif shift is None:
            c = self.config
            shift = c["shift"] if isinstance(c, dict) else c.shift
        return torch.sigmoid(h + shift)   # an addition's node keeps no number


class _Shifted(nn.Module):
    """Five blocks that add a shift, read from where ``source`` says:

    - passed in: the model's forward argument (``model``; ``numpy``: as NumPy's number, an
      ``np.float64`` is not a ``float``), each block's (``block``: the model passes it down
      from a nested dict it takes), an entry of a dict of options the model takes and passes
      to each block (``options``);
    - held: an attribute of a config object (``config``) or a dict (``dict``) the blocks
      share, or of a config object the loop gives each block anew at every step
      (``replaced``), an item of a list each block holds (``list``), a function each block
      holds and calls, a new one at every step (``function``: ``lambda h: h + shift``);
    - named by code: a global of the Python module that defines the blocks (``global``), an
      attribute of a global object (``object``) or of the blocks' class (``class``), a global
      of another Python module, read as its attribute (``module``) or by a function of that
      module (``helper``), a global that a forward hook on each block's layer adds (``hook``).
    """

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.config = {"shift": 0.0} if source == "dict" else types.SimpleNamespace(shift=0.0)
        self.first = nn.Linear(64, 512)
        self.blocks = nn.ModuleList(_Block(self.config, source) for _ in range(5))
        self.last = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor, shift: float | dict = 0.0) -> torch.Tensor:
        x = torch.sigmoid(self.first(x))
        for b in self.blocks:
            passed = shift["opts"]["shift"] if self.source == "block" else shift
            x = b(x, passed if self.source in ("model", "numpy", "options", "block") else None)
        return self.last(x)


def _twins(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two copies of one model from seed 0: one trained in core, one under the engine."""
    torch.manual_seed(0)
    ref, model = build(), build()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _batch(i: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s inputs of ``shape`` and its labels (10 classes), from a seed of its own."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)


def _assert_alike(ref_losses: list, losses: list, ref: nn.Module, model: nn.Module) -> None:
    """Every loss and every parameter and buffer of the engine's run bitwise in-core's."""
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def _shifted_steps(model: _Shifted, budget: int | None, shifts: list[float]) -> tuple[list, list]:
    """A step per shift, set as the loop's epoch changes it (``_run``)."""
    def steps() -> Iterator[Callable[[], torch.Tensor]]:
        for i, shift in enumerate(shifts):
            torch.manual_seed(i)
            x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
            global _SHIFT, _HOOK_SHIFT
            if model.source == "global":
                _SHIFT = shift
            elif model.source == "hook":
                _HOOK_SHIFT = shift
            elif model.source == "object":
                _STATE.shift = shift
            elif model.source == "class":
                _Block.lift = shift
            elif model.source in ("module", "helper"):
                _helpers.SHIFT = shift
            elif model.source == "list":
                for b in model.blocks:
                    b.rates[0] = shift
            elif model.source == "function":   # (a new function at every step, the same until the change)
                for b in model.blocks:
                    b.fn = _adding(shift)
            elif model.source == "dict":
                model.config["shift"] = shift
            elif model.source == "config":
                model.config.shift = shift
            elif model.source == "replaced":   # (a new config at every step, the same until the change)
                for b in model.blocks:
                    b.config = types.SimpleNamespace(shift=shift)
            args = {"model": (x, shift), "numpy": (x, np.float64(shift)), "options": (x, {"shift": shift}),
                    "block": (x, {"opts": {"shift": shift}})}.get(model.source, (x,))
            yield lambda args=args, y=y: nn.functional.cross_entropy(model(*args), y)
    return _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), budget, steps())


@pytest.mark.parametrize("source,named", [
    ("model", "the forward of the model (call 0) took 0.5 as its argument 1, the templates' step 0.0"),
    ("block", "the forward of blocks.0 (call 0) took 0.5 as its argument 1, the templates' step 0.0"),
    ("config", "the model's config.shift is 0.5, the templates' step ran with 0.0"),
    ("dict", "the model's config.shift is 0.5, the templates' step ran with 0.0"),
    ("replaced", "the model's blocks.0.config.shift is 0.5, the templates' step ran with 0.0"),
    ("global", "the model's global test_model_numbers._SHIFT is 0.5, the templates' step ran with 0.0"),
    ("object", "the model's global test_model_numbers._STATE.shift is 0.5, the templates' step ran with 0.0"),
    ("class", "the model's class attribute _Block.lift is 0.5, the templates' step ran with 0.0"),
    ("module", "_helpers.SHIFT is 0.5, the templates' step ran with 0.0"),
    ("helper", "_helpers.SHIFT is 0.5, the templates' step ran with 0.0"),
    ("list", "the model's blocks.0.rates.0 is 0.5, the templates' step ran with 0.0"),
    ("hook", "the model's global test_model_numbers._HOOK_SHIFT is 0.5, the templates' step ran with 0.0"),
    ("function", "the model's blocks.0.fn is <function _adding.<locals>.<lambda>"),
    ("options", "the forward of the model (call 0) took 0.5 as its argument 1's 'shift', the templates' step 0.0"),
    ("numpy", "the forward of the model (call 0) took np.float64(0.5) as its argument 1, the templates' step "
              "np.float64(0.0)")])
def test_a_number_the_forward_reads_changed_after_the_form_settled_leaves_the_plan(
        source: str, named: str, monkeypatch, caplog) -> None:
    """The shift changes at step 10, once the template form settled, and stays: the step
    leaves its plan at its first discard, naming the number, the next captures anew, and every
    loss and parameter is in-core's bitwise (on the code before: from step 11 on, not)."""
    templates_forced(monkeypatch.setattr)
    shifts = [0.0] * 10 + [0.5] * 3
    ref, model = _twins(lambda: _Shifted(source))
    if source == "hook":   # (by the loop: no code of the model's classes names the hook)
        for b in (*ref.blocks, *model.blocks):
            b.layer.register_forward_hook(_shift_output)
    ref_losses, _ = _shifted_steps(ref, None, shifts)
    with caplog.at_level("INFO", logger="ooc"):
        losses, forms = _shifted_steps(model, 6 << 20, shifts)
    _assert_alike(ref_losses, losses, ref, model)
    assert forms[9][0] == "anchored" and forms[9][1] == -1 and forms[9][2] > forms[8][2], forms
    assert forms[10][1] != -1 and named in caplog.text, (forms, caplog.text[-800:])
    assert _forwards_hooks(model) == 0, "hooks left on"


def _margin_steps(model: nn.Module, budget: int | None, margins: list[float]) -> tuple[list, list]:
    """A metric-learning loss in the loop's code: ``exp(margin - d)`` over the batch's 512 x 512
    distances (1 MiB, saved by the ``exp``), the margin raised at an epoch's end."""
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(5120, 64, generator=g), torch.randint(0, 8, (5120,), generator=g)

    def steps() -> Iterator[Callable[[], torch.Tensor]]:
        for i, margin in enumerate(margins):
            def loss(at=i % 10 * 512, margin=margin) -> torch.Tensor:
                x, y = xs[at:at + 512], ys[at:at + 512]   # (sliced in the step, as the loops do)
                z = nn.functional.normalize(model(x), dim=1)
                d = 2 - 2 * (z @ z.t())
                same_class = (y[:, None] == y[None, :]).float()
                hinge = torch.exp(margin - d)   # (held to the step's end: the plan keeps it by then)
                return (same_class * d).mean() + ((1 - same_class) * hinge).mean()
            yield loss
    return _run(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), budget, steps(),
                **({"manage": ("activations",)} if budget is not None else {}))


def test_a_number_of_the_training_loops_own_code_is_never_replayed(monkeypatch) -> None:
    """The margin reaches ``rsub`` as a Python number outside every forward, where no hook can
    see it change: the ops of the loop's code that take such a number give no template, and
    the anchored steps keep (or swap) what their chains would have made. At 4 MiB the code
    before recomputed ``exp(margin - d)`` from the captured margin after the change: every
    loss from step 13 on differed. Bitwise now."""
    templates_forced(monkeypatch.setattr)
    margins = [0.5] * 12 + [0.75] * 4
    ref, model = _twins(lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)))
    ref_losses, _ = _margin_steps(ref, None, margins)
    losses, forms = _margin_steps(model, 4 << 20, margins)
    assert sum(f[0] == "anchored" for f in forms) >= 8, forms
    _assert_alike(ref_losses, losses, ref, model)


def test_an_op_of_the_loops_code_with_a_loose_number_gets_no_template_one_in_a_forward_does() -> None:
    """Three recipes read one save: ``x + 0.5`` in the loop's code (no template), the same in
    a forward (one), a ``log_softmax`` in the loop's code, whose numbers are a dimension and a
    flag (one)."""
    cap = TemplateCapture(nn.Linear(4, 4))
    x = torch.randn(8, requires_grad=True) * 2
    cap.saved(x, x.untyped_storage(), None, gap=1)
    recipes = {i: Recipe(f, a, {}, [(x, x._version)], None, None, True, 1, outside=o)
               for i, f, a, o in ((3, aten.add.Tensor, (x, 0.5), True), (4, aten.add.Tensor, (x, 0.5), False),
                                  (5, aten._log_softmax.default, (x, -1, False), True))}
    for i, r in recipes.items():
        cap.captured(i, r)
    assert set(cap.build(recipes, {}).calls) == {4, 5}


def test_a_number_read_out_of_a_tensor_in_a_forward_leaves_no_later_template_that_replays_one() -> None:
    """A read in the loop's code (its ops' numbers are ``loose_numbers``') and a flag's read
    in a forward stop nothing; a number's read in a forward (op 4) stops the templates after it
    that replay a number (5), not those before it (3) nor those that replay none (6)."""
    cap = TemplateCapture(nn.Linear(4, 4))
    x = torch.randn(8, requires_grad=True) * 2
    cap.saved(x, x.untyped_storage(), None, gap=1)
    cap.read_out(1, torch.tensor(3))
    cap.forwards.depth = 1   # (inside a forward)
    cap.read_out(2, torch.tensor(True))
    cap.read_out(4, torch.tensor(3.0))
    recipes = {i: Recipe(f, a, {}, [(x, x._version)], None, None, True, 1)
               for i, f, a in ((3, aten.mul.Tensor, (x, 2.0)), (5, aten.mul.Tensor, (x, 2.0)),
                               (6, aten.sigmoid.default, (x,)))}
    for i, r in recipes.items():
        cap.captured(i, r)
    assert set(cap.build(recipes, {}).calls) == {3, 6}


def test_numbers_that_cannot_be_read_leave_no_template_that_replays_one(monkeypatch, caplog) -> None:
    """Reading the numbers walks the user's objects, which may raise: the step goes on, says
    so, and no function that replays a number gets a template."""
    def unreadable(model: nn.Module) -> dict:
        raise RuntimeError("a property that raises")

    monkeypatch.setattr("ooc.runtime.templates.held", unreadable)
    with caplog.at_level("INFO", logger="ooc"):
        cap = TemplateCapture(nn.Linear(4, 4))
    assert "could not be read (RuntimeError: a property that raises)" in caplog.text
    x = torch.randn(8, requires_grad=True) * 2
    cap.saved(x, x.untyped_storage(), None, gap=1)
    recipes = {i: Recipe(f, a, {}, [(x, x._version)], None, None, True, 1)
               for i, f, a in ((3, aten.mul.Tensor, (x, 2.0)), (4, aten.sigmoid.default, (x,)))}
    for i, r in recipes.items():
        cap.captured(i, r)
    assert set(cap.build(recipes, {}).calls) == {4}


_TABLE = {"": 1.0, "rate": 0.5, "_private": 2.0}   # (timm has a global dict with an empty key)


def test_a_global_dict_with_an_empty_key_is_read() -> None:
    """An empty key is no name (the first version indexed its first character: the capturing
    step of a timm ViT raised ``IndexError``)."""
    class Rated(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * _TABLE["rate"]

    names = {entry[2]: entry[3] for entry in held(Rated(2, 2)).values()}
    assert names["global test_model_numbers._TABLE.rate"] == 0.5
    assert not [n for n in names if "_TABLE" in n and not n.endswith((".rate", "_TABLE"))]   # (and the dict as itself)


def test_loose_numbers_are_the_ones_a_gradient_may_not_keep() -> None:
    x = torch.randn(4)
    assert loose_numbers(aten.add.Tensor, (x, 0.5), {}) == [0.5]
    assert loose_numbers(aten.rsub.Scalar, (x, 1), {}) == [1]
    assert loose_numbers(aten.masked_fill.Scalar, (x, x > 0, -1e4), {}) == [-1e4]
    assert loose_numbers(aten.native_layer_norm.default, (x, [4], None, None, 1e-5), {}) == [1e-5]
    assert loose_numbers(aten._log_softmax.default, (x, -1, False), {}) == []     # a dimension, a flag
    assert loose_numbers(aten.view.default, (x, [2, 2]), {}) == []                # sizes
    assert loose_numbers(aten.add.Tensor, (x, x), {"alpha": 2}) == [2]


def test_held_reads_the_modules_numbers_and_those_of_the_plain_objects_they_hold() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tau, self._private, self.name = 0.5, 3, "x"
            self.config = types.SimpleNamespace(dropout=0.1, flag=True, _hidden=2, label="y")
            self.hparams = {"margin": 1.0, "tags": ["a"], 3: 4.0}
            self.fn = lambda t: t   # a function: no data
            self.inner = nn.Dropout(0.2)

    m = M()
    names = {entry[2]: entry[3] for entry in held(m).values()}
    assert names["tau"] == 0.5 and names["config.dropout"] == 0.1 and names["inner.training"] is True
    assert names["hparams.margin"] == 1.0 and names["inner.p"] == 0.2
    assert not {"_private", "config._hidden", "config.label", "config.flag", "name", "hparams.tags"} & set(names)
    numbers = held(m)
    assert first_change(numbers) is None
    m.config.dropout = 0.3
    assert first_change(numbers) == "config.dropout is 0.3, the templates' step ran with 0.1"
    m.config.dropout, m.hparams["margin"] = 0.1, 2.0
    assert first_change(numbers) == "hparams.margin is 2.0, the templates' step ran with 1.0"


_SCALE, _LABEL, _UNREAD = 2.0, "x", 3.0


def test_held_reads_the_globals_and_closed_over_numbers_the_modules_classes_name() -> None:
    """Of the globals: those the classes' own functions name (a lambda's in them too), not a
    global no function of theirs reads, nor PyTorch's classes' globals; a closure's number."""
    def make(offset: float) -> nn.Module:
        class Closed(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return (lambda t: t * _SCALE)(x) + offset

        return Closed()

    model = nn.Sequential(make(0.25), nn.Linear(2, 2))
    names = {entry[2]: entry[3] for entry in held(model).values()}
    assert names["global test_model_numbers._SCALE"] == 2.0
    assert names["test_held_reads_the_globals_and_closed_over_numbers_the_modules_classes_name.<locals>.make."
                 "<locals>.Closed.forward's offset"] == 0.25
    assert not [n for n in names if "_UNREAD" in n or "_LABEL" in n or n.startswith("global torch")]


_DEEP = 0.25


def _deep() -> float:
    return _DEEP


def _middle() -> float:
    return _deep()


def _outer() -> float:
    return _middle()


def test_a_helper_met_deeper_first_is_walked_again_where_it_is_met_less_deep() -> None:
    """``forward`` (walked first) reaches ``_middle`` two calls deep, where its helpers are out
    of reach; ``other`` reaches it one call deep, from where ``_deep``'s global is in reach. The
    first version walked each function once, at the depth met first: which globals were watched
    hung on the order of the walk."""
    class Deep(nn.Module):
        def other(self) -> float:
            return _middle()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * _outer()

    assert "global test_model_numbers._DEEP" in {entry[2] for entry in held(Deep()).values()}


def test_same_tells_a_flag_from_a_number_and_a_nan_is_itself() -> None:
    assert same(0.5, 0.5) and same(math.nan, math.nan) and not same(True, 1) and not same(1, 1.0)
    assert changed_since({"a": (None, 1), "b": (None, 2.0)}, {"a": (None, 1), "b": (None, 3.0)}) == ["b"]


def test_same_tells_two_functions_that_do_the_same_from_two_that_do_not() -> None:
    """One code closed over the same numbers is the same function (a loop that makes it anew
    at every step); another number, another function; a tensor counts as itself."""
    def adding(s: object) -> Callable:
        return lambda h: h + s

    assert same(adding(0.5), adding(0.5)) and not same(adding(0.5), adding(0.75))
    assert not same(adding(0.5), lambda h: h + 0.5)   # (another code)
    assert same(functools.partial(max, 1.0, key=abs), functools.partial(max, 1.0, key=abs))
    assert not same(functools.partial(max, 1.0), functools.partial(max, 2.0))
    assert not same(adding(torch.ones(2)), adding(torch.ones(2)))


def test_same_compares_two_plain_objects_by_their_numbers_and_first_change_names_the_one() -> None:
    """A config, dict or list made anew is the same as the one before if its numbers are (a
    tensor in it is not compared: its ``==`` is no answer); the change is named by its key."""
    assert same(types.SimpleNamespace(a=1.0, s="x"), types.SimpleNamespace(a=1.0, s="y"))
    assert not same({"a": 1.0}, {"a": 2.0}) and not same({"a": 1.0}, {"a": 1.0, "b": 2}) and not same([1], [2])
    assert same({"t": torch.ones(2), "a": 1}, {"t": torch.zeros(2), "a": 1})
    m = nn.Linear(2, 2)
    m.config = types.SimpleNamespace(scale=1.0, name="x")
    numbers = held(m)
    m.config = types.SimpleNamespace(scale=1.0, name="y")
    assert first_change(numbers) is None
    m.config = types.SimpleNamespace(scale=2.0, name="y")
    assert first_change(numbers) == "config.scale is 2.0, the templates' step ran with 1.0"


def test_forwards_note_each_call_and_compare_call_by_call_then_take_their_hooks_off() -> None:
    class Step(nn.Module):
        def forward(self, x: torch.Tensor, scale: float, clip: bool = False) -> torch.Tensor:
            return x * scale

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = Step()

        def forward(self, x: torch.Tensor, a: float, b: float) -> torch.Tensor:
            return self.step(self.step(x, a), scale=b, clip=True)

    model, x = Twice(), torch.ones(2)
    noted = Forwards.noting(model)
    depths = []
    seen = model.step.register_forward_pre_hook(lambda *_: depths.append(noted.depth))   # (runs after ours)
    model(x, 2.0, 3.0)
    assert noted.depth == 0 and depths == [2, 2]
    noted.close()
    seen.remove()
    assert {(name, n, key): v for (_, n, key), (_, name, v) in noted.passed.items()} == {
        ("", 0, 1): 2.0, ("", 0, 2): 3.0, ("step", 0, 1): 2.0, ("step", 1, "scale"): 3.0}   # a flag steers
    assert not model._forward_pre_hooks and not model.step._forward_pre_hooks and not model._forward_hooks
    watch = Forwards.comparing(noted.passed)
    model(x, 2.0, 3.0)
    assert watch.changed is None
    watch.close()
    watch = Forwards.comparing(noted.passed)
    model(x, 2.0, 4.0)   # the root's second argument, and the step's second call's
    assert watch.changed == "the forward of the model (call 0) took 4.0 as its argument 2, the templates' step 3.0"
    watch.close()
    assert not model._forward_pre_hooks and Forwards.comparing({}) is None


class _Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * 2.0


class _Scripted(nn.Module):
    """A model with a TorchScript submodule, which takes no forward hook."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.act = nn.Linear(64, 512), torch.jit.script(_Doubled())
        self.hidden = nn.ModuleList(nn.Linear(512, 512) for _ in range(3))
        self.last = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.first(x))
        for layer in self.hidden:
            x = self.act(layer(x))
        return self.last(x)


def test_a_torchscript_submodule_is_left_unhooked(monkeypatch) -> None:
    """``register_forward_pre_hook`` raises on a ``ScriptModule``: the capturing step hooks
    every other module (the scripted one's ops run inside its parent's forward), and trains
    bitwise in the template form (at 12 MiB, a third of its peak). The first version of the
    forward hooks raised there."""
    templates_forced(monkeypatch.setattr)
    ref, model = _twins(_Scripted)

    def steps(m: nn.Module) -> Iterator[Callable[[], torch.Tensor]]:
        for i in range(8):
            x, y = _batch(i, 1024, 64)
            yield lambda x=x, y=y: nn.functional.cross_entropy(m(x), y)
    # (TorchScript's optimizing executor is not bitwise from run to run, in core either: it
    # specializes the graph after its profiling runs, and its own backward rounds otherwise)
    with torch.jit.optimized_execution(False):
        ref_losses, _ = _run(ref, torch.optim.Adam(ref.parameters(), lr=1e-3), None, steps(ref))
        losses, forms = _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), 12 << 20, steps(model))
    assert any(f[0] == "anchored" and f[2] > 0 for f in forms), forms
    _assert_alike(ref_losses, losses, ref, model)


def test_a_step_that_raises_in_its_forward_leaves_no_hook_on_the_model(monkeypatch) -> None:
    """The capturing steps hook every module; one that raises in the forward (a bad batch the
    loop skips) takes them off as it ends, as one that completes does."""
    from ooc import OutOfCore

    templates_forced(monkeypatch.setattr)
    torch.manual_seed(0)
    model = _Shifted("model")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = OutOfCore(model, opt, budget=6 << 20)
    x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
    during = []
    for step in range(6):
        raising = model.blocks[2].register_forward_pre_hook(lambda *_: 1 / 0) if step == 3 else None
        try:
            with engine.step():
                during.append(_forwards_hooks(model))
                nn.functional.cross_entropy(model(x, 0.1), y).backward()
                opt.step()
                opt.zero_grad()
        except ZeroDivisionError:
            assert step == 3
        if raising is not None:
            raising.remove()
        assert _forwards_hooks(model) == 0, step
    engine.close()
    assert during[3] == 2 * len(list(model.modules())), f"step 3 was not a capturing step: {during}"


def _forwards_hooks(model: nn.Module) -> int:
    """How many of the model's forward hooks are ``Forwards``' (the engine has its own)."""
    def ours(h: object) -> bool:   # a bound method of one, or a partial of one
        return isinstance(getattr(getattr(h, "func", h), "__self__", None), Forwards)
    return sum(ours(h) for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))


class _Offset(nn.Module):
    """A positional table (a buffer) read from an offset the loop draws at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(256, 128) * 0.1)
        self.first = nn.Linear(128, 128)
        self.hidden = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))
        self.last = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        start = int(start)   # (a tensor's number: ``_local_scalar_dense``)
        h = torch.sigmoid(self.first(x) + self.pe[start:start + x.shape[1]])
        for layer in self.hidden:
            h = torch.sigmoid(layer(h))
        return self.last(h.mean(1))


@pytest.mark.parametrize("starts", ["drawn-every-step", "changed-at-an-epoch", "read-out-of-a-tensor"])
def test_a_view_of_a_table_at_an_offset_the_forward_takes_is_not_replayed_stale(starts: str, monkeypatch) -> None:
    """``pe[start:start + T]``: the ``add`` that reads it has the same numbers in every step,
    and its template replayed the captured step's rows of the table (no hook sees the slice:
    no node records a buffer's). Drawn every step: how a template reads each tensor (its
    view, the offset with it) is compared between the steps the form is made from as its
    numbers are (``Templates.ready``), and the function is swapped instead. Changed at an
    epoch (row 0 in the capturing steps): the forward's argument differs, and a chain that
    reads a part of a tensor (``template_slots.part_of``) is not rerun. Passed in a tensor
    and read out of it (``int(start)``), changed at each epoch: no hook sees that number, and
    no function after the read that replays a number gets a template
    (``TemplateCapture.read_out``). Bitwise (on the code before, a later loss differed in each:
    step 14's in the third)."""
    templates_forced(monkeypatch.setattr)
    ref, model = _twins(_Offset)

    def steps(m: nn.Module) -> Iterator[Callable[[], torch.Tensor]]:
        for i in range(16):
            x, y = _batch(i, 64, 64, 128)
            start = i * 17 % 192 if starts == "drawn-every-step" else 32 * (i // 10)
            if starts == "read-out-of-a-tensor":
                start = torch.tensor(start)
            yield lambda x=x, y=y, start=start: nn.functional.cross_entropy(m(x, start), y)
    ref_losses, _ = _run(ref, torch.optim.Adam(ref.parameters(), lr=1e-3), None, steps(ref))
    losses, forms = _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), 4 << 20, steps(model),
                         manage=("activations",))
    assert sum(f[0] == "anchored" for f in forms) >= 8, forms
    _assert_alike(ref_losses, losses, ref, model)


class _Tasks(nn.Module):
    """A body and two heads of one shape; the forward takes the task's index (an int)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                                  nn.Linear(512, 512), nn.Tanh())
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10))
                                   for _ in range(2))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.body(x))


def test_a_tasks_index_that_picks_a_head_does_not_leave_a_plan_that_recomputes_the_body(
        monkeypatch, caplog) -> None:
    """The index reaches no op, and the chains (the body's) replay no number
    (``Templates.numbered``): the step of the other task keeps its anchored plan (its head is
    kept, not recomputed; the same sizes are saved), where the first comparison of the
    forwards' numbers left it at its first discard. Bitwise."""
    templates_forced(monkeypatch.setattr)
    ref, model = _twins(_Tasks)
    tasks = [0] * 9 + [1, 0]

    def steps(m: nn.Module) -> Iterator[Callable[[], torch.Tensor]]:
        for i, task in enumerate(tasks):
            x, y = _batch(i, 1024, 64)
            yield lambda x=x, y=y, task=task: nn.functional.cross_entropy(m(x, task), y)
    ref_losses, _ = _run(ref, torch.optim.Adam(ref.parameters(), lr=1e-3), None, steps(ref))
    with caplog.at_level("INFO", logger="ooc"):
        losses, forms = _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), 6 << 20, steps(model))
    assert forms[8][0] == "anchored" and forms[8][1] == -1 and forms[8][2] > forms[7][2], forms
    assert all(f[:2] == ("anchored", -1) for f in forms[8:]), forms
    assert all(b > a for (*_, a), (*_, b) in zip(forms[8:], forms[9:])), forms   # each recomputes
    assert "as its argument" not in caplog.text
    _assert_alike(ref_losses, losses, ref, model)


def test_a_capture_that_does_not_watch_the_forwards_gives_no_template_that_replays_a_number() -> None:
    """A per-op step of a plan whose hook-driven form is made hooks no module (a hook per
    module at every such step cost 3-5% of it): its templates, should a plan be formed from
    them, hold no function that replays a number, and every op counts as the loop's."""
    x = torch.randn(8, requires_grad=True) * 2
    recipes = {3: Recipe(aten.add.Tensor, (x, 0.5), {}, [(x, x._version)], None, None, True, 1),
               4: Recipe(aten.sigmoid.default, (x,), {}, [(x, x._version)], None, None, True, 1)}
    for watch, want in ((True, {3, 4}), (False, {4})):
        model = nn.Linear(4, 4)
        cap = TemplateCapture(model, watch=watch)
        assert bool(_forwards_hooks(model)) is watch and cap.outside()
        cap.saved(x, x.untyped_storage(), None, gap=1)
        for i, r in recipes.items():
            cap.captured(i, r)
        assert set(cap.build(recipes, {}).calls) == want and _forwards_hooks(model) == 0


def test_the_per_op_steps_of_a_plan_whose_form_is_made_hook_no_module(monkeypatch) -> None:
    """The anchored form judged slower (per-op steps kept): the steps after the verdict note no
    forward's numbers (their capture makes no form), and take no hook. Bitwise."""
    from ooc.engine.hook_forms import HookPlan
    from ooc.testing.forced_forms import decided

    templates_forced(monkeypatch.setattr)
    monkeypatch.setattr(HookPlan, "judge", decided(False))
    ref, model = _twins(lambda: _Shifted("model"))
    shifts = [0.0] * 12
    ref_losses, _ = _shifted_steps(ref, None, shifts)
    during = []
    real = Forwards.noting
    monkeypatch.setattr(Forwards, "noting", staticmethod(lambda m: during.append(len(during)) or real(m)))
    losses, forms = _shifted_steps(model, 6 << 20, shifts)
    assert [f[0] for f in forms[-4:]] == ["planned"] * 4, forms
    assert len(during) <= 6, (during, forms)   # the steps before the verdict only
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
