"""The suite's fork guard: every ``os.fork()`` taken while other threads are alive, in the test process and in every
Python process the tests start, is recorded and fails the test during which it happened (`tests/conftest.py`).

A child forked from a multi-threaded process inherits only the forking thread; a lock another thread held at that
moment (the interpreter's own, an allocator's, tqdm's) stays locked forever in the child. That is how a DataLoader
worker forked at an epoch boundary hung a two-process training run inside ``os.fork()`` itself (issue 49).

The hook is ``os.register_at_fork(before=...)``: it runs for ``os.fork()`` (multiprocessing's ``fork`` start method,
a DataLoader's default on Linux, ``pty.fork``), not for ``subprocess``'s fork-exec (``_posixsubprocess.fork_exec``
runs no at-fork hook unless given a ``preexec_fn``), which replaces the child's image at once and is safe;
`tests/test_fork_safety.py` checks both. Child processes get the hook through ``sitecustomize`` (the folder
``fork_guard_site`` on ``PYTHONPATH``), which Python imports at start-up; it installs the hook when
``TESTA_FORK_GUARD_DIR`` names the folder where records go (one JSON file per fork taken with threads alive).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from pathlib import Path

ENV = "TESTA_FORK_GUARD_DIR"
"""The environment variable naming the folder of records; the hook is installed only where it is set."""

SITE = Path(__file__).resolve().parent / "fork_guard_site"
"""The folder that goes on ``PYTHONPATH`` so that child interpreters install the hook (its ``sitecustomize``)."""

REPOSITORY = Path(__file__).resolve().parents[2]
"""The repository's root: a fork is ours when a frame of its stack is a file below it (not in a virtual environment)."""

_installed = False


def other_threads() -> list[threading.Thread]:
    """The threads of this process besides the calling one."""
    current = threading.current_thread()
    return [thread for thread in threading.enumerate() if thread is not current]


def _record_fork() -> None:
    """The at-fork hook (runs in the parent, before the fork): records the fork when other threads are alive."""
    directory = os.environ.get(ENV)
    threads = other_threads()
    if not directory or not threads:
        return
    stack = traceback.extract_stack()[:-1]
    record = {"pid": os.getpid(), "argv": sys.argv, "forking_thread": threading.current_thread().name,
              "threads": [f"{thread.name} ({type(thread).__name__}, daemon={thread.daemon})" for thread in threads],
              "stack": "".join(traceback.format_list(stack)),
              "ours": any(started_by_our_code(frame.filename) for frame in stack)}
    path = Path(directory) / f"fork-{os.getpid()}-{threading.get_ident()}-{len(os.listdir(directory))}.json"
    try:
        path.write_text(json.dumps(record, indent=1))
    except OSError:  # the folder is gone (the session ended): nothing to report to
        pass


def started_by_our_code(filename: str) -> bool:
    """Whether a stack frame's file is the project's code (the packages, scripts, benchmarks, app, tests; not a
    virtual environment's site-packages). A fork with none of ours on its stack was taken by a library on a thread of its own
    (OpenVINO's telemetry sends from a thread pool through a forked process): reported, not failed, since no change
    of ours can remove it; `docs/training.md` says how a user turns it off."""
    path = Path(filename)
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        relative = path.resolve().relative_to(REPOSITORY)
    except (ValueError, OSError):
        return False
    return relative.parts[:1] != (".venv",) and "site-packages" not in relative.parts


def install() -> None:
    """Registers the hook once in this process (it reports only while `ENV` names a folder)."""
    global _installed
    if not _installed:
        os.register_at_fork(before=_record_fork)
        _installed = True


def records(directory: str | os.PathLike) -> dict[str, dict]:
    """The records in `directory`, by file name."""
    found = {}
    for path in sorted(Path(directory).glob("fork-*.json")):
        try:
            found[path.name] = json.loads(path.read_text())
        except (OSError, ValueError):  # being written: read at the next check
            continue
    return found


def describe(record: dict) -> str:
    """One record as the failure message prints it."""
    return (f"process {record['pid']} ({' '.join(map(str, record['argv']))[:200]}) forked from thread "
            f"{record['forking_thread']!r} while these threads were alive: {', '.join(record['threads'])}\n"
            f"fork called from:\n{record['stack'][-3000:]}")


__all__ = ["ENV", "REPOSITORY", "SITE", "describe", "install", "other_threads", "records", "started_by_our_code"]
