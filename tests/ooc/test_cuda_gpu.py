"""The CUDA tier, pool and engine on a REAL GPU. Every test is marked ``gpu`` and skips where
``torch.cuda.is_available()`` is false (tests/conftest.py): the project's own machines and CI
have no GPU. They ran on an H100 lent to one session (see benchmarks/results/gpu.md for the
date and versions): ``pytest -m gpu`` runs them, and ``benchmarks/bench_gpu.py`` is the
full validation. The same code paths run against a fake driver in ``test_cuda_tier.py``.

Needs the ``cuda`` extra (cuda-python, cupy, nvtx): tests that need a missing piece skip.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def driver():
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    from ooc.storage.cuda_tier import import_driver

    torch.cuda.init()   # PyTorch makes the primary context the tier and pool retain
    return import_driver()


def _ptr(t: torch.Tensor):
    from ooc.runtime.devices import DevicePtr

    return DevicePtr(t.data_ptr(), t.numel() * t.element_size())


def test_gpu_pinned_round_trip(driver) -> None:
    """REAL GPU: bytes produced by a kernel on the compute stream go to pinned memory and come
    back identical into another tensor; result() synchronizes."""
    from ooc.storage.cuda_tier import PinnedTier

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    with PinnedTier(capacity_bytes=64 * MiB, slab_bytes=16 * MiB, verify=True,
                    compute_stream=stream) as tier:
        x = torch.randn(3 * MiB // 4, device="cuda") * 3 + 1   # a kernel still queued, maybe
        tier.write_async(1, _ptr(x), x.nbytes).result()
        y = torch.empty_like(x)
        tier.read_async(1, _ptr(y)).result()
        assert torch.equal(x, y)
        st = tier.stats()
        assert st["bytes_written"] == st["bytes_read"] == x.nbytes


def test_gpu_wait_on_orders_the_compute_stream(driver) -> None:
    """REAL GPU: wait_on(current stream) instead of result(): kernels queued afterwards on that
    stream see the swapped-in bytes without a host synchronization."""
    from ooc.storage.cuda_tier import PinnedTier

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    with PinnedTier(capacity_bytes=64 * MiB, compute_stream=stream) as tier:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        tier.write_async(7, _ptr(x), x.nbytes).result()
        y = torch.zeros_like(x)
        f = tier.read_async(7, _ptr(y))
        f.wait_on(torch.cuda.current_stream().cuda_stream)
        assert torch.equal(y * 2, x * 2)                      # ordered on the stream
        f.result()


def test_gpu_pool_tensor_and_lifetime(driver) -> None:
    """REAL GPU: CudaDevicePool.take gives a zero-copy uint8 CUDA tensor over a VMM range;
    the range goes back when the last view of it dies."""
    pytest.importorskip("cupy", reason="needs cupy: pip install 'ooc[cuda]'")
    from ooc.runtime.cuda_pool import CudaDevicePool

    pool = CudaDevicePool(16 * MiB, 2 * MiB)
    t = pool.take(3 * MiB)
    assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == 3 * MiB
    t.fill_(7)
    view = t[MiB:].view(torch.int32)
    del t
    pool.reap()
    assert pool.stats()["allocations"] == 1
    assert int(view[0]) == 0x07070707
    del view
    torch.cuda.synchronize()
    pool.reap()
    assert pool.stats()["allocations"] == 0
    pool.close()


def test_gpu_route_allocations_into_the_pool(driver) -> None:
    """REAL GPU: PyTorch's allocations inside route_allocations come from the VMM pool."""
    from ooc.runtime.cuda_pool import CudaDevicePool, route_allocations

    pool = CudaDevicePool(64 * MiB, 2 * MiB)
    with route_allocations(pool):
        x = torch.ones(1 << 20, device="cuda")
        y = x * 2
    assert pool.stats()["allocations"] >= 1
    assert float(y.sum()) == 2 * (1 << 20)
    del x, y


def test_gpu_tiny_out_of_core_step() -> None:
    """REAL GPU: a tiny OutOfCore training step on cuda matches in-core training bitwise."""
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    import copy

    import torch.nn as nn

    from ooc.engine import Options, OutOfCore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10)).cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(512, 256, device="cuda")
    target = torch.randint(0, 10, (512,), device="cuda")
    engine = OutOfCore(model, opt, budget="4MiB", device="cuda", options=Options(chunk="2MiB", min_bytes=4096))
    for _ in range(3):
        with engine.step():
            nn.functional.cross_entropy(model(x), target).backward()
            engine.optimizer_step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), target).backward()
        ref_opt.step()
    engine.close()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def _bn_cnn():
    import torch.nn as nn

    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(), nn.Dropout(0.1))

    return nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2), block(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _mlp():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(2048, 10))


@pytest.mark.parametrize("kind", ["bn_cnn_sgd_activations", "mlp_adam_all_managed",
                                  "bn_cnn_sgd_activations_one_arena", "mlp_adam_all_managed_one_arena"])
