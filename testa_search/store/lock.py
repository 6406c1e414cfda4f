"""One writer per video store: a lock file in the store's folder, taken before anything is written.

``writer.lock`` holds who writes the store (JSON: ``host``, ``pid``, ``started``, ``command``, ``token``). It is
created whole and atomically: the payload is written to a private file, then hard-linked to ``writer.lock``, which
fails when the name exists. The only file-system operations relied on are ``link`` failing on an existing name and
``rename`` / ``replace`` being atomic: the classic lock-file recipe for NFS (``flock``/``fcntl`` locks, which NFS
clients do not all honour, are not used; the tests run on a local file system). While held, a thread refreshes the file's modification time every
`HEARTBEAT_SECONDS` (the heartbeat) and checks that the file still names this writer.

**A lock left by a killed run.** A lock is stale when its writer is certainly gone: on the same host, when its pid
is not running (or is a zombie, or was reused by a process started later); on another host (a shared file system),
or in another process namespace of this one (containers can share a host name, not their pids),
when its heartbeat is older than `STALE_AFTER_SECONDS` (so hosts' clocks must agree to well within that). A stale
lock is taken over under a claim file (``writer.lock.takeover``, created by the same atomic link): only the
process that holds the claim may replace the stale lock, and it does so only if the lock still names the writer it
judged dead, so two processes racing to take over one stale lock never both win.

**The processes of one launch** (``accelerate launch``) share one lock: the main process takes it before anyone
writes, and the others check that ``writer.lock`` names the token it sends them (`check_lock_token`), which also
proves that they see the same folder.
"""

import datetime
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

LOCK_FILE = "writer.lock"
CLAIM_FILE = "writer.lock.takeover"
HEARTBEAT_SECONDS = 10.0
STALE_AFTER_SECONDS = 120.0
# How long `acquire` waits for another process's takeover claim to go (it holds the claim for microseconds).
CLAIM_WAIT_SECONDS = 10.0

logger = logging.getLogger(__name__)


class StoreLockedError(RuntimeError):
    """Another writer holds the store. Attributes: ``directory``, ``path`` (the lock file) and ``holder`` (its
    payload: ``host``, ``pid``, ``started``, ``command``)."""

    def __init__(self, directory: str | os.PathLike, holder: dict[str, Any], detail: str = ""):
        self.directory, self.path, self.holder = Path(directory), Path(directory) / LOCK_FILE, dict(holder)
        super().__init__(
            f"The video store {str(directory)!r} is being written by another writer ({describe_holder(holder)}; "
            f"lock file {str(self.path)!r}){detail}. One store takes one writer at a time: wait for it to finish, "
            "or write to another folder. A lock left by a killed run is taken over automatically (on another host "
            f"once its heartbeat is {STALE_AFTER_SECONDS:.0f} s old)."
        )


def describe_holder(holder: dict[str, Any]) -> str:
    """``host H, pid P, started T, command C`` of a lock payload."""
    return (f"host {holder.get('host')!s}, pid {holder.get('pid')!s}, started {holder.get('started')!s}, "
            f"command {holder.get('command')!r}")


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux ``/proc``), or None where unknown."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in parentheses may hold spaces


def process_state(pid: int) -> str | None:
    """The one-letter state of process `pid` from ``/proc`` (``Z``: a zombie), or None where unknown."""
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None


def pid_is_running(pid: int) -> bool:
    """Whether a process `pid` runs on this host (a zombie does not). POSIX only (on Windows ``os.kill`` would stop
    the process)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    except (OverflowError, ValueError):
        return False
    return process_state(pid) != "Z"


def pid_namespace() -> str | None:
    """Which pids this process sees: the kernel's boot id and the inode of its pid namespace (Linux), or None where
    unknown. Two containers may share a host name (``docker run --network host``) but not this, and a pid is only
    probed where it means the same process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def writer_identity(command: str | None = None) -> dict[str, Any]:
    """The payload of a lock taken by this process."""
    return {
        "host": socket.gethostname(),
        "pid_namespace": pid_namespace(),
        "pid": os.getpid(),
        "pid_start": process_start_ticks(os.getpid()),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
        "token": uuid.uuid4().hex,
    }


