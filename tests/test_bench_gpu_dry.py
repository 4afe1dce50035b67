"""bench_gpu's quick run, DRY, over ooc's FAKE CUDA driver: no GPU here, so this checks the
benchmark's own code (every method, the step forms, profiles, the report and gpu.json), not
any GPU figure. The validation runs on a lent GPU rarely and for minutes: a bug in the
script found there costs a run.

``torch.cuda``'s timing and memory calls are stubbed (events on the host clock, a constant
peak), the cases train on the CPU (``gpu_cases.DEVICE = "cpu"``) and the engines run over
``ooc.testing.fake_cuda()``. THE FIGURES IT WRITES MEAN NOTHING; the test reads only what
ran, bitwise, and what the report says.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import types
from pathlib import Path

import pytest
import torch


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
MiB = 1 << 20


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def dry_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_cases
    import gpu_link

    monkeypatch.setattr(gpu_cases, "DEVICE", "cpu")
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 40 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: 48 * MiB)
    caps = []   # the headline's caps, each released after (1.0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, *a: caps.append(f))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(
        name="FAKE (dry run)", total_memory=16 << 30, multi_processor_count=0))
    monkeypatch.setattr(gpu_link, "bandwidth", lambda quick: (["(dry run)"], {"h2d": 50e9, "d2h": 50e9}))
    real_save_on_cpu = torch.autograd.graph.save_on_cpu
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu",
                        lambda pin_memory=False, **k: real_save_on_cpu(pin_memory=False, **k))
    from ooc.testing import fake_cuda

    # what a run changes for the whole process, which the suite's process goes on with after it
    process_wide = lambda: (torch.are_deterministic_algorithms_enabled(), signal.getsignal(signal.SIGTERM))  # noqa: E731
    before = process_wide()
    with fake_cuda(memory_bytes=2 << 30, granularity=2 * MiB) as driver:
        driver.caps = caps
        yield driver
    assert driver.violations == []
    # (left on, deterministic mode filled each later torch.empty with 255s: a test of the CPU
    # allocator's pages run after it in the same process read them)
    assert process_wide() == before
    assert caps[-1:] in ([], [1.0]) and caps.count(1.0) * 2 == len(caps), caps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_gpu_quick_runs_dry_over_the_fake_driver(dry_gpu, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE DRIVER: every method of every quick case and each step form trains, in-core runs
    repeat bitwise, each ooc run is bitwise equal to in-core, and gpu.md / gpu.json / the
    profiles are written with issue 38's keys."""
    import bench_gpu

    out = tmp_path / "gpu-quick.md"
    # every method's code once (checkpointing every 2nd block and swap only are the same code
    # with another argument): the suite's time is shared
    # (one arena's rows: the next test, which runs the next GPU run's command)
    methods = "in-core-repeat,checkpoint-every-block,save_on_cpu,ooc,ooc-matched"
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--steps", "1", "--out", str(out), "--no-compile",
                                      "--methods", methods, "--cases", "resnet50,llama",
                                      "--no-sanitizer", "--profiles", str(tmp_path / "profiles"),
                                      "--recordings", str(tmp_path / "rec")])
    code = bench_gpu.main()
    data = json.loads(out.with_suffix(".json").read_text())
    rows = data["rows"] + data["step_forms"]
    broken = [(r["label"], r["method"], r["error"]) for r in rows if r["error"]]
    assert not broken, broken
    assert code == 0
    ran = {(r["case"], r["method"]) for r in data["rows"]}
    for case in ("resnet50", "llama"):   # GPT-2's code is the zoo's, as ResNet-50's
        for method in ("in-core", *methods.split(",")):
            if method.startswith("ooc-matched"):   # a row, or a line saying why no budget reaches the peak
                assert (case, method) in ran or any(f"{method} to" in n for n in data["not_run"]), data["not_run"]
                continue
            assert (case, method) in ran
    keys = {"case", "method", "budget_fraction", "step_ms", "samples_per_s", "peak_bytes",
            "bytes_moved", "bytes_recomputed", "bitwise", "predicted_step_ms"}
    assert keys <= set(data["rows"][0])
    assert all(r["wall_s"] > 0 for r in rows), "each row's wall time: what plans a GPU session's minutes"
    assert all(r["bitwise"] for r in rows if r["method"] != "in-core"), \
        [(r["label"], r["method"]) for r in rows if r["method"] != "in-core" and not r["bitwise"]]
    ooc_rows = [r for r in data["rows"] if r["method"].startswith("ooc")]
    assert all(r["predicted_step_ms"] for r in ooc_rows)
    assert any(r["bytes_moved"] for r in ooc_rows), "no ooc run moved a byte: budgets not binding"
    pool = [r for r in data["rows"] if r["method"] == "ooc"]   # the VMM pool's, asked for by name
    assert len(pool) == 4 and all(r["pool_peak_bytes"] > 0 for r in pool if r["bytes_moved"]), pool
    profiles = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert profiles == ["llama.json", "resnet50.json"]
    from scheduler.ir import VariableSequence

    seq = VariableSequence.from_json(tmp_path / "profiles" / "llama.json")
    assert seq.meta["case"] == "llama" and seq.meta["in_core_step_ms"] > 0
    assert all(f.cost.seconds is not None for f in seq.functions)
    text = out.read_text()
    assert "## Side by side" in text
    # the host cost section: its five runs and the profile of a per-op step, which ran per op
    host = text.split("## Host cost per op", 1)[1].split("\n## ", 1)[0]
    assert "FAILED" not in host, host
    for run in ("| in-core |", "| dispatch mode only |", "| ooc per op |", "| ooc per op, every op looked at |",
                "| ooc |", "`on_op`"):
        assert run in host, (run, host)
    assert "| ooc per op |" in host and "plain" in host.split("| ooc |", 1)[1].split("\n", 1)[0], host
    # the headline: the largest batch found by bisection, in core under the cap, the
    # uncapped reference at 4x, and an ooc try at 4x bitwise against it
    head = text.split("## nnabla's headline", 1)[1].split("\n## ", 1)[0]
    assert "FAILED" not in head and "Largest in-core batch under a 0.5 GiB cap: **4**" in head, head
    for arena in ("ooc", "ooc-one-arena"):   # a try in each arena, bitwise against the uncapped in core
        tries = [r for r in data["headline"] if r["method"] == arena]
        assert tries and tries[0]["label"] == "ResNet-50 b16" and tries[0]["bitwise"] is True, data["headline"]
    # one arena's first try fits (nothing is short under the dry cap): the next tries a larger budget
    one = [r for r in data["headline"] if r["method"] == "ooc-one-arena"]
    assert len(one) >= 2 and not one[0]["error"] and one[1]["budget_bytes"] > one[0]["budget_bytes"], one
    assert dry_gpu.caps and all(0 < f <= 1 for f in dry_gpu.caps)


