"""Saved activations: the step's ``saved_tensors_hooks``.

Autograd's pack hook runs when an op saves a tensor for backward (in forward order), its
unpack hook when a backward node needs it (in backward order), *before* that node's first op:
unpack runs the plan's actions before the next op early, and nothing else happens in between.
A node unpacks all it saved before it computes (the generated ``apply``s unpack first), so
the next unpack after an op that computes belongs to the next node: the previous node has
returned and let go of its tensors. Autograd itself runs a view op between two unpacks of
one node (it detaches an unpacked input that had a ``grad_fn``), so view ops do not count
(``Stepper.on_op``): counting that detach, the engine let go of the first tensor while the
node still read it (``MultiLabelSoftMarginLoss``'s ``log_sigmoid_backward``), and the plan
gave its bytes to the next swap-in, which did not fit the pool.
A saved activation is kept as a ``Packed`` (its slot and how to rebuild the view); the slot,
not autograd, holds the bytes, so the plan can move them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ooc.runtime.hook_trace import HookTrace
from ooc.runtime.slots import Slot, State
from scheduler.ir import Access, Kind


def _of_parameter(t: torch.Tensor) -> bool:
    """Whether a saved tensor is a parameter or a view of one (``weight.t()``, saved by a
    linear layer's matmul). Its bytes are the parameter's owner's, never an activation's:
    swapping it moves bytes that stay in memory anyway, and under FSDP2 the owner frees that
    storage after the forward (``resize_(0)``, reshard_after_forward) and all-gathers into it
    again before the backward, so a write still in flight read freed memory (parameters
    differed from FSDP2 without ooc once writes were slow). Managed parameters are the
    engine's persistent slots, never activations."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class Packed:
    """What autograd keeps for a saved activation: the slot and how to rebuild the view."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset", "tensor")

    def __init__(self, slot: Slot, t: torch.Tensor) -> None:
        self.slot = slot
        self.dtype, self.size, self.stride = t.dtype, t.size(), t.stride()
        self.offset = t.storage_offset()


class SavedTensors:
    """The ``Stepper``'s pack and unpack hooks (a mixin). Its state (``_init_saved``):
    ``unpacked``, vars unpacked for the next op; ``node_vars``, vars unpacked by the backward
    node now running; ``ops_since_unpack``, the node's ops since its last unpack (views not
    counted: ``used_unpacked``); ``full_vars``, a saved
    activation's var -> its variable in the whole-step recording; ``small_saved``, storages
    under the threshold that autograd saved (for the adaptive chunk); the pack hook this step
    pushed."""

    def _init_saved(self) -> None:
        self.unpacked: list[int] = []
        self.node_vars: list[int] = []
        self.ops_since_unpack = 0
        self.full_vars: dict[int, int] = {}
        self.small_saved: dict[int, int] = {}
        # The pack hook this step pushed, weakly (see saved_tensors_hooks); None before.
        self._own_pack: Callable[[], Any] | None = None
        # A planned step of a plan that moves nothing notes what it saves (plain_step.Signature):
        # if it keeps to the plan, its next steps may run plain (``ooc/runtime/plain_step.py``).
        self.signature: list[tuple[int, int, bool]] | None = (
            [] if self.planned and self.ctx.plain_candidate else None)
        # A planned step that moves bytes notes where its hooks ran: if it keeps to its plan,
        # its next steps may run the plan at those hooks alone (``anchored_step.py``).
        self.hook_trace: HookTrace | None = (
            HookTrace() if self.planned and not self.ctx.plain_candidate and self.ctx.device.type == "cpu"
            and self.ctx.manage == {"activations"} else None)

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks through which this step manages saved activations. Remembers its pack
        hook: an op that finds other hooks innermost (``save_on_cpu`` entered inside the
        step) is refused, since the activations saved under them would bypass the engine.

        Weakly: a bound method of the step kept on the step is a reference cycle, and then the
        whole step (its recording, slots and plan cursor: ~5,000 objects on GPT 6x256) is
        garbage that only the cyclic collector frees. It piled up until a full collection
        paused a step for 0.13 s, about one step in ten (GPT 6x256 b8 at 1/4). The hooks
        object holds the method as long as the step runs."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._own_pack = weakref.ref(hooks.pack_hook)
        return hooks

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout is not torch.strided:
            return t   # sparse: no storage to move, left to PyTorch
        p = self._pack_saved(t)
        trace = self.hook_trace
        if trace is not None:
            n = t.untyped_storage().nbytes()
            if n >= self.ctx.min_bytes:
                trace.packs.append((len(self.rec.names), n, p.slot.var if isinstance(p, Packed) else None))
        return p

    def _pack_saved(self, t: torch.Tensor) -> Any:
        if self.planned:
            # A planned step only looks its storage up: no op runs, so the dispatch modes
            # need not be taken off the stack and put back (what most of the time went to).
            s = t.untyped_storage()
            if self.signature is not None:   # what a plain step will compare its saves with
                n = s.nbytes()
                if n >= self.ctx.min_bytes:
                    self.signature.append((n, len(self.rec.names), not (_of_parameter(t) or t.is_meta)))
            slot = self.by_storage.get(id(s))
            if slot is None or slot.storage is not s:
                b = self.rec.births.get(s._cdata)
                if b is None or b.var is None:
                    return t   # not managed in this step: _pack returns it as it is too
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

    def _pack(self, t: torch.Tensor) -> Any:
        if _of_parameter(t) or t.device.type == "meta":
            return t
        slot = self.slot_of(t)
        if slot is None:
            s = t.untyped_storage()
            b = self.rec.live_birth(s)
            if b is not None and b.var is not None and b.var in self.slots:
                slot = self.slots[b.var]   # saved again after the engine let go of its bytes
                return Packed(slot, t) if slot.kind is Kind.ACTIVATION else t
            if b is None or self.planned:
                if b is None and self.small_born is not None and id(s) in self.small_born:
                    self.small_saved[id(s)] = self.small_born[id(s)]
                return t   # not born in this step (input, buffer), too small, or not in the plan
            var = self.ctx.new_var()
            name = f"{self.rec.names[b.op]}#{b.op}"
            self.rec.promote(b, var, Kind.ACTIVATION, name)
            slot = Slot(var, Kind.ACTIVATION, b.nbytes, name, in_place=False,
                        state=State.RESIDENT, storage=s)
            self.adopt(slot, f"the saved activation {name}")
        if slot.kind is not Kind.ACTIVATION:
            return t
        if not self.planned and slot.state is State.RESIDENT and not slot.host_current:
            self._write_out(slot)     # on demand: write it out at once
        return Packed(slot, t)

    def used_unpacked(self, i: int) -> None:
        """Op ``i`` comes right after unpacks: it uses what they unpacked.

        Why views do not count as a backward node's work (``Stepper.on_op``): autograd
        detaches each tensor an unpack hook returns (``SavedVariable::unpack``), and a node
        may take views of one unpacked tensor before it unpacks the next. Counted as work,
        such an op closed the node at its next unpack, and the tensors it had unpacked looked
        released while it still held them: the plan freed their memory before their last use,
        and the pool ran out of room at a swap-in the plan had proven (issue 40: the
        attention's ``attn @ v``; issue 42: a TransformerEncoder's layer norm, found by
        PyTorch's module database)."""
        for var in self.unpacked:
            self.rec.use(i, var, Access.READ)
        self.unpacked.clear()

    def close_node(self) -> None:
        """The backward node that unpacked ``node_vars`` has returned by the time the next
        node unpacks: autograd held those tensors until then, so they count as used up to
        the last op that ran (the plan must not give their memory back earlier)."""
        last = len(self.rec.names) - 1
        if last >= 0:
            for var in self.node_vars:
                self.rec.use(last, var, Access.READ)
        self.node_vars.clear()
        self.ops_since_unpack = 0
        if not self.planned:
            self._release_held()
        self.held.clear()

    def _release_held(self) -> None:
        """On demand: the node's unpacked activations count until it returns (autograd held
        them); then their bytes go back, the slower tier keeps a copy."""
        for slot in self.held:
            if slot.kind is Kind.ACTIVATION and slot.state is State.RESIDENT and slot.host_current:
                slot.drop(self.ctx.tier)
                self._account(-slot.nbytes)

    def unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, Packed):
            return p
        with _disable_current_modes():
            return self._unpack(p)

    def _unpack(self, p: Packed) -> torch.Tensor:
        nxt = len(self.rec.names)          # the unpacked tensor is used by the next op
        if self.ops_since_unpack:
            self.close_node()
        self.before(nxt)
        slot = p.slot
        if self.hook_trace is not None:
            self.hook_trace.unpacks.append((nxt, slot.var))
        self.unpacked.append(slot.var)
        self.node_vars.append(slot.var)
        self.ensure(slot, nxt)
        # On demand keeps nothing, but the tensor handed to autograd holds the bytes as long
        # as the backward node runs: they count until it returns (close_node releases them).
        self.held[slot] = None
        if self.full is not None and slot.var in self.full_vars:
            self.full.alias(slot.storage, self.full_vars[slot.var])
        return torch.empty(0, dtype=p.dtype, device=slot.storage.device).set_(
            slot.storage, p.offset, p.size, p.stride)
