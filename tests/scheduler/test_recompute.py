"""Recomputation: replay flags in the IR, the chain that re-creates a variable, the discard and
recompute rows of the action table, and the planners that choose swap or recompute."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import (Action, BudgetTooSmall, Cost, Kind, Op, Schedule, ScheduleError, Variable, VariableSequence,
                       build_sequence, check, plan, simulate)
from scheduler.actions import Refused
from scheduler.errors import SequenceFormatError
from scheduler.hardware import hardware
from scheduler.recompute import swap_or_recompute
from scheduler.replay import chain_for, mark_replayable
from scheduler.window import plan_window

R = {"replayable": True}
MiB = 1 << 20


def _seq(replayable: bool = True, mutate_input_later: bool = False) -> VariableSequence:
    """x -> conv -> c -> bn (+ stats) -> b, relu_(b) -> ... backward reads b, then c."""
    flags = R if replayable else {}
    fns = [
        ("conv", [(0, "r"), (1, "r"), (2, "w")], Cost(seconds=1.0), flags),
        ("bn", [(2, "r"), (3, "w"), (4, "w")], Cost(seconds=1e-4), {**flags, "updates_stats": replayable}),
        ("relu_", [(3, "r"), (3, "w")], Cost(seconds=1e-4), flags),
        ("head", [(3, "r"), (5, "w")], Cost(seconds=1.0)),
        ("mid", [(5, "r"), (6, "w"), (2, "r")] + ([(2, "w")] if mutate_input_later else []), Cost(seconds=1.0)),
        ("back_relu", [(6, "r"), (3, "r"), (7, "w")], Cost(seconds=0.1)),
        ("back_bn", [(7, "r"), (2, "r"), (4, "r")], Cost(seconds=0.1)),
        ("back_conv", [(2, "r"), (0, "r"), (1, "r"), (1, "w")], Cost(seconds=1.0)),
    ]
    vs = [Variable(0, MiB, Kind.INPUT, "x", live_in=True), Variable(1, MiB, Kind.PARAM, "w", live_in=True, live_out=True),
          Variable(2, 4 * MiB, Kind.ACTIVATION, "c"), Variable(3, 4 * MiB, Kind.ACTIVATION, "b"),
          Variable(4, 2 * MiB, Kind.ACTIVATION, "stats"), Variable(5, MiB, Kind.ACTIVATION, "h"),
          Variable(6, MiB, Kind.TEMPORARY, "m"), Variable(7, MiB, Kind.TEMPORARY, "gb")]
    return build_sequence(fns, vs, {"device": "meta"})


def test_flags_round_trip_and_old_files_read_as_not_replayable(tmp_path) -> None:
    seq = _seq()
    assert seq.producer[3] == 1 and seq.writers[3] == (1, 2) and 0 not in seq.producer
    seq.to_json(tmp_path / "s.json")
    back = VariableSequence.from_json(tmp_path / "s.json")
    assert [(f.replayable, f.rng, f.updates_stats) for f in back.functions] == \
           [(f.replayable, f.rng, f.updates_stats) for f in seq.functions]
    old = _seq(replayable=False).to_dict()
    assert all("replayable" not in f for f in old["functions"])     # older files look the same
    assert not any(f.replayable for f in VariableSequence.from_dict(old).functions)


def test_the_chain_is_every_write_of_the_variable_on_unchanged_resident_inputs() -> None:
    seq = _seq()
    chain = chain_for(seq, 3, 5)
    assert chain.functions == (1, 2) and set(chain.inputs) == {2}
    assert chain.temporaries_bytes == 2 * MiB                       # bn's stats, made again
    assert chain_for(_seq(replayable=False), 3, 5) is None          # no flags: never replayed
    assert chain_for(_seq(mutate_input_later=True), 3, 5) is None   # c changed since bn read it
    assert chain_for(seq, 1, 7) is None                             # a parameter: not the step's


def test_a_chain_reruns_first_what_its_functions_need() -> None:
    """``Function.needs``: relu_ read a result nobody keeps (made by ``mid``, no variable): its
    chain reruns ``mid`` first, with ``mid``'s inputs resident and unchanged."""
    import dataclasses

    seq = _seq()
    fs = list(seq.functions)
    fs[2] = dataclasses.replace(fs[2], needs=(0,))   # relu_ read conv's unmanaged result too
    with_needs = VariableSequence(tuple(fs), seq.variables, seq.meta)
    chain = chain_for(with_needs, 3, 5)
    assert chain.functions == (0, 1, 2) and set(chain.inputs) == {0, 1}   # conv's x and w now
    assert VariableSequence.from_dict(with_needs.to_dict()).functions[2].needs == (0,)
    bad = with_needs.to_dict()
    bad["functions"][2]["needs"] = [2]   # not an earlier function
    with pytest.raises(SequenceFormatError, match="needs"):
        VariableSequence.from_dict(bad)
    fs[0] = dataclasses.replace(fs[0], replayable=False)   # what it needs cannot be replayed
    assert chain_for(VariableSequence(tuple(fs), seq.variables, seq.meta), 3, 5) is None


