"""The Accelerate training scripts: 2-process CPU training on synthetic data, exact resume, evaluation, final folder."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.models import TINY_MODEL_RECIPE

REPO = Path(__file__).resolve().parents[1]


TINY = [
    *TINY_MODEL_RECIPE,
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


def launch(script, args: list[str], processes: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no"]
    command += ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    if isinstance(script, str) and script.startswith("train."):  # the module form: accelerate launch -m train.X
        target = ["-m", script]
    else:  # the documented script path
        target = [str(script if isinstance(script, Path) else REPO / "train" / script)]
    result = subprocess.run(command + target + args, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {row["step"]: row[key] for row in rows}


# The retrieval task with a probe: every process appends, per micro-batch, its own loss, a draw from its global RNG
# (the stream that dropout masks and hard negatives use) and the video keys it trained on.
PROBE = """
import dataclasses, json, os, sys, torch
from train.finetune_retrieval import TASK, compute_loss
from train.loop import main

def probed(model, batch, warmup_progress):
    loss = compute_loss(model, batch, warmup_progress)
    record = {{"loss": loss.item(), "draw": torch.rand(()).item(), "keys": batch["video_key"]}}
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{{os.environ['RANK']}}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\\n")
    return loss

if __name__ == "__main__":  # DataLoader workers import this script (forkserver)
    main(dataclasses.replace(TASK, compute_loss=probed))
