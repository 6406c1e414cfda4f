"""The training loop shared by pretraining and fine-tuning, written once.

A task script (``train/finetune_retrieval.py``, ``train/finetune_qa.py``, ``train/pretrain.py``) describes its task
with a :class:`Task` (model class, collation, loss, evaluation) and calls :func:`main`. The pieces:

1. recipe (`train.recipe`): a YAML file from ``configuration/`` with command-line overrides, parsed into a typed
   `Recipe` (every key's default declared once; unknown keys raise);
2. model (here): a fresh `TestaConfig` model, or ``init_from`` one of our folders, an original TESTA ``.pth`` or a
   BLIP checkpoint (converted on the fly);
3. data (`train.data`): any split ``datasets`` reads (our jsonl/parquet folders, a Hub id), streamed or not,
   reshuffled every epoch, shared between processes by position and decoded in DataLoader workers by the
   `TestaVideoProcessor`; undecodable videos are replaced from a reservoir of recent good samples;
4. the loop (here): AdamW, warm-up + cosine/linear/constant schedule (prepared by Accelerate), gradient
   accumulation, clipping, mixed precision and gradient checkpointing through Accelerate, the momentum encoder
   updated once per optimiser step, a progress bar, trackers, ``save_state`` every N steps and exact resumption on
   any number of processes (model, optimiser, scheduler, per-process RNG, queues and the position in the data);
5. a final ``save_pretrained`` folder (``OUTPUT/final``) with the processor and remote code, then evaluation.

The same script runs on 1 CPU, 2 CPU processes (``accelerate launch --multi_gpu --num_processes 2 ...``), one or
many GPUs and several nodes. The names of `train.recipe` and `train.data` that the task scripts and the evaluation
use are importable from here too.
"""

import datetime
import json
import math
import multiprocessing
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from modeling_testa import TestaConfig, TestaForVideoQA
from modeling_testa.aggregation_settings import AGGREGATION_FIELDS
from modeling_testa.process_start import die_with_launcher

from .data import (  # re-exported (`__all__`): `from train.loop import load_rows` keeps working
    MEDIA_ERRORS,
    CollectiveTimeout,
    DecodeFailures,
    StreamedEpoch,
    VideoTextCollator,
    build_processor,
    collective,
    epoch_loader,
    load_rows,
    move_to_device,
    spare_rows,
    synchronized,
)
from .recipe import (  # re-exported (`__all__`), as above
    MIXED_PRECISIONS,
    RECIPE_KEYS,
    SCHEDULERS,
    TASKS,
    Recipe,
    TrainRecipe,
    as_recipe,
    as_train_recipe,
    load_recipe,
    parse_args,
    validate_recipe,
)


# ----------------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------------


def build_model(model_class: type, recipe: "Recipe | Mapping"):
    """A fresh model from the recipe's `model` section, or `init_from` a checkpoint with the recipe's settings.

    `init_from` may be one of our `save_pretrained` folders, an original TESTA `.pth`, or a transformers BLIP
    checkpoint (folder or Hub id), which is converted to TESTA on the fly. The recipe's aggregation and training
    settings (R_T, R_S, queue, alpha, ...) apply on top of the checkpoint's architecture.
    """
    recipe = as_recipe(recipe)
    settings, init_from = recipe.model_settings(), recipe.init_from
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
        top_level = {k: v for k, v in overrides.items() if k not in RECIPE_AGGREGATION_FIELDS}
        model = model_class.from_pretrained(str(source), dtype=torch.float32, **top_level)
        aggregation = {k: v for k, v in overrides.items() if k in RECIPE_AGGREGATION_FIELDS}
        model.set_aggregation(**aggregation)  # the head's: its momentum encoder (if any) follows the online one
        copied = model.start_decoder_from_text_encoder() if isinstance(model, TestaForVideoQA) else []
        if copied:
            print(f"{source}: the answer decoder starts from the text encoder's weights ({len(copied)} tensors)")
        return model
    from modeling_testa.convert_blip_to_testa import convert_blip_to_testa

    overrides.pop("dec_token_id", None)  # [DEC] is BLIP's bos token
    vision = config.vision_config
    return convert_blip_to_testa(init_from, num_frames=vision.num_frames, image_size=vision.image_size,
                                 model_class=model_class, **overrides)


# The aggregation settings a recipe applies to a loaded checkpoint: all of them but `trace_source`, an output option.
RECIPE_AGGREGATION_FIELDS = tuple(name for name in AGGREGATION_FIELDS if name != "trace_source")
_TRAINING_FIELDS = ("momentum", "alpha", "k_test", "negative_all_rank", "label_smoothing", "video_pooling", "temperature")


