"""What a caller of :class:`vmm.VirtualAllocator` holds: an :class:`Allocation` (address,
sizes, chunks) and the buffers exported from it, with the misuse errors.

Apart from the allocator because this is the caller's side of the contract (the lifetime rule
of :meth:`Allocation.buffer`, what ``free`` refuses), while :mod:`vmm.virtual` and
:mod:`vmm.free_ranges` are the allocator's own bookkeeping.
"""

from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING, Any

from vmm.errors import VMMError
from vmm.pool import Chunk
from vmm.units import format_size

if TYPE_CHECKING:
    from vmm.free_ranges import _Range


class AllocationError(VMMError):
    """Misuse of an allocation: double free, a foreign allocation, a negative size."""


class BufferInUse(AllocationError):
    """``free()`` of an allocation while a buffer exported from it is still referenced."""


def buffer_span(offset: int, nbytes: int | None, requested: int, mapped: int, what: str) -> int:
    """The length of ``buffer(offset, nbytes)`` over ``requested`` bytes of which ``mapped``
    may be read: ``nbytes`` defaults to the rest of the request; a span outside the mapped
    bytes raises ``AllocationError`` naming ``what`` they are."""
    if nbytes is None:
        nbytes = requested - offset
    if offset < 0 or nbytes <= 0 or offset + nbytes > mapped:
        raise AllocationError(f"buffer(offset={offset}, nbytes={nbytes}) outside the {mapped} {what}")
    return nbytes


class Allocation:
    """A live allocation: ``address`` (contiguous, aligned to the backend granularity),
    ``nbytes`` (requested), ``mapped_bytes`` (k whole chunks), ``chunks`` (in mapping order).

    Lifetime rule for :meth:`buffer`: a buffer is a zero-copy window onto the mapped range
    and is valid exactly while the allocation is live. The allocator refuses to free an
    allocation while any buffer exported from it (or a numpy array / torch tensor /
    memoryview made from such a buffer, which all hold a reference to it) is still alive,
    raising :class:`BufferInUse`; drop them first. A raw ``address`` carries no such guard:
    code that uses the address directly must stop before calling ``free``.
    """

    __slots__ = ("address", "nbytes", "mapped_bytes", "_range", "_owner", "_exports",
                 "__weakref__")

    def __init__(self, address: int, nbytes: int, mapped_bytes: int, rng: _Range | None,
                 owner: Any) -> None:
        # ``owner``: the vmm.VirtualAllocator that made it (not imported: it imports this).
        self.address = address
        self.nbytes = nbytes
        self.mapped_bytes = mapped_bytes
        self._range = rng
        self._owner = owner
        self._exports: list[weakref.ref] | None = None

    @property
    def live(self) -> bool:
        return self._range is not None

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The physical chunks behind the range, in address order (empty once freed)."""
        rng = self._range
        return tuple(rng.chunks) if rng is not None else ()

    @property
    def alignment(self) -> int:
        """What ``address`` is a multiple of (the backend granularity: 4096 on the host)."""
        return self._owner.alignment

    def buffer(self, offset: int = 0, nbytes: int | None = None) -> Any:
        """A writable, zero-copy buffer over ``[offset, offset + nbytes)`` of the allocation.

        Host backend only (a ctypes ``c_char`` array: works with ``memoryview``,
        ``numpy.frombuffer`` and ``torch.frombuffer``). The buffer keeps this allocation
        object alive, and ``free()`` raises :class:`BufferInUse` while the buffer or anything
        made from it is referenced (see the class docstring). ``nbytes`` defaults to the rest
        of the requested size; up to ``mapped_bytes`` may be asked for.
        """
        if self._range is None:
            raise AllocationError(f"buffer() of a freed allocation (was at 0x{self.address:x})")
        nbytes = buffer_span(offset, nbytes, self.nbytes, self.mapped_bytes,
                             f"mapped bytes of allocation 0x{self.address:x}")
        buf = self._owner.backend.buffer(self.address + offset, nbytes)
        buf._ooc_allocation = self  # the buffer keeps the allocation (and its backend) alive
        if self._exports is None:
            self._exports = []
        else:
            self._exports = [r for r in self._exports if r() is not None]
        self._exports.append(weakref.ref(buf))
        return buf

    def _drop_exports(self) -> None:
        """Before ``free``: raise :class:`BufferInUse` while a buffer exported from this
        allocation is still referenced (its memory would be reused), else forget them."""
        alive = self.exports_alive()
        if alive:
            gc.collect()  # a buffer kept only by a reference cycle is not really in use
            alive = self.exports_alive()
        if alive:
            raise BufferInUse(
                f"free of the allocation at 0x{self.address:x} "
                f"({format_size(self.nbytes)}) while {alive} buffer(s) exported from it "
                "are still referenced (numpy arrays, tensors or memoryviews made from "
                "allocation.buffer()): drop them first, their memory would be reused")
        self._exports = None

    def exports_alive(self) -> int:
        """How many buffers exported by :meth:`buffer` are still referenced."""
        return 0 if not self._exports else sum(r() is not None for r in self._exports)

    def free(self) -> None:
        """Same as ``allocator.free(self)``."""
        self._owner.free(self)

    def __repr__(self) -> str:
        state = "live" if self._range is not None else "freed"
        return (f"<Allocation 0x{self.address:x} {format_size(self.nbytes)} requested, "
                f"{format_size(self.mapped_bytes)} mapped, {state}>")

