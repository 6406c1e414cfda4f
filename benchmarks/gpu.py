"""The numbers the paper is about, measured on one GPU: encoder speed, memory at 96 frames, a training step,
`torch.compile`, and whether ``frame_matching="original"`` merges the same tokens on CUDA as on the CPU.

    PYTHONPATH=. python3 -m benchmarks.gpu --output-dir docs          # one CUDA GPU; about 5 minutes on an H200
    python -m benchmarks.gpu --dry-run --output-dir /tmp/gpu-dry      # tiny models on the CPU in seconds (tested)

Writes ``gpu.md`` and ``gpu.json`` to ``--output-dir`` and prints the tables at the end. Random weights and random
videos (speed and memory do not depend on the values). Sections run in this order of priority, within
``--time-budget`` seconds counted from the start; a section that does not fit in what is left is recorded as skipped,
with the reason, and both files are rewritten after every section (and during the long ones), so a run that is
killed keeps what it finished:

1. ``headline``: encoder videos/s at 32 frames, bf16, batch 8: TESTA (R_T=1, R_S=12) against our encoder without
   aggregation (R_T=R_S=0) and transformers' `TimesformerModel`. Targets: >= 1.7x and >= 2x.
1b. ``same_mode`` (issue 36): TESTA against the encoder without aggregation at 8/32/96 frames and batch 1/8/64, bf16,
   both run the same way: eagerly, replayed as a captured CUDA graph, and ``torch.compile(mode="reduce-overhead")``
   (32 frames only, run last). Targets: >= 1.7x at 32 frames and batch 8, >= 1.5x at batch 1, >= 1x at 8 frames.
1c. ``fused_merge`` (issue 36): TESTA with its merge as fused Triton kernels (the default on CUDA) against the same
   encoder merging with PyTorch ops, 32 frames, batch 1 and 8, eager and CUDA graph; same merges, output difference.
2. ``memory_96``: peak `torch.cuda.max_memory_allocated` of `TestaForVideoTextRetrieval` built from the QuerYD
   96-frame recipe (ViT-B/16 224 + BERT-base, random init), for inference (the matching head on one text per video)
   and for one training step, without aggregation and with R_T=4, R_S=8. The paper's ablation: 12.6 GB against
   19.2 GB, a ratio of 0.66.
3. ``train_step``: one bf16 training step at batch 8, 32 frames (QuerYD 32-frame recipe): seconds and memory.
4. ``cuda_vs_cpu``: the same encoder and input with ``frame_matching="original"`` on CUDA and on the CPU: the same
   merges? (`torch.mode` breaks ties its own way on CUDA; the library's `aggregation.mode` is meant not to.)
5. ``compile``: `torch.compile` with static shapes of the TESTA encoder at 32 frames, bf16, batch 8.
6. ``speed_grid``: the rest of the grid: the three encoders x 8/32/96 frames x batch 1/8 x fp32/bf16/fp16 x eager/SDPA
   attention, with the kernel SDPA dispatched to (flash / efficient / cudnn / math), read from the profiler.

A training step is the one `train.finetune_retrieval` takes (`compute_loss`: VTC + VTM with momentum distillation,
the model built by `train.loop.build_model` from the recipe), then AdamW as the recipe sets it and the momentum
update; bf16 means autocast with fp32 weights, as Accelerate's ``mixed_precision="bf16"``. Timings: ``--warmup``
passes, then the median of ``--iterations`` passes, each synchronised. fp32 runs with PyTorch's defaults: no TF32
in matmuls, TF32 in cuDNN convolutions (the patch embedding); ``cuda_vs_cpu`` turns the latter off.

``--dry-run`` runs every section with tiny models on the CPU (``--device`` to change): the CUDA-only measurements
(memory) are recorded as unavailable with the reason, ``compile`` uses the ``eager`` backend (graph capture without
code generation), and ``cuda_vs_cpu`` compares the CPU with itself.
"""

import argparse
import copy
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from modeling_testa import TestaForVideoTextRetrieval, TestaVisionConfig, TestaVisionModel, estimate_encoder_gmac, fused_aggregation
from testa_runtimes import optimize_for_inference
from modeling_testa.aggregation import mode as deterministic_mode
from benchmarks.encoder_args import encoder_settings
from benchmarks.encoder_speed import build, synchronize, time_forward


REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTIONS = ("sdpa", "eager")
ENCODER_LABELS = {
    "testa": "TESTA",
    "testa-none": "ours, no aggregation",
    "timesformer": "transformers TimesformerModel",
}
HEADLINE_TARGETS = {"vs_no_aggregation": 1.7, "vs_timesformer": 2.0}
PAPER_MEMORY = {"no_aggregation_gb": 19.2, "aggregation_gb": 12.6, "target_ratio": 0.66}
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


# ----------------------------------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Scale:
    """The sizes of a run: the paper's (ViT-B/16 at 224 px and the QuerYD recipes as they are) or tiny ones."""

    encoder: dict  # image_size, hidden_size, layers, heads: as `encoder_args.add_encoder_arguments` names them
    frames: tuple[int, int, int]  # the grid's frame counts; [1] is the headline's "32 frames", [2] the "96 frames"
    reductions: dict  # frames -> (R_T, R_S) of TESTA
    batches: tuple[int, int]  # the grid's batch sizes; [1] is the headline's "batch 8"
    memory_batch: int  # videos per training step at 96 frames
    warmup: int
    iterations: int
    recipe_overrides: tuple[str, ...] = ()  # `--set` values on top of the recipes (tiny models for the dry run)
    compile_backend: str = "inductor"
    cpu_compare_frames: int = 32
    scaling_batches: tuple[int, ...] = (8, 16, 32, 64)  # batch_scaling: where kernel launches stop dominating
    same_mode_batches: tuple[int, ...] = (1, 8, 64)  # same_mode: TESTA against no aggregation, one mode for both

    @property
    def headline_frames(self) -> int:
        return self.frames[1]

    @property
    def long_frames(self) -> int:
        return self.frames[2]

    @property
    def headline_batch(self) -> int:
        return self.batches[1]


PAPER_SCALE = Scale(
    encoder=dict(image_size=224, hidden_size=768, layers=12, heads=12),
    frames=(8, 32, 96),
    reductions={8: (1, 12), 32: (1, 12), 96: (4, 8)},
    batches=(1, 8),
    memory_batch=2,  # the released f96 fine-tuning config: 2 videos per GPU (recipe comment)
    warmup=2,
    iterations=5,
)

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DRY_SCALE = Scale(
    encoder=dict(image_size=64, hidden_size=32, layers=2, heads=2),
    frames=(4, 8, 12),
    reductions={4: (1, 3), 8: (1, 3), 12: (2, 2)},
    batches=(1, 2),
    memory_batch=2,
    warmup=1,
    iterations=2,
    recipe_overrides=(
        "model.vision_config.image_size=64", "model.vision_config.hidden_size=32",
        "model.vision_config.num_hidden_layers=2", "model.vision_config.num_attention_heads=2",
        "model.vision_config.intermediate_size=128", "model.projection_dim=16", "data.max_text_length=8",
        *(f"model.text_config.{key}={value}" for key, value in TINY_TEXT.items()),
    ),
    compile_backend="eager",
    cpu_compare_frames=8,
    scaling_batches=(1, 2),
    same_mode_batches=(1, 2),
)

RECIPES = {"headline": "configuration/retrieval_queryd_f32.yaml", "long": "configuration/retrieval_queryd_f96.yaml"}


# ----------------------------------------------------------------------------------------------- run bookkeeping


class Budget:
    """Seconds left of ``--time-budget``, counted from the start of the run."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def log(budget: Budget, message: str) -> None:
    """A progress line, flushed at once (the run is read through a pipe)."""
    print(f"[{budget.elapsed():6.1f} s] {message}", flush=True)


@dataclass
class Context:
    """What every section reads: the options, the sizes, the device, the budget, and the report it writes to."""

    args: argparse.Namespace
    scale: Scale
    device: str
    budget: Budget
    report: dict
    speed: dict = field(default_factory=dict)  # measurement key -> entry, shared by the headline and the grid
    unsupported: dict = field(default_factory=dict)  # (encoder, attention) -> transformers' error message

    def save(self) -> None:
        """Rewrites gpu.json and gpu.md with everything measured so far."""
        write_report(self.report, Path(self.args.output_dir))

    def free(self) -> None:
        """Collects garbage and returns the freed memory to the device (CUDA), so that peaks do not mix."""
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    run: Callable[[Context, dict], None]  # fills the section's results dict in place (partial results survive)
    min_seconds: float  # skipped when less than this is left of the budget


# ------------------------------------------------------------------------------------------------ measurements


def encoder_namespace(scale: Scale, frames: int, device: str, dtype: str) -> argparse.Namespace:
    """The options `encoder_speed.build` reads, for ``frames`` frames and that frame count's TESTA reductions."""
    temporal, spatial = scale.reductions[frames]
    return argparse.Namespace(frames=frames, temporal_reduction=temporal, spatial_reduction=spatial, device=device,
                              dtype=DTYPES[dtype], **scale.encoder)


