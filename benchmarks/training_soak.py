"""Soak test of two-process training on a busy machine: N runs of ``accelerate launch --multi_gpu --num_processes 2``
of `train.finetune_retrieval`, each 3 epochs with ``data.num_workers=2``, while CPU burners keep every core busy.

    python -m benchmarks.training_soak                       # 20 runs, one burner per core
    python -m benchmarks.training_soak --runs 5 --output docs/training_soak.json

This is where issue 49's hang lived: a DataLoader worker forked at an epoch boundary from a rank that ran threads
deadlocked inside ``fork()``, and the run never finished. Each run here crosses two epoch boundaries per process
(new DataLoader workers each epoch) under load, on a tiny model and the synthetic data (`processing.synthetic`, made
once), without evaluation. A run that does not finish within ``--timeout`` seconds (a hang guard, not a measurement)
is killed and counted as hung; every run's outcome is printed as one JSON line, then the totals.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY = {
    "model.vision_config.num_frames": 4, "model.vision_config.image_size": 32, "model.vision_config.patch_size": 8,
    "model.vision_config.hidden_size": 32, "model.vision_config.num_hidden_layers": 2,
    "model.vision_config.num_attention_heads": 2, "model.vision_config.intermediate_size": 64,
    "model.vision_config.temporal_reduction": 1, "model.vision_config.spatial_reduction": 3,
    "model.text_config.hidden_size": 32, "model.text_config.num_hidden_layers": 2,
    "model.text_config.num_attention_heads": 2, "model.text_config.intermediate_size": 64,
    "model.projection_dim": 16, "model.queue_size": 8, "data.num_frames": 4, "data.image_size": 32,
    "data.sampling": "random", "train.batch_size": 4, "train.lr": 1e-3,
}
"""The tiny model and data of `tests/test_loop.py`."""

BURNER = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(100_000))"
"""A busy loop that ends with this script, however it ends."""


def make_data(directory: Path) -> None:
    subprocess.run([sys.executable, "-m", "processing.synthetic", "--output-dir", str(directory), "--num-videos", "16",
                    "--seed", "3", "--no-progress", "--min-duration", "30", "--max-duration", "40"],
                   check=True, cwd=REPO, capture_output=True)


def train_once(data: Path, output: Path, epochs: int, workers: int, timeout: float) -> dict:
    """One two-process training; its outcome (``finished``, ``failed`` with the exit code, or ``hung``)."""
    sets = {**TINY, "data.num_workers": workers, "train.epochs": epochs}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "train.finetune_retrieval", "--config", "configuration/synthetic_retrieval.yaml",
               "--dataset", str(data), "--output-dir", str(output), "--no-eval"]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        log, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)  # the launcher's session: the ranks and their workers with it
        process.communicate()
        return {"outcome": "hung", "seconds": round(time.perf_counter() - start, 1)}
    except BaseException:  # e.g. Ctrl-C: the run is in its own session, which the terminal's signal missed
        os.killpg(process.pid, 9)
        process.wait()
        raise
    steps = 0
    if (output / "train_log.jsonl").is_file():
        steps = len((output / "train_log.jsonl").read_text().splitlines())
    result = {"outcome": "finished" if process.returncode == 0 else "failed", "seconds":
              round(time.perf_counter() - start, 1), "steps": steps}
    if process.returncode:
        result.update(exit_code=process.returncode, log_tail=log[-1500:])
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per process")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1, help="busy-looping processes")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as hung")
    parser.add_argument("--output", help="write the outcomes to this JSON file")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="testa-soak-"))
    burners = []
    try:
        make_data(scratch / "data")
        burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.burners)]
        runs = []
        for run in range(args.runs):
            outcome = train_once(scratch / "data", scratch / f"run{run}", args.epochs, args.workers, args.timeout)
            runs.append({"run": run, **outcome})
            print(json.dumps(runs[-1]), flush=True)
            shutil.rmtree(scratch / f"run{run}", ignore_errors=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    totals = {outcome: sum(r["outcome"] == outcome for r in runs) for outcome in ("finished", "failed", "hung")}
    report = {"command": "python -m benchmarks.training_soak " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "runs": args.runs, "epochs": args.epochs, "workers": args.workers, "burners": args.burners,
              "totals": totals, "outcomes": runs}
    print(json.dumps({k: v for k, v in report.items() if k != "outcomes"}))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
