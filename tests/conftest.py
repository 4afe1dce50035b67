"""Shared test configuration: tests run on the CPU; GPU tests skip without a device; the slow
ones go first (the README runs the suite in two pytest-xdist workers)."""

from __future__ import annotations

import gc
import os

import pytest

_THREADS_GIVEN = "OMP_NUM_THREADS" in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_configure(config: pytest.Config) -> None:
    """Two compute threads a process, or one in each of the README's two pytest-xdist workers
    (set here, in the controlling process, before it starts them with its environment): two
    workers of two threads each on two cores spent more time spinning than computing (past
    15 minutes of wall time, where one process of two threads took 14.6)."""
    if not _THREADS_GIVEN and getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True, scope="module")
def _earlier_objects_frozen():
    """Each module's tests start with every object alive before them moved out of the cyclic
    collector's sight (``gc.freeze``). Why: the suite imports torch, transformers and scipy
    and keeps what earlier modules left alive, and every full collection walked all of it:
    ~0.25 s a ``gc.collect()`` late in the run, 105 s of a 536 s suite (one test that collects
    after each of its 52 frees took 13 s in the suite, 2 s alone). What a module makes is
    still collected as before; only cycles among frozen objects, made before, are never freed."""
    gc.collect()
    gc.freeze()
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error shown elsewhere
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
    # The tests marked slow (a minute or two each, several processes of their own) first: with
    # the README's two workers (``--dist worksteal``) they then run beside the short tests, not
    # alone at the end (the benchmarks' smoke run, 140 s, was the last two minutes of the run).
    items.sort(key=lambda item: "slow" not in item.keywords)
