"""A hook-driven step's templates: what its saves give them, and the replays they run.

The capture and what a template is are ``templates.py``'s; this is the run side, one per
anchored step that recomputes (``anchored_step.py``): each save of the step is counted and the
ones a template reads are kept (until the last recompute that reads them), the generator's
state is taken at the saves a random op's replay draws from, a discard first asks whether its
chain can rerun later from what the step saw, and a recompute replays the chain below autograd.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ooc.runtime.made_by import matches, node_of, said, signature
from ooc.runtime.forward_numbers import Forwards
from ooc.runtime.model_numbers import first_change
from ooc.runtime.recipes import Made, _rng_state, lifetimes, rerun
from ooc.runtime.slots import Slot
from ooc.runtime.templates import PackArg, Persistent, Template, Templates, VarArg
from ooc.runtime.views import View


@dataclass
class BoundTemplates:
    """One hook-driven step's templates: what its saves gave them (``packs``: index ->
    (tensor, version at the save)), and the persistent tensors' versions when it began.
    ``readers``: pack index -> the plan's recomputes still to run that read it (``chains``,
    one per recompute action); a saved tensor is let go after the last (autocast's low-precision
    copies of the weights, which a matmul saves, would otherwise live to the step's end).
    ``states``: save index -> the generator's state at its hook, for the random ops the chains
    replay (``Template.rng_at``). ``keep``: a step that left its plan lets go of no save to its
    end: its recomputes are not the plan's, and one may run again (``AnchoredStep._let_go``)."""

    templates: Templates
    chains: Iterable[tuple[int, ...]] = ()
    n: int = 0
    packs: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)   # id(parameter) -> its version at the start
    readers: dict[int, int] = field(default_factory=dict)
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    recomputed: int = 0
    recompute_s: float = 0.0
    walked: dict[int, tuple] = field(default_factory=dict)   # signature's memo: the nodes the walks read
    keep: bool = False

    def __post_init__(self) -> None:
        self.versions = {id(t): t._version for t in self.templates.persistent}
        # A parameter or buffer the model holds no more (``load_state_dict(assign=True)``, a
        # module replaced): the templates would replay with the old one, whose bytes the model
        # no longer has. The first discard leaves the plan, and the next step captures anew.
        self.replaced = next((name for t, module, attr, name in self.templates.owners
                              if module._parameters.get(attr) is not t and module._buffers.get(attr) is not t), None)
        self.renumbered: str | None = None   # a module's number, changed since the capture (why_stale)
        # the numbers its forwards take, compared call by call (why_stale; off at ``close``)
        self.forwards = Forwards.comparing(self.templates.arguments)
        calls = self.templates.calls
        self.chains = list(self.chains)
        self.draws = frozenset(calls[w].rng_at.k for chain in self.chains for w in chain
                               if w in calls and calls[w].rng_at is not None)   # saves whose state a replay takes
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
        templates = self.templates
        if k == 0:   # the modules' numbers, read where the capture read them
            self.renumbered = first_change(templates.numbers)
        param = templates.at_saves.get(k)
        if param is not None and s._cdata != param.untyped_storage()._cdata:
            return self.why_stale() or (
                f"saved tensor {k} is not the parameter or buffer {tuple(param.shape)} the templates' step saved "
                "there (another layer ran: their chains would read this step's tensors with that one's weights)")
        want, draw = templates.wanted.get(k), k in self.draws
        if want is None and not draw:
            return None
        expected = want if want is not None else templates.draws[k]
        if expected.differs(t, s):
            looks = View.of(t)._replace(offset=0)
            moved = looks != expected.saved
            got, had = (f" viewed as {looks}", f" viewed as {expected.saved}") if moved else ("", "")
            return (f"saved tensor {k} (of any size) is {s.nbytes()} B from {node_of(t)}{got}, the templates' "
                    f"was {expected.nbytes} B from {expected.node}{had}"
                    + (", the generator's state a random op replays from" if draw else ""))
        if draw:
            self.states[k] = _rng_state(self.templates.rng_device)
        if want is not None:
            self.packs[k] = (t, t._version)
        return None

    def node_differs(self, var: int, t: torch.Tensor) -> str | None:
        """Why the first save of managed ``var`` is not the one captured: another op made it,
        or one with another number (``signature``)."""
        want = self.templates.nodes.get(var)
        if want is None:
            return None
        got = signature(t, self.templates.depth, self.walked)
        at = matches(got, want)
        if at is None:
            return None
        names = self.templates.names
        return (f"variable {var} was made by {said(got, at, names)} ({at} nodes back), the templates' by "
                f"{said(want, at, names)}")

    def why_stale(self) -> str | None:
        """Why no template replays: the model holds another parameter or buffer than they
        read, or another number than its modules (or their configs) held when they were
        captured (``model_numbers.py``), or one of its forwards took another
        (``forward_numbers.py``)."""
        if self.replaced is not None:
            return f"the model's {self.replaced} is another tensor than the one its templates read"
        if self.renumbered is not None:
            return f"the model's {self.renumbered}"
        return None if self.forwards is None else self.forwards.changed

    def why_not(self, chain: tuple[int, ...]) -> str | None:
        """Why ``chain`` cannot rerun later from what this step saw (None: it can). A number of
        the model that changed since the capture stops only a chain that replays a number
        (``Templates.numbered``): a task's index passed to the forward to pick a head reaches
        no op, and stopping every chain left the plan at the step's first discard."""
        why = self.why_stale()
        if why is not None and (self.replaced is not None or not self.templates.numbered.isdisjoint(chain)):
            return why
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
            for t, writes in c.checked:
                if t._version != self.versions[id(t)] + writes:
                    return (f"a parameter or buffer {tuple(t.shape)} its chain reads was written since the "
                            "chain read it")
            if c.rng_at is not None and c.rng_at.k not in self.states:
                return f"the generator's state function {w} draws from (at saved tensor {c.rng_at.k}) was not seen"
        return None

    def unsaved(self, chain: tuple[int, ...]) -> bool:
        """Whether a tensor ``chain`` reads is still to be saved (a discard waits for it)."""
        calls = self.templates.calls
        return any(a.k not in self.packs for w in chain if w in calls for a in calls[w].saves) or any(
            calls[w].rng_at.k not in self.states for w in chain if w in calls and calls[w].rng_at is not None)

    def inputs(self, chain: tuple[int, ...], var: int) -> list[int]:
        """The managed variables ``chain`` reads that it does not make itself."""
        born_in = self.templates.born_in
        made = {v for w in set(chain) for v, _ in born_in.get(w, ())}
        return sorted({a.var for w in chain for a in self.templates.calls[w].variables
                       if a.var != var and a.var not in made})

    def replay(self, slot: Slot, chain: tuple[int, ...], slots: Mapping[int, Slot],
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
                return x.read(self.packs[x.k][0])
            if isinstance(x, Persistent):
                return x.view.of_tensor(x.tensor)
            return x.tensor(made) if isinstance(x, Made) else x

        def key(x: Any) -> tuple[int, int] | None:   # the result of the chain's that materialize reads
            if isinstance(x, VarArg):
                return inside.get(x.var)
            return (x.op, x.out) if isinstance(x, Made) else None

        producer, out_index = born_at[slot.var]
        calls = [(w, self._drawn(self.templates.calls[w])) for w in chain]
        lives = self.templates.lifetimes.get((slot.var, chain))
        if lives is None:   # the same for each step of the plan: found at its first replay
            lives = self.templates.lifetimes[(slot.var, chain)] = lifetimes(calls, key)
        rerun(calls, materialize, slot=slot, producer=producer, out_index=out_index, born=born,
              rng_device=self.templates.rng_device, name_of=lambda w: f"function {w}", lives=lives)
        for k in self._reads(chain):   # let go of what no recompute of the plan reads any more
            left = self.readers.get(k, 0) - 1
            self.readers[k] = left
            if left == 0 and not self.keep:
                del self.packs[k]
        self.recomputed += slot.nbytes
        self.recompute_s += time.perf_counter() - t0

    def _drawn(self, c: Template) -> Template:
        """``c`` with the generator's state it draws from in this step (a random op's)."""
        return c if c.rng_at is None else dataclasses.replace(c, rng=self.states[c.rng_at.k])

    def close(self) -> None:
        if self.forwards is not None:
            self.forwards.close()
        self.packs.clear()
        self.walked.clear()
        self.states.clear()
