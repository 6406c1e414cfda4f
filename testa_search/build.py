"""Building a video index: every step of a build, from start to end, in one place.

`IndexBuild` is the only code that builds or grows an index. The retrieval pipeline's `encode_videos`, `python -m
train.index`, the training evaluation and the app (through the pipeline) run it; `VideoIndex.save` writes a store
through the same home steps (`homes.StoreHome`). A build runs these steps, each once, on 1 to N processes
(`torch.distributed`'s default group, as `accelerate launch` makes it; one process without it):

1. **Lock.** The main process takes the home's writer lock (a store: ``writer.lock``, `lock.StoreLock`: a
   second writer is refused, naming the first; a lock left by a killed run is taken over); the other processes
   check that they see the lock it took.
2. **Settings.** The home compares the build's settings (`build_settings`: the model, its weights, frames, R_T/R_S,
   precision, window and stride, ...) with the ones it holds (`settings.IndexInfo`), and refuses, naming every
   difference, before anything is encoded; nothing in it changes then. A new home records them. A mirror (a Milvus
   collection, `milvus.MilvusHome`) is checked the same way.
3. **Plan.** The rows the home lacks are planned after its own (`RowPlan`): running a build again with the same
   videos, a subset or a superset encodes only what is new, and a killed build's open shards are resumed. The rows
   of the given videos that failed before are planned again (`retry_failures`): a failure is never a permanent
   verdict.
4. **Encode.** Each process encodes its open shards (shard ``s`` on process ``s % N``) with the one encode loop
   (`encoding.encode_videos`), decoding with `FileDecoder` (the decoder choice), resuming after what a killed run
   journaled. Unreadable videos become failures (`encoding.Failure`), never errors.
5. **Mirror.** The closed shards are upserted into the mirror, when there is one.
6. **Finish.** The main process checks that the lock is still its own and finishes the home into a searchable index
   (a store: its index and first stage).
7. **Report.** `BuildReport`: rows, what this run added, encoded and found there, the failures and the time spent
   decoding and encoding; a store keeps it as ``index_report.json``.
"""

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modeling_testa.distributed import barrier, broadcast_object, gather_objects, raise_on_every_rank, rank, world_size
from testa_search.homes import Decoder, IndexEntry, IndexHome, RowPlan, StoreHome, as_entries
from testa_search.settings import IndexInfo, IndexSettingsError, write_json_atomically
from testa_search.encoding import DecodeAhead, DecodedBatch, EncodingStats, Failure, encode_videos
from testa_search.moments import WindowRowDecoder, check_window_options, probe_duration, rebatch, window_spans
from modeling_testa.saving import INFERENCE_ATTRIBUTE
from testa_search.store.lock import StoreLockedError, check_lock_token
from testa_search.store.video_store import journaled_count, journaled_failures
from modeling_testa.process_start import dataloader_workers

logger = logging.getLogger(__name__)

REPORT_FILE = "index_report.json"
"""A store's report of its last build (`BuildReport.as_dict`)."""

PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


# ---------------------------------------------------------------------------------------------------- settings


def encoder_precision(model: Any) -> str:
    """How the model computes its embeddings, as an index records it: the precision `optimize_for_inference` set,
    with the engine when an exported graph runs the encoder (``"int8 (openvino)"``, `registry.embeddings_label`);
    otherwise the weights' dtype (``"fp32"``)."""
    settings = getattr(model, INFERENCE_ATTRIBUTE, None)
    if settings:
        from testa_runtimes.registry import embeddings_label  # imports every runtime: only an optimized model needs them

        return embeddings_label(settings["runtime"], settings["precision"], next(model.parameters()).device.type)
    dtype = next(model.parameters()).dtype
    return PRECISION_OF_DTYPE.get(dtype, str(dtype).replace("torch.", ""))


