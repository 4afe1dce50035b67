"""``vmm.cuda_driver``: the one module that calls the CUDA driver (tested with the FAKE driver)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ooc.testing.fake_cuda_driver import CUresult, FakeDriver
from vmm.backend import BackendCallError
from vmm.cuda_driver import CudaDriver, DriverCallError, DriverOutOfMemory, import_driver
from vmm.errors import OutOfBudget, VMMError

ROOT = Path(__file__).resolve().parents[2]


def test_no_other_module_calls_the_driver() -> None:
    """Every ``cu*`` driver entry point is called in vmm/cuda_driver.py (the fake driver, which
    implements them, and tests aside)."""
    call = re.compile(r"\.cu[A-Z][A-Za-z]+\(|getattr\((self\.)?_?drv")
    offenders = []
    for package in ("ooc", "vmm", "scheduler"):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "vmm/cuda_driver.py" or rel.startswith("ooc/testing/"):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if call.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == []


def test_checked_calls_name_the_call_and_the_error() -> None:
    """FAKE driver: a failure is a DriverCallError (a BackendCallError) naming the call, its
    arguments, the error and the device; out of memory is also an OutOfBudget; an exception
    inside the binding is wrapped with it as the cause; attempt() never raises."""
    fake = FakeDriver()
    cu = CudaDriver(fake, label="test", device=0)
    dev, ctx = cu.retain_primary_context()
    assert cu.calls == {"cuInit": 1, "cuDeviceGet": 1, "cuDevicePrimaryCtxRetain": 1}

    fake.fail_next("cuMemAddressReserve", CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(DriverCallError, match=r"^test: cuMemAddressReserve\(4096, 0, 0, 0\) "
                                              r"failed with CUDA_ERROR_INVALID_VALUE.* on device 0"
                       ) as err:
        cu.call("cuMemAddressReserve", 4096, 0, 0, 0)
    assert isinstance(err.value, BackendCallError)
    assert err.value.call == "cuMemAddressReserve"
    assert err.value.cuda_error == CUresult.CUDA_ERROR_INVALID_VALUE

    fake.fail_next("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(DriverOutOfMemory) as err:
        cu.call("cuMemCreate", 1 << 20, cu.allocation_prop(), 0)
    assert isinstance(err.value, OutOfBudget)

    def broken(*args):
        raise RuntimeError("driver library gone")

    fake.cuCtxSynchronize = broken
    with pytest.raises(DriverCallError, match="cuCtxSynchronize.*raised RuntimeError") as err:
        cu.call("cuCtxSynchronize")
    assert err.value.cuda_error is None and isinstance(err.value.__cause__, RuntimeError)
    assert "raised RuntimeError" in cu.attempt("cuCtxSynchronize")
    assert cu.host_syncs == 2

    assert cu.attempt("cuDevicePrimaryCtxRelease", dev) is None
    assert fake.outstanding()["retained_contexts"] == 0


def test_missing_cuda_python_names_the_install(monkeypatch) -> None:
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(VMMError, match=r"PinnedTier needs cuda-python: pip install 'ooc\[cuda\]'"):
        import_driver("PinnedTier")
    with pytest.raises(VMMError, match="needs cuda-python"):
        CudaDriver(None, label="x", device=0)
