"""The Python numbers a model's forward reads that no autograd node keeps.

A template replays its op's numbers as captured (``templates.py``), and a hook-driven step sees
no op: a number that reaches an op no node records (the ``0.5`` of ``x + 0.5``: an addition's
gradient does not need it; a CPU dropout's ``bernoulli_(1 - p)``) and changes once the form
settled (at an epoch's end) was replayed stale, and every later step's parameters were wrong.
Such a number reaches the forward from where the model's code reads it; these places are
watched here, read where the capturing step read them and compared at each hook-driven step:

- ``held``: the numbers the model's modules hold (``nn.Dropout.p``, ``self.tau``), those of
  the plain objects, dicts and lists they hold, one level down (a ``config`` whose attribute the
  forward reads, Lightning's ``hparams``), and those the code of the modules' own classes
  reaches by name (``_code_numbers``): a class attribute, a global or closed-over variable
  (``x + NOISE`` in a script's model, annealed with ``global NOISE``), a global object's or
  Python module's attribute (``cfg.SCALE``), and those of the helper functions it calls;
- the numbers passed to each module's forward, call by call (``model(x, tau)``): the hooks of
  ``forward_numbers.py``, which also keep the training loop's own numbers out of templates.

No function after a forward read a number out of a tensor gets a template that replays one
(``TemplateCapture.read_out``). Not seen: a number reached through more than ``HELPERS``
calls, or held deeper than one plain object, dict or list below a module (docs/guide/steps.md
says what to do).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch


# the numbers a forward may take or a config hold for an op (``is_number``; a module's own
# flags, ``training``, are watched too: ``held``): a flag passed or kept there (teacher forcing
# on or off per batch, ``use_cache``) steers the forward's branches, which change the ops and
# saves that the hooks check, not an op's number (watched, each change of a flag chosen per
# batch left the plan)
VALUES = (int, float)
_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)   # what a module may hold to call
SETTINGS = 512   # a plain object or dict with more entries than this is data, not settings
HELPERS = 2      # how many calls deep ``_code_numbers`` follows the functions a forward's code names

# (id(holder), attribute) -> (holder, attribute, name, value): a number of a module, of a plain
# object, dict or list it holds, or of a global; or such an object, or a function, as itself
Held = dict[tuple[int, Any], tuple[Any, Any, str, object]]


def read(holder: Any, attr: Any) -> object:
    """``holder``'s number at ``attr`` now (an item of a dict or list; None where it is gone)."""
    if type(holder) is list:
        return holder[attr] if type(attr) is int and attr < len(holder) else None
    if isinstance(holder, dict):
        return holder.get(attr)
    try:
        return getattr(holder, attr, None)
    except ValueError:   # (an empty cell)
        return None


def is_number(v: object) -> bool:
    """Whether ``v`` is a number an op may take: an int or a float, or NumPy's (a temperature
    annealed with ``np.exp``, a ``np.float64``: not ``float``'s type, and not seen until
    2026-12-01), not a flag."""
    return type(v) in VALUES or type(v).__module__ == "numpy" and isinstance(v, numbers.Real)


def held(model: torch.nn.Module) -> Held:
    """Every number the model's modules hold, those of the plain objects, dicts and lists they
    hold (one level: an HF ``config``, Lightning's ``hparams``), and those their classes' code
    reaches by name (``_code_numbers``), each read as it is now. A function a module holds
    (``self.fn = lambda h: h + 0.5``, a ``partial``) is watched as itself: another one put
    there (at an epoch) runs ops with other numbers (stale until 2026-12-01); its code is
    walked as the classes' is, and so is that of the forward hooks on the modules (a user's
    ``o + SHIFT``)."""
    out: Held = {}
    functions: list[Any] = []
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            functions.append(_called(hook))   # (a user's runs ops)
        for attr, v in vars(module).items():
            if attr[:1] == "_":
                continue
            if type(v) is bool or is_number(v) or _numbers_tuple(v):
                out.setdefault((id(module), attr), (module, attr, prefix + attr, v))
            elif isinstance(v, _FUNCTIONS):
                out.setdefault((id(module), attr), (module, attr, prefix + attr, v))
                functions.append(_called(v))
            else:   # (each number once: a config every layer holds)
                for h, a, name, x in _plain_entries(module, attr, prefix + attr, v):
                    out.setdefault((id(h), a), (h, a, name, x))
    for holder, attr, name, v in _code_numbers(model, functions):
        out.setdefault((id(holder), attr), (holder, attr, name, v))
    return out


