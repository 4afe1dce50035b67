"""The managed view of a step the engine plans from: what one executed step did to managed
memory, turned into a ``scheduler.VariableSequence``.

Every step is recorded (it costs a few microseconds an op), so that when a step diverges
from its plan the engine can re-plan from the step that just ran instead of guessing. The
whole step, every storage, is recorded by ``ooc.record.recorder`` on a step that is not
planned (what ``ooc.trace`` records); this view keeps only what the engine manages, and
``tests/ooc/test_one_recorder.py`` checks that it is that recording, filtered.

A variable is *born* at the op whose output storage is new (not one of its inputs'); it
becomes managed later, when autograd saves it (an activation), when it lands in ``p.grad``
(a gradient) or in the optimizer's state. Reads before that moment are kept, so the
sequence has the variable's whole life: creation, forward reads, backward reads. Births are
keyed as the recorder keys storages (``ooc.record.storages``: the ``StorageImpl`` address,
which the birth's weak reference keeps from being reused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ooc.record.storages import storage_of

from scheduler.ir import Access, Cost, Function, Kind, Use, Variable, VariableSequence


NOT_REPLAYABLE = (False, False, False)
# The autograd node whose backward runs now, or None (PyTorch 2.1 and later): an op outside
# every node after a backward's last one tells the engine that the backward is over.
current_node = torch._C._current_autograd_node


@dataclass(eq=False)
class Birth:
    """A storage created by an op of this step, big enough to be managed."""

    ref: StorageWeakRef
    op: int
    out: int              # position among the op's tensor outputs
    nbytes: int
    reads: list[int] = field(default_factory=list)
    # The reads that wrote it in place (``out += identity``, ``relu_``): without them the plan
    # would take a copy written out before them for current and drop the written bytes.
    writes: list[int] = field(default_factory=list)
    var: int | None = None  # set when it becomes a managed variable


@dataclass
class Recording:
    names: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    uses: list[list[tuple[int, Access]]] = field(default_factory=list)
    births: dict[int, Birth] = field(default_factory=dict)      # storage._cdata -> Birth
    variables: dict[int, Variable] = field(default_factory=dict)
    born_at: dict[int, tuple[int, int]] = field(default_factory=dict)  # var -> (op, out)
    backward_start: int | None = None
    optimizer_start: int | None = None
    # Per op, the recorder's replay flags (replayable, rng, updates_stats: ooc/record/replay.py)
    # as this call met them; and the births read before they were managed. One the engine
    # never manages is nobody's to bring back: an op that read it is replayable only with the
    # ops that made it (``Function.needs``), when those are replayable too.
    flags: list[tuple[bool, bool, bool]] = field(default_factory=list)
    anonymous_reads: list[tuple[int, Birth]] = field(default_factory=list)
    # Storages that are no variable of this sequence (buffers, parameters and inputs left to
    # PyTorch, tensors under the threshold) -> (pin, the ops that read them). A replay reads
    # them as they are then: one written in place after an op read it makes that op not
    # replayable (``outside``), since the plan cannot see the write (InstanceNorm's ``repeat``
    # of its running mean, which it then updates with ``copy_``: the recompute refused). Not
    # noted inside ``optimizer.step()`` (the caller's rule): its writes to the parameters
    # come after every replay of the step, and none of its ops is replayed.
    outside_reads: dict[int, tuple[StorageWeakRef, list[int]]] = field(default_factory=dict)
    largest_birth: int = 0   # the most bytes one storage born in the step took so far
    # Per op, the type of the autograd node it ran inside (a backward's op), else None; and the
    # births ``live_birth`` found dead, kept for ``held_by_nodes`` (a node may have read them).
    nodes: list[str | None] = field(default_factory=list)
    gone: list[Birth] = field(default_factory=list)

    def begin_op(self, name: str) -> int:
        node = current_node()
        self.nodes.append(None if node is None else type(node).__name__)
        self.names.append(name)
        self.uses.append([])
        self.seconds.append(0.0)
        self.flags.append(NOT_REPLAYABLE)
        return len(self.names) - 1

    def use(self, op: int, var: int, access: Access) -> None:
        self.uses[op].append((var, access))

    def outside(self, op: int, ins: list[torch.Tensor], written: list[torch.Tensor],
                managed: Callable[[torch.Tensor], object]) -> None:
        """Op ``op`` read ``ins`` and wrote ``written`` in place: note its reads of storages
        that are no variable (not ``managed(t)``, not born in the step), and make the ops that
        read one it writes not replayable (``outside_reads``)."""
        reads = self.outside_reads
        for t in written:
            s = storage_of(t)
            if s is not None and s._cdata in reads and s._cdata not in self.births:
                for j in reads.pop(s._cdata)[1]:
                    if j != op:
                        self.flags[j] = NOT_REPLAYABLE
        for t in ins:
            s = storage_of(t)
            if s is None or s._cdata in self.births or managed(t) is not None:
                continue
            entry = reads.get(s._cdata)
            if entry is None:   # the pin keeps the address from being reused in the step
                entry = reads[s._cdata] = (StorageWeakRef(s), [])
            entry[1].append(op)

    def birth(self, s: torch.UntypedStorage, op: int, out: int, nbytes: int) -> Birth:
        b = self.births[s._cdata] = Birth(StorageWeakRef(s), op, out, nbytes)
        if nbytes > self.largest_birth:
            self.largest_birth = nbytes
        return b

    def live_birth(self, s: torch.UntypedStorage) -> Birth | None:
        """The birth of storage ``s`` in this step, if it was born in it (and is alive)."""
        key = s._cdata
        b = self.births.get(key)
        if b is not None and b.ref.expired():
            self.gone.append(self.births.pop(key))
            return None
        return b

    def held_by_nodes(self) -> list[tuple[str, int, str]]:
        """What the backward read that autograd never saved: (name, bytes, the first node that
        read it) of each storage born in the forward (outside any node), never managed, and
        read by an op inside a backward node. A custom ``autograd.Function`` that keeps a
        tensor on ``ctx`` instead of ``save_for_backward``, or a tensor hook's closure, holds
        it: no saved-tensor hook sees it, so no plan can move it, and it stays in memory
        beside the budget. One made by the last op before a backward began is the gradient
        it starts from (``loss.backward()``'s ``ones_like``, ``out.backward(g)``'s ``g`` made
        right before), which flows through the nodes as views of itself: not counted."""
        nodes, names, found = self.nodes, self.names, []
        n = len(nodes)
        for b in (*self.gone, *self.births.values()):
            if b.var is not None or nodes[b.op] is not None or (b.op + 1 < n and nodes[b.op + 1] is not None):
                continue
            reader = next((nodes[r] for r in b.reads if nodes[r] is not None), None)
            if reader is not None:
                found.append((f"{names[b.op]}#{b.op}", b.nbytes, reader))
        return found

    def promote(self, birth: Birth, var: int, kind: Kind, name: str) -> None:
        """The born storage becomes managed variable ``var``: replay its creation and reads."""
        birth.var = var
        self.variables[var] = Variable(var, birth.nbytes, kind, name)
        self.born_at[var] = (birth.op, birth.out)
        self.uses[birth.op].append((var, Access.WRITE))
        for op in birth.reads:
            self.uses[op].append((var, Access.READ))
        for op in birth.writes:
            self.uses[op].append((var, Access.WRITE))

    def add_persistent(self, var: int, nbytes: int, kind: Kind, name: str, live_out: bool) -> None:
        self.variables[var] = Variable(var, nbytes, kind, name, live_in=True, live_out=live_out)

    def set_live_out(self, var: int, live_out: bool) -> None:
        v = self.variables[var]
        self.variables[var] = Variable(v.id, v.nbytes, v.kind, v.name, v.live_in, live_out)

    def sequence(self, meta: dict) -> VariableSequence:
        flags = list(self.flags)
        needs: dict[int, list[int]] = {}
        for i, b in sorted(self.anonymous_reads, key=lambda r: r[0]):   # makers before readers
            if b.var is not None or not flags[i][0]:
                continue
            makers = [b.op, *(w for w in b.writes if w < i)]
            if all(flags[w][0] for w in makers):
                needs.setdefault(i, []).extend(makers)
            else:
                flags[i] = NOT_REPLAYABLE
        update = self.optimizer_start if self.optimizer_start is not None else len(self.names)
        functions = []
        for i, name in enumerate(self.names):
            # Order uses by first appearance; a variable both read and written keeps both.
            uses = tuple(Use(v, a) for v, a in dict.fromkeys(self.uses[i]))
            replay = flags[i] if i < update else NOT_REPLAYABLE
            functions.append(Function(i, name, uses, Cost(seconds=self.seconds[i]), *replay,
                                      needs=tuple(dict.fromkeys(needs.get(i, ()))) if replay[0] else ()))
        meta = dict(meta)
        if self.backward_start is not None:
            meta["backward_start"] = self.backward_start
        if self.optimizer_start is not None:
            meta["optimizer_start"] = self.optimizer_start
        return VariableSequence(tuple(functions), dict(self.variables), meta)
