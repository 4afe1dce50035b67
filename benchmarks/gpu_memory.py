"""Where ooc's device memory goes on a GPU: the measured peaks against a model of two arenas.

    python benchmarks/gpu_memory.py [--out PATH]

On the H100 (benchmarks/results/gpu.json) ooc's peak was far above its budget: ResNet-50 b256
held 10.6 GiB at a 5.1 GiB budget. On a GPU ooc's step uses two allocators: PyTorch's caching
allocator, where every tensor is born (activations, the backward's gradients of activations
and temporaries, weights and optimizer state) and which keeps what the forward freed for later
requests, and ooc's VMM pool, where swapped-in activations come back. The device needs the sum
of both peaks.

For each measured ooc row of ResNet-50 and GPT-2 this plans the H100 profile of the case
(benchmarks/profiles/h100/, recorded in the same run) at the row's budget as the engine plans
(``managed_view``, activations from 1 MiB, the profile's link), then walks the plan's
allocations (``scheduler.memory_events.allocation_events``) and puts each in its arena:

- **PyTorch's**: the managed activations born or recomputed on the device, plus what the engine
  does not manage (weights, gradients, optimizer state, the backward's gradients of
  activations, temporaries, tensors under 1 MiB), live from their first use to their last;
- **the pool**: managed activations from their swap-in to their free.

It prints each arena's modelled peak beside the measured one (PyTorch's peak allocated bytes
and the pool's peak mapped bytes, both over the whole run), and the peak with one arena (the
sum of both at each point, as if swap-ins reused what the forward freed). The model counts
bytes, not the allocators' rounding, cuDNN's workspaces or the first steps (recorded on
demand, then a trial of the anchored form), which the measured peaks include.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import scheduler  # noqa: E402
from scheduler.ir import VariableSequence  # noqa: E402
from scheduler.managed import managed_view  # noqa: E402
from scheduler.memory_events import allocation_events  # noqa: E402
from scheduler.recompute import default_hardware  # noqa: E402
from scheduler.schedule import Op, Schedule  # noqa: E402

HERE = Path(__file__).resolve().parent
GiB = 1 << 30


def arenas(full: VariableSequence, schedule: Schedule) -> dict[str, int]:
    """The modelled peaks (bytes) of PyTorch's arena, of the pool, their sum, and one arena,
    for ``schedule`` (a plan of ``managed_view(full)``) over the whole step ``full``."""
    n = len(full.functions)
    torch_side, pool = [0] * (n + 1), [0] * (n + 1)
    swapped_in = [{a.var for acts in (schedule.before[i], schedule.after[i]) for a in acts
                   if a.op is Op.SWAP_IN} for i in range(n)]
    held: dict[int | str, tuple[bool, int]] = {}   # key -> (in the pool, bytes)
    t_now = p_now = 0
    for e in allocation_events(schedule):
        i = min(int(e.time), n)
        if e.action == "alloc":
            in_pool = i < n and e.key in swapped_in[i]
            held[e.key] = (in_pool, e.nbytes)
            t_now, p_now = t_now + (0 if in_pool else e.nbytes), p_now + (e.nbytes if in_pool else 0)
        else:
            in_pool, nbytes = held.pop(e.key, (False, e.nbytes))
            t_now, p_now = t_now - (0 if in_pool else nbytes), p_now - (nbytes if in_pool else 0)
        torch_side[i], pool[i] = max(torch_side[i], t_now), max(pool[i], p_now)
    first, last = full.first_use, full.last_use
    other = [0] * (n + 2)   # not managed: a difference array over each one's life
    for v, var in full.variables.items():
        if v in schedule.sequence.variables or v not in first:
            continue
        other[0 if var.live_in else first[v]] += var.nbytes
        other[(n if var.live_out else last[v]) + 1] -= var.nbytes
    running, unmanaged = 0, []
    for i in range(n + 1):
        running += other[i]
        unmanaged.append(running)
    t_peak = max(t + u for t, u in zip(torch_side, unmanaged))
    return {"torch": t_peak, "pool": max(pool), "sum": t_peak + max(pool),
            "one_arena": max(t + p + u for t, p, u in zip(torch_side, pool, unmanaged))}


def main() -> int:
    p = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--results", type=Path, default=HERE / "results" / "gpu.json")
    p.add_argument("--profiles", type=Path, default=HERE / "profiles" / "h100")
    args = p.parse_args()
    measured = json.loads(args.results.read_text())
    rows = []
    for r in measured["rows"]:
        if r["method"] != "ooc" or r["case"] not in ("resnet50", "gpt2") or not r.get("step_ms"):
            continue
        full = VariableSequence.from_json(args.profiles / f"{r['case']}.json")
        seq = managed_view(full)
        plan = scheduler.plan(seq, budget=r["budget_bytes"], hardware=default_hardware(seq), recompute="auto")
        m = arenas(full, plan)
        rows.append([r["label"], f"{r['budget_fraction']:g} ({r['budget_bytes'] / GiB:.2f} GiB)",
                     f"{r['torch_peak_bytes'] / GiB:.2f} GiB", f"{m['torch'] / GiB:.2f} GiB",
                     f"{r['pool_peak_bytes'] / GiB:.2f} GiB", f"{m['pool'] / GiB:.2f} GiB",
                     f"{r['peak_bytes'] / GiB:.2f} GiB", f"{m['sum'] / GiB:.2f} GiB",
                     f"{m['one_arena'] / GiB:.2f} GiB"])
    lines = [f"Measured: {args.results.relative_to(HERE.parent)} ({measured.get('gpu')}, commit "
             f"{measured.get('commit')}); modelled: the plan of {args.profiles.relative_to(HERE.parent)}'s "
             "profile at the row's budget. See the module docstring for what each column counts.", "",
             *common.md_table(["case", "budget", "PyTorch measured", "PyTorch modelled", "pool measured",
                               "pool modelled", "total measured", "total modelled", "one arena, modelled"],
                              rows)]
    common.write_report(common.result_path("gpu-memory", False, out=args.out),
                        common.header("ooc's device memory on a GPU, by arena", quick=False) + [""] + lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
