"""A picture of ``ooc fit``: predicted step time and modelled device peak against the budget
(for a plan bounded by the device, against the device's size it was bounded by).

The device's peak is not monotone in the budget (``scheduler.device_fit``), and a table of 32
rows hides where it jumps; two curves over the same budgets, with the device's line and the
chosen budget marked, show at once which budgets fit and what each costs.
"""

from __future__ import annotations

import os

from scheduler.device_fit import Fit


def plot_fit(fit: Fit, device_bytes: int, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Write a PNG of ``fit``'s candidates to ``path``: step time on top, device peak below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 1 / (1 << 30)
    flat = [c for c in fit.candidates if not c.bounded]
    bounded = [c for c in fit.candidates if c.bounded]   # x: the device size each was bounded by
    xs = [c.budget * gib for c in flat]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    top.plot(xs, [c.step_s * 1e3 for c in flat], marker="o", ms=3, color="tab:blue")
    top.set_ylabel("step, predicted (ms)")
    bottom.plot(xs, [c.device_peak * gib for c in flat], marker="o", ms=3, color="tab:purple",
                label="device peak, modelled")
    if bounded:
        bx = [c.budget * gib for c in bounded]
        top.plot(bx, [c.step_s * 1e3 for c in bounded], marker="s", ms=4, ls="none", color="tab:cyan",
                 label="bounded by the device (budget: the device)")
        bottom.plot(bx, [c.device_peak * gib for c in bounded], marker="s", ms=4, ls="none", color="tab:cyan",
                    label="bounded by the device, modelled")
    bottom.plot(xs, xs, ls=":", color="tab:gray", lw=1, label="the budget")
    bottom.axhline(device_bytes * gib, color="tab:red", ls="--", lw=1.2, label="device memory")
    bottom.axhline(fit.limit * gib, color="tab:orange", ls="--", lw=1, label="less the margin")
    if fit.best is not None:
        for ax, y in ((top, fit.best.step_s * 1e3), (bottom, fit.best.device_peak * gib)):
            ax.plot([fit.best.budget * gib], [y], marker="*", ms=14, color="tab:green", ls="none",
                    label="fastest that fits")
        top.legend(loc="upper right", fontsize=9)
    bottom.set_xlabel("budget (GiB)")
    bottom.set_ylabel("device memory (GiB)")
    bottom.legend(loc="upper left", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
