"""VGG-16, torchvision layout, plus the CIFAR-style variant NNTrainer measured (32x32, b64)."""

from __future__ import annotations

import torch
from torch import nn

_CFG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, features: nn.Sequential, classifier: nn.Module,
                 avgpool: nn.Module) -> None:
        super().__init__()
        self.features = features
        self.avgpool = avgpool
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(num_classes: int = 1000, batch_norm: bool = False, small_input: bool = False) -> VGG:
    """VGG-16 (13 convolutions, 3 fully connected layers).

    ``small_input=False``: torchvision's model for 224x224 images (adaptive 7x7 pooling,
    classifier 25088 -> 4096 -> 4096 -> ``num_classes``, 138 M parameters).
    ``small_input=True``: the CIFAR variant for 32x32 images (NNTrainer's VGG16 benchmark):
    the five poolings leave 512x1x1, and the classifier is one 512 -> ``num_classes`` layer.
    """
    layers: list[nn.Module] = []
    in_ch = 3
    for v in _CFG16:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        layers.append(nn.Conv2d(in_ch, int(v), 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(int(v)))
        layers.append(nn.ReLU(inplace=True))
        in_ch = int(v)
    if small_input:
        avgpool: nn.Module = nn.Identity()
        classifier: nn.Module = nn.Linear(512, num_classes)
    else:
        avgpool = nn.AdaptiveAvgPool2d((7, 7))
        classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(0.5),
            nn.Linear(4096, num_classes))
    model = VGG(nn.Sequential(*layers), classifier, avgpool)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return model
