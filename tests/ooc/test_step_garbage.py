"""A step leaves no reference cycle behind: its state is freed when the step ends.

Without that, every step's recording, slots and plan cursor (~5,000 objects on GPT 6x256)
waited for the cyclic garbage collector, and a full collection paused one step in about ten
for 0.13 s. A refused step too: once the user drops the refusal, its frames and tensors go
(ooc raised exceptions it held in the raising frame). Checked with the collector off, so only
reference counting can free the step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import torch.nn.functional as F

import ooc
from ooc import models
from scheduler import BudgetTooSmall
from test_budget_covers_step import _batch, _fresh


@pytest.mark.parametrize("budget", ["24MiB", "1GiB"])   # a plan that moves bytes; one that moves none
def test_a_finished_step_is_freed_without_the_cycle_collector(budget: str) -> None:
    torch.manual_seed(0)
    model = models.get("small_cnn")
    x, y = models.example_batch("small_cnn", 8)
    loss_fn = models.loss_fn("small_cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = ooc.OutOfCore(model, opt, budget=budget)
    steps: list[weakref.ref] = []
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):   # recording, re-plan, planned (and plain, when nothing moves)
            with engine.step():
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                steps.append(weakref.ref(engine._stepper))
                opt.step()
        alive = [k for k, ref in enumerate(steps) if ref() is not None]
        stats = engine.stats()
        assert stats["steps"] == 5
        if budget == "24MiB":   # the case is what it says: planned steps that move bytes
            assert stats["bytes_in"] > 0 and stats["steps.plain"] == 0
        else:
            assert stats["steps.plain"] > 0
    finally:
        if enabled:
            gc.enable()
        engine.close()
    assert alive == [], f"steps {alive} are still alive: a reference cycle keeps them"


def test_the_step_after_one_that_raised_begins_with_the_garbage_its_frames_left_collected() -> None:
    """A step that raises leaves its exception's frames, and what they hold, to the collector
    once a cycle runs through them (ooc's own refusals had one: a Llama's retried step held
    the refused step's 96 MiB of logits beside its own). The next step collects first
    (``EngineMemory.raised``), before its first op: with the collector off, only that frees
    the tensor here. A step that did not raise collects nothing."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ooc.OutOfCore(model, opt, budget="1GiB")
    seen: list[bool] = []

    def failing_step() -> weakref.ref:
        held = torch.randn(1024, 1024)
        cycle = {"held": held}
        cycle["self"] = cycle   # (what a frame in a traceback makes, and the collector frees)
        with engine.step():
            model(torch.randn(4, 8)).sum().backward()
            raise RuntimeError("the user's code failed")
        return weakref.ref(held)   # pragma: no cover

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        kept = torch.randn(1024, 1024)
        cycle = {"kept": kept}
        cycle["self"] = cycle
        kept_ref = weakref.ref(kept)
        del kept, cycle
        with engine.step():   # no step raised before it: nothing collected
            seen.append(kept_ref() is not None)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        try:
            failing_step()
        except RuntimeError as err:
            ref = weakref.ref(err.__traceback__.tb_next.tb_frame.f_locals["held"])   # (failing_step's)
        seen.append(ref() is not None)
        with engine.step():   # after one that raised: collected before its first op
            seen.append(ref() is not None)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        if enabled:
            gc.enable()
        engine.close()
    assert seen == [True, True, False], seen



REFUSALS = {   # step budget or not, batches: where the refusal is raised
    "before-its-update": ("4MiB", "step", (32,)),   # a share for the step so far (Planner.check_feasible)
    "at-its-end": ("1MiB", "managed", (32,)),        # an on-demand need the pool could not meet (StepEnd)
    "planned": ("16MiB", "managed", (32, 32, 96)),   # a larger batch than its plan's, planned
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_step_is_freed_once_its_refusal_is_dropped_without_the_cycle_collector(tmp_path, case: str) -> None:
    """A refusal keeps the step's frames (its traceback) only as long as the user keeps it: ooc
    raised exceptions it held in a local of the raising frame (a cycle through that frame), and
    a retry, or a new engine, began beside the refused step's tensors until a collection. With
    the collector off, only reference counting frees them."""
    budget, covers, sizes = REFUSALS[case]
    model, opt = _fresh("sgd")
    engine = ooc.OutOfCore(model, opt, budget=budget, storage=str(tmp_path),
                           options=ooc.Options(chunk="64KiB", budget_covers=covers))
    refs: list[weakref.ref] = []

    def step(n: int) -> None:
        x, y = _batch(len(refs), n)
        with engine.step():
            out = model(x)
            refs.append(weakref.ref(out))
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for n in sizes[:-1]:
            step(n)
        with pytest.raises(BudgetTooSmall):
            step(sizes[-1])
        alive = [ref() is not None for ref in refs]
    finally:
        if enabled:
            gc.enable()
        engine.close()
    assert len(refs) == len(sizes) and not any(alive), f"steps {alive} alive: a reference cycle keeps their frames"


@pytest.mark.parametrize(("manage", "how"), [("activations", "closed"), ("activations", "dropped"), ("all", "closed")])
def test_an_engine_let_go_of_is_freed_without_the_cycle_collector(manage: str, how: str) -> None:
    """An engine the user lets go of (closed, or dropped: activations only, which keep nothing
    between steps) goes at once, and with it what it refers to: its parts held its bound
    methods, a cycle, so a run that made a new engine after a refused one (a new model and
    optimizer each time) kept the old optimizer's state beside the new steps until a
    collection (a GPT-2 of 20 MiB of weights under AdamW: 260 MiB of live blocks a step at a
    254 MiB step budget, 212 MiB in a process of its own). One that manages persistent
    tensors and is dropped unclosed lives as long as its model (its hooks on the model hold
    it: the swapped bytes are the model's)."""
    kinds = ("activations",) if manage == "activations" else ("activations", "params", "grads", "optimizer_state")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters())
    engine = ooc.OutOfCore(model, opt, budget="1MiB", manage=kinds)
    for _ in range(3):
        with engine.step():
            F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
            opt.step()
            opt.zero_grad()
    if how == "closed":
        engine.close()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(engine)
        del engine
        alive = ref() is not None
    finally:
        if enabled:
            gc.enable()
    assert not alive, "the engine let go of is alive: a reference cycle keeps it"


class _TwoHeads(torch.nn.Module):
    """A body, the head the loss takes, and a ``tanh`` head it leaves out (``tanh`` saves its
    own output for its backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*(m for _ in range(6) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())))
        self.head, self.aux = torch.nn.Linear(128, 10), torch.nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), torch.tanh(self.aux(h))


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("budget,form", [("1GiB", "plain"), ("768KiB", "anchored")])
def test_a_graph_no_backward_releases_goes_with_its_outputs(monkeypatch: pytest.MonkeyPatch, budget: str,
                                                            form: str, retain: bool) -> None:
    """The graph of the head the loss leaves out, and with ``retain_graph=True`` the whole
    step's: no backward releases what their nodes saved, and in core they go when their
    outputs do. A pack hook that gave autograd an op's output itself (a tensor under the
    threshold, or one an anchored plan keeps where it is) made each a reference cycle through
    its own node, which no collector frees (``saved_tensors.unlinked``): three tensors a step,
    or a range of the pool each anchored step of HF's Reformer (its reversible layers keep
    the graphs they rerun), until a swap-in found the pool full."""
    from ooc.engine import hook_forms
    from ooc.testing.forced_forms import decided

    monkeypatch.setattr(hook_forms.HookPlan, "judge", decided(keep=True))   # the anchored form, whatever the times
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = ooc.OutOfCore(model, opt, budget=budget)
    outputs: list[weakref.ref] = []
    forms = []
    try:
        for step in range(8):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(256, 128, generator=g), torch.randint(0, 10, (256,), generator=g)
            with engine.step():
                out, aux = model(x)
                F.cross_entropy(out, y).backward(retain_graph=retain)
                opt.step()
                opt.zero_grad()
            outputs += [weakref.ref(aux), weakref.ref(out)]
            del out, aux
            forms.append(ooc.FORMS[engine.stats()["last_form"]])
    finally:
        engine.close()
    gc.collect()
    assert form in forms, forms   # the case is what it says
    alive = [k // 2 for k, ref in enumerate(outputs) if ref() is not None]
    assert alive == [], f"outputs of steps {alive} ({forms}) are still alive: their graphs hold them"


def test_hugging_faces_bert_trained_on_its_masked_lm_loss_alone_leaks_nothing() -> None:
    """HF's ``BertForPreTraining`` with the masked-LM loss alone: its next-sentence head (the
    pooler's ``tanh``) runs at every step and no backward reaches it. At default settings (plain
    steps) four tensors a step stayed alive on the code before (``saved_tensors.unlinked``); as
    many tensors are alive after ten steps as after three, as in core."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tf.BertForPreTraining(tf.BertConfig(vocab_size=128, num_hidden_layers=2, hidden_size=64,
                                                intermediate_size=128, num_attention_heads=2,
                                                max_position_embeddings=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ooc.OutOfCore(model, opt, budget="1GiB")
    alive = {}
    try:
        for step in range(10):
            ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(step))
            with engine.step():
                out = model(input_ids=ids)
                F.cross_entropy(out.prediction_logits.flatten(0, 1), ids.flatten()).backward()
                opt.step()
                opt.zero_grad()
            del out
            if step in (2, 9):
                gc.collect()
                alive[step] = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
        assert engine.stats()["steps.plain"] > 0   # the case is what it says
    finally:
        engine.close()
    assert alive[9] == alive[2], f"{alive[9] - alive[2]} more tensors alive after step 9 than after step 2"
