"""``ooc demo``: its table says what its figures are, ``--json`` gives them as data, and one
real run (small) trains out of core bit for bit like in core."""

from __future__ import annotations

import json

import pytest

from ooc.cli import cmd_demo, main
from ooc.measure import Case, CaseResult, steady_steps

MiB = 1 << 20


def _result(method: str, steps: int, *, bytes_out: int = 0) -> CaseResult:
    stats = None
    if method == "ooc":
        stats = {"last_stall_s": 0.01, "plan.bytes_in": bytes_out, "plan.bytes_out": bytes_out,
                 "plan.in_core_peak_bytes": 40 * MiB, "plan.functions": 100}
    return CaseResult(case=Case(model="small_cnn", batch=2, method=method, steps=steps),
                      step_s=tuple(0.1 * (k + 1) for k in range(steps)), baseline_rss_bytes=0,
                      peak_rise_bytes=(80 if method == "incore" else 30) * MiB,
                      peak_total_bytes=400 * MiB, losses=(1.0,) * steps, stats=stats)


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 6, 8])
def test_the_step_time_note_says_which_steps_the_median_is_of(steps):
    table = cmd_demo._table(_result("incore", steps), _result("ooc", steps, bytes_out=MiB), 10 * MiB, True)
    note = table[table.index("peak memory of training ="):]
    kept = steady_steps(steps)
    if kept.start == 0:
        assert "only step" in note
    elif len(kept) == 1:
        assert f"step time = that of step {kept.start + 1} of {steps}" in note
    else:
        assert f"step time = the median of steps {kept.start + 1}-{kept.stop} of {steps}" in note
    assert ("first two steps" in note) == (kept.start == 2)
    assert ("first three steps" in note) == (kept.start == 3)
    assert ("first four steps" in note) == (kept.start == 4)
    assert "nothing was swapped" not in table


def test_the_ratio_column_has_a_heading():
    table = cmd_demo._table(_result("incore", 5), _result("ooc", 5, bytes_out=MiB), 10 * MiB, True)
    header = table.lstrip("\n").splitlines()[0]
    ratio_row = next(line for line in table.splitlines() if line.startswith("step time (median)"))
    assert header.rstrip().endswith("ooc vs in-core")
    assert ratio_row.rstrip().endswith("x")
    assert header.index("ooc vs in-core") == ratio_row.rindex(" ") + 1  # the heading sits above it


def test_a_budget_that_holds_everything_is_said_to_swap_nothing():
    table = cmd_demo._table(_result("incore", 5), _result("ooc", 5, bytes_out=0), 1 << 30, True)
    assert "nothing was swapped" in table and "40 MiB" in table


def test_json_is_one_object_with_the_figures_and_progress_stays_off_stdout(monkeypatch, capsys):
    calls = []

    def fake_run_case(case, *, on_step=None):
        calls.append(case)
        for k in range(case.steps):
            on_step(k)
        return _result(case.method, case.steps, bytes_out=3 * MiB)

    monkeypatch.setattr(cmd_demo, "run_case", fake_run_case)
    monkeypatch.setattr(cmd_demo, "managed_peak", lambda *a, **k: 64 * MiB)
    monkeypatch.setattr(cmd_demo, "same_parameters", lambda a, b: True)
    assert main(["demo", "--steps", "5", "--batch", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    info = json.loads(out)
    assert info["budget"] == 16 * MiB and info["managed_peak_bytes"] == 64 * MiB
    assert [c.budget for c in calls] == [None, 16 * MiB]
    assert info["incore"]["median_of_steps"] == [3, 4, 5]
    assert info["ooc"]["bytes_out_per_step"] == 3 * MiB and info["bitwise_identical"] is True
    assert info["step_time_ratio"] == pytest.approx(1.0)
    assert info["incore"]["peak_rise_bytes"] == 80 * MiB and info["ooc"]["peak_rise_bytes"] == 30 * MiB


def test_a_small_real_demo_swaps_and_matches_bit_for_bit(capsys):
    """Two fresh processes (in core, then a quarter of the managed peak): ~10 s."""
    assert main(["demo", "--batch", "2", "--steps", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bitwise_identical"] is True
    assert info["budget"] < info["managed_peak_bytes"] and info["ooc"]["bytes_out_per_step"] > 0
    assert info["incore"]["median_of_steps"] == [2]


def test_the_table_says_what_was_recomputed_and_how_many_steps_ran_at_the_hooks_alone():
    ooc_ = _result("ooc", 14, bytes_out=MiB)
    ooc_.stats.update({"plan.bytes_recomputed": 5 * MiB, "steps.anchored": 8, "steps.plain": 0})
    table = cmd_demo._table(_result("incore", 14), ooc_, 10 * MiB, True)
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "5 MiB" in rows["recomputed per step (plan)"]
    assert "8 of 14 (8 anchored)" in rows["steps without op interception"]
    assert "keeps the faster" in table

    quiet = cmd_demo._table(_result("incore", 5), _result("ooc", 5, bytes_out=MiB), 10 * MiB, True)
    rows = {line.split("  ")[0]: line for line in quiet.splitlines()}
    assert rows["steps without op interception"].split()[-3:] == ["0", "of", "5"]
    assert "keeps the faster" not in quiet
