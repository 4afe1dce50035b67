"""``ooc.runtime.watched`` on its own: which uses of a watched tensor reach its owner, with which
keys, what they see, and what autograd pins (the engine's use: test_reads_between_steps.py)."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn

from ooc.runtime import watched


class Owner:
    """Records ``enter``/``leave``; the bytes are always there."""

    def __init__(self) -> None:
        self.entered: list[list] = []
        self.pinned: set = set()

    def enter(self, keys, /) -> None:
        self.entered.append(sorted(keys))

    def leave(self, keys, pinned, /) -> None:
        self.pinned |= pinned


def _watched_linear() -> tuple[nn.Linear, Owner]:
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    lin.weight.grad = torch.ones(3, 4)
    owner = Owner()
    watched.watch(lin.weight, owner, "w")
    watched.watch(lin.weight.grad, owner, "g")
    return lin, owner


def test_metadata_reads_do_not_reach_the_owner() -> None:
    lin, owner = _watched_linear()
    w = lin.weight
    assert isinstance(w, nn.Parameter) and type(w).__name__ == "WatchedParameter"
    _ = (w.shape, w.dtype, w.device, w.numel(), w.size(0), w.dim(), w.requires_grad, w.is_leaf,
         w.grad, w.stride(), len(w), hash(w), {w: 1}[w], w._version, w.element_size())
    w.requires_grad_(True)
    assert owner.entered == []
    assert watched.is_watched(w), "still watched after metadata reads"


def test_a_read_enters_once_with_every_watched_argument_and_sees_plain_classes() -> None:
    lin, owner = _watched_linear()
    seen = []
    with torch.no_grad():
        out = torch.nn.functional.linear(torch.ones(2, 4), lin.weight)
        lin.weight.add_(lin.weight.grad)   # both, one op
        seen.append(type(lin.weight.data))
    assert owner.entered == [["w"], ["g", "w"], ["w"]]
    assert type(out) is torch.Tensor and seen == [torch.Tensor]
    assert type(lin.weight).__name__ == "WatchedParameter", "watched again after the op"
    assert owner.pinned == set(), "nothing pinned under no_grad"


def test_foreach_ops_run_entry_by_entry_with_the_same_result() -> None:
    torch.manual_seed(0)
    xs = [torch.randn(5) for _ in range(3)]
    plain = torch._foreach_norm([x.clone() for x in xs])
    owner = Owner()
    for i, x in enumerate(xs):
        watched.watch(x, owner, i)
    got = torch._foreach_norm(xs)
    torch._foreach_mul_(xs, torch.tensor(2.0))
    assert owner.entered == [[0], [1], [2], [0], [1], [2]]
    assert type(got) is type(plain) and all(torch.equal(a, b) for a, b in zip(plain, got))
    from torch.utils._foreach_utils import _has_foreach_support
    assert _has_foreach_support(xs, torch.device("cpu")), "a watched tensor takes in core's path"


def test_autograd_pins_what_it_saves_and_the_gradient_it_adds_into() -> None:
    lin, owner = _watched_linear()
    (lin.weight.sum() * 2).backward()   # sum saves nothing
    assert owner.pinned == {"g"}, "a backward adds into the gradient"
    owner.pinned.clear()
    (lin.weight * lin.weight).sum().backward()
    assert owner.pinned == {"w", "g"}, "mul saved the weight"
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
        owner.pinned.clear()
        lin.weight.sum()
        assert owner.pinned == {"w", "g"}, "under the user's hooks, everything"


def test_copies_and_pickles_are_plain_and_unwatch_restores_the_class() -> None:
    lin, _ = _watched_linear()
    for c in (copy.deepcopy(lin.weight), copy.copy(lin.weight.grad)):
        assert type(c) in (nn.Parameter, torch.Tensor) and not watched.is_watched(c)
    buf = io.BytesIO()
    torch.save([lin.weight, lin.weight.grad], buf)
    buf.seek(0)
    w, g = torch.load(buf)
    assert type(w) is nn.Parameter and torch.equal(w, lin.weight) and torch.equal(g, lin.weight.grad)
    watched.unwatch(lin.weight)
    assert type(lin.weight) is nn.Parameter and not watched.is_watched(lin.weight)
    assert watched.watchable(lin.weight) and not watched.watchable(torch.nn.parameter.UninitializedParameter())


def test_a_tensor_that_dies_watched_is_forgotten() -> None:
    owner = Owner()
    before = len(watched._WATCHED)
    for _ in range(3):
        watched.watch(torch.ones(3), owner, "x")
    assert len(watched._WATCHED) == before
