"""Moved to ``ooc.record.managed`` (the recorder package); kept so that imports from here
keep working."""

from ooc.record.managed import Birth, Recording  # noqa: F401
