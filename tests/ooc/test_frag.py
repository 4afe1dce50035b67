"""ooc frag: snapshot/CSV/ooc inputs, the allow-listing unpickler, the verdicts, the exports.

No snapshot here comes from ``torch.cuda.memory._record_memory_history``: that needs a CUDA
device and this machine has none. The snapshots are built by hand in the format documented
in ``torch/cuda/memory.py`` (``_snapshot``: ``segments`` with ``blocks``, ``device_traces`` of
trace entries) and read by ``torch/cuda/_memory_viz.py``, with the keys a real one carries
(``device``, ``segment_type``, ``segment_pool_id``, ``frames``, ``time_us``, ``stream``...).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

from ooc import frag
import ooc.frag.report
from ooc.cli import main
from ooc.frag.inputs import sequence_events, snapshot_to_trace
from ooc.frag.safe_pickle import UnsafePickleError, safe_load
from scheduler import Cost, Kind, Variable, build_sequence

MiB = 1 << 20
BASE = 0x7F3A_0000_0000
FRAMES = [{"filename": "train.py", "line": 42, "name": "forward"},
          {"filename": "torch/nn/modules/linear.py", "line": 125, "name": "forward"}]


# -- fixtures ---------------------------------------------------------------------------------


def _sequence():
    """A small training step: a parameter, six activations saved in the forward and read
    back in reverse by the backward, and a temporary per backward op."""
    variables = [Variable(0, 4 * MiB, Kind.PARAM, name="w", live_in=True, live_out=True)]
    fns = []
    for i in range(6):
        variables.append(Variable(1 + i, (3 + 2 * i) * MiB + 4096 * i, Kind.ACTIVATION, name=f"act{i}"))
        fns.append((f"fwd{i}", [(0, "r")] + ([(i, "r")] if i else []) + [(1 + i, "w")], Cost()))
    for i in reversed(range(6)):
        t = 10 + i
        variables.append(Variable(t, (5 + i) * MiB + 123, Kind.TEMPORARY, name=f"tmp{i}"))
        fns.append((f"bwd{i}", [(0, "r"), (1 + i, "r"), (t, "w")], Cost()))
    return build_sequence(fns, variables)


def _checkerboard_snapshot(path, *, device_free=80 * MiB, traces_for_two_devices=True):
    """What PyTorch records for a classic fragmentation OOM.

    32 allocations of 8 MiB: each is below kMinLargeAlloc (10 MiB), so each 20 MiB segment
    takes two (8 + 8, 4 MiB left over). Freeing every other one leaves 16 segments with
    8 MiB and 4 MiB holes: 192 MiB reserved but free, none of it contiguous beyond 8 MiB.
    Then a 160 MiB request needs a fresh segment, and the device (80 MiB free) says no.
    Live at that point: 128 MiB of the 400 MiB this process could have had.
    """
    trace = []
    t = [1_700_000_000_000_000]

    def entry(**kw):
        t[0] += 17
        kw.setdefault("stream", 0)
        kw.setdefault("frames", FRAMES)
        kw["time_us"] = t[0]
        trace.append(kw)

    starts = [BASE + k * 32 * MiB for k in range(16)]
    for sa in starts:
        entry(action="segment_alloc", addr=sa, size=20 * MiB)
        entry(action="alloc", addr=sa, size=8 * MiB)
        entry(action="alloc", addr=sa + 8 * MiB, size=8 * MiB)
    for sa in starts:
        entry(action="free_requested", addr=sa, size=8 * MiB)
        entry(action="free_completed", addr=sa, size=8 * MiB)
    entry(action="oom", size=160 * MiB, device_free=device_free)  # OOM entries carry no addr
    entry(action="snapshot", addr=0, size=0)
    segments = []
    for sa in starts:
        segments.append({
            "device": 0, "address": sa, "total_size": 20 * MiB, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "allocated_size": 8 * MiB, "active_size": 8 * MiB, "requested_size": 8 * MiB,
            "frames": FRAMES,
            "blocks": [
                {"address": sa, "size": 8 * MiB, "requested_size": 0, "state": "inactive", "frames": []},
                {"address": sa + 8 * MiB, "size": 8 * MiB, "requested_size": 8 * MiB,
                 "state": "active_allocated", "frames": FRAMES},
                {"address": sa + 16 * MiB, "size": 4 * MiB, "requested_size": 0, "state": "inactive",
                 "frames": []}]})
    snap = {"segments": segments, "device_traces": [trace, []] if traces_for_two_devices else [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1}}
    with open(path, "wb") as fh:
        pickle.dump(snap, fh)
    return snap


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _json(argv, capsys):
    code, out, err = _run([*argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


# -- the allow-listing unpickler ---------------------------------------------------------------


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_payload_really_runs_with_plain_pickle(tmp_path):
    """The attack used below is live: plain pickle (in a child process) runs it."""
    marker = tmp_path / "ran-plain"
    data = pickle.dumps({"segments": [], "device_traces": [[_Evil(marker)]]})
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=data, check=True)
    assert marker.exists()


def test_allow_list_refuses_os_system_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Evil(marker)]]}))
    with pytest.raises(UnsafePickleError, match=r"asks for (posix|os|nt)\.system"):
        frag.load(path)
    code, out, err = _run(["frag", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "refused to load" in err and "nothing was run" in err
    assert "Traceback" not in err
    assert not marker.exists()


@pytest.mark.parametrize("proto", [0, 2, 4, 5])
def test_allow_list_takes_plain_data_and_sets(proto):
    data = {"a": [1, 2.5, "x", None, True, (3, 4)], "s": {1, 2}, "f": frozenset({3}), "b": 10**30}
    assert safe_load(pickle.dumps(data, protocol=proto)) == data


@pytest.mark.parametrize("obj", [print, eval, os.getcwd, pickle.Unpickler, getattr])
def test_allow_list_refuses_any_global(obj):
    with pytest.raises(UnsafePickleError, match="refused to load"):
        safe_load(pickle.dumps({"x": obj}))


def test_allow_list_refuses_persistent_ids():
    import io

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if obj == "tensor" else None

    buf = io.BytesIO()
    P(buf).dump({"x": "tensor"})
    with pytest.raises(UnsafePickleError, match="persistent ids"):
        safe_load(buf.getvalue())


# -- malformed inputs: one line, exit 2 ------------------------------------------------------


def _entries_snapshot(entries):
    return {"segments": [], "device_traces": [entries]}


@pytest.mark.parametrize("name, content, words", [
    ("trunc.pickle", "TRUNCATED", "truncated pickle"),
    ("garbage.pickle", b"\x80\x04\xffjunk", "not a readable pickle"),
    ("list.pickle", pickle.dumps([1, 2, 3]), "expected a dict with 'segments' and 'device_traces', got list"),
    ("nokey.pickle", pickle.dumps({"segments": []}), "missing key 'device_traces'"),
    ("wrongtype.pickle", pickle.dumps({"segments": [], "device_traces": {"0": []}}),
     "device_traces: expected a list, got dict"),
    ("entry.pickle", pickle.dumps(_entries_snapshot([{"action": "alloc", "addr": 1, "size": 8}, 7])),
     "device_traces[0][1]: expected a trace entry (dict), got int"),
    ("noaddr.pickle", pickle.dumps(_entries_snapshot([{"action": "alloc", "size": 8}])),
     "device_traces[0][0] (alloc): missing key 'addr'"),
    ("strsize.pickle", pickle.dumps(_entries_snapshot([{"action": "alloc", "addr": 16, "size": "8"}])),
     "device_traces[0][0] (alloc): 'size' is str"),
    ("double.pickle", pickle.dumps(_entries_snapshot([{"action": "alloc", "addr": 16, "size": 8},
                                                      {"action": "alloc", "addr": 16, "size": 8}])),
     "device_traces[0][1]: alloc at 0x10 while the block there is still allocated"),
    ("empty.pickle", pickle.dumps({"segments": [], "device_traces": [[]]}), "has no trace entries"),
    ("bad.csv", "time,action,address,bytes\n0,alloc,0x10,100\n1,alloc,0x20,abc\n",
     "bad.csv: row 3: bytes 'abc' is not an integer"),
    ("header.csv", "when,what,where\n0,alloc,1\n", "line 1: the header must name the columns"),
    ("verb.csv", "time,action,address,bytes\n0,malloc,1,5\n", "row 2: action 'malloc' is not 'alloc' or 'free'"),
    ("unknown.csv", "time,action,address,bytes\n0,alloc,1,5\n1,free,2,\n",
     "row 3: free of address 2, which is not allocated"),
    ("short.csv", "time,action,address,bytes\n0,alloc\n", "row 2: expected 4 columns, got 2"),
    ("binary.csv", b"\xff\xfe\x00\x01garbage", "not a snapshot, an ooc JSON file or a text CSV"),
    ("other.json", json.dumps({"schema": "something.else"}), "neither an ooc trace"),
    ("broken.json", '{"schema": "ooc.sequence", ', "not a JSON file"),
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, name, content, words):
    path = tmp_path / name
    if content == "TRUNCATED":
        content = pickle.dumps(_checkerboard_snapshot(tmp_path / "full.pickle"))[:-200]
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    code, out, err = _run(["frag", str(path)], capsys)
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("ooc frag: error: ")
    assert words in err
    assert name in err


def test_bad_options_are_one_line(tmp_path, capsys):
    path = tmp_path / "s.json"
    _sequence().to_json(path)
    for argv, words in [(["--chunks", "3MiB"], "not a multiple of the 2 MiB"),
                        (["--chunks", "lots"], "'lots' is not a size"),
                        (["--device-memory", "-1"], "--device-memory"),
                        (["--export-snapshot", str(tmp_path / "x.pickle"), "--export-allocator", "1MiB"],
                         "not a multiple")]:
        code, out, err = _run(["frag", str(path), *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and words in err, err
    code, _, err = _run(["frag", str(tmp_path / "missing.pickle")], capsys)
    assert code == 2 and "missing.pickle" in err and err.count("\n") == 1


# -- the inputs -------------------------------------------------------------------------------


def test_sequence_events_follow_eager_lifetimes_and_peak():
    seq = _sequence()
    events = sequence_events(seq)
    live = peak = 0
    for e in events:
        live += e.nbytes if e.action == "alloc" else -e.nbytes
        peak = max(peak, live)
    assert peak == seq.in_core_peak_bytes
    assert live == 4 * MiB  # the live_out parameter stays


def test_snapshot_rules_ring_buffer_and_pending_frees():
    """Blocks allocated before recording started appear at the start; a free_requested with
    no free_completed frees at the request; free_completed is what frees otherwise."""
    snap = {
        "segments": [{"device": 0, "address": 1 << 30, "total_size": 2 * MiB, "stream": 0,
                      "blocks": [{"address": 1 << 30, "size": 4096, "requested_size": 4000,
                                  "state": "active_allocated", "frames": []},
                                 {"size": 2 * MiB - 4096, "state": "inactive"}]}],
        "device_traces": [[
            {"action": "free_completed", "addr": 99 << 20, "size": 512},  # made before the trace
            {"action": "alloc", "addr": 7 << 20, "size": 1000},
            {"action": "free_requested", "addr": 7 << 20, "size": 1000},
            {"action": "alloc", "addr": 8 << 20, "size": 3000},
            {"action": "free_completed", "addr": 7 << 20, "size": 1000},
            {"action": "free_requested", "addr": 8 << 20, "size": 3000},  # never completed
            {"action": "alloc", "addr": 9 << 20, "size": 5},
        ]]}
    t = snapshot_to_trace(snap)
    got = [(e.action, e.key, e.nbytes) for e in t.events]
    assert got == [("alloc", 99 << 20, 512), ("alloc", 1 << 30, 4000),
                   ("free", 99 << 20, 512), ("alloc", 7 << 20, 1000), ("alloc", 8 << 20, 3000),
                   ("free", 7 << 20, 1000), ("free", 8 << 20, 3000), ("alloc", 9 << 20, 5)]
    assert any("free_requested without free_completed" in n for n in t.notes)
    assert any("before the trace started" in n for n in t.notes)


def test_csv_input(tmp_path, capsys):
    path = tmp_path / "run.csv"
    path.write_text("time,action,address,bytes\n"
                    "0.0,alloc,0x1000,10485760\n0.1,alloc,0x2000,3145728\n"
                    "0.2,free,0x1000,\n0.3,alloc,x,20971520\n0.4,free,x,20971520\n0.5,free,0x2000,0\n")
    rep = _json(["frag", str(path)], capsys)
    assert rep["input_kind"] == "csv" and rep["events"] == 6
    caching = rep["allocators"][0]
    assert caching["peak_live_bytes"] == 23 * MiB


def test_plan_input_through_memory_events(tmp_path, capsys):
    from scheduler import plan

    seq = _sequence()
    path = tmp_path / "plan.json"
    budget = seq.in_core_peak_bytes * 3 // 4
    plan(seq, budget, policy="window").to_json(path)
    rep = _json(["frag", str(path)], capsys)
    assert rep["input_kind"] == "schedule"
    assert rep["device_memory_bytes"] == budget
    vmm2 = next(a for a in rep["allocators"] if a["name"] == "vmm-2MiB")
    assert vmm2["peak_live_bytes"] <= budget < seq.in_core_peak_bytes


# -- verdicts ---------------------------------------------------------------------------------


def test_checkerboard_fragmentation_verdict(tmp_path, capsys):
    path = tmp_path / "oom.pickle"
    _checkerboard_snapshot(path)
    rep = _json(["frag", str(path)], capsys)
    assert rep["device"] == 0
    # Device size estimated from the snapshot: 320 MiB reserved at the OOM + 80 MiB free.
    assert rep["device_memory_bytes"] == 400 * MiB
    assert rep["recorded"]["ooms"] == [{"event": 48, "request_bytes": 160 * MiB,
                                        "device_free_bytes": 80 * MiB}]
    assert rep["recorded"]["peak_reserved_bytes"] == 320 * MiB
    by = {a["name"]: a for a in rep["allocators"]}
    caching = by["caching"]
    # The model reproduces the crash at the same request, with the same picture.
    assert caching["oom"]["event"] == 48 and caching["oom"]["request_bytes"] == 160 * MiB
    assert caching["oom"]["reserved_bytes"] == 320 * MiB
    assert caching["oom"]["live_bytes"] == 128 * MiB
    assert caching["oom"]["external_bytes"] == 192 * MiB
    assert caching["oom"]["largest_free_bytes"] == 8 * MiB
    assert caching["recorded_oom_fits"] is False
    # 2 MiB chunks: 128 + 160 MiB live fits in 400 MiB, no fragmentation at all.
    assert by["vmm-2MiB"]["completed"] and by["vmm-2MiB"]["recorded_oom_fits"] is True
    assert by["vmm-2MiB"]["peak_reserved_bytes"] == 288 * MiB == by["vmm-2MiB"]["peak_live_bytes"]
    # 20 MiB chunks: ooc's allocator packs the 8 MiB blocks (below half a chunk) two to a
    # chunk; the checkerboard of frees leaves a live block in every chunk, so it runs out of
    # memory at the recorded OOM, as caching does. Pure chunks (the allocator before the
    # small-block pool: each block takes a whole chunk) run out earlier.
    assert not by["vmm-20MiB"]["completed"] and by["vmm-20MiB"]["oom"]["event"] == 48
    pure = frag.analyze(frag.load(path), chunks=(), confs=(), pure_chunks=(20 * MiB,))
    assert not pure.by_name("chunks-20MiB").completed
    assert pure.by_name("chunks-20MiB").oom.event < 48
    assert rep["best"] == "vmm-2MiB"
    text = rep["recommendation"]
    assert "event 48" in text and "would not have happened" in text
    assert "largest free block was 8 MiB" in text and "192 MiB (60%)" in text
    # The table says the same.
    code, out, _ = _run(["frag", str(path), "--no-progress"], capsys)
    assert code == 0
    assert re.search(r"caching\s+256 MiB\s+320 MiB", out)
    assert "Recommendation: The recorded run ran out of memory at event 48" in out
    assert "would not\nhave happened" in out or "would not have happened" in out.replace("\n", " ")


def test_device_memory_option_overrides_snapshot(tmp_path, capsys):
    path = tmp_path / "oom.pickle"
    _checkerboard_snapshot(path)
    rep = _json(["frag", str(path), "--device-memory", "1GiB", "--chunks", "20MiB"], capsys)
    assert rep["device_memory_bytes"] == 1 << 30 and rep["device_memory_source"] == "given"
    assert [a["name"] for a in rep["allocators"]] == ["caching", *frag.report.DEFAULT_CONFS,
                                                      "vmm-20MiB"]
    assert all(a["completed"] for a in rep["allocators"])
    assert "fits" in rep["recommendation"]


def test_json_keys_are_stable(tmp_path, capsys):
    path = tmp_path / "s.json"
    _sequence().to_json(path)
    rep = _json(["frag", str(path)], capsys)
    assert list(rep) == ["schema", "version", "input", "input_kind", "device", "events",
                         "device_memory_bytes", "device_memory_source", "recorded", "allocators",
                         "best", "recommendation", "notes", "advice", "plot", "export_snapshot"]
    assert set(rep["allocators"][0]) == {
        "name", "kind", "chunk_bytes", "events_replayed", "completed", "peak_live_bytes",
        "peak_reserved_bytes", "fragmentation_at_peak", "fragmentation_mean", "fragmentation_max",
        "at_peak", "oom", "at_recorded_oom", "recorded_oom_fits", "map_calls", "unmap_calls",
        "replay_seconds", "events_per_second", "alloc_conf", "max_unused_bytes"}
    assert set(rep["advice"]) == {
        "baseline", "peak_live_bytes", "recorded_reserved_bytes", "baseline_reserved_bytes",
        "replay_matches_recorded", "choice", "kind", "setting", "reserved_bytes", "saved_bytes",
        "saved_percent", "text"}
    # No device size: garbage collection (which needs a memory cap) is left out, with a note.
    assert [a["name"] for a in rep["allocators"]] == [
        "caching", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4",
        "vmm-2MiB", "vmm-20MiB", "vmm-40MiB"]
    assert any("garbage_collection_threshold:0.8 was not modelled" in n for n in rep["notes"])
    assert [a["alloc_conf"] for a in rep["allocators"]][:2] == ["", "expandable_segments:True"]
    for a in rep["allocators"]:
        assert a["peak_live_bytes"] == _sequence().in_core_peak_bytes
        assert a["fragmentation_max"] >= a["fragmentation_mean"] >= 1.0
        p = a["at_peak"]
        assert p["reserved_bytes"] == a["peak_reserved_bytes"]
        assert p["live_bytes"] + p["internal_bytes"] + p["external_bytes"] == p["reserved_bytes"]
        assert a["max_unused_bytes"] >= p["reserved_bytes"] - p["live_bytes"]


def test_progress_reports_all_allocators(tmp_path):
    from vmm.replay import swap_trace

    events = swap_trace(70_000, layers=8, max_bytes=8 * MiB)
    trace = frag.Trace(name="syn", kind="csv", events=events)
    seen = []
    frag.analyze(trace, chunks=[20 * MiB], progress=seen.append, confs=["expandable_segments:True"])
    assert seen == sorted(seen) and seen[-1] == 3 * len(events)


# -- exports: round trip and PyTorch's own viewer code ----------------------------------------


@pytest.mark.parametrize("which", ["caching", "20MiB"])
def test_export_of_a_known_trace_comes_back_with_the_same_peaks(tmp_path, capsys, which):
    seq_path = tmp_path / "step.json"
    _sequence().to_json(seq_path)
    snap_path = tmp_path / "step.pickle"
    first = _json(["frag", str(seq_path), "--export-snapshot", str(snap_path),
                   "--export-allocator", which], capsys)
    assert first["export_snapshot"]["path"] == str(snap_path)
    again = _json(["frag", str(snap_path)], capsys)
    assert again["input_kind"] == "snapshot" and again["events"] == first["events"]
    for a, b in zip(first["allocators"], again["allocators"]):
        assert a["name"] == b["name"]
        for key in ("peak_live_bytes", "peak_reserved_bytes", "map_calls", "unmap_calls"):
            assert a[key] == b[key], (a["name"], key)
    # What the recorded allocator did is the exported replay's own peak.
    # (The 20 MiB picture is of pure chunks, one range per allocation: the chunks-20MiB row.)
    if which == "caching":
        peak = next(a["peak_reserved_bytes"] for a in first["allocators"] if a["name"] == "caching")
    else:
        pure = frag.analyze(frag.load(seq_path), chunks=(), confs=(), pure_chunks=(20 * MiB,))
        peak = pure.by_name("chunks-20MiB").peak_reserved_bytes
    assert again["recorded"]["peak_reserved_bytes"] == peak


def _viewer_check(snap):
    """The consistency PyTorch's MemoryViz.js relies on (it crashes or draws nonsense
    otherwise), replayed the way it does: from the final ``segments`` backwards through the
    trace, every allocated block must lie inside a segment, every free must match a block."""
    trace = snap["device_traces"][0]
    segs = {s["address"]: s["total_size"] for s in snap["segments"] if s["device"] == 0}
    blocks = {}
    for s in snap["segments"]:
        addr = s["address"]
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                blocks[addr] = b["requested_size"]
            addr += b["size"]

    def inside(a):
        return any(sa <= a < sa + n for sa, n in segs.items())

    for e in reversed(trace):
        act = e["action"]
        if act == "alloc":
            assert blocks.pop(e["addr"]) == e["size"]
        elif act == "free_completed":
            assert e["addr"] not in blocks
            blocks[e["addr"]] = e["size"]
        elif act in ("segment_alloc", "segment_map"):
            assert segs.pop(e["addr"]) == e["size"]
        elif act in ("segment_free", "segment_unmap"):
            segs[e["addr"]] = e["size"]
        assert all(inside(a) for a in blocks), e
    assert not blocks  # nothing was live before the trace began


@pytest.mark.parametrize("which", [None, 2 * MiB, 20 * MiB])
def test_exported_snapshot_loads_in_torch_memory_viz(tmp_path, which):
    from torch.cuda import _memory_viz as mv

    trace = frag.load(_write_seq(tmp_path))
    path = tmp_path / "out.pickle"
    info = frag.export_snapshot(trace, path, chunk_bytes=which)
    assert info.oom_event is None
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    _viewer_check(snap)
    stats = mv.segsum(snap)  # asserts PyTorch's own accounting: free + allocated == reserved
    assert "total_reserved" in stats
    assert f"{len(snap['device_traces'][0])} entries" in mv.trace(snap)
    # The flame graph input of what is live at the end: the parameter, labelled.
    flame = mv.memory(snap, format_flamegraph=lambda lines: lines)
    assert "step.json:0:w (variable 0, param)" in flame
    html = mv.trace_plot(snap)
    assert "Active Memory Timeline" in html
    # The page embeds the snapshot itself (base64 pickle): what the viewer will draw.
    payload = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))
    embedded = pickle.loads(base64.b64decode(payload[0]["base64"]).rstrip(b"\x00"))
    assert embedded == snap
    assert "Allocator State History" in mv.segment_plot(snap)
    # Labels of the ooc variables travel as frames, for the viewer's hover text.
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert "act3 (variable 4, activation)" in names


def _write_seq(tmp_path):
    path = tmp_path / "step.json"
    _sequence().to_json(path)
    return path


def test_export_of_the_oom_replay_ends_at_the_oom(tmp_path):
    from torch.cuda import _memory_viz as mv

    src = tmp_path / "oom.pickle"
    _checkerboard_snapshot(src)
    trace = frag.load(src)
    info = frag.export_snapshot(trace, tmp_path / "again.pickle", device_memory=trace.device_memory)
    assert info.oom_event == 48
    snap = pickle.load(open(tmp_path / "again.pickle", "rb"))
    last = snap["device_traces"][0][-1]
    assert last["action"] == "oom" and last["size"] == 160 * MiB and last["device_free"] == 80 * MiB
    _viewer_check(snap)
    assert "raise OutOfMemoryError" in mv.trace(snap)
    assert mv.segsum(snap).count("20.0MiB allocated") == 16
    # And it reads back as the same run: same estimate of the device, same verdict.
    again = frag.analyze(frag.load(tmp_path / "again.pickle"))
    assert again.device_memory == 400 * MiB
    assert again.by_name("caching").oom.event == 48 and again.best == "vmm-2MiB"


# -- the plot ---------------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path, capsys):
    src = tmp_path / "oom.pickle"
    _checkerboard_snapshot(src)
    png = tmp_path / "frag.png"
    code, out, err = _run(["frag", str(src), "--plot", str(png)], capsys)
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert f"timeline: {png}" in out


def test_envelope_sees_every_event_and_the_oom(tmp_path):
    """Long traces are drawn from the per-bin envelope the analysis records over every state
    (replay's own samples are decimated): its maxima are the exact peaks, and a replay cut
    short by an OOM keeps its last bin."""
    from vmm.replay import swap_trace

    events = swap_trace(30_000, layers=12, max_bytes=24 * MiB, jitter=0.1, seed=3)
    trace = frag.Trace(name="syn", kind="csv", events=events)
    rep = frag.analyze(trace, chunks=[2 * MiB])
    for a in rep.allocators:
        env = a.envelope
        assert len(env) <= frag.report.ENVELOPE_BINS + 1
        assert env[:, 1].max() == a.peak_live_bytes
        assert env[:, 2].max() == a.peak_reserved_bytes
        assert (env[:, 3] <= env[:, 2]).all()
    caching = rep.by_name("caching")
    tight = frag.analyze(trace, chunks=[2 * MiB], device_memory=caching.peak_live_bytes)
    c = tight.by_name("caching")
    assert c.oom is not None
    assert c.envelope[-1, 0] <= c.oom.event < c.envelope[-1, 0] + 30_000 // 1200 + 1
    png = tmp_path / "long.png"
    frag.plot_timeline(tight, png)
    assert png.stat().st_size > 20_000


def _transformer_like_snapshot(*, consistent: bool) -> dict:
    """Weights allocated before recording began (never freed, never in the trace: only the
    segments list them), then a forward that allocates activations and frees some."""
    weights = [(1 << 32) + i * 8 * MiB for i in range(4)]
    acts = [(2 << 32) + i * 4 * MiB for i in range(3)]
    blocks = [{"address": a, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated",
               "frames": []} for a in weights]
    live_acts = acts[1:] if consistent else acts[2:]   # inconsistent: one the trace keeps is inactive
    blocks += [{"address": a, "size": 4 * MiB, "requested_size": 4 * MiB,
                "state": "active_allocated" if a in live_acts else "inactive", "frames": []} for a in acts]
    return {"segments": [{"device": 0, "address": 1 << 32, "total_size": 32 * MiB, "stream": 0,
                          "blocks": blocks[:4]},
                         {"device": 0, "address": 2 << 32, "total_size": 12 * MiB, "stream": 0,
                          "blocks": blocks[4:]}],
            "device_traces": [[{"action": "alloc", "addr": a, "size": 4 * MiB} for a in acts]
                              + [{"action": "free_completed", "addr": acts[0], "size": 4 * MiB}]]}


def test_replay_starts_from_the_snapshots_state_and_says_when_it_does_not_end_there():
    """Issue 40: blocks allocated before the trace began and never freed in it (a model's
    weights) count from the start, so the peak live bytes are never below what the snapshot
    holds at its end; a replay that does not end in the segments' state says so."""
    t = snapshot_to_trace(_transformer_like_snapshot(consistent=True))
    rep = ooc.frag.report.analyze(t)
    peaks = {a.name: a.peak_live_bytes for a in rep.allocators}
    assert set(peaks.values()) == {32 * MiB + 12 * MiB}, peaks   # weights + the three activations
    assert rep.advice.peak_live_bytes >= 32 * MiB + 8 * MiB      # >= what the snapshot holds at its end
    assert all(a.peak_reserved_bytes >= 44 * MiB for a in rep.allocators)
    assert not any("does not end in the snapshot's state" in n for n in t.notes)
    bad = snapshot_to_trace(_transformer_like_snapshot(consistent=False))
    assert any("does not end in the snapshot's state" in n and "4 MiB the replay holds" in n
               for n in bad.notes), bad.notes
