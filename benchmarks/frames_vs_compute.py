"""More frames with TESTA vs fewer frames without, at the same encoder compute, over several training seeds.

    python -m benchmarks.frames_vs_compute --seeds 3 [--output docs/frames_vs_compute] [--work-dir outputs/fvc]
        [--score-grid 0]

Runs the demo's comparison (`train/demo.py`: the short-event task, variants (a) 8 frames without aggregation,
(b) 16 frames with TESTA at the GMAC of (a), (c) 16 frames without aggregation) once per training seed on the same
data, and prints mean +- standard deviation and the min-max range of every recall, the per-seed gain (b) - (a), and
whether the smallest per-seed gain exceeds the spread of (a) and (b). Writes OUTPUT.md, OUTPUT.json and OUTPUT.png
(recall against GMAC, error bars = min-max over seeds). About 13 minutes per seed on an idle 2-core CPU (one seed is
`train/demo.py --upper-bound`: 765 s measured). ``--score-grid`` trains and evaluates every model under that merge
rule (the models' config `score_grid`; default: the library's, 2^-10; 0: raw scores); only (b) merges, so only (b)
depends on it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from train.demo import (
    VARIANTS,
    check_equal_compute,
    evaluate_variant,
    load_recipe,
    make_data,
    plot_r1_vs_gmac,
    train_variants,
)

from modeling_testa.aggregation import DEFAULT_SCORE_GRID

METRICS = [f"{d}_R@{k}" for d in ("t2v", "v2t") for k in (1, 5, 10)]


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {std:.1f} ({min(values):.1f}–{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1 (default 3)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs" / "frames_vs_compute")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "frames_vs_compute")
    parser.add_argument("--num-videos", type=int, default=512)
    parser.add_argument("--processes", type=int, default=1, help="as train/demo.py --processes")
    parser.add_argument("--score-grid", type=float, default=None,
                        help="the merge rule the models are trained with (config score_grid; default: the library's)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the seeds OUTPUT.json already holds (a run stopped between seeds) and train the rest")
    parser.add_argument("--replot", action="store_true",
                        help="only re-render OUTPUT.md/.png from OUTPUT.json (e.g. after installing matplotlib)")
    args = parser.parse_args()
    started = time.perf_counter()
    recipe = load_recipe()
    costs = check_equal_compute(recipe)
    keys = list(VARIANTS)
    data_dir = args.work_dir / "data"
    if args.replot:
        saved = json.loads(args.output.with_suffix(".json").read_text())
        per_seed = {int(seed): runs for seed, runs in saved["per_seed"].items()}
        args.seeds = len(per_seed)
        report(args, costs, keys, per_seed, None, started - saved.get("wall_seconds", 0.0), saved.get("seen_share"))
        return
    make_data(data_dir, args.num_videos)

    per_seed: dict[int, dict] = {}
    saved_path = args.output.with_suffix(".json")
    if args.resume and saved_path.exists():
        saved = json.loads(saved_path.read_text())
        rule = DEFAULT_SCORE_GRID if args.score_grid is None else args.score_grid
        if saved.get("score_grid") != rule:  # files written before the rule was recorded say nothing: not resumed
            raise SystemExit(f"{saved_path} records score_grid {saved.get('score_grid')}, not {rule:g}: its seeds "
                             "cannot be resumed under this rule; use another --output")
        per_seed = {int(seed): runs for seed, runs in saved["per_seed"].items() if int(seed) < args.seeds}
        started -= saved.get("wall_seconds", 0.0)
        print(f"resuming: seeds {sorted(per_seed)} kept from {saved_path}", flush=True)
    for seed in range(args.seeds):
        if seed in per_seed:
            continue
        runs = args.work_dir / f"seed{seed}"
        overrides = () if args.score_grid is None else ("--set", f"model.vision_config.score_grid={args.score_grid}")
        seconds = train_variants(keys, data_dir, runs, seed=seed, processes=args.processes, overrides=overrides)
        torch.set_num_threads(torch.get_num_threads())
        per_seed[seed] = {k: {**evaluate_variant(runs / k / "final", data_dir), "train_seconds": seconds[k]}
                          for k in keys}
        row = ", ".join(f"({k}) {per_seed[seed][k]['t2v_R@1']:.1f}" for k in keys)
        print(f"seed {seed}: t2v R@1 {row}", flush=True)

        report(args, costs, keys, per_seed, data_dir, started)


def report(args, costs, keys, per_seed, data_dir, started, seen=None) -> None:
    """Prints and writes the table of the seeds done so far."""
    seen = seen or json.loads((data_dir / "metadata.json").read_text())["seen_share"]
    first = per_seed[0]["a"]
    grid = DEFAULT_SCORE_GRID if args.score_grid is None else args.score_grid
    rule = f"merge decisions on scores snapped to 2^{math.log2(grid):.0f}" if grid else "merge decisions on raw scores"
    lines = [
        f"Short-event retrieval ({first['num_videos']} test videos; chance R@1 {first['chance_R@1']:.1f}%, scene-only "
        f"R@1 25%; uniform sampling sees {100 * seen['8']:.0f}% of the flashes with 8 frames, {100 * seen['16']:.0f}% "
        f"with 16), {len(per_seed)} training seeds on the same data, {rule} (score_grid={grid:g}). Cells: mean ± std "
        "(min–max).",
        "",
        "| model | GMAC / video | vs (a) | tokens | " + " | ".join(METRICS) + " |",
        "|---|---|---|---|" + "---|" * len(METRICS),
    ]
    for k in keys:
        cells = " | ".join(spread([per_seed[s][k][m] for s in per_seed]) for m in METRICS)
        lines.append(f"| {VARIANTS[k].label} | {costs[k][0]:.4f} | {costs[k][0] / costs['a'][0]:.2f}x | "
                     f"{costs[k][1]} | {cells} |")
    gains = [per_seed[s]["b"]["t2v_R@1"] - per_seed[s]["a"]["t2v_R@1"] for s in per_seed]
    range_a = max(per_seed[s]["a"]["t2v_R@1"] for s in per_seed) - min(per_seed[s]["a"]["t2v_R@1"] for s in per_seed)
    range_b = max(per_seed[s]["b"]["t2v_R@1"] for s in per_seed) - min(per_seed[s]["b"]["t2v_R@1"] for s in per_seed)
    beyond = len(per_seed) > 1 and min(gains) > max(range_a, range_b)
    separated = min(per_seed[s]["b"]["t2v_R@1"] for s in per_seed) > max(per_seed[s]["a"]["t2v_R@1"] for s in per_seed)
    lines += [
        "",
        f"(b) − (a), t2v R@1 per seed: {', '.join(f'{g:+.1f}' for g in gains)} (mean {statistics.fmean(gains):+.1f}); "
        f"seed-to-seed range of t2v R@1: (a) {range_a:.1f}, (b) {range_b:.1f} points. "
        + (f"Smallest gain {'exceeds' if beyond else 'does NOT exceed'} the larger range; the worst seed of (b) is "
         f"{'above' if separated else 'NOT above'} the best seed of (a)." if len(per_seed) > 1
         else "One seed so far: no spread yet."),
        f"Wall time {time.perf_counter() - started:.0f} s; training seconds per run (side by side): "
        + ", ".join(f"({k}) {statistics.fmean(per_seed[s][k]['train_seconds'] for s in per_seed):.0f}" for k in keys)
        + ".",
        f"Command: `python -m benchmarks.frames_vs_compute --seeds {args.seeds}"
        + ("" if args.score_grid is None else f" --score-grid {args.score_grid:g}") + "`",
    ]
    text = "\n".join(lines)
    print("\n" + text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(text + "\n")
    args.output.with_suffix(".json").write_text(json.dumps(
        {"costs": costs, "per_seed": per_seed, "gains_t2v_R@1": gains, "gain_beyond_spread": beyond,
         "b_worst_above_a_best": separated, "score_grid": grid,
         "seen_share": seen, "wall_seconds": time.perf_counter() - started}, indent=1))
    points = {}
    for k in keys:
        r1 = [per_seed[s][k]["t2v_R@1"] for s in per_seed]
        points[k] = (costs[k][0], statistics.fmean(r1), (max(r1) - min(r1)) / 2)
    plot_r1_vs_gmac(points, args.output.with_suffix(".png"),
                        f"short-event retrieval, mean of {len(per_seed)} seeds (bars: half the min-max range)")


if __name__ == "__main__":
    main()
