"""The training loop shared by pretraining and fine-tuning, written once.

A task script (``train/finetune_retrieval.py``, ``train/finetune_qa.py``, ``train/pretrain.py``) describes its task
with a :class:`Task` (model class, collation, loss, evaluation) and calls :func:`main`. Everything else lives here:

1. recipe: a YAML file from ``configuration/`` with command-line overrides;
2. model: a fresh `TestaConfig` model, or ``init_from`` one of our folders, an original TESTA ``.pth`` or a BLIP
   checkpoint (converted on the fly);
3. data: any split ``datasets`` reads (our jsonl/parquet folders, a Hub id), streamed or not, sharded by process
   with ``split_dataset_by_node`` and decoded in DataLoader workers by the `TestaVideoProcessor`;
4. the loop: AdamW (weight decay 0.05), cosine schedule with warm-up, gradient accumulation, clipping, mixed
   precision and gradient checkpointing through Accelerate, a progress bar, trackers, ``save_state`` every N steps
   and exact resumption (model, optimiser, scheduler, RNG and the position in the data stream);
5. evaluation, and a final ``save_pretrained`` folder (``OUTPUT/final``) with the processor and remote code.

The same script runs on 1 CPU, 2 CPU processes (``accelerate launch --multi_gpu --num_processes 2 ...``), one or
many GPUs and several nodes.
"""

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup


REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from modeling_testa import TestaConfig  # noqa: E402
from processing.data import load_split  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------------
# 1. Recipe
# ----------------------------------------------------------------------------------------------------------------------


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="YAML recipe from configuration/")
    parser.add_argument("--dataset", help="overrides data.dataset: a folder of our jsonl/parquet files or a Hub id")
    parser.add_argument("--output-dir", default="outputs/run", help="checkpoints, logs and OUTPUT/final")
    parser.add_argument("--max-steps", type=int, help="overrides train.max_steps (optimiser steps)")
    parser.add_argument("--resume-from", help="a checkpoint folder written by save_state (OUTPUT/checkpoints/...)")
    parser.add_argument("--init-from", help="overrides model.init_from")
    parser.add_argument("--strict-data", action="store_true", help="stop on the first video that fails to decode")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any recipe value, e.g. --set train.lr=1e-4 --set model.vision_config.temporal_reduction=2",
    )
    return parser.parse_args(argv)


