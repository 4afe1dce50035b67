"""Activations written in place after they are born: bitwise identical to in-core training.

torchvision's ResNet ends each block with ``out += identity; relu_(out)``: the block's last
BatchNorm output is written twice in place before autograd saves it (ReLU saves its result,
the next convolution its input). A planned step manages that storage from its birth, so the
plan may write it out and read a copy back in between (the downsample branch runs there),
while the forward keeps writing into the storage it still holds. With the early layers
frozen only the small later activations are saved, so a budget of a few chunks is feasible
and that is where the pressure falls (issue 16, item 2).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ooc.engine import Options, OutOfCore


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: the downsample runs after conv2/bn2, then the in-place
    add and the in-place ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` (stem conv7x7/2, BN, in-place ReLU, maxpool 3/2; four
    stages of two BasicBlocks, 64-512 channels; average pool; fc), with its initialisation."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], 64
        for i, c in enumerate((64, 128, 256, 512)):
            stages.append(nn.Sequential(BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c)))
            cin = c
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _frozen_resnet18() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ResNet18()
    for module in (model.conv1, model.bn1, model.layer1, model.layer2):
        module.requires_grad_(False)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 96, 96, generator=g), torch.randint(0, 10, (8,), generator=g)


def test_frozen_resnet18_with_inplace_relu_is_bitwise_identical() -> None:
    """1 MiB budget, 128 KiB chunks (the issue had 16x96x96 at 2 MiB / 256 KiB: the same plan
    shape at half the batch). Before the fix the first planned step's gradients of layer3.0
    were computed from layer3.0's output as it was before ``out += identity; relu_``."""
    steps = 3
    ref, ref_opt = _frozen_resnet18()
    model, opt = _frozen_resnet18()
    engine = OutOfCore(model, opt, budget="1MiB", options=Options(chunk="128KiB"))
    diverged = []
    for step in range(steps):
        x, y = _batch(step)
        loss_ref = F.cross_entropy(ref(x), y)
        loss_ref.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        plan = engine._plans.schedule
        with engine.step():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            engine.optimizer_step()
        assert torch.equal(loss_ref, loss.detach()), f"loss of step {step} differs"
        for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), f"{name} differs after step {step}"
        if plan is not None:
            diverged.append((engine.stats()["last_diverged_at"], plan.sequence.meta["optimizer_start"]))
    stats = engine.stats()
    engine.close()
    assert stats["bytes_out"] > 0 and stats["bytes_in"] > 0, "the budget must force swaps"
    # The plan knows the in-place writes (else it drops the written bytes and the step diverges
    # in its backward): a planned step diverges, if at all, only in the optimizer, where SGD's
    # momentum buffers appear in the first planned step.
    for at, optimizer_start in diverged:
        assert at == -1 or at >= optimizer_start, f"diverged at op {at}, before the optimizer"
    assert stats["last_planned"] and stats["last_diverged_at"] == -1
