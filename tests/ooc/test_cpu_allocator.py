"""The recycling CPU allocator (ooc/runtime/cpu_allocator.py): reuse inside a step, memory
back to the system at its end, and a clean fallback wherever it cannot be built or trusted.

Installing it is process-wide and permanent, so every case that must start without it (or
with a broken build) runs in a child process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from ooc.runtime import cpu_allocator

needs_compiler = pytest.mark.skipif(
    not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")),
    reason="no C++ compiler: the allocator cannot be built here (the engine falls back)")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(code: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_compiler
def test_a_step_reuses_freed_blocks_and_gives_them_back_at_its_end():
    assert cpu_allocator.acquire(), cpu_allocator.unavailable()
    owner = object()
    before = cpu_allocator.stats()
    cpu_allocator.begin(owner, 128 << 20)
    try:
        for _ in range(6):   # 6 rounds of 8 x 8 MiB, freed after each round
            blocks = [torch.ones(2 << 20) for _ in range(8)]   # 8 MiB each, touched
            del blocks
        during = cpu_allocator.stats()
        rss_cached = _rss()
    finally:
        cpu_allocator.end(owner)
    after = cpu_allocator.stats()
    assert during["hits"] - before["hits"] >= 40          # rounds 2..6 come from the cache
    assert during["misses"] - before["misses"] <= 8
    assert during["cached_bytes"] == 64 << 20
    assert after["cached_bytes"] == 0 and after["enabled"] == 0
    assert rss_cached - _rss() >= 48 << 20                 # the kernel really got them back


@needs_compiler
def test_the_cache_never_holds_more_than_its_cap():
    assert cpu_allocator.acquire(), cpu_allocator.unavailable()
    owner = object()
    cpu_allocator.begin(owner, 16 << 20)
    try:
        blocks = [torch.ones(2 << 20) for _ in range(8)]
        del blocks
        assert cpu_allocator.stats()["cached_bytes"] <= 16 << 20
    finally:
        cpu_allocator.end(owner)


@needs_compiler
def test_a_full_cache_drops_its_oldest_blocks_for_the_newest():
    assert cpu_allocator.acquire(), cpu_allocator.unavailable()
    owner = object()
    cpu_allocator.begin(owner, 14 << 20)
    try:
        a, b, c = (torch.empty(n << 20, dtype=torch.uint8) for n in (4, 6, 8))
        del a, b, c   # freed oldest first: 4, 6, 8 MiB; only 6 + 8 fit the 14 MiB cap
        assert cpu_allocator.stats()["cached_bytes"] == 14 << 20
        before = cpu_allocator.stats()
        keep = [torch.empty(8 << 20, dtype=torch.uint8), torch.empty(6 << 20, dtype=torch.uint8)]
        mid = cpu_allocator.stats()
        keep.append(torch.empty(4 << 20, dtype=torch.uint8))
        after = cpu_allocator.stats()
        assert mid["hits"] - before["hits"] == 2          # the two newest were kept
        assert after["misses"] - mid["misses"] == 1       # the oldest had been unmapped
    finally:
        cpu_allocator.end(owner)


@needs_compiler
def test_outside_a_step_requests_go_to_pytorch_unchanged():
    assert cpu_allocator.acquire(), cpu_allocator.unavailable()
    before = cpu_allocator.stats()
    t = torch.ones(4 << 20)
    del t
    after = cpu_allocator.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


@needs_compiler
def test_with_two_engines_the_cache_lasts_until_the_last_step_ends():
    assert cpu_allocator.acquire(), cpu_allocator.unavailable()
    a, b = object(), object()
    cpu_allocator.begin(a, 32 << 20)
    cpu_allocator.begin(b, 64 << 20)
    cpu_allocator.end(a)
    assert cpu_allocator.stats()["enabled"] == 1 and cpu_allocator.stats()["cap_bytes"] == 64 << 20
    cpu_allocator.end(b)
    assert cpu_allocator.stats()["enabled"] == 0


TRAIN = """
    import json, logging, torch, ooc
    from ooc.runtime import cpu_allocator
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1),
                                torch.nn.Flatten(), torch.nn.Linear(16 * 64 * 64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    with ooc.OutOfCore(model, opt, budget="8MiB") as engine:
        for _ in range(3):
            with engine.step():
                torch.nn.functional.cross_entropy(model(x), y).backward()
                engine.optimizer_step()
        stats = engine.stats()["cpu_allocator"]
    print(json.dumps({"used": stats is not None, "reason": cpu_allocator.unavailable(),
                      "weight_sum": float(model[0].weight.double().sum())}))
"""


def test_switched_off_the_engine_trains_the_same_without_it(tmp_path):
    on = _child(TRAIN, {"XDG_CACHE_HOME": str(tmp_path / "a")})
    off = _child(TRAIN, {"OOC_CPU_ALLOCATOR": "0", "XDG_CACHE_HOME": str(tmp_path / "b")})
    assert off["used"] is False and "OOC_CPU_ALLOCATOR=0" in off["reason"]
    assert on["weight_sum"] == off["weight_sum"]
    assert not (tmp_path / "b" / "ooc").exists()   # nothing built when switched off


def test_a_compiler_that_fails_means_a_fallback_not_an_error(tmp_path):
    out = _child(TRAIN, {"CXX": "/bin/false", "XDG_CACHE_HOME": str(tmp_path)})
    assert out["used"] is False
    assert "/bin/false failed to build cpu_allocator.cpp" in out["reason"]
    assert not list((tmp_path / "ooc").glob("*.so"))   # no half-built library left behind


@needs_compiler
def test_a_cache_directory_others_can_write_is_not_trusted(tmp_path):
    shared = tmp_path / "ooc"
    shared.mkdir()
    shared.chmod(0o777)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = _child(TRAIN, {"XDG_CACHE_HOME": str(tmp_path), "TMPDIR": str(scratch)})
    assert out["used"] is True          # built in a private temporary directory instead
    assert not list(shared.iterdir())   # and nothing loaded from, or written to, the shared one
    assert not list(scratch.glob("ooc-alloc-*"))   # the temporary build is gone once loaded


@needs_compiler
def test_the_cached_library_is_private_to_its_user(tmp_path):
    _child(TRAIN, {"XDG_CACHE_HOME": str(tmp_path)})
    (lib,) = (tmp_path / "ooc").glob("cpu_allocator-*.so")
    assert (tmp_path / "ooc").stat().st_mode & 0o777 == 0o700
    assert lib.stat().st_mode & 0o077 == 0


GLIBC = """
    import json, os, torch, ooc
    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    model = torch.nn.Linear(8, 8)
    engine = ooc.OutOfCore(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="8MiB")
    n = 16 << 20
    t = torch.ones(n // 4)   # outside a step: glibc's allocator, as parameters resized in place
    del t                    # (a dynamic threshold would now rise to 16 MiB)
    a, b = torch.ones(n // 4), torch.ones(n // 4)
    before = rss()
    del a                    # not at the top of a heap: only an unmapped block gives it back
    print(json.dumps({"given_back": before - rss()}))
"""


def test_storages_made_before_the_engine_give_their_memory_back():
    """Regression: with the compiled allocator in use, the engine stopped fixing glibc's mmap
    threshold; parameters and state resized in place (they keep glibc's allocator) then
    piled up in glibc's heap: a 2 GiB-budget GPT trained at 8.7 GiB instead of 2.3."""
    out = _child(GLIBC, {})
    assert out["given_back"] >= 12 << 20


HEAP = """
    import ctypes, json, os, torch
    from ooc.runtime.malloc import give_back_heap
    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = 16 << 20
    t = torch.ones(n // 4)
    del t                    # glibc's dynamic threshold rises to 16 MiB: what follows is heap
    a, b = torch.ones(n // 4), torch.ones(n // 4)   # as parameters built before the engine
    a.untyped_storage().resize_(0)                  # swapped out: the heap keeps the pages
    before = rss()
    give_back_heap()
    print(json.dumps({"given_back": before - rss()}))
"""


def test_the_heap_gives_back_what_swapped_out_parameters_left_in_it():
    """Regression: a model built before the engine has its parameters in glibc's heap; once
    swapped out, their pages stayed there (a 2 GiB-budget GPT of depth 24 trained at 3.3 GiB
    instead of 2.6) until the engine returned the heap's free pages at each step's end."""
    out = _child(HEAP, {"OOC_CPU_ALLOCATOR": "0"})
    assert out["given_back"] >= 12 << 20
