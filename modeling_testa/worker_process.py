"""One small kit for helper processes: the decoder's (`video_decoding`) and an exported engine's
(`testa_runtimes.engine_worker`).

A helper runs native code that may crash or hang (FFmpeg decoders, inference engines); in its own process a segfault
kills only the helper, and the caller raises an error naming what died and the helper's last log lines. Both sides
talk over the helper's stdin and stdout with **length-prefixed pickles** (8 bytes, little-endian, then the pickle);
bulk data (decoded frames) follows its message as raw bytes.

* The caller's side is `WorkerProcess`: it starts the helper (its stderr goes to a log file), waits for its
  ``("ready", ...)`` message with its own start-up limit, sends requests, reads replies until a deadline (a stall
  limit: the caller moves the deadline whenever the helper shows progress), reports how the helper ended
  (`exit_description`) and its log, starts it anew after a crash or in a forked child (which must not share its
  parent's pipes), and stops it.
* The helper's side is `serve(handle)`: it makes the helper exit with its caller, keeps what libraries print off the
  reply pipe, sends ``("ready", pid)``, and answers each request with ``handle(request, replies)``; an exception is
  sent as ``("error", type name, message, code)``.

* Helpers are started by exec (``subprocess``), never forked, and end with their caller (`exit_with_parent`).
  How DataLoader workers and ranks start and end is `process_start`'s (not Hub code).

Run by path, ``python worker_process.py HANDLER_FILE``, it is a helper whose requests are handled by the module in
``HANDLER_FILE``, loaded by path (its ``handler()`` returns the ``handle`` function): the decoder helper runs this way
with `video_decoding_worker.py` (importing nothing but the standard library, numpy and the decoders), and the engine
worker with `testa_runtimes/engine_worker.py`. This file is Hub remote code, exported with the modules that
import it; it imports only the standard library.
"""

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any


HEADER = struct.Struct("<Q")
"""A message's length, before its pickle."""

START_TIMEOUT = 120.0
"""Seconds a helper may take to start (import its libraries and say ``ready``); a stall limit on the requests
themselves does not apply to the start, which can be slow on a loaded machine."""


class WorkerGone(EOFError):
    """The helper closed its pipe: it exited or crashed."""


# ----------------------------------------------------------------------------------------------------------------------
# Framing (both sides)
# ----------------------------------------------------------------------------------------------------------------------


def write_all(fd: int, data: Any) -> None:
    """Writes every byte of `data` (bytes, or a buffer such as a numpy array) to `fd`."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def write_message(fd: int, obj: Any) -> None:
    """Sends one message: its pickle, after its length."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    write_all(fd, HEADER.pack(len(payload)) + payload)


def read_into(fd: int, view: memoryview, deadline: float | None = None) -> None:
    """Fills `view` from `fd`; raises `WorkerGone` at end of file and `TimeoutError` once `deadline`
    (`time.monotonic()`) has passed with nothing to read."""
    while view:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        n = os.readv(fd, [view])
        if n == 0:
            raise WorkerGone
        view = view[n:]


def read_message(fd: int, deadline: float | None = None) -> Any:
    """The next message; `WorkerGone` (an `EOFError`) when the other side closed the pipe, `TimeoutError` past
    `deadline`."""
    header = bytearray(HEADER.size)
    read_into(fd, memoryview(header), deadline)
    payload = bytearray(HEADER.unpack(header)[0])
    read_into(fd, memoryview(payload), deadline)
    return pickle.loads(payload)


# ----------------------------------------------------------------------------------------------------------------------
# The caller's side
# ----------------------------------------------------------------------------------------------------------------------


