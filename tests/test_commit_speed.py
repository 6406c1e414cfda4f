"""`benchmarks/commit_speed.py` runs commits side by side: each in processes of its own that import that commit's
package, interleaved, reported as medians and ratios to the first commit. Its numbers are the machine's; here only
what it runs and reports is checked, on a tiny encoder."""

import subprocess
from pathlib import Path

import pytest

from benchmarks import commit_speed

REPO = Path(__file__).resolve().parent.parent


def test_the_table_gives_medians_and_ratios_to_the_first_commit():
    results = {("old", "openvino-int8"): {"wall": [2.0, 4.0, 3.0], "cpu": [1.0, 1.0, 5.0]},
               ("new", "openvino-int8"): {"wall": [6.0, 6.0, 1.0], "cpu": [2.0, 2.0, 2.0]}}
    lines = commit_speed.table(results, ["old", "new"], ["openvino-int8"]).splitlines()
    assert lines[2] == "| openvino-int8 | old | 3.000 | 1.000 | 1.000x | 1.000x | 3 |"
    assert lines[3] == "| openvino-int8 | new | 6.000 | 2.000 | 2.000x | 2.000x | 3 |"


@pytest.mark.slow  # four processes that import transformers (a minute or two on 2 busy cores)
def test_each_commit_runs_its_own_package(tmp_path):
    """A commit is extracted and measured with its own `modeling_testa`: the worker of an extracted commit imports
    the package from that tree, not from this checkout."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    tree, name = commit_speed.extract("HEAD", tmp_path)
    assert name == head.stdout.strip() and (tree / "modeling_testa" / "__init__.py").is_file()
    assert commit_speed.extract(commit_speed.WORKTREE, tmp_path) == (REPO, commit_speed.WORKTREE)
    summary = commit_speed.main(["--commits", "worktree", "HEAD", "--runtimes", "torch-fp32", "--rounds", "2",
                                 "--frames", "4", "--image-size", "32", "--hidden-size", "64", "--layers", "2",
                                 "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
                                 "--json", str(tmp_path / "speed.json")])
    assert summary["commits"] == ["worktree", name]
    assert Path(summary["packages"]["worktree"]) == REPO / "modeling_testa"
    assert not Path(summary["packages"][name]).is_relative_to(REPO)  # the extracted tree's own package
    for key in ("worktree torch-fp32", f"{name} torch-fp32"):
        clocks = summary["results"][key]
        assert len(clocks["wall"]) == len(clocks["cpu"]) == 2 and min(clocks["wall"]) > 0
    assert (tmp_path / "speed.json").is_file()