def load_recipe(args: argparse.Namespace) -> dict:
    """Reads the YAML recipe and applies the command-line overrides (values are parsed as YAML)."""
    path = Path(args.config)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {str(path)!r} does not exist; see configuration/ for the shipped ones")
    recipe = yaml.safe_load(path.read_text()) or {}
    for section in ("model", "data", "train", "eval"):
        recipe.setdefault(section, {})
    overrides = list(args.set)
    for flag, key in (("dataset", "data.dataset"), ("max_steps", "train.max_steps"), ("init_from", "model.init_from")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        node = recipe
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section of the recipe")
        node[leaf] = yaml.safe_load(value)
    return recipe


# ----------------------------------------------------------------------------------------------------------------------
# 2. Model
# ----------------------------------------------------------------------------------------------------------------------


def build_model(model_class: type, recipe: dict):
    """A fresh model from the recipe's `model` section, or `init_from` a checkpoint with the recipe's settings.

    `init_from` may be one of our `save_pretrained` folders, an original TESTA `.pth`, or a transformers BLIP
    checkpoint (folder or Hub id), which is converted to TESTA on the fly. The recipe's aggregation and training
    settings (R_T, R_S, queue, alpha, ...) apply on top of the checkpoint's architecture.
    """
    settings = copy.deepcopy(recipe["model"])
    init_from = settings.pop("init_from", None)
    config = TestaConfig(**settings)
    if not init_from:
        return model_class(config)
    overrides = _recipe_overrides(config, settings)
    source = Path(init_from)
    if source.is_file():
        from modeling_testa.convert_original_testa import convert_original_testa

        task = {"TestaForVideoTextRetrieval": "retrieval", "TestaForVideoQA": "qa"}.get(model_class.__name__, "pretraining")
        model, report = convert_original_testa(str(source), task=task, num_frames=config.vision_config.num_frames,
                                               **overrides)
        print(f"converted {source}: {report}" if len(str(report)) < 2000 else f"converted {source}")
        return model
    if (source / "config.json").is_file() and json.loads((source / "config.json").read_text()).get("model_type") == "testa":
        top_level = {k: v for k, v in overrides.items() if k not in _AGGREGATION_FIELDS}
        model = model_class.from_pretrained(str(source), dtype=torch.float32, **top_level)
        model.vision_model.set_aggregation(**{k: v for k, v in overrides.items() if k in _AGGREGATION_FIELDS})
        return model
    from modeling_testa.convert_blip_to_testa import convert_blip_to_testa

    overrides.pop("dec_token_id", None)  # [DEC] is BLIP's bos token
    vision = config.vision_config
    return convert_blip_to_testa(init_from, num_frames=vision.num_frames, image_size=vision.image_size,
                                 model_class=model_class, **overrides)


_AGGREGATION_FIELDS = ("temporal_reduction", "spatial_reduction", "aggregation_strategy", "reduction_mode",
                       "aggregation_dims", "frame_matching", "proportional_attention")
_TRAINING_FIELDS = ("momentum", "alpha", "k_test", "negative_all_rank", "label_smoothing", "video_pooling", "temperature")


def _recipe_overrides(config: TestaConfig, settings: dict) -> dict:
    """The recipe values that apply to a loaded checkpoint: aggregation settings and training hyper-parameters
    (architecture fields come from the checkpoint). The queue length and the [ENC]/[DEC] ids only apply when the
    recipe sets them."""
    overrides = {name: getattr(config.vision_config, name) for name in _AGGREGATION_FIELDS}
    overrides.update({name: getattr(config, name) for name in _TRAINING_FIELDS})
    overrides.update({name: settings[name] for name in ("queue_size", "enc_token_id", "dec_token_id") if name in settings})
    return overrides


def build_processor(recipe: dict):
    from modeling_testa.processing_testa import TestaProcessor
    from modeling_testa.video_processing_testa import TestaVideoProcessor

    data = recipe["data"]
    size = data.get("image_size", 224)
    video_processor = TestaVideoProcessor(
        num_frames=data.get("num_frames", 32), size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    return TestaProcessor(video_processor=video_processor)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Data
# ----------------------------------------------------------------------------------------------------------------------


def load_rows(recipe: dict, split: str, task: str, streaming: bool):
    """One split as a `datasets` dataset: one of our folders/files, or anything `load_dataset` reads (Hub ids)."""
    import datasets

    location = recipe["data"].get("dataset")
    if not location:
        raise ValueError("no dataset: set data.dataset in the recipe or pass --dataset")
    if isinstance(location, (list, tuple)):  # e.g. WebVid + CC3M for pretraining
        parts = [load_rows({"data": {"dataset": item}}, split, task, streaming) for item in location]
        return datasets.interleave_datasets(parts) if streaming else datasets.concatenate_datasets(parts)
    if os.path.exists(location):
        return load_split(location, split=split, task="qa" if task == "qa" else "retrieval", streaming=streaming)
    return datasets.load_dataset(location, split=split, streaming=streaming)


class DecodeFailures(RuntimeError):
    """Every video of a batch failed to decode."""


class VideoTextCollator:
    """Turns rows into a batch in a DataLoader worker: decodes and samples the videos, tokenises the texts.

    A row whose video fails to decode is replaced by another row of the same batch (same video id, so contrastive
    targets stay consistent) and counted, so that batch shapes stay equal on every process; with `strict` the error
    is raised instead. Frame sampling is seeded per example (seed, epoch, position), so a resumed run sees exactly
    the frames an uninterrupted run would.

    Args:
        text_lengths: the text columns to tokenise and their padded length, e.g. ``{"text": 64}`` or
            ``{"question": 35, "answer": 10}``. The first one becomes ``input_ids``/``attention_mask``, the others
            ``<name>_input_ids``/``<name>_attention_mask``.
    """

    def __init__(self, processor, text_lengths: dict[str, int], sampling: str, num_frames: int, seed: int,
                 strict: bool):
        self.processor = processor
        self.text_lengths = text_lengths
        self.sampling = sampling
        self.num_frames = num_frames
        self.seed = seed
        self.strict = strict

    def decode(self, row: dict) -> torch.Tensor:
        example_seed = (self.seed * 1_000_003 + row.get("epoch", 0) * 10_007 + row.get("position", 0)) % 2**31
        if row.get("video") is not None:
            return self.processor.video_processor(
                videos=[row["video"]], num_frames=self.num_frames, frame_sampling=self.sampling, seed=example_seed
            )["pixel_values"][0]
        if row.get("image") is None:
            raise ValueError(f"row {row.get('position')} has neither a 'video' nor an 'image' value: {sorted(row)}")
        from PIL import Image

        with Image.open(row["image"]) as image:  # image-text pairs become static videos
            frames = [image.convert("RGB")] * self.num_frames
        return self.processor.video_processor(videos=[frames], do_sample_frames=False)["pixel_values"][0]

    def __call__(self, rows: list[dict]) -> dict:
        start = time.perf_counter()
        videos, failures = [], []
        for row in rows:
            try:
                videos.append(self.decode(row))
            except (OSError, ValueError) as error:  # missing, corrupt or undecodable media
                if self.strict:
                    raise
                videos.append(None)
                failures.append(f"{row.get('video') or row.get('image')}: {error}")
        good = [i for i, video in enumerate(videos) if video is not None]
        if not good:
            raise DecodeFailures("every video of a batch failed to decode:\n" + "\n".join(failures))
        source = [i if videos[i] is not None else good[i % len(good)] for i in range(len(rows))]
        batch = {"pixel_values": torch.stack([videos[i] for i in source])}
        for position, (name, length) in enumerate(self.text_lengths.items()):
            encoded = self.processor.tokenizer(
                [rows[i][name] for i in source], padding="max_length", truncation=True, max_length=length,
                return_tensors="pt",
            )
            prefix = "" if position == 0 else f"{name}_"
            batch[f"{prefix}input_ids"] = encoded["input_ids"]
            batch[f"{prefix}attention_mask"] = encoded["attention_mask"]
        keys = [str(rows[i].get("video_id") or rows[i].get("video") or rows[i].get("image")) for i in source]
        batch["video_key"] = keys
        batch["stats"] = {"decode_seconds": time.perf_counter() - start, "videos": len(rows), "failures": failures}
        return batch


class _Positioned(torch.utils.data.Dataset):
    """A map-style split with each row's position in the epoch (for per-example seeds) attached."""

    def __init__(self, rows, epoch: int, offset: int):
        self.rows, self.epoch, self.offset = rows, epoch, offset

    def __len__(self) -> int:
        return len(self.rows) - self.offset

    def __getitem__(self, index: int) -> dict:
        return {**self.rows[index + self.offset], "position": index + self.offset, "epoch": self.epoch}


@dataclass
class TrainState:
    """Where the loop is, saved with every checkpoint (Accelerate's `register_for_checkpointing`)."""

    epoch: int = 0
    micro_batches_in_epoch: int = 0
    global_step: int = 0
    decode_failures: int = 0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def epoch_rows(rows, state: TrainState, per_device_batch: int, seed: int, accelerator: Accelerator):
    """This process's rows for the current epoch, shuffled with (seed, epoch), from the saved position on.

    Every process consumes the same number of rows per step, so the saved position is the same on all of them.
    """
    from datasets import IterableDataset
    from datasets.distributed import split_dataset_by_node

    skip = state.micro_batches_in_epoch * per_device_batch
    rank, world = accelerator.process_index, accelerator.num_processes
    if isinstance(rows, IterableDataset):
        stream = rows.shuffle(seed=seed, buffer_size=1000)
        stream.set_epoch(state.epoch)
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
        stream = stream.map(lambda row, position: {"position": position, "epoch": state.epoch}, with_indices=True)
        return stream.skip(skip)
    per_process = len(rows) // world  # equal shares on every process
    shard = rows.shuffle(seed=seed + state.epoch).select(range(rank * per_process, (rank + 1) * per_process))
    return _Positioned(shard, state.epoch, min(skip, per_process))


def synchronized(loader, accelerator: Accelerator):
    """Yields the loader's batches until any process runs out: every process must take the same number of steps,
    since the losses gather across processes."""
    iterator = iter(loader)
    while True:
        batch = next(iterator, None)
        has_batch = torch.tensor([0 if batch is None else 1], device=accelerator.device)
        if accelerator.reduce(has_batch, reduction="sum").item() < accelerator.num_processes:
            return
        yield batch


def move_to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------------------------------
# 4. Task description and the loop
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """What differs between pretraining, retrieval and QA fine-tuning.

    Attributes:
        name: ``"retrieval"``, ``"qa"`` or ``"pretrain"`` (also selects the data files of our folders).
        model_class: the TESTA head to train.
        text_lengths: ``(recipe key in data, default)`` per text column to tokenise, in order; e.g.
            ``{"text": ("max_text_length", 64)}``.
        compute_loss: ``(model, batch, warmup_progress) -> loss``; ``warmup_progress`` goes from 0 to 1 over the first
            epoch (the original ramps the distillation weight that way).
        evaluate: ``(model, processor, recipe, accelerator) -> metrics``; runs on every process.
        prepare_model: optional hook ``(model, processor, recipe, accelerator)`` after the model is built.
    """

    name: str
    model_class: type
    text_lengths: dict[str, tuple[str, int]]
    compute_loss: Callable[[Any, dict, float], torch.Tensor]
    evaluate: Callable[..., dict] | None = None
    prepare_model: Callable[..., None] | None = None


def main(task: Task, argv: list[str] | None = None) -> dict:
    """Trains, evaluates and saves; returns the evaluation metrics."""
    args = parse_args(f"TESTA {task.name} training", argv)
    recipe = load_recipe(args)
    data_cfg, train_cfg = recipe["data"], recipe["train"]
    output_dir = Path(args.output_dir)
    streaming = bool(data_cfg.get("streaming", task.name == "pretrain"))

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, CPU processes under `--multi_gpu` would not join one group
        gradient_accumulation_steps=train_cfg.get("grad_accum", 1),
        mixed_precision=(train_cfg.get("mixed_precision") or "no") if torch.cuda.is_available() else "no",
        log_with=_trackers(),
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False),
        # Joint mode leaves the temporal attention unused; other settings use every parameter.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(train_cfg.get(
            "find_unused_parameters", recipe["model"].get("vision_config", {}).get("aggregation_dims") == "joint")))],
    )
    seed = train_cfg.get("seed", 42)
    set_seed(seed)
    global_batch = train_cfg.get("batch_size", 16)
    accumulation = accelerator.gradient_accumulation_steps
    per_device_batch = global_batch // (accelerator.num_processes * accumulation)
    if per_device_batch < 1 or per_device_batch * accelerator.num_processes * accumulation != global_batch:
        raise ValueError(
            f"train.batch_size={global_batch} (global) must be a multiple of processes x grad_accum = "
            f"{accelerator.num_processes} x {accumulation}"
        )

    # Model, data, optimiser.
    processor = build_processor(recipe)
    model = build_model(task.model_class, recipe)
    if task.prepare_model is not None:
        task.prepare_model(model, processor, recipe, accelerator)
    if train_cfg.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    rows = load_rows(recipe, data_cfg.get("train_split", "train"), task.name, streaming)
    micro_per_epoch = None if streaming else len(rows) // accelerator.num_processes // per_device_batch
    max_steps = train_cfg.get("max_steps")
    if not max_steps:
        if micro_per_epoch is None:
            raise ValueError("a streamed dataset has no length: set train.max_steps (or --max-steps)")
        max_steps = train_cfg.get("epochs", 1) * micro_per_epoch // accumulation
    if max_steps < 1 or micro_per_epoch == 0:
        raise ValueError(f"nothing to train: {len(rows)} rows for a global batch of {global_batch}")
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=float(train_cfg.get("lr", 1e-5)),
        weight_decay=float(train_cfg.get("weight_decay", 0.05)),
    )
    warmup = train_cfg.get("warmup_steps") or int(float(train_cfg.get("warmup_ratio", 0.0)) * max_steps)
    # Stepped once per optimiser step (not prepared: Accelerate would step it once per process).
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, max_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        accelerator.print(f"resumed from {args.resume_from} at step {state.global_step} (epoch {state.epoch})")

    text_lengths = {name: int(data_cfg.get(key, default)) for name, (key, default) in task.text_lengths.items()}
    collator = VideoTextCollator(processor, text_lengths, data_cfg.get("sampling", "random"),
                                 int(data_cfg.get("num_frames", 32)), seed, args.strict_data)
    workers = int(data_cfg.get("num_workers", 2))
    accelerator.init_trackers(f"testa-{task.name}", config=_flat(recipe))
    progress = tqdm(total=max_steps, initial=state.global_step, disable=not accelerator.is_local_main_process,
                    desc=task.name, dynamic_ncols=True)
    save_every = int(train_cfg.get("save_every") or 0)
    clip = train_cfg.get("max_grad_norm")
    throughput = {"decode_seconds": 0.0, "videos": 0, "wait_seconds": 0.0, "step_seconds": 0.0}
    log_path = output_dir / "train_log.jsonl"
    output_dir.mkdir(parents=True, exist_ok=True)

    # The loop.
    model.train()
    loop_start = time.perf_counter()
    while state.global_step < max_steps:
        epoch_data = epoch_rows(rows, state, per_device_batch, seed, accelerator)
        loader_workers = min(workers, epoch_data.num_shards) if streaming else workers
        # Its own generator: creating the loader must not draw from the global RNG, which a resumed run restores.
        generator = torch.Generator().manual_seed(seed + state.epoch)
        loader = DataLoader(epoch_data, batch_size=per_device_batch, collate_fn=collator, num_workers=loader_workers,
                            drop_last=True, generator=generator)
        wait_start = time.perf_counter()
        for batch in synchronized(loader, accelerator):
            throughput["wait_seconds"] += time.perf_counter() - wait_start
            stats = batch.pop("stats")
            throughput["decode_seconds"] += stats["decode_seconds"]
            throughput["videos"] += stats["videos"]
            if stats["failures"]:
                state.decode_failures += len(stats["failures"])
                accelerator.print(f"warning: {len(stats['failures'])} videos failed to decode and were replaced "
                                  f"({state.decode_failures} so far): {stats['failures'][0]}")
            batch = move_to_device(batch, accelerator.device)
            warmup_progress = 1.0 if micro_per_epoch is None or state.epoch > 0 else state.micro_batches_in_epoch / micro_per_epoch
            step_start = time.perf_counter()
            with accelerator.accumulate(model):
                loss = task.compute_loss(model, batch, warmup_progress)
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), float(clip))
                optimizer.step()
                optimizer.zero_grad()
            throughput["step_seconds"] += time.perf_counter() - step_start
            state.micro_batches_in_epoch += 1
            if accelerator.sync_gradients:
                scheduler.step()
                state.global_step += 1
                loss_value = accelerator.reduce(loss.detach(), reduction="mean").item()
                progress.set_postfix(loss=f"{loss_value:.4f}")
                progress.update(1)
                accelerator.log({"train/loss": loss_value, "train/lr": scheduler.get_last_lr()[0]},
                                step=state.global_step)
                if accelerator.is_main_process:
                    with log_path.open("a") as log:
                        log.write(json.dumps({"step": state.global_step, "loss": loss_value}) + "\n")
                if save_every and state.global_step % save_every == 0:
                    accelerator.save_state(str(output_dir / "checkpoints" / f"step_{state.global_step}"))
                if state.global_step >= max_steps:
                    break
            wait_start = time.perf_counter()
        else:  # the epoch's data ran out
            state.epoch += 1
            state.micro_batches_in_epoch = 0
    progress.close()
    _report_throughput(accelerator, throughput, workers, time.perf_counter() - loop_start)

    # Evaluation and the final folder.
    metrics = {}
    if task.evaluate is not None and not args.no_eval:
        metrics = task.evaluate(accelerator.unwrap_model(model), processor, recipe, accelerator)
        accelerator.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))},
                        step=state.global_step)
    save_final(accelerator, model, processor, output_dir / "final")
    if accelerator.is_main_process:
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    accelerator.end_training()
    return metrics


