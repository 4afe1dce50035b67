"""Hardware the simulator runs a schedule on: one compute stream and a link to a slower tier.

A :class:`Hardware` is data: how much device memory there is (the budget's ceiling), how fast
the device computes (a roofline of ``peak_flops`` and ``mem_bandwidth`` for functions whose
time was not measured), and how fast bytes move to and from the slower tier (``h2d`` brings a
variable back to the device, ``d2h`` sends it away). ``hardware(name, **overrides)`` returns a
preset, optionally changed by keyword::

    >>> from scheduler.hardware import hardware
    >>> hw = hardware("v100-16gb-nvlink", device_bytes="15GiB")
    >>> hw.h2d_bandwidth
    50000000000.0

The presets are *nominal* datasheet figures, not measurements; every number below says where
it comes from. No machine of this project has a GPU, so GPU-scale results are predictions of
``scheduler.simulate`` over these figures and must say so wherever they appear.

Conventions: bytes are ints, bandwidths are bytes per second (decimal: 50 GB/s = 50e9 B/s,
as datasheets quote them), FLOP/s are FP32 unless a preset says otherwise. Device capacities
are binary (16 GiB), as the memory is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vmm.errors import OOCError
from vmm.units import format_size, parse_size

GB = 1e9  # bandwidths: decimal, as datasheets print them
GiB = 1 << 30  # capacities: binary


class HardwareError(OOCError, ValueError):
    """An unknown preset name or an override that is not a field or not a positive number."""


@dataclass(frozen=True, slots=True)
class Hardware:
    """One device and its link to the slower tier, as the simulator sees them.

    ``full_duplex`` says whether a copy in and a copy out can run at the same time (true for
    PCIe and NVLink, whose two directions are separate lanes; false for one flash device,
    where reads and writes share the medium and the simulator puts both on one queue).
    """

    name: str
    device_bytes: int
    peak_flops: float
    mem_bandwidth: float
    h2d_bandwidth: float
    d2h_bandwidth: float
    link_latency_s: float
    op_overhead_s: float
    description: str = ""
    tier: str = "host"  # the slower tier: "host" (pinned host memory) or "storage" (a file)
    full_duplex: bool = True
    # Compute-stream seconds each moved byte costs (CPU devices: the I/O threads and the
    # copies take cycles from the compute threads). 0 where a DMA engine moves the bytes.
    moved_byte_s: float = 0.0
    # Data-parallel training (scheduler/data_parallel.py): bytes per second, per direction,
    # between this device and its peers for the gradient all-reduce, and the latency of one
    # collective. 0 bandwidth: the collectives go over the host link, sharing it with swaps.
    collective_bandwidth: float = 0.0
    collective_latency_s: float = 0.0
    # A device that runs ops as the host queues them (a GPU): the host seconds the engine's
    # per-op path spends queuing one op it looks at, and one its plan gives no role (a quiet
    # op, scheduler.schedule.quiet_functions; a recompute's replayed op too). The device cannot
    # run an op before the host queued it: with ~5,900 small ops, the host is the bottleneck
    # (a ~320 M Llama on an H200: 0.19x in core, ~80 us an op). 0: not modelled (the presets).
    host_op_s: float = 0.0
    host_quiet_op_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bandwidth", "h2d_bandwidth", "d2h_bandwidth"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
                    or value == float("inf"):
                raise HardwareError(f"hardware {self.name!r}: {f} must be a positive number, got {value!r}")
        for f in ("link_latency_s", "op_overhead_s", "moved_byte_s", "collective_bandwidth",
                  "collective_latency_s", "host_op_s", "host_quiet_op_s"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 \
                    or value == float("inf"):
                raise HardwareError(f"hardware {self.name!r}: {f} must be >= 0 seconds, got {value!r}")
        if not isinstance(self.device_bytes, int) or isinstance(self.device_bytes, bool) \
                or self.device_bytes <= 0:
            raise HardwareError(
                f"hardware {self.name!r}: device_bytes must be a positive int, got {self.device_bytes!r}")
        if self.tier not in ("host", "storage"):
            raise HardwareError(f"hardware {self.name!r}: tier must be 'host' or 'storage', got {self.tier!r}")

    def transfer_s(self, nbytes: int, *, to_device: bool) -> float:
        """Seconds one copy of ``nbytes`` occupies its channel: latency + bytes / bandwidth."""
        bw = self.h2d_bandwidth if to_device else self.d2h_bandwidth
        return self.link_latency_s + nbytes / bw

    def function_s(self, cost: Any) -> float:
        """Seconds a function of ``cost`` (a ``scheduler.ir.Cost``) takes on the compute
        stream: the measured ``seconds`` when known, else the roofline
        ``max(flops / peak_flops, bytes / mem_bandwidth) + op_overhead_s``."""
        if cost.seconds is not None:
            return cost.seconds
        return max(cost.flops / self.peak_flops, cost.bytes / self.mem_bandwidth) + self.op_overhead_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (f"{self.name}: {format_size(self.device_bytes)} device, "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s, {self.mem_bandwidth / GB:.4g} GB/s memory, "
                f"{self.h2d_bandwidth / GB:.3g}/{self.d2h_bandwidth / GB:.3g} GB/s in/out "
                f"({self.tier}, {'full' if self.full_duplex else 'half'} duplex)")


# -- presets ---------------------------------------------------------------------------------
#
# Latency and overhead, common to the GPU presets:
# - link_latency_s = 10 us: a cudaMemcpyAsync of pinned memory costs ~5-10 us before bytes
#   flow (driver call + DMA setup); it matters only for small variables.
# - op_overhead_s = 5 us: kernel launch latency (~3-5 us on the CUDA launch path). Added to
#   roofline estimates only; measured ``cost.seconds`` already include it.
_GPU_LINK_LATENCY_S = 10e-6
_GPU_OP_OVERHEAD_S = 5e-6
# Collectives (data-parallel): ~20 us a ring all-reduce step takes before bytes flow (NCCL's
# small-message latency on one node); the V100 preset's peers are on NVLink 2.0 (2 bricks,
# 50 GB/s per direction, nominal), the PCIe presets reach theirs over their own PCIe lanes,
# the lanes the swaps use (collective_bandwidth 0). Nominal: pass your machine's figures.
_COLLECTIVE_LATENCY_S = 20e-6

PRESETS: dict[str, Hardware] = {
    # The seed paper's machine (Hayakawa & Narihira): Tesla V100 SXM2 16 GB.
    # - 16 GiB HBM2 (4 stacks x 4 GiB; nvidia-smi shows 16160 MiB and the CUDA context takes a
    #   few hundred MiB more: pass device_bytes= for the usable figure).
    # - 900 GB/s HBM2 and 15.7 TFLOP/s FP32 (NVIDIA V100 datasheet, SXM2 boost clock). The
    #   paper trains ResNet-50 in FP32, so the roofline uses the FP32 peak, not the 125 TFLOP/s
    #   of the tensor cores.
    # - host link: NVLink 2.0 to a POWER9 host, 50 GB/s each direction as the issue states
    #   (2 bricks x 25 GB/s per direction; 3 bricks would be 75 GB/s).
    "v100-16gb-nvlink": Hardware(
        name="v100-16gb-nvlink", device_bytes=16 * GiB, peak_flops=15.7e12, mem_bandwidth=900 * GB,
        h2d_bandwidth=50 * GB, d2h_bandwidth=50 * GB,
        link_latency_s=_GPU_LINK_LATENCY_S, op_overhead_s=_GPU_OP_OVERHEAD_S,
        collective_bandwidth=50 * GB, collective_latency_s=_COLLECTIVE_LATENCY_S,
        description="Tesla V100 SXM2 16 GB, NVLink 2.0 host link 50 GB/s per direction "
                    "(the paper's machine); FP32 15.7 TFLOP/s, HBM2 900 GB/s"),
    # A100 PCIe 40 GB (NVIDIA A100 datasheet): 40 GiB HBM2, 1,555 GB/s, 19.5 TFLOP/s FP32
    # (156 TFLOP/s TF32 on tensor cores: pass peak_flops= to model TF32 training).
    # PCIe 4.0 x16 is 31.5 GB/s raw per direction; pinned cudaMemcpy reaches ~25 GB/s.
    "a100-40gb-pcie4": Hardware(
        name="a100-40gb-pcie4", device_bytes=40 * GiB, peak_flops=19.5e12, mem_bandwidth=1555 * GB,
        h2d_bandwidth=25 * GB, d2h_bandwidth=25 * GB,
        link_latency_s=_GPU_LINK_LATENCY_S, op_overhead_s=_GPU_OP_OVERHEAD_S,
        collective_latency_s=_COLLECTIVE_LATENCY_S,
        description="A100 PCIe 40 GB, PCIe 4.0 x16 ~25 GB/s effective per direction; "
                    "FP32 19.5 TFLOP/s, HBM2 1,555 GB/s"),
    # H100 PCIe 80 GB (NVIDIA H100 datasheet, PCIe form factor): 80 GiB HBM2e, 2.0 TB/s,
    # 51 TFLOP/s FP32 (the SXM part: 67 TFLOP/s, 3.35 TB/s). PCIe 5.0 x16 is 63 GB/s raw per
    # direction; pinned copies reach ~50 GB/s.
    "h100-80gb-pcie5": Hardware(
        name="h100-80gb-pcie5", device_bytes=80 * GiB, peak_flops=51e12, mem_bandwidth=2000 * GB,
        h2d_bandwidth=50 * GB, d2h_bandwidth=50 * GB,
        link_latency_s=_GPU_LINK_LATENCY_S, op_overhead_s=_GPU_OP_OVERHEAD_S,
        collective_latency_s=_COLLECTIVE_LATENCY_S,
        description="H100 PCIe 80 GB, PCIe 5.0 x16 ~50 GB/s effective per direction; "
                    "FP32 51 TFLOP/s, HBM2e 2.0 TB/s"),
    # A CPU edge board, modelled on a Raspberry Pi 5 class SoC (4x Cortex-A76 at 2.4 GHz):
    # - "device" = the DRAM the budget governs: 4 GiB LPDDR4X.
    # - peak 153.6 GFLOP/s FP32 = 4 cores x 2.4 GHz x 16 FLOP/cycle (two 128-bit NEON FMA
    #   pipes); eager PyTorch reaches a fraction of it, so prefer measured seconds.
    # - memory 17 GB/s = LPDDR4X-4267 on a 32-bit bus (theoretical).
    # - slower tier = a file on local flash, half duplex (reads and writes share the medium).
    #   Default 1 GB/s each way: between eMMC 5.1 (~0.3 GB/s read, ~0.1-0.2 GB/s write),
    #   an NVMe SSD on the Pi 5's PCIe 2.0 x1 (~0.45 GB/s) and UFS 3.1 phones (~2 GB/s
    #   sequential read, ~1.2 GB/s write, the NNTrainer setting). Set it with
    #   ``hardware("cpu-edge", storage_bandwidth=...)`` (both ways) or h2d_/d2h_bandwidth=.
    # - link_latency_s = 100 us: one large pread/pwrite on flash (syscall + queue + first
    #   page); op_overhead_s = 10 us: eager PyTorch's per-op dispatch cost on a small CPU.
    # - peers (data-parallel) over 1 Gb/s Ethernet, 0.125 GB/s, beside the flash; ~100 us a
    #   collective step (TCP through gloo).
    # - moved_byte_s = 0.1 ns/B: the compute time a moved byte takes from the compute threads
    #   when the CPU that computes also moves it (I/O threads, page pinning, the kernel's and
    #   the host's work for the disk), measured on 2 cores as swap-only minus in-core step
    #   time, less the engine's per-op cost, per byte moved: ResNet-50 b8 at 1/4, ~0.1 s for
    #   1,152 MiB (2026-11-25, Intel Xeon VM). It was 0.33 ns/B (cpu-rerun.md, 02:00 run),
    #   measured while each moved byte also cost fresh pages zeroed by the kernel (memory
    #   churned between ooc's device pool and its CPU allocator; they share pages now).
    "cpu-edge": Hardware(
        name="cpu-edge", device_bytes=4 * GiB, peak_flops=153.6e9, mem_bandwidth=17 * GB,
        h2d_bandwidth=1 * GB, d2h_bandwidth=1 * GB, link_latency_s=100e-6, op_overhead_s=10e-6,
        moved_byte_s=0.1e-9, collective_bandwidth=0.125 * GB, collective_latency_s=100e-6,
        description="CPU edge board (4x Cortex-A76 2.4 GHz, 4 GiB LPDDR4X), swap to local "
                    "flash at 1 GB/s, half duplex", tier="storage", full_duplex=False),
}

_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware))


def hardware(name: str | Hardware, **overrides: Any) -> Hardware:
    """A preset by name (see ``PRESETS``), with fields replaced by keyword.

    ``device_bytes`` takes an int or a size string ("15GiB"). ``storage_bandwidth`` (B/s) sets
    both directions of a preset whose slower tier is storage. Unknown names and fields raise
    :class:`HardwareError` listing what exists. A :class:`Hardware` passes through, so callers
    can take either.
    """
    if isinstance(name, Hardware):
        base = name
    else:
        try:
            base = PRESETS[name]
        except (KeyError, TypeError):
            raise HardwareError(
                f"unknown hardware {name!r}; presets: {', '.join(sorted(PRESETS))} "
                f"(or pass overrides to one of them)") from None
    if not overrides:
        return base
    changes = dict(overrides)
    if "storage_bandwidth" in changes:
        bw = changes.pop("storage_bandwidth")
        if base.tier != "storage":
            raise HardwareError(
                f"hardware {base.name!r} swaps to {base.tier} memory, not storage; "
                f"set h2d_bandwidth= and d2h_bandwidth= instead of storage_bandwidth=")
        changes.setdefault("h2d_bandwidth", bw)
        changes.setdefault("d2h_bandwidth", bw)
    unknown = sorted(set(changes) - set(_FIELDS))
    if unknown:
        raise HardwareError(
            f"hardware {base.name!r}: unknown field(s) {', '.join(unknown)}; "
            f"fields: {', '.join(_FIELDS)} (and storage_bandwidth for storage tiers)")
    if "device_bytes" in changes:
        changes["device_bytes"] = parse_size(changes["device_bytes"], what="device_bytes")
    return dataclasses.replace(base, **changes)
