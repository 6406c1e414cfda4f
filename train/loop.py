"""The training loop shared by pretraining and fine-tuning, written once.

A task script (``train/finetune_retrieval.py``, ``train/finetune_qa.py``, ``train/pretrain.py``) describes its task
with a :class:`Task` (model class, collation, loss, evaluation) and calls :func:`main`. Everything else lives here:

1. recipe: a YAML file from ``configuration/`` with command-line overrides, validated against `RECIPE_KEYS`;
2. model: a fresh `TestaConfig` model, or ``init_from`` one of our folders, an original TESTA ``.pth`` or a BLIP
   checkpoint (converted on the fly);
3. data: any split ``datasets`` reads (our jsonl/parquet folders, a Hub id), streamed or not, reshuffled every epoch,
   shared between processes by position (`StreamedEpoch` for streams) and decoded in DataLoader workers by the
   `TestaVideoProcessor`; undecodable videos are replaced from a reservoir of recent good samples;
4. the loop: AdamW (weight decay 0.05), warm-up + cosine/linear/constant schedule (prepared by Accelerate), gradient
   accumulation, clipping, mixed precision and gradient checkpointing through Accelerate, the momentum encoder
   updated once per optimiser step, a progress bar, trackers, ``save_state`` every N steps and exact resumption on
   any number of processes (model, optimiser, scheduler, per-process RNG, queues and the position in the data);
5. a final ``save_pretrained`` folder (``OUTPUT/final``) with the processor and remote code, then evaluation.

The same script runs on 1 CPU, 2 CPU processes (``accelerate launch --multi_gpu --num_processes 2 ...``), one or
many GPUs and several nodes.
"""

import argparse
import collections
import copy
import itertools
import json
import math
import os
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


REPO = Path(__file__).resolve().parents[1]

from modeling_testa import TestaConfig
from processing.data import load_split


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
    parser.add_argument("--strict-data", action="store_true",
                        help="stop on the first video that fails to decode (default: replace it from a reservoir of "
                             "recent good samples and count it)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any recipe value, e.g. --set train.lr=1e-4 --set model.vision_config.temporal_reduction=2",
    )
    return parser.parse_args(argv)


# The recipe schema: every key below is read by the loop, the task scripts or train/evaluation.py (see
# configuration/README.md); `model` keys are those of `TestaConfig` (+ `init_from`), checked in `validate_recipe`.
RECIPE_KEYS: dict[str, set[str]] = {
    "data": {"dataset", "train_split", "eval_split", "streaming", "shuffle_buffer", "num_frames", "sampling",
             "image_size", "max_text_length", "max_question_length", "max_answer_length", "num_workers",
             "video_backend", "isolate_decoder"},
    "train": {"lr", "min_lr", "warmup_start_lr", "scheduler", "warmup_ratio", "warmup_steps", "weight_decay",
              "epochs", "max_steps", "batch_size", "grad_accum", "max_grad_norm", "mixed_precision",
              "gradient_checkpointing", "find_unused_parameters", "seed", "save_every", "log_every",
              "reservoir_size"},
    "eval": {"k_test", "batch_size", "store_dir"},
}
TASKS = ("retrieval", "qa", "pretrain")
SCHEDULERS = ("cosine", "linear", "constant")
MIXED_PRECISIONS = ("auto", "no", "fp16", "bf16", "fp8")


def _config_fields(config_class) -> set[str]:
    return set(config_class().to_dict())


