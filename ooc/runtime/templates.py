"""Chains rerun from templates: how a step driven by autograd's hooks alone recomputes.

A planned per-op step captures each chain function's call (``recipes.Recipe``), with the
tensors it read; a hook-driven step sees no op, only what autograd saves. So the per-op step
that a plan's anchored form is made from also turns each recipe into a *template*, whose
tensor arguments are slots (``template_slots.py``) a later step fills from what its hooks see
(docs/guide/steps.md, "The template form"):

- ``VarArg``: a managed activation, by its plan variable (the anchored step's slot);
- ``PackArg``: any other tensor autograd saved (of every size: a norm's ``rsqrt``, the
  rotary tables, the batch), as the k-th tensor the step saves, viewed as the op read it
  from where the save starts (a batch sliced from a dataset tensor starts elsewhere in it
  at every step), or as it is where the op read it whole (the capturing step proves that
  the bytes saved are the bytes read: same storage, same version counter);
- ``Persistent``: a parameter or buffer, or a view of one, as itself (the same object every
  step; the optimizer writes it after the backward, so a write before a replay is a change
  the hook-driven step refuses to discard under);
- ``Made``: a result of the chain, as in ``recompute.py``.

A random op (dropout) draws from the generator's state before it, which no hook sees; but the
state at the last save before it is the same where no random number is drawn in between.
The capturing step proves that (the state at that save equals the recipe's), and the template
keeps which save (``Template.rng_at``): a hook-driven step takes the generator's state at that
save's hook and replays the op from it. A recipe with anything else (a tensor no hook sees, a
random op after another one with no save between) gives no template, and the plan made for
the hook-driven form does not replay that function (``scheduler.step_plans.hook_form``). What
guards a template against a step that differs from the one captured: every tensor it reads is
saved at its index with its bytes, unwritten since, each discarded activation's and saved
input's autograd node has the captured node's type (the hook trace guards the rest, as for
swaps), and the model's numbers are the captured ones (``model_numbers.py``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ooc.runtime.made_by import node_of, signature, varied
from ooc.runtime.forward_numbers import Forwards, Passed, loose_numbers, replays_a_number
from ooc.runtime.model_numbers import Held, changed_since, held, reread
from ooc.runtime.recipes import Lifetimes, Made, Recipe, Ref, _rng_state
from ooc.runtime.template_slots import PackArg, Persistent, VarArg, part_of, whole_of
from ooc.runtime.views import View

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Template:
    """A ``Recipe`` with its tensors as slots (the attributes ``recompute.rerun`` reads);
    ``saves`` and ``variables``, its ``PackArg`` and ``VarArg`` slots, ``checked``, the
    parameters and buffers a write to refuses it (each with its ``Persistent.writes``), and
    ``spots``, (position, slot) of each slot when all are positional arguments (else None):
    ``make`` finds them once, as walking the arguments at each replay cost more than the
    replay. ``rng_at``: a random op's save at whose hook the generator's state is the one the
    op drew from (its index, size, node type and gap, as a ``PackArg``'s); ``rng``, that state,
    set for one replay (``BoundTemplates``)."""

    func: Any
    args: tuple
    kwargs: dict
    stats: tuple[int, int] | None
    grad: bool
    outputs: int
    saves: tuple[PackArg, ...] = ()
    variables: tuple[VarArg, ...] = ()
    checked: tuple[tuple[torch.Tensor, int], ...] = ()
    spots: tuple[tuple[int, Any], ...] | None = None
    rng_at: PackArg | None = None
    rng: torch.Tensor | None = None

    @staticmethod
    def make(func: Any, args: tuple, kwargs: dict, stats: tuple[int, int] | None = None, grad: bool = True,
             outputs: int = 1, rng_at: PackArg | None = None) -> Template:
        leaves = tree_leaves((args, kwargs))
        slots = [x for x in leaves if isinstance(x, _SLOTS)]
        spots = tuple((i, x) for i, x in enumerate(args) if isinstance(x, _SLOTS))
        return Template(func, args, kwargs, stats, grad, outputs,
                        tuple(x for x in slots if isinstance(x, PackArg)),
                        tuple(x for x in slots if isinstance(x, VarArg)),
                        tuple((x.tensor, x.writes) for x in slots if isinstance(x, Persistent) and x.checked),
                        spots if len(spots) == len(slots) else None, rng_at)


_SLOTS = (VarArg, PackArg, Persistent, Made)


def _numbered(t: Template) -> bool:
    """Whether ``t`` replays a number the model could have given (``replays_a_number``), or
    reads a part of a tensor (``part_of``: the rows a number placed)."""
    return replays_a_number(_numbers(t)) or any(
        part_of(x) for x in tree_leaves((t.args, t.kwargs)) if isinstance(x, (VarArg, PackArg, Persistent)))


def _numbers(t: Template) -> list:
    """What a template replays as captured: its arguments that are no tensor, and how it reads
    each tensor (``pe[start:start + T]``, ``start`` drawn per step, replayed the captured rows)."""
    return [x.view if isinstance(x, _SLOTS) else x for x in tree_leaves((t.args, t.kwargs))]


@dataclass(frozen=True)
class Templates:
    """What a plan's anchored form replays: ``calls`` (function -> template), ``born_at`` (var
    -> (function, output) that makes it), ``wanted`` (pack index -> ``PackArg``), ``nodes`` (var
    -> its ``signature`` where the step first saved it, ``depth`` nodes deep), ``persistent``
    (those checked), ``rng_device`` (whose generator the random ops draw from), ``owners``
    (each parameter or buffer read, with the module that holds it, its attribute and its
    name: a step whose model holds another tensor there replays none, ``BoundTemplates``),
    ``at_saves`` (pack index -> the parameter or buffer read that the step saved there).

    Why ``at_saves``: a template reads a save by its index and a parameter as itself. A step
    that skips a layer (LayerDrop: HF's Wav2Vec2 at its default ``layerdrop=0.1``) saves the next
    layer's tensors where the skipped one's were, of the same sizes from the same nodes, and its
    chains replayed the next layer's inputs with the skipped layer's weights: wrong gradients.
    The weights that layer's ops saved are where the step shows which layer it runs.

    ``numbers``: each Python number the model held at the step's first save (its modules',
    their configs', the globals their code names: ``model_numbers.py``); ``arguments``: each
    number passed to a module's forward, call by call (``forward_numbers.py``). A template
    replays its op's numbers as captured, and no hook sees one no autograd node keeps (on the
    CPU dropout draws its mask with ``bernoulli_(1 - p)``): a step whose model holds or takes
    another number replays no function that replays a number (``numbered``)."""

    calls: Mapping[int, Template]
    born_at: Mapping[int, tuple[int, int]]
    wanted: Mapping[int, PackArg]
    nodes: Mapping[int, tuple]
    persistent: tuple[torch.Tensor, ...]
    depth: int = 1
    rng_device: torch.device | None = None
    owners: tuple[tuple[torch.Tensor, torch.nn.Module, str, str], ...] = ()
    at_saves: Mapping[int, torch.Tensor] = field(default_factory=dict)
    numbers: Held = field(default_factory=dict)
    arguments: Passed = field(default_factory=dict)
    names: Mapping[int, str] = field(default_factory=dict)   # id(parameter) -> its name, for messages

    @property
    def functions(self) -> frozenset[int]:
        return frozenset(self.calls)

    @cached_property
    def draws(self) -> dict[int, PackArg]:
        """Save index -> the save at whose hook a random op's generator state is taken (a step
        whose save there differs leaves its plan)."""
        return {c.rng_at.k: c.rng_at for c in self.calls.values() if c.rng_at is not None}

    @cached_property
    def born_in(self) -> dict[int, tuple[tuple[int, tuple[int, int]], ...]]:
        """Function -> the variables it makes, each with its ``born_at``: what a chain makes
        itself, found per function of the chain (a replay looked through every variable the
        step saves: ~50 us of a Llama's replay on this CPU)."""
        out: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        for var, at in self.born_at.items():
            out.setdefault(at[0], []).append((var, at))
        return {i: tuple(made) for i, made in out.items()}

    @cached_property
    def lifetimes(self) -> dict[tuple[int, tuple[int, ...]], Lifetimes]:
        """(var, chain) -> how long its replay holds each result of its own
        (``recipes.lifetimes``): the same at every step of the plan, so found once."""
        return {}

    @cached_property
    def numbered(self) -> frozenset[int]:
        """The functions whose templates replay a number (``_numbered``): a step whose model
        holds or takes another number reruns no chain through one (``BoundTemplates.why_not``),
        and the others still (a task's index that picks a head reaches no op)."""
        return frozenset(i for i, c in self.calls.items() if _numbered(c))

    def vary_from(self, before: Templates) -> None:
        """Mark in each discarded activation's ``signature`` the numbers that differ from
        ``before``'s capture as ``VARIES``, which any number matches (``made_by.matches``): a
        number that changes at every step (a temperature annealed per step) keeps its function
        out of the templates (``ready``), but a signature that held it left the plan at every
        step. A model's number that differs from ``before``'s is not compared either (a counter)."""
        for var, sig in self.nodes.items():
            if (old := before.nodes.get(var)) is not None:
                self.nodes[var] = varied(sig, old)
        for key in changed_since(self.numbers, before.numbers):
            del self.numbers[key]
        for key in changed_since(self.arguments, before.arguments):
            del self.arguments[key]

    def ready(self, before: Templates | None = None) -> dict[int, int]:
        """Function -> the gap from which everything its template reads was saved: a discard
        its chain reruns for waits until then (``scheduler.anchors.anchor``). With ``before``
        (the templates of an earlier step of the same start and shapes), only the functions
        that ran the same op with the same numbers, flags and views then: a number that changed
        between steps (a temperature schedule) rules the function out."""
        same = None if before is None else {
            i for i, c in self.calls.items()
            if i in before.calls and before.calls[i].func == c.func and _numbers(before.calls[i]) == _numbers(c)}
        return {i: max([a.gap for a in c.saves] + ([c.rng_at.gap] if c.rng_at else []), default=0)
                for i, c in self.calls.items() if same is None or i in same}


class TemplateCapture:
    """The capturing per-op step's side: every tensor autograd saves (``saved``, from the pack
    hook) and every captured recipe (``captured``), matched by storage; ``build`` at the end.
    A saved tensor is held weakly (autograd holds it through the forward); a recipe's tensor
    is held by the recipe, so its storage, and the storage's address, stay its own."""

    def __init__(self, model: torch.nn.Module, depth: int = 1, rng_device: torch.device | None = None,
                 watch: bool = True) -> None:
        self.depth = depth   # how far back a managed activation's signature looks: the longest chain
        self.rng_device = rng_device   # None: random ops get no template
        self.persistent: dict[int, torch.Tensor] = {}
        self.owner: dict[int, tuple[torch.nn.Module, str, str]] = {}   # id(tensor) -> module, attribute, name
        for path, module in model.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            for attr, t in (*module._parameters.items(), *module._buffers.items()):
                if t is not None and t.layout is torch.strided and not t.is_meta:
                    self.persistent.setdefault(t.untyped_storage()._cdata, t)
                    self.owner.setdefault(id(t), (module, attr, prefix + attr))
        # Templates.arguments: the numbers the forwards took. Not watched (a plan whose form is
        # made: a hook per module at every per-op step cost it 3-5%), every op counts as the
        # loop's and no function that replays a number gets a template (``build``)
        self.forwards = Forwards.noting(model) if watch else None
        # the first op from which no function that replays a number gets a template (None: none):
        # the first that read a number out of a tensor in a forward (``read_out``); every op where
        # the forwards are not watched or the model's numbers cannot be read (-1)
        self.read_at: int | None = None if watch else -1
        self.numbers = self._held(held, model)   # Templates.numbers, read again at the first save (``saved``)
        self.start = {id(t): t._version for t in self.persistent.values()}   # versions as the step began
        self.n = 0
        # cdata -> (k, tensor, version, gap, its node where the tensor is autograd's alias of the save)
        self.packed: dict[int, list[tuple[int, weakref.ref, int, int, str | None]]] = {}
        self.pending: dict[int, list[tuple[int, torch.Tensor, int]]] = {}  # cdata -> (function, tensor, version)
        self.found: dict[int, dict[int, PackArg | Persistent]] = {}       # function -> id(tensor) -> slot
        self.nodes: dict[int, tuple] = {}
        self.random: set[int] = set()                 # random functions with no template, and loose_numbers'
        self.rng_at: dict[int, PackArg] = {}          # random function -> the save its state is taken at
        self.last: tuple[torch.Tensor, PackArg] | None = None   # the generator's state at the last save, and that save
        self.param_saves: dict[int, int] = {}         # pack index -> the parameter's or buffer's storage saved there

    def saved(self, t: torch.Tensor, s: torch.UntypedStorage, var: int | None, gap: int,
              held: torch.Tensor | None = None) -> None:
        """The pack hook saw ``t`` (storage ``s``; ``var``: its plan variable, if managed) at
        ``gap``; ``held``: what autograd keeps of it, where not ``t`` (``saved_tensors.unlinked``:
        an alias without its ``grad_fn``, which lives as long as the graph, where ``t`` may not)."""
        k = self.n
        self.n = k + 1
        if k == 0:   # where a hook-driven step compares them: after what the loop set in the step
            self.numbers = self._held(reread, self.numbers)
        if self.rng_device is not None:
            self.last = (_rng_state(self.rng_device), PackArg.of(k, t, s, gap, t))
        if var is not None:
            if var not in self.nodes:
                self.nodes[var] = signature(t, self.depth)
            return
        c, version = s._cdata, t._version
        if c in self.persistent:
            self.param_saves[k] = c
        waiting = self.pending.get(c)
        if waiting:
            for w, x, v in waiting:
                if v == version and x.untyped_storage()._cdata == c:
                    self.found[w].setdefault(id(x), PackArg.of(k, t, s, gap, x))
            waiting[:] = [p for p in waiting if id(p[1]) not in self.found[p[0]]]
        node = None if held is None or held is t else node_of(t)
        self.packed.setdefault(c, []).append((k, weakref.ref(t if node is None else held), version, gap, node))

    def _held(self, read: Any, of: Any) -> Held:
        """The model's numbers (``held``, ``reread``): read from the user's objects, which may
        raise as they like (a property, a lazy module); then none is watched, and no function
        that replays a number gets a template (as after a read out of a tensor)."""
        try:
            return read(of)
        except Exception as e:   # (a failure to look is never the step's)
            log.info("the model's numbers could not be read (%s: %s): no template replays a number",
                     type(e).__name__, e)
            self.read_at = -1
            return {}

    def read_out(self, i: int, t: torch.Tensor) -> None:
        """Op ``i`` reads a number out of ``t`` (``int(t)``, ``t.item()``). Inside a forward, no
        hook sees where it goes nor whether it changes (an offset into a positional table, kept
        in a tensor and moved at an epoch's end: replayed stale, the losses differed from the
        epoch's on): no later function that replays a number gets a template (``build``). A
        flag (a ``bool`` tensor: ``if mask.any():``) steers branches, which the hooks check."""
        if self.read_at is None and t.dtype is not torch.bool and not self.outside():
            self.read_at = i

    def captured(self, i: int, recipe: Recipe) -> None:
        """Function ``i``'s recipe: each tensor it holds bound to a parameter or buffer, to a
        tensor saved already, or left waiting for a save to come."""
        found = self.found.setdefault(i, {})
        if recipe.outside and loose_numbers(recipe.func, recipe.args, recipe.kwargs):
            self.random.add(i)   # the training loop's number: no hook sees it change (forward_numbers.py)
            return
        if recipe.rng is not None:   # drawn from the state at the last save, if nothing drew since
            last = self.last
            if last is None or not torch.equal(last[0], recipe.rng):
                self.random.add(i)
                return
            self.rng_at[i] = last[1]
        stats = {id(recipe.args[p]) for p in recipe.stats or () if p < len(recipe.args)}
        for x, version in recipe.held:
            if x.layout is not torch.strided:
                continue   # sparse: never bound, the function gets no template
            s = x.untyped_storage()
            c = s._cdata
            base = self.persistent.get(c)
            if base is not None:
                found[id(x)] = Persistent(base, View.of(x), checked=id(x) not in stats,
                                          writes=base._version - self.start[id(base)])
                continue
            # the save that is x itself, else the first of its bytes (several saves may view one
            # storage: a column of the targets per decoder step)
            bound = None
            for k, ref, v, gap, node in self.packed.get(c, ()):
                t = ref()
                if t is not None and v == version and t.untyped_storage()._cdata == c:
                    arg = PackArg.of(k, t, s, gap, x, node)
                    bound = arg if bound is None or arg.whole else bound
                    if arg.whole:
                        break
            if bound is not None:
                found[id(x)] = bound
            else:
                self.pending.setdefault(c, []).append((i, x, version))

    def build(self, recipes: Mapping[int, Recipe], born_at: Mapping[int, tuple[int, int]]) -> Templates:
        """The templates of every recipe all of whose tensors were bound."""
        calls: dict[int, Template] = {}
        saved = {id(self.persistent[c]) for c in self.param_saves.values()}
        for i, r in recipes.items():
            found = self.found.get(i, {})
            if i in self.random or any(id(x) not in found for x, _ in r.held) or self._unseen(found, saved):
                continue

            def slot(x: Any) -> Any:
                if isinstance(x, Ref):
                    return VarArg(x.slot.var, x.view, whole_of(x.view, x.slot.nbytes))
                if isinstance(x, torch.Tensor):
                    return found[id(x)]
                return x   # a Made, or no tensor

            c = Template.make(r.func, tree_map(slot, r.args), tree_map(slot, r.kwargs), r.stats, r.grad,
                              r.outputs, self.rng_at.get(i))
            if self.read_at is None or i < self.read_at or not _numbered(c):
                calls[i] = c
        wanted: dict[int, PackArg] = {}
        for a in (a for c in calls.values() for a in c.saves):   # one save read two ways: checked as the part
            if wanted.setdefault(a.k, a).whole and not a.whole:
                wanted[a.k] = a
        persistent = {id(t): t for c in calls.values() for t, _ in c.checked}
        read = {id(x.tensor): x.tensor for c in calls.values() for x in tree_leaves((c.args, c.kwargs))
                if isinstance(x, Persistent)}
        at_saves = {k: t for k, c in self.param_saves.items() if id(t := self.persistent[c]) in read}
        self.packed.clear()
        self.pending.clear()
        self.param_saves.clear()
        self.last = None
        self.close()
        return Templates(calls, dict(born_at), wanted, dict(self.nodes), tuple(persistent.values()), self.depth,
                         self.rng_device, tuple((t, *self.owner[i]) for i, t in read.items()), at_saves,
                         dict(self.numbers), dict(self.forwards.passed) if self.forwards is not None else {},
                         {i: owner[2] for i, owner in self.owner.items()})

    def _unseen(self, found: Mapping[int, Any], saved: set[int]) -> bool:
        """Whether a function reads a parameter or buffer that no later step shows it read:
        neither saved (``Templates.at_saves`` checks it there), nor a parameter autograd
        accumulates into (``made_by._parameters``), nor held by the module of one that is. A
        template reads it as itself; a step that ran another layer (LayerDrop) added that
        layer's buffer where the template adds this one's (wrong gradients, silently)."""
        reads = [x.tensor for x in found.values() if isinstance(x, Persistent) and x.checked]

        def shown(t: torch.Tensor) -> bool:
            return id(t) in saved or isinstance(t, torch.nn.Parameter) and t.requires_grad
        modules = {id(self.owner[id(t)][0]) for t in reads if shown(t)}
        return any(not shown(t) and id(self.owner[id(t)][0]) not in modules for t in reads)

    def outside(self) -> bool:
        """Whether an op running now runs outside every forward of the model (as far as seen)."""
        return self.forwards is None or self.forwards.depth == 0

    def close(self) -> None:
        """Take the forward hooks off the model's modules (at the step's end, built or not)."""
        if self.forwards is not None:
            self.forwards.close()