def test_a_chain_through_a_discarded_input_makes_that_input_first() -> None:
    """``chain_through``: bn + relu_ read c; with c discarded at that point, the chain reruns
    conv first (c is one more temporary); an absent input with no chain gives no chain."""
    from scheduler.replay import chain_through

    seq = _seq()
    plain = chain_for(seq, 3, 5)
    assert chain_through(seq, plain, lambda x: False) is plain
    through = chain_through(seq, plain, lambda x: x == 2)
    assert through.functions == (0, 1, 2) and set(through.inputs) == {0, 1}
    assert through.temporaries_bytes >= 4 * MiB                    # c, while bn reads it
    assert chain_through(seq, plain, lambda x: x in (0, 2)) is None  # conv's input is gone too


def _two_blocks() -> VariableSequence:
    """x -> conv1 -> c1 -> bn1 -> b1, relu1_(b1) -> conv2 -> c2 -> bn2 -> b2, relu2_(b2) -> head,
    then a backward that reads them all."""
    fns = [("conv1", [(0, "r"), (1, "w")], Cost(seconds=1.0), R),
           ("bn1", [(1, "r"), (2, "w")], Cost(seconds=1e-4), R),
           ("relu1_", [(2, "r"), (2, "w")], Cost(seconds=1e-4), R),
           ("conv2", [(2, "r"), (3, "w")], Cost(seconds=1.0), R),
           ("bn2", [(3, "r"), (4, "w")], Cost(seconds=1e-4), R),
           ("relu2_", [(4, "r"), (4, "w")], Cost(seconds=1e-4), R),
           ("head", [(4, "r"), (5, "w")], Cost(seconds=1.0)),
           ("back", [(5, "r"), (4, "r"), (3, "r"), (2, "r"), (1, "r"), (0, "r")], Cost(seconds=1.0))]
    vs = [Variable(0, MiB, Kind.INPUT, "x", live_in=True)] + [
        Variable(v, MiB, Kind.ACTIVATION, n) for v, n in ((1, "c1"), (2, "b1"), (3, "c2"), (4, "b2"), (5, "h"))]
    return build_sequence(fns, vs, {"device": "meta"})


def test_a_chain_through_reaches_back_through_discarded_inputs_of_discarded_inputs() -> None:
    """Two blocks, conv -> bn -> relu_ each: with the second block's conv output c2 and the
    first block's output b1 (c2's conv input) and c1 all discarded, b2's chain reruns both
    blocks from x; a level with no chain (an input gone that the step did not make) gives none."""
    from scheduler.replay import chain_through

    seq = _two_blocks()
    plain = chain_for(seq, 4, 7)
    assert plain.functions == (4, 5) and plain.inputs == (3,)
    through = chain_through(seq, plain, lambda x: x in (1, 2, 3))
    assert through.functions == (0, 1, 2, 3, 4, 5) and through.inputs == (0,)
    assert chain_through(seq, plain, lambda x: x in (0, 1, 2, 3)) is None   # x is gone: nothing to start from