def validate_recipe(recipe: dict, source: str) -> None:
    """Raises a `ValueError` naming the file, the section and the allowed keys for any key that nothing reads."""
    from transformers import BlipTextConfig

    from modeling_testa import TestaVisionConfig

    def check(keys, allowed, where: str) -> None:
        unknown = sorted(set(keys) - set(allowed))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown} in {where}; allowed keys are {sorted(allowed)}")

    if not isinstance(recipe, dict):
        raise ValueError(f"{source}: a recipe is a mapping with sections task, model, data, train, eval")
    check(recipe, ("task", "model", *RECIPE_KEYS), "the recipe's top level")
    if recipe.get("task") is not None and recipe["task"] not in TASKS:
        raise ValueError(f"{source}: task={recipe['task']!r}; allowed values are {list(TASKS)}")
    for section in ("model", *RECIPE_KEYS):
        if recipe.get(section) is not None and not isinstance(recipe[section], dict):
            raise ValueError(f"{source}: section {section!r} must be a mapping, got {recipe[section]!r}")
    model = recipe.get("model") or {}
    check(model, {"init_from"} | _config_fields(TestaConfig), "model (TestaConfig keywords + init_from)")
    check(model.get("vision_config") or {}, _config_fields(TestaVisionConfig), "model.vision_config")
    check(model.get("text_config") or {}, _config_fields(BlipTextConfig), "model.text_config")
    for section, allowed in RECIPE_KEYS.items():
        check(recipe.get(section) or {}, allowed, section)
    train = recipe.get("train") or {}
    if train.get("scheduler", "cosine") not in SCHEDULERS:
        raise ValueError(f"{source}: train.scheduler={train['scheduler']!r}; allowed values are {list(SCHEDULERS)}")
    if train.get("mixed_precision") is not None and train["mixed_precision"] not in MIXED_PRECISIONS:
        raise ValueError(f"{source}: train.mixed_precision={train['mixed_precision']!r}; allowed values are "
                         f"{list(MIXED_PRECISIONS)} or null")


def load_recipe(args: argparse.Namespace) -> dict:
    """Reads the YAML recipe, applies the command-line overrides (values are parsed as YAML) and validates the
    result against the schema (`validate_recipe`): a misspelt or unsupported key raises instead of being ignored."""
    path = Path(args.config)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {str(path)!r} does not exist; see configuration/ for the shipped ones")
    recipe = yaml.safe_load(path.read_text()) or {}
    validate_recipe(recipe, str(path))
    for section in ("model", "data", "train", "eval"):
        if recipe.get(section) is None:
            recipe[section] = {}
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
    validate_recipe(recipe, f"{path} with the command-line overrides")
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
        aggregation = {k: v for k, v in overrides.items() if k in _AGGREGATION_FIELDS}
        model.set_aggregation(**aggregation)  # the head's: its momentum encoder (if any) follows the online one
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
        num_frames=data.get("num_frames", 32), size={"shortest_edge": size}, crop_size={"height": size, "width": size},
        video_backend=data.get("video_backend", "auto"), isolate_decoder=data.get("isolate_decoder", True),
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
    """No decodable video was found for a batch (its own rows, the reservoir and the spare rows all failed)."""


# Exceptions that mean "this file is missing, corrupt or undecodable": the video processor raises
# `VideoDecodingError` (a ValueError) for every decoder failure, missing files and unreadable images are OSErrors.
# Anything else is a bug and is raised. The evaluation uses the same tuple.
MEDIA_ERRORS = (OSError, ValueError)


