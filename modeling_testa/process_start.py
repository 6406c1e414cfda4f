"""How the processes that training, evaluation and the index build start (DataLoader workers, ranks) begin and end.

No process of ours calls ``fork()`` while other threads are alive (a forked child inherits only the forking thread,
and a lock another thread held stays locked in it forever: issue 49's hang). Helpers are started by exec
(`worker_process`); DataLoader workers come from a ``forkserver``, a single-threaded process that forks them. Every
process ends with the one that started it: a rank with its launcher (``PR_SET_PDEATHSIG``, `die_with_launcher`), a
DataLoader worker with its rank (a watcher thread, `end_with_parent_process`), a helper with its caller
(`worker_process.exit_with_parent`).

Nothing a saved model folder loads imports this module: it is used by `train`, `testa_search` and `processing`.
"""

import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from typing import Any



WORKER_START_METHOD = "forkserver"
"""How DataLoader workers start. Not ``fork`` (a DataLoader's default on Linux): a rank, an evaluation or an index
build runs threads by the time it starts workers (tqdm's monitors, a store lock's heartbeat, a previous iterator's
queue feeder), and a child forked from a multi-threaded process can deadlock before it runs a line (issue 49). Not
``spawn``: every worker would import torch and the script again (tens of seconds on a busy machine, every epoch). A
forkserver is started once per process, by exec, imports the `preload` modules once, and forks each worker from its
own single thread. Like ``spawn``, it imports the main script in every worker: a script run by path guards its entry
point with ``if __name__ == "__main__":``."""


def worker_context(preload: tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    """The multiprocessing context DataLoader workers start from (`WORKER_START_METHOD`); `preload`: modules its
    server imports once, before the first worker (e.g. the dataset's and collator's modules: each worker then starts
    in a fraction of a second). Only the first call of a process, before its server starts, sets them; a module that
    cannot be imported there is imported by each worker instead."""
    context = multiprocessing.get_context(WORKER_START_METHOD)
    if preload:
        context.set_forkserver_preload(sorted({"torch", *preload}))
    return context


def dataloader_workers(num_workers: int, *uses: Any) -> dict[str, Any]:
    """The keywords that make a DataLoader's `num_workers` workers start our way: from `worker_context` (preloading
    the modules of `uses`, e.g. its dataset and collate function, which must pickle) and ending with the process that
    created them (`end_with_parent_process`). Empty without workers."""
    if not num_workers:
        return {}
    modules = tuple(module for module in {type(use).__module__ for use in uses} if module not in ("__main__", "builtins"))
    return {"multiprocessing_context": worker_context(modules), "worker_init_fn": end_with_parent_process}


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Asks Linux to send this process `sig` when its parent ends (``prctl(PR_SET_PDEATHSIG)``), so that a rank
    ends with its launcher however the launcher ends (killed, crashed, SIGKILL). For a process whose parent starts it
    from its main thread and keeps that thread for its life (a launcher starting ranks); not for the shared helpers
    (see `exit_with_parent`). Returns whether it is set (False off Linux); exits at once if the parent is already
    gone."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent ended before the request took effect
        os.kill(os.getpid(), sig)
    return True


def die_with_launcher() -> bool:
    """`die_with_parent` in a rank that a launcher started (torchrun's agent, which `accelerate launch` runs, sets
    ``TORCHELASTIC_RUN_ID``); nothing in a process started otherwise (a command run under ``nohup`` must outlive its
    shell). Returns whether it is set."""
    return "TORCHELASTIC_RUN_ID" in os.environ and die_with_parent()


def _watch_process(pid: int, interval: float = 0.5) -> None:
    """Returns once process `pid` has ended (a pidfd where Linux has them, else polling every `interval` s)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(interval)


def end_with_parent_process(worker_id: int | None = None) -> None:
    """A DataLoader's ``worker_init_fn``: the worker exits as soon as the process that created it (its rank) ends.

    PyTorch's own check watches the worker's parent, which for a forkserver worker is the server; the server stays
    up while any worker holds its pipe, so after a rank is killed its workers would wait forever. A daemon thread
    watches the rank itself (`multiprocessing.parent_process`'s pid). A worker never forks, so the thread is safe."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return

    def watch() -> None:
        _watch_process(parent.pid)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-rank").start()
