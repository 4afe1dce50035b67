"""Managed parameters, grads and optimizer state read and written between steps.

With params/optimizer_state managed, a step ends with some of them on the tier (their storage
resized to 0 bytes). Reading one there gave silently empty bytes (``torch.save`` of
``opt.state_dict()``) or a segfault (``t.sum()``), and ``load_state_dict`` copied into a
0-byte storage (issue 16, item 3). Now managed tensors that fit the budget are resident
between steps, state_dict()/load_state_dict() bring back those that do not, and bytes written
between steps reach the next step. Each check is bitwise against in-core PyTorch doing
the same, and runs in a child process so that a crash fails the test instead of pytest.
"""

from __future__ import annotations

import contextlib
import io

import torch

from test_reliability import ALL, CHUNK, fresh, run_step
from in_child import run_in_child
from ooc.engine import Options, OutOfCore


def _in_child(name: str) -> None:
    run_in_child(__file__, name)


class _Pair:
    """The same MLP (parameters and optimizer state dominate) trained in core and under an
    engine (all four kinds managed; a budget of the parameters' bytes, a quarter of the
    managed peak with Adam, a third with SGD-momentum), on the same data."""

    def __init__(self, opt: str, times_params: float = 1.0) -> None:
        self.ref, self.ref_opt = fresh(opt, kind="mlp")
        self.model, self.opt = fresh(opt, kind="mlp")
        budget = int(times_params * sum(p.untyped_storage().nbytes() for p in self.model.parameters()))
        self.engine = OutOfCore(self.model, self.opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
        self.steps = 0

    def step(self) -> None:
        run_step(self.ref, self.ref_opt, self.steps)
        run_step(self.model, self.opt, self.steps, self.engine)
        self.steps += 1

    def released(self) -> int:
        """How many managed tensors the engine's plan has on the tier during a step (so that
        the test is about released storages at all)."""
        return len(self.engine._store.slots) - len(self.engine._plans.schedule.initial_resident)


def _checkpoint(model, opt) -> dict:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


def _assert_same_checkpoint(a: dict, b: dict, when: str) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"model {k} differs {when}"
    assert a["opt"]["state"].keys() == b["opt"]["state"].keys()
    for i, state in a["opt"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["opt"]["state"][i][k]), f"optimizer state {i}.{k} differs {when}"


def save_between_steps() -> None:
    for opt in ("adam", "sgd"):
        pair = _Pair(opt)
        for _ in range(3):
            pair.step()
            assert pair.released() > 0, "the plan must keep some managed tensors on the tier"
            _assert_same_checkpoint(_checkpoint(pair.ref, pair.ref_opt),
                                    _checkpoint(pair.model, pair.opt), f"after step {pair.steps} ({opt})")
        pair.engine.close()


def load_between_steps_and_train_on() -> None:
    pair = _Pair("adam")
    pair.step()
    pair.step()
    saved = _checkpoint(pair.model, pair.opt)   # the engine's, after 2 steps
    pair.step()
    pair.step()
    for model, opt in ((pair.ref, pair.ref_opt), (pair.model, pair.opt)):
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    _assert_same_checkpoint(_checkpoint(pair.ref, pair.ref_opt), _checkpoint(pair.model, pair.opt),
                            "right after loading")
    for _ in range(3):
        pair.step()
        _assert_same_checkpoint(_checkpoint(pair.ref, pair.ref_opt), _checkpoint(pair.model, pair.opt),
                                f"at step {pair.steps}, after loading at step 4")
        _assert_state_managed(pair)   # the loaded state is managed again
    pair.engine.close()


def _assert_state_managed(pair: _Pair) -> None:
    """Every optimizer state tensor ooc could manage is managed (not left in memory outside
    the budget)."""
    managed = {id(s.storage) for s in pair.engine._store.slots.values()}
    state = [t for st in pair.opt.state.values() for t in st.values()
             if t.untyped_storage().nbytes() >= pair.engine._mem.min_bytes]
    assert state and all(id(t.untyped_storage()) in managed for t in state)


def resume_into_a_new_engine() -> None:
    """The usual resumption: model and optimizer load a checkpoint, then the engine is made.
    The state the optimizer starts with was never managed (it stayed in memory beside the
    budget at every step; only state made or loaded under an engine was): it is from the
    engine's start now, and training goes on bitwise."""
    pair = _Pair("adam")
    pair.engine.close()
    for _ in range(2):   # both in core
        run_step(pair.ref, pair.ref_opt, pair.steps)
        run_step(pair.model, pair.opt, pair.steps)
        pair.steps += 1
    saved = _checkpoint(pair.model, pair.opt)
    pair.model, pair.opt = fresh("adam", kind="mlp")
    pair.model.load_state_dict(saved["model"])
    pair.opt.load_state_dict(saved["opt"])
    budget = sum(p.untyped_storage().nbytes() for p in pair.model.parameters())
    pair.engine = OutOfCore(pair.model, pair.opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096),
                            manage=ALL)
    _assert_state_managed(pair)
    for _ in range(3):
        pair.step()
        _assert_state_managed(pair)
        assert pair.released() > 0, "the plan must keep some managed tensors on the tier"
        _assert_same_checkpoint(_checkpoint(pair.ref, pair.ref_opt), _checkpoint(pair.model, pair.opt),
                                f"at step {pair.steps}, resumed at step 3")
    pair.engine.close()


def read_and_write_tensors_between_steps(fits: bool = True) -> None:
    """Raw reads and in-place edits of every managed tensor between steps. ``fits``: params,
    grads and SGD momentum (3x the parameters) fit the budget, so each step's end brings them
    back and plain reads are safe; otherwise they stay on the tier and the reads and edits
    run inside ``engine.resident()``, as README says."""
    pair = _Pair("sgd", times_params=3.5 if fits else 1.0)
    for _ in range(3):
        pair.step()
        assert pair.engine.stats()["bytes_out"] > 0, "nothing swapped: the test says nothing"
        if not fits:
            assert pair.released() > 0
        ref = [*pair.ref.parameters(), *(t for s in pair.ref_opt.state.values() for t in s.values())]
        got = [*pair.model.parameters(), *(t for s in pair.opt.state.values() for t in s.values())]
        with contextlib.nullcontext() if fits else pair.engine.resident():
            for a, b in zip(ref, got, strict=True):
                assert torch.equal(a.sum(), b.sum()) and torch.equal(a, b.clone())
            with torch.no_grad():   # an in-place edit between steps (a weight decay of one's own)
                for a, b in zip(ref, got):
                    a.mul_(0.5)
                    b.mul_(0.5)
    pair.step()
    _assert_same_checkpoint(_checkpoint(pair.ref, pair.ref_opt), _checkpoint(pair.model, pair.opt),
                            "after edits between steps")
    pair.engine.close()


def read_and_write_over_budget() -> None:
    read_and_write_tensors_between_steps(fits=False)


def test_checkpoint_saved_between_steps_is_bitwise_in_core() -> None:
    _in_child("save_between_steps")


def test_state_dict_loaded_between_steps_then_training_matches_in_core() -> None:
    _in_child("load_between_steps_and_train_on")


def test_a_new_engine_over_a_resumed_optimizer_manages_its_state() -> None:
    _in_child("resume_into_a_new_engine")


def test_reading_and_editing_managed_tensors_between_steps_never_crashes() -> None:
    _in_child("read_and_write_tensors_between_steps")


def test_over_budget_tensors_read_and_edited_inside_resident() -> None:
    _in_child("read_and_write_over_budget")