def same_pids(holder: dict[str, Any]) -> bool:
    """Whether the lock's pid can be probed here: the same host name and, when both sides know it (a lock written by
    an older version does not), the same pid namespace."""
    if holder.get("host") != socket.gethostname():
        return False
    theirs, ours = holder.get("pid_namespace"), pid_namespace()
    return theirs is None or ours is None or theirs == ours


def stale_reason(holder: dict[str, Any] | None, age_seconds: float,
                 stale_after: float = STALE_AFTER_SECONDS) -> str | None:
    """Why the writer of a lock is certainly gone, or None when it may be alive. `holder` is None for a payload that
    cannot be read (only damage makes one: it is written whole); `age_seconds` is the age of its heartbeat."""
    # on Windows no pid is probed: every lock goes stale by its heartbeat, as another host's does
    if holder is not None and same_pids(holder) and os.name != "nt":
        pid = holder.get("pid")
        if not isinstance(pid, int) or not pid_is_running(pid):
            return f"pid {pid} is not running on this host"
        started = holder.get("pid_start")
        if started is not None and process_start_ticks(pid) not in (None, started):
            return f"pid {pid} now belongs to a process started later"
        return None
    if age_seconds > stale_after:
        return f"its heartbeat is {age_seconds:.0f} s old (stale after {stale_after:.0f} s)"
    return None


def read_lock(path: str | os.PathLike) -> tuple[dict[str, Any] | None, float]:
    """The payload of a lock file (None when unreadable) and the age of its heartbeat in seconds. Raises
    `FileNotFoundError` when there is none."""
    path = Path(path)
    age = time.time() - path.stat().st_mtime
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError):
        return None, age
    return (holder if isinstance(holder, dict) else None), age


def _link(source: Path, target: Path) -> bool:
    """Hard-links `source` to `target`; False when `target` exists. (Over NFS a retried link may report EEXIST
    although it succeeded: the link count of `source` tells.)"""
    try:
        os.link(source, target)
        return True
    except FileExistsError:
        return source.stat().st_nlink == 2 and _same_file(source, target)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    # a file system without hard links: an exclusive create (its payload is briefly empty: read as unreadable)
    try:
        descriptor = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(source.read_bytes())
    return True


def _same_file(first: Path, second: Path) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def _remove_if_token(path: Path, token: str | None) -> bool:
    """Removes `path` only if it (still) holds `token`: it is renamed away first (atomic), and put back with a link
    if another writer replaced it meanwhile. Returns whether it was removed."""
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}.removed")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        holder, _ = read_lock(aside)
        if holder is None or holder.get("token") == token:
            return True
        _link(aside, path)  # not the file judged: give it back
        return False
    finally:
        aside.unlink(missing_ok=True)


