"""Chains through results nobody saves (``Function.needs``): a softmax's scores, a residual's
downsampled identity. The engine never manages them, so a replay must make them again; the
training must still be bitwise in-core training (parameters, losses, BatchNorm statistics,
optimizer state), with dropout's generator state replayed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ooc
import test_recompute_runtime as runtime
from scheduler.replay import chain_for
from scheduler.schedule import Op


class Attention(nn.Module):
    """Causal attention written out: q k^T, scale, mask, softmax, dropout, @ v. Nothing saves
    the scores (the product, the scaled and the masked ones): only the softmax output is."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = self.drop(att.softmax(dim=-1)) @ v
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class Down(nn.Module):
    """A ResNet block with a projection shortcut: ``out += bn_d(conv_d(x))``. The shortcut's
    BatchNorm output is read by ``add_`` and then dropped: nothing saves it."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c)
        self.cd, self.bd = nn.Conv2d(c, 2 * c, 1), nn.BatchNorm2d(2 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b1(self.c1(x))
        y += self.bd(self.cd(x))
        return torch.relu_(y)


def _attention_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), nn.LayerNorm(32), Attention(), nn.Flatten(), nn.Linear(64 * 32, 10))


def _down_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), Down(16), Down(32), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 10))


CASES = {
    "attention": (_attention_model, lambda: torch.randn(16, 64, 32, generator=torch.Generator().manual_seed(3)),
                  torch.ops.aten._softmax.default),
    "downsample": (_down_model, lambda: torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3)),
                   torch.ops.aten.native_batch_norm.default),
    # the zoo's small CNN: conv-BN-ReLU blocks, for chains through a discarded convolution output
    "small_cnn": (lambda: (torch.manual_seed(0), ooc.models.small_cnn(width=8, blocks=4, per_stage=2))[1],
                  lambda: torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3)), None),
}


def _train(case: str, opt_name: str, steps: int = 4, **engine_kw) -> dict:
    make, batch, _ = CASES[case]
    x = batch()
    return runtime._train(opt_name, steps, make=make, data=(x, torch.arange(x.shape[0]) % 10), chunk="64KiB",
                          **engine_kw)


def _maker_chains(schedule) -> list[tuple[str, ...]]:
    """The recompute chains that rerun a function besides the writers of their variable."""
    seq = schedule.sequence
    out = []
    for acts in schedule.before:
        for a in acts:
            if a.op is Op.RECOMPUTE and set(a.chain) - set(seq.writers[a.var]):
                out.append(tuple(seq.functions[w].name for w in a.chain))
    return out


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("case", ["attention", "downsample"])
def test_a_chain_remakes_what_nobody_saved_and_stays_bitwise(case: str, opt_name: str) -> None:
    ref = _train(case, opt_name)
    op = CASES[case][2]
    got = _train(case, opt_name, budget="64MiB", pin={op: "must_recompute"})
    runtime._assert_bitwise(ref, got)   # losses, parameters, BatchNorm statistics, optimizer state
    chains = _maker_chains(got["schedule"])
    assert chains, "no chain reran a function besides its variable's writers"
    if case == "attention":   # the scores: q k^T, scaled, masked, then the softmax
        assert any(c[0] == "aten.bmm.default" and c[-1] == "aten._softmax.default" for c in chains), chains
    else:                     # the shortcut's BatchNorm before the add_ that reads it
        assert any(c.count("aten.native_batch_norm.default") == 2 and "aten.add_.Tensor" in c for c in chains), chains
    assert got["stats"]["bytes_recomputed"] > 0 and got["stats"]["last_planned"] == 1


def test_the_recorded_sequence_names_what_each_function_needs() -> None:
    """The recorder's ``needs``: the softmax needs the ops that made its scores (nothing the
    engine manages holds them), the chain of its output reruns them first, and the file
    format keeps them."""
    got = _train("attention", "sgd", steps=2, budget="64MiB", pin={torch.ops.aten._softmax.default: "must_recompute"})
    seq = got["schedule"].sequence
    softmax = [f for f in seq.functions if f.name == "aten._softmax.default"]
    assert softmax and all(f.replayable and f.needs for f in softmax)
    for f in softmax:
        assert [seq.functions[k].name for k in f.needs] == ["aten.masked_fill.Scalar"]
        assert [u.access.value for u in f.uses] == ["write"]   # its input is no variable
        out = f.uses[0].var
        chain = chain_for(seq, out, seq.uses_of[out][-1])
        assert chain is not None
        assert [seq.functions[w].name for w in chain.functions] == [
            "aten.bmm.default", "aten.mul.Tensor", "aten.masked_fill.Scalar", "aten._softmax.default"]
    again = type(seq).from_dict(seq.to_dict())
    assert [f.needs for f in again.functions] == [f.needs for f in seq.functions]


def _through_chains(schedule) -> list[tuple[str, ...]]:
    """The recompute chains that also make a managed variable besides their own (an input
    the plan had discarded too, made again inside the chain)."""
    seq = schedule.sequence
    out = []
    for acts in schedule.before:
        for a in acts:
            if a.op is Op.RECOMPUTE and any(seq.producer.get(x) in a.chain and x != a.var for x in seq.variables):
                out.append(tuple(seq.functions[w].name for w in a.chain))
    return out


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_a_chain_through_a_discarded_input_stays_bitwise(monkeypatch, opt_name: str) -> None:
    """``scheduler.replay.chain_through`` at run time: with transfers priced dear, the plan
    discards convolution outputs and recomputes the BatchNorm + ReLU outputs after them
    through the convolution; the replay reads the convolution output it made, not the
    discarded slot. Training stays bitwise in-core (BatchNorm statistics included)."""
    import dataclasses

    import scheduler
    from scheduler.hardware import hardware
    from scheduler.pins import Pins, pinned_rule
    from scheduler.recompute import swap_or_recompute
    from scheduler.window import plan_window

    dear = dataclasses.replace(hardware("cpu-edge"), h2d_bandwidth=1e6, d2h_bandwidth=1e6)

    def plan(seq, budget, window=None, policy="window", **options):
        return plan_window(seq, budget, window, pinned_rule(seq, Pins(), swap_or_recompute(seq, dear, 1.0, True)))

    ref = _train("small_cnn", opt_name)
    monkeypatch.setattr(scheduler, "plan", plan)
    got = _train("small_cnn", opt_name, budget="1MiB")
    runtime._assert_bitwise(ref, got)
    chains = _through_chains(got["schedule"])
    assert any(c[0] == "aten.convolution.default" and "aten.native_batch_norm.default" in c for c in chains), chains
    assert got["stats"]["last_planned"] == 1 and got["stats"]["last_diverged_at"] == -1
    assert got["stats"]["bytes_recomputed"] > 0


def test_a_chain_through_two_discarded_levels_stays_bitwise(monkeypatch) -> None:
    """``chain_through`` through an input whose own chain needs a discarded input in turn: with
    transfers priced dear and a tight budget, a ResNet block's outputs come back through two
    convolutions (conv, BatchNorm, ReLU, conv, ...) made again inside one chain, from an input
    still resident. On GPU profiles this is what lets the plan recompute a block instead of
    swapping it (benchmarks/results/profiles.md). Training stays bitwise in core."""
    import dataclasses

    import scheduler
    from scheduler.hardware import hardware
    from scheduler.pins import Pins, pinned_rule
    from scheduler.recompute import swap_or_recompute
    from scheduler.window import plan_window

    dear = dataclasses.replace(hardware("cpu-edge"), h2d_bandwidth=1e6, d2h_bandwidth=1e6)

    def plan(seq, budget, window=None, policy="window", **options):
        return plan_window(seq, budget, window, pinned_rule(seq, Pins(), swap_or_recompute(seq, dear, 1.0, True)))

    ref = _train("small_cnn", "sgd")
    monkeypatch.setattr(scheduler, "plan", plan)
    got = _train("small_cnn", "sgd", budget="768KiB")
    runtime._assert_bitwise(ref, got)
    chains = _through_chains(got["schedule"])
    assert any(c.count("aten.convolution.default") >= 2 for c in chains), chains
    assert got["stats"]["last_planned"] == 1 and got["stats"]["bytes_recomputed"] > 0


@pytest.mark.parametrize("budget", ["1MiB", "1536KiB", "2MiB"])
def test_shared_replays_the_gpu_planner_makes_run_bitwise(monkeypatch, budget: str) -> None:
    """Segment recompute (``scheduler.segments``, the GPU planner's shared replays) moves a
    discarded input's recompute before the chain that reads it, out of its own use. The engine
    on a CPU never plans so (its prices differ), so here its planning is replaced by the GPU
    rule with swaps made dear: the runtime must execute the moved recomputes as they are
    planned, every step planned, bitwise as in core."""
    import dataclasses

    import scheduler
    from scheduler.hardware import hardware
    from scheduler.pins import Pins, pinned_rule
    from scheduler.recompute import swap_or_recompute
    from scheduler.window import plan_window

    dear = dataclasses.replace(hardware("cpu-edge"), h2d_bandwidth=1e6, d2h_bandwidth=1e6, moved_byte_s=0.0)
    moved = []

    def plan(seq, budget, window=None, policy="window", **options):
        rule = pinned_rule(seq, Pins(), swap_or_recompute(seq, dear, 1.0, True, True))
        s = plan_window(seq, budget, window, rule)
        moved.append(sum(1 for i, acts in enumerate(s.before) for a in acts
                         if a.op is Op.RECOMPUTE and i not in seq.uses_of[a.var]))
        return s

    ref = _train("small_cnn", "sgd")
    monkeypatch.setattr(scheduler, "plan", plan)
    got = _train("small_cnn", "sgd", budget=budget)
    runtime._assert_bitwise(ref, got)
    assert max(moved) > 0, "no recompute was moved before its use: nothing shared was tested"
    assert got["stats"]["last_planned"] == 1 and got["stats"]["last_diverged_at"] == -1


class _Watched:
    """A chain's call whose ``func`` first notes the bytes of the replay's own results held
    while it runs (distinct storages of ``made``: an in-place op's result is its input's)."""

    def __init__(self, call, made: dict, most: list[int]) -> None:
        self._call, self._made, self._most = call, made, most

    def __getattr__(self, name: str):
        return getattr(self._call, name)

    def func(self, *args, **kwargs):
        live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._made.values()}
        self._most[0] = max(self._most[0], sum(live.values()))
        return self._call.func(*args, **kwargs)


def test_a_replay_holds_its_own_results_only_as_long_as_the_plan_counted(monkeypatch) -> None:
    """With transfers priced dear and a tight budget, ResNet-50's chains run through whole
    bottlenecks (up to 32 functions), making several activations again; the plan counts each as
    a temporary from the call that makes it to the last call that reads it
    (``Chain.temporaries_bytes``), and a replay, per op or from templates, must hold them no
    longer (held to the chain's end: 2.4 MB here where the plan counted 0.8 MB; on an H200,
    7.2 GiB at a step's peak). Bitwise as in core, as ever."""
    import dataclasses

    import scheduler
    from ooc.runtime import recipes
    from scheduler.hardware import hardware
    from scheduler.pins import Pins, pinned_rule
    from scheduler.recompute import swap_or_recompute
    from scheduler.replay import temporaries_bytes
    from scheduler.window import plan_window

    dear = dataclasses.replace(hardware("cpu-edge"), h2d_bandwidth=1e6, d2h_bandwidth=1e6)

    def plan(seq, budget, window=None, policy="window", **options):
        return plan_window(seq, budget, window, pinned_rule(seq, Pins(), swap_or_recompute(seq, dear, 1.0, True)))

    replays = []   # (var, chain, most bytes of its own results held at one of its calls, kind of call)
    rerun = recipes._rerun

    def watched(calls, fill, made, slot, *rest):
        most = [0]
        rerun([(w, _Watched(r, made, most)) for w, r in calls], fill, made, slot, *rest)
        replays.append((slot.var, tuple(w for w, _ in calls), most[0], type(calls[0][1]).__name__))

    def make():
        torch.manual_seed(0)
        return ooc.models.resnet50(num_classes=10)

    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    data = (x, torch.arange(4) % 10)
    ref = runtime._train("sgd", 10, make=make, data=data, chunk="64KiB")
    monkeypatch.setattr(scheduler, "plan", plan)
    monkeypatch.setattr(recipes, "_rerun", watched)
    got = runtime._train("sgd", 10, make=make, data=data, chunk="64KiB", budget="2MiB")
    runtime._assert_bitwise(ref, got)
    seq = got["schedule"].sequence
    counted = [(held, temporaries_bytes(seq, var, chain), len(chain), kind) for var, chain, held, kind in replays]
    assert {kind for *_, kind in counted} == {"Recipe", "Template"}, "both forms of replay ran"
    assert any(n >= 20 and held > 0 for held, _, n, _ in counted), counted   # through whole blocks
    assert all(held <= plan for held, plan, _, _ in counted), [c for c in counted if c[0] > c[1]]