def test_a_chain_through_an_input_that_is_back_by_its_use_is_proven_too() -> None:
    """The planner fixes a chain where it discards the variable: b2's, through c2, chosen when
    c2 was discarded too. Where c2's own recompute has brought it back by b2's use (a second
    backward over the same tensors: retain_graph, a gradient penalty), ``check`` proves the
    chain through c2 as it is, c2 made again as a temporary; it refused it before, and every
    plan of a residual network trained with ``retain_graph=True`` that did so was lost."""
    seq = _two_blocks()
    n = len(seq.functions)
    before, after = [()] * n, [()] * n
    after[4] = (Action(Op.DISCARD, 3),)
    after[6] = (Action(Op.DISCARD, 4),)

    def schedule(chain: tuple[int, ...]) -> Schedule:
        before[7] = (Action(Op.RECOMPUTE, 3, (3,)), Action(Op.RECOMPUTE, 4, chain))
        after[7] = tuple(Action(Op.FREE, v) for v in range(6))
        return Schedule(sequence=seq, budget=1 << 40, policy="hand", window=0, before=tuple(before),
                        after=tuple(after), initial_resident=frozenset({0}))

    plain, through = check(schedule((4, 5))), check(schedule((3, 4, 5)))
    assert through.peak_bytes == plain.peak_bytes + MiB   # c2 made again beside the resident one
    with pytest.raises(Refused, match="not the functions that wrote it"):
        check(schedule((2, 3, 4, 5)))   # b1 made again without bn1 before relu1_: no chain of it
    assert simulate(schedule((3, 4, 5)), "v100-16gb-nvlink").total_s > simulate(schedule((4, 5)),
                                                                                "v100-16gb-nvlink").total_s


def _recompute_schedule(seq: VariableSequence, chain=(1, 2), budget=1 << 40) -> Schedule:
    n = len(seq.functions)
    before = [()] * n
    after = [()] * n
    before[5] = (Action(Op.RECOMPUTE, 3, tuple(chain)),)
    after[3] = (Action(Op.DISCARD, 3),)
    after[4] = (Action(Op.FREE, 5),)
    after[5] = (Action(Op.FREE, 6), Action(Op.FREE, 3))
    after[6] = (Action(Op.FREE, 7), Action(Op.FREE, 4))
    after[7] = (Action(Op.FREE, 2), Action(Op.FREE, 0))
    return Schedule(sequence=seq, budget=budget, policy="hand", window=0, before=tuple(before),
                    after=tuple(after), initial_resident=frozenset({0, 1}))


def _without_recompute(s: Schedule) -> Schedule:
    """The plan with nothing before any function: b is discarded and never re-created."""
    return dataclasses.replace(s, before=tuple(() for _ in s.sequence.functions))


def test_check_proves_a_recompute_and_counts_its_temporaries() -> None:
    seq = _seq()
    s = _recompute_schedule(seq)
    r = check(s)
    # before back_relu: x, w, c, stats, m resident; b comes back with bn's stats made again
    assert r.peak_bytes == 2 * MiB + 4 * MiB + 2 * MiB + MiB + 4 * MiB + 2 * MiB
    with pytest.raises(ScheduleError, match="during recompute"):
        check(_recompute_schedule(seq, budget=r.peak_bytes - 1))
    with pytest.raises(Refused, match="not the functions that wrote it"):
        check(_recompute_schedule(seq, chain=(1,)))
    with pytest.raises(Refused, match="add recompute of variable 3"):
        check(_without_recompute(_recompute_schedule(seq)))
    assert Schedule.from_dict(s.to_dict()).before == s.before        # the chain travels with the plan


def test_simulate_refuses_a_use_of_a_discarded_variable_in_its_own_words() -> None:
    with pytest.raises(Refused, match=r"function 5 \(back_relu\): variable 3 .* is used while discarded"):
        simulate(_without_recompute(_recompute_schedule(_seq())), "v100-16gb-nvlink")


def test_simulate_runs_the_chain_on_the_compute_stream() -> None:
    s = _recompute_schedule(_seq())
    r = simulate(s, "v100-16gb-nvlink")
    assert r.recompute_s == pytest.approx(2e-4) and r.bytes_recomputed == 4 * MiB
    assert r.total_s == pytest.approx(r.compute_s + 2e-4)
    assert any(e.track == "recompute" for e in r.timeline)


def test_without_replayable_functions_the_default_plan_is_the_swap_only_plan() -> None:
    seq = _seq(replayable=False)
    budget = seq.in_core_peak_bytes - MiB
    assert plan(seq, budget=budget).to_dict() == plan_window(seq, budget).to_dict()


def test_the_rule_prices_chain_seconds_against_transfers_and_moved_bytes() -> None:
    seq = _seq()
    # bn + relu_ take 0.2 ms; 4 MiB out and back take ~8 ms on flash, ~0.19 ms over NVLink
    assert swap_or_recompute(seq, hardware("cpu-edge"), 1.0)(3, 5).functions == (1, 2)
    assert swap_or_recompute(seq, hardware("v100-16gb-nvlink"), 1.0)(3, 5) is None
    assert swap_or_recompute(seq, hardware("cpu-edge"), 1.0)(2, 6) is None     # conv: 1 s


