"""What an engine changes outside itself so that its steps can run, and how it is undone.

A constructor changes nothing outside its object: making an ``OutOfCore`` and never stepping
it must leave the process, the model and the optimizer as they were. Three changes are
needed by steps, and each is made at the first step and undone by ``close()``, or when the
engine is garbage-collected without one:

- CPU: ooc's recycling allocator becomes PyTorch's CPU allocator (``cpu_allocator.acquire``;
  given back by ``relinquish`` when the last engine holding it lets go);
- CPU: glibc's mmap threshold is fixed so that freed tensors leave the process
  (``malloc.release_freed_memory``; ``keep_freed_memory`` puts it back, see ``malloc``), at
  1 MiB, where ooc's allocator takes over, or, under a budget for the whole step, at 128 KiB
  (``WHOLE_STEP_MMAP_THRESHOLD``);
- managed params, grads or optimizer state: the optimizer's ``foreach`` flag is set to False
  so that one op touches one parameter's tensors; the user's values come back, and while
  they are ours ``optimizer.state_dict()`` saves the user's (a checkpoint made during the run
  is the one a run without ooc makes).

The undo holds no strong reference to the engine, nor to the optimizer whose flags it
restores: the optimizer's hooks and param groups lead back to the engine, and a finalizer's
arguments live until it runs, so either would keep the engine from ever being collected.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ooc.host import cpu_allocator, malloc
from ooc.runtime.user_hooks import UserHook

log = logging.getLogger(__name__)

#: glibc's mmap threshold under a budget for the whole step. Tensors of 128 KiB to 1 MiB
#: (a small transformer's keys and values, most of its weights) left holes in glibc's heap as
#: they were freed, which the heap keeps until the step's end: a 2-layer Llama (AdamW, every
#: kind managed, 8 x 128 tokens) held 12 MiB of them at its peak, and its steps peaked at
#: 81-82 MiB of a 78 MiB step budget; 77 MiB at this threshold (and no slower: 254-262 ms a
#: step at 1 MiB, 225-232 ms here). Mapped and unmapped at each allocation, they take fresh
#: pages from the kernel, which the budget is worth.
WHOLE_STEP_MMAP_THRESHOLD = 128 << 10


class ProcessEffects:
    """The changes one engine made, applied once and undone once (idempotent both ways)."""

    def __init__(self, device_type: str, optimizer: torch.optim.Optimizer | None,
                 per_parameter: bool, whole_step: bool = False) -> None:
        self.device_type = device_type   # glibc's mmap threshold: where ooc's allocator takes over, or lower
        self._threshold = WHOLE_STEP_MMAP_THRESHOLD if whole_step else cpu_allocator.LARGE
        self._optimizer = weakref.ref(optimizer) if per_parameter else None
        self.applied = False
        self.allocator = False     # this engine holds ooc's CPU allocator
        self._foreach: list[tuple[int, Any]] = []   # (index of a param group, its value before)
        self._saving_hook: Any = None   # optimizer.state_dict() post-hook while the flags are ours
        self._lock = threading.Lock()

    def apply(self) -> None:
        """Make the changes (the first call only)."""
        with self._lock:
            if not self.applied:
                self.applied = True
                if self.device_type == "cpu":
                    malloc.release_freed_memory(self._threshold)
                    self.allocator = cpu_allocator.acquire()
                optimizer = self._optimizer() if self._optimizer is not None else None
                if optimizer is not None:
                    self._per_parameter_optimizer(optimizer)

    def undo(self) -> None:
        """Put back what ``apply`` changed (a call before it, or a second one, does nothing)."""
        with self._lock:
            if not self.applied:
                return
            self.applied = False
            optimizer = self._optimizer() if self._optimizer is not None else None
            if self._saving_hook is not None:
                self._saving_hook.remove()
                self._saving_hook = None
            if optimizer is not None:
                groups = optimizer.param_groups
                for k, old in self._foreach:
                    if k < len(groups):
                        groups[k]["foreach"] = old
            self._foreach.clear()
            if self.device_type == "cpu":
                if self.allocator:
                    cpu_allocator.release()
                    cpu_allocator.relinquish()
                    self.allocator = False
                malloc.keep_freed_memory()

    def _per_parameter_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        multi_tensor = False
        for k, group in enumerate(optimizer.param_groups):   # one op touches one parameter's tensors
            if "foreach" in group:
                self._foreach.append((k, group["foreach"]))
                multi_tensor |= group["foreach"] is not False
                group["foreach"] = False
        self._saving_hook = optimizer.register_state_dict_post_hook(UserHook(self._saved_as_the_user_set))
        if multi_tensor and self.device_type == "cuda":
            # Measured on an H100: Adam's multi-tensor update (PyTorch's default on CUDA)
            # rounds differently from its per-parameter one; SGD's does not.
            log.warning("managed params/grads/optimizer state: the optimizer now runs per "
                        "parameter (foreach=False); on a GPU its results are bitwise those "
                        "of in-core training with foreach=False, which for Adam/AdamW differ "
                        "in rounding from PyTorch's default multi-tensor update")

    def _saved_as_the_user_set(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        """``optimizer.state_dict()`` post-hook: each param group's ``foreach`` as the user set
        it. The False is the steps' need, not training state: saved, it made a Trainer's
        ``optimizer.pt`` differ from a run without ooc, and a run loading it later would keep
        the per-parameter update (on a GPU, Adam's other rounding) with no engine around."""
        groups = state_dict["param_groups"]   # fresh dicts: the optimizer's own are untouched
        for k, old in self._foreach:
            if k < len(groups):
                groups[k]["foreach"] = old
        return state_dict
