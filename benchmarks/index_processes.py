"""Indexing throughput of the index command (`train.index`) on 1 and on 2 processes, over the same videos, in one run.

    python -m benchmarks.index_processes                                   # the demo's model (b) and test videos
    python -m benchmarks.index_processes --model DIR --videos DIR --output docs/index_processes.md

Each row indexes the collection from scratch into a temporary store: ``python -m train.index`` (1 process, PyTorch's
default threads) and ``accelerate launch --multi_gpu --num_processes 2`` (2 processes; on a CPU machine each gets
``cores / 2`` threads). The rows alternate for ``--repeats`` rounds and the medians of the command's own report are
shown (videos/s over the encoding phase, seconds waiting for decoding and encoding, summed over processes), so the
ratio comes from one run on one machine. Start-up (imports, model load) is not counted.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path("outputs/demo/runs/b/final")
DEFAULT_VIDEOS = Path("outputs/demo/data/videos")


def index_once(processes: int, model: Path, videos: Path, extra: list[str]) -> dict:
    store = Path(tempfile.mkdtemp(prefix="testa-index-")) / "store"
    cores = os.cpu_count() or 1
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(max(1, cores // processes))}
    if processes == 1:
        command = [sys.executable, "-m", "train.index"]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "-m", "train.index"]
    try:
        subprocess.run([*command, "--model", str(model), "--videos", str(videos), "--store", str(store), *extra],
                       env=env, check=True, capture_output=True, text=True)
        return json.loads((store / "index_report.json").read_text())
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"{' '.join(command)} failed:\n{error.stderr[-3000:]}") from None
    finally:
        shutil.rmtree(store.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--videos", type=Path, default=DEFAULT_VIDEOS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=1, help="decoding workers per process")
    parser.add_argument("--output", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    for path, hint in ((args.model, "run `make demo` first"), (args.videos, "run `make demo` first")):
        if not path.exists():
            raise SystemExit(f"{path} does not exist: {hint}, or pass --model/--videos.")
    extra = ["--num-workers", str(args.num_workers), "--shard-size", "64"]
    rows: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.repeats):
        for processes in (1, 2):
            rows[processes].append(index_once(processes, args.model, args.videos, extra))
    lines = [
        f"Index command throughput ({args.videos}, {rows[1][0]['videos']} videos; model {args.model}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; median of {args.repeats}; "
        f"`--num-workers {args.num_workers}` per process)",
        "",
        "| processes | videos/s | waiting for decoding (s, all processes) | encoding (s, all processes) |",
        "|---|---|---|---|",
    ]
    speed = {}
    for processes, reports in rows.items():
        speed[processes] = statistics.median(r["videos_per_second"] for r in reports)
        decode = statistics.median(r["decode_wait_seconds"] for r in reports)
        encode = statistics.median(r["encode_seconds"] for r in reports)
        lines.append(f"| {processes} | {speed[processes]:.1f} | {decode:.2f} | {encode:.2f} |")
    lines += ["", f"2 processes / 1 process: {speed[2] / speed[1]:.2f}x", "",
              f"Command: `python -m benchmarks.index_processes --repeats {args.repeats} --num-workers "
              f"{args.num_workers}`"]
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
