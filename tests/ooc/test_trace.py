"""ooc.trace: one training step recorded as a variable sequence (meta and CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ooc
from ooc import models
from ooc.cli import main
from ooc.trace import Recorder, TraceError, summary
from scheduler.ir import Access, Kind, VariableSequence


def _shape(seq: VariableSequence):
    """Everything but costs: names, uses, variable sizes/kinds/names/lifetimes, phases."""
    return ([(f.name, f.uses) for f in seq.functions],
            {k: (v.nbytes, v.kind, v.name, v.live_in, v.live_out) for k, v in seq.variables.items()},
            {k: v for k, v in seq.meta.items() if k.endswith("_start")})


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.view(x.size(0), -1))))


def _mlp_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 2, 4, generator=g), torch.randint(0, 4, (5,), generator=g)


@pytest.fixture(scope="module")
def mlp_adam() -> VariableSequence:
    x, y = _mlp_batch()
    return ooc.trace(MLP(), x, y, optimizer="adam", device="cpu")


# -- meta and real traces are the same sequence ------------------------------------------------


@pytest.mark.parametrize("name,kw,opt", [
    ("small_cnn", {"width": 8}, "adam"),
    ("tiny_transformer", {}, "sgd"),
    ("unet", {"base": 4, "depth": 2}, "adamw"),
])
def test_meta_trace_equals_cpu_trace(name, kw, opt):
    model = models.get(name, **kw)
    x, y = models.example_batch(name, 2, "cpu", image_size=32, **kw)
    loss = models.loss_fn(name)
    on_meta = ooc.trace(model, x, y, loss_fn=loss, optimizer=opt, device="meta")
    on_cpu = ooc.trace(model, x, y, loss_fn=loss, optimizer=opt, device="cpu")
    assert on_meta.meta["device"] == "meta" and on_cpu.meta["device"] == "cpu"
    assert _shape(on_meta) == _shape(on_cpu)
    assert all(f.cost.seconds is None for f in on_cpu.functions)  # measure=False


def test_model_built_on_meta_traces_without_memory():
    with torch.device("meta"):
        model = models.resnet50()
    x, y = models.example_batch("resnet50", 1440, "meta")
    seq = ooc.trace(model, x, y, optimizer="sgd")
    info = summary(seq)
    assert info["device"] == "meta" and info["batch"] == 1440
    # Paper: 7.5x beyond a 16 GB V100 in-core; this step needs about 125 GB.
    assert 100 * 2**30 < seq.in_core_peak_bytes < 160 * 2**30
    assert info["variables"]["param"]["count"] == 161 + 3 * 53  # weights + BN buffers
    assert info["variables"]["grad"]["count"] == 161
    assert info["variables"]["optimizer_state"]["count"] == 161  # SGD momentum buffers
    # forward + backward FLOPs of ResNet-50: ~3 x 8.2 GFLOP per image
    assert 30e12 < info["flops"] < 40e12


# -- kinds, names, lifetimes --------------------------------------------------------------------


def test_kinds_and_names(mlp_adam):
    by_name = {v.name: v for v in mlp_adam.variables.values()}
    for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        v = by_name[p]
        assert (v.kind, v.live_in, v.live_out) == (Kind.PARAM, True, True)
        g = by_name[f"{p}.grad"]
        assert (g.kind, g.live_in, g.live_out) == (Kind.GRAD, False, False)
        assert g.nbytes == v.nbytes
        for key in ("exp_avg", "exp_avg_sq"):
            s = by_name[f"{p}.{key}"]
            assert (s.kind, s.live_in, s.live_out, s.nbytes) == (Kind.OPTIMIZER_STATE, True, True, v.nbytes)
        assert by_name[f"{p}.step"].kind is Kind.OPTIMIZER_STATE
    assert (by_name["input"].kind, by_name["input"].live_in, by_name["input"].live_out) == (Kind.INPUT, True, False)
    assert by_name["target"].kind is Kind.INPUT
    # relu's output is saved (by ReluBackward and by fc2's mm): an activation, named after
    # the op and module that wrote it; fc1's output is only read by relu: a temporary.
    acts = [v for v in mlp_adam.variables.values() if v.kind is Kind.ACTIVATION]
    assert any(v.name.startswith("model:aten.relu.default#") for v in acts)
    fc1_out = [v for v in mlp_adam.variables.values() if v.name.startswith("fc1:aten.addmm")]
    assert len(fc1_out) == 1 and fc1_out[0].kind is Kind.TEMPORARY
    assert fc1_out[0].nbytes == 5 * 16 * 4
    kinds = {v.kind for v in mlp_adam.variables.values()}
    assert kinds == set(Kind)


def test_grads_are_created_in_backward_and_read_by_the_optimizer(mlp_adam):
    seq = mlp_adam
    bwd, opt = seq.meta["backward_start"], seq.meta["optimizer_start"]
    assert 0 < seq.meta["loss_start"] < bwd < opt < len(seq.functions)
    for v in seq.variables.values():
        if v.kind is Kind.GRAD:
            assert bwd <= seq.first_use[v.id] < opt
            assert seq.last_use[v.id] >= opt
        if v.kind is Kind.ACTIVATION:
            assert seq.first_use[v.id] < bwd <= seq.last_use[v.id]
    # Parameters are updated in place by the optimizer: a read and a write.
    w = next(v.id for v in seq.variables.values() if v.name == "fc1.weight")
    writes = [f for f in seq.functions[opt:] for u in f.uses if u.var == w and u.access is Access.WRITE]
    assert writes and all(f.name.startswith("optimizer:") for f in writes)


def test_phase_and_module_names(mlp_adam):
    seq = mlp_adam
    names = [f.name for f in seq.functions]
    bwd, opt = seq.meta["backward_start"], seq.meta["optimizer_start"]
    assert "fc1:aten.addmm.default" in names[:seq.meta["loss_start"]]
    assert all(n.startswith("loss:") for n in names[seq.meta["loss_start"]:bwd])
    assert names[bwd] == "backward:aten.ones_like.default"
    assert "fc2:aten.mm.default" in names[bwd:opt]   # backward of fc2 carries its module
    assert all(n.startswith("optimizer:") for n in names[opt:])


def test_views_share_a_variable_and_have_no_uses(mlp_adam):
    seq = mlp_adam
    views = [f for f in seq.functions if f.name.endswith((":aten.view.default", ":aten.t.default",
                                                          ":aten.detach.default"))]
    assert views and all(f.uses == () for f in views)
    assert not any("aten.view" in v.name or "aten.t." in v.name for v in seq.variables.values())
    # fc2's forward addmm reads the weight through a t() view: that is the parameter itself.
    w = next(v.id for v in seq.variables.values() if v.name == "fc2.weight")
    addmm = next(f for f in seq.functions if f.name == "fc2:aten.addmm.default")
    assert w in addmm.var_ids
    # The model's x.view(...) reads the input's storage.
    x = next(v.id for v in seq.variables.values() if v.name == "input")
    first = next(f for f in seq.functions if f.name == "fc1:aten.addmm.default")
    assert x in first.var_ids


def test_inplace_ops_read_and_write_the_same_variable():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    seq = ooc.trace(model, torch.randn(3, 4), torch.tensor([0, 1, 1]), device="meta")
    relu = next(f for f in seq.functions if f.name == "1:aten.relu_.default")
    assert len(relu.var_ids) == 1
    assert [u.access for u in relu.uses] == [Access.READ, Access.WRITE]
    v = seq.variables[relu.var_ids[0]]
    assert v.name.startswith("0:aten.addmm.default#") and v.kind is Kind.ACTIVATION


def test_storages_are_not_confused_after_free():
    """Many short-lived temporaries of one size: each is its own variable even though the
    allocator hands out the same addresses again."""
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(50):
                x = (x * 1.01).tanh()
            return x * self.w

    seq = ooc.trace(Chain(), torch.randn(8, 64), loss_fn=lambda out: out.sum(), device="cpu")
    temps = [v for v in seq.variables.values() if v.name.startswith("model:aten.mul.Tensor#")
             and seq.first_use[v.id] < seq.meta["loss_start"]]
    assert len(temps) == 51  # 50 in the loop, one for "* self.w"
    for v in temps:  # each written once, read by the next op: no aliasing across frees
        assert len([f for f in seq.functions if v.id in f.var_ids and
                    any(u.var == v.id and u.access is Access.WRITE for u in f.uses)]) == 1


def test_external_storages_are_inputs():
    const = torch.full((4,), 2.0)

    class UsesConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * const  # a tensor that is neither parameter, buffer nor input

    seq = ooc.trace(UsesConstant(), torch.randn(2, 4), loss_fn=lambda o: o.sum(), device="cpu")
    ext = [v for v in seq.variables.values() if v.name.startswith("external#")]
    assert len(ext) == 1 and ext[0].kind is Kind.INPUT and ext[0].live_in and ext[0].nbytes == 16


# -- the caller's objects are untouched ---------------------------------------------------------


def test_real_trace_leaves_model_optimizer_and_rng_untouched():
    torch.manual_seed(1)
    model = models.tiny_transformer()  # has dropout: uses the RNG
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = models.example_batch("tiny_transformer", 2)
    loss = models.loss_fn("tiny_transformer")
    loss(model(x), y).backward()
    opt.step()  # now there is optimizer state, and grads are still set
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    before_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    rng = torch.get_rng_state()

    seq = ooc.trace(model, x, y, loss_fn=loss, optimizer=opt, measure=True)

    assert seq.meta["device"] == "cpu" and seq.meta["optimizer"] == "Adam"
    assert all(f.cost.seconds is not None and f.cost.seconds >= 0 for f in seq.functions)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before_grads[n]), n
    after = opt.state_dict()["state"]
    for i, s in before_opt.items():
        for k, v in s.items():
            assert torch.equal(after[i][k], v), (i, k)


def test_meta_trace_does_not_move_or_change_the_model():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    x, y = _mlp_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seq = ooc.trace(model, x, y, optimizer=opt, device="meta")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}
    assert sum(v.kind is Kind.OPTIMIZER_STATE for v in seq.variables.values()) == 4


def test_optimizer_factory_and_foreach_choice_are_kept():
    x, y = _mlp_batch()
    per_param = ooc.trace(MLP(), x, y, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                            foreach=False))
    fused = ooc.trace(MLP(), x, y, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                        foreach=True))
    opt_ops = lambda s: [f.name for f in s.functions[s.meta["optimizer_start"]:]]  # noqa: E731
    assert not any("_foreach" in n for n in opt_ops(per_param))
    assert any("_foreach" in n for n in opt_ops(fused))


# -- memory plausibility -------------------------------------------------------------------------


def test_in_core_peak_is_plausible():
    model = models.small_cnn(width=8)
    x, y = models.example_batch("small_cnn", 4, image_size=32)
    seq = ooc.trace(model, x, y, optimizer="adam", device="cpu")
    info = summary(seq)
    rows = info["variables"]
    bwd = seq.meta["backward_start"]
    # Parameters, optimizer state, the batch and every activation the backward will read
    # must all exist together when the backward starts.
    saved = sum(v.nbytes for v in seq.variables.values()
                if v.kind is Kind.ACTIVATION and seq.last_use[v.id] >= bwd)
    floor = rows["param"]["bytes"] + rows["optimizer_state"]["bytes"] + rows["input"]["bytes"] + saved
    assert seq.in_core_peak_bytes >= floor
    # ... and the peak is not much more: at most all grads plus a few activation-sized temporaries.
    biggest = max(v.nbytes for v in seq.variables.values() if v.kind in (Kind.ACTIVATION, Kind.TEMPORARY))
    assert seq.in_core_peak_bytes <= floor + rows["grad"]["bytes"] + 4 * biggest
    # Activations are a large share of an image CNN's step.
    assert saved > rows["param"]["bytes"]


# -- errors, options, entry points ----------------------------------------------------------------


def test_data_dependent_model_fails_clearly_on_meta():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x)
            return out * 2 if out.sum().item() > 0 else out

    with pytest.raises(TraceError, match="device='cpu'"):
        ooc.trace(Gate(), torch.randn(3, 4), torch.tensor([0, 1, 0]), device="meta")
    seq = ooc.trace(Gate(), torch.randn(3, 4), torch.tensor([0, 1, 0]), device="cpu")
    assert len(seq.functions) > 0


def test_non_scalar_loss_and_bad_optimizer():
    x, y = _mlp_batch()
    with pytest.raises(TraceError, match="scalar"):
        ooc.trace(MLP(), x, loss_fn=lambda out: out, device="meta")
    with pytest.raises(TraceError, match="unknown optimizer"):
        ooc.trace(MLP(), x, y, optimizer="lbfgs2", device="meta")
    other = nn.Linear(2, 2)
    with pytest.raises(TraceError, match="not a parameter"):
        ooc.trace(MLP(), x, y, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    with torch.device("meta"):
        on_meta = MLP()
    with pytest.raises(TraceError, match="materialize"):
        ooc.trace(on_meta, x, y, device="cpu")


def test_trace_is_callable_after_importing_the_module():
    import ooc.trace as module

    x, y = _mlp_batch()
    assert callable(module) and callable(ooc.trace)
    assert isinstance(ooc.trace(MLP(), x, y, device="meta"), VariableSequence)


def test_progress_bar_and_json_roundtrip(tmp_path, capsys):
    x, y = _mlp_batch()
    seq = ooc.trace(MLP(), x, y, device="meta", progress=True)
    path = tmp_path / "mlp.json"
    seq.to_json(path)
    back = VariableSequence.from_json(path)
    assert _shape(back) == _shape(seq)


def test_recorder_can_be_used_directly():
    w = torch.randn(4, 4, requires_grad=True)
    rec = Recorder()
    rec.register(w, Kind.PARAM, "w", live_out=True)
    with rec, rec.saved_tensors_hooks():
        rec.phase("forward")
        loss = (torch.randn(2, 4) @ w).tanh().sum()
        rec.phase("backward")
        loss.backward()
    rec.mark(w.grad, Kind.GRAD, "w.grad")
    seq = rec.sequence({"model": "direct"})
    kinds = {v.name: v.kind for v in seq.variables.values()}
    assert kinds["w"] is Kind.PARAM and kinds["w.grad"] is Kind.GRAD
    assert Kind.ACTIVATION in kinds.values()
    assert seq.meta["backward_start"] > 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_recorder_sees_what_the_program_held_past_its_last_use(device):
    """A storage held by a name after its last use is ``held_to`` the last function recorded
    before it died, one still held when the recording ends to the last function; one that
    died at its last use has none (eager lifetimes hold). On ``meta`` as on the CPU."""
    x = torch.randn(4, 4, device=device)
    rec = Recorder()
    rec.register(x, Kind.INPUT, "x")
    with rec:
        a = x.exp()      # f0
        b = a * 2        # f1: a's last use
        c = b.sum()      # f2: b's last use
        d = x + 1        # f3
        del a            # a dies here, after f3
        e = (d * 3).neg_()   # f4, f5: the product dies at its last use
    seq = rec.sequence()
    held = {v.name: v.held_to for v in seq.variables.values() if not v.live_in}
    assert held == {"aten.exp.default#0": 3, "aten.mul.Tensor#1": 5, "aten.sum.default#2": 5,
                    "aten.add.Tensor#3": 5, "aten.mul.Tensor#4": None}, held
    # a (64 B) after f1 to f3, b (64 B) and c (4 B) after f2, d (64 B) after f4: beside eager lifetimes
    assert seq.held_after_use_sized(lambda n: n) == (0, 0, 64, 132, 68, 132)
    del b, c, d, e


def test_cli_trace_writes_a_sequence(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["trace", "small_cnn", "--batch", "2", "--width", "8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "in-core peak" in text and "activation" in text
    seq = VariableSequence.from_json(out)
    assert seq.meta["model"] == "small_cnn" and seq.meta["batch"] == 2
    assert {v.kind for v in seq.variables.values()} >= {Kind.PARAM, Kind.GRAD, Kind.ACTIVATION}

    assert main(["trace", "tiny_transformer", "--batch", "2", "--seq-len", "16",
                 "--optimizer", "adam", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["variables"]["optimizer_state"]["count"] > 0 and info["output"] is None


def test_cli_errors_are_one_line(capsys):
    assert main(["trace", "resnet5", "--batch", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "resnet50" in err and "unknown model" in err
    assert main(["trace", "resnet50", "--batch", "2", "--seq-len", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--seq-len" in err