def build_settings(model: Any, num_frames: int, with_weights: bool = True, window: float | None = None,
                   stride: float | None = None, token_dtype: str | torch.dtype | None = None,
                   model_source: str | None = None, **extra: Any) -> dict[str, Any]:
    """The settings a build records and checks (`IndexInfo` and `extra`, kept but not compared): the model (its
    weights' hash with `with_weights`, about a second for ViT-B), the frames, R_T/R_S, the precision
    (`encoder_precision`), the moments' window and stride (None: whole videos) and the stored tokens' dtype (None:
    the home's own)."""
    dtype = None if token_dtype is None else str(token_dtype).replace("torch.", "")
    info = IndexInfo.from_model(model, num_frames, with_weights=with_weights, precision=encoder_precision(model),
                                token_dtype=dtype, window=window, stride=stride,
                                **({"model": str(model_source)} if model_source is not None else {}))
    return {**info.as_dict(), **extra}


# ---------------------------------------------------------------------------------------------------- rows


def window_entries(entries: list[IndexEntry], window: float, stride: float | None, skip: Iterable[str] = (),
                   duration: Callable[[str], float] = probe_duration) -> list[IndexEntry]:
    """Collective. The rows of an index of moments: every video file's windows (`moments.plan_windows`), each with
    its video's `dataset`, for the videos not in `skip`. The durations are read from the files' containers (nothing
    decoded), each process its share, so that planning a large folder on N processes takes 1/N of the time and no
    process waits alone at a collective. A video whose duration cannot be read is one whole-video row, whose decoding
    then fails and says why. The one planner of moment rows (the pipeline, `train.index`, the app), given `window`
    and `stride` in seconds (checked again here, cheaply: it is public, and a stride left None would fail late)."""
    window, stride = check_window_options(window, stride, required=True)
    skip = set(skip)
    videos = list(dict.fromkeys(os.fspath(entry.video) for entry in entries if os.fspath(entry.video) not in skip))
    share = videos[len(videos) * rank() // world_size(): len(videos) * (rank() + 1) // world_size()]
    mine: dict[str, Any] = {}
    for video in share:
        try:
            mine[video] = window_spans(duration(video), window, stride)
        except (ValueError, OSError) as error:
            mine[video] = str(error)
    planned = {video: value for part in gather_objects(mine) for video, value in part.items()}
    datasets = {os.fspath(entry.video): entry.dataset for entry in entries}
    rows = []
    for video in videos:
        windows = planned[video]
        if isinstance(windows, str):
            rows.append(IndexEntry(video, dataset=datasets[video]))
        else:
            rows += [IndexEntry(video, start, end, datasets[video]) for start, end in windows]
    return rows


# ---------------------------------------------------------------------------------------------------- decoding


class FileDecoder:
    """The build's decoder (`homes.Decoder`): decodes the rows asked for, `batch_size` at a time, in order.

    Whole-video rows are decoded by ``collate([(position, video), ...])`` (e.g. `encoding.DecodeVideos`, or the
    pipeline's own, which takes in-memory videos too); with ``num_workers``, decoding runs ahead of the encoder: in
    DataLoader worker processes (``worker_processes=True``: `train.index`, the evaluation) or in threads, each with a
    decoder process of its own from ``thread_initializer`` (the pipeline). Rows that are moments go to
    `moments.WindowRowDecoder`: each video streamed once for all its consecutive rows, its windows handed out as they
    complete, in ``num_workers`` threads with decoder processes of their own (whatever ``worker_processes`` says: the
    stream's memory is bounded per worker). Every failure is named by its row (`IndexEntry.name`) and carries its
    moment.

    Args:
        collate: ``[(position, video)] -> DecodedBatch`` for whole videos.
        video_processor, num_frames: what decodes moments.
        batch_size: rows per encoder forward.
        num_workers: decoding workers (0: decode in the calling thread).
        on_error: ``"skip"`` (a row that cannot be read is a failure) or ``"raise"``.
        worker_processes: DataLoader processes instead of threads.
        thread_initializer: run once in every decoding thread (its result's ``stop()`` is called at the end).
    """

    def __init__(self, collate: Callable[[list[tuple[int, Any]]], DecodedBatch], video_processor: Any,
                 num_frames: int, batch_size: int = 8, num_workers: int = 0, on_error: str = "skip",
                 worker_processes: bool = False, thread_initializer: Callable[[], Any] | None = None):
        self.collate, self.video_processor, self.num_frames = collate, video_processor, num_frames
        self.batch_size, self.num_workers, self.on_error = batch_size, num_workers, on_error
        self.worker_processes, self.thread_initializer = worker_processes, thread_initializer

    def __call__(self, entries: list[IndexEntry], positions: list[int]) -> Iterable[DecodedBatch]:
        if any(entries[p].start is not None for p in positions):  # streamed, windows handed out as they complete
            yield from WindowRowDecoder(self.video_processor, self.num_frames, self.batch_size, self.num_workers,
                                        self.on_error)(entries, positions)
            return
        items = [(p, entries[p].video) for p in positions]
        for indices, pixel_values, failures in rebatch(self.decoded(items), self.batch_size):
            yield indices, pixel_values, [dataclasses.replace(
                f, video=entries[f.index].name(f.index), start=entries[f.index].start, end=entries[f.index].end)
                for f in failures]

    def decoded(self, items: list[Any]) -> Iterable[DecodedBatch]:
        """The items decoded one by one (a batch each, by `collate`), in order, ahead of the caller with workers."""
        if self.worker_processes:
            from torch.utils.data import DataLoader  # only the processes' variant needs it

            # one decoded item in flight per worker (the default is 2): decoded pixels are the largest host buffers
            yield from DataLoader(items, batch_size=1, collate_fn=self.collate, num_workers=self.num_workers,
                                  prefetch_factor=1 if self.num_workers else None,
                                  **dataloader_workers(self.num_workers, self.collate))
            return
        with DecodeAhead(lambda j: self.collate([items[j]]), len(items), self.num_workers,
                         max(2 * self.batch_size, self.num_workers), self.thread_initializer) as ahead:
            yield from ahead


# ---------------------------------------------------------------------------------------------------- progress


class JournalProgress:
    """A progress bar on the main process over every process's journals in a store: polls them every ``interval``
    s, so its rate is the rows/s of the whole build; its postfix counts the rows that could not be read."""

    def __init__(self, store: Path, total: int, interval: float = 1.0, enabled: bool = True,
                 description: str = "Indexing"):
        from tqdm.auto import tqdm

        self.store, self.interval, self.enabled = store, interval, enabled
        self.bar = tqdm(total=total, initial=journaled_count(store), unit="video", desc=description,
                        disable=not enabled, dynamic_ncols=True)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _refresh(self) -> None:
        failed = len(journaled_failures(self.store))
        if failed:
            self.bar.set_postfix_str(f"failed {failed}", refresh=False)
        self.bar.update(journaled_count(self.store) - self.bar.n)

    def _poll(self) -> None:
        while not self.stopped.wait(self.interval):
            self._refresh()

    def __enter__(self) -> "JournalProgress":
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stopped.set()
        if self.enabled:
            self.thread.join()
            self._refresh()
        self.bar.close()


# ---------------------------------------------------------------------------------------------------- the build


def describe_plan(plan: RowPlan, given: int, shard_size: int | None, num_processes: int) -> str:
    """What a build is about to do, in one line: its rows and shards, and what an earlier build left."""
    names = [entry.video for entry in plan.rows]
    moments = any(entry.start is not None for entry in plan.rows)
    rows = f"{len(names)} moments of {len(set(map(str, names)))} videos" if moments else f"{len(names)} videos"
    size = f" of up to {shard_size}" if shard_size else ""
    notes = []
    closed = len(plan.shards) - len(plan.open_shards)
    if len(plan.rows) > len(plan.added):  # the home held rows before this build
        notes.append(f"resuming: {closed} of {len(plan.shards)} shards closed")
        unit = "rows" if moments else "videos"
        notes.append(f"of the {given} given {unit}, {len(plan.added)} are new and {given - len(plan.added)} were "
                     "planned before (indexed, or left to a killed run, which this one continues)")
    return (f"Indexing {rows} into {len(plan.shards)} shards{size} on {num_processes} process(es)"
            f"{'; ' if notes else ''}{'; '.join(notes)}.")



@dataclass
class BuildReport:
    """What a build did (`IndexBuild.run`); a store keeps it as ``index_report.json`` (`as_dict`).

    Attributes:
        location: where the index is (``"memory"``, a store's folder).
        rows: rows of the index after the build (encoded and failed).
        given: rows the build was given (after windows were planned).
        added: rows this build added to the index's plan (the others were there, or planned by a killed build).
        handled: rows encoded or failed by this run, on every process.
        failed_now: rows this run could not read.
        failures: every row of the index that could not be read.
        processes, seconds, decode_wait_seconds, encode_seconds, num_workers: how it ran (seconds: the slowest
            process' wall time; the other times are summed over processes).
        settings: what the index is built with.
        extra: what the caller adds (e.g. `train.index`'s files that are not videos).
    """

    location: str
    rows: int
    given: int
    added: int
    handled: int
    failed_now: int
    failures: list[Failure]
    processes: int
    seconds: float
    decode_wait_seconds: float
    encode_seconds: float
    num_workers: int
    settings: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def already(self) -> int:
        """Rows the index held before this run, or that an earlier, killed run wrote."""
        return self.rows - self.handled

    def as_dict(self) -> dict[str, Any]:
        return {
            "store": self.location, "videos": self.rows, "failed": len(self.failures),
            "failures": [failure.as_dict() for failure in self.failures], "given": self.given,
            "added_this_run": self.added, "encoded_this_run": self.handled, "already_in_store": self.already,
            "failed_this_run": self.failed_now, "processes": self.processes, "seconds": self.seconds,
            "videos_per_second": self.handled / self.seconds if self.seconds > 0 else None,
            "decode_wait_seconds": self.decode_wait_seconds, "encode_seconds": self.encode_seconds,
            "num_workers": self.num_workers, "settings": self.settings, **self.extra,
        }

    def summary_lines(self, limit: int = 10) -> list[str]:
        """The build's outcome: its rows, what this run did ("N added, M already indexed, K failed": N + M + K rows,
        a resumed run's rows counted where this run wrote them), and the first `limit` failures."""
        added = self.handled - self.failed_now
        lines = [f"Indexed {self.rows} videos into {self.location} ({added} added, {self.already} already indexed, "
                 f"{self.failed_now} failed this run; {len(self.failures)} in the store could not be decoded, and "
                 "are tried again by the next run)."]
        lines += [f"  failed: {f.video}: {f.code}: {f.reason}" for f in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"  ... and {len(self.failures) - limit} more failed videos (all are in {REPORT_FILE})")
        return lines

    def time_line(self) -> str:
        """Where the time went, which of decoding and encoding to scale, and the settings."""
        decoding_bound = self.decode_wait_seconds > self.encode_seconds
        s = self.settings
        return (f"Time over all processes: waiting for decoding {self.decode_wait_seconds:.1f} s, encoding "
                f"{self.encode_seconds:.1f} s ({'decoding' if decoding_bound else 'encoding'} is the bottleneck: "
                f"scale {'--num-workers' if decoding_bound else 'processes or precision'}). "
                f"Settings: frames {s.get('num_frames')}, R_T {s.get('temporal_reduction')}, "
                f"R_S {s.get('spatial_reduction')}, {s.get('precision')}, tokens {s.get('token_dtype')}.")

    def stats(self) -> dict[str, Any]:
        """The index's `stats` (`encoding.EncodingStats.as_dict` of this run)."""
        return EncodingStats(self.handled, self.seconds, self.decode_wait_seconds, self.encode_seconds,
                             self.num_workers, self.failed_now).as_dict()


@dataclass
class BuildResult:
    """``index``: the searchable index (on the main process; None on the others); ``report``: `BuildReport` (every
    process)."""

    index: Any
    report: BuildReport


class IndexBuild:
    r"""
    One build of an index into a home, from start to end (see the module docstring for its steps).

    Usage (one process, or each process of an `accelerate launch`)::

        settings = build_settings(model, num_frames=8)
        build = IndexBuild(StoreHome("store"), settings, command="my indexing job")
        result = build.run(model, [IndexEntry("a.mp4"), IndexEntry("long.mp4", 0.0, 10.0)], decode)
        result.index.nearest(query_embeddings, k=10)

    Args:
        home: where the rows go (`IndexHome`).
        settings: what the rows are built with (`build_settings`).
        command: how the lock names this build to a writer it refuses.
        shard_size: rows per shard of a store (default: one shard per process).
        replace: the home holds exactly the given rows afterwards (the evaluation's scratch store).
        mirror: a second home that takes every closed shard of a store (a `milvus.MilvusHome`), checked at
            step 2 like the home.
        progress_bar, num_workers, description: the encode loop's (`encoding.encode_videos`).
        finish_options: passed to the home's `finish` (a store: ``first_stage``, ``require_encoded``).
        say: where the build's messages go (default: this module's logger at INFO; `train.index` prints them): the
            plan, a lock taken over, each process' shards.
    """

    def __init__(self, home: IndexHome, settings: dict[str, Any], command: str = "IndexBuild",
                 shard_size: int | None = None, replace: bool = False, mirror: Any = None,
                 progress_bar: bool = False, num_workers: int = 0, description: str = "Encoding videos",
                 finish_options: dict[str, Any] | None = None, say: Callable[[str], None] | None = None):
        self.home, self.settings, self.command = home, dict(settings), command
        self.say = say or logger.info
        self.shard_size, self.replace, self.mirror = shard_size, replace, mirror
        self.progress_bar, self.num_workers, self.description = progress_bar, num_workers, description
        self.finish_options = dict(finish_options or {})

    def run(self, model: Any, entries: list[Any], decode: Decoder, extra_report: dict[str, Any] | None = None
            ) -> BuildResult:
        """Collective. Runs every step; raises on every process when one refuses (the main process' reason)."""
        entries = as_entries(entries)
        main = rank() == 0
        lock = self.home.lock(self.command)
        self.collective(lambda: self.take_lock(lock) if main else None)
        try:
            token = broadcast_object(lock.token)
            self.collective(lambda: None if main or token is None else check_lock_token(lock.directory, token))
            plan = self.collective(lambda: self.prepare(entries) if main else None)
            self.settings = broadcast_object(self.settings)  # what the home holds, on every process
            plan = self.collective(lambda: plan if main else self.home.read_plan())  # every process calls it
            started = time.perf_counter()
            stats = self.collective(lambda: self.encode(model, plan, decode))
            seconds = time.perf_counter() - started
            every = gather_objects((stats.as_dict(), seconds))
            if self.mirror is not None:
                self.collective(lambda: self.upsert_mirror(plan))
            result = self.collective(lambda: self.finish(lock, plan, entries, every, extra_report) if main else None)
            barrier()
        finally:
            if main:
                lock.release()  # a killed build leaves it: the next one recognises it as stale and takes it over
        if result is None:  # the other processes: the report, without the index
            return BuildResult(None, self.report(plan, len(entries), every, [], extra_report))
        return result

    @staticmethod
    def collective(step: Callable[[], Any]) -> Any:
        """Runs `step` here, then stops every process if it raised on any (`distributed.raise_on_every_rank`)."""
        value, error = None, None
        try:
            value = step()
        except Exception as caught:  # noqa: BLE001  re-raised below, on every process
            error = caught
        raise_on_every_rank(error)
        return value

    def take_lock(self, lock: Any) -> None:
        lock.acquire()
        if lock.taken_over:
            self.say(f"Took over the lock of {self.home.location!r} left by a run that is gone "
                     f"({lock.taken_over['reason']}); resuming.")

    def prepare(self, entries: list[IndexEntry]) -> RowPlan:
        """Steps 2 and 3 (main process): the settings check of the home and the mirror, then the plan. The mirror is
        checked first (reached, and its settings compared) so that a refused mirror leaves the home untouched."""
        if self.mirror is not None:
            self.mirror.check_settings(self.settings, create=False)
        self.settings = self.home.check_settings(self.settings, replace=self.replace)
        if self.mirror is not None:
            self.mirror.check_settings(self.settings)
        # a failure is not a permanent verdict (a file repaired, copied in full; a decoder crash that does not
        # recur): the failed rows of the given videos are planned again, by every build. A home that keeps no
        # failures (Milvus) has nothing to retry; a replaced home holds only the given rows, all encoded anew.
        retry = getattr(self.home, "retry_failures", None)
        retried = retry(entries) if retry is not None and not self.replace else 0
        if retried:
            self.say(f"Trying again {retried} rows that could not be read before.")
        plan = self.home.plan(entries, self.shard_size, world_size())
        self.say(describe_plan(plan, len(entries), self.shard_size, world_size()))
        return plan

    def encode(self, model: Any, plan: RowPlan, decode: Decoder) -> EncodingStats:
        """Step 4: this process' open shards, each resumed after what its journal holds."""
        world, me = world_size(), rank()
        mine = [s for s in plan.open_shards if s % world == me]
        total = EncodingStats(0, 0.0, 0.0, 0.0, self.num_workers)
        location = getattr(self.home, "directory", None)
        journal = JournalProgress(location, len(plan.rows), enabled=world > 1 and me == 0 and self.progress_bar,
                                  description=self.description) if world > 1 and location is not None else None
        with journal or contextlib.nullcontext():
            for shard in mine:
                start, stop = plan.shards[shard]
                # a replaced home's old journals belong to other rows: never resumed
                with self.home.writer(shard, start, stop, resume=not self.replace, entries=plan.rows) as writer:
                    todo = [i for i in range(start, stop) if i not in writer.done]
                    batches = decode(plan.rows, todo) if todo else iter(())
                    stats = encode_videos(model, batches, writer, total=len(todo), summary=world == 1,
                                          progress_bar=self.progress_bar and world == 1,
                                          description=self.description, num_workers=self.num_workers)
                total = total.merged(stats)
                if world > 1:
                    self.say(f"[process {me}] shard {shard}: {stats.videos} videos handled this run ({stats.failed} "
                             f"could not be read), {len(range(start, stop)) - len(todo)} already in the store")
        return total

    def upsert_mirror(self, plan: RowPlan) -> None:
        """Step 5: the store's closed shards into the mirror: the main process alone for a mirror one process must
        own (a Milvus Lite file), else each process its shards (all closed: every process has passed the gather
        after its encoding). Upserts: a repeated build rewrites the same rows."""
        world, me = world_size(), rank()
        shards = range(len(plan.shards)) if self.mirror.single_process else \
            range(me, len(plan.shards), world)
        if self.mirror.single_process and me != 0:
            return
        if me != 0:  # the main process checked it: here it is reached, and told the settings its rows carry
            self.mirror.check_settings(self.settings, create=False)
        count = sum(self.mirror.upsert_store_shard(self.home.directory, *plan.shards[s], s, plan.rows) for s in shards)
        logger.info("Upserted %d rows into %s.", count, self.mirror.location)

    def finish(self, lock: Any, plan: RowPlan, entries: list[IndexEntry], every: list[tuple[dict, float]],
               extra_report: dict[str, Any] | None) -> BuildResult:
        """Steps 6 and 7 (main process)."""
        lock.verify()  # still this build's home (its lock was not taken over meanwhile)
        report = self.report(plan, len(entries), every, [], extra_report)
        index = self.home.finish(plan, self.settings, report.stats(), **self.finish_options)
        if index is not None:  # an in-memory home given nothing new has no index to return
            report.failures, report.rows = list(index.failures), len(index)
        if isinstance(self.home, StoreHome):  # the last build's report, a build that found nothing to do included
            write_json_atomically(self.home.directory / REPORT_FILE, report.as_dict())
        return BuildResult(index, report)

    def report(self, plan: RowPlan, given: int, every: list[tuple[dict, float]], failures: list[Failure],
               extra: dict[str, Any] | None) -> BuildReport:
        stats = [part for part, _ in every]
        return BuildReport(
            location=self.home.location, rows=len(plan.rows), given=given, added=len(plan.added),
            handled=sum(s["videos"] for s in stats), failed_now=sum(s["failed"] for s in stats), failures=failures,
            processes=len(every), seconds=max(seconds for _, seconds in every),
            decode_wait_seconds=sum(s["decode_wait_seconds"] for s in stats),
            encode_seconds=sum(s["encode_seconds"] for s in stats), num_workers=self.num_workers,
            settings=self.settings, extra=dict(extra or {}))


__all__ = ["REPORT_FILE", "BuildReport", "BuildResult", "FileDecoder", "IndexBuild", "IndexSettingsError",
           "JournalProgress", "StoreLockedError", "build_settings", "encoder_precision", "window_entries"]