"""


def probes(directory: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_two_process_training_resumes_exactly(synthetic, tmp_path, streaming):
    """Run A trains 4 steps on 2 gloo processes (crossing an epoch boundary: 12 training rows, 4 per step) and saves
    its state at step 2; run B resumes from that state. On each process, B's per-step losses, RNG draws and rows must
    reproduce A's (1e-6): model, optimiser, scheduler, per-process RNG, momentum queues and the position in the
    (shuffled, randomly frame-sampled, possibly streamed) data must all be restored. The two processes draw
    different random numbers, and the learning rates follow warmup_start_lr -> lr -> min_lr."""
    script = tmp_path / "probed_retrieval.py"
    script.write_text(PROBE.format())
    common = ["--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic), *TINY,
              "--set", f"data.streaming={str(streaming).lower()}", "--set", "train.warmup_start_lr=2e-4",
              "--set", "train.min_lr=1e-4", "--set", "train.log_every=1", "--max-steps", "4"]
    first, second = tmp_path / "uninterrupted", tmp_path / "resumed"
    for directory in (first, second):
        directory.mkdir()
    result = launch(script, common + ["--output-dir", str(first), "--set", "train.save_every=2"]
                    + ([] if not streaming else ["--no-eval"]), env={"PROBE_DIR": str(first)})
    assert "videos/s per worker" in result.stdout + result.stderr  # the data-pipeline throughput report
    uninterrupted = losses(first)
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    assert (first / "final" / "model.safetensors").is_file() and (first / "final" / "processor_config.json").is_file()
    if not streaming:
        metrics = json.loads((first / "metrics.json").read_text())
        test_videos = {json.loads(line)["video_id"] for line in (synthetic / "test.jsonl").read_text().splitlines()}
        assert metrics["num_videos"] == len(test_videos) and metrics["train_decode_failures"] == 0

    launch(script, common + ["--output-dir", str(second), "--no-eval",
                             "--resume-from", str(first / "checkpoints" / "step_2")], env={"PROBE_DIR": str(second)})
    resumed = losses(second)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6), (step, resumed, uninterrupted)
    assert uninterrupted[3] != uninterrupted[2]  # the comparison is not between constants
    runs = {rank: (probes(first, rank), probes(second, rank)) for rank in (0, 1)}
    for rank, (whole, tail) in runs.items():
        assert len(whole) == 4 and len(tail) == 2
        for ours, theirs in zip(tail, whole[2:]):
            assert ours["keys"] == theirs["keys"], rank
            assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6), rank
            assert ours["draw"] == theirs["draw"], rank
    # Distinct random streams and distinct rows per process.
    assert all(a["draw"] != b["draw"] for a, b in zip(runs[0][0], runs[1][0]))
    assert all(not set(a["keys"]) & set(b["keys"]) for a, b in zip(runs[0][0], runs[1][0]))
    # Learning rate of each optimiser step (prepared scheduler, 2 processes): warm-up from 2e-4, cosine to 1e-4.
    from train.loop import learning_rate

    lrs = losses(first, "lr")
    assert lrs[1] == pytest.approx(2e-4) and lrs[2] == pytest.approx(1e-3)
    train_cfg = {"lr": 1e-3, "warmup_start_lr": 2e-4, "min_lr": 1e-4, "warmup_ratio": 0.25}
    assert [lrs[s] for s in (1, 2, 3, 4)] == pytest.approx([learning_rate(s, train_cfg, 4) for s in range(4)])
    assert lrs[4] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))


def test_qa_training_uses_training_answers(synthetic, tmp_path):
    """QA fine-tuning on 1 process, launched as a module (`accelerate launch -m train.finetune_qa`); evaluation ranks
    the training answers for every test question. Also: with
    train.log_every=2 only every 2nd step (and the last) is logged, and with grad_accum=2 the (prepared) scheduler
    advances once per optimiser step, not per micro-batch."""
    result = launch("train.finetune_qa", ["--config", "configuration/synthetic_qa.yaml", "--dataset", str(synthetic),
                                          *TINY, "--output-dir", str(tmp_path), "--max-steps", "3",
                                          "--set", "train.log_every=2", "--set", "train.grad_accum=2",
                                          "--set", "train.warmup_ratio=0"], processes=1)
    # trackers are asked for only when installed: accelerate would warn about `log_with=[]` on every process
    assert "no supported trackers" not in result.stdout + result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    train_answers = {json.loads(line)["answer"] for line in (synthetic / "qa_train.jsonl").read_text().splitlines()}
    assert metrics["num_candidate_answers"] == len(train_answers)
    assert metrics["num_questions"] == len((synthetic / "qa_test.jsonl").read_text().splitlines())
    assert sorted(losses(tmp_path)) == [2, 3]
    lrs = losses(tmp_path, "lr")  # cosine from 1e-3 over 3 steps: steps 2 and 3 use lr(1) and lr(2)
    assert [lrs[2], lrs[3]] == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in (1, 2)])


def test_pretraining_streams_and_trains(synthetic, tmp_path):
    """Pretraining (VTC + VTM + CAP) on a streamed dataset: the streamed, sharded path of the loop."""
    launch("pretrain.py", ["--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic), *TINY,
                           "--set", "task=pretrain", "--set", "data.streaming=true", "--set", "data.eval_split=",
                           "--output-dir", str(tmp_path),
                           "--max-steps", "2"], processes=1)
    steps = losses(tmp_path)
    assert sorted(steps) == [1, 2] and all(value > 0 for value in steps.values())
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["architectures"] == ["TestaForPreTraining"]


def test_init_from_our_folder_blip_and_original_checkpoints(synthetic, tmp_path):
    """`--init-from` accepts one of our folders, a transformers BLIP folder (converted on the fly) and an original
    TESTA .pth; the recipe's aggregation settings apply on top of the checkpoint."""
    from helpers.models import tiny_blip_config
    from helpers.original_checkpoints import original_config, original_state
    from transformers import BlipForImageTextRetrieval

    from train.finetune_retrieval import TASK
    from train.loop import build_model, load_recipe, parse_args

    blip_dir = tmp_path / "blip"
    BlipForImageTextRetrieval(tiny_blip_config(image_size=32)).save_pretrained(blip_dir)
    original = tmp_path / "original.pth"
    torch.save({"model": original_state(), "config": original_config()}, original)
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
        assert model.vision_model.aggregation_settings().spatial_reduction == (2, 2), source
        assert model.momentum.vision_model.aggregation_settings().spatial_reduction == (2, 2), source  # momentum too
    reloaded = build_model(TASK.model_class, load_recipe(parse_args("t", [
        "--config", "configuration/synthetic_retrieval.yaml", *TINY, "--init-from", str(ours)])))
    torch.testing.assert_close(reloaded.itm_head.weight, fresh.itm_head.weight)


