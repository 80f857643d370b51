"""What hp_group members must agree on: transforms and functions are told apart by what defines them."""

import functools
import threading

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from torch.utils.data import default_collate

import coordl
from coordl._fetch.cached_dataset import CachedDataset, SampleCounters
from coordl._fetch.storage import FileStorage
from coordl._group.config import check_group_options, group_settings


def _settings(transform=None, collate_fn=default_collate, key=None) -> dict[str, str]:
    dataset = coordl.FileDataset(["a.jpg", "b.jpg"], targets=[0, 1], transform=transform)
    wrapped = CachedDataset(dataset, dataset, None, FileStorage(drop_page_cache=False), SampleCounters(1),
                            identity=bytes(32))
    return group_settings(wrapped, batch_size=2, drop_last=False, shuffle=True, seed=None, collate_fn=collate_fn,
                          dali=None, key=key, content=False)


def _scaled(k):
    return lambda batch: batch * k


def _with_default(k):
    def collate(batch, k=k):
        return batch * k
    return collate


def _with_kwdefault(k):
    def collate(batch, *, k=k):
        return batch * k
    return collate


class Jitter:
    """A transform with the default repr: only its state tells two apart."""

    def __init__(self, strength):
        self.strength = strength

    def __call__(self, x):
        return x + self.strength


class Blur:
    """A transform whose repr hides its parameter."""

    def __init__(self, sigma):
        self.sigma = sigma

    def __call__(self, x):
        return x

    def __repr__(self) -> str:
        return "Blur()"

    def scaled(self, x):
        return x * self.sigma


def _locked():
    lock = threading.Lock()
    return lambda x: (lock, x)


COLLATE_PAIRS = {
    "constants": (lambda b: b * 2, lambda b: b * 3),
    "nested function's constants": (lambda b: list(map(lambda x: x * 2, b)), lambda b: list(map(lambda x: x * 3, b))),
    "defaults": (_with_default(2), _with_default(3)),
    "keyword defaults": (_with_kwdefault(2), _with_kwdefault(3)),
    "closures": (_scaled(2), _scaled(3)),
    "partials of closures": (functools.partial(_scaled(2)), functools.partial(_scaled(3))),
    "bound methods": (Blur(1).scaled, Blur(2).scaled),
}

TRANSFORM_PAIRS = {
    "Lambda": (T.Lambda(lambda x: x * 2), T.Lambda(lambda x: x * 3)),
    "Compose with a Lambda": (T.Compose([T.ToTensor(), T.Lambda(_scaled(2))]),
                              T.Compose([T.ToTensor(), T.Lambda(_scaled(3))])),
    "default repr": (Jitter(0.1), Jitter(0.2)),
    "repr hiding a constant": (Blur(1.0), Blur(1.5)),
}


@pytest.mark.parametrize("what", COLLATE_PAIRS)
def test_collate_functions_that_differ_are_told_apart(what):
    first, second = COLLATE_PAIRS[what]
    assert _settings(collate_fn=first)["collate_fn"] != _settings(collate_fn=second)["collate_fn"]


@pytest.mark.parametrize("what", TRANSFORM_PAIRS)
def test_transforms_that_differ_are_told_apart(what):
    first, second = TRANSFORM_PAIRS[what]
    assert _settings(transform=first)["transforms"] != _settings(transform=second)["transforms"]


def test_transforms_and_functions_built_alike_are_described_alike():
    def imagenet():
        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), T.Lambda(_scaled(2))])

    def imagenet_v2():
        return v2.Compose([v2.RandomResizedCrop(224), v2.ToDtype(torch.float32, scale=True),
                           v2.Normalize([0.5], [0.2])])

    for build in (imagenet, imagenet_v2, lambda: Jitter(0.1), lambda: Blur(torch.tensor([1.0, 2.0]))):
        assert _settings(transform=build())["transforms"] == _settings(transform=build())["transforms"]
    assert _settings(collate_fn=lambda b: b * 2) == _settings(collate_fn=lambda b: b * 2)  # lines do not matter
    assert _settings(collate_fn=_scaled(2)) == _settings(collate_fn=_scaled(2))
    described = _settings(transform=Blur(1.0), collate_fn=_scaled(2))
    assert described["transforms"].startswith("transform=Blur() (sha256 ")
    assert described["collate_fn"].startswith(f"{__name__}._scaled.<locals>.<lambda> (sha256 ")


def test_what_cannot_be_compared_is_refused_naming_the_setting_and_the_way_out():
    with pytest.raises(ValueError, match=r"hp_group cannot compare transform=Compose\(.*: transform\.transforms\[1\]"
                                         r"\.lambd\.<closure lock> is <unlocked _thread\.lock object>, which cannot be "
                                         r"pickled .* Pass hp_group_key="):
        _settings(transform=T.Compose([T.ToTensor(), T.Lambda(_locked())]))
    nested = []
    for _ in range(100):
        nested = [nested]
    with pytest.raises(ValueError, match=r"hp_group cannot compare collate_fn=.*: collate_fn\.args\[0\]\[0\].* "
                                         r"nests deeper than \d+ levels.* Pass hp_group_key="):
        _settings(collate_fn=functools.partial(len, nested))


def test_hp_group_key_stands_for_transforms_and_collate_fn():
    keyed = _settings(transform=T.Lambda(_locked()), collate_fn=_scaled(2), key="sweep-a")
    assert keyed == {**_settings(collate_fn=_scaled(3), key="sweep-a"), "hp_group_key": "sweep-a"}
    assert "transforms" not in keyed and "collate_fn" not in keyed
    compared = ("dataset", "batch_size", "drop_last", "sampler", "seed")
    assert {k: keyed[k] for k in compared} == {k: _settings()[k] for k in compared}
    assert _settings(key="sweep-b")["hp_group_key"] == "sweep-b"


@pytest.mark.parametrize("key", ["", 3])
def test_a_bad_hp_group_key_is_refused(key):
    with pytest.raises(ValueError, match=rf"hp_group_key should be a non-empty string or None, but got "
                                         rf"hp_group_key={key!r}"):
        check_group_options("g", None, "auto", 60, "raise", key)
