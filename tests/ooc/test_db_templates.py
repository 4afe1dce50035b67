"""The template form (``ooc/runtime/templates.py``) on PyTorch's own module database: each
``nn`` module's first sample, trained ``db_steps.TEMPLATE_STEPS`` steps with plans that
recompute (the swap file priced slow) and every anchored form kept, so that the settled steps
rerun their chains from templates at autograd's hooks; each step bitwise as in core
(``db_steps.compare``), at the smallest budget and a chunk above it (``db_steps.TEMPLATES``).
These samples are tiny (most hold a few 4 KiB chunks): at the smallest budget an anchored
form, which holds bytes longer, often does not fit, and a chunk above it the whole step often
does; those run per op, plain or swap-only anchored, also bitwise. The test asserts that the
template form ran on enough of them to mean something (20 modules when written, the
Transformer layers, MultiheadAttention, LSTM and RNN among them).
"""

from __future__ import annotations

import pytest

from db_steps import TEMPLATES, Sample, run_chosen
from test_module_db import INFOS, _samples
from test_reliability import _one_torch_thread  # noqa: F401

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(900)]

MIN_RECOMPUTING = 16   # modules whose anchored steps recomputed, under either setting


def _firsts(covers: str = "") -> list[tuple[Sample, str]]:
    return [(samples[0], setting + covers) for _, info in INFOS.values() if (samples := _samples(info))
            for setting in TEMPLATES]


@pytest.mark.slow
@pytest.mark.parametrize("covers", ["", "@step"], ids=["managed", "whole-step"])
def test_module_samples_rerun_their_chains_from_templates_bitwise(covers: str) -> None:
    """``@step``: under a budget for the whole step (``Options(budget_covers="step")``), at the
    least the engine names and a chunk above it (23 modules recomputed at the hooks when written)."""
    ran = run_chosen(_firsts(covers))
    recomputing = {stats["sample"] for stats in ran if stats["anchored_recomputed"] > 0}
    assert len(recomputing) >= MIN_RECOMPUTING, f"only {sorted(recomputing)} recomputed at the hooks"
