"""Index a video collection into an on-disk video store, on 1 to N processes, resumably; grow it later.

    accelerate launch -m train.index --model FOLDER_OR_HUB_ID --videos DIR_OR_LIST_OR_DATASET --store OUT \
        [--precision fp32|bf16|int8|auto] [--backend torch|openvino|onnxruntime|...] [--num-frames N] [--shard-size 256] [--batch-size 8] [--num-workers 2]
        [--window SECONDS [--stride SECONDS]]

(`python -m train.index ...` runs the same on one process.) The videos are sorted and cut into shards of
``--shard-size`` videos; process ``r`` of ``W`` encodes shards ``r, r + W, r + 2W, ...`` with the library's one encode
loop (`modeling_testa.indexing.encode_videos`) into `video_store.VideoStoreWriter` shards, which journal every batch.
Run the same command again after a crash, a kill or a lost machine and it continues: closed shards are skipped, open
ones continue after their last journaled batch, so no video is encoded twice or skipped.

**Growing a store.** Run it again with ``--videos MORE`` (a folder, list or dataset that may overlap the store):
videos already in the store (by path, failed ones included) are skipped, the new ones are appended as new shards
(sorted, after the store's own videos; ``index_plan.json`` records the order and the shards) and encoded the same
way, resumably, on any number of processes. Until the grown store is complete, its previous index stays readable.
A store built with other settings (model weights, frames, R_T/R_S, precision, token dtype, shard size) is refused,
naming what differs, and nothing in it changes.

A video that cannot be read (missing, empty, not a video, truncated, no frames, decoder crash or timeout) is data, not
an error: it is recorded with its reason (`modeling_testa.indexing.FAILURE_CODES`), never encoded again, never
returned by search, and listed at the end. When every shard is closed, the main process checks them, writes the
store's index (`VideoIndex.load(OUT)` and `python -m train.search` read it) and its first stage, and reports the
videos, the failures, the settings, and the time spent decoding and encoding (`index_report.json`).

One writer per store: the main process takes the store's lock (``writer.lock``, `modeling_testa.store_lock`) before
anything is written and the other processes of the launch check it; a second run on the same store is refused,
naming the running one, and a lock left by a killed run is taken over (then the run resumes).

**Moments.** With ``--window`` (and ``--stride``, default: the window) every video is cut into windows
(`modeling_testa.moments.plan_windows`) and each window is one row of the store, with its start and end; search then
returns moments (``python -m train.search`` prints them as ``h:mm:ss``). The rows are planned from each video's
duration (read from its container, nothing decoded) when it joins the plan, a shard holds whole videos, and a video is
decoded once for all its windows in a shard run (a resumed shard decodes a video again only for its rows not yet
journaled). Resume and growth work as for whole videos; the window and stride are settings of the store.

Inputs (``--videos``): a folder (searched recursively for video files; other files are listed as skipped), a text
file with one path per line (relative paths are relative to the file), or a dataset written by the builders
(a folder with ``<split>.jsonl``, or one jsonl/parquet file; ``--split`` picks the split, default ``test``).
"""

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from modeling_testa.distributed import raise_on_every_rank
from modeling_testa.index_homes import (
    IndexEntry,
    StoreHome,
    VideoIndexBuilder,
    as_entries,
    window_entries,
    write_json_atomically,
)
from modeling_testa.indexing import SUMMARY_FAILURES, DecodeVideos, EncodingStats
from modeling_testa.inference import BACKENDS, PRECISIONS, optimize_for_inference
from modeling_testa.moments import WindowRowDecoder, check_window_options, probe_duration
from modeling_testa.runtimes import auto_precision, embeddings_label, isolated_by_default
from modeling_testa.store_lock import LOCK_FILE, StoreLock, StoreLockedError, check_lock_token
from modeling_testa.video_index import IndexInfo
from modeling_testa.video_inputs import VIDEO_SUFFIXES, find_video_files
from modeling_testa.video_store import (
    TOKEN_DTYPES,
    is_video_store,
    journaled_count,
    journaled_failures,
    missing_shards,
    read_json_file,
    shard_range,
    store_metadata,
)