def _recipe_overrides(config: TestaConfig, settings: dict) -> dict:
    """The recipe values that apply to a loaded checkpoint: aggregation settings and training hyper-parameters
    (architecture fields come from the checkpoint). The queue length and the [ENC]/[DEC] ids only apply when the
    recipe sets them."""
    overrides = {name: getattr(config.vision_config, name) for name in RECIPE_AGGREGATION_FIELDS}
    overrides.update({name: getattr(config, name) for name in _TRAINING_FIELDS})
    overrides.update({name: settings[name] for name in ("queue_size", "enc_token_id", "dec_token_id") if name in settings})
    return overrides


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


# ----------------------------------------------------------------------------------------------------------------------
# Task description and the loop
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """What differs between pretraining, retrieval and QA fine-tuning.

    Attributes:
        name: ``"retrieval"``, ``"qa"`` or ``"pretrain"`` (also selects the data files of our folders).
        model_class: the TESTA head to train.
        text_lengths: the ``data`` key holding the padded length of every text column to tokenise, in order; e.g.
            ``{"text": "max_text_length"}`` (the defaults are `DataRecipe`'s, per task `TASK_DEFAULTS`).
        compute_loss: ``(model, batch, warmup_progress) -> loss``; ``warmup_progress`` goes from 0 to 1 over the first
            epoch (the original ramps the distillation weight that way).
        evaluate: ``(model, processor, recipe, accelerator) -> metrics``; runs on every process.
        prepare_model: optional hook ``(model, processor, recipe, accelerator)`` after the model is built.
    """

    name: str
    model_class: type
    text_lengths: dict[str, str]
    compute_loss: Callable[[Any, dict, float], torch.Tensor]
    evaluate: Callable[..., dict] | None = None
    prepare_model: Callable[..., None] | None = None


def learning_rate(step: float, train: "TrainRecipe | Mapping", max_steps: int) -> float:
    """The learning rate of optimiser step `step` (0-based): linear warm-up from ``warmup_start_lr`` to ``lr`` over
    the warm-up steps, then ``scheduler`` (cosine, linear or constant) from ``lr`` down to ``min_lr``, reached at
    ``max_steps``. ``train`` is the recipe's section (a mapping may be partial: `TrainRecipe`'s defaults apply)."""
    train = as_train_recipe(train)
    lr, start_lr, min_lr = train.lr, train.warmup_start_lr, train.min_lr
    warmup = warmup_steps(train, max_steps)
    if step < warmup:
        return start_lr + (lr - start_lr) * step / warmup
    if train.scheduler == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if train.scheduler == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps(train: "TrainRecipe | Mapping", max_steps: int) -> int:
    """``warmup_steps`` when set (and not 0), else ``warmup_ratio`` of ``max_steps``."""
    train = as_train_recipe(train)
    return int(train.warmup_steps or int(train.warmup_ratio * max_steps))


def build_scheduler(optimizer, train: "TrainRecipe | Mapping", max_steps: int, ticks_per_step: int = 1):
    """`learning_rate` as a `LambdaLR`. Once prepared by Accelerate the scheduler is stepped `ticks_per_step` times
    per optimiser step (``num_processes`` unless ``split_batches``), and not on accumulation micro-batches nor on
    steps the optimiser skipped (fp16 overflow)."""
    train = as_train_recipe(train)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda tick: learning_rate(tick / ticks_per_step, train, max_steps) / train.lr)


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


