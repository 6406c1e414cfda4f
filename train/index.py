"""Index a video collection into an on-disk video store, on 1 to N processes, resumably.

    accelerate launch -m train.index --model FOLDER_OR_HUB_ID --videos DIR_OR_LIST_OR_DATASET --store OUT \
        [--precision fp32|bf16|int8|auto] [--backend torch|openvino|onnxruntime] [--num-frames N] [--shard-size 256] [--batch-size 8] [--num-workers 2]

(`python -m train.index ...` runs the same on one process.) The videos are sorted and cut into shards of
``--shard-size`` videos; process ``r`` of ``W`` encodes shards ``r, r + W, r + 2W, ...`` with the library's one encode
loop (`modeling_testa.indexing.encode_videos`) into `video_store.VideoStoreWriter` shards, which journal every batch.
Run the same command again after a crash, a kill or a lost machine and it continues: closed shards are skipped, open
ones continue after their last journaled batch, so no video is encoded twice or skipped. A store built with other
settings (model, frames, R_T/R_S, precision, token dtype, shard size, videos) is refused, naming what differs.

When every shard is closed, the main process checks them, writes the store's index (`VideoIndex.load(OUT)` and
`python -m train.search` read it) and reports the videos, the ones that could not be decoded (with reasons, never
fatal), the settings, and the time spent decoding and encoding (`index_report.json`).

Inputs (``--videos``): a folder (searched recursively for video files; other files are listed as skipped), a text
file with one path per line (relative paths are relative to the file), or a dataset written by the builders
(a folder with ``<split>.jsonl``, or one jsonl/parquet file; ``--split`` picks the split, default ``test``).
"""

import argparse
import hashlib
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from modeling_testa.distributed import raise_on_every_rank
from modeling_testa.indexing import EncodingStats, encode_videos
from modeling_testa.engines import auto_precision
from modeling_testa.inference import BACKENDS, PRECISIONS, optimize_for_inference
from modeling_testa.video_inputs import VIDEO_SUFFIXES, find_video_files
from modeling_testa.video_store import TOKEN_DTYPES, VideoStoreWriter, finalize_store, missing_shards

from .evaluation import DecodeVideos

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


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names, shapes, dtypes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def index_settings(model: Any, model_source: str, videos: list[str], num_frames: int, precision: str,
                   token_dtype: str, shard_size: int) -> dict[str, Any]:
    """What a store is built with; a resume must match it exactly."""
    vision = model.config.vision_config
    return {
        "model": str(model_source),
        "model_weights_sha256": weights_fingerprint(model),
        "num_frames": int(num_frames),
        "temporal_reduction": list(vision.temporal_reduction_per_layer),
        "spatial_reduction": list(vision.spatial_reduction_per_layer),
        "precision": precision,
        "token_dtype": token_dtype,
        "shard_size": int(shard_size),
        "num_videos": len(videos),
        "videos_sha256": hashlib.sha256("\n".join(videos).encode()).hexdigest(),
    }


def check_or_write_settings(store: Path, settings: dict[str, Any]) -> bool:
    """Writes ``index_settings.json`` into a new store; for an existing one, raises naming every setting that
    differs. Returns whether the store already existed (a resume)."""
    path = store / SETTINGS_FILE
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        differences = [f"{key}: the store has {saved.get(key)!r}, this run {value!r}"
                       for key, value in settings.items() if saved.get(key) != value]
        if differences:
            raise ValueError(f"--store {str(store)!r} was built with other settings; resume with the same ones or use "
                             "another store:\n  " + "\n  ".join(differences))
        return True
    if store.exists() and any(store.iterdir()):
        raise ValueError(f"--store {str(store)!r} is a non-empty folder that is not a video store being indexed "
                         f"(no {SETTINGS_FILE}); give a new or empty folder.")
    store.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(settings, indent=1), encoding="utf-8")
    temporary.replace(path)
    return False


