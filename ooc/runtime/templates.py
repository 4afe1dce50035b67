"""Chains rerun from templates: how a step driven by autograd's hooks alone recomputes.

A planned per-op step captures each chain function's call (``recipes.Recipe``), with the
tensors it read; a hook-driven step sees no op, only what autograd saves. So the per-op step
that a plan's anchored form is made from also turns each recipe into a *template*, whose
tensor arguments are slots a later step fills from what its hooks see
(docs/guide/gpu.md, "The template form"):

- ``VarArg``: a managed activation, by its plan variable (the anchored step's slot);
- ``PackArg``: any other tensor autograd saved (of every size: a norm's ``rsqrt``, the
  rotary tables, the batch), as the k-th tensor the step saves, viewed as the op read it.
  The capturing step proves that the bytes saved are the bytes read (same storage, same
  version counter);
- ``Persistent``: a parameter or buffer, or a view of one, as itself (the same object every
  step; the optimizer writes it after the backward, so a write before a replay is a change
  the hook-driven step refuses to discard under);
- ``Made``: a result of the chain, as in ``recompute.py``.

A recipe with anything else (a tensor no hook sees, a random op: the generator's state before
it is not visible at a hook) gives no template, and the plan made for the hook-driven form
does not replay that function (``scheduler.step_plans.hook_form``). What guards a template
against a step that differs from the one captured: every tensor it reads is saved at its
index with its bytes, unwritten since, and each discarded activation's and each saved input's
autograd node has the captured node's type (the hook trace guards the rest, as for swaps).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ooc.runtime.recipes import Made, Recipe, Ref, as_view, rerun
from ooc.runtime.made_by import node_of, said, signature
from ooc.runtime.slots import Slot


@dataclass(frozen=True, slots=True)
class View:
    """How an argument looked at a storage."""

    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> View:
        return View(t.dtype, t.size(), t.stride(), t.storage_offset())

    def on(self, s: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=s.device).set_(s, self.offset, self.size, self.stride)

    def of_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """This view of ``t``'s storage (``t`` itself where it is the view)."""
        return as_view(t, self.dtype, self.size, self.stride, self.offset)


@dataclass(frozen=True, slots=True)
class VarArg:
    """A managed activation: plan variable ``var``, read as ``view``."""

    var: int
    view: View


@dataclass(frozen=True, slots=True)
class PackArg:
    """The ``k``-th tensor the step saves (``nbytes`` its storage's), its node's type ``node``,
    at ``gap`` (the ops begun before the save)."""

    k: int
    nbytes: int
    node: str
    gap: int
    view: View


@dataclass(frozen=True, slots=True)
class Persistent:
    """A parameter or buffer (``tensor``), read as ``view``; ``checked``: a write to it since
    the step began refuses a discard (BatchNorm's running statistics are not checked: the
    replay reads copies, and its output does not depend on them)."""

    tensor: torch.Tensor
    view: View
    checked: bool


@dataclass(frozen=True, slots=True)
class Template:
    """A ``Recipe`` with its tensors as slots (the attributes ``recompute.rerun`` reads);
    ``saves`` and ``variables``, its ``PackArg`` and ``VarArg`` slots, ``checked``, the
    parameters and buffers a write to refuses it, and ``spots``, (position, slot) of each slot
    when all are positional arguments (else None): ``make`` finds them once, as walking the
    arguments at each replay cost more than the replay."""

    func: Any
    args: tuple
    kwargs: dict
    stats: tuple[int, int] | None
    grad: bool
    outputs: int
    saves: tuple[PackArg, ...] = ()
    variables: tuple[VarArg, ...] = ()
    checked: tuple[torch.Tensor, ...] = ()
    spots: tuple[tuple[int, Any], ...] | None = None
    rng: None = None

    @staticmethod
    def make(func: Any, args: tuple, kwargs: dict, stats: tuple[int, int] | None = None, grad: bool = True,
             outputs: int = 1) -> Template:
        leaves = tree_leaves((args, kwargs))
        slots = [x for x in leaves if isinstance(x, _SLOTS)]
        spots = tuple((i, x) for i, x in enumerate(args) if isinstance(x, _SLOTS))
        return Template(func, args, kwargs, stats, grad, outputs,
                        tuple(x for x in slots if isinstance(x, PackArg)),
                        tuple(x for x in slots if isinstance(x, VarArg)),
                        tuple(x.tensor for x in slots if isinstance(x, Persistent) and x.checked),
                        spots if len(spots) == len(slots) else None)


