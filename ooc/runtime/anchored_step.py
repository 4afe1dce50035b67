"""A planned step that runs without intercepting ops: its actions run at autograd's hooks.

Why: the per-op path (a ``TorchDispatchMode`` that sees every aten op) costs time per op even
where the plan has nothing to do. PyTorch's Python dispatch alone costs 10-25 us per op (+7%
on a ResNet-18 step of 0.17 s at 32 px, more than the 5% an engine that moves nothing may
cost; benchmarks/results/overhead.md), and GPT 6x256 batch 8 on this 2-core CPU spends
~70 ms of a 0.6 s step there at 7/8 of its peak, with almost nothing moved. A step with
activations managed only needs to act where an activation is saved (the pack hook, forward)
and where a backward node needs one (the unpack hook): the plan is moved to those *anchors*
(``scheduler.anchors``), proven again by ``scheduler.check``, and run there. A plan that moves
nothing is the same step with no action: its guard is the pack hook alone (one Python call
per saved tensor, not per op), and the stats call it ``plain``.

What the per-op step saw, the anchored step takes from a trace of the planned step that kept
to its plan (``HookTrace``): the k-th saved tensor of at least ``min_bytes``, its size, the gap
(ops run so far) and the plan's variable; the m-th unpack, its gap and variable; where the
update starts. The step compares each save and unpack with the trace. The first that differs
ends the plan: the rest of the step brings back what its nodes unpack synchronously, writes
what it saves beyond the budget to the tier at once (``hook_step.py``), and the engine records
the next step and plans again. A plan that recomputes reruns its chains from the templates
the per-op step captured (``templates.py``): a discard checks that what its chain reads was
saved and not written since, a recompute replays it below autograd, and a step that leaves its
plan after a discard recomputes at the unpack. A plan whose sizes vary (``scheduler/widening.py``)
has a ``bounded`` trace: each save at most its place's room, every save counted.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ooc.runtime.hook_step import HookStep, Spilled
from ooc.runtime.hook_trace import HookTrace, loose_view
from ooc.runtime.pool import DevicePool
from ooc.runtime.recompute import chains_of, next_chain
from ooc.runtime.saved_tensors import Packed, _of_parameter, unlinked
from ooc.runtime.commit_point import wait_for_transfers
from ooc.runtime.given_back import freed_error
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_protocol import waited
from ooc.runtime.bound_templates import BoundTemplates
from ooc.runtime.templates import Templates
from ooc.storage.tier import SlowerTier
from scheduler.actions import TRANSITIONS, Op, refusal
from scheduler.ir import Kind
from scheduler.schedule import Action, Schedule


class AnchoredStep(HookStep):
    """One step of an anchored plan (the module docstring says why and how); ``form`` is
    "plain" when the plan moves nothing (``anchored`` None: no action; its frees are
    autograd's). The engine drives it as it drives a ``Stepper``
    (``ooc/runtime/step_protocol.py``): hooks, ``close_node``, ``wait_for_transfers``,
    ``update_starts``/``update_done``, ``finish``; and reads at its end ``diverged_at``,
    ``why``, ``peak``, ``spilled_bytes``, ``read_bytes``, ``stall_s``, ``events``, ``rollback``."""

    def __init__(self, schedule: Schedule, anchored: Schedule | None, trace: HookTrace, *, budget: int,
                 min_bytes: int, tier: SlowerTier, pool: DevicePool, model: torch.nn.Module,
                 start_key: Any = None, templates: Templates | None = None) -> None:
        super().__init__(model, budget, tier)
        self.schedule, self.start_key = schedule, start_key   # the engine's plan, for its bookkeeping
        self.anchored = anchored   # the plan this step runs (None: the plan moves nothing, no action)
        self.trace, self.min_bytes, self.pool = trace, min_bytes, pool
        self.variables = schedule.sequence.variables
        self.actions: tuple[tuple[int, Action], ...] = () if anchored is None else anchored.in_step_order
        self.form = "anchored" if self.actions else "plain"
        self.cursor = 0
        self.k = self.m = 0                       # saves and unpacks seen so far
        self.slots: dict[int, Slot] = {}          # var -> slot
        self.by_storage: dict[int, Slot] = {}     # id(storage) -> slot
        self.made: dict[int, int] = {}            # var -> the storage it was first saved in
        self.resident = self.peak = 0             # managed bytes held now, and their peak
        self.unbound = 0   # bytes saved after the plan ended, kept (counted at each save: an upper bound)
        self.updated = False                      # the optimizer step ran in this step
        # A plan that recomputes reruns its chains from templates (``templates.py``).
        self.chains = chains_of(anchored)
        self.bound = (BoundTemplates(templates, [c for each in self.chains.values() for _, c in each])
                      if templates is not None and self.actions else None)
        self.discarded_for: dict[int, tuple[int, ...]] = {}   # var -> the chain it was discarded for
        self.discards = frozenset() if anchored is None else anchored.discarded
        self.leaving = frozenset() if anchored is None else anchored.leaving   # their bytes go before the unpack

    @property
    def planned(self) -> bool:
        """Still following its plan (``Stepper.planned``)."""
        return self.diverged_at is None

    def quiet(self) -> bool:
        """Nothing of the step touched managed memory yet: no tensor saved, no update began."""
        return self.k == 0 and not self.updating and self.rollback.undo is not None

    # -- autograd's hooks --------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout is not torch.strided:   # sparse: PyTorch's, as the planned step left it
            return t if t.grad_fn is None else t.data   # (saved_tensors.unlinked)
        s = t.untyped_storage()
        if self.bound is not None and self.diverged_at is None:   # every save, of any size
            why = self.bound.saved(t, s)
            if why is not None:
                self._diverge(self._next_gap(), why, saves=self.k)
        nbytes = s.nbytes()
        # A plan whose sizes vary (``HookTrace.bounded``): every save is counted, small ones
        # too, so that one which outgrows its room is seen where it is, not as a shift of all
        # the saves after it; a small one is bound to the plan's variable where it has one.
        small = nbytes < self.min_bytes
        if small and not self.trace.bounded:
            return t if t.grad_fn is None else t.data   # (saved_tensors.unlinked)
        slot = self.by_storage.get(id(s))
        if slot is not None and slot.storage is not s:
            slot = None   # a dead storage's id, reused
        if (slot is None and not t.requires_grad and t._is_view() and not self.trace.bounded   # (no call per save)
                and loose_view(t, self.min_bytes) and not self._binds(nbytes)):
            return t if t.grad_fn is None else t.data   # as the trace's step left it out (hook_trace.loose_view)
        k = self.k
        self.k = k + 1
        if self.diverged_at is not None:
            return Packed(slot, t) if slot is not None else self._after_plan(t, nbytes) if not small else unlinked(t, t)
        packs = self.trace.packs
        gap, expected, var = packs[k] if k < len(packs) else (None, None, None)
        if expected != nbytes and not (self.trace.bounded and expected is not None and nbytes < expected):
            self._sizes_differ(k, gap, expected, nbytes)
            return Packed(slot, t) if slot is not None else self._after_plan(t, nbytes) if not small else unlinked(t, t)
        if var is not None and slot is None and not (_of_parameter(t) or t.is_meta):
            slot = self.slots.get(var)
            if slot is None or slot.state is State.ABSENT:   # first seen: bound to its variable
                if var in self.discards and (why := self.bound.node_differs(var, t)) is not None:
                    self._diverge(gap, why, saves=k)
                    return self._after_plan(t, nbytes)
                v = self.variables[var]
                slot = Slot(var, Kind.ACTIVATION, nbytes, v.name, in_place=False,
                            state=State.RESIDENT, storage=s)
                self.slots[var] = slot
                self.made[var] = s._cdata
                self._account(nbytes)
            elif self.made[var] != s._cdata:
                # Another tensor of the size the plan's step saved again here (the step skipped a
                # layer whose input two layers saved: LayerDrop). Bound to the slot, its node read
                # the first tensor's bytes back: wrong gradients (HF's Hubert, layerdrop=0.1).
                self._diverge(gap, f"saved tensor {k} is not {slot.name}, which the plan's step saved "
                              "there again (another tensor of its size)", saves=k)
                return self._after_plan(t, nbytes)
            self.by_storage[id(s)] = slot
        if self.actions:
            self._reach(gap)
        if slot is not None and var == slot.var:
            return Packed(slot, t, var not in self.leaving)
        return t if t.grad_fn is None else t.data   # (saved_tensors.unlinked)

    def _binds(self, nbytes: int) -> bool:
        """Does the trace bind its next save, of ``nbytes``, to a variable (the trace's step
        counted a loose view of managed bytes: their first save)?"""
        packs = self.trace.packs
        return self.k < len(packs) and packs[self.k][2] is not None and packs[self.k][1] == nbytes

    def _sizes_differ(self, k: int, gap: int | None, expected: int | None, nbytes: int) -> None:
        """Save ``k`` is not what the trace has there: the step leaves its plan."""
        self.sizes_differed = expected is not None and self.diverged_at is None
        had = "none" if expected is None else f"{'at most ' if self.trace.bounded else ''}{expected} B"
        self._diverge(gap, f"saved tensor {k} has {nbytes} B, the plan's had {had}", saves=k)

    def unpack(self, p: Any) -> torch.Tensor:
        if isinstance(p, Spilled):
            return self._read_spilled(p)
        if not isinstance(p, Packed):
            return p
        slot = p.slot
        if self.diverged_at is None:
            m = self.m
            self.m = m + 1
            unpacks = self.trace.unpacks
            gap, var = unpacks[m] if m < len(unpacks) else (None, None)
            if var != slot.var:
                self._diverge(gap, f"unpack {m} is of {slot.name}, the plan's was "
                              f"{'none' if var is None else self.variables[var].name}")
            else:
                self._reach(gap)
        if p.tensor is not None and slot.state is State.RESIDENT:   # never left: the saved tensor itself
            return p.tensor
        if slot.state is State.RESIDENT:
            return p.view.on(slot.storage)
        made = slot.state is State.DISCARDED   # a step that left its plan after the discard
        if made:
            self._recompute(slot, self.discarded_for[slot.var], gap=None)
        else:
            self._bring_back(slot)
        out = p.view.on(slot.storage)
        self._let_go(slot, made)   # off its plan, the node holds the bytes now; the slot lets go
        return out

    def _held(self) -> int:
        return self.resident + self.unbound

    def _hold(self, nbytes: int) -> None:
        self.unbound += nbytes
        self.peak = max(self.peak, self.resident + self.unbound)

    # -- the plan ----------------------------------------------------------------------------

    def _reach(self, gap: int | None) -> None:
        """Run the actions anchored at or before ``gap``. One whose variable the step has not
        seen yet (saved later at the same gap) waits for the next anchor."""
        actions, slots = self.actions, self.slots
        if self.cursor >= len(actions) or (gap is not None and actions[self.cursor][0] > gap):
            return   # nothing anchored here (most hooks): the pool reaps at the next action
        while self.cursor < len(actions) and self.diverged_at is None:
            g, a = actions[self.cursor]
            if gap is not None and g > gap:
                break
            slot = slots.get(a.var)
            if slot is None:
                break
            if (a.op is Op.DISCARD and self.bound is not None
                    and self.bound.unsaved(next_chain(self.chains, a.var, g - 1))):
                break   # what its chain reads is saved later at this gap: the next anchor
            self._apply(a, slot, g)
            self.cursor += 1
        self.pool.reap()

    def _apply(self, a: Action, slot: Slot, gap: int) -> None:
        """``a`` on ``slot`` as the transition table says (``PlanExecutor.apply`` for the
        swapping rows); a refused action ends the plan for this step."""
        op = a.op
        state = slot.state.residency
        why = refusal(op, state, slot.host_current)
        if why is not None:
            self._diverge(gap, f"{op.value} {slot.name}: {why}")
            return
        device = TRANSITIONS[op, state].device   # the row's change of device bytes
        if op in (Op.DISCARD, Op.RECOMPUTE) and self.bound is None:
            raise RuntimeError(f"ooc: an anchored plan without templates cannot {op.value} {slot.name}")
        if op is Op.SWAP_IN:
            slot.start_swap_in(self.tier, self.pool)
            self.read_bytes += slot.nbytes
        elif op is Op.WAIT_IN:
            waited(self, f"wait_in {slot.name}", Slot.finish_swap_in, slot)
            self.by_storage[id(slot.storage)] = slot
        elif op is Op.SWAP_OUT:
            slot.start_swap_out(self.tier)
            self.spilled_bytes += slot.nbytes
        elif op is Op.WAIT_OUT:
            waited(self, f"wait_out {slot.name}", Slot.finish_swap_out, slot)
        elif op is Op.DROP:
            slot.drop(self.tier)
        elif op is Op.FREE:
            slot.free(self.tier)
        elif op is Op.DISCARD:
            chain = next_chain(self.chains, slot.var, gap - 1)
            why = self.bound.why_not(chain)
            if why is not None:
                self._diverge(gap, f"cannot discard {slot.name}: {why}")
                return
            slot.discard(self.tier)
            self.discarded_for[slot.var] = chain
        else:   # recompute
            self._recompute(slot, a.chain, gap)
            return   # _recompute counts the bytes
        self._account(device * slot.nbytes)

    def _recompute(self, slot: Slot, chain: tuple[int, ...], gap: int | None) -> None:
        """Rerun ``chain`` from the templates (its managed inputs brought back first, where
        the step left its plan) and bind the result to ``slot``."""
        bound, fetched = self.bound, []
        for var in bound.inputs(chain, slot.var):
            src = self.slots.get(var)
            if src is None:
                raise RuntimeError(f"ooc: recomputing {slot.name} reads {self.variables[var].name}, "
                                   "which the step never saved")
            if src.state is State.DISCARDED:
                self._recompute(src, self.discarded_for[var], gap)
                fetched.append((src, True))
            elif src.state is not State.RESIDENT:
                if self.diverged_at is None:   # the plan brings inputs back first: not this step's plan
                    self._diverge(gap, f"recompute {slot.name}: its input {src.name} is not resident")
                self._bring_back(src)
                fetched.append((src, False))

        def born(s: torch.UntypedStorage) -> None:
            slot.made_again(s)
            self.by_storage[id(s)] = slot
            self._account(slot.nbytes)

        t0 = time.perf_counter()
        bound.replay(slot, chain, self.slots, born)
        self.events.append(("recompute", f"recompute {slot.name}", t0, time.perf_counter()))
        if self.diverged_at is not None:   # no plan frees what this replay alone read
            for src, made in fetched:
                self._let_go(src, made)

    def _let_go(self, slot: Slot, made: bool) -> None:
        """A step that left its plan gives back the pool bytes of ``slot``, read back or
        recomputed (``made``) for one use: the tier keeps its copy, its chain remakes it.
        Such a step runs none of the plan's frees, and each recompute of its backward kept its
        result and the inputs it read back in the pool to the step's end: a multi-task model
        whose head changed (the anchored step left its plan at the head's first save) ran its
        pool out at 256 KiB (``BudgetExceeded``)."""
        if self.diverged_at is None or slot.state is not State.RESIDENT:
            return
        if made:
            slot.discard(self.tier)
        else:
            slot.drop(self.tier)
        self._account(-slot.nbytes)

    def _bring_back(self, slot: Slot) -> None:
        """A node needs ``slot`` where the plan did not bring it back (a step that left its
        plan): synchronously, whatever its state. Such a step runs none of the plan's frees,
        so ``unpack`` hands the bytes to the node and drops the slot (the tier keeps its copy;
        the bytes go back to the pool when the node lets go of them). Kept in the slot to the
        step's end instead, every tensor the backward read back stayed in the pool: a
        Wav2Vec2 step that skipped a layer (LayerDrop) left its anchored plan at the end of
        its forward and ran the pool out in its backward (``BudgetExceeded`` at 20 MiB)."""
        self.read_bytes += slot.bring_back(self.tier, self.pool, account=self._account,
                                           wait=lambda name, fn: waited(self, name, fn))
        if slot.storage is not None:
            self.by_storage[id(slot.storage)] = slot
        if slot.state is not State.RESIDENT:   # freed by a plan that did not expect this use
            raise freed_error(slot, "a backward node")

    def _account(self, delta: int) -> None:
        self.resident += delta
        self.peak = max(self.peak, self.resident)

    def _next_gap(self) -> int | None:
        """The gap of the next save the trace expects (None past its last)."""
        packs = self.trace.packs
        return packs[self.k][0] if self.k < len(packs) else None

    def _diverge(self, gap: int | None, why: str, saves: int | None = None) -> None:
        """The step leaves its plan at ``gap``; ``saves``: the saves that matched it so far,
        which a plan that moves nothing counts from here on (``HookTrace.counted``)."""
        if self.diverged_at is None:
            self.diverged_at = gap if gap is not None else len(self.schedule.sequence.functions)
            self.why = why
            if self.bound is not None:
                self.bound.keep = True
            if saves is not None:
                self.unbound += self.trace.counted_before(saves)
                self.peak = max(self.peak, self.resident + self.unbound)

    # -- what the engine calls ---------------------------------------------------------------

    def close_node(self) -> None:
        """Autograd releases what a node unpacked when it returns: nothing to close here."""

    def wait_for_transfers(self, drain: bool = True) -> None:
        """The commit point: the plan's actions up to the update run, then every transfer in
        flight completes (a failed one raises, naming its variable; ``drain=False``: only those
        already failed). The slots keep their states: the plan's own waits still find them in
        flight."""
        if not self.actions:   # nothing in flight: a plain step's writes are synchronous
            return
        self._reach(self.trace.update)
        wait_for_transfers(self, self.slots.values(), self.tier, drain)

    def update_starts(self) -> None:
        self.updated = True
        if self.actions:
            self._reach(self.trace.update)
        self.rollback.commit()
        self.updating = True

    def finish(self, failed: bool) -> None:
        """The step is over: the rest of the plan runs (frees at the step's end), every
        transfer settles, and the tier forgets the step's activations."""
        if not failed and self.diverged_at is None:
            if self.actions:
                self._reach(None)
            if self.cursor < len(self.actions):
                g, a = self.actions[self.cursor]
                self._diverge(g, f"the plan's {a.op.value} of {self.variables[a.var].name} never ran: "
                              "the step did not save it")
        if not failed and self.diverged_at is None and self.k != len(self.trace.packs):
            self._diverge(None, f"{self.k} saved tensors of at least {self.min_bytes} B, the plan's "
                          f"step saved {len(self.trace.packs)}", saves=min(self.k, len(self.trace.packs)))
        if self.diverged_at is None:   # as the plan's step: what it saved counts
            self.peak = max(self.peak, self.trace.counted_before(len(self.trace.packs)))
        error = None
        for slot in self.slots.values():
            error = slot.settle(self.tier) or error
            slot.forget(self.tier)
        self._forget_spilled()
        if self.bound is not None:
            self.bound.close()
        if self.actions:
            self.pool.reap()
        self.events.insert(0, ("compute", f"{self.form} step (no op intercepted)", self.t0, time.perf_counter()))
        if error is not None and not failed:
            try:
                raise error
            finally:   # (held here, a cycle through the frame its traceback keeps)
                del error
