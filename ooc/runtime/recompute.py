"""Recomputation at run time: the plan's ``discard`` and ``recompute`` actions.

A plan may discard a saved activation after its last forward use (no copy anywhere) and, before
the backward needs it again, rerun the functions that wrote it (its *chain*,
``scheduler.replay.chain_for``: its producer, then each in-place update such as ``relu_``).
Swapping copies bytes; so must this: the replay gives the same bytes, or it does not run.

- Each chain function is *captured* when the forward runs it (``Recipe``): the aten op, its
  arguments with every managed tensor replaced by a ``Ref`` (its slot and how to rebuild the
  view, as ``Packed`` does: holding the tensor would keep bytes the plan moves), every other
  tensor held as it is (parameters, the batch, tensors under the threshold) with its version
  counter, and for a random op the generator state it drew from. A result of this step that
  nobody manages (nothing saved it: the scores a softmax read) is neither: holding it would
  keep bytes PyTorch frees, so it is a ``Made`` (which op made it, and the view), and the
  chain reruns that op first (``Function.needs``).
- ``discard`` runs only if every chain function was captured and no captured tensor changed
  since; otherwise the step diverges and the activation is written out as on demand: nothing
  is lost.
- ``recompute`` replays the chain with its inputs usable (the plan made them resident; on
  demand they are brought back), below autograd, as ``recipes.rerun`` says.

The capture's data (``Ref``, ``Made``, ``Recipe``) and the replay are ``recipes.py``'s; the
templates a hook-driven step reruns are ``templates.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ooc.errors import OOCError
from ooc.record.managed import NOT_REPLAYABLE, Recording
from ooc.record.storages import storage_of
from ooc.runtime.composition import has_sharded_params
from ooc.runtime.cuda_seam import cuda_runtime
from ooc.runtime.recipes import Made, Recipe, Ref, _rng_state, lifetimes, rerun
from ooc.runtime.slots import Slot
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from ooc.runtime.views import View
from scheduler.schedule import Schedule


def chains_of(schedule: Schedule | None) -> Mapping[int, tuple[tuple[int, tuple[int, ...]], ...]]:
    """var -> (function, chain) of each of its ``recompute`` actions (``Schedule.recomputes``,
    made once per plan: read only), none without a plan."""
    return {} if schedule is None else schedule.recomputes


def next_chain(chains: Mapping[int, tuple[tuple[int, tuple[int, ...]], ...]], var: int, after: int) -> tuple[int, ...]:
    """The chain of ``var``'s first recompute after function ``after`` (empty if none)."""
    return next((chain for at, chain in chains.get(var, ()) if at > after), ())


