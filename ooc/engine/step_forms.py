"""The form a running step takes, and changing it before the step has done anything.

A step runs per op (a ``Stepper`` that every aten op reaches through ``OpMode``, the engine's
``TorchDispatchMode``) or hook-driven (an ``AnchoredStep``, plain or anchored, watched by
autograd's saved-tensor hooks alone; ``ooc/runtime/step_protocol.py`` lists the forms). ``StepForm`` is what the
running step has pushed onto PyTorch's two stacks (the dispatch modes, the saved-tensor
hooks) and which step object they reach.

Why it can change: the engine keeps a plan per step shape (``plan_cache.py``), and a step's
shape shows only when the model's forward starts (its inputs), after ``engine.step()`` began
with a guess. If nothing of the step has touched managed memory by then (no tensor saved, no
managed tensor made or used, no buffer touched, no update begun: views of the batch such as
``x[:, :-1]`` may have run, and the new plan must begin with the same ops), the step switches
to the plan of the shape it has, in that plan's form: the new step object's hooks replace the
old one's (ours are innermost: the step refuses other hooks entered inside it), and the mode
comes off (a hook-driven step: only when it is on top of the stack) or goes on (only
when no mode was entered since the step began, so that it sits where it would have from the
start). Otherwise the step keeps the form it has and runs its guess, which diverges at its
first differing op as any step that leaves its plan does.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Hashable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from ooc.runtime.composition import top_saved_tensors_hooks
from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.stepper import Stepper

UNSEEN = object()   # a step's shape before its model's forward began
SIZE_STEP = 2       # steps whose inputs' elements differ by more run plans of their own (``same_size``)


class OpMode(TorchDispatchMode):
    """Routes every aten op of the step through the stepper."""

    def __init__(self, stepper: Stepper) -> None:
        super().__init__()
        self.stepper = stepper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.stepper.on_op(func, args, kwargs or {})


def shape_of(model: torch.nn.Module, args: tuple, kwargs: dict, before: tuple[str, ...] = ()) -> tuple:
    """A step's shape: the shape and dtype of each tensor the model's forward is called with,
    in order (positional, then keyword arguments, nested containers flattened), whether
    the model is in training mode and autograd records, and the names of the ops the step ran
    before its forward (``before``). An evaluation step inside ``engine.step()``
    (``model.eval()``, ``torch.no_grad()``) runs other ops on the same batch: keyed by the
    batch alone, training and evaluation steps in turn replaced each other's plan at every
    step, and every step ran on demand. So did steps whose batch is made in the step in one of
    a few ways (timm's ``Mixup`` switching between mixup and cutmix, a random flip of the
    batch): a plan begins with its step's ops, and each way replaced the other's plan (every
    kind managed, a timm ResNet-18 with mixup and cutmix: 12 of 30 steps on demand)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return (tuple([(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]),
            model.training, torch.is_grad_enabled(), before)


def same_size(a: Any, b: Any) -> bool:
    """Whether steps of shapes ``a`` and ``b`` (``shape_of``) may run one plan whose sizes vary
    (``scheduler/widening.py``, ``PlanCache.kin``): of the same kind (``same_kind``) and with
    as many elements in all to within a step of ``SIZE_STEP`` (fixed steps: a shape's class
    is its own). Why: such a plan holds each activation at the largest its family made, and a
    step much smaller than that moves and recomputes what would fit. A GPT-2 (2 x 256 wide,
    batch 8) on lengths drawn from 32-256 at 40 MiB, every length in one plan (at 256 tokens'
    sizes), ran its last 60 of 120 steps in 1.42-1.70x their time in core; planned by size,
    1.09x (docs/guide/steps.md)."""
    return same_kind(a, b) and size_class(a) == size_class(b)


def same_kind(a: Any, b: Any) -> bool:
    """Whether shapes ``a`` and ``b`` are the same tensors but for their sizes (as many, each
    of the same rank and dtype), in the same modes."""
    if not (isinstance(a, tuple) and isinstance(b, tuple)) or a[1:] != b[1:] or len(a[0]) != len(b[0]):
        return False
    return all(len(x) == len(y) and dx == dy for (x, dx), (y, dy) in zip(a[0], b[0]))


def shape_elements(shape: tuple) -> int:
    """The elements of every tensor of a step's shape."""
    return sum(math.prod(dims) for dims, _ in shape[0])


def size_class(shape: tuple) -> int:
    """The step of ``SIZE_STEP`` a shape's elements are in (``same_size``)."""
    return int(math.log(max(shape_elements(shape), 1)) / math.log(SIZE_STEP))


class StepForm:
    """The running step's object (``st``) and what it pushed: its saved-tensor hooks (with
    activations managed) and, per op, ``OpMode``. ``start`` is the state the step started in
    (``_start_key``), ``shape`` what its forward showed (``UNSEEN`` before), and
    ``provisional`` whether it runs per op only to wait for its shape (its start has plans
    for several shapes: a plain or anchored form is taken up once the shape is known)."""

    def __init__(self, start: Hashable, st: Stepper | AnchoredStep, *, activations: bool,
                 provisional: bool) -> None:
        self.start, self.st = start, st
        self.shape: Any = UNSEEN
        self.provisional = provisional
        self.activations = activations
        self.hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.mode: OpMode | None = None
        self.depth = 0   # the dispatch modes in force when the step began

    def __enter__(self) -> StepForm:
        self.depth = torch._C._len_torch_dispatch_stack()
        if self.activations:
            self.hooks = self.st.saved_tensors_hooks()
            self.hooks.__enter__()
        try:
            if isinstance(self.st, Stepper):
                self._push(self.st)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.mode is not None:
                self.mode, mode = None, self.mode
                mode.__exit__(None, None, None)
        finally:
            if self.hooks is not None:
                self.hooks, hooks = None, self.hooks
                hooks.__exit__()

    def quiet(self) -> bool:
        """Nothing of the step touched managed memory yet: a hook-driven step saved no tensor,
        a per-op step's ops (views of the batch, say) used no managed tensor; no update began
        (``Step.quiet``)."""
        return self.st.quiet()

    def innermost(self) -> bool:
        """Our saved-tensor hooks are the innermost (none was entered inside the step)."""
        if self.hooks is None or top_saved_tensors_hooks is None:
            return self.hooks is None
        top = top_saved_tensors_hooks(False)
        return top is not None and top[0] is self.hooks.pack_hook

    def can_drop_mode(self) -> bool:
        """A hook-driven step can replace this one: no mode, or ours on top of the stack."""
        return self.mode is None or _get_current_dispatch_mode() is self.mode

    def can_run_per_op(self) -> bool:
        """A per-op step can replace this one: the mode is on, or can go where it would have
        been from the step's start (no mode was entered inside the step since)."""
        return self.mode is not None or torch._C._len_torch_dispatch_stack() == self.depth

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Our mode off (it is on top: ``can_drop_mode``) while the next step object is made:
        what that runs (``_reconcile``'s transfers, a rollback's copies of the buffers) is not
        an op of the step."""
        mode = self.mode if _get_current_dispatch_mode() is self.mode else None
        if mode is not None:
            mode.__exit__(None, None, None)
        try:
            yield
        finally:
            if mode is not None:
                mode.__enter__()

    def switch(self, new: Stepper | AnchoredStep) -> None:
        """Run ``new`` instead of ``st`` (``quiet``, ``innermost`` and ``can_drop_mode`` or
        ``can_run_per_op`` checked by the caller, as ``new`` needs); a per-op ``new`` takes
        over after the ops ``st`` ran (``Stepper.resume``)."""
        if self.hooks is not None:
            self.hooks.__exit__()
            self.hooks = new.saved_tensors_hooks()
            self.hooks.__enter__()
        if isinstance(new, Stepper):
            if isinstance(self.st, Stepper):
                new.resume(self.st)
            if self.mode is None:
                self._push(new)
            else:
                self.mode.stepper = new
        elif self.mode is not None:
            self.mode, mode = None, self.mode
            mode.__exit__(None, None, None)
        self.st = new

    def _push(self, st: Stepper) -> None:
        mode = OpMode(st)
        mode.__enter__()
        self.mode = mode
