"""The Accelerate training scripts: 2-process CPU training on synthetic data, exact resume, evaluation, final folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from train.evaluation import recall_at_k  # noqa: E402


TINY = [
    "--set", "model.vision_config.num_frames=4", "--set", "model.vision_config.image_size=32",
    "--set", "model.vision_config.patch_size=8", "--set", "model.vision_config.hidden_size=32",
    "--set", "model.vision_config.num_hidden_layers=2", "--set", "model.vision_config.num_attention_heads=2",
    "--set", "model.vision_config.intermediate_size=64", "--set", "model.vision_config.temporal_reduction=1",
    "--set", "model.vision_config.spatial_reduction=3",
    "--set", "model.text_config.hidden_size=32", "--set", "model.text_config.num_hidden_layers=2",
    "--set", "model.text_config.num_attention_heads=2", "--set", "model.text_config.intermediate_size=64",
    "--set", "model.projection_dim=16", "--set", "model.queue_size=8",
    "--set", "data.num_frames=4", "--set", "data.image_size=32", "--set", "data.num_workers=1",
    "--set", "data.sampling=random", "--set", "train.batch_size=4", "--set", "train.lr=1e-3",
    "--set", "train.warmup_ratio=0.25", "--set", "eval.batch_size=4", "--set", "eval.k_test=4",
]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    subprocess.run([sys.executable, "-m", "processing.synthetic", "--output-dir", str(out), "--num-videos", "16",
                    "--seed", "3", "--no-progress", "--min-duration", "30", "--max-duration", "40"],
                   check=True, cwd=REPO, capture_output=True)
    return out


def launch(script: str, args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no"]
    command += ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command + [str(REPO / "train" / script)] + args, cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def test_two_process_training_resumes_exactly(synthetic, tmp_path):
    """Run A trains 4 steps on 2 gloo processes and saves its state at step 2; run B resumes from that state. B's
    steps 3 and 4 must reproduce A's losses: model, optimiser, scheduler, RNG, momentum queues and the position in
    the (shuffled, randomly frame-sampled) data must all be restored."""
    common = ["--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic), *TINY]
    first = tmp_path / "uninterrupted"
    result = launch("finetune_retrieval.py", common + ["--output-dir", str(first), "--max-steps", "4",
                                                     "--set", "train.save_every=2"])
    assert "videos/s per worker" in result.stdout + result.stderr  # the data-pipeline throughput report
    uninterrupted = losses(first)
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["num_videos"] > 0 and 0 <= metrics["t2v_R@1"] <= 100
    assert (first / "final" / "model.safetensors").is_file() and (first / "final" / "processor_config.json").is_file()

    second = tmp_path / "resumed"
    launch("finetune_retrieval.py", common + ["--output-dir", str(second), "--max-steps", "4", "--no-eval",
                                              "--resume-from", str(first / "checkpoints" / "step_2")])
    resumed = losses(second)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6), (step, resumed, uninterrupted)
    assert uninterrupted[3] != uninterrupted[2]  # the comparison is not between constants


def test_qa_training_uses_training_answers(synthetic, tmp_path):
    result = launch("finetune_qa.py", ["--config", "configuration/synthetic_qa.yaml", "--dataset", str(synthetic),
                                       *TINY, "--output-dir", str(tmp_path), "--max-steps", "2"], processes=1)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    train_answers = {json.loads(line)["answer"] for line in (synthetic / "qa_train.jsonl").read_text().splitlines()}
    assert metrics["num_candidate_answers"] == len(train_answers)
    assert 0 <= metrics["accuracy"] <= 100 and metrics["num_questions"] > 0, result.stdout[-500:]


def test_recall_at_k_hand_worked():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8], [0.4, 0.4, 0.1]])
    # query 0: positive 0 ranks 1st; query 1: positive 1 ranks 2nd; query 2: positive 1 ties with 0 -> counts as 2nd
    got = recall_at_k(scores, [{0}, {1}, {1}], ks=(1, 2))
    assert got == {"R@1": pytest.approx(100 / 3), "R@2": pytest.approx(100.0)}


def test_pretraining_streams_and_trains(synthetic, tmp_path):
    """Pretraining (VTC + VTM + CAP) on a streamed dataset: the streamed, sharded path of the loop."""
    launch("pretrain.py", ["--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic), *TINY,
                           "--set", "data.streaming=true", "--set", "data.eval_split=", "--output-dir", str(tmp_path),
                           "--max-steps", "2"], processes=1)
    steps = losses(tmp_path)
    assert sorted(steps) == [1, 2] and all(value > 0 for value in steps.values())
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["architectures"] == ["TestaForPreTraining"]


def test_init_from_our_folder_blip_and_original_checkpoints(synthetic, tmp_path):
    """`--init-from` accepts one of our folders, a transformers BLIP folder (converted on the fly) and an original
    TESTA .pth; the recipe's aggregation settings apply on top of the checkpoint."""
    from heads_helpers import tiny_blip_config
    from test_converters import _original_config, _original_state
    from transformers import BlipForImageTextRetrieval

    from train.finetune_retrieval import TASK
    from train.loop import build_model, load_recipe, parse_args

    blip_dir = tmp_path / "blip"
    BlipForImageTextRetrieval(tiny_blip_config(image_size=32)).save_pretrained(blip_dir)
    original = tmp_path / "original.pth"
    torch.save({"model": _original_state(), "config": _original_config()}, original)
    ours = tmp_path / "ours"
    fresh = build_model(TASK.model_class, load_recipe(parse_args("t", ["--config", "configuration/synthetic_retrieval.yaml", *TINY])))
    fresh.save_pretrained(ours)

    for source in (ours, blip_dir, original):
        tiny_vocab = [] if source == ours else ["--set", "model.enc_token_id=119", "--set", "model.dec_token_id=118"]
        args = parse_args("t", ["--config", "configuration/synthetic_retrieval.yaml", *TINY, "--init-from", str(source),
                                "--set", "model.vision_config.spatial_reduction=2", "--set", "model.alpha=0.3",
                                *tiny_vocab])
        model = build_model(TASK.model_class, load_recipe(args))
        assert isinstance(model, TASK.model_class), source
        assert model.config.vision_config.spatial_reduction == 2 and model.config.alpha == 0.3, source
        assert all(layer.spatial_reduction == 2 for layer in model.vision_model.layers), source
    reloaded = build_model(TASK.model_class, load_recipe(parse_args("t", [
        "--config", "configuration/synthetic_retrieval.yaml", *TINY, "--init-from", str(ours)])))
    torch.testing.assert_close(reloaded.itm_head.weight, fresh.itm_head.weight)