def test_the_window_planner_recomputes_what_the_rule_chooses() -> None:
    seq = _seq()
    budget = seq.in_core_peak_bytes - 3 * MiB
    s = plan_window(seq, budget, recompute=lambda v, at: chain_for(seq, v, at))
    assert s.bytes_recomputed > 0 and check(s).peak_bytes <= budget
    for hw in ("cpu-edge", "v100-16gb-nvlink"):   # the default keeps the faster plan
        assert simulate(plan(seq, budget=budget, hardware=hw), hw).total_s <= \
            simulate(plan_window(seq, budget), hw).total_s


def test_a_sequence_goes_with_the_chains_found_in_it() -> None:
    """The chains ``chain_for`` finds are kept on the sequence, not in a cache beside it: one
    keyed by its id kept the last 65 sequences planned with recomputation, and everything
    derived from them, alive after their engine had closed."""
    import gc
    import weakref

    seq = _seq()
    schedule = plan_window(seq, seq.in_core_peak_bytes - 3 * MiB, recompute=lambda v, at, s=seq: chain_for(s, v, at))
    assert schedule.bytes_recomputed > 0
    gone = weakref.ref(seq)
    del seq, schedule
    gc.collect()
    assert gone() is None


def test_a_plan_lists_its_actions_in_step_order_and_its_recomputes_by_variable() -> None:
    """What a hook-driven step reads of its plan once per plan: every action at its gap in the
    order the step runs them, each variable's recomputes with their chains, the discarded."""
    seq = _seq()
    s = plan_window(seq, seq.in_core_peak_bytes - 3 * MiB, recompute=lambda v, at: chain_for(seq, v, at))
    n = len(seq.functions)
    walked = [(g + k, a) for g in range(n) for k, acts in ((0, s.before[g]), (1, s.after[g])) for a in acts]
    assert walked[-1][0] == n and any(k for g in range(n - 1) for k in s.after[g])   # after some function
    assert list(s.in_step_order) == walked and s.in_step_order is s.in_step_order
    assert s.recomputes and s.recomputes == {
        a.var: tuple((g, b.chain) for g, b in walked if b.op is Op.RECOMPUTE and b.var == a.var)
        for _, a in walked if a.op is Op.RECOMPUTE}
    assert s.discarded == {a.var for _, a in walked if a.op is Op.DISCARD} and s.discarded
    assert s.leaving == {a.var for _, a in walked if a.op in (Op.SWAP_OUT, Op.DISCARD)} >= s.discarded


def test_a_replay_its_use_cannot_hold_is_swapped_instead() -> None:
    """At a budget equal to the largest working set (bn's 10 MiB), re-creating bn's statistics
    right before back_bn reruns bn, which makes b again (4 MiB) beside back_bn's own 7 MiB:
    11 MiB at once. The planner swaps the statistics instead of committing in the forward to a
    replay the backward cannot hold (it used to give up on the whole plan there: "function 6
    needs 6291456 B")."""
    from scheduler.working_sets import Prepared, replay_floor, working_sets

    seq = _seq()
    budget = max(working_sets(seq))
    assert replay_floor(Prepared(seq), 6, [chain_for(seq, 4, 6)]) == 11 * MiB > budget
    s = plan_window(seq, budget, recompute=lambda v, at: chain_for(seq, v, at))
    assert check(s).peak_bytes <= budget
    assert Op.SWAP_OUT in _fate(s, 4) and Op.DISCARD not in _fate(s, 4)


