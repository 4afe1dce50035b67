"""The Python numbers a model's forwards are passed, call by call (``model_numbers.py`` has
the numbers the model holds, and why a template needs them watched).

A number passed to a module's forward (``model(x, tau)``, ``block(h, scale=s)``, or one level
inside an argument: ``model(x, {"tau": tau})``) reaches its ops where no hook sees it. The
capturing step puts a forward pre-hook on every module and notes each number each call took
(``Forwards.noting``); a hook-driven step hooks only the modules that took one
(``Forwards.comparing``). A module's hook runs before any op of its forward, so a step whose
call differs leaves its plan before a discard could replay one. The training loop's own code
(a loss's margin) takes no hook: an op that ran outside every forward and took such a number
gives no template (``loose_numbers``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from ooc.runtime.model_numbers import SETTINGS, VALUES, is_number, plain_numbers, same
from ooc.runtime.views import View

# (id(module), call, position or keyword) -> (module, name, value)
Passed = dict[tuple[int, int, Any], tuple[torch.nn.Module, str, object]]


def _inside(v: Any) -> Iterable[tuple[Any, object]]:
    """The numbers one level inside a forward's argument: a tuple's or list's items, a dict's
    or a plain object's (``plain_numbers``)."""
    if type(v) is tuple or type(v) is list:
        return [(i, x) for i, x in enumerate(v) if is_number(x)] if len(v) <= SETTINGS else ()
    return plain_numbers(v)


class Forwards:
    """The model's forwards in one step: the numbers each call took, a module's calls
    counted and a number keyed by (module, call, position or keyword); and how deep in them
    the step is (``depth``, 0: in the training loop's code). ``want`` None: the numbers are
    noted (``passed``, the capturing step's); else each is compared with ``want``'s, and the
    first that differs is named (``changed``). ``close`` takes the hooks off."""

    def __init__(self, modules: Iterable[tuple[str, torch.nn.Module]], want: Passed | None = None,
                 deep: bool = False) -> None:
        self.want = want
        self.passed: Passed = {}
        self.calls: dict[int, int] = {}
        self.changed: str | None = None
        self.deep, self.depth = deep, 0
        self.handles: list[Any] = []
        for name, m in _once(modules):   # first, before a hook that runs ops (a parametrization's)
            if isinstance(m, torch.jit.ScriptModule):
                continue   # takes no hook (its ops run inside its parent's forward, counted there)
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._called, name),
                                                            with_kwargs=True, prepend=True))
            if deep:
                self.handles.append(m.register_forward_hook(self._returned, always_call=True))

    @staticmethod
    def noting(model: torch.nn.Module) -> Forwards:
        """Every module's calls noted, and how deep in them each op runs (the capturing step's:
        a per-op step, which can afford two hooks per module)."""
        return Forwards(model.named_modules(), deep=True)

    @staticmethod
    def comparing(want: Passed) -> Forwards | None:
        """Hooks on the modules that took a number in ``want``'s step only (None: no module
        did): a hook-driven step makes no Python call per module otherwise."""
        modules = {id(m): (name, m) for m, name, _ in want.values()}
        return Forwards(modules.values(), want) if modules else None

    def _called(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.deep:
            self.depth += 1
        n = self.calls.get(id(module), 0)
        self.calls[id(module)] = n + 1
        for key, v in (*enumerate(args), *kwargs.items()):
            if is_number(v):
                self._took(module, name, n, key, v)
            elif v is not None and not isinstance(v, torch.Tensor):
                for sub, x in _inside(v):   # an options dict, a tuple, a dataclass passed in
                    self._took(module, name, n, (key, sub), x)

    def _took(self, module: torch.nn.Module, name: str, n: int, key: Any, v: object) -> None:
        """Call ``n`` of ``module`` took number ``v`` at ``key`` (a position or keyword, or
        (one, and the key inside it)): noted, or compared with ``want``'s."""
        if self.want is None:
            self.passed[(id(module), n, key)] = (module, name, v)
        elif self.changed is None:
            was = self.want.get((id(module), n, key))
            if was is not None and not same(was[2], v):
                at = f"{key[0]!r}'s {key[1]!r}" if type(key) is tuple else repr(key)
                self.changed = (f"the forward of {name or 'the model'} (call {n}) took {v!r} as its argument "
                                f"{at}, the templates' step {was[2]!r}")

    def _returned(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        self.depth -= 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def loose_numbers(func: Any, args: tuple, kwargs: dict) -> list:
    """The numbers ``func`` took where its schema takes a number or a tensor (a value its
    gradient may not keep: ``x + 0.5``, a ``masked_fill``'s value, a dropout's ``p``), not a
    dimension, a size or a flag. An op of the training loop's code that took one gives no
    template (``TemplateCapture.captured``): no hook sees where the number comes from (a
    margin annealed per epoch in ``relu(margin + d_pos - d_neg)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return [v for v in (*args, *kwargs.values()) if type(v) in VALUES]
    return [v for a, v in (*zip(schema.arguments, args), *((a, kwargs[a.name]) for a in schema.arguments
                                                            if a.name in kwargs))
            if type(v) in VALUES and "int" not in str(a.type)]


def replays_a_number(values: Iterable[Any]) -> bool:
    """Whether a template's numbers (``templates._numbers``: its arguments that are no tensor,
    and its views of tensors) hold one a number of the model could have given: an int or a
    float (a size, a dimension too), or a view at an offset (``template_slots.part_of`` says
    which views of the slots are parts)."""
    return any(type(x) in VALUES or isinstance(x, View) and x.offset != 0 for x in values)


def _once(modules: Iterable[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """Each module once (a shared one under its first name)."""
    seen: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, m in modules:
        seen.setdefault(id(m), (name, m))
    return list(seen.values())