_SLOTS = (VarArg, PackArg, Persistent, Made)


def _numbers(t: Template) -> list:
    """A template's arguments that are no tensor (what it replays as captured)."""
    return [x for x in tree_leaves((t.args, t.kwargs)) if not isinstance(x, _SLOTS)]


@dataclass(frozen=True)
class Templates:
    """What a plan's anchored form replays: ``calls`` (function -> template), ``born_at`` (var
    -> (function, output) that makes it), ``wanted`` (pack index -> ``PackArg``), ``nodes`` (var
    -> its ``signature`` where the step first saved it, ``depth`` nodes deep), ``persistent``
    (those checked)."""

    calls: Mapping[int, Template]
    born_at: Mapping[int, tuple[int, int]]
    wanted: Mapping[int, PackArg]
    nodes: Mapping[int, tuple]
    persistent: tuple[torch.Tensor, ...]
    depth: int = 1

    @property
    def functions(self) -> frozenset[int]:
        return frozenset(self.calls)

    @cached_property
    def born_in(self) -> dict[int, tuple[tuple[int, tuple[int, int]], ...]]:
        """Function -> the variables it makes, each with its ``born_at``: what a chain makes
        itself, found per function of the chain (a replay looked through every variable the
        step saves: ~50 us of a Llama's replay on this CPU)."""
        out: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        for var, at in self.born_at.items():
            out.setdefault(at[0], []).append((var, at))
        return {i: tuple(made) for i, made in out.items()}

    def ready(self, before: Templates | None = None) -> dict[int, int]:
        """Function -> the gap from which everything its template reads was saved: a discard
        its chain reruns for waits until then (``scheduler.anchors.anchor``). With ``before``
        (the templates of an earlier step that started in the same state, with the same shapes),
        only the functions that ran the same op with the same numbers and flags then: a template replays them as captured, and no hook sees
        them (``x / tau`` reaches the op as a Python number, and autograd saves it unhooked), so
        a number that changed between steps (a temperature schedule) rules the function out."""
        same = None if before is None else {
            i for i, c in self.calls.items()
            if i in before.calls and before.calls[i].func == c.func and _numbers(before.calls[i]) == _numbers(c)}
        return {i: max((a.gap for a in c.saves), default=0) for i, c in self.calls.items()
                if same is None or i in same}


