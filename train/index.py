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
A store built with other settings (model weights, frames, R_T/R_S, precision, token dtype, window and stride) is
refused, naming what differs, and nothing in it changes; the shard size may differ (it shapes only the new shards).
The same store grows from `VideoTextRetrievalPipeline.encode_videos(store_dir=...)` too: both run the library's one
build (`modeling_testa.index_build.IndexBuild`).

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
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from modeling_testa.distributed import PeerError
from modeling_testa.index_build import FileDecoder, IndexBuild, build_settings, window_entries
from modeling_testa.index_homes import StoreHome, as_entries
from modeling_testa.indexing import DecodeVideos
from modeling_testa.inference import BACKENDS, PRECISIONS, optimize_for_inference
from modeling_testa.moments import check_window_options
from modeling_testa.runtimes import auto_precision, isolated_by_default
from modeling_testa.store_lock import StoreLockedError
from modeling_testa.video_inputs import VIDEO_SUFFIXES, find_video_files
from modeling_testa.video_store import TOKEN_DTYPES
from modeling_testa.worker_process import die_with_launcher

RETRIEVAL_HEADS = ("TestaForVideoTextRetrieval", "TestaForPreTraining")
MILVUS_TOKEN_VARIABLE = "MILVUS_TOKEN"
"""The environment variable `--milvus-token` defaults to (a secret need not be on the command line)."""


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
    isolate = isolated_by_default(args.backend, accelerator.device.type) and not args.engine_in_process
    model = optimize_for_inference(model.to(accelerator.device), precision, backend=args.backend, isolate=isolate)
    # the model as it runs (an engine changes the embeddings as the precision does: "int8 (openvino)")
    settings = build_settings(model, num_frames, window=args.window, stride=args.stride, token_dtype=args.token_dtype,
                              model_source=args.model, shard_size=args.shard_size)
    mirror = None
    if args.milvus:
        from modeling_testa.milvus_home import MilvusHome

        mirror = MilvusHome(args.milvus, args.collection, token=args.milvus_token)
    try:
        entries = as_entries(videos)
        if args.window is not None:  # every process reads its share of the new videos' durations
            entries = window_entries(entries, args.window, args.stride, skip=StoreHome(store).stored_plan()["videos"])
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


def writer_command(argv: list[str] | None, num_processes: int) -> str:
    """How the lock names this run to a refused writer."""
    arguments = sys.argv[1:] if argv is None else argv
    return f"python -m train.index {' '.join(map(str, arguments))} ({num_processes} process(es))"


if __name__ == "__main__":
    main(sys.argv[1:])