def test_a_qa_head_from_a_retrieval_folder_starts_its_answer_decoder_from_the_text_encoder(tmp_path):
    """`init_from` a retrieval folder (no answer decoder): the decoder's BERT is a copy of the saved text encoder
    (embeddings, self- and cross-attention, feed-forward), the LM head's output stays tied to the copied word
    embeddings, its transform stays fresh, and only the LM head's own weights remain recorded as missing."""
    from safetensors.torch import load_file

    from modeling_testa import TestaForVideoQA, TestaForVideoTextRetrieval
    from train.finetune_qa import TASK
    from train.loop import build_model, load_recipe, parse_args

    retrieval = build_model(TestaForVideoTextRetrieval, load_recipe(parse_args("t", [
        "--config", "configuration/synthetic_retrieval.yaml", *TINY])))
    retrieval.save_pretrained(tmp_path / "retrieval")
    saved = load_file(str(tmp_path / "retrieval" / "model.safetensors"))
    qa = build_model(TASK.model_class, load_recipe(parse_args("t", [
        "--config", "configuration/synthetic_retrieval.yaml", *TINY, "--init-from", str(tmp_path / "retrieval")])))
    assert isinstance(qa, TestaForVideoQA)
    decoder = qa.text_decoder
    for name, tensor in (
        ("embeddings.word_embeddings.weight", decoder.bert.embeddings.word_embeddings.weight),
        ("embeddings.position_embeddings.weight", decoder.bert.embeddings.position_embeddings.weight),
        ("encoder.layer.0.attention.self.query.weight", decoder.bert.encoder.layer[0].attention.self.query.weight),
        ("encoder.layer.1.crossattention.self.value.bias", decoder.bert.encoder.layer[1].crossattention.self.value.bias),
        ("encoder.layer.1.output.LayerNorm.weight", decoder.bert.encoder.layer[1].output.LayerNorm.weight),
    ):
        assert torch.equal(tensor, saved[f"text_encoder.{name}"]), name
    assert decoder.cls.predictions.decoder.weight.data_ptr() == decoder.bert.embeddings.word_embeddings.weight.data_ptr()
    transform = decoder.cls.predictions.transform.dense.weight  # the LM head's own: fresh, not a copy
    assert not any(torch.equal(transform, value) for value in saved.values() if value.shape == transform.shape)
    assert qa.weights_missing_at_load and all(k.startswith("text_decoder.cls.") for k in qa.weights_missing_at_load)
    assert all(torch.isfinite(parameter).all() for parameter in qa.parameters())


# ---------------------------------------------------------------------------------------------------- streamed data


def _generate_rows(shard_ids: list[int], rows: int, shards: int):
    for shard in shard_ids:
        for i in range(shard, rows, shards):
            yield {"video": f"v{i}.mp4", "text": f"t{i}", "video_id": str(i)}


def _stream(rows: int = 23, shards: int = 1):
    import datasets

    # module-level functions: the DataLoader workers (forkserver, as the loop's) unpickle the stream
    return datasets.IterableDataset.from_generator(
        _generate_rows, gen_kwargs={"shard_ids": list(range(shards)), "rows": rows, "shards": shards})


def _video_ids(rows: list[dict]) -> list[str]:
    return [row["video_id"] for row in rows]


def _epoch_batches(stream, epoch: int, rank: int, world: int, start: int = 0, workers: int = 0) -> list[list[str]]:
    from torch.utils.data import DataLoader

    from modeling_testa.process_start import dataloader_workers
    from train.loop import StreamedEpoch

    data = StreamedEpoch(stream, seed=3, epoch=epoch, rank=rank, world=world, batch_size=2, start_batch=start,
                         buffer_size=8)
    loader = DataLoader(data, batch_size=None, collate_fn=_video_ids, num_workers=workers,
                        **dataloader_workers(workers, data))
    return list(loader)


