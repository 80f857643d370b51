"""``import coordl`` loads no torch until a name needs it, so the commands and modules that need none start fast."""

import subprocess
import sys

import pytest

import coordl

LIGHT = ["coordl", "coordl.cli", "coordl._core.shm", "coordl._peer.wire", "coordl._peer.server", "coordl._cache.minio",
         "coordl._group.membership", "coordl._fetch.storage", "coordl.analyzer.runner"]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_package_the_cli_the_analyze_runner_and_the_shm_cache_and_peer_modules_import_no_torch():
    done = _run(f"import importlib, sys\nfor m in {LIGHT!r}: importlib.import_module(m)\n"
                "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'nvidia')))")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_cache_ls_runs_without_torch():
    done = _run("import sys\nfrom coordl import cli\nstatus = cli.main(['cache', 'ls'])\n"
                "print(status, 'torch' in sys.modules)")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "0 False", done.stderr


def test_every_public_name_and_submodule_resolves_on_first_use():
    done = _run("import coordl, sys\nassert 'torch' not in sys.modules\nloader = coordl.DataLoader\n"
                "print(loader.__module__, 'torch' in sys.modules, coordl._group.membership.__name__)")
    assert done.returncode == 0 and done.stdout.split() == ["coordl.loader", "True", "coordl._group.membership"], done.stderr
    assert all(getattr(coordl, name).__name__ == name for name in coordl.__all__)
    assert set(coordl.__all__) <= set(dir(coordl)) and coordl.__all__ == sorted(coordl.__all__)
    namespace = {}
    exec("from coordl import *", namespace)
    assert {name for name in namespace if not name.startswith("__")} == set(coordl.__all__)


def test_a_name_coordl_does_not_have_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'coordl' has no attribute 'no_such_thing'"):
        coordl.no_such_thing
    assert not hasattr(coordl, "__wrapped__")


@pytest.mark.parametrize("order", ["import coordl, torch", "import torch, coordl"])
def test_coordls_loader_is_a_dataloader_subclass_as_soon_as_torch_is_imported(order):
    """Frameworks look for torch's DataLoader subclasses when they start wrapping them (Lightning as it enters
    ``train_dataloader``): coordl's must be there whichever of the two a script imports first."""
    done = _run(f"{order}\nprint([c.__module__ for c in torch.utils.data.DataLoader.__subclasses__()])")
    assert done.returncode == 0 and "'coordl.loader'" in done.stdout, done.stderr