SETTINGS_FILE = "index_settings.json"
REPORT_FILE = "index_report.json"
RETRIEVAL_HEADS = ("TestaForVideoTextRetrieval", "TestaForPreTraining")


def collect_videos(source: str | os.PathLike, split: str = "test") -> tuple[list[str], list[str]]:
    """The videos of ``source`` (sorted, unique) and the files of a folder that were skipped as not videos.

    Raises `FileNotFoundError` / `ValueError` naming ``source`` when it is missing or holds no video."""
    from processing.data import load_split, split_files

    path = Path(source)
    skipped: list[str] = []
    if path.is_dir() and _has_split(path, split, split_files):
        videos = [str(v) for v in load_split(str(path), split=split)["video"]]
    elif path.is_dir():
        videos, skipped = find_video_files(path)
    elif path.is_file() and path.suffix in (".jsonl", ".json", ".parquet"):
        videos = [str(v) for v in load_split(str(path))["video"]]
    elif path.is_file():
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        videos = [str((path.parent / line).resolve()) for line in lines if line and not line.startswith("#")]
    else:
        raise FileNotFoundError(f"--videos {str(source)!r} does not exist (give a folder, a list file or a dataset).")
    videos = sorted(set(videos))
    if not videos:
        raise ValueError(f"--videos {str(source)!r} holds no video (looked for {', '.join(VIDEO_SUFFIXES)}"
                         f"{'; skipped ' + str(len(skipped)) + ' other files' if skipped else ''}).")
    return videos, skipped


def _has_split(path: Path, split: str, split_files) -> bool:
    try:
        return bool(split_files(str(path), split))
    except (FileNotFoundError, ValueError):
        return False


def load_retrieval_model(source: str) -> tuple[Any, Any]:
    """The retrieval model and video processor saved in ``source`` (a folder or Hub id). A folder that holds
    another head (e.g. VideoQA) is refused, naming the heads that index."""
    from modeling_testa import TestaConfig, TestaForPreTraining, TestaForVideoTextRetrieval, TestaVideoProcessor

    try:
        config = TestaConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {source!r} is not a TESTA model folder or Hub id: {error}") from None
    architectures = list(getattr(config, "architectures", None) or [])
    head = next((name for name in architectures if name in RETRIEVAL_HEADS), None)
    if head is None:
        raise ValueError(f"--model {source!r} is a {architectures or 'model without architectures'}, not a retrieval "
                         f"model: indexing needs one of {', '.join(RETRIEVAL_HEADS)}.")
    model_class = {"TestaForVideoTextRetrieval": TestaForVideoTextRetrieval,
                   "TestaForPreTraining": TestaForPreTraining}[head]
    return model_class.from_pretrained(source).eval(), TestaVideoProcessor.from_pretrained(source)


def index_settings(model: Any, model_source: str, num_frames: int, precision: str, token_dtype: str,
                   shard_size: int, window: float | None = None, stride: float | None = None) -> dict[str, Any]:
    """What a store is built with (`IndexInfo`, weights hashed, the shard size, and the window and stride of an
    index of moments); a resume or an append must match it exactly (a store of whole videos has window and stride
    None, as stores written before moments existed read)."""
    info = IndexInfo.from_model(model, num_frames, with_weights=True, model=str(model_source), precision=precision,
                                token_dtype=token_dtype)
    return {**info.as_dict(), "shard_size": int(shard_size), "window": window, "stride": stride}