@pytest.mark.parametrize("shards", [1, 3])
def test_streamed_epochs_are_permutations_in_a_new_order_each_epoch(shards):
    stream = _stream(rows=24, shards=shards)
    orders = []
    for epoch in (0, 1):
        per_rank = [_epoch_batches(stream, epoch, rank, 2) for rank in (0, 1)]
        assert len(per_rank[0]) == len(per_rank[1]) == 6  # 12 rows per process, batches of 2
        rows = [row for step in zip(*per_rank) for batch in step for row in batch]
        assert sorted(rows, key=int) == [str(i) for i in range(24)]  # the epoch is a permutation of the data
        orders.append(rows)
    assert orders[0] != orders[1]  # set_epoch reached the iterated dataset
    assert sorted(orders[0]) != orders[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_resume_continues_exactly_on_every_process(workers):
    """Resuming at batch k gives exactly the batches an uninterrupted epoch gives from k on, on each of 2 processes
    (one shard: the case where skip() after split_dataset_by_node skipped rows of the whole stream)."""
    stream = _stream(rows=40, shards=1)
    for rank in (0, 1):
        full = _epoch_batches(stream, 1, rank, 2)
        assert len(full) == 10
        assert _epoch_batches(stream, 1, rank, 2, start=3, workers=workers) == full[3:], rank
        assert _epoch_batches(stream, 1, rank, 2, workers=workers) == full, rank


# ------------------------------------------------------------------------------------------------------- bad videos


def _collator(strict: bool = False, spare: list | tuple = (), reservoir_size: int = 4):
    from train.loop import VideoTextCollator, build_processor

    processor = build_processor({"data": {"num_frames": 4, "image_size": 32}})
    return VideoTextCollator(processor, {"text": 16}, "uniform", 4, seed=0, strict=strict,
                             reservoir_size=reservoir_size, spare_rows=spare)


def _media(tmp_path):
    from helpers.videos import write_video

    good = [str(write_video(tmp_path / f"good{i}.mp4", 12 + i)) for i in range(3)]
    corrupt = []
    for i in range(2):
        path = tmp_path / f"corrupt{i}.mp4"
        path.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)  # an mp4 header, then garbage
        corrupt.append(str(path))
    row = lambda path, i: {"video": path, "text": f"caption {i}", "video_id": f"id{i}", "position": i, "epoch": 0}  # noqa: E731
    return [row(p, i) for i, p in enumerate(good)], [row(p, 10 + i) for i, p in enumerate(corrupt)]


def test_a_batch_of_only_corrupt_videos_is_filled_from_the_reservoir(tmp_path):
    good, corrupt = _media(tmp_path)
    collator = _collator()
    first = collator(good[:2])
    assert first["stats"]["replaced"] == 0 and first["stats"]["failures"] == []
    bad = collator(corrupt)  # every video of the batch fails
    assert bad["stats"]["replaced"] == 2 and len(bad["stats"]["failures"]) == 2
    assert all("corrupt" in failure for failure in bad["stats"]["failures"])
    # Each failed slot holds a recent good sample, video and caption together.
    assert sorted(bad["video_key"]) == ["id0", "id1"]
    for slot, key in enumerate(bad["video_key"]):
        source = int(key[2:])
        torch.testing.assert_close(bad["pixel_values"][slot], first["pixel_values"][source])
        torch.testing.assert_close(bad["input_ids"][slot], first["input_ids"][source])
    # A mixed batch keeps its good videos in place.
    mixed = collator([corrupt[0], good[2]])
    assert mixed["stats"]["replaced"] == 1 and mixed["video_key"][1] == "id2"


def test_an_empty_reservoir_is_filled_from_spare_rows_and_strict_data_stops(tmp_path):
    from train.loop import DecodeFailures

    good, corrupt = _media(tmp_path)
    batch = _collator(spare=[corrupt[1], good[1]])(corrupt)  # first batch of a worker: nothing decoded yet
    assert batch["stats"]["replaced"] == 2 and batch["video_key"] == ["id1", "id1"]
    assert any("spare row" in failure for failure in batch["stats"]["failures"])
    with pytest.raises(DecodeFailures, match="no decodable video"):
        _collator(spare=[corrupt[1]])(corrupt)
    # A batch with one good video never fails, even with an empty reservoir and only failing spare rows: the good
    # sample fills the failed slot.
    half = _collator(spare=[corrupt[1]])([good[0], corrupt[0]])
    assert half["stats"]["replaced"] == 1 and half["video_key"] == ["id0", "id0"]
    with pytest.raises(ValueError, match="corrupt0.mp4") as error:  # --strict-data: the decoder's own error
        _collator(strict=True, spare=[good[0]])(corrupt)
    assert not isinstance(error.value, DecodeFailures)


