"""Issue 16, item 6: mixed precision and the optimizer step, written the way users write them.

The engine recognises ``optimizer.step()`` as the update by a step pre-hook, so the loop
needs no ``engine.optimizer_step()``: ``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()`` inside ``with engine.step():`` is checked bitwise against the same loop in
core (same model, data, seeds and scaler settings), with fp16 autocast and a GradScaler whose
first update is skipped (its gradients overflow), and with bf16 autocast. Around it: a budget
too small for the update still fails before anything changes when the user calls
``opt.step()`` or ``scaler.step(opt)``; an I/O error inside it still says that the update was
partial; ``zero_grad()`` anywhere in the loop keeps steps planned; an update outside the step
reads the real bytes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import ooc
from in_child import run_in_child
from ooc.engine import Options, OutOfCore
from ooc.errors import StorageError
from test_engine import TinyGPT, _data, _loss
from test_reliability import (ALL, CHUNK, Faults, _eio, _one_torch_thread, batch,  # noqa: F401
                              faulty_engine, fresh, state_of)
import test_update_budget as ub

STEPS = 6
# A first scale so large that the fp16 backward overflows: the first update is skipped (the
# scaler never calls opt.step()), and the back-off brings the scale down at once.
SKIP_FIRST = {"init_scale": 2.0 ** 24, "backoff_factor": 2.0 ** -20}


def _autocast(precision: str, device: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)


def _fresh(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """test_engine's "gpt" model and AdamW. Per parameter (``foreach=False``), the update the
    engine runs with params managed; on the CPU it is PyTorch's default anyway."""
    torch.manual_seed(0)
    # On a GPU, wide enough that a quarter of its peak spans several 2 MiB chunks.
    model = (TinyGPT() if device == "cpu" else TinyGPT(width=512, depth=4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.to(device) for t in _data("gpt", step))


def _train(precision: str, engine_kw: dict | None, zero_grad: str = "top", steps: int = STEPS,
           device: str = "cpu"):
    """The loop of the PyTorch AMP recipe (unscale, clip, scaler.step, update) around the model
    of test_engine's "gpt" case, in core or under an engine, with ``zero_grad`` at the top
    of the step ("top"), before entering it ("outside") or after the update ("after")."""
    model, opt = _fresh(device)
    scaler = torch.amp.GradScaler(device, **SKIP_FIRST) if precision == "fp16" else None
    if engine_kw:
        kw = {"device": device, **engine_kw}
        options = Options(chunk=kw.pop("chunk", CHUNK), min_bytes=4096)
    engine = OutOfCore(model, opt, options=options, **kw) if engine_kw else None
    record = {"loss": [], "scale": [], "updated": [], "planned": [], "plans": [], "dropped_alive": []}
    for step in range(steps):
        x, y = _batch(step, device)
        torch.manual_seed(1000 + step)   # dropout
        if zero_grad == "outside":
            dropped = [StorageWeakRef(p.grad.untyped_storage()) for p in model.parameters()
                       if p.grad is not None]
            opt.zero_grad()
        with engine.step() if engine is not None else contextlib.nullcontext():
            if zero_grad == "outside":   # nothing may keep the bytes of the grads dropped
                record["dropped_alive"].append(sum(not ref.expired() for ref in dropped))
            if zero_grad == "top":
                opt.zero_grad()
            with _autocast(precision, device):
                loss = _loss("gpt", model(x), y)
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)   # foreach, in place on the (managed) grads
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            if zero_grad == "after":
                opt.zero_grad()
        record["loss"].append(loss.detach().clone())
        record["scale"].append(scaler.get_scale() if scaler is not None else None)
        record["updated"].append(bool(opt.state))
        if engine is not None:
            stats = engine.stats()
            record["planned"].append(stats["last_planned"])
            record["plans"].append(stats["plans"])
    if engine is not None:
        record["stats"] = engine.stats()
        engine.close()
        record["hooks_left"] = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return model, opt, record


_REF: dict = {}


def _reference(precision: str, zero_grad: str = "top"):
    key = (precision, zero_grad, torch.get_num_threads())
    if key not in _REF:
        _REF[key] = _train(precision, None, zero_grad)
    return _REF[key]