class TemplateCapture:
    """The capturing per-op step's side: every tensor autograd saves (``saved``, from the pack
    hook) and every captured recipe (``captured``), matched by storage; ``build`` at the end.
    A saved tensor is held weakly (autograd holds it through the forward); a recipe's tensor
    is held by the recipe, so its storage, and the storage's address, stay its own."""

    def __init__(self, model: torch.nn.Module, depth: int = 1) -> None:
        self.depth = depth   # how far back a managed activation's signature looks: the longest chain
        self.persistent: dict[int, torch.Tensor] = {}
        for t in (*model.parameters(), *model.buffers()):
            if t.layout is torch.strided and not t.is_meta:
                self.persistent.setdefault(t.untyped_storage()._cdata, t)
        self.n = 0
        self.packed: dict[int, list[tuple[int, weakref.ref, int, int]]] = {}   # cdata -> (k, tensor, version, gap)
        self.pending: dict[int, list[tuple[int, torch.Tensor, int]]] = {}  # cdata -> (function, tensor, version)
        self.found: dict[int, dict[int, PackArg | Persistent]] = {}       # function -> id(tensor) -> slot
        self.nodes: dict[int, tuple] = {}
        self.random: set[int] = set()

    def saved(self, t: torch.Tensor, s: torch.UntypedStorage, var: int | None, gap: int) -> None:
        """The pack hook saw ``t`` (storage ``s``; ``var``: its plan variable, if managed) at
        ``gap``."""
        k = self.n
        self.n = k + 1
        if var is not None:
            if var not in self.nodes:
                self.nodes[var] = signature(t, self.depth)
            return
        c, version = s._cdata, t._version
        waiting = self.pending.get(c)
        if waiting:
            for w, x, v in waiting:
                if v == version and x.untyped_storage()._cdata == c:
                    self.found[w].setdefault(id(x), PackArg(k, s.nbytes(), node_of(t), gap, View.of(x)))
            waiting[:] = [p for p in waiting if id(p[1]) not in self.found[p[0]]]
        self.packed.setdefault(c, []).append((k, weakref.ref(t), version, gap))

    def captured(self, i: int, recipe: Recipe) -> None:
        """Function ``i``'s recipe: each tensor it holds bound to a parameter or buffer, to a
        tensor saved already, or left waiting for a save to come."""
        found = self.found.setdefault(i, {})
        if recipe.rng is not None:
            self.random.add(i)
            return
        stats = {id(recipe.args[p]) for p in recipe.stats or () if p < len(recipe.args)}
        for x, version in recipe.held:
            if x.layout is not torch.strided:
                continue   # sparse: never bound, the function gets no template
            s = x.untyped_storage()
            c = s._cdata
            base = self.persistent.get(c)
            if base is not None:
                found[id(x)] = Persistent(base, View.of(x), checked=id(x) not in stats)
                continue
            for k, ref, v, gap in self.packed.get(c, ()):
                t = ref()
                if t is not None and v == version and t.untyped_storage()._cdata == c:
                    found[id(x)] = PackArg(k, s.nbytes(), node_of(t), gap, View.of(x))
                    break
            else:
                self.pending.setdefault(c, []).append((i, x, version))

    def build(self, recipes: Mapping[int, Recipe], born_at: Mapping[int, tuple[int, int]]) -> Templates:
        """The templates of every recipe all of whose tensors were bound."""
        calls: dict[int, Template] = {}
        for i, r in recipes.items():
            found = self.found.get(i, {})
            if i in self.random or any(id(x) not in found for x, _ in r.held):
                continue

            def slot(x: Any) -> Any:
                if isinstance(x, Ref):
                    return VarArg(x.slot.var, View(x.dtype, x.size, x.stride, x.offset))
                if isinstance(x, torch.Tensor):
                    return found[id(x)]
                return x   # a Made, or no tensor

            calls[i] = Template.make(r.func, tree_map(slot, r.args), tree_map(slot, r.kwargs), r.stats, r.grad,
                                     r.outputs)
        wanted = {a.k: a for c in calls.values() for a in c.saves}
        persistent = {id(t): t for c in calls.values() for t in c.checked}
        self.packed.clear()
        self.pending.clear()
        return Templates(calls, dict(born_at), wanted, dict(self.nodes), tuple(persistent.values()), self.depth)


