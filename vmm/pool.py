"""The physical budget: at most floor(capacity / chunk) fixed-size chunks, made lazily.

A :class:`ChunkPool` is the only place that creates or releases physical memory. Chunks
are created on first demand (so an idle pool costs nothing), cached when given back (so a
swap-in after a swap-out does not pay for a new physical allocation), and released to the
backend only by :meth:`ChunkPool.trim`. Which chunk serves which request does not matter:
chunks are interchangeable, and the virtual allocator maps them in whatever order they
come, which is why swapping can never fragment this pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vmm.backend import Backend
from vmm.errors import OutOfBudget, VMMError
from vmm.units import format_size, parse_size


class ChunkSizeError(VMMError, ValueError):
    """The chunk size does not suit the backend (not a multiple of its granularity)."""


class BudgetExceeded(OutOfBudget):
    """A request does not fit in the budget; the numbers to act on are attributes.

    Attributes (all bytes): ``requested`` (the request), ``in_use`` (requested bytes of
    live allocations), ``budget`` (the pool's physical capacity), ``largest_fit`` (the
    largest request that would succeed now).
    """

    def __init__(self, message: str, *, requested: int, in_use: int, budget: int,
                 largest_fit: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.in_use = in_use
        self.budget = budget
        self.largest_fit = largest_fit


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """One physical chunk: ``index`` (creation order in its pool), backend ``handle``, size."""

    index: int
    handle: Any
    nbytes: int


class ChunkPool:
    """At most ``capacity_bytes // chunk_bytes`` physical chunks of ``chunk_bytes`` each.

    Args:
        backend: where chunks come from (:class:`vmm.HostBackend`, :class:`vmm.SimBackend`,
            :class:`vmm.CudaBackend`).
        chunk_bytes: size of every chunk; a multiple of ``backend.granularity``
            (int bytes, or a size string such as ``"2MiB"``).
        capacity_bytes: the physical budget. The pool never holds more than
            ``max_chunks = capacity_bytes // chunk_bytes`` chunks (the remainder is unused).

    Chunks given back with :meth:`release` are cached (the most recently released first);
    :meth:`trim` returns the cached ones to the backend.
    """

    def __init__(self, backend: Backend, chunk_bytes: int | str, capacity_bytes: int | str) -> None:
        chunk_bytes = parse_size(chunk_bytes, what="chunk size")
        capacity_bytes = parse_size(capacity_bytes, what="pool capacity")
        g = backend.granularity
        if chunk_bytes % g:
            lower, upper = max(g, chunk_bytes // g * g), -(-chunk_bytes // g) * g
            raise ChunkSizeError(
                f"chunk size {chunk_bytes} B ({format_size(chunk_bytes)}) is not a multiple of "
                f"the {backend.name} backend's granularity {g} B ({format_size(g)}); "
                f"use {lower} or {upper}")
        if capacity_bytes < chunk_bytes:
            raise ChunkSizeError(
                f"pool capacity {format_size(capacity_bytes)} is smaller than one chunk "
                f"({format_size(chunk_bytes)}); raise the capacity or use smaller chunks")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.max_chunks = capacity_bytes // chunk_bytes
        self.budget_bytes = self.max_chunks * chunk_bytes
        self.created = 0          # chunks that exist now (handed out + cached)
        self.handed_out = 0       # chunks given to callers and not yet released
        self.peak_created = 0
        self.create_calls = 0
        self.release_calls = 0
        self._cache: list[Chunk] = []
        self._next_index = 0

    @property
    def cached(self) -> int:
        """Chunks that exist and wait in the cache."""
        return len(self._cache)

    @property
    def available(self) -> int:
        """Chunks :meth:`acquire` can hand out now (cached + not yet created)."""
        return len(self._cache) + self.max_chunks - self.created

    def acquire(self, count: int) -> list[Chunk]:
        """Hand out ``count`` chunks: cached ones first, then newly created ones.

        Raises :class:`BudgetExceeded` (and hands out nothing) if fewer are available.
        """
        if count > self.available:
            fit = self.available * self.chunk_bytes
            raise BudgetExceeded(
                f"chunk pool: {count} chunk(s) of {format_size(self.chunk_bytes)} requested, "
                f"{self.available} available of {self.max_chunks} "
                f"({format_size(self.budget_bytes)} budget)",
                requested=count * self.chunk_bytes, in_use=self.handed_out * self.chunk_bytes,
                budget=self.budget_bytes, largest_fit=fit)
        cache = self._cache
        take = min(count, len(cache))
        # The most recently cached chunks, in the order they were released: a range freed
        # and allocated again gets its chunks back in the same order, so a host backend
        # can map chunks that are consecutive in its file with one call.
        out = cache[len(cache) - take:]
        del cache[len(cache) - take:]
        try:
            for _ in range(count - take):
                out.append(self._create())
        except BaseException:
            cache.extend(out)
            raise
        self.handed_out += count
        return out

    def _create(self) -> Chunk:
        handle = self.backend.create_chunk(self.chunk_bytes)
        self.create_calls += 1
        chunk = Chunk(self._next_index, handle, self.chunk_bytes)
        self._next_index += 1
        self.created += 1
        if self.created > self.peak_created:
            self.peak_created = self.created
        return chunk

    def release(self, chunks: list[Chunk]) -> None:
        """Take chunks back into the cache (they must be unmapped by the caller)."""
        self.handed_out -= len(chunks)
        self._cache.extend(chunks)

    def trim(self, limit: int | None = None) -> int:
        """Release cached chunks to the backend (every one, or the oldest cached ones up to
        ``limit`` bytes, whole chunks only); return the bytes given back."""
        freed = 0
        count = len(self._cache) if limit is None else min(len(self._cache), limit // self.chunk_bytes)
        oldest, self._cache[:count] = self._cache[:count], []
        while oldest:
            chunk = oldest.pop()
            self.backend.release_chunk(chunk.handle)
            self.release_calls += 1
            self.created -= 1
            freed += chunk.nbytes
        return freed

    def stats(self) -> dict[str, int]:
        """Plain dict: ``chunk_bytes``, ``max_chunks``, ``budget_bytes``, ``created``,
        ``handed_out``, ``cached``, ``peak_created``, ``create_calls``, ``release_calls``."""
        return {
            "chunk_bytes": self.chunk_bytes, "max_chunks": self.max_chunks,
            "budget_bytes": self.budget_bytes, "created": self.created,
            "handed_out": self.handed_out, "cached": len(self._cache),
            "peak_created": self.peak_created, "create_calls": self.create_calls,
            "release_calls": self.release_calls,
        }

    def __repr__(self) -> str:
        return (f"<ChunkPool {self.created}/{self.max_chunks} chunks of "
                f"{format_size(self.chunk_bytes)} on {self.backend.name}, "
                f"{self.handed_out} handed out, {len(self._cache)} cached>")
