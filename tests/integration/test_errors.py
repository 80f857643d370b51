"""Bad files and bad settings give errors that name the file, index or setting at fault."""

import inspect
import os
import warnings

import pytest
import torch
import torchvision

import coordl
from coordl._cache import setup as cache_setup


TORCH_NAMES = list(inspect.signature(torch.utils.data.DataLoader).parameters)


def _loader(root, num_workers):
    return coordl.DataLoader(torchvision.datasets.ImageFolder(root), batch_size=4, num_workers=num_workers,
                             collate_fn=list, cache_bytes="1MiB")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_jpeg_names_the_file_and_index(fresh_image_root, num_workers, damage):
    dataset = torchvision.datasets.ImageFolder(fresh_image_root)
    index = 5
    path = dataset.samples[index][0]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(b"this is not a jpeg" * 20 if damage == "garbage" else data[: len(data) // 2])
    with _loader(fresh_image_root, num_workers) as loader:
        with pytest.raises(coordl.SampleError, match=rf"cannot decode sample {index} \({path}"):
            list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_missing_file_names_the_file_and_index(fresh_image_root, num_workers):
    dataset = torchvision.datasets.ImageFolder(fresh_image_root)
    path = dataset.samples[7][0]
    with _loader(fresh_image_root, num_workers) as loader:
        os.remove(path)
        with pytest.raises(coordl.SampleError, match=rf"cannot read sample 7 \({path}\): No such file") as raised:
            list(loader)
        assert isinstance(raised.value, FileNotFoundError)  # what torch's DataLoader raises, through its workers too
    with coordl.DataLoader(dataset, cache_bytes=0) as uncached, pytest.raises(OSError):  # the builtin, too
        uncached.dataset[7]


class Rows(torch.utils.data.Dataset):
    """A map-style dataset of no files (as a Hugging Face ``Dataset`` is, to coordl)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index


def test_a_dataset_coordl_cannot_cache_is_named_at_the_line_that_built_the_loader(monkeypatch):
    """The warning names the dataset's class with its module and what would make it cacheable, and points at
    the user's line, not at coordl's (nor ``sys:1``)."""
    monkeypatch.setattr(cache_setup, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built_at = inspect.currentframe().f_lineno + 1
        coordl.DataLoader(Rows(), batch_size=2).close()
    [warning] = [w for w in caught if "cannot cache" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, built_at)
    assert f"coordl cannot cache Rows (from {__name__})" in str(warning.message)
    assert "give it raw_key(i) (the file of item i) and decode_raw(i, raw)" in str(warning.message)


def test_worker_death_is_reported_as_torch_reports_it(image_root):
    class Dies(torchvision.datasets.ImageFolder):
        def __getitem__(self, index):
            os._exit(3)

    with coordl.DataLoader(Dies(image_root), num_workers=1) as loader:
        with pytest.raises(RuntimeError, match="DataLoader worker .* exited unexpectedly"):
            list(loader)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cache_bytes=-1), ValueError, "cache_bytes should be"),
    (dict(cache_bytes="huge"), ValueError, "cache_bytes should be"),
    (dict(cache_bytes="0.5"), ValueError, "but got cache_bytes='0.5': '0.5' is not a whole number of bytes"),
    (dict(cache_bytes="1.5 b"), ValueError, "but got cache_bytes='1.5 b': '1.5 b' is not a whole number of bytes"),
    (dict(cache_verify="mtime"), ValueError, r"cache_verify should be one of \('stat', 'content'\), but got "
                                             r"cache_verify='mtime'"),
    (dict(cache_dir_verify="crc"), ValueError, r"cache_dir_verify should be one of \('checksum', 'none'\), but got "
                                                r"cache_dir_verify='crc'"),
    (dict(cache_name=""), ValueError, "cache_name should be"),
    (dict(locality_aware="yes"), ValueError, "locality_aware should be True or False, but got locality_aware='yes'"),
    (dict(locality_aware=1), ValueError, "locality_aware should be True or False, but got locality_aware=1"),
    (dict(batch_size=0), ValueError, "batch_size"),  # torch's own checks still apply
    (dict(cache_byte=2**20), TypeError, r"unexpected keyword argument 'cache_byte'; did you mean 'cache_bytes'\?"),
    (dict(num_worker=2), TypeError, r"unexpected keyword argument 'num_worker'; did you mean 'num_workers'\?"),
    (dict(zzz=1), TypeError, r"DataLoader.__init__\(\) got an unexpected keyword argument 'zzz'$"),
])
def test_bad_settings_are_refused(image_root, kwargs, error, match):
    with pytest.raises(error, match=match):
        coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), **kwargs)


def test_the_loaders_signature_is_still_torchs_with_coordls_options():
    names = list(inspect.signature(coordl.DataLoader).parameters)  # what Lightning reads to rebuild a loader
    assert names[:len(TORCH_NAMES)] == TORCH_NAMES and "cache_bytes" in names and "kwargs" not in names


def test_bad_log_level_names_the_variable(monkeypatch, image_root):
    monkeypatch.setenv("COORDL_LOG_LEVEL", "LOUD")
    monkeypatch.setattr("coordl._core.log._configured", False)
    with pytest.raises(ValueError, match="COORDL_LOG_LEVEL='LOUD' is not a logging level"):
        coordl.DataLoader(torchvision.datasets.ImageFolder(image_root))
