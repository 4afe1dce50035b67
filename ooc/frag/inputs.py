"""Read what users bring to ``ooc frag`` into one list of ``vmm.replay.Event``.

Three inputs, recognised by their first bytes (then by extension):

- a PyTorch memory snapshot, the pickle ``torch.cuda.memory._dump_snapshot`` writes
  (loaded with :mod:`ooc.frag.safe_pickle`, never with plain pickle);
- an ooc trace (``ooc.sequence``) or plan (``ooc.schedule``) JSON file;
- a CSV with a header line naming the columns ``time, action, address, bytes``.

How each input becomes events, and its own errors: :mod:`ooc.frag.snapshot_input` (the
snapshot's rules), :mod:`ooc.frag.csv_input`, :mod:`ooc.frag.ooc_file_input`; what they all
return: :mod:`ooc.frag.trace_data`. This module recognises the input and dispatches.
"""

from __future__ import annotations

import os
from typing import Callable

from ooc.frag.csv_input import load_csv
from ooc.frag.ooc_file_input import load_ooc_json, sequence_events
from ooc.frag.snapshot_input import load_snapshot, snapshot_to_trace
from ooc.frag.trace_data import FragInputError, OomMarker, Recorded, Trace, gc_paused

__all__ = ["gc_paused", "FragInputError", "OomMarker", "Recorded", "Trace", "load", "load_snapshot",
           "snapshot_to_trace", "load_csv", "load_ooc_json", "sequence_events"]


def load(path: str | os.PathLike[str], *, device: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> Trace:
    """Read ``path`` (snapshot, ooc JSON or CSV; see the module docstring) into a Trace.

    ``device`` picks the device of a multi-device snapshot. ``progress(done, total)`` is
    called with bytes read while a snapshot is unpickled (large ones take seconds).
    """
    with gc_paused():
        return _load(os.fspath(path), device, progress)


def _load(path: str, device: int | None, progress: Callable[[int, int], None] | None) -> Trace:
    name = os.path.basename(path)
    with open(path, "rb") as fh:
        head = fh.read(64)
    stripped = head.lstrip()
    ext = os.path.splitext(path)[1].lower()
    if head[:1] == b"\x80" or ext in (".pickle", ".pkl", ".pck"):
        return snapshot_to_trace(load_snapshot(path, progress=progress), name=name, where=path,
                                 device=device)
    if stripped[:1] in (b"{", b"[") or ext == ".json":
        return load_ooc_json(path)
    return load_csv(path)
