"""The repository itself: what a fresh clone gets must work on any machine.

A tracked `.cache` symlink to another machine's work tree once made a fresh clone skip 240 tests silently. These
checks keep the tree portable (no link leaving it, no path of one machine named in a tracked file), keep generated
files out of `git status`, and keep optional suites from skipping unnoticed under CI.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import requirements, transformers_common

ROOT = Path(__file__).resolve().parents[1]

# Absolute paths that belong to one machine: home folders, work trees, mounted volumes (`/tmp/x` in a usage example is
# any machine's, and allowed). Built from parts so that this file does not name one itself.
NAME = r"[A-Za-z0-9_.-]+"
MACHINE_PATH = re.compile(r"(?<![\w.~])(" + "|".join([
    "/" + "home/" + NAME, "/" + "Users/" + NAME, "/" + "mnt/" + NAME, "/" + "root/", "/" + "work/",
    r"[A-Za-z]:\\" + "Users" + r"\\",
]) + ")")

# What `make demo`, `make test`, `make app` and the benchmarks write inside the repository (their defaults), which
# .gitignore must cover. Tests write under pytest's tmp_path.
GENERATED = [
    ".venv/bin/python",                       # make install
    ".cache/transformers-5.0.0/tests/x.py",   # tests/helpers/transformers_common.py
    "outputs/demo/runs/b/final/model.safetensors",  # make demo, make evidence
    "outputs/synthetic/data/videos/v.mp4",
    ".pytest_cache/v/cache/lastfailed",
    "modeling_testa/__pycache__/aggregation.cpython-311.pyc",
    "testa_hf.egg-info/PKG-INFO",             # pip install -e
    "build/lib/x.py",
    "dist/testa_hf-1.0.tar.gz",
    ".gradio/flagged/log.csv",                # gradio's working files (make app)
    "outputs/run/final/model.safetensors",    # train/loop.py default --output-dir
    ".whl/x.whl",                             # wheels carried to a device machine (docs/gpu.md)
]


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def tracked_files(root: Path) -> list[str]:
    return [name for name in git("ls-files", "-z", cwd=root).split("\0") if name]


def links_leaving(root: Path, files: list[str]) -> list[str]:
    """Tracked symbolic links whose target is outside `root` (absolute, or `..` past the top), with their targets."""
    found = []
    top = root.resolve()
    for name in files:
        path = root / name
        if not path.is_symlink():
            continue
        target = os.readlink(path)
        resolved = (path.parent / target).resolve() if not os.path.isabs(target) else Path(target).resolve()
        if os.path.isabs(target) or not resolved.is_relative_to(top):
            found.append(f"{name} -> {target}")
    return found


def machine_paths(root: Path, files: list[str]) -> list[str]:
    """`file:line: path` for every absolute path of one machine named in a tracked text file."""
    found = []
    for name in files:
        path = root / name
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (pictures, safetensors)
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            for match in MACHINE_PATH.finditer(line):
                found.append(f"{name}:{number}: {match.group(0)}")
    return found


def not_ignored(root: Path, paths: list[str]) -> list[str]:
    """Those of `paths` (relative, need not exist) that .gitignore does not cover."""
    result = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-z"], cwd=root, input="\0".join(paths),
                            capture_output=True, text=True)
    ignored = {name for name in result.stdout.split("\0") if name}
    return [path for path in paths if path not in ignored]


# ------------------------------------------------------------------------------------------------ the real tree


def test_no_tracked_link_leaves_the_repository():
    assert links_leaving(ROOT, tracked_files(ROOT)) == []


def test_no_tracked_text_names_a_path_of_one_machine():
    assert machine_paths(ROOT, tracked_files(ROOT)) == []


def test_gitignore_covers_what_the_make_targets_and_benchmarks_write():
    assert not_ignored(ROOT, GENERATED) == []


def test_the_make_targets_write_only_into_ignored_output_folders():
    """Every `--output-dir`/`--output` folder the Makefile passes is ignored (docs/, written on purpose, aside)."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    folders = set(re.findall(r"--output(?:-dir)?\s+(\S+)", makefile))
    assert folders, "the Makefile passes no output folder: update this test"
    written = [f"{folder.rstrip('/')}/file" for folder in folders if not folder.startswith("docs/")]
    assert not_ignored(ROOT, written) == []


