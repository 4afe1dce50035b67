"""Two recordings of one step, in a form that can be compared: ``ooc plan`` plans the
sequence ``ooc.trace`` recorded, the engine runs the one its recording step recorded, and
the two must be the same step.

Variable ids depend on the order in which storages were first met or registered, and
names on who recorded (the engine does not see the inputs' names nor module scopes): the
canonical form renumbers variables by first use and keeps, per function, the aten op, its
uses and its replay flags, and per variable its bytes, kind and whether it lives in or out of
the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.ir import VariableSequence

_FLAGS = ("replayable", "rng", "updates_stats")


@dataclass(frozen=True, slots=True)
class CanonicalStep:
    """``functions[i]`` = (aten op, ((variable, "r"|"w"), ...), flags) with ``flags`` the
    replay flags set, a subset of ("replayable", "rng", "updates_stats"); ``variables[v]`` =
    (bytes, kind, live_in, live_out) for the variable numbered ``v`` by first use; variables
    no function uses come last, sorted."""

    functions: tuple[tuple[str, tuple[tuple[int, str], ...], tuple[str, ...]], ...]
    variables: tuple[tuple[int, str, bool, bool], ...]


def op_name(function_name: str) -> str:
    """The aten op of a function name (``"layer1.0.conv1:aten.convolution.default"``)."""
    return function_name.rpartition(":")[2]


def canonical(seq: VariableSequence) -> CanonicalStep:
    number: dict[int, int] = {}
    functions = []
    for f in seq.functions:
        uses = []
        for u in f.uses:
            v = number.setdefault(u.var, len(number))
            uses.append((v, "w" if u.access.value == "write" else "r"))
        flags = tuple(k for k in _FLAGS if getattr(f, k))
        functions.append((op_name(f.name), tuple(uses), flags))

    def facts(var: int) -> tuple[int, str, bool, bool]:
        v = seq.variables[var]
        return (v.nbytes, v.kind.value, v.live_in, v.live_out)

    used = [facts(var) for var, _ in sorted(number.items(), key=lambda kv: kv[1])]
    unused = sorted(facts(var) for var in seq.variables if var not in number)
    return CanonicalStep(tuple(functions), tuple(used + unused))


def first_difference(a: CanonicalStep, b: CanonicalStep) -> str | None:
    """Where two canonical steps first differ, in words; None if they are the same."""
    for i, (fa, fb) in enumerate(zip(a.functions, b.functions)):
        if fa != fb:
            return f"function {i}: {fa} != {fb}"
    if len(a.functions) != len(b.functions):
        i = min(len(a.functions), len(b.functions))
        extra = (a.functions if len(a.functions) > i else b.functions)[i]
        return f"{len(a.functions)} != {len(b.functions)} functions, first extra: {extra}"
    for v, (va, vb) in enumerate(zip(a.variables, b.variables)):
        if va != vb:
            return f"variable {v}: {va} != {vb}"
    if len(a.variables) != len(b.variables):
        return f"{len(a.variables)} != {len(b.variables)} variables"
    return None