def check_not_a_worker_import() -> None:
    """DataLoader workers start from a forkserver (`modeling_testa.process_start.WORKER_START_METHOD`), which, as
    ``spawn``, imports the main script in every worker: a script that calls `main` outside ``if __name__ ==
    "__main__":`` would start a second training inside each worker. Refuse it there, with the fix."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "train.loop.main() was called while a DataLoader worker imported the training script: call it under "
            "`if __name__ == \"__main__\":` in your script (DataLoader workers import the script, as with any "
            "multiprocessing start method but fork)")


def main(task: Task, argv: list[str] | None = None) -> dict:
    """Trains, saves ``OUT/final``, then evaluates; returns the evaluation metrics."""
    check_not_a_worker_import()
    # A rank ends with its launcher, however the launcher ends (its DataLoader workers and helper processes end with
    # the rank: modeling_testa.worker_process); `accelerate launch` starts ranks from its main thread.
    die_with_launcher()
    args = parse_args(f"TESTA {task.name} training", argv)
    recipe = load_recipe(args, task=task.name)
    if recipe.task not in (None, task.name):
        raise ValueError(f"{args.config}: task={recipe.task!r}, but this script trains {task.name!r} "
                         f"(pass --set task={task.name} to reuse the recipe)")
    data_cfg, train_cfg = recipe.data, recipe.train
    output_dir = Path(args.output_dir)
    if train_cfg.keep_checkpoints is not None and train_cfg.keep_checkpoints < 1:
        raise ValueError(f"train.keep_checkpoints={train_cfg.keep_checkpoints}: keep at least 1 checkpoint (the one "
                         "a run resumes from), or null to keep all")
    check_output_dir(output_dir, args.resume_from, args.overwrite)  # every process, before anything is written
    streaming = data_cfg.streaming
    find_unused = train_cfg.find_unused_parameters
    if find_unused is None:  # joint mode leaves the temporal attention unused; other settings use every parameter
        find_unused = (recipe.model.get("vision_config") or {}).get("aggregation_dims") == "joint"

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, CPU processes under `--multi_gpu` would not join one group
        gradient_accumulation_steps=train_cfg.grad_accum,
        mixed_precision=resolve_mixed_precision(train_cfg.mixed_precision),
        log_with=_trackers() or None,  # `[]` makes accelerate warn on every process
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(find_unused)),
                         # a process that waits longer than this for the others fails (`collective`): no endless wait
                         InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=train_cfg.collective_timeout))],
    )
    warn_if_launch_config_ignored(accelerator)
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, mixed precision "
                      f"{accelerator.mixed_precision} (recipe: {train_cfg.mixed_precision})")
    seed = train_cfg.seed
    # Distinct streams per process (dropout masks, hard negatives); save_state/load_state keep each process's state.
    set_seed(seed, device_specific=True)
    global_batch = train_cfg.batch_size
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
    if train_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # Momentum EMA + queue once per optimiser step (after it), not per micro-batch: see `MomentumContrast`.
    if has_momentum:
        model.defer_momentum_updates(True)
    rows = load_rows(recipe, data_cfg.train_split, task.name, streaming)
    micro_per_epoch = None if streaming else len(rows) // accelerator.num_processes // per_device_batch
    max_steps = train_cfg.max_steps
    if not max_steps:
        if micro_per_epoch is None:
            raise ValueError("a streamed dataset has no length: set train.max_steps (or --max-steps)")
        max_steps = train_cfg.epochs * micro_per_epoch // accumulation
    if max_steps < 1 or micro_per_epoch == 0:
        raise ValueError(f"nothing to train: {len(rows)} rows for a global batch of {global_batch}")
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=train_cfg.lr,
        weight_decay=train_cfg.weight_decay,
    )
    ticks = 1 if accelerator.split_batches else accelerator.num_processes
    scheduler = build_scheduler(optimizer, train_cfg, max_steps, ticks)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if args.overwrite and accelerator.is_main_process:
        clear_previous_run(output_dir)
    accelerator.wait_for_everyone()
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        accelerator.print(f"resumed from {args.resume_from} at step {state.global_step} (epoch {state.epoch})")
        if accelerator.is_main_process:  # the steps after the checkpoint are trained again: logged once
            trim_log(output_dir / "train_log.jsonl", state.global_step)

    # Replacements counted on this process since the start (or resume); the checkpointed state holds the global
    # total (Accelerate saves custom state from the main process only, so a per-process count would be wrong there).
    failures_at_start, local_failures = state.decode_failures, 0

    def at_step() -> str:  # where a collective waited, for its error
        return f"before step {state.global_step + 1} (epoch {state.epoch})"

    def global_failures() -> int:  # collective
        with collective(accelerator, "the other processes' count of replaced videos (all_reduce)", at_step):
            total = accelerator.reduce(torch.tensor([local_failures], device=accelerator.device), reduction="sum")
        return failures_at_start + int(total.item())

    text_lengths = {name: getattr(data_cfg, key) for name, key in task.text_lengths.items()}
    reservoir = train_cfg.reservoir_size
    collator = VideoTextCollator(processor, text_lengths, data_cfg.sampling, data_cfg.num_frames, seed,
                                 args.strict_data, reservoir, [] if args.strict_data else spare_rows(rows, reservoir))
    workers = data_cfg.num_workers
    buffer_size = data_cfg.shuffle_buffer
    accelerator.init_trackers(f"testa-{task.name}", config=_flat(recipe.to_dict()))
    progress = tqdm(total=max_steps, initial=state.global_step, disable=not accelerator.is_local_main_process,
                    desc=task.name, dynamic_ncols=True)
    save_every = train_cfg.save_every
    log_every = max(1, train_cfg.log_every)
    clip = train_cfg.max_grad_norm
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
        for batch in synchronized(loader, accelerator, at_step):
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
                with collective(accelerator, "the other processes' losses (all_reduce)", at_step):
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
                    if accelerator.is_main_process and train_cfg.keep_checkpoints is not None:
                        prune_checkpoints(output_dir / "checkpoints", train_cfg.keep_checkpoints)
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
    accelerator.print(final_report(metrics, output_dir))
    accelerator.end_training()
    return metrics


RUN_FILES = ("checkpoints", "final", "metrics.json", "train_log.jsonl", "logs")
"""What a run leaves in its ``--output-dir``: a folder holding any of them holds a previous run."""


def check_output_dir(output_dir: Path, resume_from: str | None, overwrite: bool) -> None:
    """Refuses an ``--output-dir`` that holds a previous run (`RUN_FILES`) unless ``--resume-from`` (continue it) or
    ``--overwrite`` (start over) says what to do, so that no run silently mixes its files with another's."""
    if resume_from and overwrite:
        raise ValueError("--resume-from continues a run and --overwrite deletes it: pass one of them")
    found = [name for name in RUN_FILES if (output_dir / name).exists()]
    if found and not (resume_from or overwrite):
        raise ValueError(f"--output-dir {str(output_dir)!r} holds a previous run ({', '.join(found)}): pass "
                         f"--resume-from {output_dir / 'checkpoints' / 'step_N'} to continue it, --overwrite to "
                         "delete it and start over, or another --output-dir")


