"""What every input of ``ooc frag`` becomes: a :class:`Trace` of replayable events with what
the input says about the run (recorded OOMs, the recorded allocator, the device memory), and
:class:`FragInputError` for an input that cannot be read.

Apart from the readers (:mod:`ooc.frag.snapshot_input`, :mod:`ooc.frag.csv_input`,
:mod:`ooc.frag.ooc_file_input`) so that the analysis, the plot and the export depend on the
result only, not on how each format is parsed.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Iterator

from vmm.errors import OOCError
from vmm.replay import Event

__all__ = ["gc_paused", "FragInputError", "OomMarker", "Recorded", "Trace"]


class FragInputError(OOCError, ValueError):
    """An input ``ooc frag`` cannot read; the message names the file and where in it."""


@dataclass(frozen=True, slots=True)
class OomMarker:
    """A recorded out-of-memory: the failed request is replayed as ``events[index]``."""

    index: int
    nbytes: int
    device_free: int | None = None
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the recorded allocator itself did, when the input says (snapshots only)."""

    peak_reserved_bytes: int
    segment_allocs: int
    segment_frees: int
    # (event index, reserved bytes) after each change, for the plot.
    reserved_points: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Trace:
    """An input read into replayable events plus what it says about the run."""

    name: str
    kind: str  # "snapshot", "csv", "sequence" or "schedule"
    events: list[Event]
    ooms: tuple[OomMarker, ...] = ()
    device_memory: int | None = None
    device_memory_source: str = ""
    device: int | None = None
    recorded: Recorded | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Key -> what it is ("conv1.out (variable 12, activation)"), where the input says.
    labels: dict[Any, str] = field(default_factory=dict)
    # Recorded with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: its segments say
    # ``is_expandable`` or its trace maps pages (``segment_map``).
    expandable: bool = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit).

    Loading a snapshot builds millions of dicts and events that all stay alive; every
    collection the allocation count triggers would walk all of them again (4x slower loads
    here). Reference counting still frees everything that is not in a cycle.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 120 else text[:117] + "..."


def _tname(x: Any) -> str:
    return "missing" if x is None else type(x).__name__
