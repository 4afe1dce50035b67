"""Space management inside the swap file: page-aligned extents, first fit, no growth while
free space suffices.

Every key of a :class:`~ooc.storage.FileTier` owns one or more *pieces* ``(offset, length)`` of
the file; offsets and lengths are multiples of ``align`` (4096: what O_DIRECT needs).
A request is served, in order of preference, by

1. the first free extent (lowest offset) that holds it whole: one piece, one sequential transfer;
2. otherwise, the free extents gathered largest first and, only for what they cannot hold,
   new space at the end of the file (merged with a free extent touching the end).

Rule 2 is the virtual-addressing idea of the design applied to the file: a request never
grows the file while the free space could hold it, so the file is never larger than the peak
of live (rounded) bytes — no external fragmentation, at the price of scattered pieces when the
free space is fragmented. The file is never shrunk implicitly (overwriting allocated blocks is
about twice as fast as extending the file on ext4 here); :meth:`Extents.trim_end` says how far
it could be.

Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

import bisect

__all__ = ["Extents", "round_up"]


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def room_to_write(records: dict, writes: "list[tuple[int | None, int]]", align: int) -> int:
    """Bytes beyond what ``writes`` (pairs ``(key, nbytes)``; ``key=None``: a new key) can
    reuse: a rewrite of a key whose record (``.nbytes``, ``.refs``) no copy holds reuses its
    room. What both tiers' ``reserve`` must find before an optimizer step."""
    need = 0
    for key, nbytes in writes:
        rec = records.get(key) if key is not None else None
        have = round_up(rec.nbytes, align) if rec is not None and rec.refs == 0 else 0
        need += max(0, round_up(int(nbytes), align) - have)
    return need


class Extents:
    """Free-list allocator over ``[0, end)`` of one file, growing ``end`` on demand."""

    def __init__(self, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        self.end = 0  # the file's size: every byte below it is allocated or free
        self.peak_end = 0
        # free extents, sorted by offset, coalesced (no two adjacent)
        self._offsets: list[int] = []
        self._lengths: list[int] = []

    @property
    def free_bytes(self) -> int:
        return sum(self._lengths)

    def free_extents(self) -> list[tuple[int, int]]:
        return list(zip(self._offsets, self._lengths))

    def allocate(self, nbytes: int) -> list[tuple[int, int]]:
        """Return pieces (sorted by offset) whose lengths sum to ``nbytes`` rounded up."""
        need = round_up(max(nbytes, 1), self.align)
        # 1. first fit: one piece
        for i, length in enumerate(self._lengths):
            if length >= need:
                off = self._offsets[i]
                self._take(i, need)
                return [(off, need)]
        # 2. scatter over the free extents (largest first); grow the file only for the rest.
        # When the free space runs out every free extent is taken, including one touching the
        # end, so the new space continues it and _merge joins the two into one piece.
        remaining = need
        taken: list[tuple[int, int]] = []
        for i in sorted(range(len(self._offsets)), key=lambda i: -self._lengths[i]):
            if remaining <= 0:
                break
            n = min(self._lengths[i], remaining)
            taken.append((self._offsets[i], n))
            remaining -= n
        pieces: list[tuple[int, int]] = []
        for off, n in taken:
            self._take(bisect.bisect_left(self._offsets, off), n)
            pieces.append((off, n))
        if remaining > 0:
            pieces.append((self.end, remaining))
            self.end += remaining
            self.peak_end = max(self.peak_end, self.end)
        pieces.sort()
        return _merge(pieces)

    def free(self, pieces: list[tuple[int, int]]) -> None:
        """Return pieces to the free list, coalescing with neighbours."""
        for off, length in pieces:
            if length <= 0:
                continue
            if off < 0 or off + length > self.end or off % self.align or length % self.align:
                raise ValueError(f"bad piece ({off}, {length}) for a file of {self.end} bytes")
            i = bisect.bisect_left(self._offsets, off)
            if (i < len(self._offsets) and self._offsets[i] < off + length) or (
                i > 0 and self._offsets[i - 1] + self._lengths[i - 1] > off
            ):
                raise ValueError(f"double free of piece ({off}, {length})")
            # merge with the previous and/or next free extent
            if i > 0 and self._offsets[i - 1] + self._lengths[i - 1] == off:
                i -= 1
                self._lengths[i] += length
            else:
                self._offsets.insert(i, off)
                self._lengths.insert(i, length)
            nxt = i + 1
            end = self._offsets[i] + self._lengths[i]
            if nxt < len(self._offsets) and end == self._offsets[nxt]:
                self._lengths[i] += self._lengths.pop(i + 1)
                self._offsets.pop(i + 1)

    def grow(self, new_end: int) -> None:
        """Extend the file to ``new_end`` (aligned); the new space is free."""
        if new_end % self.align:
            raise ValueError(f"new end {new_end} is not a multiple of {self.align}")
        if new_end > self.end:
            old, self.end = self.end, new_end
            self.peak_end = max(self.peak_end, self.end)
            self.free([(old, new_end - old)])

    def trim_end(self) -> int:
        """Drop the free extent touching the end of the file; return the new end."""
        if self._offsets and self._offsets[-1] + self._lengths[-1] == self.end:
            self.end = self._offsets.pop()
            self._lengths.pop()
        return self.end

    def _take(self, i: int, n: int) -> None:
        """Allocate the first ``n`` bytes of free extent ``i``."""
        if self._lengths[i] == n:
            del self._offsets[i]
            del self._lengths[i]
        else:
            self._offsets[i] += n
            self._lengths[i] -= n


def _merge(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, n in pieces:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out
