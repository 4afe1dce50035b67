"""The one interface every memory backend implements, and the bookkeeping they share.

A backend knows three kinds of object and nothing about allocation policy:

- **physical chunks**: ``create_chunk(nbytes) -> handle`` / ``release_chunk(handle)``.
  A chunk is memory that exists but has no address yet (a ``cuMemCreate`` handle, a slot
  of a memfd file, or a number in the simulator);
- **address ranges**: ``reserve_range(nbytes) -> address`` / ``free_range(address, nbytes)``.
  A range is virtual address space with nothing behind it (``cuMemAddressReserve``,
  ``mmap(PROT_NONE)``);
- **mappings**: ``map(address, handle, nbytes)`` puts one whole chunk at ``address``
  inside a reserved range; ``set_access(address, nbytes)`` makes a mapped span usable
  (CUDA needs it, the host does not); ``unmap(address, nbytes)`` removes every mapping
  inside the span and leaves the reservation in place.

The contract, enforced by every backend here (the simulator too, so misuse is caught
before it meets a driver): sizes and addresses are multiples of ``granularity``; a
mapping lies inside one reserved range and never overlaps another mapping; ``unmap``
covers whole mappings only; a chunk is unmapped everywhere before it is released; a
range holds no mapping when it is freed. Violations raise :class:`ContractError`.

Allocation policy (which chunk goes where, what to cache) belongs to
:class:`vmm.ChunkPool`, :class:`vmm.VirtualAllocator` and :class:`vmm.CachingAllocator`.
"""

from __future__ import annotations

import contextlib

import abc
from bisect import bisect_left, bisect_right, insort
from collections import Counter

try:  # Counter.update's C core, without its Python-level type checks (hot path)
    from collections import _count_elements
except ImportError:  # pragma: no cover - other Pythons
    def _count_elements(mapping, iterable):  # type: ignore[no-redef]
        for elem in iterable:
            mapping[elem] = mapping.get(elem, 0) + 1
from operator import itemgetter
from typing import Any, Sequence

from vmm.errors import OutOfBudget, VMMError
from vmm.units import format_size


class ContractError(VMMError):
    """A backend call broke the mapping contract (map outside a range, double map, ...)."""


class BackendCallError(VMMError):
    """A system or driver call failed; the message names the call and the error."""


class DeviceOutOfMemory(OutOfBudget, BackendCallError):
    """The backend itself ran out of physical memory (``CUDA_ERROR_OUT_OF_MEMORY``, ENOMEM)."""


class Backend(abc.ABC):
    """Physical chunks, reserved address ranges and the mappings between them.

    Subclasses set ``name`` and ``granularity`` (bytes; every size, offset and address
    handed to the backend is a multiple of it) and implement the abstract methods.
    ``map_many``, ``set_access``, ``synchronize`` and ``buffer`` have defaults.
    A backend is a context manager; leaving the block calls :meth:`close`.
    """

    name: str = "backend"
    granularity: int = 1

    # -- physical chunks ---------------------------------------------------------------
    @abc.abstractmethod
    def create_chunk(self, nbytes: int) -> Any:
        """Create one physical chunk of ``nbytes`` and return its opaque handle."""

    @abc.abstractmethod
    def release_chunk(self, handle: Any) -> None:
        """Give a chunk's memory back; it must not be mapped anywhere."""

    # -- address ranges ----------------------------------------------------------------
    @abc.abstractmethod
    def reserve_range(self, nbytes: int, alignment: int = 0) -> int:
        """Reserve ``nbytes`` of address space (aligned to ``alignment``, 0 = granularity)."""

    @abc.abstractmethod
    def free_range(self, address: int, nbytes: int) -> None:
        """Free a whole reservation made by :meth:`reserve_range`; it must hold no mapping."""

    # -- mappings ----------------------------------------------------------------------
    @abc.abstractmethod
    def map(self, address: int, handle: Any, nbytes: int) -> None:
        """Map the whole chunk ``handle`` (``nbytes`` long) at ``address``."""

    def map_many(self, address: int, handles: Sequence[Any], chunk_bytes: int) -> None:
        """Map ``handles`` one after another from ``address`` (each ``chunk_bytes`` long)."""
        for i, handle in enumerate(handles):
            self.map(address + i * chunk_bytes, handle, chunk_bytes)

    def set_access(self, address: int, nbytes: int) -> None:
        """Make a fully mapped span readable and writable (a no-op where mapping does it)."""

    @abc.abstractmethod
    def unmap(self, address: int, nbytes: int, fence: Any = None) -> None:
        """Remove every mapping inside ``[address, address + nbytes)``; keep the reservation.

        The span must cover whole mappings. Backends whose device may still be using the
        memory (CUDA) synchronize before unmapping, unless ``fence`` (from :meth:`fence`,
        taken when the span was last let go) has passed: then nothing queued can use it.
        """

    def fence(self) -> Any:
        """A mark of "now" in the device's work, taken when memory is let go, for a later
        :meth:`unmap`; None (the default: no device works asynchronously) means "unknown"."""
        return None

    def fence_passed(self, fence: Any) -> bool:
        """Whether the device has done all work queued before ``fence`` (never blocks)."""
        return False

    def synchronize(self) -> None:
        """Wait until the device no longer uses any memory of this backend (default: no-op)."""

    def one_synchronization(self) -> "contextlib.AbstractContextManager[None]":
        """Inside the block, the unmaps share one synchronization (the first one's): the
        caller queues no device work in between, so what the first wait covered still holds.
        Default: nothing to share."""
        return contextlib.nullcontext()

    def buffer(self, address: int, nbytes: int) -> Any:
        """A host buffer over a mapped span; only backends with host-visible memory have one."""
        raise VMMError(f"the {self.name} backend has no host-visible memory: "
                       f"use the device address 0x{address:x} instead of a host buffer")

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Unmap, release and free everything this backend still holds."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} granularity={format_size(self.granularity)}>"


