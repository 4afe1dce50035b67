"""What a training run shows to people and tools: a Chrome/Perfetto timeline of compute,
swaps and waits, profiler ranges around the runtime's own work, and the report picture."""

from __future__ import annotations

import json

import pytest
import torch

from ooc.cli import main
from ooc.engine import Options, OutOfCore
from test_engine import CHUNK, _data, _fresh, _loss, managed_peak


def _run(engine: OutOfCore, model: torch.nn.Module, steps: int) -> None:
    for step in range(steps):
        x, y = _data("cnn", step)
        with engine.step():
            _loss("cnn", model(x), y).backward()
            engine.optimizer_step()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model, opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", ("activations",)) // 4
    engine = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096))
    _run(engine, model, 4)
    yield engine, model
    engine.close()


def test_timeline_has_compute_swap_and_wait_tracks_per_step(trained, tmp_path) -> None:
    engine, _ = trained
    path = tmp_path / "timeline.json"
    engine.timeline(str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert {"compute", "wait", "swap-in", "swap-out"} <= threads
    transfers = [e for e in events if e.get("ph") == "X" and e["name"].startswith(("swap-in ", "swap-out "))]
    assert transfers and all(e["dur"] >= 0 for e in transfers)
    slices = [e for e in events if e.get("ph") == "X"]
    compute = [e for e in slices if e["name"].startswith("aten.")]
    assert len(compute) > 100 and all(e["dur"] >= 0 for e in slices)
    steps = {e["name"] for e in slices if e["name"].startswith("step ")}
    assert len(steps) == 4, steps


def test_the_timeline_keeps_each_event_in_a_few_bytes() -> None:
    """The timeline's last 32 steps stay in the process, which a budget for the whole step
    covers: it keeps an event as a pointer to its (track, name), shared from step to step, and
    two doubles. It kept a tuple of its own with two floats and each step's name strings:
    190 bytes an event, and a 2-layer GPT-2's steps (1,100 events each) ran 4.6 MiB over
    their step budget by the 32nd."""
    import tracemalloc

    from ooc.engine.step_book import TIMELINE_STEPS, StepBook
    from ooc.runtime.step_protocol import StepReport

    per_step = 2000
    book = StepBook()

    def step(n: int) -> StepReport:   # names made each step, as the runtime makes them
        events = tuple((track, f"{track} activation {k}", n + k * 1e-6, n + k * 1e-6 + 1e-7)
                       for k in range(per_step // 2) for track in ("compute", "swap-out"))
        return StepReport("planned", 0.1, 0.0, 0, None, events, True)

    book.book(step(0))   # its labels shared from here on
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(1, TIMELINE_STEPS):
            book.book(step(n))
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_event = kept / ((TIMELINE_STEPS - 1) * per_step)
    assert per_event <= 32, per_event   # (24 and the lists' spare room)
    events = book.events
    assert len(events) == TIMELINE_STEPS * per_step
    assert events[-1] == ("swap-out", f"swap-out activation {per_step // 2 - 1}",
                          TIMELINE_STEPS - 1 + (per_step // 2 - 1) * 1e-6,
                          TIMELINE_STEPS - 1 + (per_step // 2 - 1) * 1e-6 + 1e-7, TIMELINE_STEPS)


def test_timeline_before_any_step_is_a_clear_error(tmp_path) -> None:
    model, opt = _fresh("cnn", "sgd")
    with OutOfCore(model, opt, budget="64MiB", options=Options(chunk=CHUNK)) as engine:
        with pytest.raises(Exception, match="no step has run yet"):
            engine.timeline(str(tmp_path / "t.json"))


@pytest.mark.parametrize("kept", [False, True], ids=["per-op", "hook-driven"])
def test_swaps_and_waits_show_up_in_the_pytorch_profiler(monkeypatch, kept) -> None:
    """In either form of a planned step: the per-op one, and the hook-driven one its trial
    keeps (whose transfers and waits showed no range before: a CPU profile of a settled plan
    named nothing of ooc's). The trial's verdict is a timing, fixed here."""
    from ooc.engine import hook_forms
    from ooc.testing.forced_forms import decided
    monkeypatch.setattr(hook_forms.HookPlan, "judge", decided(keep=kept))
    model, opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", ("activations",)) // 4
    # Swap only: recompute is priced on the recording's op seconds (a fast machine's plan
    # recomputed every tensor and swapped none).
    with OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), recompute="never") as engine:
        _run(engine, model, 5)   # recorded, planned, the trial judged
        before = engine.stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(engine, model, 1)
        after = engine.stats()
        assert engine._plans.schedule.bytes_in > 0
    form = "steps.anchored" if kept else "steps.planned"
    assert after[form] == before[form] + 1, "the profiled step ran in the form under test"
    names = {e.name for e in prof.events()}
    assert any(n.startswith("ooc.swap_in ") for n in names), sorted(n for n in names if "ooc" in n)
    assert any(n.startswith("ooc.swap_out ") for n in names)
    assert any(n.startswith("ooc.wait") for n in names)


def test_report_draws_a_plan_and_plans_a_trace(tmp_path, capsys) -> None:
    trace = tmp_path / "t.json"
    assert main(["trace", "small_cnn", "--batch", "4", "-o", str(trace)]) == 0
    png = tmp_path / "r.png"
    assert main(["report", str(trace), "--budget", "8MiB", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["report", str(trace), "-o", str(png)]) == 2
    assert "give --budget" in capsys.readouterr().err
