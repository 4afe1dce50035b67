"""Slower tiers for swapped-out bytes. On CPU: :class:`FileTier`, a private swap file on
local storage with background I/O threads (O_DIRECT where buffers are page-aligned)."""

from __future__ import annotations

from ooc.storage.file_tier import FileTier

__all__ = ["FileTier"]
