"""No process of ours forks while other threads are alive (issue 49), and the suite's guard that checks it."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from helpers import fork_guard

REPO = Path(__file__).resolve().parents[1]

FORKS = """
import multiprocessing, os, subprocess, sys, threading, time
stop = threading.Event()
threading.Thread(target=stop.wait, name="busy", daemon=True).start()
subprocess.run([sys.executable, "-c", "pass"], check=True)       # fork-exec: not a fork of this interpreter
process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
process.start(); process.join()                                   # spawn: fork-exec too
pid = os.fork()                                                   # a fork with the thread "busy" alive
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
stop.set()
"""


def test_the_guard_records_a_fork_with_threads_alive_and_not_fork_exec(tmp_path):
    """In a child interpreter (the guard reaches it through ``sitecustomize``): ``os.fork()`` with a thread alive
    is recorded, with the thread's name and the line that forked; ``subprocess`` and multiprocessing's ``spawn``
    (fork-exec) are not."""
    records = tmp_path / "records"
    records.mkdir()
    script = tmp_path / "forks.py"
    script.write_text(FORKS)
    subprocess.run([sys.executable, str(script)], check=True, timeout=120,
                   env={**os.environ, fork_guard.ENV: str(records)})
    found = list(fork_guard.records(records).values())
    assert len(found) == 1, found
    assert any(thread.startswith("busy ") for thread in found[0]["threads"])
    assert "pid = os.fork()" in found[0]["stack"]
    assert json.loads(json.dumps(found[0]))["argv"] == [str(script)]
    assert found[0]["ours"] is False  # the script lies outside the repository: a library's fork, reported only


def test_a_fork_is_ours_when_the_repository_s_code_is_on_its_stack():
    """The guard fails a test for forks our code took (a DataLoader iterated in `train/data.py`, a test's own
    ``get_context("fork")``), and only reports a fork that a library took on a thread of its own (OpenVINO's
    telemetry), which has no frame of ours."""
    root = fork_guard.REPOSITORY
    assert fork_guard.started_by_our_code(str(root / "train" / "data.py"))
    assert fork_guard.started_by_our_code(str(root / "tests" / "test_store_writers.py"))
    assert not fork_guard.started_by_our_code(str(root / ".venv" / "lib" / "python3.11" / "site-packages" / "x.py"))
    assert not fork_guard.started_by_our_code(threading.__file__)


def test_train_index_with_worker_processes_on_two_processes(tmp_path):
    """`train.index --num-workers 2` on two processes: DataLoader workers decode every video (next to the store
    lock's heartbeat thread and the progress bar's monitor); the suite's guard fails this test if any of the
    processes forked with threads alive, as the index build did before its workers came from a forkserver."""
    from helpers.pipelines import INDEX_LAUNCH_2, index_collection

    from testa_search.store.video_store import journaled_count

    root, model = index_collection(tmp_path, 6)
    store = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*INDEX_LAUNCH_2, "--model", str(model), "--videos", str(root / "videos"), "--store",
                             str(store), "--num-workers", "2"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert journaled_count(store) == 6
