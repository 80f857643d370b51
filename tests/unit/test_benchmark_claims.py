"""docs/benchmarks.md quotes only figures whose run measured the code on this checkout, or says that one has
drifted; and ``benchmarks.drift`` tells which (see its docstring)."""

import json
import os
import re

import pytest

from benchmarks import drift

DOC = os.path.join(drift.ROOT, "docs", "benchmarks.md")


def _sections() -> list[str]:
    with open(DOC) as f:
        return re.split(r"\n(?=#{2,3} )", f.read())


def _section_of(folder: str) -> str:
    quoting = [s for s in _sections() if re.search(rf"\*\*Results\*\* `{re.escape(folder)}`", s)]
    assert len(quoting) == 1, f"{folder}: {len(quoting)} sections of docs/benchmarks.md give it as their results"
    return quoting[0]


@pytest.fixture(scope="module")
def current():
    return drift.source_digests()


# -- the repository's own claims --------------------------------------------------------------------

@pytest.mark.parametrize("claim", drift.CLAIMS, ids=lambda c: c.folder)
def test_each_claim_has_its_folder_and_a_run_sh_calling_a_module_of_the_project(claim):
    with open(os.path.join(drift.ROOT, claim.folder, "run.sh")) as f:
        script = f.read()
    assert re.search(r"python3? (-m benchmarks\.\w+|tools/\w+\.py)", script), script
    for path in claim.measures:
        assert os.path.exists(os.path.join(drift.ROOT, path.lstrip("!"))), f"{claim.folder} measures {path}"


@pytest.mark.parametrize("claim", drift.CLAIMS, ids=lambda c: c.folder)
def test_the_docs_call_a_figure_current_only_while_its_run_measured_this_code(claim, current):
    section = _section_of(claim.folder)
    changed = drift.drift(claim, current)
    marked = "**Drifted**" in section
    if changed == []:
        assert not marked, f"{claim.folder} is current (python -m benchmarks.drift) but its section says drifted"
    else:
        assert marked, (f"{claim.folder} has drifted ({changed or 'its run recorded no digests'}): rerun "
                        f"{claim.folder}/run.sh and quote the new figures, or mark its section **Drifted**")
    shas = {run["git_sha"][:7] for run in drift.recorded_provenances(os.path.join(drift.ROOT, claim.folder))
            if run and run.get("git_sha")}
    quoted = set(re.findall(r"\*\*Commit\*\* `?([0-9a-f]{7})", section))
    assert quoted and quoted <= shas, f"{claim.folder}: the section quotes {quoted}, its runs were at {shas}"


def test_every_results_folder_the_docs_name_is_a_claim():
    with open(DOC) as f:
        named = set(re.findall(r"results/[\w.-]+", f.read()))
    folders = {c.folder for c in drift.CLAIMS}
    assert named <= folders, f"not claims: {sorted(named - folders)}"
    on_disk = {f"results/{d}" for d in os.listdir(os.path.join(drift.ROOT, "results"))
               if os.path.isdir(os.path.join(drift.ROOT, "results", d))}
    assert on_disk == folders, f"results/ holds {sorted(on_disk - folders)}; claims lack {sorted(folders - on_disk)}"


# -- what the check sees ---------------------------------------------------------------------------

def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_a_digest_ignores_comments_docstrings_and_layout_but_not_code(tmp_path):
    path = tmp_path / "m.py"
    _write(path, 'N = 1\n\n\ndef f(x):\n    return x + N\n')
    before = drift.code_digest(str(path))
    _write(path, '"""A module."""\n\nN = 1\n"""What N is."""\n\n\ndef f(x):  # adds N\n    """N more."""\n\n'
                 '    return x + N\n')
    assert drift.code_digest(str(path)) == before
    _write(path, 'N = 1\n\n\ndef f(x):\n    return x + N + 0\n')
    assert drift.code_digest(str(path)) != before
    _write(path, 'N = 1\n\n\ndef f(x):\n    return "x + N"\n')  # a string that is a value stays
    assert drift.code_digest(str(path)) != before


def test_a_digest_leaves_out_fields_a_python_version_adds_empty():
    plain = drift._canonical(drift.ast.parse("def f(x): return x"))
    assert "type_params" not in plain and "decorator_list" not in plain and "returns" not in plain


def test_a_claim_drifts_on_a_changed_or_removed_file_under_its_paths_not_on_a_new_one(tmp_path):
    for name in ("coordl/a.py", "coordl/analyzer/b.py", "benchmarks/x.py"):
        _write(tmp_path / name, f"NAME = {name!r}\n")
    claim = drift.Claim("results/x", ("coordl/", "!coordl/analyzer/", "benchmarks/x.py"))
    recorded = drift.source_digests(str(tmp_path))
    _write(tmp_path / "results/x/setup.json", json.dumps({"provenance": {"git_sha": "0" * 40, "sources": recorded}}))
    assert drift.drift(claim, recorded, str(tmp_path)) == []
    _write(tmp_path / "coordl/analyzer/b.py", "NAME = 'changed'\n")  # excluded
    assert drift.drift(claim, drift.source_digests(str(tmp_path)), str(tmp_path)) == []
    _write(tmp_path / "coordl/new.py", "NEW = 1\n")  # the run could not use it; code that does now has changed
    assert drift.drift(claim, drift.source_digests(str(tmp_path)), str(tmp_path)) == []
    _write(tmp_path / "coordl/a.py", "from coordl.new import NEW\n")
    os.remove(tmp_path / "benchmarks/x.py")
    assert drift.drift(claim, drift.source_digests(str(tmp_path)), str(tmp_path)) == ["benchmarks/x.py",
                                                                                       "coordl/a.py"]


def test_a_runs_provenance_is_the_one_under_its_provenance_key(tmp_path):
    run = {"settings": {"git_sha": "a" * 40}, "provenance": {"git_sha": "b" * 40, "sources": {}}}
    assert drift._find_provenance(run)["git_sha"] == "b" * 40
    assert drift._find_provenance({"runs": [{"setup": {"git_sha": "c" * 40, "sources": {}}}]})["git_sha"] == "c" * 40
    assert drift._find_provenance({"runs": []}) is None


def test_a_claim_with_a_run_that_recorded_no_digests_cannot_be_current(tmp_path):
    _write(tmp_path / "coordl/a.py", "A = 1\n")
    current = drift.source_digests(str(tmp_path))
    claim = drift.Claim("results/x", ("coordl/",))
    _write(tmp_path / "results/x/one/results.json", json.dumps({"setup": {"provenance": {
        "git_sha": "1" * 40, "sources": current}}}))
    assert drift.drift(claim, current, str(tmp_path)) == []
    _write(tmp_path / "results/x/two/setup.json", json.dumps({"git_sha": "2" * 40}))  # an older run beside it
    assert drift.drift(claim, current, str(tmp_path)) is None
    assert drift.drift(drift.Claim("results/none", ("coordl/",)), current, str(tmp_path)) is None
