"""``scheduler.managed.managed_view``: a whole-step trace seen as the engine plans it."""

from __future__ import annotations

from scheduler import Cost, Kind, Variable, build_sequence
from scheduler.managed import managed_view
from scheduler.replay import chain_for

MiB = 1 << 20
R = {"replayable": True}


def _trace():
    """x -> matmul -> scores (a temporary, 4 MiB) -> softmax -> p (saved, 4 MiB) -> bmm -> out;
    a small saved tensor (64 KiB), a BatchNorm buffer, and an optimizer step."""
    vs = [Variable(0, 8 * MiB, Kind.INPUT, "x", live_in=True),
          Variable(1, 4 * MiB, Kind.TEMPORARY, "scores"),
          Variable(2, 4 * MiB, Kind.ACTIVATION, "p"),
          Variable(3, 64 << 10, Kind.ACTIVATION, "small"),
          Variable(4, 4 * MiB, Kind.PARAM, "w", live_in=True, live_out=True),
          Variable(5, 4096, Kind.PARAM, "bn.running_mean", live_in=True, live_out=True),
          Variable(6, 3 * MiB + 1, Kind.ACTIVATION, "odd")]
    fns = [("matmul", [(0, "r"), (4, "r"), (1, "w")], Cost(seconds=1e-3), R),
           ("softmax", [(1, "r"), (2, "w")], Cost(seconds=1e-4), R),
           ("small", [(2, "r"), (3, "w"), (6, "w"), (5, "w")], Cost(seconds=1e-5), R),
           ("bmm_backward", [(2, "r"), (3, "r"), (6, "r")], Cost(seconds=1e-3)),
           ("sgd", [(4, "r"), (4, "w")], Cost(seconds=1e-5), R)]
    return build_sequence(fns, vs, {"device": "cuda", "optimizer_start": 4})


def test_keeps_only_managed_kinds_from_min_bytes_with_activations_in_whole_chunks() -> None:
    seq = managed_view(_trace())
    assert set(seq.variables) == {2, 6}                      # not x, scores, small, w, the buffer
    assert seq.variables[6].nbytes == 4 * MiB               # 3 MiB + 1 in 2 MiB chunks
    assert all(u.var in {2, 6} for f in seq.functions for u in f.uses)
    assert seq.in_core_peak_bytes == 8 * MiB
    both = managed_view(_trace(), {Kind.ACTIVATION, Kind.PARAM})
    assert 4 in both.variables and 5 not in both.variables  # the buffer never


def test_a_read_of_an_unmanaged_temporary_needs_its_maker_so_the_chain_reruns_it() -> None:
    seq = managed_view(_trace())
    assert seq.functions[1].needs == (0,)       # softmax reads scores, made by matmul
    chain = chain_for(seq, 2, 3)
    assert chain is not None and chain.functions == (0, 1)
    assert managed_view(_trace(), min_bytes=8 * MiB).functions[1].needs == ()   # scores under it: held


def test_nothing_from_the_optimizer_on_is_replayable() -> None:
    seq = managed_view(_trace(), {Kind.ACTIVATION, Kind.PARAM})
    assert seq.functions[0].replayable and not seq.functions[4].replayable


def test_a_maker_that_cannot_be_replayed_makes_its_readers_unreplayable() -> None:
    trace = _trace()
    f0 = trace.functions[0]
    import dataclasses

    from scheduler.ir import VariableSequence
    fixed = VariableSequence((dataclasses.replace(f0, replayable=False), *trace.functions[1:]),
                             trace.variables, trace.meta)
    seq = managed_view(fixed)
    assert not seq.functions[1].replayable and chain_for(seq, 2, 3) is None
