"""U-Net (Ronneberger et al.) with padded convolutions, BatchNorm and transposed-conv upsampling.

The output has the input's height and width (both must be divisible by ``2**depth``): one
class score map per pixel, trained with per-pixel cross-entropy. The skip connections keep
every encoder activation alive until the decoder reaches it, the long-lived pattern that
makes segmentation nets hard to fit.
"""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True))


class Down(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(nn.MaxPool2d(2), DoubleConv(in_ch, out_ch))


class Up(nn.Module):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, in_ch // 2, 2, stride=2)
        self.conv = DoubleConv(in_ch // 2 + out_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 2, base: int = 64,
                 depth: int = 4) -> None:
        super().__init__()
        chans = [base * 2**i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, chans[0])
        self.downs = nn.ModuleList(Down(chans[i], chans[i + 1]) for i in range(depth))
        self.ups = nn.ModuleList(Up(chans[i + 1], chans[i]) for i in reversed(range(depth)))
        self.outc = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


def unet(in_channels: int = 3, num_classes: int = 2, base: int = 64, depth: int = 4) -> UNet:
    """U-Net with ``depth`` poolings and ``base`` channels at full resolution (31 M
    parameters at the defaults)."""
    return UNet(in_channels, num_classes, base, depth)