CRASHING_EVALUATION = """
import dataclasses, sys
from train.finetune_retrieval import TASK
from train.loop import main

def evaluate(*args):
    raise RuntimeError("evaluation crashed")

if __name__ == "__main__":
    main(dataclasses.replace(TASK, evaluate=evaluate))
"""


def test_bad_training_videos_are_replaced_and_final_is_saved_before_evaluation(synthetic, tmp_path):
    """The videos of the first training batch (1 process, batch 4, the recipe's seed 0) are all corrupt: training
    still runs through the whole epoch and reports the 4 replaced videos; an evaluation that crashes leaves OUT/final
    intact."""
    import shutil

    from processing.data import load_split

    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    first_batch = load_split(str(data), "train").shuffle(seed=0)["video"][:4]  # the loop's epoch-0 order
    for path in first_batch:
        Path(path).write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    script = tmp_path / "crashing_evaluation.py"
    script.write_text(CRASHING_EVALUATION.format())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(script), "--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(data),
         *TINY, "--output-dir", str(tmp_path / "out"), "--max-steps", str(len(rows) // 4), "--set", "data.num_workers=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "evaluation crashed" in output, output[-3000:]
    assert "4 videos failed to decode and were replaced" in output  # one batch, all of its videos
    assert "4 training videos failed to decode and were replaced" in output, output[-3000:]
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    assert sorted(losses(tmp_path / "out")) == list(range(1, len(rows) // 4 + 1))


def test_a_launch_config_that_accelerate_ignores_is_reported(monkeypatch, capsys):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from train.loop import warn_if_launch_config_ignored

    fake = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, print=print)
    warn_if_launch_config_ignored(fake)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    warn_if_launch_config_ignored(fake)
    assert "asks for FSDP, but Accelerate runs DistributedType.MULTI_CPU" in capsys.readouterr().out
    warn_if_launch_config_ignored(SimpleNamespace(distributed_type=DistributedType.FSDP, print=print))
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------------- stuck and killed runs


def _accelerate_command(script: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *args]


STALLING = """
import os, time
from train import data
from train.finetune_retrieval import TASK
from train.loop import main

collate = data.VideoTextCollator.__call__
calls = []

def stalling(self, rows):  # process 0 never delivers its second batch in time
    calls.append(1)
    if os.environ["RANK"] == "0" and len(calls) == 2:
        time.sleep(float(os.environ["STALL_SECONDS"]))
    return collate(self, rows)

data.VideoTextCollator.__call__ = stalling
if __name__ == "__main__":
    main(TASK)
"""


def test_a_stalled_process_makes_the_others_fail_with_a_named_error_not_wait(synthetic, tmp_path):
    """Process 0 stalls before its second batch for far longer than train.collective_timeout (30 s here): process 1
    fails with `CollectiveTimeout`, naming itself, the step and the collective it waited in, and the launch ends
    (the 400 s limit is only a hang guard)."""
    script = tmp_path / "stalling.py"
    script.write_text(STALLING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALL_SECONDS": "1000"}
    result = subprocess.run(_accelerate_command(script, [
        "--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic), *TINY, "--no-eval",
        "--output-dir", str(tmp_path / "out"), "--max-steps", "3", "--set", "data.num_workers=0",
        "--set", "train.collective_timeout=30"]), cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert ("CollectiveTimeout: process 1 of 2 gave up waiting for the other processes' next batch (all_reduce in "
            "train.data.synchronized) before step 2 (epoch 0)") in output, output[-5000:]
    assert not (tmp_path / "out" / "final").exists()


def _process_tree(root: int) -> dict[int, tuple[str, str]]:
    """The descendants of process `root` (from /proc): pid -> (start time, command line)."""
    parents, found = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = (int(fields[1]), fields[19])  # ppid, start time
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, start) in parents.items():
            if ppid == parent and pid not in found:
                try:
                    command = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    command = "?"
                found[pid] = (start, command)
                frontier.append(pid)
    return found


def _still_running(pid: int, start: str) -> bool:
    """Whether process `pid`, started at `start`, still runs (a zombie has ended: only its parent's reaping is
    left)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc")
def test_killing_the_launcher_mid_epoch_leaves_no_process_behind(synthetic, tmp_path):
    """A two-process run with 2 DataLoader workers per process (and their decoder helpers) is killed from outside
    mid-epoch: `accelerate launch` gets SIGKILL, the one signal nothing can clean up after. Every process it had
    started (ranks, forkservers, DataLoader workers, decoder helpers), recorded from /proc before the kill, is gone
    within the hang guard's 60 s."""
    import signal
    import time

    script = tmp_path / "probed_retrieval.py"
    script.write_text(PROBE.format())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_DIR": str(tmp_path)}
    launcher = subprocess.Popen(_accelerate_command(script, [
        "--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic), *TINY, "--no-eval",
        "--output-dir", str(tmp_path / "out"), "--set", "train.epochs=50", "--set", "data.num_workers=2"]),
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tree = {}
    try:
        deadline = time.monotonic() + 400  # hang guard: a loaded machine starts the two processes slowly
        probe = tmp_path / "rank0.jsonl"
        while time.monotonic() < deadline and launcher.poll() is None:  # mid-epoch: two steps done
            if probe.exists() and len(probe.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]
        assert probe.exists() and len(probe.read_text().splitlines()) >= 2, "no training step within 400 s"
        tree = _process_tree(launcher.pid)
        commands = " | ".join(command for _, command in tree.values())
        assert "probed_retrieval.py" in commands and "forkserver" in commands, commands  # ranks and their workers
        assert len(tree) >= 2 + 2 * 3, commands  # 2 ranks, each with a forkserver and 2 workers, at least
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        left = tree
        while left and time.monotonic() < deadline:
            left = {pid: info for pid, info in left.items() if _still_running(pid, info[0])}
            time.sleep(0.5)
        assert not left, "still running after the launcher was killed:\n" + "\n".join(
            f"{pid}: {command}" for pid, (_, command) in left.items())
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid, (start, _) in tree.items():  # a failed run must not leave them either
            if _still_running(pid, start):
                os.kill(pid, signal.SIGKILL)


def test_a_collective_that_fails_names_the_process_the_step_and_what_it_waited_for():
    from types import SimpleNamespace

    from train.loop import CollectiveTimeout, collective

    accelerator = SimpleNamespace(process_index=1, num_processes=2)
    with pytest.raises(CollectiveTimeout) as error:
        with collective(accelerator, "the losses (all_reduce)", lambda: "before step 7 (epoch 2)"):
            raise RuntimeError("[gloo/unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to complete")
    assert str(error.value).startswith("process 1 of 2 gave up waiting for the losses (all_reduce) before step 7 "
                                       "(epoch 2): another process is stuck or has died")
    assert "Timed out waiting 3000ms" in str(error.value)
    with collective(accelerator, "nothing", "here"):  # no error: nothing raised, the block's value stays
        value = 3
    assert value == 3


UNGUARDED = """
from train.finetune_retrieval import TASK
from train.loop import main

main(TASK)  # not under `if __name__ == "__main__":`
"""


def test_an_unguarded_script_with_dataloader_workers_fails_with_the_fix_not_a_second_training(synthetic, tmp_path):
    """DataLoader workers start from a forkserver and import the main script: one that calls `main` at module level
    would train again inside every worker. The worker refuses with the fix; the run fails instead of hanging."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script), "--config", "configuration/synthetic_retrieval.yaml", "--dataset", str(synthetic),
         *TINY, "--output-dir", str(tmp_path / "out"), "--max-steps", "1", "--no-eval"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "call it under `if __name__ == \"__main__\":`" in output, output[-3000:]
