"""Optional test requirements: skipped with the command that installs them, or a failure under CI.

`make test` installs every extra the README counts (`.[test,faiss,milvus,st,mteb,app]`) and fetches transformers' common
tests. A fresh clone once skipped 240 of them silently (a broken cache link), so under `CI=true` a suite that cannot
run fails instead of skipping; outside CI it is skipped with the command that makes it run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# What installs each optional module the suite uses (the extras of setup.cfg, installed by `make test`).
INSTALL = {
    "av": 'pip install -e ".[test]"  (PyAV is a core dependency)',
    "evaluate": 'pip install -e ".[test]"  (evaluate is a core dependency)',
    "faiss": 'pip install -e ".[faiss]"',
    "sentence_transformers": 'pip install -e ".[st]"',
    "mteb": 'pip install -e ".[mteb]"',
    "gradio": 'pip install -e ".[app]"',
    "gradio_client": 'pip install -e ".[app]"',
    "playwright.sync_api": 'pip install -e ".[app]"',
    "pymilvus": 'pip install -e ".[milvus]"',
    "hypothesis": 'pip install -e ".[test]"',
    "milvus_lite": 'pip install -e ".[milvus]"',
}


def under_ci() -> bool:
    """Whether the suite runs under CI (`CI=true`, as `.ci/run` sets it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_or_fail(reason: str, how_to_run: str, allow_module_level: bool = False) -> None:
    """Skips with `reason` and the command that makes the test run; under CI, fails with both instead."""
    message = f"{reason}; to run it: {how_to_run}"
    if under_ci():
        pytest.fail(f"{message} (CI=true: a suite that cannot run fails instead of skipping)", pytrace=False)
    pytest.skip(message, allow_module_level=allow_module_level)


def require(module: str) -> ModuleType:
    """`pytest.importorskip` that names the install command, and fails under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        skip_or_fail(f"{module!r} is not importable ({error})", INSTALL.get(module, f"pip install {module}"),
                     allow_module_level=True)
        raise  # unreachable: skip_or_fail raises


__all__ = ["INSTALL", "require", "skip_or_fail", "under_ci"]