def _flat(recipe: dict) -> dict:
    """Recipe values as flat `section/key` scalars for the trackers."""
    flat = {}
    for section, values in recipe.items():
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(value, (int, float, str, bool)):
                    flat[f"{section}/{key}"] = value
    return flat


def _trackers() -> list[str]:
    try:
        import tensorboard  # noqa: F401

        return ["tensorboard"]
    except ImportError:
        return []


def _report_throughput(accelerator: Accelerator, throughput: dict, workers: int, wall: float) -> None:
    """Prints the data pipeline's speed and whether decoding or the model is the bottleneck."""
    if not throughput["videos"]:
        return
    per_worker = throughput["videos"] / max(throughput["decode_seconds"], 1e-9)
    waiting = throughput["wait_seconds"] / max(wall, 1e-9)
    bottleneck = "decoding (the model waits for data)" if waiting > 0.2 else "the model (data is ready in time)"
    accelerator.print(
        f"data pipeline: {per_worker:.1f} videos/s per worker (decode + preprocess, {max(workers, 1)} workers/process); "
        f"the loop waited for data {100 * waiting:.0f}% of the time; model steps took "
        f"{throughput['step_seconds']:.1f} s of {wall:.1f} s -> bottleneck: {bottleneck}"
    )


def save_final(accelerator: Accelerator, model, processor, path: Path) -> None:
    """A `save_pretrained` folder with the processor: loadable with `from_pretrained` and by the pipelines."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(str(path), state_dict=state_dict)
        processor.save_pretrained(str(path))
    accelerator.wait_for_everyone()
