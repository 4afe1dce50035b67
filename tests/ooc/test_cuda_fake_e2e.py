"""``OutOfCore(device="cuda")`` end to end over the FAKE CUDA driver (``ooc.testing.fake_cuda``).

No GPU and no CUDA: the model and its batches are on the CPU, CPU memory stands for device
memory, and what runs above the fake is the real CUDA path: ``PinnedTier`` (copy streams,
events, pinned slabs, drain, reserve), ``CudaDevicePool`` over ``vmm.CudaBackend`` VMM chunks,
the engine's device-side waits (``CopyFuture.wait_on_device``), op timing through the seam,
``set_budget`` (a new pool) and ``close``. The fake runs copies lazily, only when something
waits for them, so a missing or misplaced wait shows as stale bytes (parameters that differ
from plain training) or as a contract violation; every step is compared bitwise with the
same training without the engine.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
import ooc.testing
from ooc.storage import cuda_tier

pytestmark = pytest.mark.timeout(120)

CHUNK = 64 << 10      # the fake's granularity
SYNC_CALLS = ("cuCtxSynchronize", "cuStreamSynchronize")
MAX_PLANNED_SYNCS = 3


class BNCNN(nn.Module):
    """conv-BN-ReLU with a residual block and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
            for _ in range(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(16 * 4 * 4, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(F.adaptive_avg_pool2d(x, 4))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


CASES = {
    # name: (model, optimizer, manage, input shape per batch size, the changed batch size)
    "cnn_sgd_activations": (BNCNN, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                            ("activations",), lambda n: (n, 3, 16, 16), 8),
    # its activations change size in whole chunks only with a larger batch
    "mlp_adam_all": (_mlp, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, foreach=False),
                     ("activations", "params", "grads", "optimizer_state"), lambda n: (n, 256), 40),
}
# (batch size, budget change before the step): step 0 records on demand, 1-2 run the plan
# (or, the first time, meet the optimizer state step 0 created and re-plan), 3 changes the
# batch size (another shape: the forward shows it, the step is recorded on demand under its
# own shape, the first shape's plan kept), 4 runs the new plan,
# 5 records again under a smaller budget (set_budget: a new pool), 6 runs that plan.
SCHEDULE = [(16, None), (16, None), (16, None), ("changed", None), ("changed", None),
            ("changed", "smaller"), ("changed", None)]


def _batch(case: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(CASES[case][3](n), generator=g), torch.randint(0, 10, (n,), generator=g)


def _fresh(case: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = CASES[case][0]()
    return model, CASES[case][1](model)


def _peak(case: str) -> int:
    """The in-core peak of the managed tensors, from a plan made with plenty of budget."""
    model, opt = _fresh(case)
    e = ooc.OutOfCore(model, opt, device="cuda", budget="1GiB", options=ooc.Options(chunk=CHUNK, min_bytes=4096), manage=CASES[case][2])
    x, y = _batch(case, 0, 16)
    with e.step():   # records, then plans
        F.cross_entropy(model(x), y).backward()
        e.optimizer_step()
    peak = e._plans.schedule.sequence.in_core_peak_bytes
    e.close()
    return peak


def _assert_same(step: int, ref: tuple, got: tuple) -> None:
    (ref_loss, ref_model, ref_opt), (loss, model, opt) = ref, got
    assert torch.equal(ref_loss, loss), f"step {step}: loss {ref_loss.item()} vs {loss.item()}"
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"step {step}: {name} differs from training without ooc"
    for (_, s_ref), s in zip(ref_opt.state.items(), opt.state.values()):
        for k in s_ref:
            assert torch.equal(torch.as_tensor(s_ref[k]), torch.as_tensor(s[k])), \
                f"step {step}: optimizer state {k} differs"


def _host_syncs(engine: ooc.OutOfCore) -> int:
    """Host synchronizations so far: the tier's, plus the pool backend's synchronize calls."""
    backend = getattr(engine._mem.pool, "backend", None)   # PyTorch's arena has no VMM backend
    calls = backend.calls if backend is not None else {}
    return engine.stats()["tier.host_syncs"] + sum(calls.get(c, 0) for c in SYNC_CALLS)


def _train(case: str, arena: str = "pool") -> tuple[ooc.OutOfCore, list[dict]]:
    """Train with and without the engine in lockstep, compare after every step."""
    peak = _peak(case)
    budget = max(CHUNK, peak // 2 // CHUNK * CHUNK)
    model, opt = _fresh(case)
    ref_model, ref_opt = copy.deepcopy(model), _fresh(case)[1]
    ref_opt = CASES[case][1](ref_model)
    e = ooc.OutOfCore(model, opt, device="cuda", budget=budget, manage=CASES[case][2],
                      options=ooc.Options(chunk=CHUNK, min_bytes=4096, arena=arena))
    assert e.device == torch.device("cuda", 0)
    assert isinstance(e._mem.tier, cuda_tier.PinnedTier)
    log = []
    for step, (n, change) in enumerate(SCHEDULE):
        if change == "smaller":
            e.set_budget(max(CHUNK, budget * 3 // 4 // CHUNK * CHUNK))
        x, y = _batch(case, step, CASES[case][4] if n == "changed" else n)
        torch.manual_seed(1000 + step)   # dropout
        loss = F.cross_entropy(ref_model(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        before = _host_syncs(e)
        torch.manual_seed(1000 + step)
        with e.step():
            got = F.cross_entropy(model(x), y)
            got.backward()
            e.optimizer_step()
        stats = e.stats()
        log.append(dict(step=step, planned=stats["last_planned"], syncs=_host_syncs(e) - before,
                        diverged=stats["last_diverged_at"], bytes_out=stats["bytes_out"]))
        with e.resident():   # managed parameters and state are in pinned memory between steps
            _assert_same(step, (loss.detach(), ref_model, ref_opt), (got.detach(), model, opt))
    return e, log


@pytest.mark.parametrize("arena", ["pool", "pytorch"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_path_over_the_fake_driver_is_bitwise_in_core(case: str, arena: str) -> None:
    """Both arenas: ooc's VMM pool, and PyTorch's allocator (``Options(arena="pytorch")``),
    whose swap-ins are ordinary tensors the fake checks each copy against while it runs."""
    with ooc.testing.fake_cuda() as driver:
        e, log = _train(case, arena)
        pools = (type(e._mem.pool).__name__, e.stats()["pool_peak_mapped_bytes"])
        stats = e.stats()
        e.close()
        assert driver.violations == []
        assert set(driver.outstanding().values()) == {0}, driver.outstanding()
    assert pools[0] == {"pool": "CudaDevicePool", "pytorch": "TorchArenaPool"}[arena]
    assert 0 < pools[1] <= e._mem.budget, "the swap-ins were counted, within the budget"
    # bytes really moved, through the fake's copies
    assert stats["bytes_out"] > 0 and stats["bytes_in"] > 0
    assert stats["tier.bytes_written"] > 0 and driver.copies_run > 0
    assert "cuMemcpyDtoHAsync" in driver.calls and "cuMemcpyHtoDAsync" in driver.calls
    # the steps did what the schedule says: on demand, planned, a new shape recorded, planned
    assert not log[0]["planned"] and log[2]["planned"] and log[2]["diverged"] == -1, log
    assert not log[3]["planned"] and log[3]["diverged"] == -1, log   # a new shape: recorded, not diverged
    assert log[4]["planned"] and log[6]["planned"] and not log[5]["planned"], log
    assert stats["plans"] >= 4
    # a planned step blocks the host a few times at most (commit point, step end)
    planned = [r["syncs"] for r in log if r["planned"]]
    assert planned and max(planned) <= MAX_PLANNED_SYNCS, log


def test_fake_cuda_restores_the_real_seam() -> None:
    from ooc.runtime import devices

    real = devices.cuda_runtime()
    with ooc.testing.fake_cuda() as driver:
        assert devices.cuda_runtime().fake and devices.cuda_runtime().driver() is driver
    assert devices.cuda_runtime() is real and not real.fake


def _stats_after_steps(device: str) -> dict:
    model, opt = _fresh("mlp_adam_all")
    with ooc.OutOfCore(model, opt, device=device, budget="5MiB", manage=CASES["mlp_adam_all"][2],
                       options=ooc.Options(chunk=CHUNK, min_bytes=4096)) as e:
        before = e.stats()
        for step in range(3):
            x, y = _batch("mlp_adam_all", step, 16)
            with e.step():
                F.cross_entropy(model(x), y).backward()
                e.optimizer_step()
        return {"before": before, "after": e.stats()}


def test_stats_have_the_same_keys_on_the_cpu_and_on_cuda() -> None:
    """``stats()`` is counters and gauges with the same keys on every device (issue 39 item 6):
    ``tier.host_syncs`` on the CPU and ``cpu_allocator.*`` and ``tier.file_bytes`` on CUDA are
    there, 0 where they mean nothing; the steps of each form add up to ``steps``."""
    cpu = _stats_after_steps("cpu")
    with ooc.testing.fake_cuda() as driver:
        cuda = _stats_after_steps("cuda")
        assert driver.violations == []
    for stats in (cpu["before"], cpu["after"], cuda["before"], cuda["after"]):
        assert stats.keys() == cpu["after"].keys()
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in stats.values()), stats
        assert stats["steps"] == sum(stats[f"steps.{form}"] for form in ooc.FORMS)
    assert cpu["before"]["last_form"] == -1 and cpu["after"]["steps"] == cuda["after"]["steps"] == 3
    assert cpu["after"]["tier.host_syncs"] == 0 and cpu["after"]["tier.file_bytes"] > 0
    assert cuda["after"]["tier.file_bytes"] == 0 and cuda["after"]["cpu_allocator.hits"] == 0
    assert cuda["after"]["tier.bytes_written"] > 0 and cuda["after"]["tier.pinned_bytes"] > 0
    assert ooc.FORMS[cuda["after"]["last_form"]] in ("planned", "recorded", "diverged")


# hook-driven forms on CUDA: (budget as a fraction of the in-core peak, recompute, the form the
# settled steps take). Under "auto" the plan is tried against its anchored form once its prices
# settled (its first two runs time their ops and price it again); "templates" is "auto" with
# the link priced slow (1 GB/s), so that the plan recomputes and its anchored form reruns the
# chains from templates (``ooc/runtime/templates.py``); under "prefer" it keeps the per-op
# path.
HOOK_CASES = {"plain": (4.0, "auto", "plain"), "anchored": (0.5, "never", "anchored"),
              "auto": (0.5, "auto", "anchored"), "templates": (0.5, "auto", "anchored"),
              "recomputing": (0.5, "prefer", "planned")}


@pytest.mark.parametrize("case,arena", [(c, "pool") for c in HOOK_CASES]
                         + [("anchored", "pytorch"), ("recomputing", "pytorch")])
def test_hook_driven_forms_on_cuda_are_bitwise_in_core(case: str, arena: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain and anchored steps (no op intercepted) on the CUDA path over the FAKE driver:
    every step bitwise against the same loop without the engine; an anchored plan's trial
    times each side on the device (one host synchronization at its end), then the kept form
    blocks the host no more than a planned per-op step does (the trial's verdict is fixed:
    keep, after two steps of each side)."""
    from ooc.engine import hook_forms
    from ooc.runtime import devices
    from test_anchored_steps import _decided

    # the trial's verdict on the host's clock would depend on the machine's load: fixed here
    monkeypatch.setattr(hook_forms.HookPlan, "judge", _decided(keep=True, runs=2))
    fraction, recompute, settled = HOOK_CASES[case]
    if case == "templates":
        from test_anchored_steps import templates_forced
        templates_forced(monkeypatch.setattr, h2d_bandwidth=1e9, d2h_bandwidth=1e9)
        monkeypatch.setattr(hook_forms.HookPlan, "judge", _decided(keep=True, runs=2))
    with ooc.testing.fake_cuda() as driver:
        peak = _peak("cnn_sgd_activations")
        runtime, events = devices.cuda_runtime(), []
        make_event = runtime.timing_event
        monkeypatch.setattr(runtime, "timing_event", lambda: events.append(1) or make_event())
        model, opt = _fresh("cnn_sgd_activations")
        ref_model = copy.deepcopy(model)
        ref_opt = CASES["cnn_sgd_activations"][1](ref_model)
        e = ooc.OutOfCore(model, opt, device="cuda", budget=max(CHUNK, int(peak * fraction) // CHUNK * CHUNK),
                          recompute=recompute, options=ooc.Options(chunk=CHUNK, min_bytes=4096, arena=arena))
        forms, syncs, waits, recomputed = [], [], [], []
        for step in range(12):
            x, y = _batch("cnn_sgd_activations", step, 16)
            torch.manual_seed(1000 + step)
            loss = F.cross_entropy(ref_model(x), y)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            before, events_before = _host_syncs(e), len(events)
            torch.manual_seed(1000 + step)
            with e.step():
                got = F.cross_entropy(model(x), y)
                got.backward()
                e.optimizer_step()
            syncs.append(_host_syncs(e) - before)
            waits.append(len(events) - events_before)   # timing events: per op when recording
            forms.append(ooc.FORMS[e.stats()["last_form"]])
            recomputed.append(e.stats()["bytes_recomputed"])
            _assert_same(step, (loss.detach(), ref_model, ref_opt), (got.detach(), model, opt))
        stats = e.stats()
        e.close()
        assert driver.violations == []
        assert set(driver.outstanding().values()) == {0}, driver.outstanding()
    assert forms[-3:] == [settled] * 3, forms
    assert max(syncs[-3:]) <= MAX_PLANNED_SYNCS, (forms, syncs)
    start = 3   # the plan's first planned run makes its anchored form ...
    if case in ("auto", "templates"):   # ... after its prices settled: its first runs timed each op on the device
        assert forms[2:5] == ["planned"] * 3 and min(waits[2:4]) > 100 and waits[4] == 0, (forms, waits)
        start = 5
    elif case == "anchored":   # swap only: nothing to price, no op timed
        assert forms[2] == "planned" and waits[2] == 0, (forms, waits)
    if case in ("anchored", "auto", "templates"):   # it moves bytes through the pinned tier, at the hooks
        assert stats["steps.anchored"] >= 3 and "planned" in forms[start:start + 4], forms
        # the trial's steps, either side, wait for the device once (an event); the kept form never
        trial = [w for f, w in zip(forms[start:], waits[start:]) if f in ("anchored", "planned")]
        assert trial[:4] == [1, 1, 1, 1] and waits[-2:] == [0, 0], (forms, waits)
        assert stats["bytes_out"] > 0 and stats["tier.bytes_written"] > 0
    if case == "recomputing":
        assert stats["bytes_recomputed"] > 0 and stats["steps.plain"] == stats["steps.anchored"] == 0
    if case == "templates":   # the anchored steps rerun chains, from templates, on the CUDA path
        hooked = [b - a for f, a, b in zip(forms[1:], recomputed, recomputed[1:]) if f == "anchored"]
        assert hooked and min(hooked) > 0, (forms, recomputed)


def test_an_ops_end_event_is_queued_before_the_step_records_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE DRIVER: on a GPU the end event runs when the host queues it, so the recording step
    queues it right after the op and records the op after (else the device idles while Python
    records, and that idling is timed as the op's). Checked where the full recorder is called:
    the op's end event (the newest made) was recorded already."""
    from ooc.record.recorder import StepRecorder

    made, checked = [], []
    timing_event, op = ooc.testing.FakeCudaRuntime.timing_event, StepRecorder.op

    def event(self):
        made.append(timing_event(self))
        return made[-1]

    def recorded(self, *args, **kwargs):
        checked.append(made[-1].t is not None)
        return op(self, *args, **kwargs)

    monkeypatch.setattr(ooc.testing.FakeCudaRuntime, "timing_event", event)
    monkeypatch.setattr(StepRecorder, "op", recorded)
    with ooc.testing.fake_cuda():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ooc.OutOfCore(model, opt, device="cuda", budget="1GiB", options=ooc.Options(chunk=CHUNK)) as e:
            with e.step():
                F.mse_loss(model(torch.randn(64, 256)), torch.randn(64, 10)).backward()
                opt.step()
    assert checked and all(checked), f"{checked.count(False)} of {len(checked)} ops recorded before their end event"
