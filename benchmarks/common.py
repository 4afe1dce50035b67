"""Helpers shared by the benchmark scripts: header, timing, Markdown tables, plots, paths.

Conventions every ``benchmarks/bench_<name>.py`` follows (run it as ``python
benchmarks/bench_<name>.py``, so that ``import common`` finds this file):

- ``--quick``: tiny sizes, one run, a few seconds; writes ``results/<name>-quick.md`` so a
  quick run never overwrites the full results (``results/<name>.md``). ``add_args`` adds it
  together with ``--out``.
- The report starts with ``header(...)``: what ran where (machine, versions, date, commit,
  mode), so a number can always be traced back to its setting.
- Timings are medians (``median_of``), 3 runs in full mode unless the script says otherwise.
- Plots are PNG files beside the Markdown (``result_path(name, quick, ".png")``), drawn
  with matplotlib's Agg backend (no display needed).

Example::

    import common
    args = common.add_args(argparse.ArgumentParser()).parse_args()
    t = common.median_of(lambda: work(), runs=1 if args.quick else 3)
    lines = common.header("Time to do X", quick=args.quick)
    lines += common.md_table(["case", "seconds"], [["X", f"{t.median:.3f}"]])
    common.write_report(common.result_path("x", args.quick, out=args.out), lines)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
_REPO = Path(__file__).resolve().parent.parent


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags every benchmark takes: ``--quick`` and ``--out PATH``."""
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one run, a few seconds (writes <name>-quick.md)")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="Markdown output (default benchmarks/results/<name>[-quick].md)")
    return parser


def parse_or_run_child(parser: argparse.ArgumentParser, child: Callable[[dict[str, Any]], Any]
                       ) -> argparse.Namespace | None:
    """Parse a benchmark's flags, with the hidden ``--child SPEC`` its cases run under in a
    fresh process (``run_child``): given that, the case runs (``child(spec)``), its output is
    flushed, and None is returned (the caller returns)."""
    import json

    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        return args
    child(json.loads(args.child))
    sys.stdout.flush()
    return None


def result_path(name: str, quick: bool, suffix: str = ".md", *, out: Path | None = None) -> Path:
    """Where a benchmark writes: ``results/<name>.md``, ``<name>-quick.md`` in quick mode.

    With ``out`` (the ``--out`` flag), that path, with ``suffix`` swapped in for a plot.
    """
    if out is not None:
        return Path(out).with_suffix(suffix)
    return RESULTS / f"{name}{'-quick' if quick else ''}{suffix}"


# -- what ran where -------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Plain facts about this run: uname, CPU, cores, memory, versions, date, git commit."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = float("nan")
    u = platform.uname()
    info: dict[str, Any] = {
        "uname": f"{u.system} {u.release} {u.machine}",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": git_commit(),
    }
    for mod in ("torch", "numpy"):  # only when the script already uses them: no import cost
        m = sys.modules.get(mod)
        info[mod] = getattr(m, "__version__", None) if m is not None else None
    return info


def git_commit() -> str:
    """Short HEAD commit, with "+dirty" when the working tree has uncommitted changes.
    ``OOC_COMMIT`` overrides it: a copy of the tree sent to another machine may carry a
    stale ``.git``, so the sender names the commit."""
    if os.environ.get("OOC_COMMIT"):
        return os.environ["OOC_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=_REPO, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=_REPO, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages as ``"5.2 / 5.6 / 4.4"`` (``"unknown"`` where the
    system gives none). On a shared machine a report notes it at the start and at the end."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def header(title: str, *, quick: bool, notes: Iterable[str] = ()) -> list[str]:
    """The first lines of a report: ``# title``, then one bullet per fact, then ``notes``."""
    m = machine_info()
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "numpy") if m[k])
    lines = [
        f"# {title}",
        "",
        f"- machine: {m['cpu']}, {m['cpu_count']} cores, {m['memory_gib']:g} GiB RAM, {m['uname']}",
        f"- Python {m['python']}" + (f", {versions}" if versions else "") + f"; commit {m['commit']}",
        f"- date: {m['date']}",
        f"- mode: {'quick (tiny sizes, not the reference figures)' if quick else 'full'}",
    ]
    lines += [f"- {n}" for n in notes]
    lines.append("")
    return lines


