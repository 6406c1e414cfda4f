"""A real `milvus-lite server` for the tests, on the loopback, stopped whatever happens."""

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .requirements import skip_or_fail

START_SECONDS = 300
"""How long the server may take to listen: a bound on a stall (a loaded machine starts it slowly), not a speed."""


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stop(process: subprocess.Popen) -> None:
    """Ends a process a test started (SIGTERM, then SIGKILL after 10 s)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def milvus_lite_server(data: Path) -> Iterator[str]:
    """A `milvus-lite server` bound to 127.0.0.1 on a free port, its data in `data`; yields its URI."""
    executable = Path(sys.executable).with_name("milvus-lite")
    if not executable.is_file():
        skip_or_fail(f"no milvus-lite executable beside {sys.executable}", 'pip install -e ".[milvus]"')
    port = free_loopback_port()
    log_path = data.parent / f"milvus_server_{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115
    process = subprocess.Popen([str(executable), "server", "--host", "127.0.0.1", "--port", str(port),
                                "--data-dir", str(data)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_SECONDS
        while not listening(port):
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                text = log_path.read_text(errors="replace")[-2000:]
                skip_or_fail(f"milvus-lite server did not start on 127.0.0.1:{port}: {text}",
                             'pip install -e ".[milvus]"')
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)
        log.close()


def record_milvus_tokens(monkeypatch, pymilvus) -> list:
    """Makes every `pymilvus.MilvusClient` created from now on (for this test) append the ``token`` it was given to
    the returned list, and connect as usual."""
    tokens: list = []

    class RecordingClient(pymilvus.MilvusClient):
        def __init__(self, *args, **kwargs):
            tokens.append(kwargs.get("token"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pymilvus, "MilvusClient", RecordingClient)
    return tokens
