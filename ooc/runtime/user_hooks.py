"""The hooks an engine puts on the user's model, parameters and optimizer, as copies see them.

Users copy a model the engine manages: ``copy.deepcopy(model)`` for an EMA teacher,
``torch.optim.swa_utils.AveragedModel(model)`` and timm's ``ModelEmaV2`` (which deep-copy),
``torch.save(model)`` of the whole module. A module's hooks are in its ``__dict__``, so a copy
takes them along: a deep copy of a bound method copies its object, the whole engine (its locks
refused: ``TypeError: cannot pickle '_thread.lock' object``), and a closure cannot be pickled
at all. The copy is not the engine's: it needs none of them, and one that did run would act on
the original's steps (a forward of the copy taken for the model's). So each hook is a
:class:`UserHook`, which a copy or a pickle turns into :func:`inert`: the copy has plain
PyTorch semantics, as in core. (Loading a pickled whole model needs ooc importable, for
``inert``; a ``state_dict`` needs nothing.)
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["UserHook", "inert"]


def inert(*args: Any, **kwargs: Any) -> None:
    """What an engine's hook becomes in a copy of the object it was on: nothing (``None``
    leaves a hook's arguments and results as they were)."""
    return None


def _inert() -> Callable[..., None]:
    return inert


class UserHook:
    """``fn``, registered as a hook on an object of the user's; a copy of that object
    (``copy.deepcopy``, pickling) gets :func:`inert` in its place."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return _inert, ()

    def __repr__(self) -> str:
        return f"UserHook({self.fn!r})"
