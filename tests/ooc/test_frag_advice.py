"""ooc frag's answer to "what should I set, and what does it save?": the PYTORCH_CUDA_ALLOC_CONF
models in the report, the advice, the cross-check on a snapshot recorded with expandable
segments, the plot's chosen models, the --alloc-conf option.

No snapshot here was recorded on a GPU (this machine has none): the expandable one is built
by hand in the format of ``torch.cuda.memory._snapshot()`` with what PyTorch writes for
expandable segments (``segment_map`` trace entries, segments with ``is_expandable``), its
addresses and page mappings derived from the rules in ``vmm/expandable.py``.
"""

from __future__ import annotations

import pickle

import pytest

from ooc import frag
from ooc.cli import main
from vmm.replay import Event

MiB = 1 << 20
BASE = 0x7F3A_0000_0000


def _expandable_snapshot(path, *, flag_segments=True, map_entries=True):
    """A run with expandable_segments:True, as PyTorch records it (large pool, 20 MiB pages).

    X 12 MiB maps page [0, 20) (segment_map 20 MiB), Y 8 MiB takes the rest [12, 20); Z 30 MiB
    maps [20, 60) (segment_map 40 MiB); X is freed; W 9 MiB lands at [0, 9) (the free [50, 60)
    could grow, so the search prefers [0, 12)). Recorded peak reserved: 60 MiB.
    The default allocator would have made segments of 12, 20 and 30 MiB: 62 MiB.
    """
    t = [1_700_000_000_000_000]
    trace = []

    def entry(**kw):
        if kw["action"] == "segment_map" and not map_entries:
            return  # the ring buffer dropped them
        t[0] += 13
        kw.update(stream=0, frames=[], time_us=t[0])
        trace.append(kw)

    entry(action="segment_map", addr=BASE, size=20 * MiB)
    entry(action="alloc", addr=BASE, size=12 * MiB)
    entry(action="alloc", addr=BASE + 12 * MiB, size=8 * MiB)
    entry(action="segment_map", addr=BASE + 20 * MiB, size=40 * MiB)
    entry(action="alloc", addr=BASE + 20 * MiB, size=30 * MiB)
    entry(action="free_requested", addr=BASE, size=12 * MiB)
    entry(action="free_completed", addr=BASE, size=12 * MiB)
    entry(action="alloc", addr=BASE, size=9 * MiB)
    blocks = [(0, 9, True), (9, 3, False), (12, 8, True), (20, 30, True), (50, 10, False)]
    segment = {
        "device": 0, "address": BASE, "total_size": 60 * MiB, "stream": 0,
        "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": flag_segments,
        "allocated_size": 47 * MiB, "active_size": 47 * MiB, "requested_size": 47 * MiB,
        "frames": [],
        "blocks": [{"address": BASE + a * MiB, "size": n * MiB,
                    "requested_size": n * MiB if live else 0,
                    "state": "active_allocated" if live else "inactive", "frames": []}
                   for a, n, live in blocks]}
    snap = {"segments": [segment], "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    with open(path, "wb") as fh:
        pickle.dump(snap, fh)


@pytest.mark.parametrize("flag_segments", [True, False])
def test_expandable_snapshot_replay_reproduces_its_recorded_peak(tmp_path, flag_segments):
    """The cross-check: a snapshot recorded with expandable segments (said by its segments,
    or by its segment_map entries alone) is replayed with them as the baseline, and the
    replay's peak is the recorded one; the default allocator's replay is not (62 MiB)."""
    path = tmp_path / "exp.pickle"
    _expandable_snapshot(path, flag_segments=flag_segments)
    trace = frag.load(path)
    assert trace.expandable and trace.recorded.peak_reserved_bytes == 60 * MiB
    rep = frag.analyze(trace, chunks=[], confs=[])
    assert [a.name for a in rep.allocators] == ["caching", "expandable_segments:True"]
    adv = rep.advice
    assert adv.baseline == "expandable_segments:True" and adv.replay_matches_recorded is True
    assert adv.baseline_reserved_bytes == 60 * MiB == adv.recorded_reserved_bytes
    assert rep.by_name("caching").peak_reserved_bytes == 62 * MiB
    assert "reproduces the recorded peak reserved (60 MiB)" in adv.text
    # Nothing beats what was recorded here: keep it.
    assert adv.kind == "keep" and adv.choice is None and adv.saved_bytes == 0


def test_expandable_is_read_from_the_segments_alone(tmp_path):
    """Without segment_map entries (the trace lost them) the segments still say so."""
    path = tmp_path / "exp.pickle"
    _expandable_snapshot(path, map_entries=False)
    trace = frag.load(path)
    assert trace.expandable and trace.recorded is None
    adv = frag.analyze(trace, chunks=[], confs=[]).advice
    assert adv.baseline == "expandable_segments:True" and adv.replay_matches_recorded is None


def _trace(events):
    return frag.Trace(name="hand", kind="csv", events=events)


# caching: segments of 30, 20 (the 5 MiB request) and 34 MiB = 84 MiB; expandable: 80 MiB
# (vmm/tests: test_expandable_grows_the_free_end_instead_of_a_new_segment); 2 MiB chunks:
# 15 + 3 chunks, then 3 + 17 chunks: 40 MiB.
_GROW = [Event("alloc", 1, 30 * MiB), Event("alloc", 2, 5 * MiB), Event("free", 1, 0),
         Event("alloc", 3, 33 * MiB), Event("free", 2, 0), Event("free", 3, 0)]


def test_advice_prefers_a_setting_that_lowers_the_peak():
    rep = frag.analyze(_trace(_GROW), chunks=[], confs=["max_split_size_mb:128",
                                                         "expandable_segments:True"])
    adv = rep.advice
    assert rep.by_name("max_split_size_mb:128").peak_reserved_bytes == 84 * MiB
    assert adv.baseline == "caching" and adv.baseline_reserved_bytes == 84 * MiB
    assert adv.choice == "expandable_segments:True" and adv.kind == "alloc_conf"
    assert adv.setting == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert adv.reserved_bytes == 80 * MiB and adv.saved_bytes == 4 * MiB
    assert adv.saved_percent == 4.8  # 4 / 84
    assert adv.replay_matches_recorded is None  # a CSV records no reserved bytes
    assert "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in adv.text
    assert rep.plotted == ("caching", "expandable_segments:True")


def test_advice_takes_ooc_when_it_saves_clearly_more():
    """2 MiB chunks save 44 MiB, the setting 4 MiB: 40 MiB more, above 5% of 84 MiB."""
    rep = frag.analyze(_trace(_GROW), chunks=[2 * MiB], confs=["expandable_segments:True"])
    adv = rep.advice
    assert adv.choice == "vmm-2MiB" and adv.kind == "ooc" and adv.saved_bytes == 44 * MiB
    assert "chunk=2097152" in adv.setting
    assert rep.plotted == ("caching", "vmm-2MiB")


def test_advice_keeps_the_defaults_when_nothing_saves():
    """One 20 MiB block: a 20 MiB segment, one 20 MiB page, ten 2 MiB chunks: all equal."""
    rep = frag.analyze(_trace([Event("alloc", 1, 20 * MiB), Event("free", 1, 0)]),
                       chunks=[2 * MiB], confs=["expandable_segments:True"])
    adv = rep.advice
    assert adv.kind == "keep" and adv.choice is None and adv.setting == ""
    assert "Keep PyTorch's defaults" in adv.text
    # After the free the segment and the page stay reserved; chunks leave with their data.
    assert [a.max_unused_bytes for a in rep.allocators] == [20 * MiB, 20 * MiB, 0]


def test_advice_on_the_checkerboard_oom(tmp_path, capsys):
    """Every PyTorch setting runs out at the recorded OOM (160 MiB asked with 128 MiB live in
    400 MiB: the expandable end needs 8 pages, 260 + 160 > 400, and no whole page is free
    inside the 8 MiB holes); 2 MiB chunks fit: ooc's allocator, and the table says why."""
    from test_frag import _checkerboard_snapshot

    path = tmp_path / "oom.pickle"
    _checkerboard_snapshot(path)
    assert main(["frag", str(path), "--json"]) == 0
    import json

    rep = json.loads(capsys.readouterr().out)
    adv = rep["advice"]
    assert adv["baseline"] == "caching" and adv["replay_matches_recorded"] is True
    assert adv["choice"] == "vmm-2MiB" and adv["kind"] == "ooc"
    by = {a["name"]: a for a in rep["allocators"]}
    assert by["expandable_segments:True"]["oom"]["event"] == 48
    assert by["expandable_segments:True"]["peak_reserved_bytes"] == 260 * MiB
    assert by["garbage_collection_threshold:0.8"]["completed"] is False  # the cap is known here
    assert by["caching"]["max_unused_bytes"] == 192 * MiB


def test_plot_draws_only_the_chosen_models():
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from ooc.frag import plot

    rep = frag.analyze(_trace(_GROW), chunks=[2 * MiB, 20 * MiB],
                       confs=["expandable_segments:True", "max_split_size_mb:128"])
    ax = Figure().add_subplot()
    plot._draw(ax, rep, FuncFormatter)
    labels = " ".join(ax.get_legend_handles_labels()[1])
    assert "caching reserved" in labels and "vmm-2MiB mapped" in labels
    assert "max_split_size_mb" not in labels and "expandable" not in labels
    assert "vmm-20MiB" not in labels


@pytest.mark.parametrize("value, words", [("bogus:1", "not a modelled"),
                                          ("max_split_size_mb:8", "above 20"),
                                          ("garbage_collection_threshold:2", "outside (0, 1)")])
def test_bad_alloc_conf_is_one_line(tmp_path, capsys, value, words):
    from test_frag import _sequence

    path = tmp_path / "s.json"
    _sequence().to_json(path)
    code = main(["frag", str(path), "--alloc-conf", value])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err and "--alloc-conf" in err, err


def test_alloc_conf_option_chooses_the_models(tmp_path, capsys):
    from test_frag import _sequence

    path = tmp_path / "s.json"
    _sequence().to_json(path)
    assert main(["frag", str(path), "--json", "--chunks", "2MiB", "--alloc-conf",
                 "roundup_power2_divisions:2,expandable_segments:True;"
                 "expandable_segments:True,roundup_power2_divisions:2"]) == 0
    import json

    rep = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in rep["allocators"]] == [
        "caching", "expandable_segments:True,roundup_power2_divisions:2", "vmm-2MiB"]
    assert main(["frag", str(path), "--json", "--alloc-conf", "none", "--chunks", "2MiB"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in rep["allocators"]] == ["caching", "vmm-2MiB"]
