"""bench_gpu's report: gpu.md for people, gpu.json for tools, both rewritten after every row.

Why after every row: a run on a lent GPU ends when its time does; what it measured up to then
must be on disk. The verdicts are issue 38's targets, computed from the rows: ooc at no more
peak memory than an alternative is faster than it; ResNet-50 and GPT-2 at >= 0.80x in-core at
1/2 and >= 0.70x at 1/4; the simulator within 15% of every ooc row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import common
from gpu_methods import Row

GiB = 1 << 30
TARGETS = {0.5: 0.80, 0.25: 0.70}   # ResNet-50 and GPT-2, measured
SIM_TOLERANCE = 0.15


class Report:
    def __init__(self, out: Path, quick: bool) -> None:
        self.out, self.quick = Path(out), quick
        self.rows: list[Row] = []
        self.forms: list[Row] = []
        self.sections: list[tuple[str, list[str]]] = []
        self.notes: list[str] = []
        self.link: dict[str, float] = {}
        self.profiles: list[str] = []
        self.extra: dict[str, list[dict]] = {}   # gpu.json's other sections' rows (headline)
        self._header = common.header("ooc on a GPU", quick=quick, notes=_gpu_notes())

    def add(self, row: Row, *, form: bool = False) -> None:
        (self.forms if form else self.rows).append(row)
        print(f"{row.label} {row.method} {row.budget_fraction}: "
              f"{row.step_ms and round(row.step_ms, 1)} ms bitwise={row.bitwise} {row.error}", flush=True)
        self.write()

    def section(self, title: str, lines: list[str]) -> None:
        self.sections.append((title, lines))
        self.write()

    def skipped(self, what: str) -> None:
        self.notes.append(what)
        self.write()

    def failures(self) -> int:
        return sum(1 for r in self.rows + self.forms if r.error or r.bitwise is False)

    # -- writing -----------------------------------------------------------------------------

    def write(self) -> None:
        lines = list(self._header)
        for title, body in self.sections:
            lines += [f"## {title}", "", *body, ""]
        lines += ["## Side by side", "",
                  "Median of the timed steps after warm-up, each between two "
                  "`torch.cuda.synchronize()`. Budgets are fractions of the in-core step's own "
                  "peak allocation above its start (activations, gradients, temporaries). Peak: "
                  "PyTorch's peak allocated bytes over the run, plus ooc's VMM pool (mapped "
                  "outside PyTorch). `sim`: scheduler.simulate on the h100-80gb-pcie5 preset with "
                  "the measured link and the host lane measured in 'Host cost per op', on the op "
                  "times the engine priced its plan on (CUDA events: each op's fastest of the "
                  "recording step and the planned runs that timed it).", ""]
        for case in dict.fromkeys(r.case for r in self.rows):
            rows = [r for r in self.rows if r.case == case]
            lines += [f"### {rows[0].label}", "", *_table(rows), "", *_verdicts(rows), ""]
        if self.forms:
            lines += ["## Step forms on CUDA, bitwise against the same loop in core", "",
                      *_table(self.forms), ""]
        if self.profiles:
            lines += ["## GPU profiles", "", *[f"- `{p}`" for p in self.profiles], ""]
        if self.notes:
            lines += ["## Not run", "", *[f"- {n}" for n in self.notes], ""]
        common.write_report(self.out, lines)
        info = common.machine_info()
        self.out.with_suffix(".json").write_text(json.dumps({
            "gpu": _gpu_name(), "commit": info["commit"], "date": info["date"],
            "torch": info.get("torch"), "link_bytes_per_s": self.link,
            "rows": [r.to_dict() for r in self.rows],
            "step_forms": [r.to_dict() for r in self.forms],
            "profiles": self.profiles, "not_run": self.notes, **self.extra}, indent=1) + "\n")


def _table(rows: list[Row]) -> list[str]:
    """One line per row; "vs in-core" against the in-core row above it (its own case)."""
    base, out = None, []
    for r in rows:
        if r.method == "in-core" and r.step_ms:
            base = r
        if r.error:
            out.append([_what(rows, r), _frac(r), "FAILED", "", "", "", "", "", "", "", r.error])
            continue
        speed = f"{base.step_ms / r.step_ms:.2f}x" if base and r.step_ms else ""
        sim = ""
        if r.predicted_step_ms:
            sim = f"{r.predicted_step_ms:.0f} ms ({r.predicted_step_ms / r.step_ms - 1:+.0%})"
        out.append([_what(rows, r), _frac(r), f"{r.step_ms:.1f} ms", f"{r.samples_per_s:.0f}", speed,
                    _peak(r), _gib(r.bytes_moved), _gib(r.bytes_recomputed),
                    {True: "yes", False: "**NO**", None: ""}[r.bitwise], sim,
                    "; ".join(x for x in (r.note, _forms(r.forms)) if x)])
    return common.md_table(["method" if len({r.label for r in rows}) == 1 else "case, method", "budget", "step", "samples/s", "vs in-core", "peak",
                            "moved/step", "recomputed/step", "bitwise", "sim", "note"], out)


def _what(rows: list[Row], r: Row) -> str:
    return r.method if len({x.label for x in rows}) == 1 else f"{r.label}: {r.method}"


def _verdicts(rows: list[Row]) -> list[str]:
    """Issue 38's targets for this case's ooc rows."""
    base = next((r for r in rows if r.method == "in-core" and r.step_ms), None)
    others = [a for a in rows if not a.method.startswith(("ooc", "in-core")) and not a.error]
    out = []
    for r in rows:
        if not r.method.startswith("ooc") or r.error or not r.step_ms or base is None:
            continue
        beaten = [a.method for a in others
                  if a.peak_bytes and a.peak_bytes >= (r.peak_bytes or 0) and a.step_ms < r.step_ms]
        speed = base.step_ms / r.step_ms
        target = TARGETS.get(r.budget_fraction or 0) if r.case in ("resnet50", "gpt2") else None
        sim_ok = (r.predicted_step_ms is not None
                  and abs(r.predicted_step_ms / r.step_ms - 1) <= SIM_TOLERANCE)
        out.append(f"- {r.method} at {_frac(r)}: {speed:.2f}x in-core"
                   + (f" (target >= {target:.2f}: {'met' if speed >= target else 'NOT met'})" if target else "")
                   + "; faster than every alternative at no less peak: "
                   + ("no alternative measured" if not others else "yes" if not beaten
                      else f"NO (slower than {', '.join(beaten)})")
                   + f"; simulator within 15%: {'yes' if sim_ok else 'NO'}"
                   + f"; bitwise: {r.bitwise}")
    ours = [r for r in rows if r.method.startswith("ooc") and not r.error and r.step_ms and r.peak_bytes]
    for a in [a for a in others if a.peak_bytes]:
        within = [r for r in ours if r.peak_bytes <= a.peak_bytes]
        best = min(within, key=lambda r: r.step_ms, default=None)
        out.append(f"- against {a.method} ({a.step_ms:.1f} ms, {_gib(a.peak_bytes)}): "
                   + ("no ooc row at no more peak" if best is None else
                      f"fastest ooc at no more peak {best.step_ms:.1f} ms at {_gib(best.peak_bytes)}: "
                      + ("faster (met)" if best.step_ms < a.step_ms else "slower (NOT met)")))
    return out


def _frac(r: Row) -> str:
    if r.budget_fraction is None:
        return ""
    return f"{r.budget_fraction:g} ({_gib(r.budget_bytes)})"


def _peak(r: Row) -> str:
    if r.pool_peak_bytes:
        return f"{_gib(r.peak_bytes)} ({_gib(r.torch_peak_bytes)} + {_gib(r.pool_peak_bytes)})"
    return _gib(r.peak_bytes)


def _forms(forms: dict[str, int]) -> str:
    if not forms:
        return ""
    return ("steps " + ", ".join(f"{k} {v}" for k, v in forms.items()))


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GiB:.2f} GiB"


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_properties(0).name


def _gpu_notes() -> list[str]:
    import importlib.metadata as md

    import torch

    props = torch.cuda.get_device_properties(0)
    versions = []
    for name in ("cuda-bindings", "cuda-python", "cupy-cuda13x", "cupy-cuda12x", "transformers"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return [f"GPU: {props.name}, {props.total_memory / GiB:.1f} GiB, {props.multi_processor_count} SMs; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}); {', '.join(versions)}",
            "cuDNN deterministic, cuBLAS workspace :4096:8, deterministic algorithms (warn only), "
            "in every run; PYTORCH_CUDA_ALLOC_CONF "
            + repr(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset (PyTorch's defaults)"))]

