"""The ``hp_group`` keywords of ``coordl.DataLoader``: validation, defaults, and what members must agree on."""

import logging

import torch.utils.data

from coordl._core.settings import AUTO_STAGING_BYTES, AUTO_STAGING_FRACTION
from coordl._core.shm import free_shm_bytes
from coordl._core.sizes import format_bytes, parse_size_option
from coordl._core.sysinfo import available_memory_bytes
from coordl._fetch.cached_dataset import CachedDataset
from coordl._fetch.raw_datasets import dataset_identity
from coordl._fetch.storage import FileStorage
from coordl._group.agreement import describe

logger = logging.getLogger(__name__)

ON_MISMATCH = ("raise", "uncoordinated")
_TRANSFORMS = ("transform", "target_transform", "transforms")
"""The dataset attributes that hold its transforms."""


def check_group_options(hp_group, hp_group_size, hp_staging_bytes, hp_group_timeout_s,
                        hp_group_on_mismatch, hp_group_key) -> int | None:
    """Validate the hp_group keywords; return the staging size in bytes, None for ``"auto"``.

    Raises:
        ValueError, TypeError: naming the keyword, the value and what is accepted.
    """
    if not isinstance(hp_group, str) or not hp_group:
        raise ValueError(f"hp_group should be a non-empty string or None, but got hp_group={hp_group!r}")
    if hp_group_size is not None and (isinstance(hp_group_size, bool) or not isinstance(hp_group_size, int)
                                      or hp_group_size < 1):
        raise ValueError(f"hp_group_size should be a positive int or None, but got hp_group_size={hp_group_size!r}")
    if isinstance(hp_group_timeout_s, bool) or not isinstance(hp_group_timeout_s, (int, float)) \
            or not hp_group_timeout_s > 0:
        raise ValueError(f"hp_group_timeout_s should be a positive number of seconds, but got "
                         f"hp_group_timeout_s={hp_group_timeout_s!r}")
    if hp_group_on_mismatch not in ON_MISMATCH:
        raise ValueError(f"hp_group_on_mismatch should be one of {ON_MISMATCH}, but got "
                         f"hp_group_on_mismatch={hp_group_on_mismatch!r}")
    if hp_group_key is not None and (not isinstance(hp_group_key, str) or not hp_group_key):
        raise ValueError(f"hp_group_key should be a non-empty string or None, but got hp_group_key={hp_group_key!r}")
    return parse_size_option("hp_staging_bytes", hp_staging_bytes, allow_zero=False)


def check_group_compatible(dataset, sampler, batch_sampler, batch_size, in_order) -> None:
    """Refuse the DataLoader settings with which the group cannot plan epochs.

    Raises:
        ValueError: naming the setting at fault.
    """
    why = None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        why = "a map-style dataset (it got an IterableDataset)"
    elif sampler is not None or batch_sampler is not None:
        why = "to plan epochs itself: pass shuffle=True or False instead of sampler= / batch_sampler="
    elif batch_size is None:
        why = "batched loading (batch_size=None was given)"
    elif not in_order:
        why = "in_order=True"
    if why:
        raise ValueError(f"hp_group needs {why}")


def auto_staging_bytes() -> int:
    """``hp_staging_bytes="auto"``: the least of 4 GiB, 25% of free /dev/shm and 25% of available memory."""
    shm, memory = free_shm_bytes(), available_memory_bytes()
    size = int(min(AUTO_STAGING_BYTES, AUTO_STAGING_FRACTION * shm, AUTO_STAGING_FRACTION * memory))
    logger.info("Because hp_staging_bytes was not given, using %s: the least of %s, %d%% of free /dev/shm (%s) "
                "and %d%% of available memory (%s).", format_bytes(size), format_bytes(AUTO_STAGING_BYTES),
                AUTO_STAGING_FRACTION * 100, format_bytes(shm), AUTO_STAGING_FRACTION * 100, format_bytes(memory))
    return size


def group_settings(dataset: CachedDataset, *, batch_size: int, drop_last: bool, shuffle: bool, seed: int | None,
                   collate_fn, dali, key: str | None, content: bool) -> dict[str, str]:
    """What every member of a group must share: ``{setting: description}``.

    The dataset is identified by its type, length and, for datasets of files, their identity (see
    :func:`dataset_identity`; ``content`` hashes the files' bytes); its transforms and ``collate_fn``
    by what defines them (see :mod:`coordl._group.agreement`). With the DALI backend (``dali``, the loader's
    ``DaliBackend``) its pipeline function, device and mode stand for ``collate_fn``. ``key``
    (``hp_group_key=``), if given, stands for the transforms, ``collate_fn`` and pipeline function.

    Raises:
        ValueError: if a transform, ``collate_fn`` or the pipeline function cannot be described
            and no ``key`` is given.
    """
    user = dataset.dataset
    if dataset.identity is None and dataset.source is not None:
        dataset.identity = dataset_identity(dataset.source, local=isinstance(getattr(dataset.storage, "inner", dataset.storage), FileStorage),
                                            content=content)
    files = f", files {dataset.identity.hex()[:16]}" if dataset.identity is not None else ""
    settings = {
        "dataset": f"{type(user).__module__}.{type(user).__qualname__} of {len(user)} samples{files}",
        "batch_size": str(batch_size),
        "drop_last": str(drop_last),
        "sampler": "shuffled" if shuffle else "sequential",
        "seed": "drawn by the group" if seed is None else str(seed),
    }
    if key is not None:
        settings["hp_group_key"] = key
    else:
        transforms = [f"{name}={describe(getattr(user, name), name)}" for name in _TRANSFORMS
                      if getattr(user, name, None) is not None]
        settings["transforms"] = ", ".join(transforms) or "none"
    if dali is not None:
        pipeline = "named by hp_group_key" if key is not None else describe(dali.pipeline_fn, "dali_pipeline")
        settings["dali_pipeline"] = f"{pipeline} on {dali.device}, {'train' if dali.train else 'eval'}"
    elif key is None:
        settings["collate_fn"] = describe(collate_fn, "collate_fn")
    return settings
