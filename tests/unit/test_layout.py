"""The package's layout keeps its promises (docs/architecture.md, Layout): the data path never imports the
analyzer, one module reads the environment, and ``_core`` depends on no feature."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "coordl"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (at any depth of its code), as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_layout_is_what_the_tests_look_at():
    assert len(MODULES) > 40 and (PACKAGE / "_core" / "settings.py") in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_only_the_analyzer_and_its_command_import_the_analyzer(path):
    if _name(path).startswith("coordl.analyzer") or _name(path) == "coordl.cli":
        return
    assert not {m for m in _imports(path) if m.startswith("coordl.analyzer")}


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_only_the_settings_module_reads_the_environment(path):
    if _name(path) == "coordl._core.settings":
        return
    source = path.read_text()
    assert "os.environ" not in source and "getenv" not in source


@pytest.mark.parametrize("path", sorted((PACKAGE / "_core").glob("*.py")), ids=_name)
def test_the_core_depends_on_no_feature(path):
    assert {m for m in _imports(path) if m.startswith("coordl.") and not m.startswith("coordl._core")} <= \
        {"coordl.exceptions"}
