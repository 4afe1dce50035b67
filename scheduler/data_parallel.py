"""Data-parallel training in the simulator: the gradient all-reduce beside the transfers.

Under DistributedDataParallel every rank runs the same step on its own batch, and the
gradients are averaged across ranks while the backward still runs: DDP groups them into
buckets (``bucket_cap_mb``, 25 MiB by default) in the order they become ready, and starts an
all-reduce of a bucket as soon as its last gradient is written. The optimizer may read a
gradient only once its bucket's all-reduce has finished.

What a rank sends: a ring all-reduce of ``n`` bytes over ``r`` ranks sends, and receives,
``2 (r - 1) / r * n`` bytes per rank (reduce-scatter then all-gather), the figure NCCL's
"bus bandwidth" is quoted for. Its time is that over the interconnect's bandwidth per
direction, plus a latency.

Which link it uses is what a user wants to know: on a GPU whose peers are reached over its
own PCIe lanes (the PCIe presets) the all-reduce goes over the same lanes as the swaps, and
the two contend; with NVLink between GPUs (or a network beside local flash) they do not.
``Hardware.collective_bandwidth`` says which: 0 means "over the host link".

One step is modelled, one rank's view (all ranks run the same plan at the same pace); the
buckets are formed from the step's gradient variables (kind ``grad``) in the order their last
write in the backward happens.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.ir import Access, Kind, VariableSequence

DDP_BUCKET_BYTES = 25 << 20   # DDP's default bucket_cap_mb


@dataclass(frozen=True, slots=True)
class Bucket:
    """Gradients all-reduced together: issued after function ``ready_after`` (the last write
    of its last gradient), needed before function ``needed_before`` (the first read of any of
    them after that; ``None``: nothing in the step reads them again, the step's end waits)."""

    variables: tuple[int, ...]
    nbytes: int
    ready_after: int
    needed_before: int | None


def ring_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes`` over ``ranks``."""
    if ranks < 2:
        return 0
    return -(-2 * (ranks - 1) * nbytes // ranks)


def gradient_buckets(seq: VariableSequence, bucket_bytes: int = DDP_BUCKET_BYTES) -> list[Bucket]:
    """The step's gradients in DDP's buckets: ordered by when each is last written, a bucket
    closed once it holds ``bucket_bytes`` (the last one with what remains)."""
    last_write: dict[int, int] = {}
    for i, f in enumerate(seq.functions):
        for u in f.uses:
            if u.access is Access.WRITE and seq.variables[u.var].kind is Kind.GRAD:
                last_write[u.var] = i
    first_read_after: dict[int, int] = {}
    for i, f in enumerate(seq.functions):
        for u in f.uses:
            w = last_write.get(u.var)
            if w is not None and i > w and u.var not in first_read_after:
                first_read_after[u.var] = i
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    ordered = sorted(last_write, key=lambda v: (last_write[v], v))
    for k, v in enumerate(ordered):
        current.append(v)
        size += seq.variables[v].nbytes
        if size >= bucket_bytes or k == len(ordered) - 1:
            reads = [first_read_after[x] for x in current if x in first_read_after]
            buckets.append(Bucket(tuple(current), size, max(last_write[x] for x in current),
                                  min(reads) if reads else None))
            current, size = [], 0
    return buckets


def allreduce_bytes(seq: VariableSequence, ranks: int, bucket_bytes: int = DDP_BUCKET_BYTES) -> int:
    """Bytes one rank sends (and receives) to all-reduce the step's gradients over ``ranks``."""
    return sum(ring_bytes(b.nbytes, ranks) for b in gradient_buckets(seq, bucket_bytes))