def _called(f: Any) -> Any:
    """The function a bound method or a ``partial`` calls (``f`` itself else)."""
    return getattr(f, "__func__", getattr(f, "func", f))


def _numbers_tuple(v: object) -> bool:
    """Whether ``v`` is a tuple of numbers (``self.rates = (...)``: watched as one value)."""
    return type(v) is tuple and 0 < len(v) <= SETTINGS and all(map(is_number, v))


def _code_numbers(model: torch.nn.Module,
                  functions: Iterable[Any] = ()) -> Iterable[tuple[Any, str, str, object]]:
    """The ints and floats that the code of the modules' own classes (not PyTorch's) reaches
    by name (holder, name, what to call it, value): their classes' attributes (``self.scale``
    set on the class), and the globals and closed-over variables their functions name, and
    what those hold (``_reached``: a module's attribute, ``cfg.SCALE``; a plain object's, a
    global ``STATE.shift``), through the helper functions they call, ``HELPERS`` calls deep
    (``helpers.shift(h)`` adding its module's ``SCALE``); and so for ``functions`` (those the
    modules hold)."""
    todo = [(f, 0) for f in functions if isinstance(f, types.FunctionType)]
    for cls in dict.fromkeys(type(m) for m in model.modules()):   # (in the model's order: the names given)
        for c in cls.__mro__:
            if _pytorchs(c) or c is object:
                continue
            for attr, v in vars(c).items():
                if is_number(v) and attr[:1] != "_":
                    yield c, attr, f"class attribute {c.__qualname__}.{attr}", v
                elif isinstance(f := getattr(v, "__func__", getattr(v, "fget", v)), types.FunctionType):
                    todo.append((f, 0))   # (a static or class method's, a property's)
    seen: dict[int, int] = {}   # id(function) -> the fewest calls deep it was walked at
    while todo:
        f, depth = todo.pop()
        if seen.get(id(f), HELPERS + 1) <= depth or _pytorchs(f):
            continue   # (one met deeper first is walked again: its helpers are in reach now)
        seen[id(f)] = depth
        names, g, calls = _names(f.__code__), f.__globals__, []
        for name in names:
            if name in g:
                yield from _reached(g, name, names, f"global {f.__module__}.{name}", calls)
        for var, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            with contextlib.suppress(ValueError):   # (an empty cell)
                yield from _reached(cell, "cell_contents", names, f"{f.__qualname__}'s {var}", calls)
        if depth < HELPERS:
            todo.extend((h, depth + 1) for h in calls)


def _reached(holder: Any, attr: str, names: set[str], label: str,
             calls: list[types.FunctionType]) -> Iterable[tuple[Any, str, str, object]]:
    """The numbers a function's code reaches through the global or closed-over ``holder[attr]``
    (the functions it may call go to ``calls``): the value itself, the attributes a module or
    class holds under a name the code reads (``cfg.SCALE``; read from its ``__dict__``: a lazy
    module's ``__getattr__`` imports), or a plain object's or dict's (``plain_numbers``)."""
    v = holder.get(attr) if isinstance(holder, dict) else getattr(holder, attr)
    if is_number(v):
        yield holder, attr, label, v
    elif isinstance(v, types.FunctionType):
        calls.append(v)
    elif isinstance(v, (types.ModuleType, type)):
        if _pytorchs(v):
            return
        space = vars(v)
        for name in names:
            x = space.get(name)
            if is_number(x):   # (a module's dict holds it as the globals of its functions do)
                yield space if isinstance(v, types.ModuleType) else v, name, f"{label}.{name}", x
            elif isinstance(x, types.FunctionType):
                calls.append(x)
    else:
        yield from _plain_entries(holder, attr, label, v)


def _plain_entries(holder: Any, attr: Any, label: str, v: Any) -> list[tuple[Any, Any, str, object]]:
    """The entries a plain object, dict or list ``v`` at ``holder``'s ``attr`` gives: each of its
    numbers (``plain_numbers``), and the object itself where it holds one: another put in its
    place (a config the loop makes anew, a global rebound to a new one) is compared by its
    numbers (``same``)."""
    inside = plain_numbers(v)
    if not inside:
        return []
    return [(holder, attr, label, v), *((v, sub, f"{label}.{sub}", x) for sub, x in inside)]