def check_or_write_settings(store: Path, settings: dict[str, Any]) -> bool:
    """Writes ``index_settings.json`` into a new store; for an existing one, raises naming every setting that
    differs. Returns whether the store already existed (a resume or an append)."""
    path = store / SETTINGS_FILE
    if path.is_file():
        saved = read_json_file(path)  # DamagedStoreError naming it when damaged
        differences = [f"{key}: the store has {saved.get(key)!r}, this run {value!r}"
                       for key, value in settings.items() if saved.get(key) != value]
        if differences:
            raise ValueError(f"--store {str(store)!r} was built with other settings; resume or grow it with the same "
                             "ones or use another store:\n  " + "\n  ".join(differences))
        return True
    if is_video_store(store):
        raise ValueError(f"--store {str(store)!r} is a video store that train.index did not build (no "
                         f"{SETTINGS_FILE}; e.g. written by `encode_videos(store_dir=...)` or the evaluation): its "
                         "settings are unknown, so it cannot be grown. Give a new folder.")
    if store.exists() and any(path.name != LOCK_FILE for path in store.iterdir()):
        raise ValueError(f"--store {str(store)!r} is a non-empty folder that is not a video store being indexed "
                         f"(no {SETTINGS_FILE}); give a new or empty folder.")
    store.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, settings)
    return False


def read_plan(store: Path) -> dict[str, Any]:
    """``{"videos": [...], "shards": [[start, stop], ...], "segments": ...}``: the store's rows in order, its shards'
    ranges and, for moments, every row's ``[start, end]`` (`StoreHome.plan`)."""
    return StoreHome(store).plan()


def new_videos(plan: dict[str, Any], videos: list[str]) -> list[str]:
    """``videos`` the plan lacks, in order, each once."""
    known = set(plan["videos"])
    return [video for video in dict.fromkeys(videos) if video not in known]


def planned_entries(plan: dict[str, Any], videos: list[str], window: float | None = None,
                    stride: float | None = None, duration: Callable[[str], float] | None = None
                    ) -> list[IndexEntry]:
    """The rows to plan for ``videos`` (those the plan lacks, in order): whole videos, or with a ``window`` every
    new video's windows (`index_homes.window_entries`, durations from ``duration``, default: probed here)."""
    new = new_videos(plan, videos)
    return as_entries(new) if window is None else window_entries(new, window, stride, duration=duration)


