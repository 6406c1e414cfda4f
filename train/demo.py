"""The built-in demo (`make demo`): at the same encoder compute, more frames with TESTA beat fewer frames without.

    python train/demo.py [--output-dir outputs/demo] [--quick] [--upper-bound] [--seed 0]

Steps (docs/evidence.md's demo section gives the measured wall time; ``--quick``: under 2 minutes):

1. ``python -m processing.short_events`` writes the short-event task (OUTPUT/data): 512 synthetic videos of three
   long colour scenes and 2-3 short flashes that each last 1/20 to 1/10 of the video; families of 4 videos share
   their scenes and differ only in their flashes. Uniform sampling of 8 frames sees about 60% of the flashes, 16 frames
   about 98%.
2. Small TESTA models are trained from scratch with ``configuration/short_events.yaml`` (one ``accelerate launch``
   each, one CPU process each, run side by side so that they share the two cores fairly):

   * (a) 8 frames, no aggregation;
   * (b) 16 frames with temporal and spatial aggregation, at the encoder GMAC of (a) (checked: within 10%);
   * (c) with ``--upper-bound`` only: 16 frames, no aggregation, the upper bound at twice the compute (on an idle
     2-core CPU the demo took 765 s with it against 341 s without, over the 10-minute budget;
     ``benchmarks/frames_vs_compute.py`` runs it).

3. Each model ranks the test split (two-stage retrieval, ``train/evaluation.py``); the table (GMAC, tokens, R@1/5/10
   both directions, wall times) goes to the terminal and to OUTPUT/demo_results.md / .json, and a recall-vs-GMAC
   chart to OUTPUT/recall_vs_gmac.png when matplotlib is installed. OUTPUT/runs/b/final is model (b), a
   ``save_pretrained`` folder that the pipelines load.
4. A small VideoQA head for the QA pipeline and the app's Ask tab (``--no-qa`` skips it): model (b)'s video and
   question encoders with an answer decoder started from its text encoder (`TestaForVideoQA.start_decoder_from_text_encoder`),
   fine-tuned for ``configuration/short_events_qa.yaml``'s 120 steps
   (``--quick``: 20) on three questions per training video read off its paragraph (the colour of the first scene,
   the last scene and the first flash; ``processing.short_events.write_qa_splits``), then scored on the test
   videos' questions (exact match among the training answers, beside chance and the commonest training answer's
   share). OUTPUT/qa/final is a TestaForVideoQA folder.

One seed is one sample: ``benchmarks/frames_vs_compute.py --seeds 3`` repeats this with three training seeds and
reports mean and spread. ``--quick`` trains 30 steps on 128 videos: it shows that everything runs, and its recall
means nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from modeling_testa import TestaForVideoTextRetrieval, TestaVisionConfig
from modeling_testa.flops import count_encoder_gmac

RECIPE = REPO / "configuration" / "short_events.yaml"
QA_RECIPE = REPO / "configuration" / "short_events_qa.yaml"
GMAC_TOLERANCE = 0.10  # (b) must cost within 10% of (a)
# The training runs start as modules (`accelerate launch -m train.X`, working directory: this repository), so that
# they run this checkout's code: a script started by path puts train/ first on sys.path and then imports `train.*`
# and `modeling_testa` from wherever the installed distribution points (another checkout, with an editable install).
RETRIEVAL_MODULE = "train.finetune_retrieval"
QA_MODULE = "train.finetune_qa"


@dataclass(frozen=True)
class Variant:
    """One contender: frames sampled per video and the per-block reductions."""

    key: str
    label: str
    num_frames: int
    temporal_reduction: int
    spatial_reduction: int

    def overrides(self) -> list[str]:
        settings = {"data.num_frames": self.num_frames, "model.vision_config.num_frames": self.num_frames,
                    "model.vision_config.temporal_reduction": self.temporal_reduction,
                    "model.vision_config.spatial_reduction": self.spatial_reduction}
        return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


VARIANTS = {
    "a": Variant("a", "(a) 8 frames, no aggregation", 8, 0, 0),
    "b": Variant("b", "(b) 16 frames + TESTA", 16, 2, 4),
    "c": Variant("c", "(c) 16 frames, no aggregation", 16, 0, 0),
}


def load_recipe(path: Path = RECIPE) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def encoder_cost(variant: Variant, recipe: dict) -> tuple[float, int]:
    """(GMAC per video, output tokens) of the variant's encoder, counted by `count_encoder_gmac`."""
    settings = dict(recipe["model"]["vision_config"])
    settings.update(num_frames=variant.num_frames, temporal_reduction=variant.temporal_reduction,
                    spatial_reduction=variant.spatial_reduction)
    return count_encoder_gmac(TestaVisionConfig(**settings))