def journaled_count(store: Path) -> int:
    """Videos written or marked failed in all the store's shard journals (for the progress bar)."""
    count = 0
    for journal in store.glob("journal-*.jsonl"):
        for line in journal.read_text(encoding="utf-8").splitlines()[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            count += len(entry["encoded"]) if "encoded" in entry else 1
    return count


class JournalProgress:
    """A progress bar on the main process over all processes' journals: polls them every ``interval`` s, so its
    rate is the videos/s of the whole job."""

    def __init__(self, store: Path, total: int, interval: float = 1.0, enabled: bool = True):
        self.store, self.interval, self.enabled = store, interval, enabled
        self.bar = tqdm(total=total, initial=journaled_count(store), unit="video", desc="Indexing",
                        disable=not enabled, dynamic_ncols=True)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stopped.wait(self.interval):
            self.bar.update(journaled_count(self.store) - self.bar.n)

    def __enter__(self) -> "JournalProgress":
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stopped.set()
        if self.enabled:
            self.thread.join()
            self.bar.update(journaled_count(self.store) - self.bar.n)
        self.bar.close()


def encode_shard(model: Any, videos: list[str], shard: int, shard_size: int, store: Path, collate: DecodeVideos,
                 batch_size: int, num_workers: int, token_dtype: torch.dtype) -> tuple[EncodingStats, int]:
    """Encodes what shard ``shard`` still lacks; returns the loop's stats and how many videos it already held."""
    start, stop = shard * shard_size, min((shard + 1) * shard_size, len(videos))
    with VideoStoreWriter(store, shard, start, stop, token_dtype=token_dtype, resume=True) as writer:
        already = writer.done
        remaining = [(i, videos[i]) for i in range(start, stop) if i not in already]
        loader = DataLoader(remaining, batch_size=batch_size, collate_fn=collate, num_workers=num_workers,
                            prefetch_factor=1 if num_workers else None)
        stats = encode_videos(model, loader, writer, num_workers=num_workers)
    return stats, len(already)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.index", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a retrieval model: saved folder or Hub id")
    parser.add_argument("--videos", required=True, help="a folder, a list file, or a builders dataset")
    parser.add_argument("--store", required=True, help="the store folder (created; an existing one is resumed)")
    parser.add_argument("--split", default="test", help="with a dataset: the split to index (default: test)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS + ("auto",),
                        help="encoder precision (default: fp32; auto: the fastest within the quality contract)")
    parser.add_argument("--backend", default="torch", choices=BACKENDS,
                        help="what runs the video encoder (default: torch; openvino/onnxruntime: the exported encoder, "
                             "merging included, cached in $HF_HOME/testa/engines)")
    parser.add_argument("--num-frames", type=int, default=None, help="frames per video (default: the model's)")
    parser.add_argument("--token-dtype", default="float16", choices=sorted(TOKEN_DTYPES),
                        help="dtype of the stored tokens (default: float16)")
    parser.add_argument("--shard-size", type=int, default=256, help="videos per shard (default: 256)")
    parser.add_argument("--batch-size", type=int, default=8, help="videos per encoder forward, per process")
    parser.add_argument("--num-workers", type=int, default=2, help="decoding worker processes per process")
    args = parser.parse_args(argv)
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
    precision = auto_precision(args.backend) if args.precision == "auto" else args.precision
    # the backend changes the embeddings as the precision does: a store records both (as "int8 (openvino)")
    recorded = precision if args.backend == "torch" else f"{precision} ({args.backend})"
    settings = index_settings(model, args.model, videos, num_frames, recorded, args.token_dtype, args.shard_size)
    # without cpu=True, CPU processes under `--multi_gpu` would not join one group
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = optimize_for_inference(model.to(accelerator.device), precision, backend=args.backend)
    resumed, error = False, None
    if accelerator.is_main_process:
        try:
            resumed = check_or_write_settings(store, settings)
        except ValueError as caught:
            error = caught
    try:  # collective: a refused store stops every process, with the main process' message
        raise_on_every_rank(error, accelerator.device)
    except (ValueError, RuntimeError) as failure:
        raise SystemExit(f"error: {failure}") from None
    accelerator.wait_for_everyone()

    num_shards = math.ceil(len(videos) / args.shard_size)
    closed = set(range(num_shards)) - set(missing_shards(store, num_shards))
    mine = [s for s in range(accelerator.process_index, num_shards, accelerator.num_processes) if s not in closed]
    if accelerator.is_main_process:
        print(f"Indexing {len(videos)} videos into {num_shards} shards of {args.shard_size} on "
              f"{accelerator.num_processes} process(es){'; resuming: ' + str(len(closed)) + ' shards closed' if resumed else ''}"
              f"{'; skipped ' + str(len(skipped)) + ' files that are not videos' if skipped else ''}.", flush=True)
    collate = DecodeVideos(video_processor, num_frames)
    totals = {"encoded": 0, "already": 0, "decode_wait_seconds": 0.0, "encode_seconds": 0.0, "seconds": 0.0}
    begin = time.perf_counter()
    with JournalProgress(store, len(videos), enabled=accelerator.is_main_process):
        for shard in mine:
            stats, already = encode_shard(model, videos, shard, args.shard_size, store, collate, args.batch_size,
                                          args.num_workers, TOKEN_DTYPES[args.token_dtype])
            totals["encoded"] += stats.videos
            totals["already"] += already
            totals["decode_wait_seconds"] += stats.decode_wait_seconds
            totals["encode_seconds"] += stats.encode_seconds
            print(f"[process {accelerator.process_index}] shard {shard}: {stats.videos} videos encoded this run, "
                  f"{already} already in the store", flush=True)
        totals["seconds"] = time.perf_counter() - begin
        all_totals = gather_object([totals]) if accelerator.num_processes > 1 else [totals]
        accelerator.wait_for_everyone()

    report = None
    if accelerator.is_main_process:
        missing = missing_shards(store, num_shards)
        if missing:  # only when processes on several machines do not share the store's filesystem
            raise SystemExit(f"error: shards {missing} of {str(store)!r} are not closed: every process must write to "
                             "the same folder (on several machines, a shared filesystem).")
        finalize_store(store, videos, num_shards, info={**settings, "model_class": type(model).__name__,
                                                          "projection_dim": int(model.config.projection_dim)})
        failures = []
        for shard in range(num_shards):
            failures += json.loads((store / f"shard-{shard:05d}.json").read_text(encoding="utf-8"))["failures"]
        wall = max(t["seconds"] for t in all_totals)
        encoded_now = sum(t["encoded"] for t in all_totals)
        report = {
            "store": str(store), "videos": len(videos), "failed": len(failures),
            "failures": sorted(failures, key=lambda f: f["index"]), "skipped_files": skipped,
            "encoded_this_run": encoded_now, "already_in_store": len(videos) - encoded_now,
            "processes": accelerator.num_processes, "seconds": wall,
            "videos_per_second": encoded_now / wall if wall > 0 else None,
            "decode_wait_seconds": sum(t["decode_wait_seconds"] for t in all_totals),
            "encode_seconds": sum(t["encode_seconds"] for t in all_totals),
            "settings": settings,
        }
        (store / REPORT_FILE).write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(f"Indexed {len(videos)} videos into {store} ({encoded_now} encoded this run, "
              f"{len(videos) - encoded_now} already there; {len(failures)} could not be decoded).")
        for failure in report["failures"]:
            print(f"  failed: {failure['video']}: {failure['reason']}")
        for file in skipped:
            print(f"  skipped (not a video file): {file}")
        print(f"Time over all processes: waiting for decoding {report['decode_wait_seconds']:.1f} s, encoding "
              f"{report['encode_seconds']:.1f} s ({'decoding' if report['decode_wait_seconds'] > report['encode_seconds'] else 'encoding'} "
              f"is the bottleneck: scale {'--num-workers' if report['decode_wait_seconds'] > report['encode_seconds'] else 'processes or precision'}). "
              f"Settings: frames {settings['num_frames']}, R_T {settings['temporal_reduction']}, "
              f"R_S {settings['spatial_reduction']}, {settings['precision']}, tokens {settings['token_dtype']}.",
              flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report or {}


if __name__ == "__main__":
    main(sys.argv[1:])
