"""`train/demo.py`: how it starts its training runs, and how it reads the QA run's accuracy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.requirements import require
from processing.short_events import caption, make_videos
from train import demo

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- the QA accuracy


def test_the_qa_accuracy_is_read_from_the_key_the_qa_evaluation_writes():
    """The overall accuracy is `QA_ACCURACY_KEY`, in percent as written: neither the first key that contains
    "accuracy" (a per-type one may come first) nor rescaled when it is at most 1 (0.5% is 0.5%)."""
    from train.evaluation import QA_ACCURACY_KEY

    metrics = {"accuracy_color": 100.0, QA_ACCURACY_KEY: 0.5, "num_questions": 200}
    assert demo.qa_exact_match_percent(metrics) == 0.5
    assert demo.qa_exact_match_percent({QA_ACCURACY_KEY: 1, "accuracy_free": 40.0}) == 1.0


def test_qa_metrics_without_the_accuracy_key_are_refused_naming_it():
    from train.evaluation import QA_ACCURACY_KEY

    with pytest.raises(KeyError, match=f"no '{QA_ACCURACY_KEY}'.*keys: \\['accuracy_color', 'num_questions'\\]"):
        demo.qa_exact_match_percent({"accuracy_color": 50.0, "num_questions": 4})
    with pytest.raises(KeyError, match=QA_ACCURACY_KEY):
        demo.qa_exact_match_percent({QA_ACCURACY_KEY: None})


def test_the_demo_reads_what_the_video_qa_metric_computes():
    """Writer and reader agree: the metric module `evaluate_qa` scores with returns `QA_ACCURACY_KEY` in percent,
    and the demo reports it as is (1 right answer of 200: 0.5%)."""
    require("evaluate")
    from train.evaluation import load_metric

    references = [f"answer {i}" for i in range(200)]
    predictions = references[:1] + ["wrong"] * 199
    result = load_metric("video_qa_accuracy").compute(predictions=predictions, references=references,
                                                      question_types=["color"] * 100 + ["object"] * 100)
    assert demo.qa_exact_match_percent(result) == pytest.approx(100 * 1 / 200)


# ------------------------------------------------------------------------------------------- how runs are started


class _Recorded(Exception):
    """Stops `train_qa` once its command is recorded."""


@pytest.fixture
def decoy_train_package(tmp_path, monkeypatch):
    """A `train` package first on PYTHONPATH that exits with code 97 when imported: what an editable install of
    another checkout amounts to for a script started by path (its sys.path[0] is train/, so `import train.loop`
    finds whichever `train` comes next)."""
    decoy = tmp_path / "decoy"
    (decoy / "train").mkdir(parents=True)
    (decoy / "train" / "__init__.py").write_text("raise SystemExit(97)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(decoy), os.environ.get("PYTHONPATH")])))
    return decoy


def _run_help(command: list[str], cwd, env) -> subprocess.CompletedProcess:
    """The recorded launch with the run's own arguments replaced by ``--help``: it parses no recipe and trains
    nothing, but imports the training module the way the run would."""
    target = command.index("-m", command.index("--num_processes")) + 1
    return subprocess.run(command[: target + 1] + ["--help"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_demo_starts_its_retrieval_runs_as_modules_of_this_checkout(tmp_path, monkeypatch,
                                                                          decoy_train_package):
    """Every run is ``accelerate launch -m train.finetune_retrieval`` from the repository root, so it imports this
    checkout's `train`, even with another `train` on the path (started by path, it would import the decoy)."""
    started = []

    class Finished:
        returncode = 0

        def poll(self):
            return 0

        def kill(self):
            pass

    def record(command, cwd=None, env=None, **kwargs):
        started.append((list(command), cwd, env))
        return Finished()

    with monkeypatch.context() as patched:  # `demo.subprocess` is the subprocess module: undone before _run_help
        patched.setattr(demo.subprocess, "Popen", record)
        demo.train_variants(["a", "b"], tmp_path / "data", tmp_path / "runs", max_steps=1)
    assert len(started) == 2
    for command, cwd, env in started:
        assert Path(cwd) == REPO
        assert command[command.index("-m", command.index("--num_processes")) + 1] == "train.finetune_retrieval"
        assert not any(part.endswith(".py") for part in command)
    command, cwd, env = started[0]
    result = _run_help(command, cwd, env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "--config" in result.stdout


def test_the_demo_starts_its_qa_run_as_a_module_of_this_checkout(tmp_path, monkeypatch, decoy_train_package):
    data = tmp_path / "data"
    data.mkdir()
    videos = make_videos(8, seed=0)
    for split in ("train", "test"):  # the rows `write_qa_splits` reads (no pixels needed)
        rows = [{"video": v.video_path, "text": caption(v), "video_id": v.video_id} for v in videos]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "qa").mkdir()
    started = []

    def record(command, cwd=None, env=None, **kwargs):
        started.append((list(command), cwd, env))
        raise _Recorded

    with monkeypatch.context() as patched, pytest.raises(_Recorded):
        patched.setattr(demo.subprocess, "run", record)
        demo.train_qa(data, tmp_path / "qa", tmp_path / "retrieval")
    (command, cwd, env), = started
    assert Path(cwd) == REPO
    assert command[command.index("-m", command.index("--num_processes")) + 1] == "train.finetune_qa"
    assert not any(part.endswith(".py") for part in command)
    result = _run_help(command, cwd, env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def test_a_script_started_by_path_imports_the_decoy(decoy_train_package):
    """The check above can fail: the old form (``train/finetune_qa.py`` by path) imports the decoy `train`."""
    result = subprocess.run([sys.executable, str(REPO / "train" / "finetune_qa.py"), "--help"], cwd=REPO,
                            env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert result.returncode == 97, result.stdout[-2000:] + result.stderr[-3000:]
