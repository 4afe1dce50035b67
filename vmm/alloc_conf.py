"""``PYTORCH_CUDA_ALLOC_CONF`` as data: parse a line, print it back, build the allocator model.

The knobs a PyTorch user can switch on today without changing code, each modelled where
its behaviour lives: ``expandable_segments`` (:mod:`vmm.expandable`), ``max_split_size_mb``
(:class:`vmm.CachingAllocator`), ``roundup_power2_divisions`` (:mod:`vmm.roundup`) and
``garbage_collection_threshold`` (:mod:`vmm.gc_threshold`). Other keys PyTorch knows
(``pinned_use_cuda_host_register``, ``backend``...) do not change the replay and are refused
here rather than silently ignored, so a model never claims a setting it does not have.

    conf = AllocConf.parse("expandable_segments:True,max_split_size_mb:128")
    conf.line()          # "expandable_segments:True,max_split_size_mb:128"
    conf.make(16 << 30)  # the allocator model, capped at 16 GiB
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vmm.gc_threshold import check_threshold
from vmm.roundup import check_divisions

__all__ = ["AllocConf", "AllocConfError"]

_MiB = 1 << 20
_MIN_SPLIT_MB = 20  # PyTorch refuses max_split_size_mb at or below kLargeBuffer (20 MiB)


class AllocConfError(ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` line the models cannot take; the message names the key."""


@dataclass(frozen=True, slots=True)
class AllocConf:
    """One setting of the modelled knobs (the defaults: PyTorch's own defaults)."""

    expandable_segments: bool = False
    max_split_size_mb: int | None = None
    garbage_collection_threshold: float | None = None
    roundup_power2_divisions: int = 1

    @classmethod
    def parse(cls, text: str) -> "AllocConf":
        """Read ``key:value[,key:value...]`` as PyTorch does (an empty line: the defaults)."""
        values: dict[str, Any] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise AllocConfError(f"{part!r}: expected key:value, e.g. expandable_segments:True")
            if key in values:
                raise AllocConfError(f"{key} is given twice in {text!r}")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise AllocConfError(f"expandable_segments:{value}: give True or False")
                values[key] = value == "True"
            elif key == "max_split_size_mb":
                if not value.isdigit() or int(value) <= _MIN_SPLIT_MB:
                    raise AllocConfError(f"max_split_size_mb:{value}: give a whole number of MiB "
                                         f"above {_MIN_SPLIT_MB}, e.g. 128 (PyTorch refuses less)")
                values[key] = int(value)
            elif key == "garbage_collection_threshold":
                try:
                    values[key] = check_threshold(float(value))
                except ValueError as exc:
                    raise AllocConfError(str(exc)) from None
            elif key == "roundup_power2_divisions":
                if not value.isdigit():
                    raise AllocConfError(f"roundup_power2_divisions:{value}: give one power of two, "
                                         f"e.g. 4 (the per-interval list form is not modelled)")
                try:
                    values[key] = check_divisions(int(value))
                except ValueError as exc:
                    raise AllocConfError(str(exc)) from None
            else:
                raise AllocConfError(
                    f"{key}: not a modelled PYTORCH_CUDA_ALLOC_CONF key; use expandable_segments, "
                    f"max_split_size_mb, garbage_collection_threshold or roundup_power2_divisions")
        return cls(**values)

    def line(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` value for this setting ("" for the defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.roundup_power2_divisions > 1:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        return ",".join(parts)

    @property
    def needs_cap(self) -> bool:
        """Whether the setting does anything only under a memory cap (garbage collection
        acts only with ``torch.cuda.set_per_process_memory_fraction``)."""
        return self.garbage_collection_threshold is not None and not self.expandable_segments

    def make(self, capacity_bytes: int | None, backend: Any = None) -> Any:
        """The allocator model for this setting (``backend``: for the default allocator's
        segments; a fresh :class:`vmm.SimBackend` when None)."""
        split = self.max_split_size_mb * _MiB if self.max_split_size_mb is not None else None
        if self.expandable_segments:
            from vmm.expandable import ExpandableAllocator

            return ExpandableAllocator(capacity_bytes, max_split_size=split,
                                       roundup_divisions=self.roundup_power2_divisions)
        from vmm.caching import CachingAllocator

        if backend is None:
            from vmm.sim import SimBackend

            backend = SimBackend(granularity=2 * _MiB)
        return CachingAllocator(backend, capacity_bytes, max_split_size=split,
                                roundup_divisions=self.roundup_power2_divisions,
                                gc_threshold=self.garbage_collection_threshold)
