"""Plans and step forms fixed for tests and CPU benchmarks, whatever the machine's load.

The engine chooses what to recompute from measured op times and a priced link, and between
step forms by a timed trial. A test that must reach a form (the template form, say) cannot
depend on a timing, and a CPU benchmark of a GPU's plan shape needs the GPU's choice, which
this CPU's prices would not make. THESE PATCH THE ENGINE'S INTERNALS; nothing in ooc itself
imports this module.
"""

from __future__ import annotations

from typing import Any, Callable

#: The op time every step reports to the planner under ``templates_forced``.
CHEAP_OP_S = 1e-6


def decided(keep: bool, runs: int = 1) -> Callable[[Any], bool]:
    """``HookPlan.judge`` deciding ``keep`` once each side ran ``runs`` steps, whatever the times."""
    def judge(self: Any) -> bool:
        if self.kept or self.rejected or min(len(self.trial), len(self.per_op)) < runs:
            return False
        self.kept, self.rejected = keep, not keep
        return True
    return judge


def templates_forced(patch: Callable[[Any, str, Any], None], storage_bandwidth: float = 50e6,
                     **link: float) -> None:
    """Plans that recompute whatever the machine's load, and every trial kept: the swap file
    priced at ``storage_bandwidth`` (or a GPU preset's ``link`` bandwidths), every step's op
    times reported to the planner at ``CHEAP_OP_S`` (measured times on a loaded machine made
    chains dear: the module database's form count fell from 20 to 13 beside a CI run), and the
    trial's verdict fixed (it is a timing). ``patch(obj, name, value)``: ``monkeypatch.setattr``
    or an equivalent (``setattr`` in a process of its own)."""
    import ooc.engine.planning as planning
    from ooc.engine import hook_forms
    from ooc.runtime import stepper as stepper_module
    from scheduler.hardware import hardware
    from scheduler.recompute import default_hardware

    real = planning.Planner._facts

    def cheap(self: Any, st: Any, report: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(st, stepper_module.Stepper):
            st.rec.seconds[:] = [CHEAP_OP_S] * len(st.rec.seconds)
        return real(self, st, report, *args, **kwargs)

    priced = {"storage_bandwidth": storage_bandwidth} if not link else link
    patch(planning.Planner, "_facts", cheap)
    patch(planning, "priced_hardware", lambda seq, stats: hardware(default_hardware(seq), **priced))
    patch(hook_forms.HookPlan, "judge", decided(keep=True))
