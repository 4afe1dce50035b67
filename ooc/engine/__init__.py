"""``OutOfCore``: train a model whose working memory exceeds a budget, bit for bit as in core.

The engine, in the order a step meets it (``ooc/runtime/stepper.py`` runs the ops):

- ``out_of_core.py``: ``OutOfCore``, its settings, the step context manager, stats, close;
- ``planning.py``: which plan a step runs (per start and shape, least recently used out),
  re-planning from a recorded step, the adaptive chunk;
- ``step_forms.py``: the step's form (per op, plain, anchored) and switching it at the forward;
- ``persistent.py``: the parameters, gradients and optimizer state it manages across steps;
- ``between_steps.py``: their uses between steps, where they exceed the budget;
- ``update_hooks.py``: ``optimizer.step()`` inside a step, the commit point;
- ``step_end.py``: finishing a step (settle, roll back, what outlives it);
- ``lifetime.py``: what it holds outside itself (hooks, tier, pool), and letting go.
"""

from ooc.engine.out_of_core import KINDS, OutOfCore
from ooc.engine.planning import DEFAULT_CHUNK
from ooc.engine.step_end import TIMELINE_STEPS
from ooc.runtime.vector_math import settle_vector_math

__all__ = ["DEFAULT_CHUNK", "KINDS", "OutOfCore", "TIMELINE_STEPS"]

settle_vector_math()   # before any step, ours or an in-core reference's (see its docstring)