def _budget(manage: tuple[str, ...], fraction: int = 4, device: str = "cpu", chunk: int = CHUNK) -> int:
    """A fraction of the managed in-core peak, recorded with a huge budget (the plan of a
    step that starts with AdamW's state), rounded down to whole chunks."""
    model, opt = _fresh(device)
    with OutOfCore(model, opt, budget="4GiB", options=Options(chunk=chunk, min_bytes=4096), manage=manage,
                   device=device) as e:
        for step in range(3):
            x, y = _batch(step, device)
            with e.step():
                opt.zero_grad()
                _loss("gpt", model(x), y).backward()
                opt.step()
        return e._plans.schedule.sequence.in_core_peak_bytes // fraction // chunk * chunk


def _assert_bitwise(ref, got) -> None:
    (ref_model, ref_opt, r), (model, opt, g) = ref, got
    for i, (a, b) in enumerate(zip(r["loss"], g["loss"])):
        assert torch.equal(a, b), f"loss of step {i} differs: {a.item()} vs {b.item()}"
    assert r["scale"] == g["scale"] and r["updated"] == g["updated"]
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after {STEPS} steps"
    for s_ref, s in zip(ref_opt.state.values(), opt.state.values()):
        for k in s_ref:
            assert torch.equal(s_ref[k], s[k]), f"optimizer state {k} differs"