@pytest.mark.timeout(600)
def test_the_next_gpu_runs_command_runs_dry(dry_gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE DRIVER: the command docs/guide/gpu.md gives for the next GPU run (one arena, at 1/2
    and 1/4, matched to each checkpointing peak on the profile's curve, and with a budget for
    the whole step at each peak, its plans bounded op by op), on the quick ResNet-50: the chosen
    methods run, bitwise, and no other; one arena's rows are PyTorch's allocator's; the bounded
    rows' budget is the whole step's, under the alternative's peak."""
    import bench_gpu

    out = tmp_path / "gpu-quick.md"
    methods = "checkpoint-every-block,checkpoint-every-2nd,ooc-one-arena,ooc-matched-one-arena,ooc-matched-bounded"
    doc = (BENCHMARKS.parent / "docs" / "guide" / "gpu.md").read_text()
    assert f"--no-headline --cases resnet50 --methods {methods}`" in doc, "the test runs what the guide says"
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--steps", "1", "--out", str(out), "--no-compile",
                                      "--no-profiles", "--methods", methods, "--cases", "resnet50",
                                      "--no-sanitizer", "--no-forms", "--no-headline", "--no-host-cost"])
    assert bench_gpu.main() == 0
    data = json.loads(out.with_suffix(".json").read_text())
    ran = {r["method"] for r in data["rows"]}
    matched = {"ooc-matched-one-arena", "ooc-matched-bounded"}
    assert {"in-core", *methods.split(",")} - matched <= ran <= {"in-core", *methods.split(",")}
    assert all(m in ran or any(f"{m} to" in n for n in data["not_run"]) for m in matched), data["not_run"]
    assert all(r["bitwise"] for r in data["rows"] if r["method"] != "in-core"), data["rows"]
    # the host's time to queue each step (the Llama's in-core row gives bench_hook_bound's h0)
    assert all(r["queued_ms"] is not None for r in data["rows"]), data["rows"]
    # the host's waits inside each ooc step: what tells a host-bound step from one that waits
    assert all(r["stall_ms"] is not None and r["stall_ms"] >= 0 for r in data["rows"]
               if r["method"].startswith("ooc")), data["rows"]
    # the op times each ooc row planned on, added up: what tells an overstated recording
    assert all(r["priced_op_ms"] > 0 for r in data["rows"] if r["method"].startswith("ooc")), data["rows"]
    one = [r for r in data["rows"] if r["method"] == "ooc-one-arena"]
    assert len(one) == 2 and all(r["pool_peak_bytes"] == 0 and "in PyTorch's allocator" in r["note"] for r in one), one
    assert any(r["bytes_moved"] for r in one), "one arena moved nothing: its budgets were not binding"
    # a budget for the whole step at each peak: it ran under it in PyTorch's allocator, or was
    # refused with the least that works (the quick case's weights and momentum, 300 MiB, are
    # over these tiny peaks: the fake device counts only what the step allocates)
    peaks = {r["method"]: r["peak_bytes"] for r in data["rows"] if r["method"].startswith("checkpoint")}
    bounded = [r for r in data["rows"] if r["method"] == "ooc-matched-bounded"]
    refused = [n for n in data["not_run"] if "ooc-matched-bounded to" in n and "BudgetTooSmall" in n]
    assert len(bounded) + len(refused) == len(peaks), (bounded, data["not_run"])
    assert all(r["budget_bytes"] < max(peaks.values()) and r["pool_peak_bytes"] == 0 for r in bounded), bounded


