"""Names for the runtime's own work in other people's profilers.

Swap-ins, swap-outs and waits show up as ``ooc.swap_in <tensor>`` ranges in
``torch.profiler`` (via ``record_function``) and in Nsight Systems (via ``nvtx``, when the
optional package is installed). Both are skipped when no profiler listens: a
``record_function`` costs an op dispatch, too much for every transfer of every step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

try:  # optional: the [cuda] extra
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None


_NONE = contextlib.nullcontext()


def label(*parts: object) -> contextlib.AbstractContextManager:
    """A profiler range named ``parts`` joined (``str`` of each) around the block, when a
    profiler is recording (none: a shared empty context, no generator and no name made; every
    transfer of every step form is labelled)."""
    profiling = torch.autograd.profiler._is_profiler_enabled
    if not profiling and _nvtx is None:
        return _NONE
    return _ranges("".join(map(str, parts)), profiling)


@contextlib.contextmanager
def _ranges(name: str, profiling: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if profiling:
            stack.enter_context(torch.profiler.record_function(name))
        if _nvtx is not None:
            stack.enter_context(_nvtx.annotate(name, domain="ooc"))
        yield
