"""The PYTORCH_CUDA_ALLOC_CONF models: expandable segments, roundup_power2_divisions,
garbage_collection_threshold, and the line that builds them.

Each test replays a hand-built event sequence; the docstring derives the expected bytes from
the rules in the model's module docstring (which follow c10/cuda/CUDACachingAllocator.cpp).
"""

from __future__ import annotations

import pytest

from vmm import CachingAllocator, OutOfBudget, SimBackend
from vmm.alloc_conf import AllocConf, AllocConfError
from vmm.expandable import ExpandableAllocator
from vmm.gc_threshold import segments_to_release
from vmm.replay import Event, replay
from vmm.roundup import round_up

MiB = 1 << 20


def _caching(**kw) -> CachingAllocator:
    return CachingAllocator(SimBackend(granularity=2 * MiB), **kw)


# -- roundup_power2_divisions ---------------------------------------------------------------


@pytest.mark.parametrize("nbytes, divisions, expected", [
    (1200 * MiB, 4, 1280 * MiB),   # [1 GiB, 2 GiB) in 4 steps of 256 MiB
    (1 << 30, 4, 1 << 30),         # a power of two is kept
    (3000, 4, 3072),               # [2048, 4096) in steps of 512
    (1000, 4, 1024),               # not above 512 * 4: the usual multiple of 512
    (5 * MiB + 1, 2, 6 * MiB),     # [4 MiB, 8 MiB) in steps of 2 MiB
    (100, 8, 512),                 # below 512: 512
    (1200 * MiB, 1, 1200 * MiB),   # off
])
def test_roundup_values(nbytes, divisions, expected):
    assert round_up(nbytes, divisions) == expected


def test_roundup_lets_a_freed_block_serve_a_larger_request():
    """100 MiB then, once it is freed, 110 MiB.

    Default: the 100 MiB block gets its own 100 MiB segment; 110 MiB does not fit in it, so a
    second segment of 110 MiB: 210 MiB reserved. With 4 divisions both requests round to
    112 MiB (step of [64, 128) MiB is 16 MiB): the second reuses the first's segment: 112 MiB.
    """
    events = [Event("alloc", 1, 100 * MiB), Event("free", 1, 0),
              Event("alloc", 2, 110 * MiB), Event("free", 2, 0)]
    assert replay(events, _caching(), name="d").peak_reserved_bytes == 210 * MiB
    assert replay(events, _caching(roundup_divisions=4), name="r").peak_reserved_bytes == 112 * MiB
    exp = replay(events, ExpandableAllocator(roundup_divisions=4), name="e")
    assert exp.peak_reserved_bytes == 120 * MiB  # 112 MiB on 20 MiB pages: 6 pages


# -- garbage_collection_threshold -------------------------------------------------------------


def test_gc_choice_in_passes_by_mean_age():
    """Reclaim 100 - 0.5 * 100 = 50. Pass 1: mean age (5+1+3)/3 = 3 frees the 10 (age 5) and
    the 30 (age 3): 40 < 50. Pass 2: mean age 1 frees the 20: 60."""
    assert segments_to_release([(10, 5), (20, 1), (30, 3)], 100, 100, 0.5) == [0, 2, 1]
    assert segments_to_release([(10, 5), (20, 1), (30, 3)], 50, 100, 0.5) == []  # not above


def test_gc_frees_the_oldest_cached_segment_before_growing():
    """Cap 200 MiB, threshold 0.25: collect above 50 MiB.

    A (30 MiB: own segment, search 1) is freed (age base 1); B (36 MiB, search 2) misses,
    reserved 30 is under 50: new segment, 66 MiB; B freed (base 2). C (40 MiB, search 3)
    misses; 66 > 50, reclaim 16: ages are A 2, B 1, mean 1.5: A goes (30 >= 16), B stays.
    C gets a new segment: 36 + 40 = 76 MiB, the peak. Without the knob: 30 + 36 + 40 = 106.
    Without a cap (no set_per_process_memory_fraction) the knob does nothing: 106.
    """
    events = [Event("alloc", "A", 30 * MiB), Event("free", "A", 0),
              Event("alloc", "B", 36 * MiB), Event("free", "B", 0),
              Event("alloc", "C", 40 * MiB)]
    gc = _caching(capacity_bytes=200 * MiB, gc_threshold=0.25)
    assert replay(events, gc, name="gc").peak_reserved_bytes == 76 * MiB
    assert gc.gc_released == 1 and gc.mapped_bytes == 76 * MiB
    off = replay(events, _caching(capacity_bytes=200 * MiB), name="off")
    assert off.peak_reserved_bytes == 106 * MiB
    uncapped = replay(events, _caching(gc_threshold=0.25), name="nocap")
    assert uncapped.peak_reserved_bytes == 106 * MiB


# -- expandable segments ----------------------------------------------------------------------


def test_expandable_grows_the_free_end_instead_of_a_new_segment():
    """Large pool, 20 MiB pages. 30 MiB: 2 pages [0, 40), block [0, 30), free [30, 40).
    5 MiB: best fit [30, 35). Free the 30 MiB. 33 MiB: no free block holds it; the free
    [35, 40) before the unmapped end has room with it: map 28 MiB more = 2 pages: 80 MiB.
    Default: segments of 30, 20 (a 5 MiB request) and 34 MiB: 84 MiB."""
    events = [Event("alloc", 1, 30 * MiB), Event("alloc", 2, 5 * MiB), Event("free", 1, 0),
              Event("alloc", 3, 33 * MiB)]
    e = ExpandableAllocator()
    r = replay(events, e, name="e")
    assert r.peak_reserved_bytes == 80 * MiB and r.map_calls == 4
    assert replay(events, _caching(), name="c").peak_reserved_bytes == 84 * MiB


