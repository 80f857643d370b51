"""The JPEG dataset generator: ImageFolder layout, sizes spread around 100 KB, deterministic."""

import os

import numpy as np
from PIL import Image

from coordl._demo.synthetic import make_image_folder


def test_imagenet_like_sizes_in_class_folders(tmp_path):
    paths = make_image_folder(str(tmp_path / "a"), 120, n_classes=4, seed=5)
    assert sorted(os.listdir(tmp_path / "a")) == ["class_00", "class_01", "class_02", "class_03"]
    assert paths[5].endswith(os.path.join("class_01", "img_000005.jpg"))
    sizes = np.array([os.path.getsize(p) for p in paths])
    assert 70_000 < sizes.mean() < 140_000
    low, high = np.percentile(sizes, [5, 95])
    assert low < 0.5 * sizes.mean() and high > 1.5 * sizes.mean()  # a spread, not one size
    with Image.open(paths[0]) as img:
        assert img.format == "JPEG" and img.mode == "RGB"


def test_deterministic_by_seed(tmp_path):
    def contents(name, seed):
        return [open(p, "rb").read() for p in make_image_folder(str(tmp_path / name), 6, mean_side_px=96, seed=seed)]

    assert contents("a", 1) == contents("b", 1)
    assert contents("a", 1) != contents("c", 2)
