"""The ``--plot`` timeline: live vs reserved vs mapped bytes per allocator, OOMs marked."""

from __future__ import annotations

import os
from typing import Any

from vmm.units import format_size

from ooc.frag.report import ENVELOPE_BINS, FragReport

__all__ = ["plot_timeline"]

_GIB = float(1 << 30)


def plot_timeline(rep: FragReport, path: str | os.PathLike[str], *, dpi: int = 120) -> None:
    """Write a PNG of memory over the events of the trace (matplotlib, Agg backend).

    One line per chosen model (``rep.plotted``: the baseline, the advised setting or chunk
    size, the best chunk size; caching: reserved segment bytes; expandable segments: mapped
    pages; vmm-N: mapped chunk bytes), the
    live (requested) bytes shaded, the recorded allocator's reserved bytes when the snapshot
    has them, the device size, the recorded OOM (vertical line) and each allocator's own
    OOM (a cross). Axes in GiB and event index; the title names the input.
    """
    # A bare Figure on the Agg canvas: no pyplot, no global backend switch, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw(ax, rep, FuncFormatter)
    fig.savefig(os.fspath(path), dpi=dpi)


def _series(a: Any, total: int) -> tuple[Any, Any, Any, Any, bool]:
    """x, live (max), reserved (max), reserved (min) of one allocator's replay, and whether
    they are per-bin envelopes. Short traces: the replay's samples (every event). Long ones:
    the envelope the analysis recorded over every event (a periodic trace drawn point by
    point would paint a solid block, and decimated samples miss spikes)."""
    s = a.result.samples
    env = a.envelope
    if total > 2 * ENVELOPE_BINS and env is not None and len(env):
        return env[:, 0], env[:, 1], env[:, 2], env[:, 3], True
    return s[:, 0], s[:, 1], s[:, 2], s[:, 2], False


_WINDOW = 15  # bins (1.25% of the trace) over which the lines of long traces take the maximum


def _rolling_max(v: Any, k: int) -> Any:
    """Maximum of v over a centred window of k values (shrinking at the ends)."""
    import numpy as np

    if len(v) <= 1 or k <= 1:
        return v
    h = k // 2
    padded = np.concatenate([np.full(h, v.min()), v, np.full(h, v.min())])
    return np.lib.stride_tricks.sliding_window_view(padded, 2 * h + 1).max(axis=1)


def _draw(ax: Any, rep: FragReport, FuncFormatter: Any) -> None:
    trace = rep.trace
    total = len(trace.events)
    furthest = max(rep.allocators, key=lambda a: a.events)
    x, live, _, _, binned = _series(furthest, total)
    if len(x):
        ax.fill_between(x, live / _GIB, step="post", color="0.8", label="live (requested)", zorder=1)
    colors = {"caching": "tab:red"}
    palette = iter(["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:cyan"])
    # The chosen models only (the baseline, the advised one, the best chunk size): with every
    # PYTORCH_CUDA_ALLOC_CONF setting drawn, the lines would hide each other.
    shown = [a for a in rep.allocators if not rep.plotted or a.name in rep.plotted]
    for a in shown:
        c = colors.get(a.name) or next(palette, "tab:gray")
        what = "reserved" if a.kind == "caching" else "mapped"
        label = f"{a.name} {what} (peak {format_size(a.peak_reserved_bytes)})"
        x, _, hi, lo, b = _series(a, total)
        if len(x):
            if b:
                # The range within each bin, faint; the line is the maximum over a window of
                # bins: a per-bin maximum of a periodic trace zigzags into a solid block.
                ax.fill_between(x, lo / _GIB, hi / _GIB, step="post", color=c, alpha=0.15,
                                lw=0, zorder=2)
                hi = _rolling_max(hi, _WINDOW)
            ax.step(x, hi / _GIB, where="post", color=c, lw=1.4, label=label, zorder=3)
        if a.oom is not None:
            ax.plot([a.oom.event], [a.oom.reserved_bytes / _GIB], marker="X", ms=11, color=c,
                    markeredgecolor="black", zorder=5, linestyle="none",
                    label=f"{a.name} OOM at event {a.oom.event:,}")
    rec = trace.recorded
    if rec is not None and rec.reserved_points:
        xs = [p for p, _ in rec.reserved_points] + [len(trace.events)]
        ys = [r / _GIB for _, r in rec.reserved_points] + [rec.reserved_points[-1][1] / _GIB]
        ax.step(xs, ys, where="post", color="black", lw=1.0, ls=":", zorder=2,
                label=f"recorded reserved (peak {format_size(rec.peak_reserved_bytes)})")
    if rep.device_memory is not None:
        ax.axhline(rep.device_memory / _GIB, color="black", lw=1.0, ls="--", zorder=2,
                   label=f"device memory {format_size(rep.device_memory)}")
    for k, m in enumerate(trace.ooms):
        ax.axvline(m.index, color="crimson", lw=1.2, ls="-.", zorder=2,
                   label=(f"recorded OOM ({format_size(m.nbytes)} requested)" if k == 0 else None))
    ax.set_xlim(0, max(1, total))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("event (allocation or free, in trace order)")
    ax.set_ylabel("device memory (GiB)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.3g}"))
    ax.grid(True, alpha=0.3)
    per = -(-total // ENVELOPE_BINS)
    binned_txt = (f"\nlines: maximum over {per * _WINDOW:,} events; bands: range within each "
                  f"{per:,} events" if binned else "")
    ax.set_title(f"ooc frag: {trace.name} ({total:,} events): live vs reserved/mapped{binned_txt}")
    # Outside the axes: the curves fill the plot, and a legend on top would hide them.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
