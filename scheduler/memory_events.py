"""A schedule as a stream of device allocations and frees, for replay through an allocator.

``check`` and ``simulate`` count bytes, as if any free bytes could hold any request. A real
allocator cannot always: a best-fit caching allocator fragments, and the virtual-addressing
allocator rounds every request up to whole chunks. ``allocation_events`` turns a schedule
into the requests the runtime would make, so that ``vmm.replay.replay`` can run them through
either allocator and say how much memory each really reserves (the paper's "Schedule" vs
"Schedule+VA" rows).

The stream follows the transition table of ``scheduler.actions`` exactly:

- at the start, one alloc per ``initial_resident`` variable (live-in and on the device);
- before/after function i, in schedule order: ``swap_in v`` allocs v (memory is taken when
  the copy is issued); ``wait_out``, ``drop`` and ``free`` free it;
- ``discard`` frees v; ``recompute v`` allocs v, then its chain's temporaries (one block of
  their peak bytes), freed when the chain ends;
- when function i runs, one alloc per variable it creates (its first use, a write, of a
  variable that is not live-in), between its "before" and "after" actions.

Event times are function indices (``float(i)``; the initial allocations are at 0.0): the
stream's order is the schedule's, and the times say which function each request belongs to.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler.actions import Ledger
from scheduler.ir import VariableSequence
from scheduler.schedule import Schedule

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # vmm is imported lazily: ``import scheduler`` must not need it
    from scheduler.hardware import Hardware
    from vmm.replay import Event


def allocation_events(schedule: Schedule) -> list["Event"]:
    """The allocation requests of one step of ``schedule``, in the order the runtime makes them.

    Keys are variable ids; a variable swapped out and back in is allocated again under the same
    key after its free. Raises :class:`scheduler.actions.Refused` (a ``ScheduleError``) on an
    action or a use the transition table refuses, as ``check`` does.
    """
    from vmm.replay import Event

    # The table (scheduler.actions) says which actions take device bytes and which give them
    # back; this function only writes them down as requests.
    seq = schedule.sequence
    ledger = Ledger(seq, schedule.initial_resident)
    nbytes = ledger.nbytes
    events = [Event("alloc", v, nbytes[v], 0.0) for v in sorted(schedule.initial_resident)]
    for i in range(len(seq.functions)):
        t = float(i)
        for phase, acts in (("before", schedule.before[i]), ("during", None), ("after", schedule.after[i])):
            if acts is None:  # the function itself runs: it allocates what it creates
                events.extend(Event("alloc", v, nbytes[v], t) for v in ledger.run(i))
                continue
            for a in acts:
                eff = ledger.apply(a.op, a.var, i, phase, a.chain)
                if eff.device:
                    events.append(Event("alloc" if eff.device > 0 else "free", a.var, nbytes[a.var], t))
                if eff.needs_chain:   # the chain's temporaries, at their peak, while it runs
                    temps = ledger.chain.temporaries_bytes
                    if temps:
                        key = f"recompute {a.var} temporaries {phase} {i}"
                        events.append(Event("alloc", key, temps, t))
                        events.append(Event("free", key, 0, t))
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


def replay_allocator(schedule: Schedule, hw: "Hardware", allocator: str, chunk_bytes: int) -> tuple[int, bool, int | None]:
    """Run the step's allocation stream through an allocator model of ``hw.device_bytes``.

    Returns (peak reserved bytes, fits, first function that ran out or None). "Reserved" is
    the allocator's ``mapped_bytes``: segment bytes for the caching allocator, chunks under
    live allocations for virtual addressing (``vmm.replay.ReplayResult.peak_reserved_bytes``).
    """
    # vmm through its public API only, and only on this path: planning needs no allocator.
    import vmm
    from vmm.replay import replay

    events = allocation_events(schedule)
    # Mapping granularity: 2 MiB for CUDA VMM (cuMemGetAllocationGranularity on current
    # GPUs), the 4 KiB page for host chunks in front of a storage tier.
    granularity = (2 << 20) if hw.tier == "host" else 4096
    backend = vmm.SimBackend(granularity)
    if allocator == "caching":
        model = vmm.CachingAllocator(backend, capacity_bytes=hw.device_bytes)
        name = "caching"
    else:
        # ooc's allocator, as the runtime's device pools build it (and ``ooc frag`` replays
        # it): blocks 512-byte aligned on a GPU, page-aligned on a CPU; a plan's chunk-rounded
        # sizes bound what it maps (vmm.small_blocks: the bound).
        pool = vmm.ChunkPool(backend, chunk_bytes=chunk_bytes, capacity_bytes=hw.device_bytes)
        align = 512 if hw.tier == "host" else granularity
        model = vmm.SmallBlockAllocator(vmm.VirtualAllocator(pool), align=align)
        name = f"vmm-{chunk_bytes}"
    result = replay(events, model, name=name)
    if result.oom_index is None:
        return result.peak_reserved_bytes, True, None
    oom_function = int(events[result.oom_index].time)
    log.debug("%s on %s: out of memory at function %d (%d B requested)",
              name, hw.name, oom_function, result.oom_request)
    return result.peak_reserved_bytes, False, oom_function