class StoreLock:
    """The lock of the video store in `directory` (created if needed); a context manager.

    Args:
        directory: the store's folder.
        command (`str`, *optional*): what writes (shown to a refused writer); defaults to this process's argv.
        heartbeat (`float`): seconds between heartbeats; stale_after (`float`): heartbeat age after which a lock of
            another host counts as left by a dead run.

    Raises (`acquire`):
        StoreLockedError: naming the writer that holds the store (host, pid, start time, command).
    """

    def __init__(self, directory: str | os.PathLike, command: str | None = None,
                 heartbeat: float = HEARTBEAT_SECONDS, stale_after: float = STALE_AFTER_SECONDS):
        self.directory = Path(directory)
        self.path, self.claim = self.directory / LOCK_FILE, self.directory / CLAIM_FILE
        self.command, self.heartbeat, self.stale_after = command, float(heartbeat), float(stale_after)
        self.identity: dict[str, Any] | None = None
        self.taken_over: dict[str, Any] | None = None  # the payload of a stale lock this one replaced
        self.lost: str | None = None
        self.created = False  # whether `acquire` made the folder (an empty one is removed again by `release`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str | None:
        return None if self.identity is None else self.identity["token"]

    @property
    def held(self) -> bool:
        return self.identity is not None

    def acquire(self) -> "StoreLock":
        if self.held:
            raise RuntimeError(f"The lock {str(self.path)!r} is already held by this StoreLock.")
        self.created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        identity = writer_identity(self.command)
        private = self.directory / f".{LOCK_FILE}.{identity['token']}"
        private.write_text(json.dumps(identity), encoding="utf-8")
        try:
            self._take(private, identity)
        finally:
            private.unlink(missing_ok=True)
        self.identity = identity
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"store lock {self.directory}", daemon=True)
        self._thread.start()
        return self

    def _take(self, private: Path, identity: dict[str, Any]) -> None:
        deadline = time.monotonic() + CLAIM_WAIT_SECONDS
        while True:
            if _link(private, self.path):
                return
            try:
                holder, age = read_lock(self.path)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise OSError(f"Could not create the lock file {str(self.path)!r}.") from None
                continue  # released meanwhile
            reason = stale_reason(holder, age, self.stale_after)
            if reason is None:
                raise StoreLockedError(self.directory, holder or {"unreadable": True})
            if self._take_over(private, identity["token"], holder, reason):
                return
            if time.monotonic() > deadline:
                raise StoreLockedError(self.directory, holder or {}, "; another process is taking over its stale "
                                       f"lock ({CLAIM_WAIT_SECONDS:.0f} s)")
            time.sleep(0.02)

    def _take_over(self, private: Path, token: str, stale: dict[str, Any] | None, reason: str) -> bool:
        """Replaces the stale lock `stale` with this one, under the claim; False when the claim is taken or the
        lock changed meanwhile (the caller looks again)."""
        if not _link(private, self.claim):
            try:
                claimer, age = read_lock(self.claim)
            except FileNotFoundError:
                return False
            if stale_reason(claimer, age, self.stale_after) is not None:  # its taker died holding it
                _remove_if_token(self.claim, None if claimer is None else claimer.get("token"))
            return False
        try:
            try:
                current, _ = read_lock(self.path)
            except FileNotFoundError:
                return False  # released meanwhile: take it the ordinary way
            if (current or {}).get("token") != (stale or {}).get("token"):
                return False
            os.replace(private, self.path)  # atomic: readers see the stale payload or this one
            logger.warning("Took over the lock of the video store %s left by a run that is gone (%s; %s).",
                           self.directory, describe_holder(stale or {}), reason)
            self.taken_over = {**(stale or {}), "reason": reason}
            return True
        finally:
            _remove_if_token(self.claim, token)

    def _holder(self) -> dict[str, Any]:
        """The payload of the lock file now (``{}`` when it is gone or unreadable)."""
        try:
            return read_lock(self.path)[0] or {}
        except FileNotFoundError:
            return {}

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            holder = self._holder()
            if holder.get("token") != self.token:
                self.lost = f"{str(self.path)!r} no longer names this writer (now: {describe_holder(holder)})"
                logger.error("The lock of the video store %s was lost: %s.", self.directory, self.lost)
                return
            try:
                os.utime(self.path)
            except OSError:
                pass

    def verify(self) -> None:
        """Raises `StoreLockedError` when this lock is no longer held (its file removed or taken over)."""
        holder = self._holder()
        if not self.held or holder.get("token") != self.token:
            raise StoreLockedError(self.directory, holder or {"host": None},
                                   "; this writer's lock was lost" + (f" ({self.lost})" if self.lost else ""))

    def release(self) -> None:
        """Stops the heartbeat and removes the lock file if it still names this writer (idempotent)."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        _remove_if_token(self.path, self.token)
        self.identity, self._thread = None, None
        if self.created:  # a refused build into a new folder leaves no empty folder behind
            try:
                self.directory.rmdir()
            except OSError:
                pass  # the build wrote into it

    def __enter__(self) -> "StoreLock":
        return self if self.held else self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


def check_lock_token(directory: str | os.PathLike, token: str) -> None:
    """For the other processes of a launch: raises `StoreLockedError` unless ``writer.lock`` in `directory` names
    the writer `token` (the main process's lock, which it sent them)."""
    path = Path(directory) / LOCK_FILE
    try:
        holder, _ = read_lock(path)
    except FileNotFoundError:
        raise StoreLockedError(directory, {}, f"; this process sees no {LOCK_FILE} where its main process took it: "
                               "every process must see the same folder (a shared file system)") from None
    if (holder or {}).get("token") != token:
        raise StoreLockedError(directory, holder or {}, "; it is not the lock this launch's main process took")


__all__ = [
    "LOCK_FILE",
    "STALE_AFTER_SECONDS",
    "StoreLock",
    "StoreLockedError",
    "check_lock_token",
    "describe_holder",
    "pid_namespace",
    "same_pids",
    "stale_reason",
]
