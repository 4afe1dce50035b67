"""The ``TorchDispatchMode`` that feeds the recorder every aten op of code it runs around
(``ooc.trace``'s step; usable around any code): the recorder's rules, plus function names
with module scopes, timing, a progress bar, and the op that failed."""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ooc.errors import OOCError
from ooc.record.op_schema import _OPS, op_info
from ooc.record.recorder import StepRecorder
from ooc.runtime.cuda_seam import keep_stream_busy
from scheduler.ir import Kind, VariableSequence


class TraceError(OOCError):
    """The training step could not be recorded (the message names the op that failed)."""


class Recorder(TorchDispatchMode):
    """The op-level recorder behind :func:`ooc.trace`, usable around any code.

    Register the storages that exist before the step (``register``), enter the recorder
    (``with rec:``) around the step, tell it which storages ended up as gradients
    (``mark``), and call ``sequence()``. ``saved_tensors_hooks()`` returns the pack/unpack
    pair that classifies saved storages as activations; ``phase(name)`` records where the
    forward, loss, backward and optimizer begin. ``scope`` (a string, or a zero-argument
    callable returning one) prefixes function names. The rules are
    ``ooc.record.recorder.StepRecorder``'s, the same the engine's recording step applies.
    """

    def __init__(self, *, measure: bool = False, device: torch.device | None = None,
                 progress: bool = False) -> None:
        super().__init__()
        self.steps = StepRecorder()
        self._stash: dict[int, torch.Tensor] = {}
        self.scope: str | Callable[[], str] = ""
        self.failed_at: tuple[int, str] | None = None
        # On a GPU an op is timed on the device: a pair of CUDA events around its kernels,
        # read once the step is over (``sequence``). A host clock around a synchronized op
        # would count the launch and the synchronization too, and stall the stream.
        self._events: list[tuple[int, Any, Any]] | None = [] if (
            measure and device is not None and device.type == "cuda") else None
        self._measure = measure
        self._progress = progress
        self._bar: Any = None

    @property
    def marks(self) -> dict[str, int]:
        return self.steps.marks

    def register(self, t: torch.Tensor, kind: Kind, name: str, *, live_in: bool = True,
                 live_out: bool = False) -> int | None:
        """Declare a storage that exists before the step; the first registration wins."""
        return self.steps.register(t, kind, name, live_in=live_in, live_out=live_out)

    def mark(self, t: torch.Tensor, kind: Kind, name: str, *, live_out: bool = False) -> None:
        """Classify a storage the step created (a gradient, replaced state) unless a
        registration already classified it."""
        self.steps.mark(t, kind, name, live_out=live_out)

    def phase(self, name: str) -> None:
        """Note that phase ``name`` (e.g. ``"backward"``) starts at the next function."""
        self.steps.phase(name)

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that note every storage autograd saves; the tensors go to a stash (not
        into the graph, which would make a reference cycle) and leave it when unpacked."""
        stash, saved, handles = self._stash, self.steps.saved, itertools.count()

        def pack(t: torch.Tensor) -> int:
            saved(t)
            handle = next(handles)
            stash[handle] = t
            return handle

        def unpack(handle: int) -> torch.Tensor:
            return stash.pop(handle)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def sequence(self, meta: dict[str, Any] | None = None) -> VariableSequence:
        """The recorded functions and variables (classification applied)."""
        if self._events:   # the ops' device times, read now that their kernels are done
            self._events[-1][2].synchronize()
            for index, start, end in self._events:
                self.steps.fsecs[index] = start.elapsed_time(end) / 1e3
            self._events.clear()
        return self.steps.sequence(meta)

    def __enter__(self) -> "Recorder":
        if self._progress:
            from tqdm import tqdm

            self._bar = tqdm(desc="tracing", unit=" ops", file=sys.stderr, delay=0.5,
                             mininterval=0.25, leave=False)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        info = _OPS.get(id(func))
        if info is None or info.func is not func:
            info = op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        index = len(self.steps.fname)
        seconds = None
        try:
            if self._events is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                keep_stream_busy()   # else the events time the host's launches too
                start.record()
                out = func(*args, **kwargs)
                end.record()
                self._events.append((index, start, end))
            elif self._measure:
                t0 = time.perf_counter()
                out = func(*args, **kwargs)
                seconds = time.perf_counter() - t0
            else:
                out = func(*args, **kwargs)
        except BaseException:
            self.failed_at = (index, info.name)
            raise
        scope = self.scope if isinstance(self.scope, str) else self.scope()
        self.steps.op(info, args, kwargs, out, f"{scope}:{info.name}" if scope else info.name,
                      seconds)
        if self._bar is not None and not index & 127:
            self._bar.update(128 if index else 1)
        return out
