"""The built-in demo (`make demo`): synthetic long videos -> 2-process CPU fine-tuning -> retrieval with and without
aggregation -> a table of recall, GMAC and wall time -> a model folder the pipelines load.

    python train/demo.py [--output-dir outputs/demo] [--num-videos 640] [--processes 2] [--max-steps N]

Steps:
1. `python -m processing.synthetic` writes the synthetic long-form dataset (mp4 + jsonl) to OUTPUT/data.
2. `accelerate launch --multi_gpu --num_processes 2 train/finetune_retrieval.py` trains the small model of
   `configuration/synthetic_retrieval.yaml` from scratch on CPU, with a progress bar; OUTPUT/final is its
   `save_pretrained` folder.
3. The test split is ranked twice with the same weights: with the recipe's aggregation and without any
   (`set_aggregation(temporal_reduction=0, spatial_reduction=0)`), and the table is printed and written to
   OUTPUT/demo_results.md (and .json).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from modeling_testa import TestaForVideoTextRetrieval  # noqa: E402
from modeling_testa.flops import count_encoder_gmac  # noqa: E402
from modeling_testa.processing_testa import TestaProcessor  # noqa: E402


def run(command: list[str]) -> None:
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)


def evaluate(folder: Path, data_dir: Path, recipe_path: Path, aggregate: bool) -> dict:
    """Test-split retrieval of the trained folder, in this process (1 process, as a user would run it)."""
    import yaml
    from accelerate import Accelerator

    from train.evaluation import evaluate_retrieval

    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["data"]["dataset"] = str(data_dir)
    model = TestaForVideoTextRetrieval.from_pretrained(str(folder)).eval()
    if not aggregate:
        model.set_aggregation(temporal_reduction=0, spatial_reduction=0)  # online and momentum encoders
    processor = TestaProcessor.from_pretrained(str(folder))
    accelerator = Accelerator(cpu=True)
    start = time.perf_counter()
    metrics = evaluate_retrieval(model, processor, recipe, accelerator)
    metrics["eval_seconds"] = time.perf_counter() - start
    metrics["gmac_per_video"] = count_encoder_gmac(model.config.vision_config)[0]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=REPO / "outputs" / "demo")
    parser.add_argument("--config", type=Path, default=REPO / "configuration" / "synthetic_retrieval.yaml")
    parser.add_argument("--num-videos", type=int, default=640)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--max-steps", type=int, help="override the recipe's training length")
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.output_dir.resolve()
    data_dir = out / "data"

    # 1. Data.
    if not (data_dir / "test.jsonl").is_file():
        run([sys.executable, "-m", "processing.synthetic", "--output-dir", str(data_dir),
             "--num-videos", str(args.num_videos), "--seed", str(args.seed)])

    # 2. Training, with as many CPU processes as asked (gloo).
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    launch += ["--multi_gpu", "--num_processes", str(args.processes)] if args.processes > 1 else ["--num_processes", "1"]
    train = [str(REPO / "train" / "finetune_retrieval.py"), "--config", str(args.config), "--dataset", str(data_dir),
             "--output-dir", str(out / "train"), "--no-eval"]
    if args.max_steps:
        train += ["--max-steps", str(args.max_steps)]
    train_start = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.processes)))
    run(launch + train)
    train_seconds = time.perf_counter() - train_start
    folder = out / "train" / "final"

    # 3. Retrieval with and without aggregation, same weights.
    torch.set_num_threads(os.cpu_count() or 1)
    results = {
        "with aggregation": evaluate(folder, data_dir, args.config, aggregate=True),
        "without aggregation": evaluate(folder, data_dir, args.config, aggregate=False),
    }
    vision = TestaForVideoTextRetrieval.config_class.from_pretrained(str(folder)).vision_config
    chance = results["with aggregation"]["chance_R@1"]
    lines = [
        f"Synthetic long-video retrieval, {results['with aggregation']['num_videos']} test videos "
        f"(chance R@1 = {chance:.1f}%); model trained {train_seconds:.0f} s on {args.processes} CPU processes.",
        "",
        "| encoder | R_T | R_S | video tokens | GMAC / video | GMAC vs none | t2v R@1 | t2v R@5 | t2v R@10 | v2t R@1 | "
        "mean recall | test wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = results["without aggregation"]["gmac_per_video"]
    for name, m in results.items():
        r_t, r_s = (vision.temporal_reduction, vision.spatial_reduction) if name == "with aggregation" else (0, 0)
        lines.append(
            f"| {name} | {r_t} | {r_s} | {m['video_tokens']} | {m['gmac_per_video']:.3f} | "
            f"{100 * m['gmac_per_video'] / base:.0f}% | {m['t2v_R@1']:.1f} | {m['t2v_R@5']:.1f} | "
            f"{m['t2v_R@10']:.1f} | {m['v2t_R@1']:.1f} | {m['mean_recall']:.1f} | {m['eval_seconds']:.1f} |"
        )
    drop = results["without aggregation"]["t2v_R@1"] - results["with aggregation"]["t2v_R@1"]
    lines += ["", f"R@1 (text-to-video) with aggregation minus without: {-drop:+.1f} points.",
              f"Model folder for the pipelines: {folder}", f"Total demo time: {time.perf_counter() - started:.0f} s."]
    table = "\n".join(lines)
    print("\n" + table)
    (out / "demo_results.md").write_text(table + "\n")
    (out / "demo_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
