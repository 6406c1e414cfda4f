"""One writer per video store (`testa_search.store.lock`): real processes.

Two `python -m train.index` runs started at once on one `--store`: exactly one writes, the other exits non-zero
naming the first (host, pid, start time, command) before writing anything, and the store equals a clean build. A
writer killed with SIGKILL leaves a stale lock that the next run takes over and completes. Processes racing to take
over one stale lock: exactly one wins. The pipeline's `encode_videos(store_dir=...)` and `VideoIndex.save` take the
same lock. References: a clean one-process build of the same videos (bit for bit, float32 tokens), the journals
(each video written exactly once) and the lock file's payload."""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.pipelines import INDEX_COMMAND as PLAIN
from helpers.pipelines import INDEX_LAUNCH_2 as LAUNCH_2
from helpers.pipelines import index_collection
from helpers.videos import write_noise_video

from modeling_testa import TestaForVideoTextRetrieval, TestaProcessor
from testa_search import StoreLock, StoreLockedError
from modeling_testa import VideoTextRetrievalPipeline
from testa_search.store.lock import LOCK_FILE, check_lock_token, pid_namespace, read_lock
from testa_search.index import VideoIndex
from testa_search.store.video_store import VideoTokenStore, journaled_count
from modeling_testa.process_start import worker_context

NUM_VIDEOS = 96
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
REFUSED = "is being written by another writer"


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    return index_collection(tmp_path_factory.mktemp("writers"), NUM_VIDEOS)


def command(root: Path, model: Path, store: Path, *extra, launcher: list[str] = PLAIN) -> list[str]:
    return [*launcher, *map(str, ["--model", model, "--videos", root / "videos", "--store", store, "--token-dtype",
                               "float32", "--num-workers", "0", "--shard-size", "32", "--batch-size", "1", *extra])]