def signal_name(code: int | None) -> str | None:
    """``"SIGSEGV"`` for a process that a signal ended (a negative exit code), else None."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class WorkerProcess:
    """The caller's side of one helper process, run as `argv` (see the module docstring). Not thread-safe by itself:
    a subclass that serves threads holds its own lock around a request.

    Args:
        argv: the helper's command line, or a function that returns it at each start.
        grace: seconds a stopped helper gets to exit by itself (at the end of its input) before it is killed; 0
            kills it at once (a hung decoder would never read the end of its input).
        log_limit: bytes of log kept; the log restarts empty beyond it (`log_mark`).
    """

    def __init__(self, argv: list[str] | Callable[[], list[str]], grace: float = 0.0, log_limit: int = 1 << 20
                 ) -> None:
        self.argv, self.grace, self.log_limit = argv, grace, log_limit
        self.process: subprocess.Popen | None = None
        self.log = None
        self.owner_pid = os.getpid()
        self.starts = 0

    def running(self) -> bool:
        """Whether this process' helper is alive. In a forked child the parent's helper is forgotten, not stopped:
        its pipes are the parent's."""
        if self.owner_pid != os.getpid():
            self.process, self.log, self.owner_pid = None, None, os.getpid()
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float | None = START_TIMEOUT) -> Any:
        """Starts the helper and returns its first message once it says ``ready``. Raises `WorkerGone` when it
        exits first, `TimeoutError` after `timeout` seconds, `OSError` with the helper's reason for another first
        message."""
        self.log = tempfile.TemporaryFile()
        try:
            import fcntl  # POSIX: the helper appends to the log while this process reads it with pread

            flags = fcntl.fcntl(self.log.fileno(), fcntl.F_GETFL)
            fcntl.fcntl(self.log.fileno(), fcntl.F_SETFL, flags | os.O_APPEND)
        except ImportError:  # pragma: no cover
            pass
        argv = self.argv() if callable(self.argv) else list(self.argv)
        self.process = subprocess.Popen(
            argv,
            # Run by path, a script's folder would come first on the helper's import path, where a sibling file could
            # shadow a module that a library imports; Python 3.11+ leaves it out with PYTHONSAFEPATH.
            env={**os.environ, "PYTHONSAFEPATH": "1"},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, bufsize=0, close_fds=True,
            start_new_session=True,  # Ctrl-C in a terminal goes to the caller only
        )
        self.starts += 1
        weakref.finalize(self, stop_process, self.process, self.grace)
        widen_pipe(self.process.stdout.fileno())
        message = self.receive(time.monotonic() + timeout if timeout else None)
        if message[0] != "ready":
            raise OSError(f"{message[1]}: {message[2]}")
        return message

    def send(self, obj: Any) -> None:
        write_message(self.process.stdin.fileno(), obj)

    def receive(self, deadline: float | None = None) -> Any:
        return read_message(self.process.stdout.fileno(), deadline)

    def receive_into(self, view: memoryview, deadline: float | None = None) -> None:
        """Reads the raw bytes that follow a message into `view`."""
        read_into(self.process.stdout.fileno(), view, deadline)

    def stop(self) -> None:
        """Stops the helper (if any) and forgets it: closes its pipes, then kills it at once, or after `grace`
        seconds if it has not exited by then (a helper ends at the end of its input)."""
        process, self.process = self.process, None
        if process is not None:
            stop_process(process, self.grace)
        if self.log is not None:
            self.log.close()
            self.log = None

    def exit_code(self, timeout: float = 5.0) -> int | None:
        """The helper's exit code (negative: the signal that ended it), or None if it has not ended within
        `timeout` seconds."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_mark(self) -> int:
        """Where the log ends now (see `log_since`); a log past `log_limit` restarts empty first."""
        size = os.fstat(self.log.fileno()).st_size
        if size > self.log_limit:
            os.ftruncate(self.log.fileno(), 0)
            size = 0
        return size

    def log_since(self, offset: int = 0, max_chars: int | None = None) -> str:
        """What the helper wrote to its log after `offset` (the last `max_chars` of it); empty when there is no log."""
        if self.log is None:
            return ""
        try:
            size = os.fstat(self.log.fileno()).st_size
            start = max(offset, size - max_chars) if max_chars else offset
            return os.pread(self.log.fileno(), max(size - start, 0), start).decode("utf-8", "replace")
        except OSError:
            return ""


PIPE_BYTES = 1 << 20
"""The reply pipe's capacity asked for (Linux; 64 KiB by default): a decoded frame goes through in a few writes, and
the helper decodes the next one while the caller reads."""


def widen_pipe(fd: int) -> None:
    """Asks the kernel for a `PIPE_BYTES` pipe (Linux ``F_SETPIPE_SZ``); keeps the default where it cannot."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass


def stop_process(process: subprocess.Popen, grace: float = 0.0) -> None:
    """Closes a helper's pipes (it exits at the end of its input) and kills it now, or after `grace` seconds if it
    is still running then."""
    if grace <= 0 and process.poll() is None:
        process.kill()
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - already closed
            pass
    try:
        process.wait(timeout=max(grace, 10.0))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ----------------------------------------------------------------------------------------------------------------------
# The helper's side
# ----------------------------------------------------------------------------------------------------------------------


class Replies:
    """How a request handler answers: `send` a message, `send_bytes` the raw bytes that follow one."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, obj: Any) -> None:
        write_message(self.fd, obj)

    def send_bytes(self, data: Any) -> None:
        write_all(self.fd, data)


def exit_with_parent(interval: float = 0.5) -> None:
    """A helper ends when it reads end-of-file on stdin, but one hung inside a library call never reads it; if the
    caller is killed meanwhile the helper would run forever. A daemon thread exits the helper once its parent process
    is gone (checked every `interval` seconds; the decoders and engines release the GIL while they work).

    Not Linux's ``PR_SET_PDEATHSIG``: it fires when the parent *thread* that started the helper ends, and any thread
    of the caller may start a shared helper (a request thread, a decode-ahead thread) and end long before the caller."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def reply_pipe() -> int:
    """The helper's reply pipe: its original stdout. What libraries print to stdout from now on goes to stderr (the
    caller's log), never into the replies."""
    replies = os.dup(1)
    os.dup2(2, 1)
    return replies


def serve(handle: Callable[[Any, Replies], None], replies: int | None = None) -> None:
    """The helper's loop: sends ``("ready", pid)``, then calls ``handle(request, Replies)`` for every request read
    from stdin, until the caller closes it. An exception from `handle` is sent as ``("error", type name, message,
    code)``, `code` being the exception's ``code`` attribute or None."""
    out = Replies(reply_pipe() if replies is None else replies)
    out.send(("ready", os.getpid()))
    while True:
        try:
            request = read_message(0)
        except EOFError:
            return
        try:
            handle(request, out)
        except Exception as error:  # noqa: BLE001 - sent to the caller, which raises it
            code = getattr(error, "code", None)
            out.send(("error", type(error).__name__, str(error), code if isinstance(code, str) else None))


def load_handler(path: str) -> Callable[[Any, Replies], None]:
    """The ``handler()`` of the module in the file `path`, loaded by path (its folder is not put on the import
    path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("helper_handler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.handler()


def main(argv: list[str]) -> None:
    """``python worker_process.py HANDLER_FILE``: a helper serving the handler in `HANDLER_FILE`. A handler that
    cannot be loaded is reported as the first message, in place of ``ready``."""
    exit_with_parent()
    replies = reply_pipe()
    try:
        handle = load_handler(argv[1])
    except Exception as error:  # noqa: BLE001 - e.g. numpy missing: the caller reports it
        write_message(replies, ("error", type(error).__name__, str(error), None))
        return
    serve(handle, replies)


if __name__ == "__main__":
    main(sys.argv)
