"""Load PyTorch memory snapshots without running anything in them.

A snapshot (``torch.cuda.memory._dump_snapshot``) is a pickle of plain data: dicts, lists,
tuples, ints, floats, strings, booleans and None. Pickle encodes all of those with its own
opcodes, so a real snapshot never needs to import anything. Anything that asks the
unpickler for a global (a class or a function, which is how ``__reduce__`` payloads such as
``os.system`` run code) is refused before it is looked up, so nothing is imported and
nothing is called.

The allow-list is deliberately tiny: ``set`` and ``frozenset`` (plain containers; pickle
protocols 0-3 encode them as a call to the builtin), under their Python 3 and Python 2
module names. Persistent ids (``torch.save`` archives use them) are refused too.

The unpickler is Python's pure-Python one (``pickle._Unpickler``), not the C accelerator: the C
unpickler keeps its memo in an array sized by the largest index a PUT opcode names, so a
30-byte pickle naming index 2**30 makes it allocate and zero-fill 16 GiB before it reads on
(found by tests/ooc/test_fuzz_loaders.py: a hang, then the OOM killer). The pure-Python memo is
a dict. The price is speed: about 10x the C unpickler's time (a 12 MB snapshot: 2.8 s instead
of 0.2 s here).
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, BinaryIO

from vmm.errors import OOCError

__all__ = ["ALLOWED_GLOBALS", "UnsafePickleError", "SafeUnpickler", "safe_load"]

# (module, name) pairs a snapshot may ask for. Everything else is refused.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"),
    ("__builtin__", "set"), ("__builtin__", "frozenset"),
})


class UnsafePickleError(OOCError, ValueError):
    """A pickle asked for a global outside the allow-list; nothing was imported or run."""


class SafeUnpickler(pickle._Unpickler):  # noqa: SLF001 - the pure-Python one, see the docstring
    """An unpickler that only builds plain data (see the module docstring)."""

    def __init__(self, file: BinaryIO, *, where: str = "pickle") -> None:
        super().__init__(file)
        self._where = where
        read = self._file_read

        def read_exactly(n: int) -> bytes:   # the C unpickler's check; Python's reads on
            data = read(n)
            if len(data) < n:
                raise pickle.UnpicklingError("pickle data was truncated")
            return data

        self._file_read = read_exactly

    def load(self) -> Any:
        try:
            return super().load()
        except struct.error as e:   # an argument cut short: the C unpickler's "truncated"
            raise pickle.UnpicklingError(f"pickle data was truncated ({e})") from None

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return set if name == "set" else frozenset
        raise UnsafePickleError(
            f"{self._where}: refused to load: the pickle asks for {module}.{name}, and a memory "
            f"snapshot holds only plain data (dicts, lists, numbers, strings); nothing was run. "
            f"Only open snapshots you trust with pickle itself")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            f"{self._where}: refused to load: the pickle uses persistent ids (a torch.save archive?),"
            f" not a memory snapshot; nothing was run")


def safe_load(data: bytes | BinaryIO, *, where: str = "pickle") -> Any:
    """Unpickle ``data`` (bytes or a binary file) with :class:`SafeUnpickler`.

    Raises :class:`UnsafePickleError` for a refused global and lets the caller turn the
    usual unpickling errors (truncated, garbage) into messages of its own.
    """
    fh = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    return SafeUnpickler(fh, where=where).load()