def test_a_gradient_is_never_recomputed_only_swapped() -> None:
    """A gradient made by a cheap replayable op in the backward and read by the update: the
    program holds it (``p.grad``), so a discard frees nothing and its replay makes a second
    copy beside it. An MLP's 6 MiB weight gradient was discarded after the backward and made
    again for Adam: 6 MiB over a 20 MiB budget, unseen by the engine. No chain makes it; a
    plan that must move it swaps it."""
    fns = [("mm", [(0, "r"), (1, "r"), (2, "w")], Cost(seconds=1e-3), R),
           ("loss", [(2, "r"), (3, "w")], Cost(seconds=1e-4)),
           ("grad_mm", [(3, "r"), (1, "r"), (4, "w")], Cost(seconds=1e-4), R),     # cheap to rerun
           ("keep_l", [(3, "r")], Cost(seconds=1e-4)),                            # its input, there still
           ("other", [(5, "r"), (6, "w")], Cost(seconds=1.0)),                      # takes the room
           ("update", [(4, "r"), (3, "r"), (1, "r"), (1, "w")], Cost(seconds=1e-3))]
    vs = [Variable(0, 2 * MiB, Kind.INPUT, "x", live_in=True),
          Variable(1, 6 * MiB, Kind.PARAM, "w", live_in=True, live_out=True),
          Variable(2, 2 * MiB, Kind.ACTIVATION, "a"), Variable(3, MiB, Kind.TEMPORARY, "l"),
          Variable(4, 6 * MiB, Kind.GRAD, "w.grad"), Variable(5, 4 * MiB, Kind.INPUT, "y", live_in=True),
          Variable(6, 8 * MiB, Kind.TEMPORARY, "big")]
    seq = build_sequence(fns, vs, {"device": "meta"})
    assert chain_for(seq, 4, 5) is None
    assert chain_for(dataclasses.replace(seq, variables={**seq.variables, 4: dataclasses.replace(
        seq.variables[4], kind=Kind.ACTIVATION)}), 4, 5) is not None   # the same bytes as an activation: one
    budget = 13 * MiB   # "other" holds 12 MiB: the weight and the gradient must leave for it
    for hw in ("cpu-edge", "h100-80gb-pcie5"):
        s = plan(seq, budget=budget, hardware=hw)
        assert check(s).peak_bytes <= budget
        assert Op.DISCARD not in _fate(s, 4) and Op.SWAP_OUT in _fate(s, 4), hw


def _far_use() -> VariableSequence:
    """a (8 MiB) is made, pushed out by t (8 MiB), then read after 20 short functions that use
    only w: the uses between weigh 2 MiB each, so the default window (1.5 x a 10 MiB budget)
    lets a's swap-in start only 2 functions ahead, twice that window 10."""
    fns = [("make_a", [(1, "r"), (0, "w")], Cost(seconds=1.0), R),   # replayable, too dear to rerun
           ("make_t", [(1, "r"), (2, "w")], Cost(seconds=1e-3)),
           ("use_t", [(2, "r"), (1, "r")], Cost(seconds=1e-3))]
    fns += [(f"mid{k}", [(1, "r")], Cost(seconds=5e-5)) for k in range(20)]
    fns += [("use_a", [(0, "r"), (1, "r")], Cost(seconds=1e-4))]
    vs = [Variable(0, 8 * MiB, Kind.ACTIVATION, "a"), Variable(1, 2 * MiB, Kind.PARAM, "w", live_in=True, live_out=True),
          Variable(2, 8 * MiB, Kind.ACTIVATION, "t")]
    return build_sequence(fns, vs, {"device": "meta"})


def test_with_no_window_named_the_default_planner_also_tries_a_wider_one() -> None:
    from scheduler.recompute import WIDE_WINDOW
    from scheduler.window import default_window

    seq, budget, hw = _far_use(), 10 * MiB, "v100-16gb-nvlink"
    narrow, wide = default_window(budget), WIDE_WINDOW * default_window(budget)
    chosen = plan(seq, budget=budget, hardware=hw)
    assert chosen.window == wide
    at = {w: simulate(plan_window(seq, budget, w), hw) for w in (narrow, wide)}
    assert at[wide].stall_s < at[narrow].stall_s                    # a's copy starts earlier
    assert simulate(chosen, hw).total_s == at[wide].total_s
    assert plan(seq, budget=budget, window=narrow, hardware=hw).window == narrow   # a named window binds
    assert plan(seq, budget=budget, hardware="cpu-edge").window == narrow   # reads take compute there


# -- the zoo: default planner vs the MILP reference ------------------------------------------
# The replay flags are the recorder's (``ooc.record.replay``: from each op's schema and tags).


@pytest.fixture(scope="module")
def zoo():
    torch = pytest.importorskip("torch")
    import ooc

    out = {}
    for name in ("small_cnn", "tiny_transformer"):
        with torch.device("meta"):
            model = ooc.models.get(name)
        x, y = ooc.models.example_batch(name, 4, "meta")
        out[name] = ooc.trace(model, x, y, loss_fn=ooc.models.loss_fn(name), optimizer="sgd")
    return out


