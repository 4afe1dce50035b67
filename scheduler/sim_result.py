"""What ``scheduler.simulate`` predicts for one step: its times, its bytes, its peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.hardware import Hardware
from scheduler.timeline import Event

__all__ = ["SimResult"]


@dataclass(frozen=True, slots=True)
class SimResult:
    """Predicted time and memory of one step. Times in seconds, sizes in bytes.

    ``compute_s`` is the sum of function times (what the step takes in core, with nothing
    swapped), ``stall_s`` the time the compute stream spent in ``wait_in``/``wait_out``,
    ``recompute_s`` the time it spent rerunning recompute chains, ``copy_cpu_s`` the compute
    time moved bytes took (``Hardware.moved_byte_s``), and ``total_s`` the step's end: the
    compute stream's end or the last copy's, whichever is later.

    ``reserved_peak_bytes`` and ``fits`` come from replaying the allocation stream through the
    chosen ``allocator`` with the device's capacity; with ``allocator=None`` they describe an
    ideal allocator (reserved = ``peak_bytes``, fits when that is within ``device_bytes``).
    ``oom_function`` is the first function at which the device ran out, or None.
    """

    total_s: float
    compute_s: float
    stall_s: float
    lower_bound_s: float
    peak_bytes: int
    peak_function: int
    bytes_in: int
    bytes_out: int
    transfers_in: int
    transfers_out: int
    h2d_busy_s: float
    d2h_busy_s: float
    hardware: Hardware
    policy: str
    budget: int
    timeline: tuple[Event, ...] = ()
    allocator: str | None = None
    chunk_bytes: int | None = None
    reserved_peak_bytes: int = 0
    fits: bool = True
    oom_function: int | None = None
    recompute_s: float = 0.0
    bytes_recomputed: int = 0
    copy_cpu_s: float = 0.0
    data_parallel: int = 1
    allreduce_bytes: int = 0      # bytes this rank sent (and received) in the step's all-reduce
    allreduce_s: float = 0.0      # seconds its link was busy with them
    allreduce_stall_s: float = 0.0   # of stall_s: the compute stream waiting for them
    host_s: float = 0.0           # the host's time queuing the step's ops (Hardware.host_op_s)
    host_wait_s: float = 0.0      # the compute stream idle, waiting for the host to queue an op

    @property
    def relative_speed(self) -> float:
        """In-core time over this step's time (the paper's "55% of in-core speed" is 0.55)."""
        return self.compute_s / self.total_s if self.total_s > 0 else 1.0

    @property
    def overhead_s(self) -> float:
        """Seconds the step takes beyond its compute: what swapping costs."""
        return self.total_s - self.compute_s

    def throughput(self, samples_per_step: float) -> float:
        """Samples per second at ``samples_per_step`` (the batch size) per step."""
        return samples_per_step / self.total_s if self.total_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON fields with stable keys (plus the allocator's, when one was modelled)."""
        out: dict[str, Any] = {
            "total_s": self.total_s, "compute_s": self.compute_s, "stall_s": self.stall_s,
            "lower_bound_s": self.lower_bound_s, "peak_bytes": self.peak_bytes,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "recompute_s": self.recompute_s, "bytes_recomputed": self.bytes_recomputed,
            "copy_cpu_s": self.copy_cpu_s, "hardware": self.hardware.name, "policy": self.policy, "budget": self.budget,
            "data_parallel": self.data_parallel, "allreduce_bytes": self.allreduce_bytes,
            "allreduce_s": self.allreduce_s, "allreduce_stall_s": self.allreduce_stall_s,
            "host_s": self.host_s, "host_wait_s": self.host_wait_s,
        }
        if self.allocator is not None:
            out.update(allocator=self.allocator, chunk_bytes=self.chunk_bytes,
                       reserved_peak_bytes=self.reserved_peak_bytes, fits=self.fits)
        return out