@pytest.mark.parametrize("manage", ["activations", "all"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_amp_loop_with_opt_step_inside_the_step_is_bitwise_in_core(precision: str, manage: str) -> None:
    kinds = ALL if manage == "all" else ("activations",)
    ref = _reference(precision)
    if precision == "fp16":
        assert ref[2]["updated"][:2] == [False, True], "the first update must be skipped"
    budget = _budget(kinds)
    got = _train(precision, {"budget": budget, "manage": kinds})
    _assert_bitwise(ref, got)
    record = got[2]
    assert record["stats"]["bytes_out"] > 0, "a quarter of the peak must swap"
    assert all(record["planned"][3:]), f"later steps must run their plans: {record['planned']}"
    assert record["hooks_left"] == 0, "close() must remove the optimizer hooks"


@pytest.mark.parametrize("zero_grad", ["top", "outside", "after"])
def test_zero_grad_anywhere_in_the_loop_keeps_steps_planned(zero_grad: str) -> None:
    """Grads managed: wherever ``zero_grad()`` sits, every step after the warm-up (the first
    update creates AdamW's state) starts in a state a plan was made for. Zeroing at the top
    of the step or before it used to give each step new gradient variables and re-plan it;
    zeroed before the step, the engine kept the dropped gradients' bytes into the next step."""
    ref = _reference("bf16", zero_grad)
    budget = _budget(ALL)
    got = _train("bf16", {"budget": budget, "manage": ALL}, zero_grad)
    _assert_bitwise(ref, got)
    planned, plans = got[2]["planned"], got[2]["plans"]
    assert all(planned[2:]), f"steps after the warm-up must run planned: {planned}"
    assert plans[-1] == plans[1], f"plans kept growing: {plans}"
    assert not any(got[2]["dropped_alive"]), \
        f"the engine kept gradients that zero_grad() dropped: {got[2]['dropped_alive']}"


@pytest.mark.parametrize("call", ["opt.step", "scaler.step"])
def test_an_update_over_the_budget_fails_at_opt_step_before_it_changes_anything(call: str) -> None:
    """test_update_budget's case, with the update called the user's way: the engine's
    pre-hook checks the update's needs before it runs (it used to run unchecked, update the
    parameters on demand over the budget, and fail only then)."""
    model, opt = ub.fresh()
    before = state_of(model, opt)
    engine = OutOfCore(model, opt, budget=ub.BUDGET, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    scaler = torch.amp.GradScaler("cpu")
    x, y = ub.batch(0)
    with pytest.raises(ooc.BudgetTooSmall) as err:
        with engine.step():
            loss = F.cross_entropy(model(x), y)
            if call == "opt.step":
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
    assert "of the optimizer step" in str(err.value), err.value
    engine.close()
    after = state_of(model, opt)
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k]), f"{k} changed although the update was refused"
    assert not opt.state, "the optimizer must not have stepped"


@pytest.mark.timeout(60)
def test_io_error_during_opt_step_says_the_update_was_partial(tmp_path) -> None:
    """An I/O error inside ``opt.step()`` called by the user (all managed: the update swaps
    parameters and state one by one) is not rolled back; the error says so."""
    model, opt = fresh(kind="mlp")
    faults = Faults()
    e = faulty_engine(model, opt, faults, tmp_path, manage=ALL, kind="mlp")
    x, y = batch(0)
    for _ in range(2):
        with e.step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    started = []
    opt.register_step_pre_hook(lambda *a: started.append(True))   # after the engine's
    faults.fn = lambda op, key, off, n: _eio("pread")(op, key, off, n) if started else None
    with pytest.raises(StorageError) as err:
        with e.step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert "during the optimizer step" in str(err.value) and "checkpoint" in str(err.value)
    faults.fn = None
    del err
    e.close()


@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
def test_unscale_and_clip_over_all_grads_fit_a_budget_smaller_than_the_grads(clip: str) -> None:
    """``scaler.unscale_(opt)`` and gradient clipping are foreach ops over every gradient. All
    managed, under a budget of 3/4 of the MLP's gradients (SGD-momentum's update of one
    parameter fits), they needed every gradient resident at once (BudgetTooSmall); entry by
    entry they fit, bitwise as in core."""
    model, opt = fresh("sgd", kind="mlp")
    ref, ref_opt = fresh("sgd", kind="mlp")
    budget = sum(p.untyped_storage().nbytes() for p in model.parameters()) * 3 // 4 // CHUNK * CHUNK
    engine = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    scalers = [torch.amp.GradScaler("cpu", **SKIP_FIRST) for _ in range(2)]
    for step in range(4):
        x, y = batch(step)
        for m, o, scaler, e in ((ref, ref_opt, scalers[0], None), (model, opt, scalers[1], engine)):
            with e.step() if e is not None else contextlib.nullcontext():
                o.zero_grad()
                scaler.scale(F.cross_entropy(m(x), y)).backward()
                scaler.unscale_(o)
                if clip == "clip_grad_norm_":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                else:
                    torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
                scaler.step(o)
                scaler.update()
    stats = engine.stats()
    engine.close()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert stats["plan.peak_resident_bytes"] <= budget and stats["last_planned"]
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"
    for s_ref, s_got in zip(ref_opt.state.values(), opt.state.values()):
        for k in s_ref:
            assert torch.equal(s_ref[k], s_got[k]), f"optimizer state {k} differs"


def update_outside_the_step() -> None:
    """All managed, over the budget between steps (their storages released): the user
    calls ``opt.step()`` after ``with engine.step():``. Bitwise as in core."""
    model, opt = _fresh("cpu")
    ref, ref_opt = _fresh("cpu")
    budget = _budget(ALL)
    engine = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    for step in range(4):
        x, y = _data("gpt", step)
        for m, o, e in ((ref, ref_opt, None), (model, opt, engine)):
            torch.manual_seed(1000 + step)
            with e.step() if e is not None else contextlib.nullcontext():
                _loss("gpt", m(x), y).backward()
            o.step()
            o.zero_grad()
        managed = {id(s.storage) for s in engine._store.slots.values()}
        assert all(id(t.untyped_storage()) in managed for s in opt.state.values()
                   for t in s.values() if t.untyped_storage().nbytes() >= 4096), \
            "the state an update outside the step made must be managed"
    assert engine.stats()["bytes_out"] > 0
    engine.close()
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"


def test_update_outside_the_step_reads_the_real_bytes() -> None:
    """In a child process: a read of a released storage is garbage or a segfault."""
    run_in_child(__file__, "update_outside_the_step")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_amp_loop_is_bitwise_in_core(precision: str) -> None:
    """REAL GPU: the same loop with CUDA autocast and ``GradScaler("cuda")``, all managed at a
    quarter of the peak, bitwise as without the engine."""
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    pytest.importorskip("cupy", reason="needs cupy: pip install 'ooc[cuda]'")
    chunk = 2 << 20   # a real GPU's VMM granularity
    ref = _train(precision, None, device="cuda")
    if precision == "fp16":
        assert ref[2]["updated"][:2] == [False, True], "the first update must be skipped"
    budget = max(_budget(ALL, device="cuda", chunk=chunk), chunk)
    got = _train(precision, {"budget": budget, "manage": ALL, "chunk": chunk}, device="cuda")
    _assert_bitwise(ref, got)
    assert got[2]["stats"]["bytes_out"] > 0, "nothing was swapped: the budget is not binding"