class VideoTextCollator:
    """Turns rows into a batch in a DataLoader worker: decodes and samples the videos, tokenises the texts.

    A training batch never dies of bad videos: a row whose video fails to decode is replaced by a recent good sample
    (video and texts together, so the pair stays consistent) from a small reservoir kept by this worker, and counted
    (``stats["failures"]``), so that batch shapes stay equal on every process. While the reservoir is still empty
    (the first batches), the `spare_rows` (a few rows of the split) are decoded to fill it. With `strict` the error is
    raised instead. Frame sampling is seeded per example (seed, epoch, position in the epoch's global order), so a
    resumed run sees exactly the frames an uninterrupted run would and two processes never share a seed.

    Args:
        text_lengths: the text columns to tokenise and their padded length, e.g. ``{"text": 64}`` or
            ``{"question": 35, "answer": 10}``. The first one becomes ``input_ids``/``attention_mask``, the others
            ``<name>_input_ids``/``<name>_attention_mask``.
        reservoir_size: how many recent good samples a worker keeps as replacements.
        spare_rows: rows to decode when a replacement is needed and the reservoir is empty.
    """

    def __init__(self, processor, text_lengths: dict[str, int], sampling: str, num_frames: int, seed: int,
                 strict: bool, reservoir_size: int = 8, spare_rows: list[dict] | tuple = ()):
        self.processor = processor
        self.text_lengths = text_lengths
        self.sampling = sampling
        self.num_frames = num_frames
        self.seed = seed
        self.strict = strict
        self.reservoir: collections.deque = collections.deque(maxlen=max(1, int(reservoir_size)))
        self.spare_rows = list(spare_rows)

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

    @staticmethod
    def _key(row: dict) -> str:
        return str(row.get("video_id") or row.get("video") or row.get("image"))

    def _replacements(self, count: int, taken: set[str], failures: list[str]) -> list[tuple[torch.Tensor, dict]]:
        """`count` recent good samples, distinct and not already in the batch when the reservoir allows (a batch of
        one repeated video has no hard negative); spare rows are decoded while the reservoir holds too few."""
        def distinct() -> int:
            return sum(self._key(row) not in taken for _, row in self.reservoir)

        while distinct() < min(count, self.reservoir.maxlen) and self.spare_rows:
            row = self.spare_rows.pop(0)
            try:
                self.reservoir.append((self.decode(row), row))
            except MEDIA_ERRORS as error:
                failures.append(f"spare row {row.get('video') or row.get('image')}: {error}")
        if not self.reservoir:
            raise DecodeFailures(
                "no decodable video for this batch: its videos, the reservoir of recent good samples (empty) and the "
                "spare rows all failed:\n" + "\n".join(failures))
        newest_first = list(reversed(self.reservoir))
        ranked = [s for s in newest_first if self._key(s[1]) not in taken] + [
            s for s in newest_first if self._key(s[1]) in taken]
        return [ranked[i % len(ranked)] for i in range(count)]

    def __call__(self, rows: list[dict]) -> dict:
        start = time.perf_counter()
        samples, failures = [], []
        for row in rows:
            try:
                video = self.decode(row)
            except MEDIA_ERRORS as error:  # missing, corrupt or undecodable media
                if self.strict:
                    raise
                failures.append(f"{row.get('video') or row.get('image')}: {type(error).__name__}: {error}")
                samples.append(None)
                continue
            samples.append((video, row))
        good = [sample for sample in samples if sample is not None]
        failed = [i for i, sample in enumerate(samples) if sample is None]
        # The batch's own good samples join the reservoir first: a batch with one good video never fails, even
        # while the reservoir is empty and the spare rows fail (other videos are still preferred as replacements).
        self.reservoir.extend(good)
        if failed:
            taken = {self._key(row) for _, row in good}
            for i, sample in zip(failed, self._replacements(len(failed), taken, failures)):
                samples[i] = sample
        batch = {"pixel_values": torch.stack([video for video, _ in samples])}
        rows = [row for _, row in samples]
        for position, (name, length) in enumerate(self.text_lengths.items()):
            encoded = self.processor.tokenizer(
                [row[name] for row in rows], padding="max_length", truncation=True, max_length=length,
                return_tensors="pt",
            )
            prefix = "" if position == 0 else f"{name}_"
            batch[f"{prefix}input_ids"] = encoded["input_ids"]
            batch[f"{prefix}attention_mask"] = encoded["attention_mask"]
        batch["video_key"] = [self._key(row) for row in rows]
        batch["stats"] = {"decode_seconds": time.perf_counter() - start, "videos": len(rows), "failures": failures,
                          "replaced": len(failed)}
        return batch


