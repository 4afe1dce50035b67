"""A picture of one planned step, for people: memory over the step and what moved when.

Top: device bytes while each function runs, in core (nothing swapped) and under the plan,
with the budget line. Bottom: bytes swapped in before and out after each function. Backward
and optimizer phases are shaded when the sequence knows where they start.
"""

from __future__ import annotations

import os

from scheduler.check import check
from scheduler.schedule import Op, Schedule
from vmm.units import format_size


def plot_schedule(schedule: Schedule, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Write a PNG of ``schedule``'s memory timeline and swap volume to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq = schedule.sequence
    n = len(seq.functions)
    mib = 1 / (1 << 20)
    resident = [b * mib for b in check(schedule).resident_bytes]
    in_core = [b * mib for b in seq.live_bytes]
    swap_in = [sum(seq.variables[a.var].nbytes for a in acts if a.op is Op.SWAP_IN) * mib
               for acts in schedule.before]
    swap_out = [sum(seq.variables[a.var].nbytes for a in acts if a.op is Op.SWAP_OUT) * mib
                for acts in schedule.after]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    xs = range(n)
    top.fill_between(xs, in_core, step="mid", alpha=0.25, color="tab:gray", label="in core (nothing swapped)")
    top.plot(xs, resident, drawstyle="steps-mid", color="tab:blue", lw=1.4, label=f"under the plan ({schedule.policy})")
    top.axhline(schedule.budget * mib, color="tab:red", ls="--", lw=1.2, label=f"budget {format_size(schedule.budget)}")
    top.set_ylabel("device memory (MiB)")
    top.legend(loc="upper right", fontsize=9)
    top.set_title(title or (f"{seq.meta.get('model', 'step')}: in-core peak {format_size(seq.in_core_peak_bytes)}, "
                            f"planned peak {format_size(schedule.peak_resident_bytes)}"))
    bottom.bar(xs, swap_in, width=1.0, color="tab:green", label=f"swap-in ({format_size(schedule.bytes_in)}/step)")
    bottom.bar(xs, [-v for v in swap_out], width=1.0, color="tab:orange",
               label=f"swap-out ({format_size(schedule.bytes_out)}/step)")
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_ylabel("swapped (MiB)")
    bottom.set_xlabel("function (aten op) index in the step")
    bottom.legend(loc="lower right", fontsize=9)
    for ax in (top, bottom):
        for key, color, label in (("backward_start", "tab:purple", "backward"),
                                  ("optimizer_start", "tab:brown", "optimizer")):
            start = seq.meta.get(key)
            if isinstance(start, int) and 0 <= start < n:
                ax.axvspan(start, n if key == "optimizer_start" else seq.meta.get("optimizer_start", n),
                           color=color, alpha=0.06)
                if ax is top:
                    ax.text(start, top.get_ylim()[1] * 0.97, f" {label}", color=color, va="top", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
