"""Checks that the retrieval evaluation gives the numbers of the evaluations it replaced.

    python -m benchmarks.evaluation_equivalence --model outputs/synthetic/train/final --data outputs/synthetic/data \\
        [--old-commit eeffc78] [--before REV] [--config configuration/synthetic_retrieval.yaml]

Two references:

- ``--old-commit`` (default eeffc78): the in-memory evaluation that the on-disk store replaced (all video tokens in
  memory, `model.rank_videos`/`rank_texts`, recall computed by hand), read from git history (``git show
  OLD_COMMIT:train/evaluation.py``) into a temporary module; it runs with the current model code.
- ``--before REV`` (optional): the whole code base at another commit (e.g. the one before a refactoring), checked out
  into a temporary git worktree and run there in a subprocess, so that nothing of the current code is used.

The current evaluation encodes into an on-disk token store (fp32, then fp16 tokens) and computes the numbers with the
`video_text_retrieval` metric module. All run on the test split, with the recipe's aggregation and without any, and
the R@1/5/10 of both directions are printed side by side; the script exits with 1 if any differs by more than 1e-9.
"""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml


REPO = Path(__file__).resolve().parents[1]

from accelerate import Accelerator

from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.processing_testa import TestaProcessor
from train.evaluation import evaluate_retrieval


KEYS = [f"{direction}_R@{k}" for direction in ("t2v", "v2t") for k in (1, 5, 10)]


def old_evaluation(commit: str):
    """``evaluate_retrieval`` of ``train/evaluation.py`` at ``commit``, loaded as ``train._old_evaluation``."""
    source = subprocess.run(["git", "show", f"{commit}:train/evaluation.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_evaluation.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("train._old_evaluation", path)  # `from .loop import ...` resolves
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.evaluate_retrieval


# Runs in the worktree of `--before` (its own packages come first on the import path: the working directory).
BEFORE_SCRIPT = """
import json, sys, torch, yaml
from pathlib import Path
from accelerate import Accelerator
from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.processing_testa import TestaProcessor
from train.evaluation import evaluate_retrieval
model_dir, data, config = sys.argv[1:4]
recipe = yaml.safe_load(Path(config).read_text()); recipe["data"]["dataset"] = data
processor = TestaProcessor.from_pretrained(model_dir)
results = {}
for label, aggregate in (("with aggregation", True), ("without aggregation", False)):
    model = TestaForVideoTextRetrieval.from_pretrained(model_dir).eval()
    if not aggregate:
        model.set_aggregation(temporal_reduction=0, spatial_reduction=0)
    results[label] = evaluate_retrieval(model, processor, recipe, Accelerator(cpu=True), token_dtype=torch.float32)
print("RESULTS " + json.dumps(results))
"""


def before_evaluation(revision: str, model: str, data: str, config: str) -> dict:
    """The evaluation of the code base at ``revision``, run in a temporary worktree; ``{label: metrics}``."""
    worktree = Path(tempfile.mkdtemp(prefix="testa-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), revision], cwd=REPO, check=True,
                   capture_output=True)
    try:
        result = subprocess.run([sys.executable, "-c", BEFORE_SCRIPT, str(Path(model).resolve()),
                                 str(Path(data).resolve()), str(Path(config).resolve())],
                                cwd=worktree, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the evaluation at {revision} failed:\n{result.stderr[-3000:]}")
        line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
        return json.loads(line[len("RESULTS "):])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
        shutil.rmtree(worktree.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a TestaForVideoTextRetrieval folder (e.g. the demo's)")
    parser.add_argument("--data", required=True, help="its dataset folder (test.jsonl + videos)")
    parser.add_argument("--config", default=str(REPO / "configuration" / "synthetic_retrieval.yaml"))
    parser.add_argument("--old-commit", default="eeffc78",
                        help="a commit with the earlier in-memory train/evaluation.py, or 'none' (it re-ranks only "
                             "k_test candidates and ranks nothing after them: compare with recipes whose k_test "
                             "covers the test split)")
    parser.add_argument("--before", default=None, help="also compare with the whole code base at this commit")
    args = parser.parse_args()
    recipe = yaml.safe_load(Path(args.config).read_text())
    recipe["data"]["dataset"] = args.data
    processor = TestaProcessor.from_pretrained(args.model)
    old = old_evaluation(args.old_commit) if args.old_commit != "none" else None
    before = before_evaluation(args.before, args.model, args.data, args.config) if args.before else None
    worst = 0.0
    columns = ([f"in memory ({args.old_commit})"] if old else []) + ([f"at {args.before}, fp32 tokens"] if before else [])
    columns += ["store, fp32 tokens", "store, fp16 tokens"]
    print("| encoder | metric | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for label, aggregate in (("with aggregation", True), ("without aggregation", False)):
        model = TestaForVideoTextRetrieval.from_pretrained(args.model).eval()
        if not aggregate:
            model.set_aggregation(temporal_reduction=0, spatial_reduction=0)
        accelerator = Accelerator(cpu=True)
        references = [old(model, processor, recipe, accelerator)] if old else []
        references += [before[label]] if before else []
        fp32 = evaluate_retrieval(model, processor, recipe, accelerator, token_dtype=torch.float32)
        fp16 = evaluate_retrieval(model, processor, recipe, accelerator, token_dtype=torch.float16)
        for key in KEYS:
            values = [reference[key] for reference in references] + [fp32[key], fp16[key]]
            print(f"| {label} | {key} | " + " | ".join(f"{value:.3f}" for value in values) + " |")
            worst = max([worst] + [abs(reference[key] - current[key]) for reference in references
                                   for current in (fp32, fp16)])
    print(f"\nlargest difference: {worst:.3g} points")
    sys.exit(0 if worst <= 1e-9 else 1)


if __name__ == "__main__":
    main()