class _Positioned(torch.utils.data.Dataset):
    """A map-style share of a split with each row's position in the epoch's global order attached (per-example
    seeds), starting at `offset`."""

    def __init__(self, rows, epoch: int, offset: int, first_position: int):
        self.rows, self.epoch, self.offset, self.first_position = rows, epoch, offset, first_position

    def __len__(self) -> int:
        return len(self.rows) - self.offset

    def __getitem__(self, index: int) -> dict:
        index += self.offset
        return {**self.rows[index], "position": self.first_position + index, "epoch": self.epoch}


def _iterate_rows(stream, chunk: int = 256):
    """The rows of a `datasets.IterableDataset`, read with `.iter()`: plain iteration inside a DataLoader worker
    would make datasets split the shards between workers itself, which `StreamedEpoch` does by position."""
    for columns in stream.iter(batch_size=chunk):
        names = list(columns)
        for i in range(len(columns[names[0]]) if names else 0):
            yield {name: columns[name][i] for name in names}


class StreamedEpoch(torch.utils.data.IterableDataset):
    """One process's batches of rows of a streamed (`datasets.IterableDataset`) split for one epoch, resumable
    exactly on any number of processes and DataLoader workers.

    The epoch's global order is ``rows.shuffle(seed, buffer_size)`` with ``set_epoch(epoch)`` set on the very dataset
    that is iterated (shard order and shuffle buffer change every epoch). Global row ``g`` belongs to process
    ``g % world``; that process's ``j``-th row (``j = g // world``) belongs to its batch ``j // batch_size``. Batches
    before `start_batch` (already trained on) are skipped, and worker ``w`` of ``W`` yields the batches ``b`` with
    ``(b - start_batch) % W == w``, which is the order in which a DataLoader takes them. So the batches, their order
    and every row's position (the per-example seed) depend only on (seed, epoch, rank, world, batch_size), not on
    where a run was interrupted, nor on the number of shards or workers. Each process (and worker) reads the rows'
    metadata of the whole stream and keeps its share; only kept rows are decoded.

    datasets' own ``IterableDataset.state_dict()`` is not used: it loses the shuffle buffer's content on resume (so
    the resumed order differs) and needs a stateful DataLoader to track positions across workers.
    """

    def __init__(self, rows, seed: int, epoch: int, rank: int, world: int, batch_size: int, start_batch: int = 0,
                 buffer_size: int = 1000):
        self.rows, self.seed, self.epoch = rows, seed, epoch
        self.rank, self.world, self.batch_size, self.start_batch = rank, world, batch_size, start_batch
        self.buffer_size = buffer_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        stream = self.rows.shuffle(seed=self.seed, buffer_size=self.buffer_size)
        stream.set_epoch(self.epoch)
        batch: list[dict] = []
        for position, row in enumerate(_iterate_rows(stream)):
            if position % self.world != self.rank:
                continue
            index = (position // self.world) // self.batch_size
            if index < self.start_batch or (index - self.start_batch) % workers != worker:
                continue
            batch.append({**row, "position": position, "epoch": self.epoch})
            if len(batch) == self.batch_size:
                yield batch
                batch = []


@dataclass
class TrainState:
    """Where the loop is, saved with every checkpoint (Accelerate's `register_for_checkpointing`)."""

    epoch: int = 0
    micro_batches_in_epoch: int = 0
    global_step: int = 0
    decode_failures: int = 0  # replaced videos on all processes, up to this checkpoint

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def epoch_loader(rows, state: TrainState, per_device_batch: int, seed: int, rank: int, world: int,
                 collator, workers: int, buffer_size: int = 1000) -> DataLoader:
    """This process's DataLoader for the current epoch, shuffled with (seed, epoch), from the saved position on.

    Every process consumes the same number of rows per step, so the saved position (micro-batches into the epoch)
    is the same on all of them.
    """
    from datasets import IterableDataset

    start = state.micro_batches_in_epoch
    # Its own generator: creating the loader must not draw from the global RNG, which a resumed run restores.
    generator = torch.Generator().manual_seed(seed + state.epoch)
    if isinstance(rows, IterableDataset):
        epoch_data = StreamedEpoch(rows, seed, state.epoch, rank, world, per_device_batch, start, buffer_size)
        return DataLoader(epoch_data, batch_size=None, collate_fn=collator, num_workers=workers, generator=generator)
    per_process = len(rows) // world  # equal shares on every process
    shard = rows.shuffle(seed=seed + state.epoch).select(range(rank * per_process, (rank + 1) * per_process))
    epoch_data = _Positioned(shard, state.epoch, min(start * per_device_batch, per_process), rank * per_process)
    return DataLoader(epoch_data, batch_size=per_device_batch, collate_fn=collator, num_workers=workers,
                      drop_last=True, generator=generator)


def spare_rows(rows, count: int) -> list[dict]:
    """The first `count` rows of the split: decoded to fill an empty reservoir (see `VideoTextCollator`)."""
    from datasets import IterableDataset

    if isinstance(rows, IterableDataset):
        return list(itertools.islice(_iterate_rows(rows), count))
    return [rows[i] for i in range(min(count, len(rows)))]


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


def learning_rate(step: float, train_cfg: dict, max_steps: int) -> float:
    """The learning rate of optimiser step `step` (0-based): linear warm-up from ``warmup_start_lr`` (default 0) to
    ``lr`` over the warm-up steps, then ``scheduler`` (cosine, linear or constant) from ``lr`` down to ``min_lr``
    (default 0), reached at ``max_steps``."""
    lr = float(train_cfg.get("lr", 1e-5))
    start_lr, min_lr = float(train_cfg.get("warmup_start_lr") or 0.0), float(train_cfg.get("min_lr") or 0.0)
    warmup = warmup_steps(train_cfg, max_steps)
    if step < warmup:
        return start_lr + (lr - start_lr) * step / warmup
    kind = train_cfg.get("scheduler", "cosine")
    if kind == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if kind == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps(train_cfg: dict, max_steps: int) -> int:
    return int(train_cfg.get("warmup_steps") or int(float(train_cfg.get("warmup_ratio") or 0.0) * max_steps))


def build_scheduler(optimizer, train_cfg: dict, max_steps: int, ticks_per_step: int = 1):
    """`learning_rate` as a `LambdaLR`. Once prepared by Accelerate the scheduler is stepped `ticks_per_step` times
    per optimiser step (``num_processes`` unless ``split_batches``), and not on accumulation micro-batches nor on
    steps the optimiser skipped (fp16 overflow)."""
    lr = float(train_cfg.get("lr", 1e-5))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda tick: learning_rate(tick / ticks_per_step, train_cfg, max_steps) / lr)