def check_equal_compute(recipe: dict, tolerance: float = GMAC_TOLERANCE) -> dict[str, tuple[float, int]]:
    """GMAC and tokens of every variant; raises if (b) is not within `tolerance` of (a)."""
    costs = {key: encoder_cost(v, recipe) for key, v in VARIANTS.items()}
    ratio = costs["b"][0] / costs["a"][0]
    if abs(ratio - 1) > tolerance:
        raise ValueError(f"variant (b) costs {ratio:.2f}x the GMAC of (a); the comparison needs it within "
                         f"{tolerance:.0%}: change VARIANTS or the recipe's vision_config")
    return costs


def run(command: list[str], **kwargs) -> None:
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO, **kwargs)


def make_data(data_dir: Path, num_videos: int, seed: int = 0) -> None:
    if (data_dir / "test.jsonl").is_file() and (data_dir / "metadata.json").is_file():
        settings = json.loads((data_dir / "metadata.json").read_text()).get("settings", {})
        if settings.get("num_videos") == num_videos and settings.get("seed") == seed:
            print(f"data: reusing {data_dir}")
            return
    run([sys.executable, "-m", "processing.short_events", "--output-dir", str(data_dir), "--num-videos",
         str(num_videos), "--seed", str(seed)])


def _last_step(log: Path) -> int:
    try:
        lines = log.read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def train_variants(keys: list[str], data_dir: Path, runs_dir: Path, seed: int = 0, max_steps: int | None = None,
                   processes: int = 1, recipe_path: Path = RECIPE, overrides: tuple[str, ...] = ()) -> dict[str, float]:
    """Trains the variants and returns each run's training wall time (logs: ``runs_dir/<key>.log``, models:
    ``runs_dir/<key>/final``). ``overrides``: more ``--set key=value`` arguments for every run (e.g. the score
    grid).

    ``processes=1``: the runs go side by side, one single-process ``accelerate launch`` each (one thread each), so
    that they share the cores fairly. ``processes=N > 1``: one after the other, each an N-process ``accelerate launch
    --multi_gpu`` run (gloo on CPU).
    """
    from tqdm.auto import tqdm

    recipe = load_recipe(recipe_path)
    threads = "1" if processes == 1 else str(max(1, (os.cpu_count() or 2) // processes))
    env = dict(os.environ, OMP_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    launch += ["--num_processes", "1"] if processes == 1 else ["--multi_gpu", "--num_processes", str(processes)]
    runs_dir.mkdir(parents=True, exist_ok=True)
    steps_per_run = max_steps or _planned_steps(recipe, data_dir)
    bar = tqdm(total=steps_per_run * len(keys), desc=f"training {', '.join(f'({k})' for k in keys)}", unit="step")
    groups = [keys] if processes == 1 else [[k] for k in keys]
    seconds: dict[str, float] = {}
    try:
        for group in groups:
            seconds.update(_train_group(group, launch, env, data_dir, runs_dir, seed, max_steps, recipe_path, bar,
                                        steps_per_run, keys, overrides))
    finally:
        bar.close()
    return seconds


def _train_group(group, launch, env, data_dir, runs_dir, seed, max_steps, recipe_path, bar, steps_per_run, keys,
                 overrides=()):
    procs, started, seconds, logs = {}, {}, {}, {}
    try:
        for key in group:
            out = runs_dir / key
            command = launch + ["-m", RETRIEVAL_MODULE, "--config", str(recipe_path),
                                "--dataset", str(data_dir), "--output-dir", str(out), "--overwrite", "--no-eval",
                                "--set", f"train.seed={seed}", *VARIANTS[key].overrides(), *overrides]
            if max_steps:
                command += ["--max-steps", str(max_steps)]
            if (out / "train_log.jsonl").exists():  # the progress bar reads it (--overwrite deletes it too, later)
                (out / "train_log.jsonl").unlink()
            logs[key] = open(runs_dir / f"{key}.log", "w")
            print(f"+ [{key}] " + " ".join(command[len(launch):]) + f"  > {runs_dir / f'{key}.log'}", flush=True)
            procs[key] = subprocess.Popen(command, cwd=REPO, env=env, stdout=logs[key], stderr=subprocess.STDOUT)
            started[key] = time.perf_counter()
        while procs:
            time.sleep(1.0)
            bar.n = sum(min(steps_per_run, _last_step(runs_dir / k / "train_log.jsonl")) for k in keys)
            bar.refresh()
            for key, proc in list(procs.items()):
                if proc.poll() is None:
                    continue
                seconds[key] = time.perf_counter() - started[key]
                logs[key].close()
                del procs[key]
                if proc.returncode:
                    tail = "".join((runs_dir / f"{key}.log").read_text().splitlines(True)[-15:])
                    raise RuntimeError(f"training run ({key}) failed with exit code {proc.returncode}; the end of "
                                       f"{runs_dir / f'{key}.log'}:\n{tail}")
    finally:
        for proc in procs.values():  # an error or Ctrl-C: stop the other runs too
            proc.kill()
        for log in logs.values():
            log.close()
    return seconds


def train_qa(data_dir: Path, out: Path, retrieval_folder: Path, max_steps: int | None = None) -> dict:
    """Fine-tunes the demo's VideoQA head (step 4 of the module docstring) into ``out`` (the model: ``out/final``)
    and returns its test metrics with the training wall time (``train_seconds``)."""
    from processing.short_events import write_qa_splits

    counts = write_qa_splits(str(data_dir))
    print(f"qa: {counts['train']} training and {counts['test']} test questions in {data_dir}", flush=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--num_processes", "1", "-m", QA_MODULE,
               "--config", str(QA_RECIPE), "--dataset", str(data_dir), "--output-dir", str(out), "--overwrite",
               "--set", f"model.init_from={retrieval_folder}"]
    if max_steps:
        command += ["--max-steps", str(max_steps)]
    started = time.perf_counter()
    with open(out.parent / "qa.log", "w") as log:
        script = command.index("-m", command.index("--num_processes"))
        print("+ " + " ".join(command[script:]) + f"  > {out.parent / 'qa.log'}", flush=True)
        done = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1)),
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "".join((out.parent / "qa.log").read_text().splitlines(True)[-15:])
        raise RuntimeError(f"the QA run failed with exit code {done.returncode}; the end of {out.parent / 'qa.log'}:"
                           f"\n{tail}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {**metrics, "train_seconds": time.perf_counter() - started, "questions": counts,
            "baselines": qa_baselines(data_dir)}


def qa_baselines(data_dir: Path) -> dict:
    """What a head that ignores the video scores on the test questions: chance among the training answers (the
    candidates), and always answering the commonest training answer (`majority`, its share of the test questions)."""
    def answers(split: str) -> list[str]:
        lines = (data_dir / f"qa_{split}.jsonl").read_text().splitlines()
        return [str(json.loads(line)["answer"]) for line in lines if line.strip()]

    train, test = answers("train"), answers("test")
    majority = max(dict.fromkeys(train), key=train.count)
    return {"candidates": len(set(train)), "chance": 100 / len(set(train)), "majority_answer": majority,
            "majority": 100 * sum(answer == majority for answer in test) / len(test)}


def _planned_steps(recipe: dict, data_dir: Path) -> int:
    train_cfg = recipe["train"]
    if train_cfg.get("max_steps"):
        return int(train_cfg["max_steps"])
    rows = sum(1 for line in (data_dir / "train.jsonl").read_text().splitlines() if line.strip())
    return max(1, rows // int(train_cfg["batch_size"])) * int(train_cfg["epochs"])


def evaluate_variant(folder: Path, data_dir: Path, recipe_path: Path = RECIPE) -> dict:
    """Test-split retrieval of a trained folder in this process; adds the test wall time."""
    from accelerate import Accelerator

    from modeling_testa.processing_testa import TestaProcessor
    from train.evaluation import evaluate_retrieval

    recipe = load_recipe(recipe_path)
    recipe["data"]["dataset"] = str(data_dir)
    model = TestaForVideoTextRetrieval.from_pretrained(str(folder)).eval()
    processor = TestaProcessor.from_pretrained(str(folder))
    recipe["data"]["num_frames"] = processor.video_processor.num_frames
    start = time.perf_counter()
    metrics = evaluate_retrieval(model, processor, recipe, Accelerator(cpu=True))
    metrics["test_seconds"] = time.perf_counter() - start
    return metrics


TABLE_HEADER = (
    "| model | frames | R_T | R_S | video tokens | GMAC / video | vs (a) | t2v R@1 | t2v R@5 | t2v R@10 | v2t R@1 | "
    "v2t R@5 | v2t R@10 | train (s) | test (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(key: str, costs: dict, metrics: dict, train_seconds: float) -> str:
    v = VARIANTS[key]
    gmac, tokens = costs[key]
    recall = " | ".join(f"{metrics[f'{d}_R@{k}']:.1f}" for d in ("t2v", "v2t") for k in (1, 5, 10))
    return (f"| {v.label} | {v.num_frames} | {v.temporal_reduction} | {v.spatial_reduction} | {tokens} | "
            f"{gmac:.4f} | {gmac / costs['a'][0]:.2f}x | {recall} | {train_seconds:.0f} | "
            f"{metrics['test_seconds']:.1f} |")


def plot_r1_vs_gmac(points: dict[str, tuple[float, float, float]], path: Path, title: str) -> bool:
    """Writes a recall-vs-GMAC chart: `points` maps a variant key to (GMAC, mean R@1, spread). False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    colours = {"a": "tab:gray", "b": "tab:blue", "c": "tab:orange"}
    for key, (gmac, r1, spread) in points.items():
        ax.errorbar([gmac], [r1], yerr=[spread] if spread else None, fmt="o", color=colours[key], capsize=4,
                    label=VARIANTS[key].label)
        ax.annotate(f"({key})", (gmac, r1), textcoords="offset points", xytext=(7, -3))
    ax.set_xlabel("encoder GMAC per video")
    ax.set_ylabel("text-to-video R@1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def qa_exact_match_percent(metrics: dict) -> float:
    """The overall exact-match accuracy (%) in a QA run's metrics (``metrics.json`` of `train.finetune_qa`): the key
    `train.evaluation.evaluate_qa` writes (`QA_ACCURACY_KEY`, already a percentage). Raises `KeyError` naming the
    key and the keys there when it is missing."""
    from train.evaluation import QA_ACCURACY_KEY

    value = metrics.get(QA_ACCURACY_KEY)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise KeyError(f"The QA metrics have no {QA_ACCURACY_KEY!r} (the overall exact match in percent that "
                       f"train.evaluation.evaluate_qa writes); keys: {sorted(metrics)}.")
    return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=REPO / "outputs" / "demo")
    parser.add_argument("--seed", type=int, default=0, help="training seed (the data is always seed 0)")
    parser.add_argument("--num-videos", type=int, default=512)
    parser.add_argument("--quick", action="store_true",
                        help="128 videos, 30 steps, (a) and (b) only: a smoke run; its recall is not meaningful")
    parser.add_argument("--upper-bound", action="store_true",
                        help="also train (c), 16 frames without aggregation (2x the compute of (a); several more "
                             "minutes on 2 CPU cores)")
    parser.add_argument("--no-qa", action="store_true",
                        help="skip step 4, the small VideoQA head (OUTPUT/qa/final) for the QA pipeline and the app")
    parser.add_argument("--processes", type=int, default=1,
                        help="1: the runs train side by side, one process each (default); N > 1: one after the "
                             "other, N processes each (accelerate launch --multi_gpu)")
    args = parser.parse_args()
    if args.quick and args.upper_bound:
        parser.error("--quick trains (a) and (b) only; drop --upper-bound, or --quick for the full run")
    started = time.perf_counter()
    out = args.output_dir.resolve()
    num_videos, max_steps = (128, 30) if args.quick else (args.num_videos, None)
    keys = ["a", "b", "c"] if args.upper_bound else ["a", "b"]
    if args.quick:
        out = out.with_name(out.name + "_quick")
    recipe = load_recipe()
    costs = check_equal_compute(recipe)

    data_dir = out / "data"
    make_data(data_dir, num_videos)
    train_seconds = train_variants(keys, data_dir, out / "runs", seed=args.seed, max_steps=max_steps,
                                   processes=args.processes)

    torch.set_num_threads(os.cpu_count() or 1)
    results = {key: evaluate_variant(out / "runs" / key / "final", data_dir) for key in keys}
    summary = json.loads((data_dir / "metadata.json").read_text())["seen_share"]
    first = results[keys[0]]
    lines = []
    if args.quick:
        lines += ["**Quick run (`--quick`): 30 training steps on 128 videos. It shows that the pipeline runs; the "
                  "recall below is not meaningful.**", ""]
    lines += [
        f"Short-event retrieval, {first['num_videos']} test videos: chance R@1 = {first['chance_R@1']:.1f}%, "
        f"scene-only R@1 = 25% (families of 4 differ only in their flashes). Uniform sampling sees "
        f"{100 * summary['8']:.0f}% of the flashes with 8 frames and {100 * summary['16']:.0f}% with 16. "
        f"Training seed {args.seed}; "
        + ("the runs trained side by side, one CPU process each." if args.processes == 1 else
           f"the runs trained one after the other, {args.processes} CPU processes each."),
        "",
        TABLE_HEADER,
    ]
    lines += [table_row(key, costs, results[key], train_seconds[key]) for key in keys]
    gain = results["b"]["t2v_R@1"] - results["a"]["t2v_R@1"]
    lines += ["", f"(b) - (a), text-to-video R@1: {gain:+.1f} points at {costs['b'][0] / costs['a'][0]:.2f}x the GMAC "
              "(one seed; `benchmarks/frames_vs_compute.py --seeds 3` gives the spread).",
              f"Model (b) for the pipelines: {out / 'runs' / 'b' / 'final'}"]
    qa = None
    if not args.no_qa:
        qa = train_qa(data_dir, out / "qa", out / "runs" / "b" / "final", max_steps=20 if args.quick else None)
        lines.append(f"VideoQA head for the QA pipeline: {out / 'qa' / 'final'} (model (b)'s encoders and a new answer "
                     f"decoder, trained and scored in {qa['train_seconds']:.0f} s; exact match on the "
                     f"{qa['questions']['test']} test questions: {qa_exact_match_percent(qa):.1f}%; chance among the "
                     f"{qa['baselines']['candidates']} candidate answers {qa['baselines']['chance']:.1f}%, always "
                     f"'{qa['baselines']['majority_answer']}' {qa['baselines']['majority']:.1f}%).")
    lines.append(f"Total demo time: {time.perf_counter() - started:.0f} s.")
    points = {k: (costs[k][0], results[k]["t2v_R@1"], 0.0) for k in keys}
    if plot_r1_vs_gmac(points, out / "recall_vs_gmac.png", f"short-event retrieval, seed {args.seed}"):
        lines.append(f"Chart: {out / 'recall_vs_gmac.png'}")
    table = "\n".join(lines)
    print("\n" + table)
    (out / "demo_results.md").write_text(table + "\n")
    payload = {"seed": args.seed, "quick": args.quick, "processes": args.processes, "costs": costs, "train_seconds": train_seconds,
               "results": results, "qa": qa}
    (out / "demo_results.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
