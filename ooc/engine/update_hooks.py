"""The update: ``optimizer.step()`` inside a managed step, seen through the optimizer's hooks.

The pre-hook (``_update_starts``) is the step's commit point: the recording step first proves
the budget feasible for the update (``_check_feasible``), then every transfer in flight is
waited for and the room the update will write is reserved on the tier (``_commit_point``),
so that neither a failed transfer nor a full disk can stop the update halfway. From there on
the step is not rolled back, and a Ctrl-C is held until the update is whole. The post-hook
(``_update_done``) notes that the optimizer's state exists and delivers a held Ctrl-C.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ooc.engine.memory import EngineMemory
from ooc.engine.persistent import PersistentStore
from ooc.engine.plan_cache import PlanCache
from ooc.engine.planning import Planner
from ooc.engine.step_budget import Update, update_so_far
from ooc.errors import OOCError
from ooc.runtime.deferred_interrupt import DeferredInterrupt
from ooc.runtime.dry_run import optimizer_need, state_sizes
from ooc.runtime.stepper import Stepper
from scheduler.errors import BudgetTooSmall
from scheduler.ir import Kind

log = logging.getLogger(__name__)


class UpdateGuard:
    """The engine's optimizer hooks (one part of ``OutOfCore``). Its state:
    ``_optimizer_stepped``, whether the optimizer's state exists (its size is known); before
    it does, ``_state_sizes``, the bytes of each parameter's state after one update, measured
    on meta twins by the recording step (``dry_run.state_sizes``; None if not measurable);
    ``_reserved_for``, a weak reference to the step whose writes were last reserved;
    ``_nesting``, the step whose update is open and how deep (a subclass's nested ``step()``,
    ``update_starts``);
    ``interrupts``, a Ctrl-C held while an update runs. the running step is the plan cache's ``form.st``."""

    def __init__(self, mem: EngineMemory, store: PersistentStore, planner: Planner, cache: PlanCache, *,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, manage: frozenset[str]) -> None:
        self._mem, self._store, self._planner, self._cache = mem, store, planner, cache
        self._model, self._optimizer, self._manage = model, optimizer, manage
        self._optimizer_stepped = False
        self._state_sizes: dict[torch.Tensor, tuple[int, ...]] | None = None
        self._reserved_for: weakref.ref | None = None
        self._nesting: tuple[weakref.ref | None, int] = (None, 0)   # a step, and its updates open
        self.interrupts = DeferredInterrupt()   # Ctrl-C waits for a started update to end

    def optimizer_step(self, given: torch.optim.Optimizer | None) -> None:
        """``given.step()`` then ``zero_grad(set_to_none=True)``, inside the managed step:
        the optimizer the user gave (a wrapper's ``step()`` may skip the update: Accelerate's
        between synchronized micro-batches), whose update the hooked one runs.

        A convenience: ``optimizer.step()`` (or ``scaler.step(optimizer)``) inside
        ``with engine.step():`` is recognised as the update by itself (see ``update_starts``).
        """
        if given is None:
            raise OOCError("this engine was created without an optimizer")
        if self._cache.form is None:
            raise OOCError("call engine.optimizer_step() inside `with engine.step():`")
        given.step()
        given.zero_grad(set_to_none=True)

    def update_starts(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``optimizer.step()`` pre-hook: the update starts here, whoever calls it (the user,
        ``GradScaler.step``, which skips it when the gradients are not finite, or
        ``optimizer_step()``).

        In the recording step it first checks that the budget is feasible, so that a budget
        that is too small fails before any parameter changes. Then, the commit point: every
        transfer still in flight is waited for (a failed one raises here) and the room the
        update will write is reserved on the swap file (a full disk raises here), so that
        neither failure can stop the update halfway. From here on the step is not rolled back.

        Outside ``engine.step()`` the update is plain PyTorch: managed tensors on the tier are
        brought back first (an empty storage read there is garbage or a segfault), and the
        next step sees the update's writes as writes between steps.
        """
        form = self._cache.form   # the running step's (None between steps)
        st = None if form is None else form.st
        if st is None:
            if not self._store.closed:
                self._store.bring_back()
            return
        closure = args[1] if len(args) > 1 else kwargs.get("closure")   # args[0]: the optimizer
        if closure is not None and not getattr(closure, "ooc_ran", False) and self._manage - {"activations"}:
            # A closure runs forward and backward inside the update, past the commit point:
            # managed params and grads crashed there ("src holds 0 bytes"), naming nothing.
            # (Lightning's, which ooc.integrations.lightning ran first, is marked ``ooc_ran``.)
            raise OOCError(f"{type(optimizer).__name__}.step(closure) runs the forward and backward inside the "
                           f"update, which ooc cannot do with {', '.join(sorted(self._manage - {'activations'}))} "
                           "managed; manage=('activations',) with a closure (the default)")
        # One update, not two nested ones: ``step()`` of a subclass that calls ``super().step()``
        # runs these hooks twice, nested, once PyTorch has wrapped both classes' ``step`` (any
        # instance of the parent class does). Counted per step (an update that raised leaves
        # none open), inline: a plain step's calls into ooc are counted (test_op_cost.py).
        ref, depth = self._nesting
        depth = depth if ref is not None and ref() is st else 0
        self._nesting = (weakref.ref(st), depth + 1)
        if depth:
            return
        # The backward is over: its last node returned, so the activations it unpacked are no
        # longer held by autograd (on demand, their bytes go back before the update needs room).
        st.close_node()
        if isinstance(st, Stepper):   # a step that waited for a shape no forward showed
            st.end_wait()
        if st.schedule is None or not self._optimizer_stepped:
            # A planned step's update may be the first to run (a GradScaler skipped the one its
            # plan was recorded from): measured here too, or it ran on demand and raised
            # OutOfBudget mid-training (torchvision's ViT, fp16, every kind managed).
            self._check_feasible(st)
        if st.schedule is None:
            overflow = st.forgive_overflow()
            if overflow is not None:   # feasible with a plan: only the unplanned step overflowed
                log.warning("the recording step went over the pool once (%s); planned steps stay "
                            "within the budget", overflow)
        self._commit_point(st)
        # From here on the step is not rolled back, so Ctrl-C waits until the update is whole
        # (ooc/runtime/deferred_interrupt.py): the step is then either undone or complete.
        self.interrupts.hold()
        st.update_starts()

    def update_done(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``optimizer.step()`` post-hook: the update completed (its state exists, with its
        size). Outside a step, the state it created there becomes managed too."""
        self._optimizer_stepped = True
        form = self._cache.form   # the running step's (None between steps)
        st = None if form is None else form.st
        if st is not None:
            ref, depth = self._nesting
            if ref is not None and ref() is st:   # the outermost update's end only (``update_starts``)
                self._nesting = (ref, max(depth - 1, 0))
                if depth > 1:
                    return
            st.update_done()
            self.interrupts.release()   # a Ctrl-C held during the update raises here
        elif "optimizer_state" in self._manage:
            names = {p: n for n, p in self._model.named_parameters()}
            for p, state in optimizer.state.items():
                for key, t in state.items():
                    if isinstance(t, torch.Tensor):
                        self._store.adopt(t, Kind.OPTIMIZER_STATE, f"{names.get(p, '?')}.{key}")

    def _commit_point(self, st: Stepper) -> None:
        """Make sure nothing the step did so far can fail once parameters start changing.

        Waits for every transfer in flight: a failed one raises here, naming its variable,
        while model and optimizer are still as before the step (the step is rolled back).
        Then reserves on the tier the room that the updated parameters and optimizer state
        may need, so that a full disk fails here and not halfway through the update.

        Inside the backward (PyTorch's recipe of one ``step()`` per gradient, from a
        post-accumulate-grad hook) the step is applied a parameter at a time, with or without
        the engine: the rest of the backward's transfers follow the first update whatever this
        waits for, so it waits for none (a drain there cost VGG16 at 1/4 ~80 ms a step) and
        raises only those already failed; one that fails later raises where it is met.
        """
        st.wait_for_transfers(drain=not _inside_backward())
        if st.planned and self._reserved_for is not None and self._reserved_for() is st:
            # A later update of the recipe's step: its first one reserved every write the
            # plan's step makes (listing them at each of VGG16's 28 updates cost ~6 ms a step).
            return
        self._mem.tier.reserve(self._writes_ahead(st))
        self._reserved_for = weakref.ref(st)

    def _writes_ahead(self, st: Stepper) -> list[tuple[int | None, int]]:
        """(tier key, or None for a new one; bytes) of each managed tensor the optimizer step
        may write to the tier: the updated parameters and the optimizer state."""
        out: list[tuple[int | None, int]] = []
        if not self._manage & {"params", "optimizer_state"}:
            return out
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                slot = st.slot_of(p)
                if "params" in self._manage and slot is not None:
                    out.append((slot.key, slot.nbytes))
                if "optimizer_state" not in self._manage:
                    continue
                state = [t for t in self._optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
                for t in state:
                    s = st.slot_of(t)
                    if s is not None:
                        out.append((s.key, s.nbytes))
                if not state and not self._optimizer_stepped:   # created now: as measured
                    out += [(None, n) for n in (self._state_sizes or {}).get(p, ()) if n >= self._mem.min_bytes]
        return out

    def _check_feasible(self, st: Stepper) -> None:
        """Plan what a recording step recorded so far (forward, backward; under a budget for
        the whole step, fit a share beside what it holds so far: ``Planner.check_feasible``),
        then measure, in any step until an update has completed, what the update will need:
        the first one runs on demand and must find room, op by op, for every managed tensor and
        every new storage of the optimizer that the op touches. It is measured by running
        ``step()`` on meta twins (``ooc/runtime/dry_run.py``), from shapes: here the parameters
        and grads are on the tier, their storages empty (sizes read from them said 0 bytes, and
        an overflowing update got through)."""
        recording = st.schedule is None   # else a planned step's first update: its plan holds
        if "optimizer_state" in self._manage and not self._optimizer_stepped:
            self._state_sizes = state_sizes(self._optimizer)   # what the first update creates
        if recording:   # and what it holds beside them so far, under a budget for the whole step
            self._planner.check_feasible(st.rec.sequence({}), st, lambda: self._update_so_far(st))
        counted = self._manage & {"params", "grads", "optimizer_state"}
        if not counted:
            return
        names = {p: n for n, p in self._model.named_parameters()}
        need = optimizer_need(self._optimizer, names, counted, self._mem.min_bytes,
                              len(st.rec.names) if recording else 0)
        budget = st.ctx.budget if isinstance(st, Stepper) else self._mem.budget   # (a recording's room)
        if need is not None and need.nbytes > budget:
            err = BudgetTooSmall(function=need.index,
                                 name=f"{need.name} of the optimizer step, holding {', '.join(need.tensors)}",
                                 working_set=need.nbytes, budget=budget, minimum=need.nbytes)
            # under a budget for the whole step, its least: the one named for the share looped forever
            try:
                raise self._planner.of_the_step(err) if self._mem.step_budget else err
            finally:   # (held here, a cycle through the frame its traceback keeps)
                del err

    def _update_so_far(self, st: Stepper) -> Update:
        """Under a budget for the whole step, what the update adds to what the recording step
        ``st`` holds beside its managed tensors so far (``step_budget.update_so_far``)."""
        if not self._mem.step_budget or self._optimizer is None:
            return Update()
        # Inside the backward (one ``step()`` per gradient) each call makes only its parameter's
        # state, which the step's recording counts from its start for all of them: measured
        # there, each update named a little more than the last (8 refusals, then 20 once what
        # the program holds counted, on a Llama). So the state counted is every parameter's
        # (``state_sizes(every=True)``), and its ops' own peak is found at the end.
        inside = _inside_backward()
        sizes = None if self._optimizer_stepped else (
            state_sizes(self._optimizer, every=True) if inside else
            self._state_sizes if "optimizer_state" in self._manage else state_sizes(self._optimizer))
        return update_so_far(self._optimizer, self._model, sizes, self._manage, self._mem, st.recording,
                             measure=not inside)


def _inside_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (an update called from
    a gradient hook); False where this PyTorch cannot say, which keeps the drain."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
