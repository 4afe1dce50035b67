"""Plans for steps whose activations' sizes depend on the data (``scheduler.widening``): a
step that left a plan of the same ops, its first activation the plan's size, is planned with
each activation at least as large as the plan's (one that outgrew it an eighth larger), and
that plan's hook-driven forms check each save against its variable's room."""

from __future__ import annotations

import dataclasses

from scheduler.ir import Kind
from scheduler.step_plans import REPRICED_RUNS, Decision, PlanState, Settings, StepFacts, after_step, plan_recorded
from scheduler.widening import HEADROOM, sizes_vary, widened
from tests.scheduler.strategies import training_like_sequence

CHUNK = 1 << 12


def _timed(seq, seconds: float):
    functions = tuple(dataclasses.replace(f, cost=dataclasses.replace(f.cost, seconds=seconds))
                      for f in seq.functions)
    return dataclasses.replace(seq, functions=functions, meta={**seq.meta, "chunk": CHUNK})


def _born(seq) -> dict[int, tuple[int, int]]:
    """Each variable born in the step -> (its first writer, its place among that one's)."""
    out, made = {}, {}
    for f in seq.functions:
        for u in f.uses:
            if u.var not in out and not seq.variables[u.var].live_in:
                out[u.var] = (f.index, made.setdefault(f.index, 0))
                made[f.index] += 1
    return out


def _resized(seq, sizes: dict[int, int]):
    variables = {v: dataclasses.replace(x, nbytes=sizes.get(v, x.nbytes)) for v, x in seq.variables.items()}
    return dataclasses.replace(seq, variables=variables)


