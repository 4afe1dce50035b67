"""``ooc plan`` / ``ooc simulate`` on a GPU profile (benchmarks/profiles/): planned as the
engine plans it (``--manage``) and priced on the link the profile measured, on a machine
without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "gpt2.json"


def _ooc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ooc", *args], capture_output=True, text=True, timeout=300)


def test_simulate_a_profile_as_the_engine_plans_it_on_its_own_link() -> None:
    p = _ooc("simulate", str(PROFILE), "--budget", "4GiB", "--manage", "activations", "--json",
             "--no-progress")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    meta = json.loads(PROFILE.read_text())["meta"]
    assert r["hardware"] == "h100-80gb-pcie5"
    assert r["peak_bytes"] <= 4 << 30 and r["bytes_recomputed"] > 0
    # only the activations are planned: the parameters and Adam's state are not in the budget
    whole = _ooc("simulate", str(PROFILE), "--budget", "4GiB", "--json", "--no-progress")
    assert whole.returncode == 2 and "too small" in whole.stderr
    # the in-core step it compares with is the profile's own op times: ~ the measured step
    assert abs(r["compute_s"] * 1e3 / meta["in_core_step_ms"] - 1) < 0.05
    # the device holds the whole step's tensors, beyond the budget: weights, Adam's state,
    # the backward's temporaries; with ooc's pool beside PyTorch's allocator, both peaks
    d = r["device_peaks"]
    assert d["two_arenas"] == d["torch"] + d["pool"] and d["pool"] > 0
    assert 4 << 30 < max(d["torch"], d["pool"]) <= d["one_arena"] <= d["two_arenas"]


def test_simulate_prints_the_device_peak_by_arena() -> None:
    p = _ooc("simulate", str(PROFILE), "--budget", "4GiB", "--manage", "activations", "--no-progress")
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("device, GPU"))
    assert "with ooc's pool (PyTorch's" in line and "in one arena (arena='pytorch')" in line


def test_plan_takes_manage_and_refuses_an_unknown_kind() -> None:
    p = _ooc("plan", str(PROFILE), "--budget", "8GiB", "--manage", "activations", "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["in_core_peak_bytes"] < 18 << 30 and info["bytes_recomputed"] > 0
    bad = _ooc("plan", str(PROFILE), "--budget", "8GiB", "--manage", "weights", "--no-progress")
    assert bad.returncode == 2 and "activations, params, grads, optimizer_state" in bad.stderr


RESNET = PROFILE.parent / "resnet50.json"


def test_fit_names_the_fastest_budget_whose_device_peak_fits_and_draws_the_curve(tmp_path: Path) -> None:
    png = tmp_path / "fit.png"
    p = _ooc("fit", str(RESNET), "--device-memory", "9.5GiB", "--margin", "512MiB", "--budgets", "12",
             "--json", "--plot", str(png), "--no-progress")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["hardware"] == "h100-80gb-pcie5" and r["limit_bytes"] == 9 << 30
    fits = [c for c in r["candidates"] if c["device_peak"] <= r["limit_bytes"]]
    assert r["best"] in fits and r["best"]["step_s"] == min(c["step_s"] for c in fits)
    assert len(fits) < len(r["candidates"])   # the larger budgets do not fit
    bounded = [c for c in r["candidates"] if c["bounded"]]   # bounded by the device: each fits
    assert bounded and all(c in fits for c in bounded) and r["best"]["bounded"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    flat = json.loads(_ooc("fit", str(RESNET), "--device-memory", "9.5GiB", "--budgets", "6", "--flat-only",
                           "--json", "--no-progress").stdout)
    assert flat["candidates"] and not any(c["bounded"] for c in flat["candidates"])
    table = _ooc("fit", str(RESNET), "--device-memory", "9.5GiB", "--budgets", "6", "--no-progress")
    assert table.returncode == 0, table.stderr
    assert "<- fastest that fits" in table.stdout and "predicted, not measured" in table.stdout
    assert "budget_covers='step'" in table.stdout and "(bounded by the device)" in table.stdout


def test_simulate_bounded_plans_within_the_device_less_what_the_step_holds_beside() -> None:
    """``ooc simulate --bounded``: the budget is the device's; the plan of the managed tensors
    holds at each op at most it less what the profile holds beside them there, so one
    arena's modelled peak is within it, where the same budget as ooc's own bytes goes over."""
    bounded = _ooc("simulate", str(RESNET), "--budget", "9.5GiB", "--manage", "activations", "--bounded",
                   "--json", "--no-progress")
    assert bounded.returncode == 0, bounded.stderr
    r = json.loads(bounded.stdout)
    assert r["device_peaks"]["one_arena"] <= 9.5 * 2**30 and r["bytes_recomputed"] + r["bytes_in"] > 0
    flat = json.loads(_ooc("simulate", str(RESNET), "--budget", "9.5GiB", "--manage", "activations", "--json",
                           "--no-progress").stdout)
    assert flat["device_peaks"]["one_arena"] > 9.5 * 2**30
    bad = _ooc("simulate", str(RESNET), "--budget", "9.5GiB", "--bounded", "--no-progress")
    assert bad.returncode == 2 and "give --manage" in bad.stderr


def test_fit_says_what_the_lowest_peak_is_when_no_budget_fits() -> None:
    p = _ooc("fit", str(RESNET), "--device-memory", "3GiB", "--margin", "0", "--budgets", "4", "--no-progress")
    assert p.returncode == 2
    assert "no budget fits 3 GiB" in p.stderr and "the lowest modelled device peak is" in p.stderr
    same = _ooc("fit", str(RESNET), "--device-memory", "1GiB", "--margin", "1GiB", "--no-progress")
    assert same.returncode == 2 and "leaves nothing" in same.stderr
