"""What the runtime asks of a slower tier: the :class:`SlowerTier` protocol.

The engine and the stepper move a managed tensor's bytes out to a slower tier and back, and
never look at what the tier is. Two tiers implement it:

==============================================  ===========================================
:class:`~ooc.storage.FileTier` (CPU)             a private swap file, background I/O threads;
                                                 ``src``/``dst`` are byte buffers (memoryview)
:class:`~ooc.storage.cuda_tier.PinnedTier` (GPU) pinned host memory, two copy streams;
                                                 ``src``/``dst`` are ``DevicePtr``
==============================================  ===========================================

``tests/ooc/test_tier_protocol.py`` runs one conformance suite over every implementation
(the pinned tier over the fake CUDA driver): what is written here is what it checks.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

__all__ = ["SlowerTier", "Transfer", "STATS_KEYS"]

#: Keys every tier's :meth:`SlowerTier.stats` has (each tier adds its own: ``file_bytes``,
#: ``pinned_bytes``, ...). Counts are ints; ``verify`` is a bool.
STATS_KEYS = ("bytes_written", "bytes_read", "writes", "reads", "live_bytes",
              "peak_live_bytes", "keys", "verify")


@runtime_checkable
class Transfer(Protocol):
    """One transfer in flight, as :meth:`SlowerTier.write_async` / ``read_async`` return it:
    a ``concurrent.futures.Future`` (file tier) or a ``CopyFuture`` (pinned tier).

    A ``CopyFuture`` also has ``wait_on_device()``: the device's compute stream waits for the
    copy, the host does not (``ooc.runtime.slots`` uses it where it exists).
    """

    def result(self, timeout: float | None = None) -> Any:
        """Block until the transfer is over; raise its :class:`~ooc.errors.StorageError`."""

    def done(self) -> bool:
        """Whether the transfer is over (never blocks)."""

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until the transfer is over; return its error (or None), never raise it."""


@runtime_checkable
class SlowerTier(Protocol):
    """Where swapped-out bytes live, keyed by int; exactly what the runtime calls.

    Guarantees every implementation gives (and the conformance suite checks):

    * ``write_async(key, src, nbytes)`` copies ``src``'s first ``nbytes`` under ``key``
      (replacing the key's old bytes); ``read_async(key, dst)`` copies them back into the
      start of ``dst``. A read may follow the key's write at once: it waits for the write.
      The bytes read are identical to the bytes written. The caller keeps ``src`` and ``dst``
      alive and untouched until the transfer is over.
    * Misuse is an error at the call, never a corrupt transfer: ``read_async`` of an unknown or
      discarded key is ``KeyError``; a ``dst`` smaller than the key, a ``src`` smaller than
      ``nbytes`` or a negative ``nbytes`` is ``ValueError``; ``write_async``, ``read_async``
      and ``reserve`` on a closed tier raise :class:`~ooc.errors.StorageError` (``discard``,
      ``drain``, ``stats`` and ``close`` do not).
    * A failed transfer raises :class:`~ooc.errors.StorageError` from its future, naming the
      key and the bytes.
    """

    def write_async(self, key: int, src: Any, nbytes: int) -> Transfer:
        """Start copying ``src[:nbytes]`` into the tier under ``key``."""

    def read_async(self, key: int, dst: Any) -> Transfer:
        """Start copying ``key``'s bytes into the start of ``dst``."""

    def discard(self, key: int) -> None:
        """Forget ``key`` (its room is reused once no transfer of it is in flight); an unknown
        key does nothing."""

    def reserve(self, writes: Sequence[tuple[int | None, int]]) -> None:
        """Make sure that ``writes`` (``(key or None for a new key, nbytes)`` pairs) will find
        room without growing the tier, or raise StorageError now: the engine calls it before
        the optimizer step changes any parameter. A rewrite of a key reuses its room."""

    def drain(self) -> None:
        """Block until every transfer submitted so far is over, whoever holds its future:
        afterwards nothing touches a buffer handed to the tier. Does nothing when closed."""

    def stats(self) -> dict[str, Any]:
        """Counters as a flat dict with at least the keys in :data:`STATS_KEYS`."""

    def close(self) -> None:
        """Wait for transfers in flight and give every resource back. Idempotent."""
