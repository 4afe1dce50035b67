"""``OutOfCore``: train a model whose working memory exceeds a budget, bit for bit as in core.

The engine is a facade over parts that each own their state (``out_of_core.py`` lists them, in
the order a step meets them); ``ooc/runtime/`` runs the step itself, in one of the forms of
``ooc/runtime/step_protocol.py``.
"""

from ooc.engine.options import RECOMPUTE, Options
from ooc.engine.arguments import KINDS
from ooc.engine.out_of_core import OutOfCore
from ooc.engine.memory import DEFAULT_CHUNK
from ooc.engine.step_book import TIMELINE_STEPS
from ooc.runtime.step_protocol import FORMS
from ooc.runtime.vector_math import settle_vector_math

__all__ = ["DEFAULT_CHUNK", "FORMS", "KINDS", "Options", "OutOfCore", "RECOMPUTE", "TIMELINE_STEPS"]

settle_vector_math()   # before any step, ours or an in-core reference's (see its docstring)
