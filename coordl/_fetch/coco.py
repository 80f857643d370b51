"""COCO-style detection dataset read from its annotation JSON, cacheable by coordl (no pycocotools)."""

import json
import os
from collections import defaultdict
from collections.abc import Callable
import numpy as np

from coordl._fetch.raw_datasets import FileDataset


class CocoDetection(FileDataset):
    """Images of a COCO-style annotation file, one file per sample.

    Items are ``(image, annotations)`` as torchvision's ``CocoDetection`` gives them: an RGB PIL
    image (after ``transform``) and the list of the image's annotation dicts. For the DALI
    backend, :meth:`dali_target` gives the boxes (relative ``[x0, y0, x1, y1]``) and labels.

    Args:
        root: folder that ``file_name`` entries are relative to.
        ann_file: the annotation JSON (``images``, ``annotations`` with ``bbox`` as
            ``[x, y, width, height]`` in pixels, ``category_id``).
        transform: applied to the PIL image. Defaults to None.
        target_transform: applied to the annotation list. Defaults to None.
    """

    def __init__(self, root: str, ann_file: str, transform: Callable | None = None,
                 target_transform: Callable | None = None):
        try:
            with open(ann_file) as f:
                coco = json.load(f)
            images = sorted(coco["images"], key=lambda im: im["id"])
            by_image = defaultdict(list)
            for ann in coco.get("annotations", []):
                by_image[ann["image_id"]].append(ann)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read COCO annotations from {ann_file}: {e!r}") from e
        self.root = root
        self.images = images
        self.annotations = [by_image[im["id"]] for im in images]
        super().__init__([os.path.join(root, im["file_name"]) for im in images], self.annotations, "image",
                         transform, target_transform)

    def dali_target(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(boxes float32 [n, 4] relative x0 y0 x1 y1 clipped to the image, labels int32 [n]); crowd
        regions are left out."""
        info = self.images[index]
        width, height = float(info["width"]), float(info["height"])
        anns = [a for a in self.annotations[index] if not a.get("iscrowd", 0)]
        boxes = np.array([a["bbox"] for a in anns], dtype=np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes /= np.array([width, height, width, height], dtype=np.float32)
        return np.clip(boxes, 0.0, 1.0), np.array([a["category_id"] for a in anns], dtype=np.int32)