@pytest.mark.timeout(300)
def test_the_gpu_probe_runs_dry(dry_gpu, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """FAKE DRIVER: benchmarks/gpu_probe.py (what found the signature bug on an H200) on the
    quick ResNet-50: each row trains bitwise, also past the signature check ("relaxed"), and
    each row's last step is profiled, in core's too, and in core runs again under saved-tensor
    hooks that do nothing."""
    import gpu_probe

    assert gpu_probe.main(["--quick", "--steps", "1", "--cases", "resnet50", "--fractions", "0.25",
                           "--relaxed", "0.25", "--profiles", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "ooc-one-arena 0.25" in line]
    assert len(rows) == 2 and "relaxed" in rows[1], rows
    assert all("bitwise True error ''" in r and " GiB " in r for r in rows), rows
    assert "in-core, saved-tensor hooks that do nothing" in out
    assert out.count("profiled step: the host waited") == 2
    assert out.count("function calls") == 3, "each row's last step under cProfile, in core's too"
    whole = sorted(p.name for p in tmp_path.iterdir())
    assert whole == ["resnet50-in-core.txt", "resnet50-ooc-one-arena-0.25-relaxed.txt",
                     "resnet50-ooc-one-arena-0.25.txt"], whole
    assert "cumulative" in (tmp_path / "resnet50-ooc-one-arena-0.25.txt").read_text()
    assert "MISMATCH" not in out


def test_what_is_live_at_a_steps_peak_is_summed_by_where_it_was_allocated() -> None:
    """gpu_probe.peak_lines on an allocator trace: the peak is of allocated bytes (a block
    counts until its free completes), and each block live then is summed by the innermost frame
    of ooc or the model; what the step frees of the blocks it began with is taken off them."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_probe import peak_lines

    swap = [{"filename": "/x/torch/autograd/graph.py", "line": 1, "name": "run_backward"},
            {"filename": "/work/ooc/runtime/slots.py", "line": 155, "name": "start_swap_in"}]
    model = [{"filename": "/v/site-packages/transformers/models/llama/modeling_llama.py", "line": 62,
              "name": "forward"}]
    G = 2**30
    events = [{"action": "alloc", "addr": 1, "size": 2 * G, "frames": model},
              {"action": "free_requested", "addr": 9, "size": G},   # a block from before the step
              {"action": "free_completed", "addr": 9, "size": G},
              {"action": "alloc", "addr": 2, "size": 3 * G, "frames": swap},
              {"action": "alloc", "addr": 3, "size": G, "frames": swap},
              {"action": "free_requested", "addr": 2, "size": 3 * G},
              {"action": "free_completed", "addr": 2, "size": 3 * G},
              {"action": "alloc", "addr": 4, "size": G, "frames": model}]
    text = peak_lines(events, 4 * G, "case")
    assert text.splitlines()[0].startswith("MEMORY case: peak 9.00 GiB allocated (event 4 of 8; 4.00 GiB")
    body = {line.split("GiB", 1)[1].strip(): float(line.split("GiB", 1)[0])
            for line in text.splitlines()[1:-1]}
    assert body == {"runtime/slots.py:155 start_swap_in": 4.0, "llama/modeling_llama.py:62 forward": 2.0,
                    "(allocated before the step, still live)": 3.0}, body
    assert text.splitlines()[-1] == "  the peak's allocation: 1024.0 MiB at runtime/slots.py:155 start_swap_in"
    # a name belongs to the last block allocated at its address by then: block 4 is named
    # after the peak; the name given block 3 after the step's 3rd allocation is block 3's
    named = peak_lines(events, 4 * G, "case", names=[(3, 3, "swapped in layer1.0.relu"), (4, 4, "recomputed x"),
                                                     (1, 3, "recomputed y")])
    lines = named.splitlines()
    assert "  of which a slot's bytes: 3.000 GiB in 2 blocks; the rest: 3.000 GiB" in lines, lines
    assert lines.index("      2.000 GiB  recomputed y") < lines.index("      1.000 GiB  swapped in layer1.0.relu")
    reused = events + [{"action": "free_completed", "addr": 3, "size": G},
                       {"action": "alloc", "addr": 3, "size": G, "frames": swap}]
    later = peak_lines(reused, 4 * G, "case", names=[(3, 5, "recomputed z")])   # block 3's second life
    assert "  of which a slot's bytes: 0.000 GiB in 0 blocks; the rest: 6.000 GiB" in later.splitlines()
    engine = peak_lines([{"action": "alloc", "addr": 7, "size": G, "frames": []}], 0, "case")
    assert "    1.000 GiB  (no Python frame: the autograd engine's)" in engine.splitlines(), engine


@pytest.mark.parametrize("limit", [0, 1, 7, 8, 9, 100, 255, 256, 511, 512, 600])
def test_the_largest_batch_that_fits_is_found_by_bisection(limit: int) -> None:
    """The headline's search: the largest multiple of 8 up to 512 that fits, in few tries."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_headline import largest_batch

    tried = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= limit

    got = largest_batch(fits, 8, 512)
    assert got == (0 if limit < 8 else min(512, limit // 8 * 8))
    assert len(tried) <= 8 and all(b % 8 == 0 for b in tried)


def test_gpu_memory_models_each_measured_row_in_two_arenas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_memory.py on the committed H100 results and profiles: one line per
    measured ooc row of ResNet-50 and GPT-2; the modelled total is the two arenas' peaks
    added, and one arena never holds more than that sum nor less than either arena."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_memory
    from scheduler.arenas import device_peaks
    from scheduler.ir import VariableSequence
    from scheduler.managed import managed_view
    from scheduler.recompute import default_hardware

    out = tmp_path / "gpu-memory.md"
    monkeypatch.setattr(sys, "argv", ["gpu_memory.py", "--quick", "--out", str(out)])
    assert gpu_memory.main() == 0
    text = out.read_text()
    rows = [line for line in text.split("\n## ")[0].splitlines() if line.startswith(("| ResNet", "| GPT"))]
    assert len(rows) == 4, rows
    matched = text.split("## At each alternative's peak, one arena predicted", 1)[1].split("\n## ", 1)[0]
    verdicts = [line.rsplit("|", 2)[1].strip() for line in matched.splitlines() if line.startswith(("| ResNet", "| GPT"))]
    assert len(verdicts) == 4 and set(verdicts) <= {"faster", "slower", "none fits"}, matched
    head = text.split("## nnabla's headline, predicted: ResNet-50 b576", 1)[1]
    predicted = [line for line in head.splitlines() if line.startswith("| ") and "GiB |" in line]
    assert len(predicted) == 8 and any("(over)" in line for line in predicted), predicted
    full = VariableSequence.from_json(BENCHMARKS / "profiles" / "h100" / "resnet50.json")
    seq = managed_view(full)
    import scheduler

    m = device_peaks(full, scheduler.plan(seq, budget=seq.in_core_peak_bytes // 4, hardware=default_hardware(seq)))
    assert m.two_arenas == m.torch + m.pool
    assert max(m.torch, m.pool) <= m.one_arena <= m.two_arenas
    assert m.pool > 0 and m.torch > seq.in_core_peak_bytes // 4   # swaps happen; PyTorch holds more than the budget


@pytest.mark.parametrize("points, peak, budget", [
    ([(5, 10), (10, 16)], 13, 7.5),          # on the line through the two
    ([(5, 10), (10, 16)], 22, 15),           # beyond them
    ([(5, 10), (10, 16)], 4, None),          # under ooc's fixed part: no budget
    ([(5, 10)], 9, None),                    # one point cannot tell
    ([(5, 10), (10, 10)], 9, None),          # a flat line cannot tell
    ([(1, 3), (5, 10), (10, 16)], 13, 7.5),  # the pair that brackets the peak
    ([(5, 8), (10, 11), (15, 17)], 14, 12.5),  # bracketing, not the two largest: the bend past 10
    ([(5, 8), (10, 11), (15, 17)], 20, 17.5),  # all under: the two largest budgets
    ([(5, 10), (10, 16), (20, 40)], 7, 2.5),   # all over: the two smallest budgets
    ([(5, 10), (10, 11), (20, 21)], 14, 13),   # flat ooc rows, in core's point above them
])
def test_the_budget_matched_to_an_alternatives_peak(points, peak, budget) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from bench_gpu import matched_budget

    assert matched_budget([(b << 30, p << 30) for b, p in points], peak << 30) == (
        None if budget is None else int(budget * 2**30))


@pytest.mark.parametrize("peak, step, again", [
    (9.5, 150.0, True),     # over the alternative's peak: between
    (8.73, 163.1, True),    # ResNet-50 at db63edf: slower, 0.6 GiB unused: nearer
    (8.73, 150.0, False),   # faster already, at less memory: done
    (9.10, 163.1, False),   # slower but at the aim: done, a tie or a loss as measured
    (8.73, None, False),    # no time (a failed row): nothing to compare
])
def test_a_matched_try_is_tried_again_over_the_peak_or_slower_well_under_it(peak, step, again) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from bench_gpu import tries_again

    assert tries_again(int(peak * 2**30), step, int(9.32 * 2**30), 159.2) is again


def test_a_profile_scaled_to_a_larger_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_memory.scaled: what grows with the batch grows in proportion, the rest does not."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_memory
    from scheduler.ir import VariableSequence

    full = VariableSequence.from_json(BENCHMARKS / "profiles" / "h100" / "resnet50.json")
    big = gpu_memory.scaled(full, 2.25)
    opt = full.meta["optimizer_start"]
    for v, w in zip(full.variables.values(), big.variables.values()):
        assert w.nbytes == (v.nbytes if v.kind.value in ("param", "grad", "optimizer_state") else int(v.nbytes * 2.25))
    for i, (f, g) in enumerate(zip(full.functions, big.functions)):
        assert g.cost.seconds == pytest.approx(f.cost.seconds * (2.25 if i < opt else 1.0))
    assert 2.0 * full.in_core_peak_bytes < big.in_core_peak_bytes < 2.25 * full.in_core_peak_bytes


def test_a_plan_made_from_noisy_op_times_is_priced_on_the_true_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_plan_noise: the noise changes only op times (sigma 0 changes nothing), and a plan
    simulated on the true sequence is the plan's own simulation when its times are the true ones."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import random

    import bench_plan_noise as pn
    import scheduler
    from scheduler.ir import VariableSequence
    from scheduler.managed import managed_view
    from scheduler.recompute import default_hardware

    seq = managed_view(VariableSequence.from_json(BENCHMARKS / "profiles" / "h100" / "resnet50.json"))
    hw = default_hardware(seq)
    same, other = pn.noisy(seq, 0.0, random.Random(1)), pn.noisy(seq, 0.1, random.Random(1))
    assert [f.cost for f in same.functions] == [f.cost for f in seq.functions]
    changed = [a.cost.seconds != b.cost.seconds for a, b in zip(seq.functions, other.functions) if a.cost.seconds]
    assert all(changed) and [f.uses for f in other.functions] == [f.uses for f in seq.functions]
    plan = scheduler.plan(other, budget=seq.in_core_peak_bytes // 4, hardware=hw)
    assert pn.step_on(plan, other, hw) == scheduler.simulate(plan, hw, timeline=False).total_s
    assert pn.step_on(plan, seq, hw) != pn.step_on(plan, other, hw)   # priced on the other times


def test_expandable_segments_are_set_for_the_whole_run_and_said(dry_gpu, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE DRIVER: ``--expandable-segments`` sets PyTorch's allocator setting before any CUDA
    work, keeping what the environment had, and the report's header says which setting ran."""
    import bench_gpu

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    out = tmp_path / "gpu-quick.md"
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--steps", "1", "--out", str(out), "--no-compile",
                                      "--no-profiles", "--methods", "ooc-one-arena", "--cases", "resnet50",
                                      "--no-sanitizer", "--no-forms", "--no-headline", "--no-host-cost",
                                      "--expandable-segments"])
    assert bench_gpu.main() == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF 'max_split_size_mb:512,expandable_segments:True'" in out.read_text()


def test_the_gpu_probe_clocks_each_plan_action_dry(dry_gpu, capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE DRIVER: ``gpu_probe.py --clocks`` on the quick ResNet-50 at 1/4 (a plan that swaps
    and recomputes): its last step's host time inside ooc, with the hooks' calls counted and
    each kind of action's calls and mean time, and the row still bitwise. The anchored form is
    kept whatever its trial's clocks say: on a loaded machine the per-op steps won the trial
    once, and the last step had no hook to count."""
    import gpu_probe
    import ooc.engine.hook_forms as hook_forms
    from scheduler.anchoring import judge

    monkeypatch.setattr(hook_forms, "judge", lambda *a, **kw: None if judge(*a, **kw) is None else True)

    assert gpu_probe.main(["--quick", "--steps", "1", "--cases", "resnet50", "--fractions", "0.25",
                           "--clocks"]) == 0
    out = capsys.readouterr().out
    clocked = [line for line in out.splitlines() if line.startswith("clocked step (")]
    assert len(clocked) == 1, out
    m = re.search(r"inside ooc ([\d.]+) ms \((\d+) packs, (\d+) unpacks\), of which replays ([\d.]+) ms", clocked[0])
    assert m and float(m[1]) > 0 and int(m[2]) > 0 and int(m[3]) > 0, clocked
    actions = dict((op, int(n)) for op, n in re.findall(r"(\w+) (\d+) x [\d.]+ us", clocked[0]))
    assert actions.get("free", 0) > 0 and (actions.get("swap_out", 0) > 0 or actions.get("discard", 0) > 0), actions
    assert "function calls" not in out, "clocks, not the profiler"
    row = [line for line in out.splitlines() if "ooc-one-arena 0.25" in line and "bitwise" in line]
    assert row and "bitwise True error ''" in row[0], row