def _pytorchs(x: Any) -> bool:
    """Whether ``x`` (a class, function or Python module) is PyTorch's own, or ooc's (its hooks
    on the model's modules)."""
    name = x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", None) or ""
    return name in ("torch", "ooc") or name.startswith(("torch.", "ooc."))


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code reads, its lambdas' and comprehensions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def plain_numbers(v: Any) -> Iterable[tuple[Any, object]]:
    """The numbers of a plain object, dict or list (by index: per-layer rates ``self.rates[i]``):
    not a module, tensor, function or class (whose attributes are not what a forward reads as
    data)."""
    if isinstance(v, dict):
        items = v.items()
    elif type(v) is list:
        return list(enumerate(v)) if len(v) <= SETTINGS and all(map(is_number, v)) else ()
    elif isinstance(v, (torch.nn.Module, torch.Tensor, type)) or callable(v) or not hasattr(v, "__dict__"):
        return ()
    else:
        items = vars(v).items()
    if len(items) > SETTINGS:
        return ()   # a table (a vocabulary), not settings
    return [(k, x) for k, x in items if type(k) is str and k[:1] not in ("_", "") and is_number(x)]


def reread(numbers: Held) -> Held:
    """``numbers`` read again (the capturing step reads them at its first save, after what the
    loop set in the step)."""
    return {key: (h, attr, name, read(h, attr)) for key, (h, attr, name, _) in numbers.items()}


def same(a: object, b: object) -> bool:
    """Whether two numbers are one (``True`` is not ``1``; a NaN is itself), or two functions
    a module held do the same: one code closed over the same numbers and objects (a loop that
    makes ``lambda h: h + s`` at every step), a ``partial`` of one function with the same, or
    two plain objects, dicts or lists of the same numbers (a config the loop makes anew)."""
    if type(a) is not type(b):
        return False
    if type(a) in VALUES:
        return a == b or a != a and b != b
    if type(a) is types.FunctionType:
        return (a.__code__ is b.__code__ and _alike(a.__defaults__, b.__defaults__)
                and _alike(_contents(a), _contents(b)))
    if type(a) is functools.partial:
        return (a.func is b.func and _alike(a.args, b.args) and a.keywords.keys() == b.keywords.keys()
                and _alike(tuple(a.keywords.values()), tuple(b.keywords.values())))
    if _plain(a):
        return _differs(a, b) is None
    return a == b or a != a and b != b


def _plain(v: object) -> bool:
    """Whether ``v`` is a plain object, dict or list (whose numbers ``plain_numbers`` reads)."""
    return isinstance(v, (dict, list)) or (hasattr(v, "__dict__") and not callable(v)
                                           and not isinstance(v, (torch.nn.Module, torch.Tensor, type)))


def _differs(a: object, b: object) -> tuple[Any, object, object] | None:
    """The first number two plain objects hold otherwise: (its key, ``a``'s, ``b``'s)."""
    x, y = dict(plain_numbers(a)), dict(plain_numbers(b))
    for key in (*x, *(k for k in y if k not in x)):
        if not same(x.get(key), y.get(key)):
            return key, x.get(key), y.get(key)
    return None


def _alike(xs: tuple | None, ys: tuple | None) -> bool:
    """Whether two functions' defaults, closed-over values or bound arguments are the same:
    each number by value, anything else as itself (a tensor's ``==`` is no answer)."""
    if xs is None or ys is None:
        return xs is ys
    return len(xs) == len(ys) and all(x is y or is_number(x) and same(x, y) for x, y in zip(xs, ys))


def _contents(f: types.FunctionType) -> tuple:
    """What ``f`` closed over (an empty cell as itself)."""
    out = []
    for cell in f.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            out.append(cell)
    return tuple(out)


def first_change(numbers: Held) -> str | None:
    """The first number held elsewhere now than ``numbers`` say, named (None: none). Read at
    each hook-driven step: a 32-layer Llama's code reaches 1,372 (~160 us here)."""
    for h, attr, name, v in numbers.values():
        try:   # (``read``, inline: a call per number)
            now = h.get(attr) if isinstance(h, dict) else getattr(h, attr, None)
        except (TypeError, ValueError):   # a list's item, an emptied cell
            now = read(h, attr)
        if now is not v and not same(now, v):   # (the same object, mostly: no call)
            if _plain(now) and _plain(v) and (d := _differs(now, v)) is not None:   # (another config object)
                name, now, v = f"{name}.{d[0]}", d[1], d[2]
            return f"{name} is {now!r}, the templates' step ran with {v!r}"
    return None


def changed_since(now: Mapping, before: Mapping) -> list:
    """The keys of ``now`` whose number ``before`` (a capture of an earlier step) had otherwise:
    a counter the model keeps, or a step's index passed to it, which are not compared (a
    function whose op read one is no template: ``Templates.ready``)."""
    return [key for key, entry in now.items() if key in before and not same(before[key][-1], entry[-1])]