# -- timing ---------------------------------------------------------------------------------


class Timing(NamedTuple):
    """``median_of``'s answer: median wall seconds, every run's wall seconds, the last run's
    value, and the median CPU seconds of this process (``time.process_time``: all threads;
    on a shared machine it shows the work done when wall time is inflated by other jobs)."""

    median: float
    times: tuple[float, ...]
    value: Any
    cpu: float = 0.0

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)


def median_of(fn: Callable[[], Any], runs: int) -> Timing:
    """Call ``fn()`` ``runs`` times (at least once) and time each call (wall and CPU)."""
    times, cpus = [], []
    value = None
    for _ in range(max(1, runs)):
        c0, t0 = time.process_time(), time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return Timing(statistics.median(times), tuple(times), value, statistics.median(cpus))


# -- cases in fresh processes ---------------------------------------------------------------


def run_child(script: str | Path, spec: dict[str, Any], tag: str, what: str,
              timeout: float = 1200) -> dict[str, Any]:
    """Run ``python script --child JSON`` (one case, in a fresh process: no allocator or cache
    state carried over from another case) and return the JSON object its stdout printed after
    ``tag``; ``RuntimeError`` naming ``what`` with the child's last line of stderr if it failed."""
    import json

    proc = subprocess.run([sys.executable, str(script), "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"{what} failed: {tail}")
    return json.loads(line[len(tag) + 1:])


def run_cases(script: str | Path, cases: Sequence[str], spec: Callable[[str], dict[str, Any]], tag: str,
              log: Callable[[str], Any], timeout: float = 3600) -> tuple[dict[str, dict], dict[str, bool]]:
    """Each of ``cases`` in a fresh process (``run_child``, its spec ``spec(case)`` plus
    ``params_out``: where the child saves its model's state dict at the end), each case's
    time in all logged (its result's ``rows``, each with ``s``). Returns the results by case,
    and for each case after the first whether its state is bitwise the first case's."""
    import tempfile

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-{Path(script).stem}-") as tmp:
        params = {case: str(Path(tmp) / f"{k}.pt") for k, case in enumerate(cases)}
        for case in cases:
            results[case] = run_child(script, {**spec(case), "params_out": params[case]}, tag, case, timeout)
            log(f"{case}: {sum(r['s'] for r in results[case]['rows']):.1f} s in all")
        same = {case: same_state(params[cases[0]], params[case]) for case in cases[1:]}
    return results, same


def same_state(a: str | Path, b: str | Path) -> bool:
    """Whether two state dicts saved with ``torch.save`` hold bitwise the same tensors."""
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# -- output ---------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
             align: str | None = None) -> list[str]:
    """A Markdown table as lines. ``align``: one letter per column, ``l`` or ``r``
    (default: first column left, the others right, as numbers read best)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} letters for {len(headers)} columns")
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"row {cells} has {len(cells)} cells for {len(headers)} columns")
        out.append("| " + " | ".join(cells) + " |")
    return out


def write_report(path: Path, lines: Iterable[str]) -> Path:
    """Write the Markdown lines to ``path`` (creating results/), and say so on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
    print(f"wrote {path}")
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, path: Path) -> Path:
    """Save a matplotlib figure as PNG (120 dpi, tight box), close it, say so on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    print(f"wrote {path}")
    return path


def plan_stats(stats: dict | None) -> dict:
    """The ``plan.*`` numbers of ``engine.stats()`` without the prefix; {} when no step of the
    engine ran a plan (or there was no engine)."""
    stats = stats or {}
    if not stats.get("plan.functions"):
        return {}
    return {k[len("plan."):]: v for k, v in stats.items() if k.startswith("plan.")}