def run(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def clean_store(collection):
    root, model = collection
    run(command(root, model, root / "clean"))
    return root / "clean"


def journaled_indices(store: Path) -> list[int]:
    indices = []
    for journal in sorted(store.glob("journal-*.jsonl")):
        for line in journal.read_text().splitlines()[1:]:
            indices += json.loads(line).get("encoded", [])
    return sorted(indices)


def assert_equal_stores(store: Path, reference: Path) -> None:
    """Same videos, and for every video the same embedding and tokens, bit for bit (float32, same CPU code)."""
    built, clean = VideoTokenStore(store), VideoTokenStore(reference)
    assert built.videos == clean.videos and built.valid.tolist() == clean.valid.tolist()
    assert torch.equal(built.embeddings, clean.embeddings)
    everything = torch.arange(len(clean))
    assert torch.equal(built.read_tokens(everything), clean.read_tokens(everything))
    assert journaled_indices(store) == list(range(NUM_VIDEOS))  # each video written exactly once
    assert not (store / LOCK_FILE).exists()


def test_a_run_started_while_another_writes_is_refused_naming_it(collection, clean_store):
    """The first run is paused (SIGSTOP) as soon as its lock file exists, so the second surely starts while it
    holds the lock, whatever the machine's speed: the second exits non-zero naming the first, having written
    nothing, and the first, resumed, completes a clean build."""
    root, model = collection
    store = root / "paused"
    first = subprocess.Popen(command(root, model, store), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 300
    while not (store / LOCK_FILE).exists():
        assert first.poll() is None, f"the first run ended before taking the lock: {first.communicate()}"
        assert time.monotonic() < deadline, "the first run took no lock within 300 s"
        time.sleep(0.005)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = subprocess.run(command(root, model, store), env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert second.returncode == 1, (second.stdout[-2000:], second.stderr[-2000:])
    message = second.stderr
    assert REFUSED in message and "Traceback" not in message
    assert f"host {socket.gethostname()}, pid {first.pid}, started 20" in message
    assert f"command 'python -m train.index --model {model}" in message
    assert f"Indexed {NUM_VIDEOS} videos" in out
    # the refused run wrote nothing: every batch in the journals is the first run's, and the store is a clean build's
    assert_equal_stores(store, clean_store)
    report = json.loads((store / "index_report.json").read_text())
    assert report["encoded_this_run"] == NUM_VIDEOS and report["failed"] == 0


def test_two_runs_started_at_once_never_both_write(collection, clean_store):
    """Two runs started at once: either one is refused while the other writes, or (on a machine where the first
    finishes before the second starts) the second finds nothing to encode; never do both write, and the store
    equals a clean build with every video written exactly once."""
    root, model = collection
    store = root / "raced"
    runs = [subprocess.Popen(command(root, model, store), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in runs]
    codes = [process.returncode for process in runs]
    assert sorted(codes) in ([0, 1], [0, 0]), (codes, [err[-2000:] for _, err in outputs])
    if sorted(codes) == [0, 1]:
        loser = codes.index(1)
        assert REFUSED in outputs[loser][1] and "Traceback" not in outputs[loser][1]
    added = [out for out, _ in outputs if f"Indexed {NUM_VIDEOS} videos" in out]
    assert sum(f"({NUM_VIDEOS} added," in out for out in added) == 1  # the other, if it ran: "(0 added, 96 already"
    assert all(f"({NUM_VIDEOS} added," in out or "(0 added," in out for out in added)
    assert_equal_stores(store, clean_store)


@pytest.mark.parametrize("launcher", [PLAIN, LAUNCH_2], ids=["1 process", "accelerate launch, 2 processes"])
def test_a_refused_run_writes_nothing(collection, clean_store, tmp_path, launcher):
    """While another writer holds the store (this test process), a run that would append videos is refused before
    it writes anything (every process of a launch stops): no file of the store changes, none appears."""
    root, model = collection
    extra = tmp_path / "more"
    write_noise_video(extra / "new.mp4", seed=1000)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in clean_store.iterdir()}
    with StoreLock(clean_store, command="the test writer") as held:
        args = command(root, model, clean_store, launcher=launcher)
        args[args.index("--videos") + 1] = str(extra)
        result = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
        assert result.returncode != 0 and REFUSED in result.stderr
        assert f"pid {os.getpid()}" in result.stderr and "command 'the test writer'" in result.stderr
        assert read_lock(clean_store / LOCK_FILE)[0]["token"] == held.token  # its lock untouched
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in clean_store.iterdir()} == before


def test_a_killed_writer_leaves_a_stale_lock_that_the_next_run_takes_over(collection, clean_store):
    root, model = collection
    store = root / "killed"
    process = subprocess.Popen(command(root, model, store), env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while (not store.is_dir() or journaled_count(store) < 10) and time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    holder, _ = read_lock(store / LOCK_FILE)
    assert holder["pid"] == process.pid  # the lock the killed run left
    done_before = journaled_count(store)
    assert 10 <= done_before < NUM_VIDEOS

    result = run(command(root, model, store))
    assert f"Took over the lock of {str(store)!r}" in result.stdout and f"pid {process.pid} is not running" in (
        result.stdout)
    report = json.loads((store / "index_report.json").read_text())
    assert report["already_in_store"] == done_before and report["encoded_this_run"] == NUM_VIDEOS - done_before
    assert_equal_stores(store, clean_store)


def exited_pid() -> int:
    """The pid of a process that has finished (and been reaped)."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def write_lock(directory: Path, age_seconds: float = 0.0, **payload) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "pid": exited_pid(), "started": "2026-01-01T00:00:00+00:00",
              "command": "a killed run", "token": "stale", **payload}
    (directory / LOCK_FILE).write_text(json.dumps(holder))
    then = time.time() - age_seconds
    os.utime(directory / LOCK_FILE, (then, then))


def take_over(directory: str, barrier, results) -> None:
    """One racer: waits for all, tries to take the stale lock, reports, and holds a winning lock until every racer
    reported (so that a loser meets it, not a released one)."""
    barrier.wait()
    lock = StoreLock(directory, command=f"racer {os.getpid()}")
    try:
        lock.acquire()
        results.put(("won", os.getpid(), lock.taken_over["token"]))
    except StoreLockedError as error:
        results.put(("refused", os.getpid(), error.holder.get("pid")))
    barrier.wait()
    lock.release()


def test_racers_taking_over_one_stale_lock_never_both_win(tmp_path):
    # racers from the library's forkserver, not "fork": earlier tests leave threads alive in this process
    context = worker_context(("testa_search.store.lock", __name__))
    racers = 6
    for round_ in range(8):
        directory = tmp_path / f"round{round_}"
        write_lock(directory)
        barrier, results = context.Barrier(racers), context.Queue()
        processes = [context.Process(target=take_over, args=(str(directory), barrier, results))
                     for _ in range(racers)]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=60) for _ in range(racers)]
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        winners = [pid for outcome, pid, _ in outcomes if outcome == "won"]
        assert len(winners) == 1, outcomes
        assert all(holder == winners[0] for outcome, _, holder in outcomes if outcome == "refused"), outcomes
        assert sorted(p.name for p in directory.iterdir()) == []  # the claim and private files are gone


def test_when_a_lock_is_stale(tmp_path):
    alive = tmp_path / "alive"
    write_lock(alive, age_seconds=10_000, pid=os.getpid(), token="mine")  # same host, running: never stale
    with pytest.raises(StoreLockedError, match=rf"host {socket.gethostname()}, pid {os.getpid()}, started "
                                               r"2026-01-01T00:00:00\+00:00, command 'a killed run'"):
        StoreLock(alive).acquire()

    elsewhere = tmp_path / "elsewhere"
    write_lock(elsewhere, age_seconds=30, host="another-host")  # another host: its heartbeat decides
    with pytest.raises(StoreLockedError, match="host another-host"):
        StoreLock(elsewhere, stale_after=60).acquire()
    lock = StoreLock(elsewhere, stale_after=20).acquire()
    assert "heartbeat is 30 s old" in lock.taken_over["reason"]
    lock.release()

    # a container with this host name but its own pids (docker --network host): its pid means nothing here, so a
    # fresh heartbeat keeps the lock even though no process here has that pid; an old one lets it go
    container = tmp_path / "container"
    write_lock(container, age_seconds=30, pid_namespace="another-boot:4026531836")
    with pytest.raises(StoreLockedError, match=f"host {socket.gethostname()}"):
        StoreLock(container, stale_after=60).acquire()
    lock = StoreLock(container, stale_after=20).acquire()
    assert "heartbeat is 30 s old" in lock.taken_over["reason"]
    lock.release()

    dead = tmp_path / "dead"
    write_lock(dead, pid_namespace=pid_namespace())  # same host, same pids: the pid decides
    lock = StoreLock(dead).acquire()
    assert lock.taken_over["reason"].endswith("is not running on this host")
    holder, _ = read_lock(dead / LOCK_FILE)
    assert holder["pid"] == os.getpid() and holder["token"] == lock.token
    lock.release()
    assert not (dead / LOCK_FILE).exists()


def test_the_heartbeat_refreshes_the_lock_and_notices_when_it_is_lost(tmp_path):
    lock = StoreLock(tmp_path, heartbeat=0.05).acquire()
    first = (tmp_path / LOCK_FILE).stat().st_mtime_ns
    time.sleep(0.3)
    assert (tmp_path / LOCK_FILE).stat().st_mtime_ns > first
    lock.verify()
    check_lock_token(tmp_path, lock.token)  # what the other processes of a launch check
    with pytest.raises(StoreLockedError, match="not the lock this launch's main process took"):
        check_lock_token(tmp_path, "another launch")
    write_lock(tmp_path, host="another-host", token="intruder")  # e.g. taken over by a wrong clock elsewhere
    time.sleep(0.3)
    assert lock.lost and "another-host" in lock.lost
    with pytest.raises(StoreLockedError, match="this writer's lock was lost"):
        lock.verify()
    lock.release()
    assert read_lock(tmp_path / LOCK_FILE)[0]["token"] == "intruder"  # not its lock: left in place


def test_the_pipeline_and_index_save_take_the_same_lock(collection, tmp_path):
    root, model = collection
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    videos = sorted(str(p) for p in (root / "videos").glob("*.mp4"))[:3]
    store = tmp_path / "store"
    with StoreLock(store, command="train.index elsewhere"):
        with pytest.raises(StoreLockedError, match="command 'train.index elsewhere'"):
            pipe.encode_videos(videos, store_dir=store)
        assert sorted(p.name for p in store.iterdir()) == [LOCK_FILE]
        with pytest.raises(StoreLockedError):
            pipe.encode_videos(videos).save(store, as_store=True)
        assert sorted(p.name for p in store.iterdir()) == [LOCK_FILE]
    index = pipe.encode_videos(videos, store_dir=store)  # free again: written, and the lock released
    assert len(index) == 3 and not (store / LOCK_FILE).exists()
    index.save(tmp_path / "copy")
    assert VideoIndex.load(tmp_path / "copy").videos == videos and not (tmp_path / "copy" / LOCK_FILE).exists()
