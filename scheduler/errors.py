"""Errors of the planning layer, all under the project's one base ``OOCError``."""

from __future__ import annotations

from vmm.errors import OOCError
from vmm.units import format_size


class SequenceFormatError(OOCError, ValueError):
    """A trace or plan file that is malformed, foreign, or of another schema version.

    The message says where (``functions[12].uses[3]``) and what was expected.
    """


class ScheduleError(OOCError):
    """``check`` found a schedule unsafe; the message names the function index and variable."""

    def __init__(self, message: str, *, function: int | None = None, variable: int | None = None):
        super().__init__(message)
        self.function = function
        self.variable = variable


class BudgetTooSmall(OOCError):
    """No schedule fits: one function's working set alone exceeds the budget."""

    def __init__(self, *, function: int, name: str, working_set: int, budget: int, minimum: int):
        self.function = function
        self.name = name
        self.working_set = working_set
        self.budget = budget
        self.minimum = minimum
        # The function named is the first one over the budget; the minimum is set by the
        # step as a whole (its largest working set, or more), so it may be larger. Say so,
        # or the two figures read as a contradiction ("needs 8 MiB ... at least 16 MiB").
        more = (", and the step as a whole needs more (another function's working set, or "
                "what must stay resident beside it)" if minimum > working_set else "")
        super().__init__(
            f"budget {format_size(budget)} ({budget} B) is too small: function {function} ({name}) "
            f"needs {format_size(working_set)} ({working_set} B) resident at once{more}; "
            f"raise the budget to at least {format_size(minimum)} ({minimum} B)"
        )