SEQ = _timed(training_like_sequence(6), 1e-3)
SETTINGS = Settings(budget=SEQ.in_core_peak_bytes // 2, chunk=CHUNK, window=None)
BORN = _born(SEQ)
ACTS = [v for v, x in SEQ.variables.items() if x.kind is Kind.ACTIVATION]


def test_a_step_of_the_same_ops_is_planned_at_the_larger_of_each_activations_sizes() -> None:
    left = plan_recorded(SEQ, SETTINGS)
    binding = {where: var for var, where in BORN.items()}
    small, large = ACTS[1], ACTS[2]
    size = SEQ.variables[large].nbytes
    step = _resized(SEQ, {small: SEQ.variables[small].nbytes // 2, large: size * 2})
    got = widened(step, BORN, left, binding)
    assert sizes_vary(got) and not sizes_vary(step)
    assert got.variables[small].nbytes == left.sequence.variables[small].nbytes   # the plan's: no smaller
    assert got.variables[large].nbytes == 2 * size + 2 * size // HEADROOM   # outgrew it: room to grow
    others = [v for v in SEQ.variables if v not in (small, large)]
    assert all(got.variables[v].nbytes == max(SEQ.variables[v].nbytes, left.sequence.variables[v].nbytes)
               for v in others)
    assert all(got.variables[v] == step.variables[v] for v in others
               if step.variables[v].kind is not Kind.ACTIVATION)
    # the same sizes as the plan's: nothing to widen, nothing marked
    assert widened(SEQ, BORN, left, binding) is SEQ


def test_an_activation_that_keeps_outgrowing_its_room_gets_twice_the_headroom_each_time() -> None:
    """Sizes that drift upward (a router sending more and more tokens to one expert) outgrow
    an eighth over and over; each step that outgrows it leaves the plan. Doubling the
    headroom each time the same activation outgrows its room (an eighth, a quarter, a half,
    then its size again, at most) makes those steps grow as the logarithm of the drift."""
    binding = {where: var for var, where in BORN.items()}
    roomy = dataclasses.replace(SETTINGS, budget=SEQ.in_core_peak_bytes * 64)
    left = plan_recorded(SEQ, roomy)
    act, other = ACTS[2], ACTS[1]
    rooms = []
    for _ in range(5):   # each step one chunk past the room its plan gave it
        grew = left.sequence.variables[act].nbytes + CHUNK
        got = widened(_resized(SEQ, {act: grew}), BORN, left, binding)
        rooms.append((got.variables[act].nbytes - grew) / grew)
        assert got.variables[other].nbytes == SEQ.variables[other].nbytes   # never outgrew: no headroom
        left, binding = plan_recorded(got, roomy), {where: var for var, where in BORN.items()}
    assert [round(r * HEADROOM) for r in rooms] == [1, 2, 4, 8, 8], rooms


def test_a_step_whose_first_activation_differs_is_another_shape_planned_as_it_ran() -> None:
    """A larger batch makes every activation larger from the first on: not the data's doing
    (its plan stays exact, and a smaller batch leaves it again for its own)."""
    left = plan_recorded(SEQ, SETTINGS)
    binding = {where: var for var, where in BORN.items()}
    larger = _resized(SEQ, {v: SEQ.variables[v].nbytes * 2 for v in ACTS})
    assert widened(larger, BORN, left, binding) is larger
    first = _resized(SEQ, {ACTS[0]: SEQ.variables[ACTS[0]].nbytes * 2})
    assert widened(first, BORN, left, binding) is first
    assert widened(first, BORN, left, binding, differed=True) is first


def test_a_plan_a_hook_driven_step_left_for_a_saves_bytes_is_marked_though_its_chunks_match() -> None:
    """The plan holds whole chunks; a hook-driven form compares each save's exact bytes: a
    save of other bytes in the same chunks leaves that form, and the plan made next is marked
    (no such form again) though no size in it changes."""
    left = plan_recorded(SEQ, SETTINGS)
    binding = {where: var for var, where in BORN.items()}
    got = widened(SEQ, BORN, left, binding, differed=True)
    assert sizes_vary(got)
    assert all(got.variables[v].nbytes == max(SEQ.variables[v].nbytes, left.sequence.variables[v].nbytes)
               for v in SEQ.variables)


def test_a_step_that_ran_other_ops_is_planned_as_it_ran() -> None:
    left = plan_recorded(SEQ, SETTINGS)
    binding = {where: var for var, where in BORN.items()}
    step = _resized(SEQ, {ACTS[0]: 1})
    renamed = dataclasses.replace(step, functions=(dataclasses.replace(step.functions[0], name="other"),
                                                   *step.functions[1:]))
    assert widened(renamed, BORN, left, binding) is renamed
    assert widened(dataclasses.replace(step, functions=step.functions[:-1]), BORN, left, binding).variables \
        == step.variables


def test_the_engine_widens_a_diverged_step_and_its_plan_takes_the_hook_forms_bounded() -> None:
    """``after_step`` with the plan the step left: the new plan holds the larger sizes; once
    marked, a planned run that kept to it gives it the anchored form, swapping only (its
    chains' templates hold one step's shapes), or the plain one where it moves nothing: their
    saves are checked against their variables' room (``HookTrace.bounded``)."""
    left = plan_recorded(SEQ, SETTINGS)
    binding = {where: var for var, where in BORN.items()}
    step = _resized(SEQ, {ACTS[1]: SEQ.variables[ACTS[1]].nbytes * 2})
    d = after_step(StepFacts("diverged", False, 1.0, sequence=step, left=(left, binding, False), born_at=BORN),
                   None, SETTINGS)
    assert d.plan is not None and sizes_vary(d.plan.sequence)
    assert d.plan.sequence.variables[ACTS[1]].nbytes >= 2 * SEQ.variables[ACTS[1]].nbytes
    n = len(SEQ.functions)
    facts = StepFacts("planned", True, 1.0, seconds=[1e-3] * n, ran_whole_plan=True, gaps=set(range(n + 1)),
                      first={}, signature=True)
    settled = PlanState(d.plan, priced_runs=REPRICED_RUNS)
    formed = after_step(facts, settled, SETTINGS)   # anchored, swapping only (a template holds one step's shapes)
    assert formed.anchored and formed.moved is not None and formed.moved.bytes_recomputed == 0
    assert after_step(facts, PlanState(left, priced_runs=REPRICED_RUNS), SETTINGS).anchored   # unmarked too
    roomy = dataclasses.replace(SETTINGS, budget=SEQ.in_core_peak_bytes * 4)
    marked = plan_recorded(dataclasses.replace(SEQ, meta={**SEQ.meta, "sizes_vary": True}), roomy)
    assert after_step(facts, PlanState(marked), roomy).plain
    assert after_step(facts, PlanState(plan_recorded(SEQ, roomy)), roomy).plain
    assert not after_step(facts, settled, SETTINGS).plain   # marked, but it moves bytes
    # a hook-driven step that left the marked plan: the plan runs per op again (where it grew,
    # that step leaves it and the next plan is widened from there), not dropped for a recording
    for form in ("plain", "anchored"):
        gone = StepFacts(form, False, 1.0)
        assert after_step(gone, PlanState(marked), roomy) == Decision(unhook=True)
        assert after_step(gone, PlanState(plan_recorded(SEQ, roomy)), roomy) == Decision(drop=True)


def test_larger_sizes_that_do_not_fit_the_budget_are_planned_at_the_steps_own() -> None:
    """A budget the engine accepted never fails later for room a step does not need: where
    the plan's larger sizes do not fit, the step's own are planned (marked all the same)."""
    roomy = dataclasses.replace(SETTINGS, budget=SEQ.in_core_peak_bytes)
    huge = _resized(SEQ, {ACTS[2]: SEQ.in_core_peak_bytes * 4})
    left = plan_recorded(huge, dataclasses.replace(SETTINGS, budget=huge.in_core_peak_bytes))
    binding = {where: var for var, where in BORN.items()}
    d = after_step(StepFacts("diverged", False, 1.0, sequence=SEQ, left=(left, binding, False), born_at=BORN),
                   None, roomy)
    assert d.plan is not None and d.plan.peak_resident_bytes <= roomy.budget
    assert sizes_vary(d.plan.sequence)
    assert d.plan.sequence.variables[ACTS[2]].nbytes < SEQ.in_core_peak_bytes