def probe_new_durations(store: Path, videos: list[str], accelerator: Accelerator, gather: Callable = gather_object
                        ) -> Callable[[str], float]:
    """Collective. The durations of the videos the store's plan lacks, read from their containers by every process
    for its contiguous share and gathered on all of them, so that planning the windows of a large folder does not
    keep the other processes waiting at a collective (where they would time out) while one process reads every
    file. Returns a `duration` function for the planning, which raises a probe's error as the probe did."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine: dict[str, float | str] = {}
    error = None
    try:
        new = new_videos(StoreHome(store).plan(), videos)
        start, stop = shard_range(len(new), rank, world)
        for video in new[start:stop]:
            try:
                mine[video] = probe_duration(video)
            except (ValueError, OSError) as failure:
                mine[video] = str(failure)  # planned as one whole-video row, whose decoding says why
    except (OSError, ValueError) as caught:
        error = caught
    raise_on_every_rank(error, accelerator.device)
    parts = gather([mine]) if world > 1 else [mine]
    durations = {video: value for part in parts for video, value in part.items()}

    def duration(video: str) -> float:
        value = durations[video] if video in durations else probe_duration(video)
        if isinstance(value, str):
            raise ValueError(value)
        return value

    return duration


def prepare_store(store: Path, settings: dict[str, Any], videos: list[str], shard_size: int,
                  duration: Callable[[str], float] | None = None) -> tuple[dict[str, Any], list[str], bool]:
    """Checks (or writes) the settings and appends the videos the store lacks to its plan (`StoreHome.append`;
    windows planned from ``duration``, default: probed here). Returns the plan, the videos added to it, and whether
    the store existed. A refused store is left untouched."""
    existed = check_or_write_settings(store, settings)
    home = StoreHome(store)
    entries = planned_entries(home.plan(), videos, settings.get("window"), settings.get("stride"), duration)
    plan, added = home.append(entries, shard_size)
    return plan, list(dict.fromkeys(entries[i].name(i) for i in added)), existed


class JournalProgress:
    """A progress bar on the main process over all processes' journals: polls them every ``interval`` s, so its
    rate is the videos/s of the whole job; its postfix counts the videos that could not be read."""

    def __init__(self, store: Path, total: int, interval: float = 1.0, enabled: bool = True):
        self.store, self.interval, self.enabled = store, interval, enabled
        self.bar = tqdm(total=total, initial=journaled_count(store), unit="video", desc="Indexing",
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


def decode_with_workers(collate: DecodeVideos, batch_size: int, num_workers: int):
    """The builder's ``decode(entries, positions)`` for whole videos: `DecodeVideos` in a `DataLoader` of
    `num_workers` processes. (Moments use `WindowRowDecoder`, which streams each video in threads.)"""

    def decode(entries: list[IndexEntry], positions: list[int]):
        workers = dict(num_workers=num_workers, prefetch_factor=1 if num_workers else None)
        items = [(i, entries[i].video) for i in positions]
        return DataLoader(items, batch_size=batch_size, collate_fn=collate, **workers)

    return decode


def encode_shard(builder: VideoIndexBuilder, entries: list[IndexEntry], shard: int, shard_range: tuple[int, int],
                 decode: Any, num_workers: int) -> tuple[EncodingStats, int]:
    """Encodes what shard ``shard`` (rows ``[start, stop)``) still lacks, resuming after its last journaled batch;
    returns the loop's stats and how many rows it already held. Unreadable videos are recorded as failures."""
    start, stop = shard_range
    return builder.encode(entries, decode, shard=shard, start=start, stop=stop, resume=True, num_workers=num_workers,
                          summary=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.index", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a retrieval model: saved folder or Hub id")
    parser.add_argument("--videos", required=True, help="a folder, a list file, or a builders dataset")
    parser.add_argument("--store", required=True,
                        help="the store folder (created; an existing one is resumed, and grown by new --videos)")
    parser.add_argument("--split", default="test", help="with a dataset: the split to index (default: test)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS + ("auto",),
                        help="encoder precision (default: fp32; auto: the fastest within the quality contract)")
    parser.add_argument("--backend", default="torch", choices=BACKENDS,
                        help="what runs the video encoder (default: torch; openvino/onnxruntime: the exported encoder, "
                             "merging included, cached in $HF_HOME/testa/engines)")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the openvino/onnxruntime engine in this process (default: in a worker process of "
                             "its own, which a crash of the engine cannot take down with the indexing)")
    parser.add_argument("--num-frames", type=int, default=None, help="frames per video (default: the model's)")
    parser.add_argument("--token-dtype", default="float16", choices=sorted(TOKEN_DTYPES),
                        help="dtype of the stored tokens (default: float16)")
    parser.add_argument("--shard-size", type=int, default=256, help="videos per shard (default: 256)")
    parser.add_argument("--batch-size", type=int, default=8, help="videos per encoder forward, per process")
    parser.add_argument("--num-workers", type=int, default=2, help="decoding workers per process (DataLoader processes; with --window, threads, each streaming one video with a decoder process of its own)")
    parser.add_argument("--milvus", default=None,
                        help="also upsert every encoded video into Milvus: a Milvus Lite file (videos.db) or a server "
                             "or cluster URI (http://host:19530); the tokens stay in --store")
    parser.add_argument("--collection", default="videos", help="the Milvus collection (default: videos)")
    parser.add_argument("--window", type=float, default=None,
                        help="index moments: windows of this many seconds, one row each (default: whole videos)")
    parser.add_argument("--stride", type=float, default=None, help="seconds between windows (default: --window)")
    args = parser.parse_args(argv)
    try:
        args.window, args.stride = check_window_options(args.window, args.stride)
    except ValueError as error:
        parser.error(str(error))
    for name in ("shard_size", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.num_workers < 0 or (args.num_frames is not None and args.num_frames < 1):
        parser.error("--num-workers must be >= 0 and --num-frames >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    store = Path(args.store)
    if store.exists() and not store.is_dir():
        raise SystemExit(f"error: --store {str(store)!r} is a file; give a folder.")
    try:  # the same on every process (no collective yet), so every process stops alike
        videos, skipped = collect_videos(args.videos, args.split)
        model, video_processor = load_retrieval_model(args.model)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    num_frames = args.num_frames or video_processor.num_frames
    # without cpu=True, CPU processes under `--multi_gpu` would not join one group
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    # auto: the runtime's choice on this device (a GPU: bf16, captured as CUDA graphs by backend "torch")
    precision = auto_precision(args.backend, accelerator.device.type) if args.precision == "auto" else args.precision
    # an engine changes the embeddings as the precision does: a store records both (as "int8 (openvino)")
    recorded = embeddings_label(args.backend, precision, accelerator.device.type)
    settings = index_settings(model, args.model, num_frames, recorded, args.token_dtype, args.shard_size,
                              args.window, args.stride)
    isolate = isolated_by_default(args.backend, accelerator.device.type) and not args.engine_in_process
    model = optimize_for_inference(model.to(accelerator.device), precision, backend=args.backend, isolate=isolate)
    lock = StoreLock(store, command=writer_command(argv, accelerator.num_processes))
    try:
        return index_into_store(args, store, videos, skipped, model, settings,
                                video_processor, num_frames, accelerator, lock)
    finally:
        lock.release()  # a killed run leaves it: the next run recognises it as stale and takes it over


def writer_command(argv: list[str] | None, num_processes: int) -> str:
    """How the lock names this run to a refused writer."""
    arguments = sys.argv[1:] if argv is None else argv
    return f"python -m train.index {' '.join(map(str, arguments))} ({num_processes} process(es))"


def take_store_lock(lock: StoreLock, accelerator: Accelerator) -> None:
    """Collective. One writer per store: the main process takes the store's lock before anything is written (a
    store held by another run is refused, naming it; a lock left by a killed run is taken over), and the other
    processes of this launch check that the lock they see is the one it took."""
    error = None
    if accelerator.is_main_process:
        try:
            lock.acquire()
            if lock.taken_over:
                print(f"Took over the lock of {str(lock.directory)!r} left by a run that is gone "
                      f"({lock.taken_over['reason']}); resuming.", flush=True)
        except (OSError, StoreLockedError) as caught:
            error = caught
    raise_on_every_rank(error, accelerator.device)
    token = [lock.token]
    if accelerator.num_processes > 1:
        token = broadcast_object_list(token)
        error = None
        if not accelerator.is_main_process:
            try:
                check_lock_token(lock.directory, token[0])
            except StoreLockedError as caught:
                error = caught
        raise_on_every_rank(error, accelerator.device)


def index_into_store(args: argparse.Namespace, store: Path, videos: list[str], skipped: list[str], model: Any,
                     settings: dict[str, Any], video_processor: Any, num_frames: int, accelerator: Accelerator,
                     lock: StoreLock) -> dict[str, Any]:
    """`main` once the model is ready: takes the store's lock, then plans, encodes, checks and finalises."""
    existed, added, error = False, [], None
    try:
        take_store_lock(lock, accelerator)
        # moments: every process reads its share of the new videos' durations (a collective)
        duration = probe_new_durations(store, videos, accelerator) if args.window is not None else None
    except (StoreLockedError, RuntimeError, OSError, ValueError) as failure:
        raise SystemExit(f"error: {failure}") from None
    if accelerator.is_main_process:
        try:
            _, added, existed = prepare_store(store, settings, videos, args.shard_size, duration)
        except (OSError, ValueError) as caught:
            error = caught
    try:  # collective: a refused store stops every process, with the main process' message
        raise_on_every_rank(error, accelerator.device)
    except (ValueError, RuntimeError, OSError) as failure:
        raise SystemExit(f"error: {failure}") from None
    accelerator.wait_for_everyone()
    plan = read_plan(store)  # what the main process wrote (every process sees the store's folder)

    stored = plan["videos"]
    entries = StoreHome.entries(plan)  # every row: a video, or a moment of it
    num_shards = len(plan["shards"])
    home = StoreHome(store, TOKEN_DTYPES[args.token_dtype])
    builder = VideoIndexBuilder(model, home, settings)
    closed = home.closed_shards(num_shards)
    assigned = list(range(accelerator.process_index, num_shards, accelerator.num_processes))
    mine = [s for s in assigned if s not in closed]
    milvus = None
    if args.milvus:
        from modeling_testa.milvus_home import MilvusHome

        milvus = MilvusHome(args.milvus, args.collection, dim=int(settings["projection_dim"]))
    if accelerator.is_main_process:
        notes = []
        if existed:
            notes.append(f"resuming: {len(closed)} of {num_shards} shards closed")
            notes.append(f"{len(videos) - len(added)} of the {len(videos)} given videos already in the store, "
                         f"{len(added)} added")
        if skipped:
            notes.append(f"skipped {len(skipped)} files that are not videos")
        rows = f"{len(stored)} videos" if args.window is None else f"{len(stored)} moments of {len(set(stored))} videos"
        print(f"Indexing {rows} into {num_shards} shards of up to {args.shard_size} on "
              f"{accelerator.num_processes} process(es){'; ' if notes else ''}{'; '.join(notes)}.", flush=True)
    if args.window is not None:  # rows are windows: each video streamed once for its rows, in worker threads
        decode = WindowRowDecoder(video_processor, num_frames, args.batch_size, args.num_workers)
    else:
        decode = decode_with_workers(DecodeVideos(video_processor, num_frames), args.batch_size, args.num_workers)
    totals = {"encoded": 0, "already": 0, "failed": 0, "decode_wait_seconds": 0.0, "encode_seconds": 0.0,
              "seconds": 0.0}
    begin = time.perf_counter()
    with JournalProgress(store, len(stored), enabled=accelerator.is_main_process):
        for shard in mine:
            stats, already_there = encode_shard(builder, entries, shard, tuple(plan["shards"][shard]), decode,
                                                args.num_workers)
            totals["encoded"] += stats.videos
            totals["already"] += already_there
            totals["failed"] += stats.failed
            totals["decode_wait_seconds"] += stats.decode_wait_seconds
            totals["encode_seconds"] += stats.encode_seconds
            print(f"[process {accelerator.process_index}] shard {shard}: {stats.videos} videos handled this run "
                  f"({stats.failed} could not be read), {already_there} already in the store", flush=True)
        if milvus is not None:  # this process' shards, closed now or by an earlier run: upserts, so repeats are harmless
            upserted = sum(milvus.upsert_store_shard(store, *plan["shards"][shard], shard, entries)
                           for shard in assigned)
            print(f"[process {accelerator.process_index}] upserted {upserted} videos into Milvus "
                  f"{args.milvus} ({args.collection})", flush=True)
        totals["seconds"] = time.perf_counter() - begin
        all_totals = gather_object([totals]) if accelerator.num_processes > 1 else [totals]
        accelerator.wait_for_everyone()

    report, error = None, None
    if accelerator.is_main_process:
        try:
            report = finalise_index(store, stored, num_shards, lock, builder, entries, all_totals, skipped, videos,
                                    added, settings)
        except (SystemExit, StoreLockedError, ValueError, OSError) as caught:
            error = caught if isinstance(caught, Exception) else RuntimeError(str(caught))
    try:  # collective: the other processes stop too rather than wait for the main one at the next barrier
        raise_on_every_rank(error, accelerator.device)
    except (RuntimeError, StoreLockedError, ValueError, OSError) as failure:
        message = str(failure)
        raise SystemExit(message if message.startswith("error: ") else f"error: {message}") from None
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report or {}


def finalise_index(store: Path, stored: list[str], num_shards: int, lock: StoreLock, builder: Any, entries: Any,
                   all_totals: list[dict[str, Any]], skipped: list[str], videos: list[str], added: list[int],
                   settings: dict[str, Any]) -> dict[str, Any]:
    """The main process, once every shard is written: checks the shards and the lock, writes the store's index (with
    every row's moment) and its first stage, and reports. Raises `SystemExit` naming what is wrong."""
    missing = missing_shards(store, num_shards)
    if missing:  # only when processes on several machines do not share the store's filesystem
        raise SystemExit(f"error: shards {missing} of {str(store)!r} are not closed: every process must write to "
                         "the same folder (on several machines, a shared filesystem).")
    try:
        lock.verify()  # still this run's store (its lock was not taken over meanwhile)
    except StoreLockedError as lost:
        raise SystemExit(f"error: {lost}") from None
    failed = journaled_failures(store)
    if stored and len(failed) == len(stored):  # nothing to search: no store is published
        reasons = "\n  ".join(f"{f['video']}: {f['reason']}" for f in failed[:10])
        raise SystemExit(f"error: none of the {len(stored)} videos could be read, so {str(store)!r} was not "
                         f"finalised (its journals say why):\n  {reasons}")
    # the store's index (with every row's moment) and its first stage over every video of the (grown) store
    builder.finish(entries, num_shards)
    failures = store_metadata(store)["failures"]
    wall = max(t["seconds"] for t in all_totals)
    encoded_now = sum(t["encoded"] for t in all_totals)
    report = {
        "store": str(store), "videos": len(stored), "failed": len(failures), "failures": failures,
        "skipped_files": skipped, "given": len(videos), "added_this_run": len(added),
        "encoded_this_run": encoded_now, "already_in_store": len(stored) - encoded_now,
        "failed_this_run": sum(t["failed"] for t in all_totals),
        "processes": len(all_totals), "seconds": wall,
        "videos_per_second": encoded_now / wall if wall > 0 else None,
        "decode_wait_seconds": sum(t["decode_wait_seconds"] for t in all_totals),
        "encode_seconds": sum(t["encode_seconds"] for t in all_totals),
        "settings": settings,
    }
    write_json_atomically(store / REPORT_FILE, report)
    print(f"Indexed {len(stored)} videos into {store} ({encoded_now} handled this run, "
          f"{len(stored) - encoded_now} already there; {len(failures)} could not be decoded).")
    for failure in failures[:SUMMARY_FAILURES]:
        print(f"  failed: {failure['video']}: {failure.get('code', 'unknown')}: {failure['reason']}")
    if len(failures) > SUMMARY_FAILURES:
        print(f"  ... and {len(failures) - SUMMARY_FAILURES} more failed videos (all are in {REPORT_FILE})")
    for file in skipped:
        print(f"  skipped (not a video file): {file}")
    decoding_bound = report["decode_wait_seconds"] > report["encode_seconds"]
    print(f"Time over all processes: waiting for decoding {report['decode_wait_seconds']:.1f} s, encoding "
          f"{report['encode_seconds']:.1f} s ({'decoding' if decoding_bound else 'encoding'} is the bottleneck: "
          f"scale {'--num-workers' if decoding_bound else 'processes or precision'}). "
          f"Settings: frames {settings['num_frames']}, R_T {settings['temporal_reduction']}, "
          f"R_S {settings['spatial_reduction']}, {settings['precision']}, tokens {settings['token_dtype']}.",
          flush=True)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