@pytest.mark.parametrize("name", ["small_cnn", "tiny_transformer"])
@pytest.mark.parametrize("fraction", [2, 4])
@pytest.mark.parametrize("hw", ["v100-16gb-nvlink", "cpu-edge"])
def test_default_planner_is_within_5_percent_of_the_milp(zoo, name, fraction, hw) -> None:
    pytest.importorskip("scipy")
    seq = zoo[name]
    assert any(f.replayable for f in seq.functions)
    budget = seq.in_core_peak_bytes // fraction
    default = simulate(plan(seq, budget=budget, hardware=hw), hw).total_s
    reference = simulate(plan(seq, budget=budget, policy="milp", hardware=hw), hw).total_s
    assert default <= 1.05 * reference
    # and never slower than swapping alone
    swap_only = mark_replayable(seq, lambda f: {})
    assert default <= simulate(plan(swap_only, budget=budget), hw).total_s * (1 + 1e-9)


# -- pins: the user's say per tensor (scheduler.pins) ------------------------------------------


def _fate(s: Schedule, v: int) -> set[Op]:
    """What the plan does to variable ``v``: the ops of its actions."""
    return {a.op for acts in (*s.before, *s.after) for a in acts if a.var == v}


def test_pins_keep_offload_prefer_and_must_recompute() -> None:
    seq = _seq()
    tight, roomy = seq.in_core_peak_bytes - 3 * MiB, seq.in_core_peak_bytes
    # Unpinned, the budget evicts the BatchNorm statistics (4): swapped on the V100 (NVLink
    # hides the copy), recomputed on a CPU where each moved byte costs its compute threads
    # 0.33 ns (the I/O's work, measured on the project's VM before the pool shared its pages).
    busy = hardware("cpu-edge", moved_byte_s=0.33e-9)
    assert _fate(plan(seq, budget=tight, hardware="v100-16gb-nvlink"), 4) >= {Op.SWAP_OUT, Op.SWAP_IN}
    assert _fate(plan(seq, budget=tight, hardware=busy), 4) >= {Op.DISCARD, Op.RECOMPUTE}
    # prefer_recompute: recomputed instead, whatever the price
    s = plan(seq, budget=tight, hardware="v100-16gb-nvlink", pins={4: "prefer_recompute"})
    assert _fate(s, 4) >= {Op.DISCARD, Op.RECOMPUTE} and check(s).peak_bytes <= tight
    # offload: swapped even where recompute="prefer" would recompute it
    assert Op.RECOMPUTE in _fate(plan(seq, budget=tight, recompute="prefer"), 4)
    s = plan(seq, budget=tight, recompute="prefer", pins={4: "offload"})
    assert _fate(s, 4) >= {Op.SWAP_OUT, Op.SWAP_IN} and Op.RECOMPUTE not in _fate(s, 4)
    # keep: never leaves; other tensors go instead
    s = plan(seq, budget=tight, pins={4: "keep"})
    assert _fate(s, 4) <= {Op.FREE} and s.bytes_in > 0 and check(s).peak_bytes <= tight
    # must_recompute: with room for everything nothing moves, unless pinned
    assert plan(seq, budget=roomy).bytes_recomputed == 0
    s = plan(seq, budget=roomy, pins={3: "must_recompute"})
    assert _fate(s, 3) >= {Op.DISCARD, Op.RECOMPUTE}
    assert check(s).peak_bytes < check(plan(seq, budget=roomy)).peak_bytes
    # a swap-only plan ignores recompute pins
    assert plan(seq, budget=roomy, recompute="never", pins={3: "must_recompute"}).bytes_recomputed == 0


def test_keeping_what_must_leave_fails_with_a_budget_that_works() -> None:
    seq = _seq()
    keep_all = {v: "keep" for v in (2, 3, 4, 5)}
    budget = seq.in_core_peak_bytes - 3 * MiB
    with pytest.raises(BudgetTooSmall) as err:
        plan(seq, budget=budget, pins=keep_all)
    assert err.value.minimum > budget
    check(plan(seq, budget=err.value.minimum, pins=keep_all))


@pytest.mark.parametrize("pins, words", [({3: "pin"}, "not one of"), ({99: "keep"}, "does not have")])
def test_bad_pins_are_refused(pins, words) -> None:
    with pytest.raises(ValueError, match=words):
        plan(_seq(), budget=1 << 30, pins=pins)