def test_expandable_best_fit_keeps_the_growing_end():
    """X 12 MiB: page [0, 20): X [0, 12), free [12, 20); Y 8 MiB takes [12, 20). Z 30 MiB:
    pages [20, 60): Z [20, 50), free [50, 60) before the unmapped end. Free X: [0, 12).
    W 9 MiB: the smallest fit is [50, 60) (10 MiB), but it could expand, so the search moves
    to [0, 12) (12 MiB, cannot expand): W lands at the segment's start."""
    e = ExpandableAllocator()
    x, y, z = e.alloc(12 * MiB), e.alloc(8 * MiB), e.alloc(30 * MiB)
    base = x.address
    assert (y.address - base, z.address - base) == (12 * MiB, 20 * MiB)
    e.free(x)
    w = e.alloc(9 * MiB)
    assert w.address == base and e.mapped_bytes == 60 * MiB


def test_expandable_empty_cache_unmaps_whole_pages_only():
    """A 30 MiB: pages [0, 40), A [0, 30), free [30, 40). B 30 MiB: [30, 40) and one more
    page: B [30, 60), 60 MiB mapped. Free A, empty_cache: the only whole page inside the
    free [0, 30) is [0, 20): 40 MiB mapped, [20, 30) stays. Free B: [20, 60) free; empty
    cache: 2 pages: nothing mapped."""
    e = ExpandableAllocator()
    a, b = e.alloc(30 * MiB), e.alloc(30 * MiB)
    assert e.mapped_bytes == 60 * MiB and b.address - a.address == 30 * MiB
    e.free(a)
    assert e.empty_cache() == 20 * MiB and e.mapped_bytes == 40 * MiB and e.unmap_calls == 1
    e.free(b)
    assert e.empty_cache() == 40 * MiB and e.mapped_bytes == 0 and e.unmap_calls == 3
    assert e.alloc(50 * MiB).address == a.address  # the lowest unmapped range with room


def test_expandable_out_of_memory_unmaps_free_pages_and_retries_once():
    """Cap 60 MiB. A 30 MiB: 40 mapped, free [30, 40); B 10 MiB fills it. Free A. C 35 MiB:
    the end needs 2 pages: 80 > 60, fails; unmapping the free [0, 30) gives back [0, 20)
    (20 mapped); the range [0, 30) then has 30 MiB < 35 of room, so C goes at 40 MiB: 2
    pages, 60 mapped. D 1 MiB more than the cap can ever take: BudgetExceeded."""
    e = ExpandableAllocator(60 * MiB)
    a, b = e.alloc(30 * MiB), e.alloc(10 * MiB)
    e.free(a)
    c = e.alloc(35 * MiB)
    assert c.address - a.address == 40 * MiB and e.mapped_bytes == 60 * MiB
    assert e.num_alloc_retries == 1 and e.peak_mapped_bytes == 60 * MiB
    with pytest.raises(OutOfBudget, match="expandable-segments allocator out of memory"):
        e.alloc(21 * MiB)
    assert e.ooms == 1


def test_expandable_small_pool_uses_2mib_pages():
    """Requests up to 1 MiB map 2 MiB pages of their own segment: three 1 MiB blocks take
    two pages (4 MiB); freeing all and emptying the cache unmaps both."""
    e = ExpandableAllocator()
    blocks = [e.alloc(MiB) for _ in range(3)]
    assert e.mapped_bytes == 4 * MiB and e.small_pool_bytes == 4 * MiB and e.map_calls == 2
    for b in blocks:
        e.free(b)
    assert e.empty_cache() == 4 * MiB and e.mapped_bytes == 0


# -- the line -------------------------------------------------------------------------------


def test_conf_line_round_trip_and_models():
    conf = AllocConf.parse(" max_split_size_mb:128 , expandable_segments:True")
    assert conf.line() == "expandable_segments:True,max_split_size_mb:128"
    assert isinstance(conf.make(None), ExpandableAllocator)
    gc = AllocConf.parse("garbage_collection_threshold:0.6,roundup_power2_divisions:4")
    a = gc.make(1 << 30)
    assert isinstance(a, CachingAllocator) and a.gc_threshold == 0.6 and a.roundup_divisions == 4
    assert gc.needs_cap and AllocConf.parse("").line() == ""


@pytest.mark.parametrize("line, words", [
    ("expandable_segments:yes", "True or False"),
    ("max_split_size_mb:20", "above 20"),
    ("garbage_collection_threshold:1.5", "outside (0, 1)"),
    ("roundup_power2_divisions:3", "not a power of two"),
    ("roundup_power2_divisions:[256:1,>:4]", "list form is not modelled"),
    ("pinned_use_cuda_host_register:True", "not a modelled"),
    ("expandable_segments", "key:value"),
])
def test_conf_refuses_what_it_does_not_model(line, words):
    with pytest.raises(AllocConfError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        AllocConf.parse(line)
