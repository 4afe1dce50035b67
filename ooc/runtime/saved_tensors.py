"""Saved activations: the step's ``saved_tensors_hooks``.

Autograd's pack hook runs when an op saves a tensor for backward (in forward order), its
unpack hook when a backward node needs it (in backward order), *before* that node's first op:
unpack runs the plan's actions before the next op early, and nothing else happens in between.
A node unpacks all it saved before it computes (the generated ``apply``s unpack first), so
the next unpack after an op that computes belongs to the next node: the previous node has
returned and let go of its tensors. Autograd itself runs a view op between two unpacks of
one node (it detaches an unpacked input that had a ``grad_fn``), so view ops do not count
(``SavedTensors.op_ran``): counting that detach, the engine let go of the first tensor while the
node still read it (``MultiLabelSoftMarginLoss``'s ``log_sigmoid_backward``), and the plan
gave its bytes to the next swap-in, which did not fit the pool.
A saved activation is kept as a ``Packed`` (its slot and how to rebuild the view); the slot,
not autograd, holds the bytes, so the plan can move them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ooc.record.managed import Recording
from ooc.record.recorder import StepRecorder
from ooc.runtime.fresh_storages import storage_users
from ooc.runtime.hook_trace import HookTrace, loose_view
from ooc.runtime.on_demand_room import OnDemandRoom
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from ooc.runtime.templates import TemplateCapture
from ooc.runtime.views import View
from scheduler.ir import Access, Kind


def _of_parameter(t: torch.Tensor) -> bool:
    """Whether a saved tensor is a parameter or a view of one (``weight.t()``, saved by a
    linear layer's matmul). Its bytes are the parameter's owner's, never an activation's:
    swapping it moves bytes that stay in memory anyway, and under FSDP2 the owner frees that
    storage after the forward (``resize_(0)``, reshard_after_forward) and all-gathers into it
    again before the backward, so a write still in flight read freed memory (parameters
    differed from FSDP2 without ooc once writes were slow). Managed parameters are the
    engine's persistent slots, never activations.

    Asked at every save of a hook-driven step: ``isinstance(t, Parameter)`` runs the
    metaclass's Python ``__instancecheck__`` (a plain tensor is a ``Parameter`` to it when it
    has a true ``_is_param``), and ``t._base`` makes a Python object for the base; this asks
    the same, exactly, for a plain tensor that is no view at a fifth of the cost."""
    if type(t) is torch.Tensor:   # a Parameter only by the flag the metaclass reads
        if getattr(t, "_is_param", False):
            return True
    elif isinstance(t, torch.nn.Parameter):
        return True
    return t._is_view() and isinstance(t._base, torch.nn.Parameter)


class Packed:
    """What autograd keeps for a saved activation: the slot and how to rebuild the view;
    ``tensor``, the tensor itself where its bytes never leave the step's memory before its
    unpack (an anchored plan that neither swaps nor discards it: holding it costs no memory,
    and the unpack needs no new view, ~5 us each)."""

    __slots__ = ("slot", "view", "tensor")

    def __init__(self, slot: Slot, t: torch.Tensor, keep: bool = False) -> None:
        self.slot, self.view = slot, View.of(t)
        # (an anchored step's: no mode of the engine's sees ``.data``; see ``unlinked``)
        self.tensor = (t if t.grad_fn is None else t.data) if keep else None


def unlinked(p: Any, t: torch.Tensor) -> Any:
    """What a pack hook that returned ``p`` for ``t`` gives autograd: ``p``, unless it is ``t``
    itself and an op made ``t`` (a node that saves its own output), then an alias of ``t``
    without its ``grad_fn``, as PyTorch saves an output.

    Why: ``t`` held by its own node is a reference cycle that only a backward through that
    node breaks (it releases what the node saved), and Python's collector does not see it.
    A graph no backward reached (an output the loss leaves out, a head a step does not
    train) or one kept by ``backward(retain_graph=True)`` was never freed: three tensors a
    step of a model with an unused ``tanh`` head, and a 32 KiB range of the pool each
    anchored step of HF's Reformer, whose reversible layers keep their recomputed graphs
    until they let go of them, till a swap-in found the pool full (``BudgetExceeded``)."""
    if p is not t or t.grad_fn is None:
        return p
    with torch._C._DisableTorchDispatch():   # below the per-op path's mode, which took it for an op
        return t.data


class SavedTensors:
    """A step's pack hook and what its unpacks note (the ``Stepper`` runs the unpack: it
    brings the bytes back). Its state: ``unpacked``, vars unpacked for the next op;
    ``node_vars``, vars unpacked by the backward node now running, each with the op it was
    unpacked for; ``worked``, whether an op of
    the node ran since its last unpack (views not counted: ``op_ran``); ``full_vars``, a
    saved activation's var -> its variable in the whole-step recording; ``small_born`` and
    ``small_saved``, storages under the threshold the step created and those autograd saved
    (for the adaptive chunk; None unless observed); ``own_pack``, the pack hook this step
    pushed, weakly; ``signature`` and ``hook_trace``, what the plain and anchored forms of the
    next steps compare with (None when not noted)."""

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, rec: Recording,
                 full: StepRecorder | None, room: OnDemandRoom, observe_small: bool,
                 diverge: Callable[[int, str], None]) -> None:
        self.ctx, self.book, self.course, self.rec, self.full, self.room = ctx, book, course, rec, full, room
        planned = course.planned
        # A plan whose sizes depend on the data (``Course.widened``) knows no variable where
        # every step it was made from made less than the threshold; a step that saves more
        # there leaves it (``diverge``), and its recording gives the next plan that variable.
        # The step's method, weakly: held strongly, the step is a reference cycle (``hooks``).
        self.diverge = weakref.WeakMethod(diverge)
        self.unpacked: list[int] = []
        self.node_vars: list[tuple[int, int]] = []
        self.worked = False   # a node's work (an op, not a view) ran since the last unpack
        self.full_vars: dict[int, int] = {}
        self.packed: set[int] = set()   # vars saved since the last unpack: the next unpack begins a backward
        self.reachable: set[int] = set()   # vars saved before a backward began
        self.read_back: set[int] = set()   # vars a backward node unpacked
        # A recording step that decides the chunk (the engine's default chunk adapts, see
        # scheduler/chunk_size.py) notes the storages its ops create below the threshold, and
        # which of those autograd saves (``small_saved``): would a smaller chunk manage them?
        self.small_born: dict[int, int] | None = {} if observe_small and not planned else None
        self.small_saved: dict[int, int] = {}
        # The pack hook this step pushed, weakly (see Stepper.saved_tensors_hooks); None before.
        self.own_pack: Callable[[], Any] | None = None
        # A planned step of a plan that moves nothing notes what it saves (plain_step.Signature):
        # if it keeps to the plan, its next steps may run plain (``ooc/runtime/plain_step.py``).
        self.signature: list[tuple[int, int, bool]] | None = [] if planned and ctx.plain_candidate else None
        # A planned step that moves bytes notes where its hooks ran: if it keeps to its plan,
        # its next steps may run the plan at those hooks alone (``anchored_step.py``); so does a
        # recording the engine asks for it (``StepContext.trace_recording``).
        traced = (planned and not ctx.plain_candidate) or (not planned and ctx.trace_recording)
        self.hook_trace: HookTrace | None = (
            HookTrace(bounded=course.widened) if traced and ctx.manage == {"activations"} else None)
        # With it, the templates of its chains, if its plan recomputes (its anchored form reruns
        # them; one whose sizes vary swaps only: a template holds one step's shapes).
        self.templates: TemplateCapture | None = None
        if self.hook_trace is not None and room.recompute.recipe_ops and not course.widened:
            depth = max(len(c) for each in room.recompute.chains.values() for _, c in each)
            self.templates = room.recompute.templates = TemplateCapture(ctx.model, depth,
                                                                        room.recompute.rng_device,
                                                                        watch=ctx.unformed)

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout is not torch.strided:
            return unlinked(t, t)   # sparse: no storage to move, left to PyTorch
        p = self._pack_saved(t)
        if p is t and t.grad_fn is not None:
            p = unlinked(t, t)
        elif isinstance(p, Packed):   # saved before a backward begins? (hold_unread)
            self.packed.add(p.slot.var)
        trace = self.hook_trace
        if trace is not None:
            s = t.untyped_storage()
            n = s.nbytes()
            var = p.slot.var if isinstance(p, Packed) else None
            counted = n >= self.ctx.min_bytes and not (var is None and loose_view(t, self.ctx.min_bytes))
            if counted or trace.bounded:   # sizes vary: every save, bounded
                bound = self._bound(self.book.by_storage.get(id(s)), s, n) if trace.bounded else n
                trace.packs.append((len(self.rec.names), bound, var))
            if self.templates is not None:   # every save, of any size: a template may read it
                self.templates.saved(t, s, var, len(self.rec.names), held=p if var is None else None)
        return p

    def _pack_saved(self, t: torch.Tensor) -> Any:
        if self.course.planned:
            # A planned step only looks its storage up: no op runs, so the dispatch modes
            # need not be taken off the stack and put back (what most of the time went to).
            s = t.untyped_storage()
            widened = self.course.widened
            slot = self.book.by_storage.get(id(s))
            if self.signature is not None:   # what a plain step will compare its saves with
                n = s.nbytes()
                # (a plain step binds no variable: a loose view is left out whatever it views)
                counted = n >= self.ctx.min_bytes and not loose_view(t, self.ctx.min_bytes)
                if counted or widened:   # sizes vary: every save, bounded
                    n = self._bound(slot, s, n) if widened else n
                    self.signature.append((n, len(self.rec.names), not (_of_parameter(t) or t.is_meta)
                                           and n >= self.ctx.min_bytes))
            if slot is None or slot.storage is not s:
                b = self.rec.births.get(s._cdata)
                if b is None or (b.var is None and not widened):
                    return t   # not managed in this step: _pack returns it as it is too
                if b.var is None:   # on demand from here: it is managed (_pack)
                    self.diverge()(b.op, f"{self.rec.names[b.op]}#{b.op} ({b.nbytes} B) is saved where "
                                 f"the plan has no variable: it was under {self.ctx.min_bytes} B in "
                                 "the steps the plan was made from")
            elif slot.kind is not Kind.ACTIVATION or _of_parameter(t) or t.is_meta:
                return t
            else:
                return Packed(slot, t)
        full = self.full
        if full is None:
            with _disable_current_modes():
                return self._pack(t)
        full.saved(t)
        with _disable_current_modes():
            p = self._pack(t)
        if isinstance(p, Packed):   # unpack brings it back in another storage: same variable
            var = full.var(t)
            if var is not None:
                self.full_vars.setdefault(p.slot.var, var)
        return p

    def _bound(self, slot: Slot | None, s: torch.UntypedStorage, nbytes: int) -> int:
        """The most a save of storage ``s`` (``nbytes`` now; ``slot``: the one its id maps to)
        may have in a later step of a plan whose sizes vary (``scheduler/widening.py``), which
        its hook-driven steps check: the room of the plan's variable it is bound to; under
        ``min_bytes`` without one (left to PyTorch, as the plan left it); else its bytes (a
        parameter, the batch)."""
        v = None if slot is None or slot.storage is not s else self.course.schedule.sequence.variables.get(slot.var)
        if v is not None and v.kind is Kind.ACTIVATION:   # (None: made after the step left its plan)
            return max(nbytes, v.nbytes)
        return self.ctx.min_bytes - 1 if nbytes < self.ctx.min_bytes else nbytes

    def _pack(self, t: torch.Tensor) -> Any:
        if _of_parameter(t) or t.device.type == "meta":
            return t
        slot = self.book.slot_of(t)
        if slot is None:
            s = t.untyped_storage()
            b = self.rec.live_birth(s)
            if b is not None and b.var is not None and b.var in self.book.slots:
                slot = self.book.slots[b.var]   # saved again after the engine let go of its bytes
                return Packed(slot, t) if slot.kind is Kind.ACTIVATION else t
            if b is None or self.course.planned:
                if b is None and self.small_born is not None and id(s) in self.small_born:
                    self.small_saved[id(s)] = self.small_born[id(s)]
                return t   # not born in this step (input, buffer), too small, or not in the plan
            var = self.ctx.new_var()
            name = f"{self.rec.names[b.op]}#{b.op}"
            self.rec.promote(b, var, Kind.ACTIVATION, name)
            slot = Slot(var, Kind.ACTIVATION, b.nbytes, name, in_place=False,
                        state=State.RESIDENT, storage=s)
            self.room.adopt(slot, f"the saved activation {name}")
        if slot.kind is not Kind.ACTIVATION:
            return t
        if not self.course.planned and slot.state is State.RESIDENT and not slot.host_current:
            self.room.write_out(slot)     # on demand: write it out at once
        return Packed(slot, t)

    def op_ran(self, i: int, view: bool, outside: bool) -> None:
        """Op ``i`` begins: it uses what the unpacks right before it unpacked, and, unless it
        is a view, is the running backward node's work; ``outside`` every node after a node's
        work, it closes that node (the ``Stepper`` calls this only when one of these may
        change something: after an unpack, while a node's tensors are held).

        Why views do not count as a backward node's work: autograd detaches each tensor an
        unpack hook returns (``SavedVariable::unpack``), and a node may take views of one
        unpacked tensor before it unpacks the next. Counted as work, such an op closed the
        node at its next unpack, and the tensors it had unpacked looked released while it
        still held them: the plan freed their memory before their last use, and the pool ran
        out of room at a swap-in the plan had proven (issue 40: the attention's ``attn @ v``;
        issue 42: a TransformerEncoder's layer norm, found by PyTorch's module database)."""
        if outside and self.worked and self.node_vars:   # the backward is over
            self.close_node(i - 1, final=False)
        if self.unpacked:
            for var in self.unpacked:
                self.rec.use(i, var, Access.READ)
            self.unpacked.clear()
        if not view:
            self.worked = True

    def close_node(self, last: int | None = None, final: bool = True) -> None:
        """The backward node that unpacked ``node_vars`` has returned by the time the next
        node unpacks, or an op runs outside every node (``last``: the op before it): autograd
        held those tensors until then, so they count as used by every op from their unpack to
        ``last``, by default the last op that ran. Used at the last op alone, a tensor the node
        read early and again late looked free in between, and the plan gave it back and
        brought it in again inside the node: the node still held the old bytes, and the
        swap-in did not fit the pool (``native_group_norm``'s backward, which reruns a dozen
        ops on its mean and rstd; PyTorch's op database, every kind managed). Held to the
        update instead (where the engine closed the last node before), the first backward's
        last activations sat in every working set of SAM's second forward: 2 MiB where one
        forward and backward needs 1.5 (test_robust_training.py).

        A tensor something still holds (``_kept``) stays open, counted as used up to the
        close that finds it let go, unless the close is ``final`` (the engine's: the update
        begins, or the step ends). Why: a custom ``autograd.Function`` whose backward
        keeps computing holds what it unpacked while the nodes of a backward it runs inside
        unpack theirs (HF's Reformer: a reversible layer's backward recomputes its forward
        and runs ``backward()`` on it, holding ``ctx.saved_tensors`` across). Closed at that
        first inner unpack, the tensors went back to the plan while their bytes stayed
        in the pool, and the next swap-in did not fit it (``OutOfBudget`` at a planned step)."""
        if last is None:
            last = len(self.rec.names) - 1
        use = self.rec.use
        kept: list[tuple[int, int]] = []
        for var, first in self.node_vars:
            for i in range(first, last + 1):
                use(i, var, Access.READ)
            if not final and self._kept(var):
                kept.append((var, last + 1))
        self.node_vars = kept
        self.worked = False   # a node's work (an op, not a view) ran since the last unpack
        self.room.release_held(keep={self.book.slots[var] for var, _ in kept})

    def _kept(self, var: int) -> bool:
        """Whether a tensor outside the engine still holds ``var``'s bytes: its storage has
        more users than the slot (and a transfer in flight). Where this PyTorch cannot count
        them, none is assumed."""
        slot = self.book.slots.get(var)
        if slot is None or slot.storage is None:
            return False
        users = storage_users(slot.storage)
        return users is not None and users > 1 + sum(isinstance(t, torch.Tensor) for t in slot.pending)

    def hold_unread(self) -> None:
        """At the end of a step that is planned from: an activation saved before a backward
        began and that no backward node unpacked (a node the backward did not reach:
        ``backward(inputs=...)`` short of it, an output the loss left out) outlives the step
        (``live_out``): the plan never frees it, it keeps it or writes it out.

        Why: the plan gave its bytes back after its last use in the forward, while its node
        still held it. A later step whose backward reaches that node (the loss takes the
        output in, ``inputs`` widen) left the plan at an op of its backward, and on demand the
        unpack found nothing to read: the step failed. In core holds those bytes as long as
        autograd does; the plan keeps or writes them out to the step's end (kept as one op's
        inputs instead, they had to fit the budget at once). So too where autograd let go of
        it before the backward: a loss computed in a helper that returns it alone (Hugging
        Face's ``Trainer.compute_loss``) drops the graph of an output the loss leaves out when
        the helper returns, and a later step whose loss took that output in ran the same ops
        up to the loss, past the plan's free (BART with LayerDrop: a step that dropped every
        decoder layer left the encoder's graph unread). Counted dead, they made the next such
        step fail. One read back died with its node unless the graph was kept
        (``retain_graph``): a second backward in a later step that the recorded step did not
        run is not provided for (``given_back.freed_error``)."""
        for var in self.reachable - self.read_back:
            if var in self.rec.variables:
                self.rec.set_live_out(var, True)

    def hooks(self, before: Callable[[int], None], ensure: Callable[[Slot, int], None]
              ) -> torch.autograd.graph.saved_tensors_hooks:
        """The step's saved-tensor hooks: ``pack``, and an unpack that runs the plan's actions
        before the next op early (``before``), brings the slot's bytes back for it
        (``ensure``) and rebuilds the view. Remembers the pack hook, weakly (``own_pack``): an
        op that finds other hooks innermost (``save_on_cpu`` entered inside the step) is
        refused, since the activations saved under them would bypass the engine.

        Weakly: a bound method of the step kept on the step is a reference cycle, and then the
        whole step (its recording, slots and plan cursor: ~5,000 objects on GPT 6x256) is
        garbage that only the cyclic collector frees. It piled up until a full collection
        paused a step for 0.13 s, about one step in ten (GPT 6x256 b8 at 1/4). The hooks
        object, which the engine holds as long as the step runs, holds the functions."""

        def unpack(p: Any) -> torch.Tensor:
            if not isinstance(p, Packed):
                return p
            with _disable_current_modes():
                nxt = len(self.rec.names)          # the unpacked tensor is used by the next op
                if self.worked:
                    self.close_node(final=False)
                before(nxt)
                ensure(p.slot, nxt)
                return self.rebuild(p, nxt)

        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)
        self.own_pack = weakref.ref(hooks.pack_hook)
        return hooks

    def rebuild(self, p: Packed, nxt: int) -> torch.Tensor:
        """The saved view on its slot's storage, usable now, for op ``nxt``. On demand keeps
        nothing, but the tensor handed to autograd holds the bytes as long as the backward
        node runs: they count until it returns (``close_node``)."""
        slot = p.slot
        if self.hook_trace is not None:
            self.hook_trace.unpacks.append((nxt, slot.var))
        self.unpacked.append(slot.var)
        if self.packed:   # a backward begins: what was saved before it, this step's or a later one's may unpack
            self.reachable |= self.packed
            self.packed.clear()
        self.read_back.add(slot.var)
        self.node_vars.append((slot.var, nxt))
        self.room.hold(slot)
        if self.full is not None and slot.var in self.full_vars:
            self.full.alias(slot.storage, self.full_vars[slot.var])
            self.full.unpacked(self.full_vars[slot.var])
        return p.view.on(slot.storage)

    def saved_sizes(self) -> list[int] | None:
        """Bytes of every distinct storage born in this step that autograd saved, managed or
        not; None unless the step observed them (``observe_small``)."""
        if self.small_born is None:
            return None
        managed = [v.nbytes for v in self.rec.variables.values() if v.kind is Kind.ACTIVATION]
        return managed + list(self.small_saved.values())
