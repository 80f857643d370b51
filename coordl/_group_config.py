"""The ``hp_group`` keywords of ``coordl.DataLoader``: validation, defaults, and what members must agree on."""

import hashlib
import logging
import re

import torch.utils.data

from coordl._constants import AUTO_STAGING_BYTES, AUTO_STAGING_FRACTION
from coordl._shm import free_shm_bytes
from coordl._sizes import format_bytes, parse_bytes
from coordl._sysinfo import available_memory_bytes
from coordl.cached_dataset import CachedDataset
from coordl.raw_datasets import fingerprint_files

logger = logging.getLogger(__name__)

ON_MISMATCH = ("raise", "uncoordinated")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def check_group_options(hp_group, hp_group_size, hp_staging_bytes, hp_group_timeout_s,
                        hp_group_on_mismatch) -> int | None:
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
    accepted = "a positive int, a size string such as '2GiB', or 'auto'"
    if isinstance(hp_staging_bytes, str) and hp_staging_bytes.strip().lower() == "auto":
        return None
    try:
        size = parse_bytes(hp_staging_bytes) if isinstance(hp_staging_bytes, str) else hp_staging_bytes
    except ValueError:
        size = None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"hp_staging_bytes should be {accepted}, but got hp_staging_bytes={hp_staging_bytes!r}")
    return size


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


def _describe(obj) -> str:
    """A process-independent description of ``obj``: a function's name and code digest, else its repr
    without memory addresses."""
    if hasattr(obj, "__qualname__"):
        code = getattr(obj, "__code__", None)
        digest = f" (code {hashlib.sha256(code.co_code).hexdigest()[:8]})" if code is not None else ""
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}{digest}"
    return _ADDRESS.sub("", repr(obj))


def group_settings(dataset: CachedDataset, *, batch_size: int, drop_last: bool, shuffle: bool, seed: int | None,
                   collate_fn, dali=None) -> dict[str, str]:
    """What every member of a group must share: ``{setting: description}``.

    The dataset is identified by its type, length and, for datasets of files, the fingerprint of its
    files (paths, sizes, mtimes); transforms by their repr; with the DALI backend (``dali``, the
    loader's ``DaliBackend``), its pipeline function's code, device and mode stand for ``collate_fn``.
    """
    user = dataset.dataset
    if dataset.fingerprint is None and dataset.source is not None:
        dataset.fingerprint = fingerprint_files([dataset.source.raw_key(i) for i in range(len(dataset.source))])
    files = f", files {dataset.fingerprint[0].hex()[:16]}" if dataset.fingerprint is not None else ""
    transforms = [f"{name}={_describe(getattr(user, name))}" for name in ("transform", "target_transform",
                                                                           "transforms")
                  if getattr(user, name, None) is not None]
    return {
        "dataset": f"{type(user).__module__}.{type(user).__qualname__} of {len(user)} samples{files}",
        "transforms": ", ".join(transforms) or "none",
        "batch_size": str(batch_size),
        "drop_last": str(drop_last),
        "sampler": "shuffled" if shuffle else "sequential",
        "seed": "drawn by the group" if seed is None else str(seed),
        **({"collate_fn": _describe(collate_fn)} if dali is None else
           {"dali_pipeline": f"{_describe(dali.pipeline_fn)} on {dali.device}, {'train' if dali.train else 'eval'}"}),
    }
