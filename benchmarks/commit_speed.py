"""Two (or more) commits side by side on one machine: the exported encoder's speed at each commit, as ratios measured
in one run, so that a regression shows whatever the machine and its load.

    python -m benchmarks.commit_speed --commits d257ac3 HEAD [--runtimes openvino-int8 openvino-fp32] \\
        [--rounds 3] [--threads 2] [--frames 32] [--cache-dir outputs/commit_speed]

Every commit is extracted with ``git archive`` into a temporary folder (``worktree`` stands for this checkout as it
is, uncommitted changes included). Every measurement is a process of its own that imports the commit's
`modeling_testa` (only the public API every commit has: `TestaVisionConfig`, `TestaVisionModel`,
`optimize_for_inference`), builds the same encoder (seed 0; ViT-B/16, 224 px, R_T=1, R_S=12 by default; int8
calibrated on the same random videos), loads its export from ``--cache-dir`` (the first round exports and quantizes:
minutes per commit and runtime for ViT-B) and times ``--repeats`` batch-1 forwards after one warm-up forward. The
processes run interleaved, round by round (commit A, commit B, commit A, ...), so that a change of the machine's load
falls on all of them alike; the table gives the median of every commit and runtime over the rounds, in wall time and
in process CPU time (the engines' threads are the process's threads), and each commit's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKTREE = "worktree"
"""The name that stands for this checkout as it is (uncommitted changes included)."""


def extract(commit: str, root: Path) -> tuple[Path, str]:
    """The package tree of ``commit`` extracted into ``root`` (``git archive``), and the commit's short hash;
    `WORKTREE` is this checkout itself."""
    if commit == WORKTREE:
        return REPO, WORKTREE
    short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    folder = root / short
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder, short


def measure(tree: Path, runtime: str, args: argparse.Namespace, cache_dir: Path) -> dict:
    """One measurement in a process of its own that imports `modeling_testa` from ``tree``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", runtime, "--threads", str(args.threads),
               "--frames", str(args.frames), "--image-size", str(args.image_size), "--hidden-size",
               str(args.hidden_size), "--layers", str(args.layers), "--repeats", str(args.repeats), "--cache-dir",
               str(cache_dir)]
    # PYTHONSAFEPATH: the script's own folder is not put first on the path, the commit's tree is
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{runtime} at {tree} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def worker(args: argparse.Namespace) -> None:
    """Builds the encoder with the imported commit's public API, runs it once (export or cache), times it, prints
    ``{"wall": [...], "cpu": [...], "first": s, "package": where modeling_testa was imported from}``."""
    import torch

    import modeling_testa
    from modeling_testa import TestaVisionConfig, TestaVisionModel
    from testa_runtimes import optimize_for_inference

    torch.set_num_threads(args.threads)
    backend, precision = args.worker.split("-")
    torch.manual_seed(0)
    config = TestaVisionConfig(num_frames=args.frames, image_size=args.image_size, hidden_size=args.hidden_size,
                               num_hidden_layers=args.layers, num_attention_heads=max(args.hidden_size // 64, 1),
                               intermediate_size=4 * args.hidden_size, temporal_reduction=1, spatial_reduction=12)
    model = TestaVisionModel(config).eval()
    shape = (args.frames, 3, args.image_size, args.image_size)
    options = {}
    if backend != "torch":
        options["cache_dir"] = args.cache_dir
        if precision == "int8":
            options["calibration"] = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1234))
    optimize_for_inference(model, precision, backend=backend, **options)
    video = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        model(pixel_values=video)
    times = {"first": time.perf_counter() - start, "wall": [], "cpu": [],
             "package": str(Path(modeling_testa.__file__).resolve().parent)}
    for _ in range(args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            model(pixel_values=video)
        times["wall"].append(time.perf_counter() - start)
        times["cpu"].append(time.process_time() - start_cpu)
    print(json.dumps(times))


def table(results: dict[tuple[str, str], dict[str, list[float]]], commits: list[str], runtimes: list[str]) -> str:
    """The markdown table: median wall and CPU time of every commit and runtime, and the ratio to the first commit
    (above 1: slower)."""
    lines = ["| runtime | commit | wall time (s), median | CPU time (s), median | wall vs first | CPU vs first | "
             "rounds |", "|---|---|---|---|---|---|---|"]
    for runtime in runtimes:
        base = {clock: statistics.median(results[(commits[0], runtime)][clock]) for clock in ("wall", "cpu")}
        for commit in commits:
            clocks = results[(commit, runtime)]
            median = {clock: statistics.median(clocks[clock]) for clock in ("wall", "cpu")}
            lines.append(f"| {runtime} | {commit} | {median['wall']:.3f} | {median['cpu']:.3f} | "
                         f"{median['wall'] / base['wall']:.3f}x | {median['cpu'] / base['cpu']:.3f}x | "
                         f"{len(clocks['wall'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", nargs="+", default=["HEAD~1", "HEAD"],
                        help=f"commits to compare (the first is the reference; {WORKTREE!r}: this checkout as it is)")
    parser.add_argument("--runtimes", nargs="+", default=["openvino-int8", "openvino-fp32"],
                        help="backend-precision, e.g. openvino-int8, onnxruntime-fp32, torch-fp32")
    parser.add_argument("--rounds", type=int, default=3, help="processes per commit and runtime, interleaved")
    parser.add_argument("--repeats", type=int, default=1, help="timed forwards per process (after a warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cache-dir", type=Path, default=REPO / "outputs" / "commit_speed",
                        help="exports, one folder per commit (kept: a rerun loads them)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}

    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    packages: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="testa-commits-") as root:
        trees = [extract(commit, Path(root)) for commit in args.commits]
        names = [name for _, name in trees]
        for round_index in range(args.rounds):
            for runtime in args.runtimes:
                for tree, name in trees:
                    times = measure(tree, runtime, args, args.cache_dir / name)
                    packages[name] = times["package"]
                    clocks = results.setdefault((name, runtime), {"wall": [], "cpu": []})
                    clocks["wall"].append(statistics.median(times["wall"]))
                    clocks["cpu"].append(statistics.median(times["cpu"]))
                    print(f"round {round_index + 1}/{args.rounds} {runtime} {name}: wall {clocks['wall'][-1]:.3f} s, "
                          f"CPU {clocks['cpu'][-1]:.3f} s (first forward {times['first']:.1f} s)", flush=True)
    report = table(results, names, args.runtimes)
    load = "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    print(f"\n{args.frames} frames, {args.image_size} px, hidden {args.hidden_size}, {args.layers} layers, batch 1, "
          f"{args.threads} threads; {args.rounds} rounds interleaved, {args.repeats} timed forward(s) each; "
          f"{load}\n\n{report}")
    summary = {"commits": names, "runtimes": args.runtimes, "threads": args.threads, "frames": args.frames,
               "packages": packages, "results": {f"{commit} {runtime}": clocks for (commit, runtime), clocks in results.items()}}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
