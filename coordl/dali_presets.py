"""The DALI backend's presets (``dali_pipeline=``), to use as they are or with arguments of their own, e.g.
``functools.partial(dali_presets.image_classification, hw_decoder_load=1.0)``. They live in
``coordl._dali.presets``."""

from coordl._dali.presets import PRESETS, audio_classification, image_classification, object_detection

__all__ = ["PRESETS", "audio_classification", "image_classification", "object_detection"]
