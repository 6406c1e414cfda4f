"""Does the rule that breaks near-ties decide the demo's recall? The demo's model (b) trained and evaluated with one
tie rule each, everything else equal (data, seed, recipe).

    python -m benchmarks.tie_rules [--rules lowest raw seed1 seed2 seed3] [--data outputs/demo/data] \\
        [--output-dir outputs/tie_rules] [--eval-only MODEL_DIR ...] [--json PATH]

Merge decisions are taken on cosines snapped to the model's `score_grid`; equal snapped scores are ties, and the
library sends them to the lowest index (``lowest``). The other rules, for this experiment only:

* ``raw``: no snapping (``score_grid=0``, the library's own setting, saved with the model): near-ties are decided by
  rounding, differently on every runtime;
* ``seedK``: ties broken by a fixed pseudo-random order: a constant offset in [0, 0.45) grid steps per (A token,
  B token) pair, drawn from a generator seeded with K and the set sizes, added to the rounded scores. It is below
  half a step, so it never reorders scores that differ after snapping, and it is the same on every runtime;
* ``nearest``: ties to the B token nearest in position (an offset of minus the distance, scaled below half a step).

``raw`` is trained with ``--set model.vision_config.score_grid=0`` and evaluated with that setting. Every other rule
patches `aggregation.round_to_grid` (the one place where snapped scores are made) in the training process
(``train/finetune_retrieval.py`` with the demo's recipe and model (b)'s overrides, as `train/demo.py` runs it) and in
the evaluation (the demo's test split, `train.evaluation.evaluate_retrieval`), so a model is always evaluated with the
rule it was trained with. ``--eval-only`` evaluates existing model folders with every rule instead (no training).
Training takes a few minutes per rule on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

import modeling_testa.aggregation as aggregation

REPO = Path(__file__).resolve().parent.parent
RULES = ("lowest", "raw", "nearest")  # and seedK for any integer K


def tie_offsets(num_a: int, num_b: int, rule: str) -> torch.Tensor | None:
    """``(num_a, num_b)`` offsets in grid steps added to the rounded scores, all of absolute value below 1/2 (so
    only ties move); None for the library's rule and for raw scores (which have no grid)."""
    if rule in ("lowest", "raw"):
        return None
    a = torch.arange(num_a, dtype=torch.float64)[:, None]
    b = torch.arange(num_b, dtype=torch.float64)[None, :]
    if rule == "nearest":  # A token i sits at position 2i, B token j at 2j + 1
        return (-(2 * a - (2 * b + 1)).abs() / (4 * (num_a + num_b))).float()
    if rule.startswith("seed") and rule[4:].isdigit():
        generator = torch.Generator().manual_seed(int(rule[4:]) * 1000 + num_a * 7 + num_b)
        return (torch.rand(num_a, num_b, generator=generator, dtype=torch.float64) * 0.45).float()
    raise ValueError(f"Unknown tie rule {rule!r}; use one of {RULES} or seedK (K an integer).")


def grid_of(rule: str) -> str:
    """The score grid a model decides on under ``rule`` (`runtime_agreement.grid_value`'s names): ``raw`` is the
    model's own setting ``score_grid=0``; every other rule snaps to the library's default grid."""
    return "off" if rule == "raw" else str(round(-math.log2(aggregation.DEFAULT_SCORE_GRID)))


def apply_rule(rule: str) -> None:
    """Makes this process's matcher break ties with ``rule`` (``raw`` needs nothing here: it is a setting of the
    model, `grid_of`)."""
    tie_offsets(2, 2, rule)  # refuses an unknown rule before anything runs
    if rule == "raw":
        return
    library_round = aggregation.round_to_grid
    cache: dict[tuple, torch.Tensor | None] = {}

    def round_with_rule(scaled: torch.Tensor) -> torch.Tensor:
        rounded = library_round(scaled)
        if scaled.ndim < 2:
            return rounded
        key = (scaled.shape[-2], scaled.shape[-1], scaled.device, scaled.dtype)
        if key not in cache:
            offsets = tie_offsets(scaled.shape[-2], scaled.shape[-1], rule)
            cache[key] = None if offsets is None else offsets.to(scaled.device, scaled.dtype)
        return rounded if cache[key] is None else rounded + cache[key]

    aggregation.round_to_grid = round_with_rule


