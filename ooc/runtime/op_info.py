"""Moved to ``ooc.record.op_schema`` (the recorder and the runtime share it); kept so that
imports from here keep working."""

from ooc.record.op_schema import _OPS, OpInfo, op_info, split_foreach, tensors  # noqa: F401
