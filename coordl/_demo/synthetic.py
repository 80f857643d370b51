"""Generators of small ImageNet-like datasets: class folders of JPEGs with a realistic spread of sizes."""

import io
import os

import numpy as np
from PIL import Image


def _jpeg(rng: np.random.Generator, noise: np.ndarray, side_px: int, quality: int) -> bytes:
    """One natural-ish JPEG: smooth colour gradients plus texture noise, ``side_px`` on its longer side.

    The texture is a random window of ``noise`` (standard normal, at least ``side_px`` square) at a
    random strength, which sets how well the image compresses.
    """
    aspect = rng.uniform(0.6, 1.0)
    w, h = (side_px, int(side_px * aspect)) if rng.random() < 0.5 else (int(side_px * aspect), side_px)
    x, y = np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32)[:, None]
    base = np.stack([np.sin(x / rng.uniform(8, 60) + rng.uniform(0, 6)) + np.cos(y / rng.uniform(8, 60))
                     for _ in range(3)], axis=-1)
    top, left = rng.integers(0, noise.shape[0] - h + 1), rng.integers(0, noise.shape[1] - w + 1)
    texture = noise[top:top + h, left:left + w] * np.float32(rng.uniform(10, 40))
    pixels = np.clip(127 + 60 * base + texture, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def make_image_folder(root: str, n_images: int, n_classes: int = 10, mean_side_px: int = 490,
                      seed: int = 0) -> list[str]:
    """Write ``n_images`` JPEGs into ``root/class_XX/img_XXXXXX.jpg`` (ImageFolder layout).

    Image ``i`` goes to class ``i % n_classes``. With the default ``mean_side_px`` files average
    about 100 KB, 90% of them between 25 and 200 KB, as in ImageNet. Deterministic for a given
    seed. Returns the paths written, in index order.
    """
    rng = np.random.default_rng(seed)
    max_side = mean_side_px * 2
    noise = rng.standard_normal((max_side, max_side, 3), dtype=np.float32)
    paths = []
    for i in range(n_images):
        folder = os.path.join(root, f"class_{i % n_classes:02d}")
        os.makedirs(folder, exist_ok=True)
        side = int(np.clip(rng.normal(mean_side_px, mean_side_px * 0.25), mean_side_px // 3, max_side))
        path = os.path.join(folder, f"img_{i:06d}.jpg")
        with open(path, "wb") as f:
            f.write(_jpeg(rng, noise, side, quality=int(rng.integers(80, 95))))
        paths.append(path)
    return paths
