"""Index a video collection into an on-disk video store, on 1 to N processes, resumably; grow it later.

    python -m train.index --store OUT --remove PATH [PATH ...] [--milvus URI]    # rows out of a store (and Milvus)
    accelerate launch -m train.index --model FOLDER_OR_HUB_ID --videos DIR_OR_LIST_OR_DATASET --store OUT \
        [--precision fp32|bf16|int8|auto] [--backend torch|openvino|onnxruntime|...] [--num-frames N] [--shard-size 256] [--batch-size 8] [--num-workers 2]
        [--window SECONDS [--stride SECONDS]]

(`python -m train.index ...` runs the same on one process.) The videos are sorted and cut into shards of
``--shard-size`` videos; process ``r`` of ``W`` encodes shards ``r, r + W, r + 2W, ...`` with the library's one encode
loop (`testa_search.encoding.encode_videos`) into `video_store.VideoStoreWriter` shards, which journal every batch.
Run the same command again after a crash, a kill or a lost machine and it continues: closed shards are skipped, open
ones continue after their last journaled batch, so no video is encoded twice or skipped.

**Growing a store.** Run it again with ``--videos MORE`` (a folder, list or dataset that may overlap the store):
videos already in the store (by path) are skipped, the ones that failed before are tried again (a failure is not a
permanent verdict: a file may be repaired or copied in full since), the new ones are appended as new shards
(sorted, after the store's own videos; ``index_plan.json`` records the order and the shards) and encoded the same
way, resumably, on any number of processes. Until the grown store is complete, its previous index stays readable.
A store built with other settings (model weights, frames, R_T/R_S, precision, token dtype, window and stride) is
refused, naming what differs, and nothing in it changes; the shard size may differ (it shapes only the new shards).
The same store grows from `VideoTextRetrievalPipeline.encode_videos(store_dir=...)` too: both run the library's one
build (`testa_search.build.IndexBuild`).

A video that cannot be read (missing, empty, not a video, truncated, no frames, decoder crash or timeout) is data, not
an error: it is recorded with its reason (`testa_search.encoding.FAILURE_CODES`), tried again by the next run, never
returned by search, and listed at the end. When every shard is closed, the main process checks them, writes the
store's index (`VideoIndex.load(OUT)` and `python -m train.search` read it) and its first stage, and reports the
videos, the failures, the settings, and the time spent decoding and encoding (`index_report.json`).

One writer per store: the main process takes the store's lock (``writer.lock``, `testa_search.store.lock`) before
anything is written and the other processes of the launch check it; a second run on the same store is refused,
naming the running one, and a lock left by a killed run is taken over (then the run resumes).

**Removing rows.** ``--store OUT --remove PATH ...`` removes every row of those videos (each moment, encoded or
failed), under the store's lock, through the store's own `StoreHome.remove_videos`; the shards that held them are
rewritten and the store's index written anew. With ``--milvus URI`` (and ``--collection``), the Milvus collection
filled from the store loses the same rows, and the store's other rows in it are rewritten with their new positions
(the collection is checked before the store changes). A removal killed halfway leaves a store that is refused as
unfinished: index its videos again into a new folder.

**Moments.** With ``--window`` (and ``--stride``, default: the window) every video is cut into windows
(`testa_search.moments.plan_windows`) and each window is one row of the store, with its start and end; search then
returns moments (``python -m train.search`` prints them as ``h:mm:ss``). The rows are planned from each video's
duration (read from its container, nothing decoded) when it joins the plan, a shard holds whole videos, and a video is
decoded once for all its windows in a shard run (a resumed shard decodes a video again only for its rows not yet
journaled). Resume and growth work as for whole videos; the window and stride are settings of the store.

Inputs (``--videos``): a folder (searched recursively for video files; other files are listed as skipped), a video
file, a list of paths, one per line (a ``.txt`` or ``.lst`` file, or any file with ``--videos-from FILE``; relative
paths are relative to the current directory, as for every shell tool; a list none of whose paths exists is refused
before anything is written), or a dataset written by the builders (a folder with ``<split>.jsonl``, or one
jsonl/parquet file; ``--split`` picks the split, default ``test``). Any other file (e.g. ``README.md``) is refused,
naming these forms.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from modeling_testa.distributed import PeerError
from testa_search.build import FileDecoder, IndexBuild, build_settings, window_entries
from testa_search.homes import StoreHome, as_entries
from testa_search.encoding import DecodeVideos
from testa_runtimes.optimize import BACKENDS, PRECISIONS, optimize_for_inference
from testa_search.moments import check_window_options
from testa_runtimes.registry import auto_precision, isolated_by_default
from testa_search.store.lock import StoreLockedError
from modeling_testa.video_inputs import VIDEO_SUFFIXES, find_video_files
from testa_search.store.video_store import TOKEN_DTYPES
from modeling_testa.process_start import die_with_launcher

RETRIEVAL_HEADS = ("TestaForVideoTextRetrieval", "TestaForPreTraining")
MILVUS_TOKEN_VARIABLE = "MILVUS_TOKEN"
"""The environment variable `--milvus-token` defaults to (a secret need not be on the command line)."""


LIST_SUFFIXES = (".txt", ".lst")
"""The names of a file that ``--videos`` reads as a list of paths (any name with ``--videos-from``)."""
DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
INPUT_FORMS = (f"a folder of videos, a video file, a list of paths ({', '.join(LIST_SUFFIXES)}, or any file with "
               f"--videos-from), or a dataset ({', '.join(DATASET_SUFFIXES)}, or a folder of them)")
"""What ``--videos`` takes, for its help and its refusals."""


def read_video_list(path: Path) -> list[str]:
    """The paths listed in ``path``, one per line (blank lines and ``#`` comments skipped), as absolute paths:
    a relative line is relative to the current directory, as for every shell tool (``ls videos/*.mp4 > list.txt``
    from here, then ``--videos list.txt`` from here). Raises `FileNotFoundError` naming the list, the rule and the
    first lines when none of the listed files exists: nothing is written for such a list."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"the list {str(path)!r} is not UTF-8 text; give one path per line ({INPUT_FORMS}).") from None
    lines = [line.strip() for line in text.splitlines()]
    videos = [os.path.abspath(line) for line in lines if line and not line.startswith("#")]
    if videos and not any(os.path.exists(video) for video in videos):
        shown = ", ".join(repr(line) for line in lines if line and not line.startswith("#"))[:300]
        raise FileNotFoundError(f"none of the {len(videos)} paths listed in {str(path)!r} exists (relative paths are "
                                f"relative to the current directory, {os.getcwd()!r}): {shown}")
    return videos


def collect_videos(source: str | os.PathLike, split: str = "test", as_list: bool = False
                   ) -> tuple[list[str], list[str]]:
    """The videos of ``source`` (sorted, unique) and the files of a folder that were skipped as not videos.
    ``source`` is one of `INPUT_FORMS`; with ``as_list`` (``--videos-from``) it is a list whatever its name.

    Raises `FileNotFoundError` / `ValueError` naming ``source`` when it is missing, of another kind (e.g. a
    README), a list none of whose paths exists, or holds no video."""
    from processing.data import load_split, split_files

    path = Path(source)
    skipped: list[str] = []
    if as_list:
        if not path.is_file():
            raise FileNotFoundError(f"--videos-from {str(source)!r} is not a file (give a file of paths, one a line).")
        videos = read_video_list(path)
    elif path.is_dir() and _has_split(path, split, split_files):
        videos = [str(v) for v in load_split(str(path), split=split)["video"]]
    elif path.is_dir():
        videos, skipped = find_video_files(path)
    elif path.is_file() and path.suffix.lower() in DATASET_SUFFIXES:
        videos = [str(v) for v in load_split(str(path))["video"]]
    elif path.is_file() and path.suffix.lower() in LIST_SUFFIXES:
        videos = read_video_list(path)
    elif path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES:
        videos = [str(path.resolve())]
    elif path.is_file():
        raise ValueError(f"--videos {str(source)!r} is not something to index: give {INPUT_FORMS}.")
    else:
        raise FileNotFoundError(f"--videos {str(source)!r} does not exist (give {INPUT_FORMS}).")
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


def add_milvus_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--milvus``, ``--collection`` and ``--milvus-token``: the options of every command that reaches Milvus."""
    parser.add_argument("--milvus", default=None, help=what)
    parser.add_argument("--collection", default="videos", help="the Milvus collection (default: videos)")
    parser.add_argument("--milvus-token", default=os.environ.get(MILVUS_TOKEN_VARIABLE),
                        help=f"credentials of a secured Milvus server (\"user:password\" or an API key; default: "
                             f"${MILVUS_TOKEN_VARIABLE})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.index", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a retrieval model: saved folder or Hub id (required unless --remove)")
    videos = parser.add_mutually_exclusive_group()
    videos.add_argument("--videos", help=f"what to index: {INPUT_FORMS}. Relative paths in a list are relative to "
                                         "the current directory")
    videos.add_argument("--videos-from", metavar="FILE",
                        help="a file of video paths, one a line, whatever its name (relative to the current directory)")
    parser.add_argument("--store", required=True,
                        help="the store folder (created; an existing one is resumed, and grown by new --videos; "
                             "videos that failed before are tried again)")
    parser.add_argument("--remove", nargs="+", metavar="PATH", default=None,
                        help="remove these videos' rows (every moment of them, encoded or failed) from --store, and "
                             "nothing else (no --model or --videos)")
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
    parser.add_argument("--token-dtype", default=None, choices=sorted(TOKEN_DTYPES),
                        help="dtype of the stored tokens (default: the store's; float16 for a new store)")
    parser.add_argument("--shard-size", type=int, default=256, help="videos per shard (default: 256)")
    parser.add_argument("--batch-size", type=int, default=8, help="videos per encoder forward, per process")
    parser.add_argument("--num-workers", type=int, default=2,
                        help="decoding workers per process: DataLoader processes; with --window, threads that each "
                             "stream one video (with a decoder process of their own)")
    add_milvus_arguments(parser, "also upsert every encoded video into Milvus: a Milvus Lite file (videos.db) or a "
                                 "server or cluster URI (http://host:19530); the tokens stay in --store")
    parser.add_argument("--window", type=float, default=None,
                        help="index moments: windows of this many seconds, one row each (default: whole videos)")
    parser.add_argument("--stride", type=float, default=None, help="seconds between windows (default: --window)")
    args = parser.parse_args(argv)
    if args.remove is not None:
        if args.model or args.videos or args.videos_from:
            parser.error("--remove takes only --store, the paths to remove and the Milvus mirror's options")
        return args
    if not args.model or not (args.videos or args.videos_from):
        parser.error("--model and --videos (or --videos-from) are required")
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
    die_with_launcher()  # a rank ends with its launcher, however the launcher ends (train.loop.main does the same)
    args = parse_args(argv)
    store = Path(args.store)
    if store.exists() and not store.is_dir():
        raise SystemExit(f"error: --store {str(store)!r} is a file; give a folder.")
    if args.remove is not None:
        mirror = (args.milvus, args.collection, args.milvus_token) if args.milvus else None
        return remove_videos(store, args.remove, writer_command(argv, 1), mirror)
    try:  # the same on every process (no collective yet), so every process stops alike
        videos, skipped = collect_videos(args.videos_from or args.videos, args.split, as_list=bool(args.videos_from))
        model, video_processor = load_retrieval_model(args.model)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    num_frames = args.num_frames or video_processor.num_frames
    # without cpu=True, CPU processes under `--multi_gpu` would not join one group
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    # auto: the runtime's choice on this device (a GPU: bf16, captured as CUDA graphs by backend "torch")
    precision = auto_precision(args.backend, accelerator.device.type) if args.precision == "auto" else args.precision
    isolate = isolated_by_default(args.backend, accelerator.device.type) and not args.engine_in_process
    model = optimize_for_inference(model.to(accelerator.device), precision, backend=args.backend, isolate=isolate)
    # the model as it runs (an engine changes the embeddings as the precision does: "int8 (openvino)")
    settings = build_settings(model, num_frames, window=args.window, stride=args.stride, token_dtype=args.token_dtype,
                              model_source=args.model, shard_size=args.shard_size)
    mirror = None
    if args.milvus:
        from testa_search.milvus import MilvusHome

        mirror = MilvusHome(args.milvus, args.collection, token=args.milvus_token)
    try:
        entries = as_entries(videos)
        if args.window is not None:  # every process reads its share of the new videos' durations
            entries = window_entries(entries, args.window, args.stride, skip=StoreHome(store).held_videos())
        decode = FileDecoder(DecodeVideos(video_processor, num_frames), video_processor, num_frames, args.batch_size,
                             args.num_workers, worker_processes=True)
        build = IndexBuild(StoreHome(store), settings, command=writer_command(argv, accelerator.num_processes),
                           shard_size=args.shard_size, mirror=mirror, progress_bar=accelerator.is_main_process,
                           num_workers=args.num_workers, description="Indexing", say=print)
        result = build.run(model, entries, decode, extra_report={"skipped_files": skipped})
    except (StoreLockedError, PeerError, OSError, ValueError) as failure:  # refusals: one line, every process
        message = str(failure)
        raise SystemExit(message if message.startswith("error: ") else f"error: {message}") from None
    if accelerator.is_main_process:
        for line in result.report.summary_lines():
            print(line)
        for file in skipped:
            print(f"  skipped (not a video file): {file}")
        print(result.report.time_line(), flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result.report.as_dict()


def remove_videos(store: Path, paths: list[str], command: str,
                  mirror: tuple[str, str, str | None] | None = None) -> dict[str, Any]:
    """``--remove``: every row of these videos leaves the store (`StoreHome.remove_videos`, under the store's lock)
    and, with ``mirror`` (``--milvus URI``, ``--collection``, ``--milvus-token``), the Milvus collection filled from it
    (`MilvusHome.remove_store_rows`; the mirror is checked before the store changes). Paths are matched as the store
    names its videos: absolute, or relative to the current directory."""
    from testa_search.store.video_store import is_video_store, store_metadata

    if not is_video_store(store):
        raise SystemExit(f"error: --store {str(store)!r} holds no finished video store.")
    wanted = {os.path.abspath(path) for path in paths} | set(paths)
    home, milvus = StoreHome(store), None
    try:
        if mirror is not None:
            from testa_search.milvus import MilvusHome, row_key

            milvus = MilvusHome(*mirror[:2], token=mirror[2])
            milvus.check_mirror_of(dict(store_metadata(store).get("info") or {}))
            rows = home.row_plan(home.stored_plan()).rows
            keys = [row_key(e.name(i), e.start, e.end) for i, e in enumerate(rows) if e.name(i) in wanted]
        removed = home.remove_videos(wanted, command)
        if milvus is not None:
            deleted = milvus.remove_store_rows(store, keys, home.row_plan(home.stored_plan()))
    except (StoreLockedError, OSError, ValueError, ImportError) as failure:  # MilvusHomeError is a ValueError;
        raise SystemExit(f"error: {failure}") from None  # ImportError: --milvus without pymilvus
    missing = [path for path in paths if path not in removed and os.path.abspath(path) not in removed]
    print(f"Removed {len(removed)} videos from {store}" + (f"; not in the store: {', '.join(missing)}" if missing
                                                          else "") + ".")
    if milvus is not None:
        print(f"Removed {deleted} rows from {milvus.location}.")
    return {"store": str(store), "removed": removed, "not_in_store": missing,
            **({"milvus_rows_removed": deleted} if milvus is not None else {})}


def writer_command(argv: list[str] | None, num_processes: int) -> str:
    """How the lock names this run to a refused writer."""
    arguments = sys.argv[1:] if argv is None else argv
    return f"python -m train.index {' '.join(map(str, arguments))} ({num_processes} process(es))"


if __name__ == "__main__":
    main(sys.argv[1:])