class Ledger:
    """Reservations, chunks and mappings of one backend, with the contract checked.

    Shared by the host, sim and CUDA backends (the fake driver in the tests checks the
    CUDA calls independently). Lookups are O(log n): reservations are found by bisecting
    their sorted start addresses, and each reservation keeps its own sorted list of mapping
    starts. The per-chunk work of mapping k chunks is done by bulk dict/list operations.
    """

    __slots__ = ("granularity", "backend_name", "chunks", "_mapped_in", "_mapped_out", "_starts",
                 "_ranges")

    def __init__(self, granularity: int, backend_name: str) -> None:
        self.granularity = granularity
        self.backend_name = backend_name
        self.chunks: dict[Any, int] = {}            # handle -> nbytes
        # Live mappings of a handle = _mapped_in[h] - _mapped_out[h]: two Counters, because
        # Counter.update counts a batch in C while a decrement loop would run in Python.
        self._mapped_in: Counter = Counter()
        self._mapped_out: Counter = Counter()
        self._starts: list[int] = []                # sorted reservation starts
        # start -> (end, sorted mapping starts, {mapping start: (end, handle)})
        self._ranges: dict[int, tuple[int, list[int], dict[int, tuple[int, Any]]]] = {}

    # -- helpers -----------------------------------------------------------------------
    def fail(self, what: str) -> ContractError:
        return ContractError(f"{self.backend_name} backend: {what}")

    def check_size(self, what: str, nbytes: int) -> None:
        if nbytes <= 0 or nbytes % self.granularity:
            raise self.fail(f"{what}: {nbytes} bytes is not a positive multiple of the "
                            f"granularity {self.granularity} ({format_size(self.granularity)})")

    def _range_of(self, what: str, address: int, nbytes: int):
        i = bisect_right(self._starts, address) - 1
        if i >= 0:
            start = self._starts[i]
            entry = self._ranges[start]
            if address + nbytes <= entry[0]:
                return start, entry
        raise self.fail(f"{what}: [0x{address:x}, 0x{address + nbytes:x}) is not inside "
                        "one reserved address range")

    # -- chunks ------------------------------------------------------------------------
    def add_chunk(self, handle: Any, nbytes: int) -> None:
        self.chunks[handle] = nbytes

    def remove_chunk(self, handle: Any) -> int:
        nbytes = self.chunks.get(handle)
        if nbytes is None:
            raise self.fail(f"release of unknown or already released chunk {handle!r}")
        mapped = self.mapcount(handle)
        if mapped:
            raise self.fail(f"release of chunk {handle!r} while it is still mapped "
                            f"{mapped} time(s): unmap it first")
        del self.chunks[handle]
        self._mapped_in.pop(handle, None)
        self._mapped_out.pop(handle, None)
        return nbytes

    def mapcount(self, handle: Any) -> int:
        """How many live mappings the chunk has."""
        return self._mapped_in.get(handle, 0) - self._mapped_out.get(handle, 0)

    # -- ranges ------------------------------------------------------------------------
    def add_range(self, address: int, nbytes: int) -> None:
        insort(self._starts, address)
        self._ranges[address] = (address + nbytes, [], {})

    def remove_range(self, address: int, nbytes: int) -> None:
        entry = self._ranges.get(address)
        if entry is None or entry[0] - address != nbytes:
            raise self.fail(f"free of [0x{address:x}, +{nbytes}) which is not a whole "
                            "reserved range")
        if entry[1]:
            raise self.fail(f"free of range 0x{address:x} while {len(entry[1])} chunk(s) "
                            "are still mapped in it: unmap first")
        del self._ranges[address]
        del self._starts[bisect_left(self._starts, address)]

    def ranges(self) -> list[tuple[int, int]]:
        return [(s, self._ranges[s][0] - s) for s in self._starts]

    # -- mappings ----------------------------------------------------------------------
    def add_mappings(self, address: int, handles: Sequence[Any], chunk_bytes: int) -> None:
        """Check and record ``handles`` mapped back to back from ``address``."""
        g = self.granularity
        if address % g or chunk_bytes <= 0 or chunk_bytes % g:
            raise self.fail(f"map of {chunk_bytes} bytes at 0x{address:x}: address and size "
                            f"must be multiples of the granularity {g}")
        total = chunk_bytes * len(handles)
        # The reservation holding the span (inline _range_of: this is the per-map hot path).
        starts_r = self._starts
        r = bisect_right(starts_r, address) - 1
        entry = self._ranges[starts_r[r]] if r >= 0 else None
        if entry is None or address + total > entry[0]:
            raise self.fail(f"map: [0x{address:x}, 0x{address + total:x}) is not inside "
                            "one reserved address range")
        _, starts, maps = entry
        i = bisect_right(starts, address)
        if i and maps[starts[i - 1]][0] > address:
            raise self.fail(f"map at 0x{address:x}: already mapped (double map)")
        if i < len(starts) and starts[i] < address + total:
            raise self.fail(f"map at 0x{starts[i]:x}: already mapped (double map)")
        chunks = self.chunks
        if len(handles) == 1:  # the per-chunk path: no bulk machinery
            handle = handles[0]
            if chunks.get(handle) != chunk_bytes:
                raise self.fail(f"map of chunk {handle!r}: unknown, released, or not "
                                f"{chunk_bytes} bytes (it is {chunks.get(handle)})")
            starts.insert(i, address)
            maps[address] = (address + chunk_bytes, handle)
            mapped_in = self._mapped_in
            mapped_in[handle] = mapped_in.get(handle, 0) + 1
            return
        if set(map(chunks.get, handles)) != {chunk_bytes}:
            for handle in handles:
                if handle not in chunks:
                    raise self.fail(f"map of unknown or released chunk {handle!r}")
                if chunks[handle] != chunk_bytes:
                    raise self.fail(f"map of chunk {handle!r}: it is {chunks[handle]} bytes, "
                                    f"not {chunk_bytes}")
        new = range(address, address + total, chunk_bytes)
        starts[i:i] = new
        maps.update(zip(new, zip(range(address + chunk_bytes, address + total + 1, chunk_bytes),
                                 handles)))
        _count_elements(self._mapped_in, handles)

    def remove_mappings(self, address: int, nbytes: int) -> list[tuple[int, tuple[int, Any]]]:
        """Check and forget the mappings of a span that covers whole mappings only.

        Returns ``(start, (end, handle))`` for each removed mapping, in address order.
        """
        stop = address + nbytes
        starts_r = self._starts
        r = bisect_right(starts_r, address) - 1
        entry = self._ranges[starts_r[r]] if r >= 0 else None
        if entry is None or stop > entry[0]:
            raise self.fail(f"unmap: [0x{address:x}, 0x{stop:x}) is not inside one reserved "
                            "address range")
        _, starts, maps = entry
        i = bisect_left(starts, address)  # first mapping starting at or after address
        if i and maps[starts[i - 1]][0] > address:
            raise self.fail(f"unmap at 0x{address:x} cuts the mapping at 0x{starts[i - 1]:x}")
        j = bisect_left(starts, stop, i)  # first mapping starting at or after stop
        if i == j:
            raise self.fail(f"unmap of [0x{address:x}, 0x{stop:x}): nothing is mapped there")
        if maps[starts[j - 1]][0] > stop:
            raise self.fail(f"unmap of [0x{address:x}, 0x{stop:x}) cuts the mapping "
                            f"at 0x{starts[j - 1]:x}")
        if j == i + 1:  # one mapping: the per-chunk path
            key = starts.pop(i)
            value = maps.pop(key)
            mapped_out = self._mapped_out
            mapped_out[value[1]] = mapped_out.get(value[1], 0) + 1
            return [(key, value)]
        keys = starts[i:j]
        del starts[i:j]
        values = list(map(maps.pop, keys))
        _count_elements(self._mapped_out, map(itemgetter(1), values))
        return list(zip(keys, values))

    def is_mapped(self, address: int, nbytes: int, *, whole: bool = False) -> bool:
        """True if every byte of the span is mapped (``whole``: by mappings that start and
        end inside it, as ``cuMemSetAccess`` requires)."""
        try:
            _, (end, starts, maps) = self._range_of("check", address, nbytes)
        except ContractError:
            return False
        stop = address + nbytes
        i = bisect_right(starts, address) - 1   # the mapping that would hold ``address``
        if i < 0:
            return False
        j = bisect_left(starts, stop, i)        # mappings i..j-1 start before ``stop``
        first, last_end = starts[i], maps[starts[j - 1]][0]
        if maps[first][0] <= address or last_end < stop:
            return False
        if whole and (first != address or last_end != stop):
            return False
        # Mappings never overlap, so there is no gap iff their lengths add up.
        keys = starts[i:j]
        covered = sum(map(itemgetter(0), map(maps.__getitem__, keys))) - sum(keys)
        return covered == last_end - first

    def mappings(self) -> list[tuple[int, int, Any]]:
        out = []
        for s in self._starts:
            _, starts, maps = self._ranges[s]
            out.extend((a, maps[a][0] - a, maps[a][1]) for a in starts)
        return out

    @property
    def mapped_count(self) -> int:
        return sum(len(self._ranges[s][1]) for s in self._starts)