def sdpa_backend(op_name: str) -> str | None:
    """The SDPA backend of a profiler op name (``aten::_scaled_dot_product_flash_attention`` -> ``"flash"``), or
    None for an op that is not an SDPA kernel dispatch."""
    if not op_name.startswith("aten::_scaled_dot_product_"):
        return None
    for backend in SDPA_BACKENDS:
        if backend in op_name:
            return backend + (" (CPU)" if op_name.endswith("_for_cpu") else "")
    return op_name.removeprefix("aten::")


def sdpa_kernels(forward: Callable[[], Any]) -> dict[str, int]:
    """How many attention calls of ``forward()`` each SDPA backend ran, from the profiler's op names: the backend
    `scaled_dot_product_attention` dispatched to on the actual shapes, dtype and device."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        forward()
    counts = Counter(sdpa_backend(event.name) for event in profile.events())
    counts.pop(None, None)
    return dict(counts)


def speed_key(variant: str, frames: int, batch: int, dtype: str, attention: str) -> str:
    return f"{variant}|{frames}|{batch}|{dtype}|{attention}"


def output_tokens_and_gmac(model: torch.nn.Module, frames: int, image_size: int) -> tuple[int, float]:
    """Video tokens out of the encoder and its closed-form GMAC per video (`estimate_encoder_gmac`; transformers'
    TimesformerModel counts as our encoder without aggregation)."""
    if isinstance(model, TestaVisionModel):
        config = model.config
    else:
        config = TestaVisionConfig(num_frames=frames, image_size=image_size, hidden_size=model.config.hidden_size,
                                   num_hidden_layers=model.config.num_hidden_layers,
                                   num_attention_heads=model.config.num_attention_heads,
                                   intermediate_size=model.config.intermediate_size, temporal_reduction=0,
                                   spatial_reduction=0)
    gmac, tokens = estimate_encoder_gmac(config, num_frames=frames, image_size=image_size)
    return tokens, gmac


def budgeted_forward_times(ctx: Context, model: torch.nn.Module, video: torch.Tensor
                           ) -> tuple[list[float] | None, str | None]:
    """``--iterations`` timed forwards after ``--warmup``, the first of which also tells whether the rest fits in the
    time budget: ``(seconds, None)``, or ``(None, why not)``."""
    first = time_forward(model, video, ctx.device)
    needed = first * (ctx.scale.warmup - 1 + ctx.scale.iterations)
    if needed > ctx.budget.left():
        return None, f"needs about {needed:.0f} s (first pass {first:.2f} s), {ctx.budget.left():.0f} s left"
    for _ in range(ctx.scale.warmup - 1):
        time_forward(model, video, ctx.device)
    return [time_forward(model, video, ctx.device) for _ in range(ctx.scale.iterations)], None


def measure_encoder(ctx: Context, model: torch.nn.Module, variant: str, frames: int, batch: int, dtype: str,
                    attention: str) -> dict:
    """Median seconds of ``--iterations`` forward passes after ``--warmup`` (the first of which also tells whether
    the rest fits in the budget), videos/s, and for SDPA the kernels it ran."""
    size = ctx.scale.encoder["image_size"]
    entry = dict(variant=variant, label=ENCODER_LABELS[variant], frames=frames, batch=batch, dtype=dtype,
                 attention=attention)
    entry["output_tokens"], entry["gmac_per_video"] = output_tokens_and_gmac(model, frames, size)
    video = torch.randn(batch, frames, 3, size, size, device=ctx.device, dtype=getattr(torch, DTYPES[dtype]))
    times, skipped = budgeted_forward_times(ctx, model, video)
    if times is None:
        entry["skipped"] = skipped
        return entry
    entry.update(seconds=statistics.median(times), all_seconds=times)
    entry["videos_per_second"] = batch / entry["seconds"]
    if attention == "sdpa":
        def forward():
            with torch.inference_mode():
                model(pixel_values=video)
            synchronize(ctx.device)

        entry["sdpa_kernels"] = sdpa_kernels(forward)
    return entry


def build_encoder(ctx: Context, variant: str, frames: int, dtype: str, attention: str) -> torch.nn.Module | str:
    """The encoder, or the error message of an attention implementation the model does not support (remembered, so
    that it is not built again)."""
    if (variant, attention) in ctx.unsupported:
        return ctx.unsupported[(variant, attention)]
    torch.manual_seed(0)
    try:
        return build(variant, encoder_namespace(ctx.scale, frames, ctx.device, dtype), attention)
    except ValueError as error:  # transformers: "... does not support an attention implementation through ..."
        ctx.unsupported[(variant, attention)] = str(error).split(". ")[0].rstrip(".") + "."  # the first sentence
        return ctx.unsupported[(variant, attention)]


def measure_speeds(ctx: Context, variant: str, frames: int, dtype: str, attention: str, batches) -> list[dict]:
    """One encoder built once and measured at every batch size not measured yet (entries cached in ``ctx.speed``)."""
    keys = [speed_key(variant, frames, batch, dtype, attention) for batch in batches]
    if all(key in ctx.speed for key in keys):
        return [ctx.speed[key] for key in keys]
    model = build_encoder(ctx, variant, frames, dtype, attention)
    for batch, key in zip(batches, keys):
        if key in ctx.speed:
            continue
        if isinstance(model, str):
            ctx.speed[key] = dict(variant=variant, label=ENCODER_LABELS[variant], frames=frames, batch=batch,
                                  dtype=dtype, attention=attention, unsupported=model)
            continue
        try:
            ctx.speed[key] = measure_encoder(ctx, model, variant, frames, batch, dtype, attention)
        except torch.cuda.OutOfMemoryError as error:
            ctx.speed[key] = dict(variant=variant, label=ENCODER_LABELS[variant], frames=frames, batch=batch,
                                  dtype=dtype, attention=attention, skipped=f"out of memory: {str(error)[:160]}")
        entry = ctx.speed[key]
        result = entry.get("videos_per_second")
        log(ctx.budget, f"{entry['label']}, {frames} frames, batch {batch}, {dtype}, {attention}: "
                        + (f"{result:.2f} videos/s {entry.get('sdpa_kernels', '')}" if result else
                           entry.get("skipped") or entry.get("unsupported")))
    del model
    ctx.free()
    return [ctx.speed[key] for key in keys]


def peak_memory(device: str, work: Callable[[], Any]) -> tuple[Any, dict | None]:
    """Runs ``work()``; on CUDA also returns its peak `torch.cuda.max_memory_allocated` (and reserved) in bytes,
    with the memory allocated before it. None elsewhere."""
    if not device.startswith("cuda"):
        return work(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = work()
    torch.cuda.synchronize()
    return result, dict(peak_allocated=torch.cuda.max_memory_allocated(),
                        peak_reserved=torch.cuda.max_memory_reserved(), allocated_before=before)


MEMORY_UNAVAILABLE = "needs CUDA (torch.cuda.max_memory_allocated); not measured on the CPU"


# ------------------------------------------------------------------------------------------ the training step


def retrieval_recipe(ctx: Context, which: str, frames: int, reductions: tuple[int, int]) -> dict:
    """A QuerYD recipe (``which``: "headline" = 32 frames, "long" = 96 frames) as the training scripts read it, from
    scratch (no ``init_from``), with ``frames`` and ``(R_T, R_S)`` set, plus the dry run's tiny sizes."""
    from train.loop import load_recipe, parse_args

    settings = ["model.init_from=null", f"model.vision_config.num_frames={frames}", f"data.num_frames={frames}",
                f"model.vision_config.temporal_reduction={reductions[0]}",
                f"model.vision_config.spatial_reduction={reductions[1]}", *ctx.scale.recipe_overrides]
    argv = ["--config", str(REPO / RECIPES[which])] + [item for value in settings for item in ("--set", value)]
    return load_recipe(parse_args("benchmarks.gpu", argv))


def retrieval_batch(recipe: dict, batch: int, device: str) -> dict:
    """Random videos and texts of the recipe's sizes, as the training collator returns them."""
    vision = recipe["model"]["vision_config"]
    text_length = int(recipe["data"].get("max_text_length", 64))
    vocab = int(recipe["model"].get("text_config", {}).get("vocab_size", 30524))
    size = int(vision.get("image_size", 224))
    return dict(
        pixel_values=torch.randn(batch, int(vision["num_frames"]), 3, size, size, device=device),
        input_ids=torch.randint(0, vocab - 2, (batch, text_length), device=device),
        attention_mask=torch.ones(batch, text_length, dtype=torch.long, device=device),
        video_key=[f"video-{index}" for index in range(batch)],
    )


