"""Imported by Python at start-up in every process the tests start (this folder is on their ``PYTHONPATH``):
installs the fork guard (`tests/helpers/fork_guard.py`) when ``TESTA_FORK_GUARD_DIR`` is set, then runs the
``sitecustomize`` this one shadows, if any."""

import importlib.machinery
import importlib.util
import os
import sys


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if os.environ.get("TESTA_FORK_GUARD_DIR"):
    _load("testa_fork_guard", os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                           "fork_guard.py")).install()

_here = os.path.dirname(os.path.abspath(__file__))
_shadowed = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _here])
if _shadowed is not None and _shadowed.origin:
    _load("sitecustomize_shadowed", _shadowed.origin)