# ------------------------------------------------------------------------------------------------ the checks fail


@pytest.fixture
def planted(tmp_path):
    """A small git repository with a clean file, for planting what the checks must find."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "ok.py").write_text("OUTPUT = 'outputs/run'  # relative\nEXAMPLE = '/tmp/x'\n")
    (tmp_path / "inside").symlink_to("ok.py")
    (tmp_path / ".gitignore").write_text("outputs/\n")
    return tmp_path


def test_the_checks_pass_a_clean_tree_and_find_a_planted_link_and_path(planted):
    git("add", "-A", cwd=planted)
    files = tracked_files(planted)
    assert links_leaving(planted, files) == [] and machine_paths(planted, files) == []
    (planted / "cache").symlink_to("/tmp")
    (planted / "up").symlink_to("../elsewhere")
    home, work = "/" + "home/alice", "/" + "work/"
    (planted / "notes.md").write_text(f"The sdist is in\n{home}/testa/.cache and {work}wt-24-hf/x\n")
    git("add", "-A", cwd=planted)
    files = tracked_files(planted)
    assert links_leaving(planted, files) == ["cache -> /tmp", "up -> ../elsewhere"]
    assert machine_paths(planted, files) == [f"notes.md:2: {home}", f"notes.md:2: {work}"]
    assert not_ignored(planted, ["outputs/a/b.pt", "results/c.json"]) == ["results/c.json"]


# ------------------------------------------------------------------------------------------------ CI never skips


def test_a_missing_requirement_skips_with_its_install_command_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r'to run it: pip install -e "\.\[faiss\]"'):
        requirements.skip_or_fail("'faiss' is not importable", requirements.INSTALL["faiss"])
    with pytest.raises(pytest.skip.Exception, match="pip install no_such_module_xyz"):
        requirements.require("no_such_module_xyz")


def test_a_missing_requirement_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_xyz.*CI=true"):
        requirements.require("no_such_module_xyz")
    assert requirements.require("json").dumps([1]) == "[1]"  # an installed module is returned as it is


@pytest.mark.parametrize("ci, code, word", [("true", 1, "error"), ("", 0, "warning")])
def test_a_failed_conformance_fetch_fails_under_ci_naming_the_command(monkeypatch, capsys, ci, code, word):
    def unreachable(*args, **kwargs):
        raise subprocess.CalledProcessError(1, ["pip", "download", "transformers==0.0.0"])

    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(transformers_common, "fetch_sdist", unreachable)
    assert transformers_common.main() == code
    error = capsys.readouterr().err
    assert error.startswith(f"{word}:") and "pip download transformers==0.0.0" in error


@pytest.mark.skipif(not requirements.under_ci(), reason="checks CI's own run (set CI=true to run it)")
def test_under_ci_the_conformance_suite_is_there():
    """Under CI the sdist was fetched before pytest started (`make test`), so the 240 conformance tests are collected."""
    assert transformers_common.sdist_dir() is not None


@pytest.mark.parametrize("dirty, code", [(None, 0), ("tracked", 1), ("untracked", 1), ("ignored", 0)])
def test_ci_fails_when_the_run_leaves_the_tree_dirty(planted, dirty, code):
    """`.ci/check-tree` (run by `.ci/run` after the suite) fails on a modified tracked file or a new untracked one."""
    git("add", "-A", cwd=planted)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "clean", cwd=planted)
    if dirty == "tracked":
        (planted / "ok.py").write_text("changed\n")
    elif dirty == "untracked":
        (planted / "results.json").write_text("{}")
    elif dirty == "ignored":
        (planted / "outputs").mkdir()
        (planted / "outputs" / "model.pt").write_text("x")
    result = subprocess.run(["bash", str(ROOT / ".ci" / "check-tree")], cwd=planted, capture_output=True, text=True)
    assert result.returncode == code, result.stdout + result.stderr
    if code:
        assert ("ok.py" if dirty == "tracked" else "results.json") in result.stdout + result.stderr


def test_ci_runs_the_tree_check_and_repeats_the_summary_line():
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".ci/check-tree" in script and "make test" in script
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
