"""Images from a local folder, never downloaded; augmentation in the loader or on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision.io import write_png

from framework.config import ConfigError, validate
from framework.data.images import DeviceAugment, ImageFiles
from tests.helpers import compose_config, read_summary, train_cli


def make_image_folder(root: Path, per_class: int = 8, size: int = 20) -> Path:
    g = torch.Generator().manual_seed(0)
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            image = (torch.rand(3, size, size, generator=g) * 128 + 127 * c).to(torch.uint8)
            write_png(image, str(root / name / f"{i}.png"))
    return root


def test_loader_and_device_pipelines_agree_on_shape_and_scale(tmp_path):
    root = make_image_folder(tmp_path / "imgs")
    loader_side = ImageFiles("folder", str(root), 16, augment=False, on_device=False)
    device_side = ImageFiles("folder", str(root), 16, augment=False, on_device=True)
    (a,), label = loader_side[3]
    (raw,), _ = device_side[3]
    assert raw.dtype == torch.uint8 and a.dtype == torch.float32 and a.shape == raw.shape == (3, 16, 16)
    b = DeviceAugment(augment=False, seed=0, device=torch.device("cpu"))(raw[None])[0]
    assert torch.allclose(a, b, atol=1e-5)  # same normalisation either way
    assert int(label) in (0, 1)


def test_device_augmentation_draws_per_sample_and_is_seeded():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8).repeat(8, 1, 1, 1)
    one = DeviceAugment(True, seed=1, device=torch.device("cpu"))(x)
    two = DeviceAugment(True, seed=1, device=torch.device("cpu"))(x)
    assert torch.equal(one, two) and one.shape == x.shape
    assert len({tuple(one[i].flatten()[:5].tolist()) for i in range(0, 16, 2)}) > 1  # not one crop for all


def test_training_on_an_image_folder(tmp_path):
    root = make_image_folder(tmp_path / "imgs")
    run = tmp_path / "run"
    proc = train_cli(["experiment=resnet", "logger=none", "steps=2", "data.source=folder", f"data.root={root}",
                      "data.image_size=16", "data.batch_size=4", "data.num_workers=1"], run)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_summary(run)["status"] == "ok"


@pytest.mark.parametrize("source", ["folder", "cifar10"])
def test_missing_image_root_is_a_clear_error(tmp_path, source):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["experiment=resnet", f"data.source={source}", f"data.root={tmp_path / 'nope'}"]))
    assert err.value.key == "data.root" and "nope" in str(err.value)
    if source == "cifar10":
        with pytest.raises(ConfigError, match="never downloaded"):
            validate(compose_config(["experiment=resnet", "data.source=cifar10", f"data.root={tmp_path}"]))
