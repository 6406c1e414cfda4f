"""A training run reports and tidies (issue 52): it ends by printing its metrics and the saved model's path, keeps a
bounded number of checkpoints (``train.keep_checkpoints``), refuses an ``--output-dir`` holding a previous run unless
``--resume-from`` or ``--overwrite`` says what to do, and never appends one run's log to another's.

References: the run's own ``metrics.json`` (the printed line must say the same numbers), the checkpoint folders on
disk, and the logged steps (each step once, in order). Runs in this process (`train.loop.main`), a tiny model on
16 synthetic videos."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.models import TINY_MODEL_RECIPE

from train.finetune_retrieval import TASK
from train.loop import main

REPO = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_MODEL_RECIPE,
    "--set", "data.num_frames=4", "--set", "data.image_size=32", "--set", "data.num_workers=0",
    "--set", "train.batch_size=4", "--set", "eval.batch_size=4", "--set", "eval.k_test=4",
    "--set", "train.save_every=1", "--set", "train.log_every=1",
]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    subprocess.run([sys.executable, "-m", "processing.synthetic", "--output-dir", str(out), "--num-videos", "16",
                    "--seed", "3", "--no-progress", "--min-duration", "30", "--max-duration", "40"],
                   check=True, cwd=REPO, capture_output=True)
    return out


def train(synthetic: Path, out: Path, *extra: str) -> dict:
    return main(TASK, ["--config", str(REPO / "configuration" / "synthetic_retrieval.yaml"), "--dataset",
                       str(synthetic), *TINY, "--output-dir", str(out), *extra])


def logged_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_a_run_reports_keeps_two_checkpoints_and_refuses_to_mix_with_another(synthetic, tmp_path, capsys):
    out = tmp_path / "run"
    metrics = train(synthetic, out, "--max-steps", "3")
    printed = capsys.readouterr().out
    saved = json.loads((out / "metrics.json").read_text())
    assert metrics == saved and "t2v_R@1" in saved
    assert f"t2v_R@1 {saved['t2v_R@1']:.1f}" in printed and f"v2t_R@5 {saved['v2t_R@5']:.1f}" in printed
    assert f"saved the model to {out / 'final'}" in printed and (out / "final" / "model.safetensors").is_file()
    assert checkpoints(out) == ["step_2", "step_3"]  # the default keep_checkpoints=2; step_1 was deleted
    assert logged_steps(out) == [1, 2, 3]

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"holds a previous run \(checkpoints, final, metrics.json, train_log.jsonl"
                                         r".*--resume-from .*--overwrite"):
        train(synthetic, out, "--max-steps", "3")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before

    # resumed from step 2, the run trains step 3 again: the log holds it once
    train(synthetic, out, "--max-steps", "3", "--no-eval", "--resume-from", str(out / "checkpoints" / "step_2"))
    assert logged_steps(out) == [1, 2, 3] and checkpoints(out) == ["step_2", "step_3"]

    # --overwrite starts over: nothing of the old run is left (its log, checkpoints, metrics)
    (out / "notes.txt").write_text("mine")
    train(synthetic, out, "--max-steps", "1", "--no-eval", "--overwrite", "--set", "train.keep_checkpoints=null")
    assert logged_steps(out) == [1] and checkpoints(out) == ["step_1"]
    assert json.loads((out / "metrics.json").read_text()) == {"train_decode_failures": 0}
    assert (out / "notes.txt").read_text() == "mine"  # not a file of the run: left alone
    with pytest.raises(ValueError, match="pass one of them"):
        train(synthetic, out, "--overwrite", "--resume-from", str(out / "checkpoints" / "step_1"))
    with pytest.raises(ValueError, match="keep_checkpoints=0"):
        train(synthetic, tmp_path / "other", "--set", "train.keep_checkpoints=0")