@dataclass
class BoundTemplates:
    """One hook-driven step's templates: what its saves gave them (``packs``: index ->
    (tensor, version at the save)), and the persistent tensors' versions when it began.
    ``readers``: pack index -> the plan's recomputes still to run that read it (``chains``,
    one per recompute action); a saved tensor is let go after the last (autocast's low-precision
    copies of the weights, which a matmul saves, would otherwise live to the step's end)."""

    templates: Templates
    chains: Iterable[tuple[int, ...]] = ()
    n: int = 0
    packs: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)   # id(parameter) -> its version at the start
    readers: dict[int, int] = field(default_factory=dict)
    recomputed: int = 0
    recompute_s: float = 0.0

    def __post_init__(self) -> None:
        self.versions = {id(t): t._version for t in self.templates.persistent}
        for chain in self.chains:
            for k in self._reads(chain):
                self.readers[k] = self.readers.get(k, 0) + 1

    def _reads(self, chain: tuple[int, ...]) -> set[int]:
        calls = self.templates.calls
        return {a.k for w in chain if w in calls for a in calls[w].saves}

    def saved(self, t: torch.Tensor, s: torch.UntypedStorage) -> str | None:
        """The step's next save (every size counts); why it is not what the templates read."""
        k = self.n
        self.n = k + 1
        want = self.templates.wanted.get(k)
        if want is None:
            return None
        if s.nbytes() != want.nbytes or node_of(t) != want.node:
            return (f"saved tensor {k} (of any size) is {s.nbytes()} B from {node_of(t)}, the templates' "
                    f"was {want.nbytes} B from {want.node}")
        self.packs[k] = (t, t._version)
        return None

    def node_differs(self, var: int, t: torch.Tensor) -> str | None:
        """Why the first save of managed ``var`` is not the one captured: another op made it,
        or one with another number (``signature``)."""
        want = self.templates.nodes.get(var)
        if want is None:
            return None
        got = signature(t, self.templates.depth)
        if got == want:
            return None
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return (f"variable {var} was made by {said(got, at)} ({at} nodes back), the templates' by "
                f"{said(want, at)}")

    def why_not(self, chain: tuple[int, ...]) -> str | None:
        """Why ``chain`` cannot rerun later from what this step saw (None: it can)."""
        calls = self.templates.calls
        for w in chain:
            c = calls.get(w)
            if c is None:
                return f"function {w} has no template"
            for a in c.saves:
                got = self.packs.get(a.k)
                if got is None:
                    return f"saved tensor {a.k}, which its chain reads, was not saved"
                if got[0]._version != got[1]:
                    return f"saved tensor {a.k}, which its chain reads, was written since"
            for t in c.checked:
                if t._version != self.versions[id(t)]:
                    return f"a parameter or buffer {tuple(t.shape)} its chain reads was written in the step"
        return None

    def unsaved(self, chain: tuple[int, ...]) -> bool:
        """Whether a tensor ``chain`` reads is still to be saved (a discard waits for it)."""
        calls = self.templates.calls
        return any(a.k not in self.packs for w in chain if w in calls for a in calls[w].saves)

    def inputs(self, chain: tuple[int, ...], var: int) -> list[int]:
        """The managed variables ``chain`` reads that it does not make itself."""
        born_in = self.templates.born_in
        made = {v for w in set(chain) for v, _ in born_in.get(w, ())}
        return sorted({a.var for w in chain for a in self.templates.calls[w].variables
                       if a.var != var and a.var not in made})

    def replay(self, slot: Slot, chain: tuple[int, ...], slots: Mapping[int, Slot], rng_device: torch.device,
               born: Callable[[torch.UntypedStorage], None]) -> None:
        """Rerun ``chain`` to re-create ``slot`` (its inputs resident: the caller made them)."""
        t0 = time.perf_counter()
        born_at, born_in = self.templates.born_at, self.templates.born_in
        inside = {var: at for w in set(chain) for var, at in born_in.get(w, ()) if var != slot.var}

        def materialize(x: Any, made: dict) -> Any:
            if isinstance(x, VarArg):
                at = inside.get(x.var)
                return x.view.on(slots[x.var].storage) if at is None else x.view.of_tensor(made[at])
            if isinstance(x, PackArg):
                return x.view.of_tensor(self.packs[x.k][0])
            if isinstance(x, Persistent):
                return x.view.of_tensor(x.tensor)
            return x.tensor(made) if isinstance(x, Made) else x

        producer, out_index = born_at[slot.var]
        rerun([(w, self.templates.calls[w]) for w in chain], materialize, slot=slot, producer=producer,
              out_index=out_index, born=born, rng_device=rng_device, name_of=lambda w: f"function {w}")
        for k in self._reads(chain):   # let go of what no recompute of the plan reads any more
            left = self.readers.get(k, 0) - 1
            self.readers[k] = left
            if left == 0:
                del self.packs[k]
        self.recomputed += slot.nbytes
        self.recompute_s += time.perf_counter() - t0

    def close(self) -> None:
        self.packs.clear()
