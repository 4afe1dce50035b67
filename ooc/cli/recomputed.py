"""Which tensors a plan recomputes, and what each costs: the listing of ``ooc plan`` and ``ooc simulate``.

The totals (``bytes_recomputed``, ``recompute_s``) say how much a plan trades transfers for
compute, not which tensors it drops nor whether one long chain dominates the bill; a user
deciding between ``--recompute prefer`` and ``never`` (or a budget) needs the tensors. Each
``recompute`` action of the Schedule is one :class:`Recomputed`; its seconds are the chain's
functions priced by ``Hardware.function_s``, exactly what ``scheduler.simulate`` charges the
compute stream for it, so the rows of a simulated plan add up to its ``recompute_s``.

The table shows the ``LIMIT`` largest (a plan may recompute thousands of small tensors; the
large ones are where the time goes) and sums up the rest on one line; ``--json`` gets every
row, in program order, under the key ``"recomputed"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from scheduler.actions import Op
from scheduler.hardware import Hardware
from scheduler.schedule import Schedule

LIMIT = 10          # rows the table shows; the rest are summed up on one line
NAME_WIDTH = 44     # characters of a name in the table (the start is cut, not the end)

# "aten.native_batch_norm.default" -> "native_batch_norm": the recorder names functions
# "module.path:namespace.op.overload"; the op is what a reader recognizes.
_ATEN = re.compile(r"\baten\.(\w+)(?:\.\w+)?")


@dataclass(frozen=True, slots=True)
class Recomputed:
    """Variable ``var`` (``name``, ``nbytes``) is re-created before function ``before`` by
    rerunning ``functions`` (indices, in order), which take ``seconds`` on the hardware."""

    var: int
    name: str
    nbytes: int
    before: int
    functions: tuple[int, ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON row: stable keys, plain values."""
        return {"var": self.var, "name": self.name, "bytes": self.nbytes, "before": self.before,
                "functions": list(self.functions), "seconds": self.seconds}


def recomputed(schedule: Schedule, hw: Hardware) -> list[Recomputed]:
    """One row per ``recompute`` action of ``schedule``, in program order, priced on ``hw``.

    A recompute runs before a function; one listed among the actions after function i runs
    before function i + 1, and is listed so (the rows still add up to ``bytes_recomputed``).
    """
    seq = schedule.sequence
    rows: list[Recomputed] = []
    for offset, lists in ((0, schedule.before), (1, schedule.after)):
        for i, acts in enumerate(lists):
            for a in acts:
                if a.op is not Op.RECOMPUTE:
                    continue
                var = seq.variables[a.var]
                # simulate's price of the chain (its ``rerun``), function by function
                seconds = sum(hw.function_s(seq.functions[k].cost) for k in a.chain)
                rows.append(Recomputed(a.var, var.name or f"v{a.var}", var.nbytes, i + offset,
                                       tuple(a.chain), seconds))
    rows.sort(key=lambda r: r.before)   # stable: within a function, the schedule's order
    return rows


def as_json(rows: list[Recomputed]) -> list[dict[str, Any]]:
    """Every row as plain data, the value of ``"recomputed"`` in ``--json`` output."""
    return [r.to_dict() for r in rows]


def short(name: str) -> str:
    """A function or tensor name without the ATen namespace and overload:
    "blocks.1.bn2:aten.native_batch_norm.default#24" -> "blocks.1.bn2:native_batch_norm#24"."""
    return _ATEN.sub(r"\1", name)


def op(name: str) -> str:
    """A function's op alone, for naming chains briefly: "stem.2:aten.relu_.default" -> "relu_"."""
    return short(name).rsplit(":", 1)[-1]


def table(rows: list[Recomputed], schedule: Schedule, *, limit: int = LIMIT) -> list[str]:
    """The listing's lines: a header, the ``limit`` largest rows (ties in program order), and
    "... and N more (SIZE)" for the rest. Empty when nothing is recomputed."""
    from vmm.units import format_size as fs

    if not rows:
        return []
    functions = schedule.sequence.functions
    shown = sorted(rows, key=lambda r: (-r.nbytes, r.before))[:limit]
    names = [_fit(short(r.name), NAME_WIDTH) for r in shown]
    befores = [_fit(f"{r.before} {op(functions[r.before].name)}", NAME_WIDTH) for r in shown]
    width = max(len("tensor"), *(len(n) for n in names))
    bwidth = max(len("before"), *(len(b) for b in befores))
    lines = [f"  {'tensor':<{width}}  {'bytes':>9}  {'chain':>9}  {'before':<{bwidth}}  reruns"]
    for r, name, before in zip(shown, names, befores):
        lines.append(f"  {name:<{width}}  {fs(r.nbytes):>9}  {_seconds(r.seconds):>9}  {before:<{bwidth}}  "
                     f"{_chain([op(functions[k].name) for k in r.functions])}")
    if len(rows) > len(shown):
        rest = sum(r.nbytes for r in rows) - sum(r.nbytes for r in shown)
        lines.append(f"  ... and {len(rows) - len(shown):,} more ({fs(rest)})")
    return lines


def _chain(ops: list[str]) -> str:
    """"2: native_batch_norm, relu_"; a long chain by its ends: "7: conv, relu_, ..., add_"."""
    names = ops if len(ops) <= 3 else [ops[0], ops[1], "...", ops[-1]]
    return f"{len(ops)}: {', '.join(names)}"


def _fit(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: the end is kept (it tells tensors apart)."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


def _seconds(s: float) -> str:
    """Chains are short: microseconds below a millisecond, milliseconds above."""
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:,.2f} ms"