def evaluate(model_dir: Path, data_dir: Path, rule: str) -> dict:
    """The demo's test-split recall of ``model_dir`` under ``rule`` (run in a fresh process: rules patch globals)."""
    command = [sys.executable, "-m", "benchmarks.tie_rules", "--worker-eval", str(model_dir), "--rule", rule,
               "--data", str(data_dir)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"evaluating {model_dir} with rule {rule} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def train(rule: str, data_dir: Path, output_dir: Path, seed: int) -> Path:
    """Model (b) of the demo trained with ``rule``; returns its final folder."""
    from train.demo import RECIPE, VARIANTS

    out = output_dir / f"b_{rule}"
    command = [sys.executable, "-m", "benchmarks.tie_rules", "--worker-train", "--rule", rule, "--",
               str(REPO / "train" / "finetune_retrieval.py"), "--config", str(RECIPE), "--dataset", str(data_dir),
               "--output-dir", str(out), "--overwrite", "--no-eval", "--set", f"train.seed={seed}",
               *VARIANTS["b"].overrides(),
               *(["--set", "model.vision_config.score_grid=0.0"] if rule == "raw" else [])]
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir / f"b_{rule}.log"
    with open(log_path, "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode:
        raise RuntimeError(f"training with rule {rule} failed (exit code {result.returncode}); see {log_path}")
    return out / "final"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", nargs="+", default=["lowest", "raw", "seed1", "seed2", "seed3"])
    parser.add_argument("--data", type=Path, default=REPO / "outputs" / "demo" / "data")
    parser.add_argument("--output-dir", type=Path, default=REPO / "outputs" / "tie_rules")
    parser.add_argument("--seed", type=int, default=0, help="the training seed (as the demo's)")
    parser.add_argument("--eval-only", nargs="+", type=Path, default=None, metavar="MODEL_DIR")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rule", help=argparse.SUPPRESS)
    parser.add_argument("--worker-eval", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-train", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    # the training worker passes the training script's own arguments after the first "--"
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    rest = argv[split + 1:]
    if rest and not args.worker_train:
        parser.error(f"arguments after '--' are only for the training worker: {rest}")

    if args.worker_eval:  # one evaluation, printed as one JSON line
        from benchmarks.runtime_agreement import evaluate as demo_evaluation

        apply_rule(args.rule)
        metrics = demo_evaluation(args.worker_eval, args.data, grid_of(args.rule))
        print(json.dumps({key: value for key, value in metrics.items() if "_R@" in key and "chance" not in key}))
        return []
    if args.worker_train:  # the demo's training script, run in this process under the rule
        import runpy

        apply_rule(args.rule)
        script, *script_args = rest
        sys.argv = [script, *script_args]
        runpy.run_path(script, run_name="__main__")
        return []

    for rule in args.rules:
        tie_offsets(2, 2, rule)
    rows = []
    models = args.eval_only or []
    for rule in args.rules if not models else []:
        start = time.perf_counter()
        folder = train(rule, args.data, args.output_dir, args.seed)
        rows.append({"trained with": rule, "evaluated with": rule, "train_seconds": time.perf_counter() - start,
                     **evaluate(folder, args.data, rule)})
        print(json.dumps(rows[-1]), flush=True)
    for folder in models:
        for rule in args.rules:
            rows.append({"model": str(folder), "evaluated with": rule, **evaluate(folder, args.data, rule)})
            print(json.dumps(rows[-1]), flush=True)
    print("| trained with | evaluated with | t2v R@1 | t2v R@5 | t2v R@10 | v2t R@1 | v2t R@5 | v2t R@10 |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        recall = " | ".join(f"{row[f'{d}_R@{k}']:.1f}" for d in ("t2v", "v2t") for k in (1, 5, 10))
        print(f"| {row.get('trained with', row.get('model'))} | {row['evaluated with']} | {recall} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