class Trainer:
    """`TestaForVideoTextRetrieval` from a recipe, on the device, with the training loop's optimiser and momentum
    protocol; `step` takes one training step as `train.loop.main` does."""

    def __init__(self, recipe: dict, device: str, precision: str):
        from train.loop import build_model

        torch.manual_seed(0)
        with torch.device(device):
            self.model = build_model(TestaForVideoTextRetrieval, recipe).to(device)
        self.device = device
        self.autocast = getattr(torch, DTYPES[precision]) if precision != "fp32" else None
        train = recipe["train"]
        self.model.start_momentum()
        self.model.defer_momentum_updates(True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(train.get("lr", 1e-5)),
                                           weight_decay=float(train.get("weight_decay", 0.05)))

    def autocast_context(self):
        return torch.autocast(self.device.split(":")[0], dtype=self.autocast, enabled=self.autocast is not None)

    def step(self, batch: dict) -> float:
        from train.finetune_retrieval import compute_loss

        self.model.train()
        with self.autocast_context():
            loss = compute_loss(self.model, batch, warmup_progress=1.0)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.momentum_step()
        return loss.item()

    def infer(self, batch: dict) -> torch.Tensor:
        """The matching head on the batch's (video, text) pairs, in inference mode."""
        self.model.eval()
        with torch.inference_mode(), self.autocast_context():
            scores = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                pixel_values=batch["pixel_values"], use_itm_head=True).itm_score
        return scores.float()

    def timed_step(self, batch: dict) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        loss = self.step(batch)
        synchronize(self.device)
        if not math.isfinite(loss):
            raise FloatingPointError(f"the training loss is {loss}")
        return time.perf_counter() - start


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


# ---------------------------------------------------------------------------------------------------- sections


def run_headline(ctx: Context, results: dict) -> None:
    scale = ctx.scale
    frames, batch = scale.headline_frames, scale.headline_batch
    runs = [("testa", "sdpa"), ("testa-none", "sdpa"), ("timesformer", "eager"), ("testa", "eager"),
            ("testa-none", "eager"), ("timesformer", "sdpa")]
    results["frames"], results["batch"], results["dtype"] = frames, batch, "bf16"
    results["reductions"] = list(scale.reductions[frames])
    results["entries"] = []
    for variant, attention in runs:
        results["entries"] += measure_speeds(ctx, variant, frames, "bf16", attention, [batch])
        ctx.save()
    speed = {(e["variant"], e["attention"]): e.get("videos_per_second") for e in results["entries"]}
    ratios = {}
    if speed[("testa", "sdpa")] and speed[("testa-none", "sdpa")]:
        ratios["vs_no_aggregation"] = speed[("testa", "sdpa")] / speed[("testa-none", "sdpa")]
    if speed[("testa", "eager")] and speed[("testa-none", "eager")]:
        ratios["vs_no_aggregation_eager"] = speed[("testa", "eager")] / speed[("testa-none", "eager")]
    timesformer = max((v for (variant, _), v in speed.items() if variant == "timesformer" and v), default=None)
    if speed[("testa", "sdpa")] and timesformer:
        ratios["vs_timesformer"] = speed[("testa", "sdpa")] / timesformer
    results["ratios"] = ratios
    results["targets"] = {name: dict(target=target, value=ratios.get(name),
                                     met=None if ratios.get(name) is None else ratios[name] >= target)
                          for name, target in HEADLINE_TARGETS.items()}


def run_memory_96(ctx: Context, results: dict) -> None:
    scale = ctx.scale
    frames, batch = scale.long_frames, scale.memory_batch
    settings = {"none": (0, 0), "aggregation": scale.reductions[frames]}
    results.update(frames=frames, batch=batch, reductions=list(settings["aggregation"]), rows=[])
    for precision in ("bf16", "fp32"):
        for name, reductions in settings.items():
            if ctx.budget.left() < 15:
                results["rows"].append(dict(precision=precision, aggregation=name, skipped="time budget spent"))
                continue
            recipe = retrieval_recipe(ctx, "long", frames, reductions)
            row = dict(precision=precision, aggregation=name, reductions=list(reductions))
            try:
                trainer = Trainer(recipe, ctx.device, precision)
                data = retrieval_batch(recipe, batch, ctx.device)
                row["weights_bytes"] = weights_bytes(trainer.model)
                row["video_tokens"] = estimate_encoder_gmac(trainer.model.config.vision_config)[1]
                _, row["inference"] = peak_memory(ctx.device, lambda: trainer.infer(data))
                start = time.perf_counter()
                loss, row["train_step"] = peak_memory(ctx.device, lambda: trainer.step(data))
                synchronize(ctx.device)
                row["train_step_seconds"] = time.perf_counter() - start
                row["loss"] = loss
            except torch.cuda.OutOfMemoryError as error:
                row["error"] = f"out of memory: {str(error)[:200]}"
            if row.get("train_step") is None and "error" not in row:
                row["memory_unavailable"] = MEMORY_UNAVAILABLE
            results["rows"].append(row)
            log(ctx.budget, f"memory at {frames} frames, {precision}, {name}: "
                            + json.dumps({k: row.get(k) for k in ("inference", "train_step", "error")}))
            results.update(memory_ratios(results["rows"]))
            trainer = data = None
            ctx.free()
            ctx.save()


def memory_ratios(rows: list[dict]) -> dict:
    """``ratios``: aggregation / no aggregation of the peak allocated memory, per precision and pass, of the rows
    measured so far; ``targets``: the training-step ratios against the paper's 0.66."""
    ratios = {}
    by_key = {(row["precision"], row["aggregation"]): row for row in rows}
    for precision in ("bf16", "fp32"):
        for phase in ("inference", "train_step"):
            none, merged = by_key.get((precision, "none"), {}), by_key.get((precision, "aggregation"), {})
            if none.get(phase) and merged.get(phase):
                ratios[f"{precision} {phase}"] = merged[phase]["peak_allocated"] / none[phase]["peak_allocated"]
    limit = PAPER_MEMORY["target_ratio"]
    targets = {name: dict(target=limit, value=value, met=value <= limit)
               for name, value in ratios.items() if name.endswith("train_step")}
    return dict(ratios=ratios, targets=targets)


def run_train_step(ctx: Context, results: dict) -> None:
    scale = ctx.scale
    frames, batch = scale.headline_frames, scale.headline_batch
    results.update(frames=frames, batch=batch, precision="bf16", rows=[])
    for name, reductions in (("aggregation", scale.reductions[frames]), ("none", (0, 0))):
        recipe = retrieval_recipe(ctx, "headline", frames, reductions)
        row = dict(aggregation=name, reductions=list(reductions))
        try:
            trainer = Trainer(recipe, ctx.device, "bf16")
            data = retrieval_batch(recipe, batch, ctx.device)
            first = trainer.timed_step(data)
            needed = first * (scale.warmup - 1 + scale.iterations)
            if needed > ctx.budget.left():
                row["skipped"] = (f"needs about {needed:.0f} s (first step {first:.2f} s), "
                                  f"{ctx.budget.left():.0f} s left")
            else:
                for _ in range(scale.warmup - 1):
                    trainer.timed_step(data)
                times, row["memory"] = peak_memory(
                    ctx.device, lambda: [trainer.timed_step(data) for _ in range(scale.iterations)])
                row.update(seconds=statistics.median(times), all_seconds=times)
                row["videos_per_second"] = batch / row["seconds"]
                if row["memory"] is None:
                    row["memory_unavailable"] = MEMORY_UNAVAILABLE
        except torch.cuda.OutOfMemoryError as error:
            row["error"] = f"out of memory: {str(error)[:200]}"
        results["rows"].append(row)
        log(ctx.budget, f"training step, {frames} frames, batch {batch}, bf16, {name}: "
                        + (f"{row['seconds']:.3f} s" if "seconds" in row else row.get("skipped") or row.get("error")))
        trainer = data = None
        ctx.free()
        ctx.save()


def compare_runs(model_a: torch.nn.Module, model_b: torch.nn.Module, video: torch.Tensor, device_a: str,
                 device_b: str) -> dict:
    """Runs the same video through two copies of an encoder (``trace_source=True``) on two devices and compares
    what they merged (the source map: the output token of every input patch; the token sizes) and their outputs."""
    with torch.inference_mode():
        out_a = model_a(pixel_values=video.to(device_a))
        out_b = model_b(pixel_values=video.to(device_b))
    source_a, source_b = out_a.source_map.cpu(), out_b.source_map.cpu()
    sizes_a, sizes_b = out_a.token_sizes.float().cpu(), out_b.token_sizes.float().cpu()
    same_shape = out_a.last_hidden_state.shape == out_b.last_hidden_state.shape
    result = dict(
        source_map_agreement=(source_a == source_b).float().mean().item(),
        same_merges=bool(torch.equal(source_a, source_b)),
        same_token_sizes=bool(torch.equal(sizes_a, sizes_b)),
        output_tokens=int(out_a.last_hidden_state.shape[1]),
    )
    if same_shape:
        difference = (out_a.last_hidden_state.float().cpu() - out_b.last_hidden_state.float().cpu()).abs()
        result["max_abs_output_difference"] = difference.max().item()
    return result


