"""The memory of a process tree: this process and every process it started (decoder helpers, engine workers,
DataLoader workers), for the long-video memory benchmark and test.

* `TreeMemory` samples the tree's resident memory (the sum of every process' RSS) in a thread and keeps the highest
  sum seen (`peak`): what the machine had to hold at once, to within the sampling interval.
* `high_water` sums each living process' own peak (``VmHWM``): an upper bound of the tree's peak (the processes may
  have peaked at different times), which no short spike escapes. A process that has already exited is not counted.

RSS counts pages shared between processes once per process. The helpers here are started with ``exec`` and share
little besides libraries; a child caught between its ``fork`` and its ``exec`` (same command line as its parent) holds
only its parent's pages and is not counted.
"""

import os
import threading
import time

import psutil


def tree_processes() -> list[psutil.Process]:
    """This process and its living descendants (a child that has not yet exec'd is left out: its pages are its
    parent's)."""
    me = psutil.Process(os.getpid())
    try:
        processes = [me, *me.children(recursive=True)]
    except psutil.Error:
        return [me]
    kept = [me]
    for process in processes[1:]:
        try:
            if process.cmdline() != process.parent().cmdline():
                kept.append(process)
        except psutil.Error:
            pass  # it exited meanwhile
    return kept


def tree_rss() -> int:
    """The tree's resident memory now, in bytes."""
    total = 0
    for process in tree_processes():
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass  # it exited meanwhile
    return total


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) the tree has used so far: this process, the children it has waited for (a
    stopped helper), and its living descendants."""
    me = psutil.Process(os.getpid())
    times = me.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for process in tree_processes()[1:]:
        try:
            child = process.cpu_times()
            total += child.user + child.system
        except psutil.Error:
            pass
    return total


def _vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def high_water() -> int:
    """The sum of every living tree process' peak resident memory (Linux ``VmHWM``), in bytes."""
    total = 0
    for process in tree_processes():
        try:
            total += _vm_hwm(process.pid)
        except OSError:
            pass
    return total


def label(process: psutil.Process) -> str:
    """``"main"`` for this process, else the script or module a child runs (e.g. ``worker_process.py``)."""
    if process.pid == os.getpid():
        return "main"
    try:
        arguments = process.cmdline()
    except psutil.Error:
        return "?"
    scripts = [os.path.basename(a) for a in arguments[1:] if a.endswith(".py") or a.startswith(("-c", "-m"))]
    return scripts[0] if scripts else os.path.basename(arguments[0]) if arguments else "?"


class TreeMemory:
    """Samples the tree's resident memory every `interval` seconds while in the ``with`` block; `peak` is the highest
    sum seen, `start` the sum when the block was entered, `process_peaks` every process' own highest RSS seen
    (``{pid: (label, bytes)}``)."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.start = self.peak = 0
        self.process_peaks: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="tree-memory")

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0
            for process in tree_processes():
                try:
                    rss = process.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                if rss > self.process_peaks.get(process.pid, ("", 0))[1]:
                    self.process_peaks[process.pid] = (label(process), rss)
            self.peak = max(self.peak, total)
            time.sleep(self.interval)

    def __enter__(self) -> "TreeMemory":
        self.start = self.peak = tree_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss())


MIB = 1 << 20