def clear_previous_run(output_dir: Path) -> None:
    """Deletes what a previous run left in ``output_dir`` (`RUN_FILES`; other files are left alone)."""
    import shutil

    for name in RUN_FILES:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def trim_log(log_path: Path, step: int) -> None:
    """Keeps the lines of ``train_log.jsonl`` up to ``step`` (a resumed run logs the later steps again)."""
    if not log_path.is_file():
        return
    kept = [line for line in log_path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    log_path.write_text("".join(line + "\n" for line in kept))


def checkpoint_step(path: Path) -> int:
    """The step of a ``checkpoints/step_N`` folder (-1 for another name)."""
    prefix, _, number = path.name.partition("_")
    return int(number) if prefix == "step" and number.isdigit() else -1


def prune_checkpoints(directory: Path, keep: int) -> list[Path]:
    """Deletes all but the ``keep`` latest ``step_N`` checkpoints in ``directory``; returns the deleted ones."""
    import shutil

    steps = sorted((p for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) >= 0), key=checkpoint_step)
    old = steps[:-keep] if keep else steps
    for path in old:
        shutil.rmtree(path)
    return old


def final_report(metrics: dict, output_dir: Path) -> str:
    """What a run ends with: its metrics (one line) and where the model and the metrics are."""
    numbers = {key: value for key, value in metrics.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    shown = ", ".join(f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}"
                      for key, value in numbers.items())
    return (f"metrics: {shown or 'none (no evaluation)'} (in {output_dir / 'metrics.json'})\n"
            f"saved the model to {output_dir / 'final'} (a save_pretrained folder the pipelines load)")


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
    with collective(accelerator, "the other processes to finish training (barrier)", "after the last step"):
        accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(str(path), state_dict=state_dict)
        processor.save_pretrained(str(path))
    with collective(accelerator, f"the main process to write {path} (barrier)", "after the last step"):
        accelerator.wait_for_everyone()


__all__ = [
    # this module's own
    "RECIPE_AGGREGATION_FIELDS",
    "Task",
    "TrainState",
    "build_model",
    "build_scheduler",
    "check_not_a_worker_import",
    "check_output_dir",
    "clear_previous_run",
    "final_report",
    "learning_rate",
    "main",
    "prune_checkpoints",
    "resolve_mixed_precision",
    "RUN_FILES",
    "save_final",
    "trim_log",
    "warmup_steps",
    "warn_if_launch_config_ignored",
    # re-exported from train.recipe and train.data, where they live
    "MEDIA_ERRORS",
    "MIXED_PRECISIONS",
    "CollectiveTimeout",
    "RECIPE_KEYS",
    "SCHEDULERS",
    "TASKS",
    "DecodeFailures",
    "Recipe",
    "StreamedEpoch",
    "TrainRecipe",
    "VideoTextCollator",
    "build_processor",
    "collective",
    "epoch_loader",
    "load_recipe",
    "load_rows",
    "move_to_device",
    "parse_args",
    "spare_rows",
    "synchronized",
    "validate_recipe",
]
