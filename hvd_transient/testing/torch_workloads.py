"""PyTorch models and data for the PyTorch example and the benchmarks (``workloads`` is the Keras side).

He et al.'s CIFAR ResNets on CIFAR-10-shaped synthetic data (deterministic, no download), the same on
every worker. Imports PyTorch, and no TensorFlow.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A CIFAR ResNet's basic block (two 3x3 convolutions and a shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet(depth: int = 20, num_classes: int = 10, width: int = 16) -> nn.Module:
    """He et al.'s CIFAR ResNet, 6n+2 layers (ResNet-20: n=3, about 0.27 M parameters)."""
    n = (depth - 2) // 6
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage in range(3):
        cout = width * 2 ** stage
        for block in range(n):
            layers.append(Block(cin, cout, 2 if stage > 0 and block == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def small_cnn(num_classes: int = 10) -> nn.Module:
    """A fast stand-in with the same input and output shapes (for tests): the layers of the Keras
    ``small_cnn`` (``workloads.py``), so that a step costs about as much in both frameworks."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, 2), nn.ReLU(), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, num_classes))


# resnet8 (a narrow ResNet-8) was ``small_cnn`` until 2026-12-02: the PyTorch results of 2026-11-27 ran it
MODELS = {"resnet8": lambda: resnet(8, width=8), "resnet20": lambda: resnet(20), "resnet32": lambda: resnet(32),
          "small_cnn": small_cnn}


def synthetic_cifar10(samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10-shaped data (NCHW float images, 10 classes), the same on every worker; no download."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, samples)
    # each class has its own mean image, so the model has something to learn
    means = rng.normal(0, 1, (10, 3, 32, 32)).astype(np.float32)
    images = means[labels] + rng.normal(0, 1, (samples, 3, 32, 32)).astype(np.float32)
    return torch.from_numpy(images), torch.from_numpy(labels)