def test_gpu_engine_scenario_bitwise(kind: str) -> None:
    """REAL GPU: planned steps, a changed batch shape (on demand, re-planned), set_budget and
    close, bitwise equal to the same training without the engine after every step; in ooc's
    VMM pool and, ``_one_arena``, with the swap-ins in PyTorch's allocator."""
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    pytest.importorskip("cupy", reason="needs cupy: pip install 'ooc[cuda]'")
    import copy

    import torch.nn as nn

    from ooc.engine import OutOfCore, Options

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    if kind.startswith("bn_cnn"):
        model = _bn_cnn().cuda()
        make_opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
        shapes, budgets = [(32, 3, 64, 64)] * 3 + [(24, 3, 64, 64)] * 2, ("128MiB", "96MiB")
        manage = ("activations",)
    else:
        model = _mlp().cuda()
        # The engine runs a managed optimizer per parameter (foreach=False): on a GPU, Adam's
        # default multi-tensor implementation rounds differently, so compare with the same.
        make_opt = lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False)  # noqa: E731
        shapes, budgets = [(256, 1024)] * 3 + [(192, 1024)] * 2, ("80MiB", "72MiB")
        manage = ("activations", "params", "grads", "optimizer_state")
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    arena = "pytorch" if kind.endswith("one_arena") else "pool"
    engine = OutOfCore(model, opt, budget=budgets[0], device="cuda", manage=manage,
                       options=Options(arena=arena))
    planned = []
    for step, shape in enumerate(shapes + shapes[:2]):
        if step == len(shapes):
            engine.set_budget(budgets[1])
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(shape, device="cuda", generator=g)
        y = torch.randint(0, 10, (shape[0],), device="cuda", generator=g)
        torch.manual_seed(100 + step)
        with engine.step():
            nn.functional.cross_entropy(model(x), y).backward()
            engine.optimizer_step()
        planned.append(engine.stats()["last_planned"])
        torch.manual_seed(100 + step)
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        with engine.resident():
            for (name, a), b in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(a, b), f"step {step}: {name} differs"
    assert any(planned), "no step ran planned"
    assert engine.stats()["bytes_out"] > 0, "nothing was swapped: the budget is not binding"
    engine.close()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_gpu_plan_is_priced_on_two_timed_runs_with_device_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """REAL GPU: a plan that recomputes is priced again on its first two planned runs, which
    time each op with CUDA events (the recording step's ran on a cold caching allocator), and
    no later run is timed; training bitwise as in core after every step, timed or not."""
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    import copy
    import time

    import torch.nn as nn

    from ooc.engine import OutOfCore
    from ooc.engine.planning import Planner
    from ooc.runtime.stepper import Stepper

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    model = _bn_cnn().cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    runs: list[tuple[bool, float]] = []   # per planned per-op run: timed?, its ops' seconds added up
    real = Planner._facts

    def noted(self, st, report, **kw):
        if isinstance(st, Stepper) and report.kept_plan:
            runs.append((st.ctx.time_ops, sum(st.rec.seconds)))
        return real(self, st, report, **kw)

    monkeypatch.setattr(Planner, "_facts", noted)
    # 96 MiB: the second block's dropout alone holds 72 MiB at once (its 32 MiB input and
    # output, its 8 MiB mask); at 48 MiB no plan exists (the H200 run of 76db2c5 said so)
    engine = OutOfCore(model, opt, budget="96MiB", device="cuda", recompute="prefer")
    walls = []
    for step in range(7):
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(32, 3, 64, 64, device="cuda", generator=g)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        torch.manual_seed(100 + step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with engine.step():
            nn.functional.cross_entropy(model(x), y).backward()
            engine.optimizer_step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        torch.manual_seed(100 + step)
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), f"step {step}: {name} differs"
    assert engine.stats()["bytes_recomputed"] > 0, "the plan recomputes nothing: nothing to price"
    engine.close()
    assert [t for t, _ in runs][:3] == [True, True, False], runs
    assert all(0 < ops_s < max(walls) for _, ops_s in runs[:2]), (runs, walls)   # read from the events


def test_gpu_validation_command_runs_quick(tmp_path) -> None:
    """REAL GPU: benchmarks/bench_gpu.py --quick (the validation command) exits 0 and reports
    bitwise identical training."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
    out = tmp_path / "gpu-quick.md"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--no-sanitizer", "--no-compile",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "**NO**" not in text and "FAILED" not in text, text


def test_gpu_the_seams_compute_stream_is_pytorchs_current_one() -> None:
    """REAL GPU: the handle the tier orders its copies after (``CudaRuntime.compute_stream``,
    PyTorch's raw handle where the build has one) is the current stream's, on the default
    stream and inside ``torch.cuda.stream(...)``."""
    from ooc.runtime.cuda_seam import CudaRuntime

    current = CudaRuntime().compute_stream(torch.cuda.current_device())
    assert current() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert current() == torch.cuda.current_stream().cuda_stream
