"""Image data from disk (torchvision ImageFolder, or CIFAR-10 from a local root: never
downloaded) and augmentation either in the loader's workers or on the training device.

``data.transforms_on=loader``: each worker decodes, crops, flips and normalises one image at a
time with torchvision.transforms.v2 (CPU work per sample). ``device``: workers only decode to
uint8 tensors; the whole batch is then converted, cropped, flipped and normalised on the training
device in a few batched tensor ops, as the article suggests, so the CPU stops being the
bottleneck. Both draw a fresh crop and flip per sample.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def loader_transform(image_size: int, augment: bool, on_device: bool):
    """Per-sample transform run in the loader: full pipeline, or decode-only for `on_device`."""
    from torchvision.transforms import v2

    steps = [v2.ToImage(), v2.Resize((image_size, image_size), antialias=True)]
    if on_device:
        return v2.Compose(steps)  # uint8 (C, H, W): 4x less to move than float32
    if augment:
        steps += [v2.RandomCrop(image_size, padding=4), v2.RandomHorizontalFlip()]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR_MEAN, CIFAR_STD)]
    return v2.Compose(steps)


class DeviceAugment:
    """Batched augmentation on the training device: uint8 -> float, random crop with 4-pixel
    padding and horizontal flip drawn per sample, normalisation. Deterministic from the seed."""

    def __init__(self, augment: bool, seed: int, device: torch.device):
        self.augment = augment
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.mean = torch.tensor(CIFAR_MEAN, device=device)[:, None, None]
        self.std = torch.tensor(CIFAR_STD, device=device)[:, None, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        x = TF.to_dtype(x, torch.float32, scale=True) if x.dtype == torch.uint8 else x
        if self.augment:
            B, _, H, W = x.shape
            g, dev = self.generator, x.device
            flip = torch.rand(B, generator=g, device=dev) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            padded = F.pad(x, (4, 4, 4, 4))
            dy = torch.randint(0, 9, (B,), generator=g, device=dev)
            dx = torch.randint(0, 9, (B,), generator=g, device=dev)
            # one gather for all crops: row/column indices per sample
            rows = (dy[:, None] + torch.arange(H, device=dev))[:, None, :, None].expand(B, x.size(1), H, W + 8)
            x = padded.gather(2, rows)
            cols = (dx[:, None] + torch.arange(W, device=dev))[:, None, None, :].expand(B, x.size(1), H, W)
            x = x.gather(3, cols)
        return (x - self.mean) / self.std


class ImageFiles(Dataset):
    """ImageFolder (root/class_name/*.png|jpg...) or CIFAR-10 (root/cifar-10-batches-py)."""

    def __init__(self, source: str, root: str, image_size: int, augment: bool, on_device: bool):
        import torchvision

        transform = loader_transform(image_size, augment, on_device)
        if source == "cifar10":
            self.data = torchvision.datasets.CIFAR10(root, train=True, download=False, transform=transform)
        else:
            self.data = torchvision.datasets.ImageFolder(root, transform=transform)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        image, label = self.data[i]
        return (image,), torch.tensor(label)

    collate = staticmethod(default_collate)
    tokens_in = staticmethod(lambda batch: None)


def check_image_root(source: str, root: str | None) -> str | None:
    """What is wrong with an image root, or None."""
    if root is None:
        return f"data.source={source} reads images from disk: set data.root"
    if not os.path.isdir(root):
        return f"no folder at {root!r}"
    if source == "cifar10" and not os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
        return f"no CIFAR-10 under {root!r} (expected {root}/cifar-10-batches-py; it is never downloaded)"
    return None
