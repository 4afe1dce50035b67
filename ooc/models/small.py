"""A small BN-CNN for 64x64 images: the CPU demo model (like DESIGN.md's "5-block BN-CNN")."""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a skip connection (1x1 conv when the shape changes), ReLU."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.skip = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.skip(x)
        return self.relu(out)


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 32, blocks: int = 8,
                 per_stage: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers, ch = [], width
        for i in range(blocks):
            # ``per_stage`` blocks at each resolution; then halve it and widen (up to 8x width).
            stage = i // per_stage
            out = width * 2 ** min(stage, 3)
            layers.append(ConvBlock(ch, out, 2 if i and i % per_stage == 0 else 1))
            ch = out
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def small_cnn(num_classes: int = 10, width: int = 32, blocks: int = 8, per_stage: int = 4) -> SmallCNN:
    """Residual conv-BN-ReLU blocks on 64x64 inputs, ``per_stage`` at each resolution.

    The demo model: activations dominate its memory (as in the CNNs people run out of core),
    and no single op needs more than a small share of the step's peak.
    """
    return SmallCNN(num_classes, width, blocks, per_stage)