class Recomputation:
    """The step's discard and recompute. Its state: ``chains`` (var -> functions to rerun),
    ``recipe_ops`` (every function of some chain: the ones ``on_op`` captures), ``recipes``
    (function -> ``Recipe``), ``discarded_for`` (var -> the chain it was discarded for)."""

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, rec: Recording) -> None:
        self.ctx, self.book, self.course, self.rec = ctx, book, course, rec
        self.chains = chains_of(course.schedule)
        self.recipe_ops = frozenset(w for each in self.chains.values() for _, chain in each for w in chain)
        self.recipes: dict[int, Recipe] = {}
        # var -> the chain it was discarded for: a step that diverges after the discard runs on
        # demand, where op indices no longer match the plan's, and recomputes with that chain.
        self.discarded_for: dict[int, tuple[int, ...]] = {}
        # FSDP2 frees each unsharded parameter after its forward use and gathers it again in
        # its module's backward: a replay run before that (for an earlier backward op) would
        # read freed storage. With sharded parameters no op that reads a parameter is replayed.
        self.params_leave = has_sharded_params(ctx.model)
        # The generator a random op draws from: its tensors' device's (the CPU's under
        # ooc.testing.fake_cuda, whose "device" tensors are CPU tensors).
        self.rng_device = cuda_runtime().tensor_device(ctx.device) if ctx.device.type == "cuda" else ctx.device
        # A step whose plan's anchored form may rerun its chains turns its recipes into
        # templates too (``templates.TemplateCapture``; ``SavedTensors`` sets it).
        self.templates: Any = None
        self._built: Any = None

    def built_templates(self) -> Any:
        """The ``templates.Templates`` of this step's chains, if it captured them and kept to
        its plan (None else); built once."""
        if self.templates is None or self.course.diverged_at is not None:
            return None
        if self._built is None:
            self._built = self.templates.build(self.recipes, self.rec.born_at)
        return self._built

    def rng_before(self, info: Any) -> torch.Tensor | None:
        """The generator state a chain function is about to draw from (random ops only)."""
        return _rng_state(self.rng_device) if info.replay.rng else None

    def capture(self, i: int, info: Any, func: Any, args: tuple, kwargs: dict,
                rng: torch.Tensor | None, outputs: int) -> None:
        """Keep what replaying op ``i`` needs (called after it ran and its outputs were bound)."""
        held: list[tuple[torch.Tensor, int]] = []

        def keep(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            slot = self.book.slot_of(x)
            if slot is not None:
                return Ref(slot, View.of(x))
            s = storage_of(x)   # None: sparse, held as it is
            birth = None if s is None else self.rec.live_birth(s)
            if birth is not None and birth.var is None:   # the chain makes it again
                return Made(birth.op, birth.out, View.of(x))
            held.append((x, x._version))
            return x

        rule = info.replay
        stats = None
        if rule.updates_stats(args, kwargs):
            pos = rule.running_mean[0]
            stats = (pos, pos + 1)   # running_mean, running_var: adjacent in every BatchNorm schema
        recipe = Recipe(func, tree_map(keep, args), tree_map(keep, kwargs), held, rng, stats,
                        torch.is_grad_enabled(), outputs,
                        outside=self.templates is not None and self.templates.outside())
        self.recipes[i] = recipe
        if self.templates is not None and not self.course.waiting:
            self.templates.captured(i, recipe)

    def adopt(self, recipes: Mapping[int, Recipe], bound: Mapping[tuple[int, int], int]) -> None:
        """Keep of ``recipes`` (captured before the step knew its plan: a step that waits for
        its shape captures every op, ``binding.py``) those of this plan's chains, unless one
        reads as made by the step what the plan binds to a variable (its replay would make
        again what the plan keeps: the chain is then refused as not captured)."""
        self.recipes = {}
        for i, recipe in recipes.items():
            made = (x for x in tree_leaves((recipe.args, recipe.kwargs)) if isinstance(x, Made))
            if i in self.recipe_ops and not any((m.op, m.out) in bound for m in made):
                self.recipes[i] = recipe
                if self.templates is not None:
                    self.templates.captured(i, recipe)

    def replay_flags(self, info, args, kwargs, written_tensors) -> tuple[bool, bool, bool]:
        """The recorder's flags for this call (``ooc.record.replay``; the call rules of
        ``StepRecorder.op``): an in-place write to what the step did not create (parameters,
        buffers, state, tensors under the threshold) cannot be replayed."""
        if self.params_leave and any(isinstance(x, torch.nn.Parameter) for x in tree_leaves((args, kwargs))):
            return NOT_REPLAYABLE
        births = self.rec.births
        for t in written_tensors:
            s = storage_of(t)
            if s is None or s._cdata not in births:
                return NOT_REPLAYABLE
        return info.replay.flags(args, kwargs)

    def discard(self, slot: Slot, where: int) -> str | None:
        """Give ``slot``'s bytes back with no copy, if its chain can bring them back exactly;
        else say why not (the step diverges: on demand writes the activation out)."""
        chain = next_chain(self.chains, slot.var, where)
        recipes = [self.recipes.get(w) for w in chain]
        missing = [w for w, r in zip(chain, recipes) if r is None]
        missing += sorted({m.op for r in recipes if r is not None for m in _made(r) if m.op not in chain})
        changed = next((t for r in recipes if r is not None and (t := r.changed()) is not None), None)
        if not chain or missing or changed is not None:
            why = (f"ops {missing} of its chain were not captured" if missing or not chain
                   else f"an input of its chain ({tuple(changed.shape)}) was written since")
            return f"cannot discard {slot.name}: {why}"
        slot.discard(self.ctx.tier)
        self.discarded_for[slot.var] = chain
        return None

    def recompute(self, slot: Slot, chain: tuple[int, ...], where: int, ensure: Callable[..., None]) -> None:
        """Rerun ``chain`` to re-create ``slot`` before op ``where`` (the module docstring);
        ``ensure(slot, where, keep)`` makes each managed input usable (``Stepper.ensure``)."""
        t0 = time.perf_counter()
        recipes = [self.recipes[w] for w in chain]
        # Managed variables the chain makes on the way (an input discarded too, made again inside
        # the chain: scheduler.replay.chain_through): read from the replay, not from their slots.
        ops = set(chain)
        inside = {var: at for var, at in self.rec.born_at.items() if at[0] in ops and var != slot.var}
        keep = {slot}   # what is made usable stays so: on demand, room for the next input evicted an
        for r in recipes:   # earlier one, and the replay read a slot with no bytes (2026-11-29)
            for ref in _refs(r):   # every other managed input usable (the plan made them resident)
                if ref.slot is not slot and ref.slot.var not in inside:
                    keep.add(ref.slot)
                    ensure(ref.slot, where, keep=keep)
            changed = r.changed()
            if changed is not None:
                raise OOCError(
                    f"cannot recompute {slot.name} before op {where} ({self.course.name(where)}): a "
                    f"tensor its chain read ({tuple(changed.shape)}, {changed.dtype}) was written "
                    f"in place since; pass recompute=\"never\" to OutOfCore to swap instead")
        producer, out_index = self.rec.born_at[slot.var]   # (op, output) the plan bound it at

        def born(s: torch.UntypedStorage) -> None:
            slot.made_again(s)   # discarded: the tier holds no copy to forget
            self.book.register(slot)

        calls = list(zip(chain, recipes))
        rerun(calls, lambda x, made: _materialize(x, made, inside), slot=slot,
              producer=producer, out_index=out_index, born=born, rng_device=self.rng_device,
              name_of=self.course.name, lives=lifetimes(calls, lambda x: _key(x, inside)))
        t1 = time.perf_counter()
        self.ctx.counters["bytes_recomputed"] += slot.nbytes
        self.ctx.counters["recompute_s"] += t1 - t0
        self.book.events.append(("recompute", f"recompute {slot.name}", t0, t1))


def _materialize(x: Any, made: dict[tuple[int, int], torch.Tensor], inside: dict[int, tuple[int, int]]) -> Any:
    if isinstance(x, Ref):
        at = inside.get(x.slot.var)
        return x.tensor(None if at is None else made[at].untyped_storage())
    return x.tensor(made) if isinstance(x, Made) else x


def _key(x: Any, inside: dict[int, tuple[int, int]]) -> tuple[int, int] | None:
    """The replay's result that ``_materialize`` rebuilds ``x`` from (None: none of the chain's)."""
    if isinstance(x, Ref):
        return inside.get(x.slot.var)
    return (x.op, x.out) if isinstance(x, Made) else None


def _made(r: Recipe) -> list[Made]:
    return [x for x in tree_leaves((r.args, r.kwargs)) if isinstance(x, Made)]


def _refs(r: Recipe) -> list[Ref]:
    return [x for x in tree_leaves((r.args, r.kwargs)) if isinstance(x, Ref)]
