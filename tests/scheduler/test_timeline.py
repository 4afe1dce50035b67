"""Chrome/Perfetto traces: valid JSON, one named thread per track, a slice per step."""

from __future__ import annotations

import json

import pytest

from scheduler.timeline import Event, to_chrome_trace, write_chrome_trace


def _events() -> list[Event]:
    return [
        Event("compute", "conv", 0.0, 0.002, step=0, args={"function": 0}),
        Event("swap-out", "a0", 0.002, 0.005, step=0),
        Event("wait", "wait_out a0", 0.003, 0.005, step=0),
        Event("compute", "relu", 0.005, 0.006, step=0),
        Event("swap-in", "a0", 0.006, 0.008, step=1),
        Event("compute", "conv", 0.008, 0.010, step=1),
    ]


def _threads(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_trace_file_parses_and_has_the_tracks(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(_events(), path, process_name="sim v100")
    trace = json.loads(path.read_text())
    names = _threads(trace)
    assert sorted(names.values()) == ["compute", "step", "swap-in", "swap-out", "wait"]
    assert len(set(names)) == 5  # one tid per track
    procs = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert procs[0]["args"]["name"] == "sim v100"
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 6 + 2  # the events plus one slice per step
    by_tid = {tid: name for tid, name in names.items()}
    conv = next(e for e in slices if e["name"] == "conv" and by_tid[e["tid"]] == "compute")
    assert conv["ts"] == 0.0 and conv["dur"] == pytest.approx(2000.0)  # microseconds
    assert conv["args"] == {"step": 0, "function": 0}


def test_one_slice_per_step_spans_its_events() -> None:
    trace = to_chrome_trace(_events())
    names = _threads(trace)
    steps = sorted((e["name"], e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                   if e["ph"] == "X" and names[e["tid"]] == "step")
    assert steps == [("step 0", 0.0, pytest.approx(6000.0)),
                     ("step 1", pytest.approx(6000.0), pytest.approx(10000.0))]


def test_caller_step_track_is_kept_and_other_tracks_allowed() -> None:
    events = [Event("step", "iteration 7", 0.0, 1.0, step=7), Event("io-thread-2", "pread", 0.1, 0.4, step=7)]
    trace = to_chrome_trace(events)
    names = _threads(trace)
    assert sorted(names.values()) == ["io-thread-2", "step"]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["iteration 7", "pread"]  # no synthesized step slice


def test_empty_timeline_is_still_a_trace(tmp_path) -> None:
    path = tmp_path / "empty.json"
    write_chrome_trace([], path)
    trace = json.loads(path.read_text())
    assert [e for e in trace["traceEvents"] if e["ph"] == "X"] == []