def resolve_mixed_precision(value: str | None) -> str | None:
    """Precedence: the recipe's ``train.mixed_precision`` wins when it is set to ``no``, ``fp16``, ``bf16`` or
    ``fp8``; with ``auto`` or null (or no key) the Accelerate launch configuration decides (``mixed_precision`` of
    ``--config_file``, ``--mixed_precision``, or ``ACCELERATE_MIXED_PRECISION``; ``no`` without any). Without a GPU,
    a recipe's ``fp16`` becomes ``no`` (CPU autocast has no fp16 GradScaler path); ``bf16`` runs with CPU autocast."""
    if value in (None, "auto"):
        return None
    if value == "fp16" and not torch.cuda.is_available():
        print("train.mixed_precision=fp16 needs a GPU: training in fp32 on CPU")
        return "no"
    return value


def warn_if_launch_config_ignored(accelerator: Accelerator) -> None:
    """Accelerate (1.15) only turns FSDP or DeepSpeed on with GPUs (or other accelerators): on CPU processes
    (`cpu=True`, gloo) it silently runs plain data parallelism (MULTI_CPU). Say so instead of pretending."""
    for name, variable in (("FSDP", "ACCELERATE_USE_FSDP"), ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED")):
        if os.environ.get(variable, "false").lower() == "true" and name.upper() not in str(accelerator.distributed_type):
            accelerator.print(f"warning: the launch configuration asks for {name}, but Accelerate runs "
                              f"{accelerator.distributed_type} here ({name} needs GPUs; see configuration/README.md)")


def main(task: Task, argv: list[str] | None = None) -> dict:
    """Trains, saves ``OUT/final``, then evaluates; returns the evaluation metrics."""
    args = parse_args(f"TESTA {task.name} training", argv)
    recipe = load_recipe(args)
    if recipe.get("task") not in (None, task.name):
        raise ValueError(f"{args.config}: task={recipe['task']!r}, but this script trains {task.name!r} "
                         f"(pass --set task={task.name} to reuse the recipe)")
    data_cfg, train_cfg = recipe["data"], recipe["train"]
    output_dir = Path(args.output_dir)
    streaming = bool(data_cfg.get("streaming", task.name == "pretrain"))

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, CPU processes under `--multi_gpu` would not join one group
        gradient_accumulation_steps=train_cfg.get("grad_accum", 1),
        mixed_precision=resolve_mixed_precision(train_cfg.get("mixed_precision")),
        log_with=_trackers() or None,  # `[]` makes accelerate warn on every process
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False),
        # Joint mode leaves the temporal attention unused; other settings use every parameter.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(train_cfg.get(
            "find_unused_parameters", recipe["model"].get("vision_config", {}).get("aggregation_dims") == "joint")))],
    )
    warn_if_launch_config_ignored(accelerator)
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, mixed precision "
                      f"{accelerator.mixed_precision} (recipe: {train_cfg.get('mixed_precision')})")
    seed = train_cfg.get("seed", 42)
    # Distinct streams per process (dropout masks, hard negatives); save_state/load_state keep each process's state.
    set_seed(seed, device_specific=True)
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
    # Momentum contrast (the contrastive heads' `model.momentum`; the QA head has none) starts now (random queues,
    # copies of the online weights), before anything else draws from the seeded generator.
    has_momentum = hasattr(model, "momentum")
    if has_momentum:
        model.start_momentum()
    if task.prepare_model is not None:
        task.prepare_model(model, processor, recipe, accelerator)
    if train_cfg.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    # Momentum EMA + queue once per optimiser step (after it), not per micro-batch: see `MomentumContrast`.
    if has_momentum:
        model.defer_momentum_updates(True)
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
    ticks = 1 if accelerator.split_batches else accelerator.num_processes
    scheduler = build_scheduler(optimizer, train_cfg, max_steps, ticks)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        accelerator.print(f"resumed from {args.resume_from} at step {state.global_step} (epoch {state.epoch})")

    # Replacements counted on this process since the start (or resume); the checkpointed state holds the global
    # total (Accelerate saves custom state from the main process only, so a per-process count would be wrong there).
    failures_at_start, local_failures = state.decode_failures, 0

    def global_failures() -> int:  # collective
        total = accelerator.reduce(torch.tensor([local_failures], device=accelerator.device), reduction="sum")
        return failures_at_start + int(total.item())

    text_lengths = {name: int(data_cfg.get(key, default)) for name, (key, default) in task.text_lengths.items()}
    reservoir = int(train_cfg.get("reservoir_size", 8))
    collator = VideoTextCollator(processor, text_lengths, data_cfg.get("sampling", "random"),
                                 int(data_cfg.get("num_frames", 32)), seed, args.strict_data, reservoir,
                                 [] if args.strict_data else spare_rows(rows, reservoir))
    workers = int(data_cfg.get("num_workers", 2))
    buffer_size = int(data_cfg.get("shuffle_buffer", 1000))
    accelerator.init_trackers(f"testa-{task.name}", config=_flat(recipe))
    progress = tqdm(total=max_steps, initial=state.global_step, disable=not accelerator.is_local_main_process,
                    desc=task.name, dynamic_ncols=True)
    save_every = int(train_cfg.get("save_every") or 0)
    log_every = max(1, int(train_cfg.get("log_every") or 1))
    clip = train_cfg.get("max_grad_norm")
    throughput = {"decode_seconds": 0.0, "videos": 0, "wait_seconds": 0.0, "step_seconds": 0.0}
    log_path = output_dir / "train_log.jsonl"
    output_dir.mkdir(parents=True, exist_ok=True)
    head = accelerator.unwrap_model(model)

    # The loop.
    model.train()
    loop_start = time.perf_counter()
    while state.global_step < max_steps:
        loader = epoch_loader(rows, state, per_device_batch, seed, accelerator.process_index,
                              accelerator.num_processes, collator, workers, buffer_size)
        wait_start = time.perf_counter()
        for batch in synchronized(loader, accelerator):
            throughput["wait_seconds"] += time.perf_counter() - wait_start
            stats = batch.pop("stats")
            throughput["decode_seconds"] += stats["decode_seconds"]
            throughput["videos"] += stats["videos"]
            if stats["replaced"]:
                local_failures += stats["replaced"]
                print(f"warning (process {accelerator.process_index}): {stats['replaced']} videos failed to decode "
                      f"and were replaced by recent good samples ({local_failures} so far on this process): "
                      f"{stats['failures'][0]}", flush=True)
            batch = move_to_device(batch, accelerator.device)
            warmup_progress = 1.0 if micro_per_epoch is None or state.epoch > 0 else state.micro_batches_in_epoch / micro_per_epoch
            step_start = time.perf_counter()
            with accelerator.accumulate(model):
                loss = task.compute_loss(model, batch, warmup_progress)
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), float(clip))
                step_lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                scheduler.step()  # Accelerate's scheduler only advances on real optimiser steps
                optimizer.zero_grad()
                if accelerator.sync_gradients and has_momentum:
                    head.momentum_step()  # EMA of the updated weights, then enqueue this step's momentum features
            throughput["step_seconds"] += time.perf_counter() - step_start
            state.micro_batches_in_epoch += 1
            if accelerator.sync_gradients:
                state.global_step += 1
                loss_value = accelerator.reduce(loss.detach().float(), reduction="mean").item()
                progress.set_postfix(loss=f"{loss_value:.4f}")
                progress.update(1)
                if state.global_step % log_every == 0 or state.global_step == max_steps:
                    accelerator.log({"train/loss": loss_value, "train/lr": step_lr}, step=state.global_step)
                    if accelerator.is_main_process:
                        with log_path.open("a") as log:
                            log.write(json.dumps({"step": state.global_step, "loss": loss_value, "lr": step_lr})
                                      + "\n")
                if save_every and state.global_step % save_every == 0:
                    state.decode_failures = global_failures()
                    accelerator.save_state(str(output_dir / "checkpoints" / f"step_{state.global_step}"))
                if state.global_step >= max_steps:
                    break
            wait_start = time.perf_counter()
        else:  # the epoch's data ran out
            if state.micro_batches_in_epoch == 0:  # on some process: the split is smaller than one global batch
                raise ValueError(
                    f"Epoch {state.epoch} gave no complete batch on every process: the training split is smaller than "
                    f"one global batch ({per_device_batch} rows x {accelerator.num_processes} processes). Lower "
                    "train.batch_size or add data."
                )
            state.epoch += 1
            state.micro_batches_in_epoch = 0
    progress.close()
    _report_throughput(accelerator, throughput, workers, time.perf_counter() - loop_start)
    failures = global_failures()
    if failures:
        accelerator.print(f"{failures} training videos failed to decode and were replaced (all processes)")

    # The final folder first, so that an evaluation failure cannot lose the trained model; then evaluation.
    save_final(accelerator, model, processor, output_dir / "final")
    metrics = {}
    if task.evaluate is not None and not args.no_eval:
        metrics = task.evaluate(accelerator.unwrap_model(model), processor, recipe, accelerator)
        accelerator.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))},
                        step=state.global_step)
    metrics["train_decode_failures"] = failures
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
