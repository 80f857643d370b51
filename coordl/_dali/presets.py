"""DALI graphs for the paper's three tasks, fed with encoded bytes and targets by coordl.

A preset (or a user's own pipeline function) has the signature::

    def pipeline(encoded, target, *, device: str, train: bool) -> tuple[DataNode, ...]

``encoded`` holds one sample's raw file bytes (uint8, 1-D); ``target`` is the sample's label (int64
scalar), or a ``(boxes, labels)`` pair for detection datasets (float32 ``[n, 4]`` boxes, relative
``[x0, y0, x1, y1]``, and int32 ``[n]`` labels). ``device`` is ``"cpu"`` or ``"gpu"``: decoding
runs on the GPU ("mixed") for ``"gpu"``. What the function returns is what each batch yields.
DALI's random operators draw afresh on every run, so each epoch gets new augmentation.
"""

from nvidia.dali import fn, types

IMAGENET_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
IMAGENET_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def _decoder_device(device: str) -> str:
    return "mixed" if device == "gpu" else "cpu"


def _normalize(images, mirror=None, crop=None):
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=IMAGENET_MEAN,
                                    std=IMAGENET_STD, mirror=mirror if mirror is not None else 0,
                                    crop=crop)


def image_classification(encoded, target, *, device: str, train: bool, size: int = 224,
                         hw_decoder_load: float | None = None):
    """ImageNet-style classification: yields (images float32 NCHW normalized, labels int64).

    Train: random-resized-crop to ``size`` (torchvision's defaults: scale 0.08–1, ratio 3/4–4/3),
    random horizontal flip, normalize. Eval: resize the shorter side to ``size * 8 / 7`` (256 for
    224), center crop ``size``, normalize. ``hw_decoder_load``: on the GPU, the share of the JPEGs given to
    the GPU's hardware JPEG decoder where it has one (A100, H100), the rest decoded on its cores; ``None``
    keeps DALI's default (0.65). Bind it with ``functools.partial(image_classification, hw_decoder_load=1.0)``.
    """
    decoder = dict(device=_decoder_device(device), output_type=types.RGB)
    if hw_decoder_load is not None:  # the CPU decoder ignores it
        decoder["hw_decoder_load"] = hw_decoder_load
    if train:
        images = fn.decoders.image_random_crop(encoded, **decoder, random_area=[0.08, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        images = fn.resize(images, size=[size, size])
        images = _normalize(images, mirror=fn.random.coin_flip(probability=0.5))
    else:
        images = fn.decoders.image(encoded, **decoder)
        images = fn.resize(images, resize_shorter=round(size * 8 / 7))
        images = _normalize(images, crop=(size, size))
    return images, target


def object_detection(encoded, target, *, device: str, train: bool, size: int = 300):
    """SSD-style detection: yields (images float32 NCHW, boxes float32 [n, 4] relative xyXY, labels).

    Train: a bounding-box-aware random crop (boxes cut to the crop, boxes whose centre falls
    outside dropped), horizontal flip of image and boxes together, resize to ``size``x``size``, color
    twist (brightness, contrast, saturation, hue), normalize. Eval: resize and normalize only.
    Boxes and labels have a different length per image, so they come as lists of tensors.
    """
    boxes, labels = target
    if train:
        anchor, shape, boxes, labels = fn.random_bbox_crop(
            boxes, labels, bbox_layout="xyXY", aspect_ratio=[0.5, 2.0], thresholds=[0.0, 0.1, 0.3, 0.5, 0.7, 0.9],
            scaling=[0.3, 1.0], allow_no_crop=True, num_attempts=50)
        images = fn.decoders.image_slice(encoded, anchor, shape, device=_decoder_device(device),
                                         output_type=types.RGB)
        flip = fn.random.coin_flip(probability=0.5)
        boxes = fn.bb_flip(boxes, ltrb=True, horizontal=flip)
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.color_twist(images, brightness=fn.random.uniform(range=[0.875, 1.125]),
                                contrast=fn.random.uniform(range=[0.5, 1.5]),
                                saturation=fn.random.uniform(range=[0.5, 1.5]),
                                hue=fn.random.uniform(range=[-18.0, 18.0]))
        images = _normalize(images, mirror=flip)
    else:
        images = fn.decoders.image(encoded, device=_decoder_device(device), output_type=types.RGB)
        images = _normalize(fn.resize(images, resize_x=size, resize_y=size))
    return images, boxes, fn.cast(labels, dtype=types.INT64)


def audio_classification(encoded, target, *, device: str, train: bool, sample_rate: int = 8000,
                         seconds: float = 1.0):
    """Audio classification: yields (waveforms float32 [batch, sample_rate * seconds], labels int64).

    Decodes WAV/FLAC/OGG, downmixes to mono, resamples to ``sample_rate``, then keeps the first
    ``seconds`` (zero-padded when shorter). Decoding runs on the CPU; with ``device="gpu"`` the
    waveforms are moved to the GPU.
    """
    audio, _ = fn.decoders.audio(encoded, dtype=types.FLOAT, downmix=True, sample_rate=sample_rate)
    audio = fn.slice(audio, start=[0], shape=[round(sample_rate * seconds)], axes=[0],
                     out_of_bounds_policy="pad")
    return (audio.gpu() if device == "gpu" else audio), target


PRESETS = {"image_classification": image_classification, "object_detection": object_detection,
           "audio_classification": audio_classification}
"""Preset name → pipeline function."""
