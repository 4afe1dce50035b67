"""A schedule as a stream of device allocations and frees, for replay through an allocator.

``check`` and ``simulate`` count bytes, as if any free bytes could hold any request. A real
allocator cannot always: a best-fit caching allocator fragments, and the virtual-addressing
allocator rounds every request up to whole chunks. ``allocation_events`` turns a schedule
into the requests the runtime would make, so that ``vmm.replay.replay`` can run them through
either allocator and say how much memory each really reserves (the paper's "Schedule" vs
"Schedule+VA" rows).

The stream follows the schedule's memory semantics exactly (see ``scheduler.schedule``):

- at the start, one alloc per ``initial_resident`` variable (live-in and on the device);
- before/after function i, in schedule order: ``swap_in v`` allocs v (memory is taken when
  the copy is issued); ``wait_out``, ``drop`` and ``free`` free it;
- when function i runs, one alloc per variable it creates (its first use, a write, of a
  variable that is not live-in), between its "before" and "after" actions.

Event times are function indices (``float(i)``; the initial allocations are at 0.0): the
stream's order is the schedule's, and the times say which function each request belongs to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.errors import ScheduleError
from scheduler.ir import VariableSequence
from scheduler.schedule import Op, Schedule

if TYPE_CHECKING:  # vmm is imported lazily: ``import scheduler`` must not need it
    from vmm.replay import Event


def allocation_events(schedule: Schedule) -> list["Event"]:
    """The allocation requests of one step of ``schedule``, in the order the runtime makes them.

    Keys are variable ids; a variable swapped out and back in is allocated again under the same
    key after its free. Raises :class:`ScheduleError` on an action that contradicts the
    variable's state (a free of a variable not on the device, a swap-in of one already there):
    run ``scheduler.check`` for the full diagnosis.
    """
    from vmm.replay import Event

    seq = schedule.sequence
    nbytes = {v: var.nbytes for v, var in seq.variables.items()}
    created = creations(schedule)
    on_device: set[int] = set()
    events: list[Event] = []

    def alloc(v: int, t: float, i: int, why: str) -> None:
        if v in on_device:
            raise ScheduleError(
                f"function {i}: {why} of variable {v}, which is already on the device",
                function=i, variable=v)
        on_device.add(v)
        events.append(Event("alloc", v, nbytes[v], t))

    def free(v: int, t: float, i: int, why: str) -> None:
        if v not in on_device:
            raise ScheduleError(
                f"function {i}: {why} of variable {v}, which is not on the device",
                function=i, variable=v)
        on_device.discard(v)
        events.append(Event("free", v, nbytes[v], t))

    for v in sorted(schedule.initial_resident):
        alloc(v, 0.0, 0, "initial residency")
    for i in range(len(seq.functions)):
        t = float(i)
        for lists in (schedule.before[i], None, schedule.after[i]):
            if lists is None:  # the function itself runs: it allocates what it creates
                for v in created[i]:
                    if v not in on_device:
                        alloc(v, t, i, "creation")
                continue
            for a in lists:
                if a.op is Op.SWAP_IN:
                    alloc(a.var, t, i, "swap_in")
                elif a.op is Op.WAIT_OUT or a.op is Op.DROP:
                    free(a.var, t, i, a.op.value)
                elif a.op is Op.FREE:
                    # A free of a variable already off the device (dead while swapped out)
                    # releases nothing on the device.
                    if a.var in on_device:
                        free(a.var, t, i, "free")
    return events


def creations(schedule_or_seq: Schedule | VariableSequence) -> tuple[tuple[int, ...], ...]:
    """For each function, the variables it creates: its first use of a non-live-in variable."""
    seq = getattr(schedule_or_seq, "sequence", schedule_or_seq)
    variables = seq.variables
    seen: set[int] = set()
    out: list[tuple[int, ...]] = []
    for f in seq.functions:
        new = []
        for u in f.uses:
            if u.var not in seen:
                seen.add(u.var)
                if not variables[u.var].live_in:
                    new.append(u.var)
        out.append(tuple(new))
    return tuple(out)
