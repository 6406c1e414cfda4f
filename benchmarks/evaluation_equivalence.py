"""Checks that the store-and-module retrieval evaluation gives the numbers of the evaluation it replaced.

    python -m benchmarks.evaluation_equivalence --model outputs/synthetic/train/final --data outputs/synthetic/data \\
        [--old-commit eeffc78] [--config configuration/synthetic_retrieval.yaml]

The earlier evaluation (all video tokens in memory, `model.rank_videos`/`rank_texts`, recall computed by hand) is read
from git history (``git show OLD_COMMIT:train/evaluation.py``) into a temporary module; it runs with the current model
code. The current one encodes into an on-disk token store (fp32, then fp16 tokens) and computes the numbers with the
`video_text_retrieval` metric module. Both run on the test split, with the recipe's aggregation and without any, and
the R@1/5/10 of both directions are printed side by side; the script exits with 1 if any differs by more than 1e-9.
"""

import argparse
import importlib.util
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a TestaForVideoTextRetrieval folder (e.g. the demo's)")
    parser.add_argument("--data", required=True, help="its dataset folder (test.jsonl + videos)")
    parser.add_argument("--config", default=str(REPO / "configuration" / "synthetic_retrieval.yaml"))
    parser.add_argument("--old-commit", default="eeffc78", help="a commit with the earlier train/evaluation.py")
    args = parser.parse_args()
    recipe = yaml.safe_load(Path(args.config).read_text())
    recipe["data"]["dataset"] = args.data
    processor = TestaProcessor.from_pretrained(args.model)
    old = old_evaluation(args.old_commit)
    worst = 0.0
    print("| encoder | metric | before (in memory) | store, fp32 tokens | store, fp16 tokens |")
    print("|---|---|---|---|---|")
    for label, aggregate in (("with aggregation", True), ("without aggregation", False)):
        model = TestaForVideoTextRetrieval.from_pretrained(args.model).eval()
        if not aggregate:
            model.set_aggregation(temporal_reduction=0, spatial_reduction=0)
        accelerator = Accelerator(cpu=True)
        before = old(model, processor, recipe, accelerator)
        fp32 = evaluate_retrieval(model, processor, recipe, accelerator, token_dtype=torch.float32)
        fp16 = evaluate_retrieval(model, processor, recipe, accelerator, token_dtype=torch.float16)
        for key in KEYS:
            print(f"| {label} | {key} | {before[key]:.3f} | {fp32[key]:.3f} | {fp16[key]:.3f} |")
            worst = max(worst, abs(before[key] - fp32[key]), abs(before[key] - fp16[key]))
    print(f"\nlargest difference: {worst:.3g} points")
    sys.exit(0 if worst <= 1e-9 else 1)


if __name__ == "__main__":
    main()