def mode_tie_agreement(device_a: str, device_b: str, rows: int = 4096, width: int = 16) -> dict:
    """On integer rows full of ties: how often `torch.mode` (and the library's deterministic `mode`) give the same
    value on both devices."""
    values = torch.randint(0, 4, (rows, width), generator=torch.Generator().manual_seed(0))
    torch_a = torch.mode(values.to(device_a), dim=-1).values.cpu()
    torch_b = torch.mode(values.to(device_b), dim=-1).values.cpu()
    ours_a = deterministic_mode(values.to(device_a)).cpu()
    ours_b = deterministic_mode(values.to(device_b)).cpu()
    return dict(rows=rows, torch_mode_agreement=(torch_a == torch_b).float().mean().item(),
                library_mode_agreement=(ours_a == ours_b).float().mean().item())


def run_cuda_vs_cpu(ctx: Context, results: dict) -> None:
    scale = ctx.scale
    frames = scale.cpu_compare_frames
    temporal, spatial = scale.reductions[frames]
    args = encoder_namespace(scale, frames, "cpu", "fp32")
    config = TestaVisionConfig(**encoder_settings(args), temporal_reduction=temporal, spatial_reduction=spatial,
                               frame_matching="original", trace_source=True)
    torch.manual_seed(0)
    model_cpu = TestaVisionModel(config).eval()
    model_other = copy.deepcopy(model_cpu).to(ctx.device)
    size = scale.encoder["image_size"]
    generator = torch.Generator().manual_seed(0)
    videos = {
        "random frames": torch.randn(1, frames, 3, size, size, generator=generator),
        # identical frames make identical keys: exact ties in the frame votes, where torch.mode's rule would show
        "static segments (every frame 4 times)": torch.randn(1, frames // 4, 3, size, size, generator=generator)
        .repeat_interleave(4, dim=1),
    }
    results.update(devices=["cpu", ctx.device], frames=frames, reductions=[temporal, spatial], dtype="fp32",
                   frame_matching="original", inputs={})
    convolution_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # true fp32 on both devices (cuDNN convolutions default to TF32)
    try:
        for name, video in videos.items():
            results["inputs"][name] = compare_runs(model_cpu, model_other, video, "cpu", ctx.device)
            log(ctx.budget, f"{name}: {results['inputs'][name]}")
            ctx.save()
    finally:
        torch.backends.cudnn.allow_tf32 = convolution_tf32
    results["mode_ties"] = mode_tie_agreement("cpu", ctx.device)


def run_compile(ctx: Context, results: dict) -> None:
    scale = ctx.scale
    frames, batch = scale.headline_frames, scale.headline_batch
    results.update(frames=frames, batch=batch, dtype="bf16", attention="sdpa", backend=scale.compile_backend,
                   dynamic=False)
    model = build_encoder(ctx, "testa", frames, "bf16", "sdpa")
    size = scale.encoder["image_size"]
    video = torch.randn(batch, frames, 3, size, size, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(scale.warmup):
        time_forward(model, video, ctx.device)
    eager = [time_forward(model, video, ctx.device) for _ in range(scale.iterations)]
    results.update(eager_seconds=statistics.median(eager), eager_all_seconds=eager)
    ctx.save()
    compiled = torch.compile(model, dynamic=False, backend=scale.compile_backend)
    results["compile_seconds"] = time_forward(compiled, video, ctx.device)  # the first call compiles
    log(ctx.budget, f"compiled in {results['compile_seconds']:.1f} s")
    for _ in range(scale.warmup - 1):
        time_forward(compiled, video, ctx.device)
    times = [time_forward(compiled, video, ctx.device) for _ in range(scale.iterations)]
    results.update(compiled_seconds=statistics.median(times), compiled_all_seconds=times)
    results["speedup"] = results["eager_seconds"] / results["compiled_seconds"]
    with torch.inference_mode():
        reference, output = model(pixel_values=video), compiled(pixel_values=video)
    results["same_output_shape"] = reference.last_hidden_state.shape == output.last_hidden_state.shape
    if results["same_output_shape"]:
        results["max_abs_output_difference"] = (
            (reference.last_hidden_state.float() - output.last_hidden_state.float()).abs().max().item())
    torch.compiler.reset()


def run_speed_grid(ctx: Context, results: dict) -> None:
    scale = ctx.scale
    frames_order = (scale.headline_frames, scale.long_frames, scale.frames[0])
    batches = sorted(scale.batches, reverse=True)
    results["entries"] = []
    for dtype in ("bf16", "fp16", "fp32"):
        for frames in frames_order:
            for variant in ("testa", "testa-none", "timesformer"):
                for attention in ATTENTIONS:
                    keys = [speed_key(variant, frames, batch, dtype, attention) for batch in batches]
                    if ctx.budget.left() < 3 and not all(key in ctx.speed for key in keys):
                        for batch, key in zip(batches, keys):
                            ctx.speed.setdefault(key, dict(variant=variant, label=ENCODER_LABELS[variant],
                                                           frames=frames, batch=batch, dtype=dtype,
                                                           attention=attention, skipped="time budget spent"))
                    results["entries"] += measure_speeds(ctx, variant, frames, dtype, attention, batches)
            ctx.save()


def graph_replay_seconds(ctx: Context, model: torch.nn.Module, video: torch.Tensor) -> float:
    """Median seconds of one forward replayed as a captured CUDA graph: the GPU's work without Python and kernel
    launch overhead (the shapes are static for given R_T, R_S). Raises where the forward cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            for _ in range(2):
                model(pixel_values=video)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(pixel_values=video)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(ctx.scale.iterations):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del graph
    return statistics.median(times)


def run_batch_scaling(ctx: Context, results: dict) -> None:
    """TESTA against no aggregation (32 frames, bf16, SDPA) as the batch grows, run eagerly and replayed as a CUDA
    graph: where the merging's many small kernels, not the matrix products, set the time."""
    frames = ctx.scale.headline_frames
    results.update(frames=frames, dtype="bf16", attention="sdpa", entries=[])
    for variant in ("testa", "testa-none"):
        model = build_encoder(ctx, variant, frames, "bf16", "sdpa")
        for batch in ctx.scale.scaling_batches:
            entry = dict(variant=variant, label=ENCODER_LABELS[variant], batch=batch)
            try:
                eager = measure_encoder(ctx, model, variant, frames, batch, "bf16", "sdpa")
                entry["eager_seconds"] = eager.get("seconds")
                if ctx.device.startswith("cuda") and "seconds" in eager:
                    size = ctx.scale.encoder["image_size"]
                    video = torch.randn(batch, frames, 3, size, size, device=ctx.device, dtype=torch.bfloat16)
                    try:
                        entry["graph_seconds"] = graph_replay_seconds(ctx, model, video)
                    except Exception as error:  # a forward that cannot be captured: say why, keep the eager time
                        entry["graph_error"] = f"{type(error).__name__}: {str(error)[:160]}"
                    del video
                else:
                    entry["graph_error"] = "CUDA graphs need a CUDA device"
            except torch.cuda.OutOfMemoryError as error:
                entry["error"] = f"out of memory: {str(error)[:160]}"
            results["entries"].append(entry)
            log(ctx.budget, f"batch_scaling {entry['label']}, batch {batch}: eager {entry.get('eager_seconds')} s, "
                            f"graph {entry.get('graph_seconds', entry.get('graph_error'))}")
            ctx.save()
        del model
        ctx.free()


def render_batch_scaling(results: dict) -> list[str]:
    by = {(e["variant"], e["batch"]): e for e in results.get("entries", [])}
    batches = sorted({e["batch"] for e in results.get("entries", [])})
    lines = [f"{results.get('frames')} frames, bf16, SDPA; TESTA with R_T=1, R_S=12. Videos/s run eagerly and replayed "
             "as one captured CUDA graph (no Python or kernel-launch overhead), and TESTA's ratio over the encoder "
             "without aggregation in each.", "",
             "| batch | TESTA eager | no aggregation eager | ratio eager | TESTA graph | no aggregation graph | "
             "ratio graph |", "|---|---|---|---|---|---|---|"]

    def rate(entry, key):
        return entry["batch"] / entry[key] if entry and entry.get(key) else None

    for batch in batches:
        testa, none = by.get(("testa", batch)), by.get(("testa-none", batch))
        cells = [str(batch)]
        for key in ("eager_seconds", "graph_seconds"):
            a, b = rate(testa, key), rate(none, key)
            cells += [number(a), number(b), f"{a / b:.2f}x" if a and b else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    errors = sorted({e.get("graph_error") or e.get("error") for e in results.get("entries", [])} - {None})
    lines += [""] + [f"Not measured: {error}" for error in errors]
    return lines


EXECUTION_MODES = ("eager", "cuda_graph", "compile")
SAME_MODE_TARGETS = (  # issue 36, at the paper's sizes: (frames, batch, minimum TESTA / no aggregation ratio)
    ("headline", "headline", 1.7),  # 32 frames, batch 8
    ("headline", "smallest", 1.5),  # 32 frames, batch 1
    ("shortest", None, 1.0),  # 8 frames, every batch: never slower
)


def compiled_forward_seconds(ctx: Context, model: torch.nn.Module, video: torch.Tensor) -> tuple[float, float, Any]:
    """``torch.compile`` with static shapes (``mode="reduce-overhead"``, CUDA graphs, on CUDA; ``--compile-backend``
    elsewhere): compile seconds (the first call), median seconds per forward, and the compiled output."""
    if ctx.device.startswith("cuda"):
        compiled = torch.compile(model, dynamic=False, mode="reduce-overhead")
    else:
        compiled = torch.compile(model, dynamic=False, backend=ctx.scale.compile_backend)
    compile_seconds = time_forward(compiled, video, ctx.device)
    for _ in range(ctx.scale.warmup):
        time_forward(compiled, video, ctx.device)
    times = [time_forward(compiled, video, ctx.device) for _ in range(ctx.scale.iterations)]
    with torch.inference_mode():
        output = compiled(pixel_values=video).last_hidden_state.float().clone()
    return compile_seconds, statistics.median(times), output


def same_mode_entry(ctx: Context, model: torch.nn.Module, variant: str, frames: int, batch: int, mode: str) -> dict:
    """Median seconds of one forward of ``model`` in one execution mode, or why it was not measured."""
    entry = dict(variant=variant, frames=frames, batch=batch, mode=mode)
    size = ctx.scale.encoder["image_size"]
    video = torch.randn(batch, frames, 3, size, size, device=ctx.device, dtype=torch.bfloat16)
    try:
        if mode == "eager":
            times, skipped = budgeted_forward_times(ctx, model, video)
            if times is None:
                entry["skipped"] = skipped
                return entry
            entry["seconds"] = statistics.median(times)
        elif mode == "cuda_graph":
            if not ctx.device.startswith("cuda"):
                entry["unavailable"] = "CUDA graphs need a CUDA device"
                return entry
            entry["seconds"] = graph_replay_seconds(ctx, model, video)
        else:
            if frames != ctx.scale.headline_frames:
                entry["unavailable"] = f"compiled at {ctx.scale.headline_frames} frames only (compile time)"
                return entry
            if ctx.budget.left() < 90:
                entry["skipped"] = f"compiling needs time; {ctx.budget.left():.0f} s left"
                return entry
            entry["compile_seconds"], entry["seconds"], output = compiled_forward_seconds(ctx, model, video)
            with torch.inference_mode():
                reference = model(pixel_values=video).last_hidden_state.float()
            entry["max_abs_output_difference"] = (reference - output).abs().max().item()  # against eager
            torch.compiler.reset()
    except torch.cuda.OutOfMemoryError as error:
        entry["error"] = f"out of memory: {str(error)[:160]}"
    except Exception as error:  # a forward that cannot be captured or compiled: say why, measure the rest
        entry["error"] = f"{type(error).__name__}: {str(error)[:160]}"
    if "seconds" in entry:
        entry["videos_per_second"] = batch / entry["seconds"]
    return entry


def run_same_mode(ctx: Context, results: dict) -> None:
    """TESTA against the same encoder without aggregation at every frame count and batch, bf16, SDPA, with both
    encoders in the same execution mode: eager, replayed as one captured CUDA graph, and ``torch.compile``
    (reduce-overhead) at the headline frame count. The issue-36 targets are checked on the ratios."""
    scale = ctx.scale
    results.update(dtype="bf16", attention="sdpa", modes=list(EXECUTION_MODES), entries=[],
                   reductions={str(frames): list(scale.reductions[frames]) for frames in scale.frames})
    # eager and graphs everywhere first; compiling (a minute or more per shape) last, so a short budget skips it alone
    passes = [(frames, ("eager", "cuda_graph")) for frames in (scale.headline_frames, scale.frames[0], scale.long_frames)]
    passes += [(frames, ("compile",)) for frames in (scale.headline_frames, scale.frames[0], scale.long_frames)]
    for frames, modes in passes:
        for variant in ("testa", "testa-none"):
            model = build_encoder(ctx, variant, frames, "bf16", "sdpa")
            for batch in scale.same_mode_batches:
                for mode in modes:
                    entry = same_mode_entry(ctx, model, variant, frames, batch, mode)
                    results["entries"].append(entry)
                    outcome = next(entry[key] for key in ("seconds", "unavailable", "skipped", "error") if key in entry)
                    log(ctx.budget, f"same_mode {variant} {frames} frames, batch {batch}, {mode}: {outcome}")
                    ctx.free()
                ctx.save()
            del model
            ctx.free()
    results["ratios"] = same_mode_ratios(results["entries"])
    results["targets"] = same_mode_targets(results["ratios"], scale)


def same_mode_ratios(entries: list[dict]) -> list[dict]:
    """TESTA's videos/s over the unmerged encoder's, per (frames, batch, mode) where both were measured."""
    by = {(e["variant"], e["frames"], e["batch"], e["mode"]): e for e in entries}
    ratios = []
    for (variant, frames, batch, mode), testa in sorted(by.items()):
        plain = by.get(("testa-none", frames, batch, mode))
        if variant == "testa" and testa.get("seconds") and plain and plain.get("seconds"):
            ratios.append(dict(frames=frames, batch=batch, mode=mode, ratio=plain["seconds"] / testa["seconds"]))
    return ratios


def same_mode_targets(ratios: list[dict], scale: Scale) -> list[dict]:
    """Each target of :data:`SAME_MODE_TARGETS` at this scale's sizes, with the measured ratio it covers (the best
    execution mode counts; "every batch" takes the worst batch) and whether it is met."""
    frame_counts = {"headline": scale.headline_frames, "shortest": scale.frames[0]}
    batch_sizes = {"headline": scale.headline_batch, "smallest": scale.same_mode_batches[0], None: None}
    targets = []
    for frames_role, batch_role, minimum in SAME_MODE_TARGETS:
        frames, batch = frame_counts[frames_role], batch_sizes[batch_role]
        best = {}
        for r in ratios:
            if r["frames"] == frames and (batch is None or r["batch"] == batch):
                best[r["batch"]] = max(best.get(r["batch"], 0.0), r["ratio"])
        value = min(best.values()) if best else None
        label = f"{frames} frames, " + (f"batch {batch}" if batch is not None else "every batch")
        targets.append(dict(label=label, frames=frames, batch=batch, target=minimum, value=value,
                            met=None if value is None else value >= minimum))
    return targets


def render_same_mode(results: dict) -> list[str]:
    by = {(e["variant"], e["frames"], e["batch"], e["mode"]): e for e in results.get("entries", [])}
    ratios = {(r["frames"], r["batch"], r["mode"]): r["ratio"] for r in results.get("ratios", [])}
    reductions = results.get("reductions", {})
    lines = ["TESTA against the same encoder without aggregation, both run the same way: eagerly, replayed as one "
             "captured CUDA graph, or compiled (`torch.compile`, static shapes, `mode=\"reduce-overhead\"` on CUDA). "
             "bf16, SDPA; TESTA's R_T, R_S per frame count: "
             + ", ".join(f"{frames} frames {tuple(value)}" for frames, value in reductions.items()) + ".", "",
             "| frames | batch | mode | TESTA videos/s | no aggregation videos/s | ratio |", "|---|---|---|---|---|---|"]

    def cell(entry):
        if entry is None:
            return "–"
        if entry.get("videos_per_second"):
            return number(entry["videos_per_second"])
        return entry.get("unavailable") or entry.get("skipped") or entry.get("error") or "–"

    for frames, batch, mode in sorted({key[1:] for key in by}, key=lambda k: (k[0], k[1], EXECUTION_MODES.index(k[2]))):
        ratio = ratios.get((frames, batch, mode))
        lines.append(f"| {frames} | {batch} | {mode} | {cell(by.get(('testa', frames, batch, mode)))} | "
                     f"{cell(by.get(('testa-none', frames, batch, mode)))} | "
                     f"{f'{ratio:.2f}x' if ratio else '–'} |")
    lines += ["", "| target | required | measured (best mode) | met |", "|---|---|---|---|"]
    for target in results.get("targets", []):
        met = {True: "yes", False: "**no**", None: "not measured"}[target["met"]]
        value = f"{target['value']:.2f}x" if target["value"] else "–"
        lines.append(f"| {target['label']} | >= {target['target']:.1f}x | {value} | {met} |")
    return lines


def run_fused_merge(ctx: Context, results: dict) -> None:
    """TESTA with its merge as fused Triton kernels (`modeling_testa.fused_aggregation`, the default on CUDA) against
    the same encoder merging with PyTorch ops (its runtime's ``fused_kernels="off"``), at the headline frame count, bf16,
    SDPA, batch 1 and the headline batch, run eagerly and replayed as a CUDA graph; and whether both took the same
    merges (source maps) and how far their outputs are apart."""
    frames, size = ctx.scale.headline_frames, ctx.scale.encoder["image_size"]
    results.update(frames=frames, dtype="bf16", attention="sdpa", entries=[])
    model = build_encoder(ctx, "testa", frames, "bf16", "sdpa")
    # the same weights merging with PyTorch ops: the runtime's option (eager, as `model` runs without a runtime)
    models = {"auto": model, "off": optimize_for_inference(copy.deepcopy(model), backend="torch-eager",
                                                           fused_kernels="off")}
    for batch in sorted({ctx.scale.same_mode_batches[0], ctx.scale.headline_batch}):
        entry = dict(batch=batch)
        video = torch.randn(batch, frames, 3, size, size, device=ctx.device, dtype=torch.bfloat16)
        try:
            with torch.inference_mode():
                reference = models["off"](pixel_values=video, trace_source=True)
                launches = fused_aggregation.launches
                fused = model(pixel_values=video, trace_source=True)
            entry["fused_launches"] = fused_aggregation.launches - launches  # 0: the kernels are not used here
            entry["same_merges"] = torch.equal(fused.source_map, reference.source_map)
            entry["max_abs_output_difference"] = (fused.last_hidden_state.float()
                                                  - reference.last_hidden_state.float()).abs().max().item()
            for kernels, timed in models.items():
                times, skipped = budgeted_forward_times(ctx, timed, video)
                if times is None:
                    entry[f"eager_{kernels}_skipped"] = skipped
                    continue
                entry[f"eager_{kernels}_seconds"] = statistics.median(times)
                if ctx.device.startswith("cuda"):
                    entry[f"graph_{kernels}_seconds"] = graph_replay_seconds(ctx, timed, video)
        except torch.cuda.OutOfMemoryError as error:
            entry["error"] = f"out of memory: {str(error)[:160]}"
        except Exception as error:  # a forward that cannot be captured: say why, keep what was measured
            entry["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        results["entries"].append(entry)
        log(ctx.budget, f"fused_merge batch {batch}: {entry}")
        ctx.save()
        del video
        ctx.free()
    del model, models
    ctx.free()


def render_fused_merge(results: dict) -> list[str]:
    lines = [f"{results.get('frames')} frames, bf16, SDPA, TESTA (R_T=1, R_S=12): the merge as fused Triton kernels "
             "(the default on CUDA) against PyTorch ops (`fused_kernels=\"off\"`), in ms per forward, run "
             "eagerly and replayed as one captured CUDA graph; fused launches per forward (0: the kernels were not "
             "used on this device), whether both took the same merges, and their largest output difference.", "",
             "| batch | fused launches | same merges | max output difference | eager fused | eager PyTorch | "
             "speed-up eager | graph fused | graph PyTorch | speed-up graph |", "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(entry, key):
        return f"{entry[key] * 1e3:.2f}" if entry.get(key) else "–"

    def ratio(entry, mode):
        fused, plain = entry.get(f"{mode}_auto_seconds"), entry.get(f"{mode}_off_seconds")
        return f"{plain / fused:.2f}x" if fused and plain else "–"

    for entry in results.get("entries", []):
        if "error" in entry:
            lines.append(f"| {entry['batch']} | {entry['error']} | | | | | | | | |")
            continue
        lines.append(f"| {entry['batch']} | {entry.get('fused_launches', '–')} | {entry.get('same_merges', '–')} | "
                     f"{entry.get('max_abs_output_difference', float('nan')):.3g} | {ms(entry, 'eager_auto_seconds')} | "
                     f"{ms(entry, 'eager_off_seconds')} | {ratio(entry, 'eager')} | {ms(entry, 'graph_auto_seconds')} | "
                     f"{ms(entry, 'graph_off_seconds')} | {ratio(entry, 'graph')} |")
    return lines


SECTIONS = (
    Section("headline", "Encoder speed: TESTA, no aggregation, TimesformerModel", run_headline, min_seconds=20),
    Section("same_mode", "TESTA against no aggregation in the same execution mode", run_same_mode, min_seconds=30),
    Section("fused_merge", "The merge as fused kernels against PyTorch ops", run_fused_merge, min_seconds=20),
    Section("memory_96", "Peak memory of long clips: inference and one training step", run_memory_96, min_seconds=30),
    Section("train_step", "One bf16 training step", run_train_step, min_seconds=20),
    Section("cuda_vs_cpu", 'frame_matching="original" on CUDA against the CPU', run_cuda_vs_cpu, min_seconds=30),
    Section("compile", "torch.compile with static shapes", run_compile, min_seconds=120),
    Section("speed_grid", "Encoder speed grid", run_speed_grid, min_seconds=10),
    Section("batch_scaling", "Batch size and kernel-launch overhead", run_batch_scaling, min_seconds=20),
)


# ------------------------------------------------------------------------------------------------- environment


def nvidia_driver() -> str | None:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None


def environment(device: str) -> dict:
    info = dict(
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        platform=platform.platform(), cpu_threads=torch.get_num_threads(), device_type=device,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32,
    )
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), driver=nvidia_driver(),
                    gpu_memory_gib=properties.total_memory / GiB)
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")
    return info


def command_line(argv: list[str]) -> str:
    """The command, with the output folder written as OUTPUT_DIR (it is a path of the machine that ran it)."""
    shown, skip = [], False
    for item in argv:
        if skip:
            shown.append("OUTPUT_DIR")
            skip = False
        elif item == "--output-dir":
            shown.append(item)
            skip = True
        elif item.startswith("--output-dir="):
            shown.append("--output-dir=OUTPUT_DIR")
        else:
            shown.append(shlex.quote(item))
    return "PYTHONPATH=. python3 -m benchmarks.gpu " + " ".join(shown)


# ---------------------------------------------------------------------------------------------------- rendering


def number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def gmac_text(value: float) -> str:
    """One decimal at the paper's sizes, three significant digits for the dry run's tiny models."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def gib(measurement: dict | None, key: str = "peak_allocated") -> str:
    return "–" if not measurement else f"{measurement[key] / GiB:.2f}"


def kernels_text(entry: dict) -> str:
    kernels = entry.get("sdpa_kernels")
    if not kernels:
        return "–"
    return ", ".join(f"{name} x{count}" for name, count in sorted(kernels.items()))


def speed_rows(entries: list[dict]) -> list[str]:
    """The grid as a table; combinations a model does not support are listed once below it."""
    rows = ["| encoder | frames | batch | dtype | attention | SDPA kernel (calls) | median s per batch | videos/s |",
            "|---|---|---|---|---|---|---|---|"]
    unsupported = {}
    for e in entries:
        if "unsupported" in e:
            unsupported[(e["label"], e["attention"])] = e["unsupported"]
            continue
        if "skipped" in e:
            rows.append(f"| {e['label']} | {e['frames']} | {e['batch']} | {e['dtype']} | {e['attention']} | – | "
                        f"skipped: {e['skipped']} | – |")
            continue
        rows.append(f"| {e['label']} | {e['frames']} | {e['batch']} | {e['dtype']} | {e['attention']} | "
                    f"{kernels_text(e)} | {e['seconds']:.4f} | {e['videos_per_second']:.2f} |")
    if unsupported:
        rows.append("")
    rows += [f"Not run: {label} with {attention} attention ({message})"
             for (label, attention), message in unsupported.items()]
    return rows


def render_headline(results: dict) -> list[str]:
    lines = [f"{results['frames']} frames, batch {results['batch']}, bf16; TESTA with R_T={results['reductions'][0]}, "
             f"R_S={results['reductions'][1]}. GMAC per video: closed form (`estimate_encoder_gmac`).", "",
             "| encoder | attention | SDPA kernel (calls) | video tokens | GMAC per video | median s per batch | "
             "s per video | videos/s |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for e in results.get("entries", []):
        if "unsupported" in e:
            notes.append(f"Not run: {e['label']} with {e['attention']} attention ({e['unsupported']})")
            continue
        if "seconds" not in e:
            lines.append(f"| {e['label']} | {e['attention']} | – | – | – | skipped: {e['skipped']} | – | – |")
            continue
        lines.append(f"| {e['label']} | {e['attention']} | {kernels_text(e)} | {e['output_tokens']} | "
                     f"{gmac_text(e['gmac_per_video'])} | {e['seconds']:.4f} | {e['seconds'] / e['batch']:.4f} | "
                     f"{e['videos_per_second']:.2f} |")
    ratios = results.get("ratios", {})
    lines += ["", *notes, *([""] if notes else [])]
    names = {"vs_no_aggregation": "TESTA / ours without aggregation (SDPA)",
             "vs_no_aggregation_eager": "TESTA / ours without aggregation (eager)",
             "vs_timesformer": "TESTA (SDPA) / transformers TimesformerModel"}
    for name, label in names.items():
        target = results.get("targets", {}).get(name)
        verdict = "" if target is None or target["met"] is None else \
            f" (target >= {target['target']}x: {'met' if target['met'] else 'not met'})"
        lines.append(f"- {label}: {number(ratios.get(name))}x videos/s{verdict}")
    return lines


def render_memory(results: dict) -> list[str]:
    r_t, r_s = results["reductions"]
    lines = [f"`TestaForVideoTextRetrieval` from `{RECIPES['long']}` (random init), {results['frames']} frames, "
             f"batch {results['batch']}; peak `torch.cuda.max_memory_allocated` in GiB, weights and optimiser state "
             "included (reserved by the caching allocator in brackets). Inference: the matching head on one text per "
             "video; training step: VTC + VTM loss, backward, AdamW step, momentum update (the first step, so AdamW "
             "allocates its state in it).", "",
             f"| precision | pass | no aggregation | R_T={r_t}, R_S={r_s} | ratio | paper |",
             "|---|---|---|---|---|---|"]
    by_key = {(row["precision"], row["aggregation"]): row for row in results.get("rows", [])}
    ratios = results.get("ratios", {})
    for precision in ("bf16", "fp32"):
        for phase, label in (("inference", "inference"), ("train_step", "training step")):
            none, merged = by_key.get((precision, "none"), {}), by_key.get((precision, "aggregation"), {})
            if not none and not merged:
                continue

            def cell(row):
                if row.get(phase):
                    return f"{gib(row[phase])} ({gib(row[phase], 'peak_reserved')})"
                return row.get("error") or row.get("skipped") or ("not measured" if row.get("memory_unavailable")
                                                                  else "–")

            paper = (f"{PAPER_MEMORY['aggregation_gb']} / {PAPER_MEMORY['no_aggregation_gb']} GB = 0.66 "
                     f"(target <= {PAPER_MEMORY['target_ratio']})") if phase == "train_step" else "–"
            target = results.get("targets", {}).get(f"{precision} {phase}")
            verdict = "" if target is None else f" ({'met' if target['met'] else 'not met'})"
            lines.append(f"| {precision} | {label} | {cell(none)} | {cell(merged)} | "
                         f"{number(ratios.get(f'{precision} {phase}'))}{verdict} | {paper} |")
    unavailable = {row["memory_unavailable"] for row in results.get("rows", []) if row.get("memory_unavailable")}
    lines += [f"\nNot measured: {reason}; the passes ran." for reason in sorted(unavailable)]
    return lines


def render_train_step(results: dict) -> list[str]:
    lines = [f"`TestaForVideoTextRetrieval` from `{RECIPES['headline']}` (random init), {results['frames']} frames, "
             f"batch {results['batch']}, bf16 autocast; seconds per step (median), videos/s, and peak memory over the "
             "timed steps (GiB).", "",
             "| model | seconds per step | videos/s | peak allocated (GiB) | peak reserved (GiB) |",
             "|---|---|---|---|---|"]
    for row in results.get("rows", []):
        label = ("TESTA, R_T={}, R_S={}".format(*row["reductions"]) if row["aggregation"] != "none"
                 else "no aggregation")
        if "seconds" not in row:
            lines.append(f"| {label} | {row.get('skipped') or row.get('error')} | – | – | – |")
            continue
        memory = row.get("memory")
        lines.append(f"| {label} | {row['seconds']:.3f} | {row['videos_per_second']:.2f} | "
                     f"{gib(memory) if memory else 'not measured'} | "
                     f"{gib(memory, 'peak_reserved') if memory else '–'} |")
    unavailable = {row["memory_unavailable"] for row in results.get("rows", []) if row.get("memory_unavailable")}
    lines += [f"\nNot measured: {reason}." for reason in sorted(unavailable)]
    return lines


def render_cuda_vs_cpu(results: dict) -> list[str]:
    devices = " and ".join(results["devices"])
    lines = [f"The same fp32 encoder ({results['frames']} frames, R_T={results['reductions'][0]}, "
             f"R_S={results['reductions'][1]}, `frame_matching=\"original\"`, random weights) and the same input on "
             f"{devices}, without TF32.", "",
             "| input | same merges (source map) | source map agreement | same token sizes | output tokens | "
             "max abs output difference |", "|---|---|---|---|---|---|"]
    for name, row in results.get("inputs", {}).items():
        lines.append(f"| {name} | {'yes' if row['same_merges'] else 'no'} | {row['source_map_agreement']:.4f} | "
                     f"{'yes' if row['same_token_sizes'] else 'no'} | {row['output_tokens']} | "
                     f"{number(row.get('max_abs_output_difference'), 6)} |")
    ties = results.get("mode_ties")
    if ties:
        lines += ["", f"On {ties['rows']} integer rows full of ties: `torch.mode` agrees between the devices on "
                      f"{100 * ties['torch_mode_agreement']:.1f}% of the rows; the library's `aggregation.mode` on "
                      f"{100 * ties['library_mode_agreement']:.1f}%."]
    return lines


def render_compile(results: dict) -> list[str]:
    lines = [f"Backend `{results['backend']}`, `dynamic=False`; {results['frames']} frames, batch {results['batch']}, "
             "bf16, SDPA.", "", "| | median s per batch | compile s (first call) |", "|---|---|---|",
             f"| eager | {number(results.get('eager_seconds'), 4)} | – |",
             f"| torch.compile | {number(results.get('compiled_seconds'), 4)} | "
             f"{number(results.get('compile_seconds'), 1)} |",
             "", f"Speed-up: {number(results.get('speedup'))}x; max abs difference of the outputs: "
                 f"{number(results.get('max_abs_output_difference'), 4)}."]
    return lines


def render_grid(results: dict) -> list[str]:
    return ["Every encoder, frame count, batch, dtype and attention that fitted in the budget (the headline's rows "
            "included). TESTA: R_T, R_S as above (R_T=4, R_S=8 at the longest clips).", "",
            *speed_rows(results.get("entries", []))]


RENDERERS = {"headline": render_headline, "memory_96": render_memory, "train_step": render_train_step,
             "cuda_vs_cpu": render_cuda_vs_cpu, "compile": render_compile, "speed_grid": render_grid,
             "batch_scaling": render_batch_scaling, "same_mode": render_same_mode,
             "fused_merge": render_fused_merge}


def render_markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# GPU numbers", "",
             "Written by `benchmarks/gpu.py` (the sections and how each is measured are in its docstring).", "",
             f"- Device: {env.get('device')}"
             + (f", {env['gpu_memory_gib']:.0f} GiB" if env.get("gpu_memory_gib") else ""),
             f"- Versions: torch {env['torch']}, transformers {env['transformers']}, CUDA {env.get('cuda') or '–'}, "
             f"cuDNN {env.get('cudnn') or '–'}, driver {env.get('driver') or '–'}, Python {env['python']}",
             f"- Command: `{report['command']}`",
             f"- {'Dry run: tiny models, not the paper sizes. ' if report['dry_run'] else ''}Time budget "
             f"{report['time_budget_s']:.0f} s; took {report.get('elapsed_s', 0):.0f} s. Timings: warm-up "
             f"{report['warmup']}, then the median of {report['iterations']} synchronised passes. fp32 matmuls "
             f"{'with' if env['tf32_matmul'] else 'without'} TF32, convolutions "
             f"{'with' if env['tf32_cudnn'] else 'without'} (PyTorch's defaults).",
             *([f"- Resumed (`--resume`): {report['resumed']}."] if report.get("resumed") else []), ""]
    for section in SECTIONS:
        state = report["sections"].get(section.name)
        lines += [f"## {section.title}", ""]
        if state is None:
            lines += ["Not run.", ""]
            continue
        if state["status"] != "done":
            lines += [f"**{state['status']}**" + (f": {state['reason']}" if state.get("reason") else ""), ""]
        if state.get("kept_from_earlier_run"):
            lines += [f"(Measured by the earlier run `{report.get('earlier_command')}`.)", ""]
        if state.get("results"):
            try:
                lines += RENDERERS[section.name](state["results"]) + [""]
            except (KeyError, TypeError, IndexError) as error:  # a section killed half-way: show its raw results
                lines += [f"(partial results, see gpu.json: {type(error).__name__} {error})", ""]
    return "\n".join(lines)


def readme_rows(report: dict) -> str:
    """Rows for the README's headline table (model | frames | video tokens | encoder GMAC | time per video | R@1),
    with the GPU time per video, and a sentence on the 96-frame training memory; links point to docs/gpu.md."""
    sections = report["sections"]
    device = report["environment"].get("device")
    headline = sections.get("headline", {}).get("results", {})
    rows = []
    labels = {"timesformer": "transformers TimesformerModel (ViT-B/16)", "testa-none": "ViT-B/16, no aggregation",
              "testa": "ViT-B/16 + TESTA, R_T={}, R_S={}"}
    ratios = headline.get("ratios", {})
    for entry in headline.get("entries", []):
        if "seconds" not in entry or (entry["variant"] != "timesformer" and entry["attention"] != "sdpa"):
            continue
        label = labels[entry["variant"]].format(*headline["reductions"])
        speedup = ""
        if entry["variant"] == "testa":
            speedup = (f" ([{number(ratios.get('vs_no_aggregation'))}x][gpu], "
                       f"[{number(ratios.get('vs_timesformer'))}x][gpu] vs TimesformerModel)")
        rows.append(f"| {label}, GPU | {entry['frames']} | {entry['output_tokens']} | "
                    f"{gmac_text(entry['gmac_per_video'])} | "
                    f"[{entry['seconds'] / entry['batch']:.4f}][gpu] ({device}, {entry['dtype']}, batch "
                    f"{entry['batch']}, {entry['attention']}){speedup} | – |")
    memory = sections.get("memory_96", {}).get("results", {})
    by_key = {(row["precision"], row["aggregation"]): row for row in memory.get("rows", [])}
    none, merged = by_key.get(("bf16", "none"), {}), by_key.get(("bf16", "aggregation"), {})
    text = ""
    if none.get("train_step") and merged.get("train_step"):
        ratio = merged["train_step"]["peak_allocated"] / none["train_step"]["peak_allocated"]
        text = (f"\nOne bf16 training step at {memory['frames']} frames (batch {memory['batch']}) peaks at "
                f"[{gib(merged['train_step'])} GiB][gpu] with R_T={memory['reductions'][0]}, "
                f"R_S={memory['reductions'][1]} against [{gib(none['train_step'])} GiB][gpu] without aggregation "
                f"([{ratio:.2f}x][gpu]; the paper: 0.66x).")
    return "\n".join(rows) + "\n\n[gpu]: docs/gpu.md" + text


def write_report(report: dict, output_dir: Path) -> None:
    """gpu.json and gpu.md, each written whole and then renamed into place, so a run killed while writing leaves the
    previous complete files."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu.json", json.dumps(report, indent=1, default=str)), ("gpu.md", render_markdown(report))):
        partial = output_dir / f".{name}.partial"
        partial.write_text(text + "\n")
        os.replace(partial, output_dir / name)


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, type=Path, help="where gpu.md and gpu.json are written")
    parser.add_argument("--dry-run", action="store_true", help="tiny models, on the CPU unless --device says otherwise")
    parser.add_argument("--device", help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--time-budget", type=float, default=330.0, help="seconds for the whole run (default 330)")
    parser.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                        help="comma-separated sections to run (default: all, in priority order)")
    parser.add_argument("--warmup", type=int, help="warm-up passes (default 2; 1 in a dry run)")
    parser.add_argument("--iterations", type=int, help="timed passes (default 5; 2 in a dry run)")
    parser.add_argument("--compile-backend", help="torch.compile backend (default inductor; eager in a dry run)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the sections that the gpu.json already in --output-dir finished (same device, "
                             "versions and sizes), reuse its encoder timings, and run the rest")
    parser.add_argument("--redo", default="",
                        help="with --resume: comma-separated sections measured again although the earlier run "
                             "finished them (e.g. after a fix)")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: re-write gpu.md (and print the README rows) from the gpu.json already "
                             "in --output-dir, e.g. after a change of the tables' layout")
    args = parser.parse_args(argv)
    redo = [name for name in args.redo.split(",") if name]
    unknown = sorted(set(redo) - {s.name for s in SECTIONS})
    if unknown:
        parser.error(f"--redo: unknown {unknown}; allowed values are {', '.join(s.name for s in SECTIONS)}")
    args.redo = redo
    names = [name for name in args.sections.split(",") if name]
    unknown = sorted(set(names) - {s.name for s in SECTIONS})
    if unknown:
        parser.error(f"--sections: unknown {unknown}; allowed values are {', '.join(s.name for s in SECTIONS)}")
    args.sections = names
    for name in ("warmup", "iterations"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def earlier_run(output_dir: Path, report: dict) -> tuple[dict | None, str]:
    """The report an earlier run left in ``output_dir`` (gpu.json), if it ran on the same device with the same
    versions and sizes; otherwise None and the reason."""
    path = output_dir / "gpu.json"
    if not path.is_file():
        return None, f"no gpu.json in {output_dir.name}/, nothing kept"
    earlier = json.loads(path.read_text())
    for key in ("device", "torch", "transformers", "cuda"):
        if earlier["environment"].get(key) != report["environment"].get(key):
            return None, (f"the earlier run's {key} was {earlier['environment'].get(key)!r}, this one's is "
                          f"{report['environment'].get(key)!r}; nothing kept")
    current = json.loads(json.dumps(report["scale"]))  # as the json holds it
    if any(earlier["scale"].get(key) != current.get(key) for key in earlier["scale"]):  # sizes added later aside
        return None, "the earlier run used other sizes or iterations; nothing kept"
    return earlier, "the sections the earlier run finished are kept, and its encoder timings reused"


def resume(ctx: Context, earlier: dict) -> dict:
    """Takes the finished sections of ``earlier``, and every encoder timing it measured (finished or not) into the
    speed cache, so that the headline and the grid go on where it stopped; returns the finished sections."""
    for name in ("headline", "speed_grid"):
        for entry in earlier["sections"].get(name, {}).get("results", {}).get("entries", []):
            if "seconds" in entry:
                key = speed_key(entry["variant"], entry["frames"], entry["batch"], entry["dtype"], entry["attention"])
                ctx.speed[key] = entry
    return {name: {**state, "kept_from_earlier_run": True} for name, state in earlier["sections"].items()
            if state["status"] == "done"}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        report = json.loads((Path(args.output_dir) / "gpu.json").read_text(encoding="utf-8"))
        (Path(args.output_dir) / "gpu.md").write_text(render_markdown(report) + "\n", encoding="utf-8")
        print("README rows (for the headline table):\n\n" + readme_rows(report), flush=True)
        return report
    gc.freeze()  # what the imports made stays: collections between measurements then only scan what the run made
    budget = Budget(args.time_budget)
    device = args.device or ("cpu" if args.dry_run else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu: no CUDA device here; run it with --dry-run, or with --device cpu to measure "
                         "the paper's sizes on the CPU (slow).")
    scale = DRY_SCALE if args.dry_run else PAPER_SCALE
    overrides = {k: v for k, v in (("warmup", args.warmup), ("iterations", args.iterations),
                                   ("compile_backend", args.compile_backend)) if v is not None}
    scale = Scale(**{**asdict(scale), **overrides})
    report = dict(environment=environment(device), command=command_line(argv), dry_run=args.dry_run,
                  time_budget_s=args.time_budget, warmup=scale.warmup, iterations=scale.iterations,
                  scale=asdict(scale), sections={})
    ctx = Context(args=args, scale=scale, device=device, budget=budget, report=report)
    log(budget, f"{report['environment']['device']}; torch {torch.__version__}, "
                f"transformers {transformers.__version__}")
    kept = {}
    if args.resume:
        earlier, report["resumed"] = earlier_run(Path(args.output_dir), report)
        kept = resume(ctx, earlier) if earlier else {}
        if earlier:
            report["earlier_command"] = earlier["command"]
        log(budget, f"--resume: {report['resumed']}")
    for section in SECTIONS:
        state = report["sections"][section.name] = dict(status="running", reason=None, results={})
        if section.name in kept and section.name not in args.redo:
            state.update(kept[section.name])
        elif section.name not in args.sections:
            state.update(status="skipped", reason="not selected (--sections)")
        elif budget.left() < section.min_seconds:
            state.update(status="skipped", reason=f"needs at least {section.min_seconds:.0f} s, "
                                                  f"{max(budget.left(), 0):.0f} s of the time budget left")
        else:
            log(budget, f"section {section.name}: {section.title}")
            start = time.monotonic()
            try:
                section.run(ctx, state["results"])
                state["status"] = "done"
            except Exception as error:  # one failed section must not cost the others (one GPU run, no rerun)
                traceback.print_exc()
                state.update(status="failed", reason=f"{type(error).__name__}: {str(error)[:300]}")
            state["seconds"] = time.monotonic() - start
            ctx.free()
        log(budget, f"section {section.name}: {state['status']}" + (f" ({state['reason']})" if state["reason"] else ""))
        report["elapsed_s"] = budget.elapsed()
        ctx.save()
    print("\n" + render_markdown(report), flush=True)
    print("\nREADME rows (for the headline table):\n\n" + readme_rows(report), flush=True)
    return report


if __name__ == "__main__":
    main()
