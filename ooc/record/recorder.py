"""The one recorder: aten ops in, a ``scheduler.VariableSequence`` out.

``ooc.trace`` feeds it from a ``TorchDispatchMode`` on ``meta`` (or any device), the engine
from its recording step (``Stepper.on_op``, for real, while it swaps). Both call ``op`` with
the op's schema facts (``ooc.record.op_schema``), its arguments and its results, and both
key storages the same way (``ooc.record.storages``), so the same step gives the same
sequence whoever records it: ``tests/ooc/test_one_recorder.py`` checks that.

Uses per op (the rules, applied the same on every device)
---------------------------------------------------------
- every tensor argument is a read of its storage (once per op, even if passed twice);
- every result with a storage not seen before is a new variable, created by a write;
- an argument the schema marks as mutated (``Tensor(a!)``: in-place and ``out=`` ops) is a
  read *and* a write of its storage; results aliasing it add nothing more;
- a view op (every result aliases an argument, nothing mutated: ``view``, ``t``,
  ``transpose``, ``detach``, ...) allocates nothing and touches no data: it is kept in the
  sequence as a function with *no* uses, so function indices match the op stream;
- a sparse tensor has no storage of its own: its parts (indices and values) stand for it,
  read where it is an argument and results where it is one (a sparse gradient's values,
  held until ``zero_grad``, are bytes the step holds like any other);
- a managed activation that autograd unpacks for a backward node (``unpacked``, the engine's
  recording only) is read by the next function that is not a view, whether or not an op
  reads its bytes there;
- a storage first met as an argument (created outside the recorded step and not one of
  the registered parameters, buffers, state tensors or inputs) is an external input:
  kind ``INPUT``, ``live_in``;
- ``profiler.*`` ops (the optimizers' ``record_function`` markers) and ``lift_fresh``
  (``torch.tensor(data)`` emits it on real devices only) are not recorded (the caller
  checks ``OpInfo.skip``).

Replay flags (recomputation)
----------------------------
Each function gets ``replayable``, ``rng`` and ``updates_stats`` from the op's
``OpInfo.replay`` (``ooc.record.replay`` has the rules and why), plus two rules about the
call: a result that aliases an existing storage makes it not replayable, and so does an
in-place write to a storage that exists before the step (``num_batches_tracked.add_(1)``,
parameters, state: no replay can re-create those), and being in the optimizer phase
(``phase("optimizer")``; applied in ``sequence``).

Deaths
------
Eager lifetimes end at a variable's last use; the program may hold it longer (a Python name
such as Adam's ``denom``, kept until the next parameter's is made; every gradient, until
``zero_grad``). The recorder watches each storage the step creates (a weak reference with a
callback, so that it keeps nothing alive) and gives a variable still held after its last use
``held_to``: the last function recorded before its last storage died (the step's last, if it
outlived the recording). What bounds the bytes beside ooc's tensors reads it
(``scheduler.whole_step.held_beside``, ``scheduler.beside``); nothing else does.

Kinds
-----
What exists before the step is ``register``-ed with its kind (parameters and buffers
``PARAM``, optimizer state ``OPTIMIZER_STATE``, inputs ``INPUT``); what the step creates is
``mark``-ed when its role shows (``p.grad`` after the backward: ``GRAD``); a storage that
autograd saved (``saved``, from a pack hook) and that is none of those is an
``ACTIVATION``; everything else a ``TEMPORARY``. A new variable is named after the function
that wrote it: ``"<function>#<index>"``, with ``.k`` for the k-th result.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ooc.record.op_schema import OpInfo
from ooc.record.storages import StorageTable, sparse_parts, storage_of
from scheduler.ir import Access, Cost, Function, Kind, Use, Variable, VariableSequence


class StepRecorder:
    """Functions, variables and uses of one step, as the module docstring's rules say."""

    def __init__(self) -> None:
        self.table = StorageTable()
        self.nbytes: list[int] = []
        self.vname: list[str] = []
        self.kind: list[Kind | None] = []
        self.live_in: list[bool] = []
        self.live_out: list[bool] = []
        self.fname: list[str] = []
        self.fuses: list[tuple[tuple[int, bool], ...]] = []
        self.fflops: list[float] = []
        self.fbytes: list[int] = []
        self.fsecs: list[float | None] = []
        self.fflags: list[tuple[bool, bool, bool]] = []   # replayable, rng, updates_stats
        self.saved_vars: set[int] = set()        # variables autograd packed
        self.marks: dict[str, int] = {}
        self._external = 0
        # Deaths (the module docstring): per variable the step created, its storages alive,
        # and the functions recorded when the last one died; the weak references themselves.
        self._alive: dict[int, int] = {}
        self._died: dict[int, int] = {}
        self._watches: list[weakref.ref] = []
        self._unpacked: list[int] = []   # variables autograd unpacked for the next function

    # -- what exists before the step, and what the step's tensors turn out to be -----------

    def register(self, t: torch.Tensor, kind: Kind, name: str, *, live_in: bool = True,
                 live_out: bool = False, nbytes: int | None = None) -> int | None:
        """Declare a storage that exists before the step; the first registration wins.
        ``nbytes``: its size when its bytes are elsewhere now (the runtime released it)."""
        s = storage_of(t)
        if s is None:
            return None
        vid = self.table.get(s)
        if vid is None:
            vid = self._new(s, name)
            if nbytes is not None:
                self.nbytes[vid] = nbytes
            self.kind[vid], self.live_in[vid], self.live_out[vid] = kind, live_in, live_out
        return vid

    def mark(self, t: torch.Tensor, kind: Kind, name: str, *, live_out: bool = False) -> None:
        """Classify a storage the step created (a gradient, replaced state) unless a
        registration already classified it."""
        vid = self.var(t)
        if vid is not None and self.kind[vid] is None:
            self.kind[vid], self.vname[vid], self.live_out[vid] = kind, name, live_out

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t`` for the backward (call from a pack hook)."""
        vid = self.var(t)
        if vid is not None:
            self.saved_vars.add(vid)

    def unpacked(self, vid: int) -> None:
        """Autograd unpacked variable ``vid`` (a managed activation) for the node about to run:
        a read by the next function that is not a view. The node may read none of its bytes
        (IndexAddBackward needs only its source's shape), but the managed recording counts the
        unpack as a use, and what the step holds beside the managed tensors is the difference
        of the two: an MPNN's 16 MiB message, last read by an op at function 7 and unpacked at
        92, fell out of it there, and its plans held 13 MiB more than its step budget."""
        self._unpacked.append(vid)

    def phase(self, name: str) -> None:
        """Note that phase ``name`` (e.g. ``"backward"``) starts at the next function."""
        self.marks[f"{name}_start"] = len(self.fname)

    def var(self, t: torch.Tensor) -> int | None:
        """The variable ``t``'s storage holds, if it is one."""
        s = storage_of(t)
        return None if s is None else self.table.get(s)

    def alias(self, s: torch.UntypedStorage, vid: int) -> None:
        """``s`` now holds variable ``vid``'s bytes (the runtime brought them back into a new
        storage): uses of ``s`` are uses of ``vid``."""
        self.table.add(s, vid)
        if vid in self._alive:
            self._watch(s, vid)

    def _watch(self, s: torch.UntypedStorage, vid: int) -> None:
        """Note when the last storage of ``vid`` (created in the step) dies."""
        alive, died, fname = self._alive, self._died, self.fname

        def gone(_: weakref.ref) -> None:   # (runs where the last reference went: any thread)
            alive[vid] -= 1
            if not alive[vid]:
                died[vid] = len(fname)

        alive[vid] = alive.get(vid, 0) + 1
        died.pop(vid, None)
        self._watches.append(weakref.ref(s, gone))

    def _new(self, s: torch.UntypedStorage, name: str) -> int:
        vid = len(self.nbytes)
        self.table.add(s, vid)
        self.nbytes.append(s.nbytes())
        self.vname.append(name)
        self.kind.append(None)
        self.live_in.append(False)
        self.live_out.append(False)
        return vid

    # -- the per-op rules (keep them small: they run for every recorded op) ----------------

    def op(self, info: OpInfo, args: tuple, kwargs: dict, out: Any, name: str,
           seconds: float | None = None) -> int:
        """Record op ``info`` that ran on ``(args, kwargs)`` and returned ``out``, as function
        ``name``; returns its index."""
        index = len(self.fname)
        self.fname.append(name)
        self.fsecs.append(seconds)
        if info.view:
            self.fuses.append(())
            self.fflops.append(0.0)
            self.fbytes.append(0)
            self.fflags.append(_NEVER)
            return index
        var_of = self.table.var_of
        uses: list[tuple[int, bool]] = []
        seen: set[int] = set()
        nbytes = 0
        inputs = info.inputs(args, kwargs)
        for t in inputs:
            s = storage_of(t)
            if s is None:   # a sparse tensor: its parts are read (the loop reaches them)
                inputs.extend(sparse_parts(t))
                continue
            nbytes += t.nbytes
            vid = var_of.get(s._cdata)
            if vid is None:  # created outside the recorded step: an external input
                vid = self._new(s, f"external#{self._external}")
                self._external += 1
                self.kind[vid], self.live_in[vid] = Kind.INPUT, True
            if vid not in seen:
                seen.add(vid)
                uses.append((vid, False))
        if self._unpacked:   # (a view is no function that reads: they wait for the next one)
            uses.extend((vid, False) for vid in dict.fromkeys(self._unpacked) if vid not in seen)
            seen.update(self._unpacked)
            self._unpacked.clear()
        persistent = False   # writes in place what existed before the step
        if info.writes:
            for t in info.written(args, kwargs):
                s = storage_of(t)
                vid = None if s is None else var_of.get(s._cdata)   # read above
                if vid is None:
                    continue
                uses.append((vid, True))
                persistent = persistent or self.live_in[vid]
                n = s.nbytes()
                if n > self.nbytes[vid]:  # out= results may be resized
                    self.nbytes[vid] = n
        k = 0
        aliased = False   # a result in an existing storage, not written in place
        results = [out] if isinstance(out, torch.Tensor) else _results(out)
        for t in results:
            s = storage_of(t)
            if s is None:   # a sparse result: its parts are results (the loop reaches them)
                results.extend(sparse_parts(t))
                continue
            nbytes += t.nbytes
            if s._cdata not in var_of:
                vid = self._new(s, f"{name}#{index}" if k == 0 else f"{name}#{index}.{k}")
                uses.append((vid, True))
                self._watch(s, vid)
            elif not info.writes:
                aliased = True
            k += 1
        self.fuses.append(tuple(uses))
        rule = info.replay
        self.fflags.append(_NEVER if not rule.replayable or aliased or persistent else
                           rule.flags(args, kwargs))
        self.fbytes.append(nbytes)
        flops = 0.0
        if info.flop is not None:
            try:
                flops = float(info.flop(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not cover this overload
                flops = 0.0
        self.fflops.append(flops)
        return index

    # -- the result ---------------------------------------------------------------------------

    def sequence(self, meta: dict[str, Any] | None = None, kinds: dict[int, Kind] | None = None,
                 so_far: bool = False) -> VariableSequence:
        """The recorded functions and variables (classification applied; ``kinds``: of
        variables nothing classified, for this sequence only). ``so_far``: of a step still
        running, whose variables alive now get no ``held_to`` (what holds them may let go at
        the next op; counted held to now, a Llama's refusals at each update inside its
        backward each named more, in some processes without end)."""
        saved, kinds = self.saved_vars, kinds or {}
        last: dict[int, int] = {}   # (to keep only a hold past the last use)
        for i, uses in enumerate(self.fuses):
            for v, _ in uses:
                last[v] = i
        variables: dict[int, Variable] = {}
        for vid in range(len(self.nbytes)):
            kind = self.kind[vid] or kinds.get(vid)
            if kind is None:
                kind = Kind.ACTIVATION if vid in saved else Kind.TEMPORARY
            variables[vid] = Variable(vid, self.nbytes[vid], kind, self.vname[vid], self.live_in[vid],
                                      self.live_out[vid], self._held_to(vid, last.get(vid, -1), so_far))
        reads = [Use(v, Access.READ) for v in range(len(self.nbytes))]
        writes = [Use(v, Access.WRITE) for v in range(len(self.nbytes))]
        # The optimizer's update runs once per step: none of it is replayed (see replay.py).
        update = self.marks.get("optimizer_start", len(self.fname))
        flags = self.fflags
        functions = tuple(
            Function(i, self.fname[i],
                     tuple(writes[v] if w else reads[v] for v, w in self.fuses[i]),
                     Cost(self.fflops[i], self.fbytes[i], self.fsecs[i]),
                     *(flags[i] if i < update else _NEVER))
            for i in range(len(self.fname)))
        return VariableSequence(functions, variables, {**self.marks, **(meta or {})})


    def _held_to(self, vid: int, last: int, so_far: bool = False) -> int | None:
        """The last function recorded while variable ``vid`` was held (the step's last while
        it is), or None: not one the step created, not held past its ``last`` use, or (of a
        step ``so_far``) alive still."""
        if vid not in self._alive or self.live_out[vid] or (so_far and vid not in self._died):
            return None
        end = self._died.get(vid, len(self.fname)) - 1
        return end if end > last else None


_NEVER = (False, False, False)


def _results(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned (a list or tuple of them, one level deep)."""
    found: list[torch.Tensor] = []
    if isinstance(out, (list, tuple)):
        for a in out:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found
