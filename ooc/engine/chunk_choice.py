"""The default chunk's choice, step by step: what ``scheduler.chunk_size`` computes, asked when.

With the default chunk (neither ``Options.chunk`` nor ``min_bytes`` given) the engine chooses
its chunk twice over. After the first recording step at a budget, from the sizes it saved
(``choose_chunk``: small enough that what stays with PyTorch is a small share of the budget).
And where that step's plan is refused: a chunk rounds every managed tensor up to its multiple,
so a 1.1 MiB tensor takes 2 MiB chunks, and a budget refused in 2 MiB chunks may hold the same
step in 1 MiB ones. The least budget a refusal names must hold the step for a fresh engine
given it, whatever budget the user's loop started from (a loop from 4 MiB that chose 1 MiB
chunks named 52 MiB for a 2-layer Llama whose fresh engine at 52 chose 2 MiB chunks and was
refused naming 58). So a refused recording is recorded again in half the chunk while that
names a least budget smaller by a sixteenth; then the chunk that named the least is kept and
its refusal raised. Each try is a step that ran whole: training goes on, slower for a step.

State only: the engine's planner (``planning.Planner``) makes the pool each chunk needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ooc.engine.memory import EngineMemory
from scheduler.chunk_size import UNMANAGED_SHARE, choose_chunk, unmanaged_bytes
from scheduler.errors import BudgetTooSmall
from vmm.units import format_size

log = logging.getLogger(__name__)

#: A half is worth another half while it named a least budget smaller by this share (1/16) or more.
WORTH = 16


class ChunkChoice:
    """``adaptive``: the chunk is the default's (chosen here); ``pending``: the next recording
    step chooses it; ``_refused``: at this budget, the chunk whose recording named the least
    budget so far, and that refusal (a halving is under way)."""

    def __init__(self, adaptive: bool) -> None:
        self.adaptive = self.pending = adaptive
        self._refused: tuple[int, BudgetTooSmall] | None = None

    def again(self) -> None:
        """A new budget: the next recording chooses again, and no refusal at the old one counts."""
        self.pending, self._refused = self.adaptive, None

    def chosen(self, saved: list[int] | None, mem: EngineMemory) -> int | None:
        """The chunk for a step that saved ``saved`` (bytes of each tensor; None: unknown)."""
        return None if saved is None else choose_chunk(saved, mem.budget, mem.chunk, mem.pool.granularity)

    def after_recording(self, saved: list[int] | None, mem: EngineMemory) -> int | None:
        """After the first recording step that completes at a budget: the chunk it chose from
        what it saved, where that is another one (the next step records again); else None.
        Decided once a budget."""
        if not self.pending or saved is None:
            return None
        self.pending = False
        chunk = self.chosen(saved, mem)
        left = unmanaged_bytes(saved, chunk // 2)
        if sum(saved) > mem.budget and left > mem.budget // UNMANAGED_SHARE:
            log.warning("saved activations in tensors under %s take %s, more than an eighth of the "
                        "%s budget, and stay outside it: the chunk cannot go below %s, the %s "
                        "granularity. Pass min_bytes= to manage smaller tensors (each takes a whole "
                        "chunk of the budget)", format_size(chunk // 2), format_size(left),
                        format_size(mem.budget), format_size(mem.pool.granularity), mem.device.type)
        if chunk == mem.chunk:
            return None
        log.info("chunk %s -> %s (tensors from %s managed): saved activations under %s took %s of "
                 "the %s budget; the next step records again", format_size(mem.chunk),
                 format_size(chunk), format_size(chunk // 2), format_size(mem.min_bytes),
                 format_size(unmanaged_bytes(saved, mem.min_bytes)), format_size(mem.budget))
        return chunk

    def at_update(self, fits: Callable[[int], object], mem: EngineMemory) -> None:
        """At a recording step's update: ``fits(chunk)`` raises ``BudgetTooSmall`` where the
        step so far, in chunks of that size, cannot hold under the budget. Refused (the step
        taken back) only where half the chunk would not hold it either, naming the half's least
        where that is a sixteenth smaller (the next budget's first recording is then refused at
        its end in this chunk and records again in the half: ``instead_of``)."""
        try:
            fits(mem.chunk)
            return
        except BudgetTooSmall as err:
            refusal = err
        half = self._half(mem)
        if half is not None:
            try:
                fits(half)
                refusal = None   # the half holds it: the step goes on, and its end records again in it
            except BudgetTooSmall as err:
                if self._worth(refusal.minimum, err.minimum):
                    err.add_note(f"ooc: in {format_size(half)} chunks, which the next recording at this budget "
                                 f"takes (in {format_size(mem.chunk)} chunks it needs {format_size(refusal.minimum)})")
                    refusal = err
        if refusal is not None:
            try:
                raise refusal
            finally:   # (the frame must not keep what it raises: a cycle through the step's frames)
                del refusal

    def _half(self, mem: EngineMemory) -> int | None:
        """Half the chunk, where the default chunk may go there (not below the granularity)."""
        return mem.chunk // 2 if self.adaptive and mem.chunk // 2 >= mem.pool.granularity else None

    @staticmethod
    def _worth(least: int, smaller: int) -> bool:
        """Whether a least budget of ``smaller`` is worth a smaller chunk over ``least``."""
        return smaller <= least - least // WORTH

    def instead_of(self, err: BudgetTooSmall, mem: EngineMemory) -> tuple[int, BudgetTooSmall | None]:
        """A recording step's plan at this budget was refused with ``err``: the chunk to take
        and the refusal to raise, None to record again in that chunk. Half the chunk while
        each half names a least budget smaller by a sixteenth (down to the pool's granularity:
        smaller chunks cost more bookkeeping a step for ever less); then the chunk that named
        the least, with its refusal."""
        best = self._refused
        if best is not None and not self._worth(best[1].minimum, err.minimum):
            self._refused = None   # the last half saved too little to try another: the least of the two
            return best if best[1].minimum <= err.minimum else (mem.chunk, err)
        smaller = self._half(mem)
        if smaller is None:
            self._refused = None
            return mem.chunk, err
        # kept without its traceback: its frames hold the step's tensors until the next budget
        self._refused = (mem.chunk, err.with_traceback(None))
        log.info("the budget %s is refused in %s chunks (least %s): the next step records again in %s "
                 "chunks, which round tensors up less", format_size(mem.step_budget or mem.budget),
                 format_size(mem.chunk), format_size(err.minimum), format_size(smaller))
        return smaller, None
