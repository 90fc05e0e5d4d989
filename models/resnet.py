"""torchvision's ResNet, randomly initialised (no weights are downloaded).

Re-arranged as stem -> ``blocks`` (the four residual stages) -> head so that the framework can
wrap each stage (activation checkpointing, FSDP units) the same way as a transformer's blocks.
"""

from __future__ import annotations

import torch
from torch import nn


class ResNet(nn.Module):
    task = "classify"
    trains_on = ("images",)
    blocks_path = "blocks"

    def __init__(self, arch: str = "resnet18", num_classes: int = 10, small_input: bool = True):
        super().__init__()
        import torchvision  # here, not at import: a gpt run never pays for its start-up time and memory

        builder = getattr(torchvision.models, arch)
        net = builder(weights=None, num_classes=num_classes)
        if small_input:
            # CIFAR-style stem: a 7x7 stride-2 conv and a max-pool would shrink 32x32 inputs to 8x8
            net.conv1 = nn.Conv2d(3, net.conv1.out_channels, 3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.blocks = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4])
        self.pool = net.avgpool
        self.head = net.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(self.pool(x), 1))
