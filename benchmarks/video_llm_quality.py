"""Quality where it can be measured here: a tiny Qwen2.5-VL trained on the CPU on the short-events task as video QA,
then, training-free, four ways to give it a video (issue 51):

    (a) 8 frames, stock;
    (b) 16 frames with TESTA in the tower, at most the tower compute of (a) (a schedule found from the compute
        alone, :func:`testa_schedule`, never from accuracy);
    (c) 16 frames, stock tower, then post-encoder pruning to the LLM token count of (b), as the serving engines do
        (vLLM's EVS, `compute_retention_mask`: every token of the first tubelet, then the tokens least like the token
        at the same place in the previous tubelet, by cosine of the tower outputs; kept tokens keep their stock
        M-RoPE positions), :func:`evs_retention_mask`;
    (d) 16 frames, stock.

The model (random init; a word-level tokenizer written here): a 6-block Qwen2.5-VL vision tower (hidden 64, MLP 256)
on a 2-layer LLM (hidden 64), trained on 8- and 16-frame inputs alternately (so it is not specialised to one frame
count), loss on the one-word answer. Task: :mod:`processing.short_events_vqa` ("what colour is the flash" -> one
of 3 colours; the flash lasts 1/20 to 1/10 of the video) at 56 x 56 px (4 x 4 patches, 2 x 2 merge units per
tubelet: small enough to train on a 2-core CPU).
Each training seed trains one model; the arms are evaluated on one fixed test set (other timelines than training).

Compute is counted, not timed: :func:`tower_macs` adds the multiply-accumulates of the tower's matrix products
(patch embedding, q/k/v and output projections, attention scores and values within each tubelet, the gated MLP
after TESTA's merge, TESTA's matching, the patch merger) from the token counts per block, which the run checks
against the token counts the tower's modules actually see (hooks on every block's ``qkv`` and ``mlp``).

    python -m benchmarks.video_llm_quality            # the experiment, 3 seeds one after the other
    python -m benchmarks.video_llm_quality --seeds 0 --threads 1 --output s0.json   # one seed (likewise 1, 2) ...
    python -m benchmarks.video_llm_quality --merge s0.json s1.json s2.json        # ... merged into the JSON
    python -m benchmarks.video_llm_quality --quick    # seconds: the pipeline end to end on a few videos

(Three one-thread seed processes side by side took about 7 min on a 2-core machine beside a niced test run.)
Writes ``docs/video_llm_quality.json`` (not with ``--quick`` unless ``--output`` is given) and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.modeling_outputs import BaseModelOutputWithPooling

from processing.short_events_vqa import FLASH_COLOURS, ceiling_accuracy, make_vqa_split, sampled_frames, vocabulary
from video_llms import apply_testa_to_video_llm, remove_testa_from_video_llm
from video_llms.budget import spread
from video_llms.common import video_settings

SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>", "<pad>", "<eos>"]
FRAME_SIZE = 56           # 4 x 4 patches of 14 px, 2 x 2 merge units per frame
VISION = {"depth": 6, "hidden_size": 64, "intermediate_size": 256, "num_heads": 4, "out_hidden_size": 64,
          "window_size": 56, "fullatt_block_indexes": [2, 5], "tokens_per_second": 2}
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
MROPE_SECTION = [4, 2, 2]  # head_dim 16: 8 rotary frequencies split over (time, row, column)


@dataclass
class Experiment:
    """The sizes of one run."""

    seeds: tuple[int, ...] = (0, 1, 2)
    train_videos: int = 1024
    val_videos: int = 64
    test_videos: int = 256
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    eval_batch_size: int = 32
    train_frames: tuple[int, ...] = (8, 16)
    data_seed: int = 1000


QUICK = Experiment(seeds=(0,), train_videos=8, val_videos=2, test_videos=4, steps=2, batch_size=2, eval_batch_size=8)


# ----------------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------------


def tokenizer() -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer over the task's words and Qwen's vision tokens."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + vocabulary() + ["<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[:4]})
    fast.video_token, fast.image_token = "<|video_pad|>", "<|image_pad|>"
    fast.padding_side = "left"
    return fast


def build_model(seed: int):
    """``(model, processor)``: a randomly initialised Qwen2.5-VL of the sizes above and its processor at
    ``FRAME_SIZE`` x ``FRAME_SIZE`` px per frame."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    fast = tokenizer()
    ids = {name: fast.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("video_token_id", "<|video_pad|>"), ("image_token_id", "<|image_pad|>"))}
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": len(fast), "bos_token_id": None, "eos_token_id": fast.eos_token_id,
                     "pad_token_id": fast.pad_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION}},
        vision_config=VISION, **ids)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.set_attn_implementation("sdpa")
    pixels = {"min_pixels": FRAME_SIZE * FRAME_SIZE, "max_pixels": FRAME_SIZE * FRAME_SIZE}
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels),
                                    video_processor=Qwen2VLVideoProcessor(**pixels, cap_pixels_per_frame=False),
                                    tokenizer=fast)
    return model, processor


def prompt(processor, question: str, answer: str | None = None) -> str:
    """The text of one example: the video, the question and (for training) the answer word."""
    text = f"<|vision_start|> {processor.video_token} <|vision_end|> {question}"
    return text if answer is None else f"{text} {answer}"


def encode(processor, videos, questions, num_frames: int, with_answers: bool = False) -> dict:
    """The processor's tensors for ``questions`` about ``videos`` at ``num_frames`` uniformly sampled frames."""
    frames = [sampled_frames(videos[q.video_index], num_frames) for q in questions]
    texts = [prompt(processor, q.text, q.answer if with_answers else None) for q in questions]
    return processor(text=texts, videos=frames, return_tensors="pt")


# ----------------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------------


def train(model, processor, videos, questions, experiment: Experiment, seed: int, log=print,
          validation=None) -> tuple[list[float], list[dict]]:
    """AdamW with warmup and cosine decay, cross-entropy on the answer token (the last one: every prompt has the
    same length); batches alternate over ``experiment.train_frames``. ``validation``: ``(videos, questions)`` from
    the training distribution (never the test set), whose stock 8- and 16-frame accuracy is logged every 100 steps,
    to see whether the model learns. Returns the loss per step and the validation accuracies."""
    rng = random.Random(f"video-llm-quality-train-{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=experiment.lr, weight_decay=0.01)
    warmup = max(1, experiment.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, experiment.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses, order, start, validated = [], [], time.perf_counter(), []
    for step in range(experiment.steps):
        if len(order) < experiment.batch_size:
            order += rng.sample(range(len(questions)), len(questions))
        batch, order = [questions[i] for i in order[:experiment.batch_size]], order[experiment.batch_size:]
        num_frames = experiment.train_frames[step % len(experiment.train_frames)]
        inputs = encode(processor, videos, batch, num_frames, with_answers=True)
        labels = torch.full_like(inputs["input_ids"], -100)
        labels[:, -1] = inputs["input_ids"][:, -1]
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 20 == 0 or step + 1 == experiment.steps:
            log(f"  seed {seed} step {step + 1}/{experiment.steps} loss {statistics.fmean(losses[-40:]):.3f} "
                f"({time.perf_counter() - start:.0f} s)")
        if validation is not None and ((step + 1) % 100 == 0 or step + 1 == experiment.steps):
            model.eval()
            accuracy = {str(frames): evaluate(model, processor, *validation, Arm("validation", frames),
                                              experiment.eval_batch_size)["accuracy"] for frames in (8, 16)}
            validated.append({"step": step + 1, **accuracy})
            log(f"  seed {seed} step {step + 1} validation accuracy (stock) 8 frames {accuracy['8']:.3f}, "
                f"16 frames {accuracy['16']:.3f}")
            model.train()
    model.eval()
    return losses, validated


# ----------------------------------------------------------------------------------------------------------------------
# Compute and the TESTA schedule
# ----------------------------------------------------------------------------------------------------------------------

UNIT = 4  # patches per merge unit (2 x 2)


def block_grids(settings, slices: int, units: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``((slices, units) entering, (slices, units) after the merge)`` of every block; ``settings`` None: stock."""
    if settings is None:
        return [((slices, units), (slices, units))] * VISION["depth"]
    after = settings.token_schedule(slices, units, has_cls=False)
    return list(zip([(slices, units), *after[:-1]], after))


def tower_macs(settings, slices: int, units: int) -> int:
    """Multiply-accumulates of the tower on one video of ``slices`` tubelets of ``units`` merge units (each a 2 x 2
    group of patches): the patch embedding (3 channels x 2 frames x 14 x 14 per patch), per block the q/k/v and
    output projections and the attention within each tubelet (a window is the whole 56 px frame) on the tokens
    entering it, TESTA's matching (keys against keys, one per unit or per tubelet), the gated MLP on the tokens
    after the merge; the merger on the units that leave."""
    d, inner = VISION["hidden_size"], VISION["intermediate_size"]
    window_units = (VISION["window_size"] // 28) ** 2
    assert window_units >= units, "the count assumes one attention window per frame"
    macs = slices * units * UNIT * 3 * 2 * 14 * 14 * d
    for (s_in, u_in), (s_out, u_out) in block_grids(settings, slices, units):
        tokens_in, tokens_out = s_in * u_in * UNIT, s_out * u_out * UNIT
        macs += 4 * d * d * tokens_in + 2 * s_in * (u_in * UNIT) ** 2 * d
        if s_out < s_in:
            macs += math.ceil(s_in / 2) * (s_in // 2) * d
        if u_out < u_in:
            macs += s_out * math.ceil(u_in / 2) * (u_in // 2) * d
        macs += 3 * d * inner * tokens_out
    s_last, u_last = block_grids(settings, slices, units)[-1][1]
    merger = UNIT * d
    return macs + s_last * u_last * (merger * merger + merger * VISION["out_hidden_size"])


def testa_schedule(slices: int, units: int, budget_macs: int) -> dict:
    """The TESTA schedule for ``slices x units`` that gives the LLM the most tokens within ``budget_macs`` of tower
    compute (ties: fewer MACs, then more tubelets). Candidates: every final grid ``(slices', units')``, reached by
    spreading the merges evenly (`budget.spread`, within TESTA's caps) over the first ``m`` blocks, for every
    ``m`` (merging early costs less, merging over more blocks is gentler). Uses compute only, never accuracy."""
    depth, best = VISION["depth"], None
    for kept_slices in range(2, slices + 1):
        for kept_units in range(1, units + 1):
            for blocks in range(1, depth + 1):
                try:
                    temporal = spread(slices - kept_slices, blocks, 0, slices, lambda c: (c - 1) // 2, "slices")
                    spatial = spread(units - kept_units, blocks, 0, units, lambda c: c // 2, "units")
                except ValueError:
                    continue
                pad = [0] * (depth - blocks)
                settings = video_settings(depth, temporal + pad, spatial + pad)
                macs = tower_macs(settings, slices, units)
                if macs > budget_macs:
                    continue
                key = (kept_slices * kept_units, -macs, kept_slices)
                if best is None or key > best[0]:
                    best = (key, {"temporal_reduction": temporal + pad, "spatial_reduction": spatial + pad,
                                  "macs": macs, "grid": [kept_slices, kept_units]})
    if best is None:
        raise ValueError(f"no TESTA schedule fits {slices} x {units} units in {budget_macs} MACs")
    return best[1]


class TokenCounter:
    """Counts the tokens every tower block's ``qkv`` (before the merge) and ``mlp`` (after it) sees, per call."""

    def __init__(self, visual):
        self.seen: list[tuple[str, int, int]] = []
        self.handles = []
        for index, block in enumerate(visual.blocks):
            for name, module in (("qkv", block.attn.qkv), ("mlp", block.mlp)):
                self.handles.append(module.register_forward_pre_hook(
                    lambda _m, args, name=name, index=index: self.seen.append((name, index, args[0].shape[0]))))

    def close(self):
        for handle in self.handles:
            handle.remove()


# ----------------------------------------------------------------------------------------------------------------------
# Post-encoder pruning (the engines' way)
# ----------------------------------------------------------------------------------------------------------------------


def evs_retention_mask(features: torch.Tensor, slices: int, units: int, keep: int) -> torch.Tensor:
    """vLLM's EVS (`vllm/multimodal/evs.py`, `compute_retention_mask`) on one video's tower outputs
    ``(slices * units, C)`` (tubelet-major, as the stock tower emits them): the dissimilarity ``1 - cosine`` of
    every token to the token at the same place in the previous tubelet, the first tubelet's tokens first
    (dissimilarity 255), and the ``keep`` most dissimilar tokens kept (stable order on ties; never fewer than one
    tubelet's tokens, as EVS). Returns a ``(slices * units,)`` bool mask."""
    grid = features.reshape(slices, units, -1)
    dissimilarity = 1 - torch.nn.functional.cosine_similarity(grid[1:], grid[:-1], dim=-1)
    dissimilarity = torch.cat([torch.full_like(grid[:1, :, 0], 255.0), dissimilarity]).reshape(-1)
    order = torch.argsort(dissimilarity, descending=True, stable=True)
    mask = torch.zeros_like(dissimilarity, dtype=torch.bool)
    mask[order[:max(keep, units)]] = True
    return mask


def pruned_forward(model, inputs: dict, keep: int) -> tuple[torch.Tensor, list[int]]:
    """Next-token logits ``(batch, vocab)`` of the stock model with every video's tower outputs pruned by EVS to
    ``keep`` tokens; the kept tokens keep their stock M-RoPE positions (the text after the video too). Also
    returns the LLM's video tokens per example."""
    base = model.model
    video_token = model.config.video_token_id
    grids = inputs["video_grid_thw"]
    features = base.get_video_features(inputs["pixel_values_videos"], grids).pooler_output
    positions, _ = base.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], video_grid_thw=grids,
                                       second_per_grid_ts=inputs.get("second_per_grid_ts"),
                                       attention_mask=inputs.get("attention_mask"))
    kept_features, rows, counts = [], [], []
    for index, (video, (t, h, w)) in enumerate(zip(features, grids.tolist())):
        mask = evs_retention_mask(video, t, h * w // UNIT, keep)
        kept_features.append(video[mask])
        counts.append(int(mask.sum()))
        keep_row = torch.ones_like(inputs["input_ids"][index], dtype=torch.bool)
        keep_row[inputs["input_ids"][index] == video_token] = mask
        rows.append(keep_row)
    if len(set(counts)) != 1:
        raise ValueError(f"EVS kept different counts per video ({counts}); batch videos of one grid")
    rows = torch.stack(rows)
    batch = rows.shape[0]
    select = lambda t: t[rows].reshape(batch, -1)  # noqa: E731 - one mask for every per-token tensor
    outputs = model(
        input_ids=select(inputs["input_ids"]), attention_mask=select(inputs["attention_mask"]),
        mm_token_type_ids=select(inputs["mm_token_type_ids"]),
        position_ids=positions[:, rows].reshape(3, batch, -1),
        mm_encoder_outputs={"video": BaseModelOutputWithPooling(pooler_output=tuple(kept_features))},
    )
    return outputs.logits[:, -1], counts


# ----------------------------------------------------------------------------------------------------------------------
# The arms
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    name: str
    frames: int
    testa: dict | None = None       # apply_testa's schedule
    prune_to: int | None = None     # EVS to this many LLM tokens per video
    llm_tokens: int = 0
    tower_macs: int = 0
    extra: dict = field(default_factory=dict)


def make_arms() -> list[Arm]:
    """The four arms, their LLM token counts and tower MACs (from the compute alone)."""
    units = (FRAME_SIZE // 28) ** 2
    stock8, stock16 = tower_macs(None, 4, units), tower_macs(None, 8, units)
    plan = testa_schedule(8, units, stock8)
    testa_tokens = plan["grid"][0] * plan["grid"][1]
    schedule = {"temporal_reduction": plan["temporal_reduction"], "spatial_reduction": plan["spatial_reduction"]}
    return [
        Arm("(a) 8 frames, stock", 8, llm_tokens=4 * units, tower_macs=stock8),
        Arm("(b) 16 frames, TESTA at the tower compute of (a)", 16, testa=schedule, llm_tokens=testa_tokens,
            tower_macs=plan["macs"], extra={"grid": plan["grid"]}),
        Arm("(c) 16 frames, post-encoder pruning (EVS) to the tokens of (b)", 16, prune_to=testa_tokens,
            llm_tokens=testa_tokens, tower_macs=stock16),
        Arm("(d) 16 frames, stock", 16, llm_tokens=8 * units, tower_macs=stock16),
    ]


def evaluate(model, processor, videos, questions, arm: Arm, batch_size: int) -> dict:
    """Accuracy of greedy next-token answers (argmax over the whole vocabulary) of ``arm`` on ``questions``, and
    what it ran: the LLM video tokens per example, and whether the tokens every tower block saw (hooks) were the
    schedule's (:func:`expected_tower_tokens`) in every batch."""
    answer_ids = {colour: processor.tokenizer.convert_tokens_to_ids(colour) for colour in FLASH_COLOURS}
    video_token = model.config.video_token_id
    if arm.testa is not None:
        apply_testa_to_video_llm(model, processor, **arm.testa)
    counter = TokenCounter(model.model.visual)
    correct, llm_tokens, tower_matches = 0, set(), True
    try:
        with torch.no_grad():
            for start in range(0, len(questions), batch_size):
                batch = questions[start:start + batch_size]
                inputs = encode(processor, videos, batch, arm.frames)
                counter.seen.clear()
                if arm.prune_to is not None:
                    logits, counts = pruned_forward(model, inputs, arm.prune_to)
                else:
                    logits = model(**inputs).logits[:, -1]
                    counts = (inputs["input_ids"] == video_token).sum(1).tolist()
                llm_tokens.update(counts)
                tower_matches &= counter.seen == expected_tower_tokens(arm, len(batch))
                predicted = logits.argmax(-1).tolist()
                correct += sum(p == answer_ids[q.answer] for p, q in zip(predicted, batch))
    finally:
        counter.close()
        if arm.testa is not None:
            remove_testa_from_video_llm(model)
    return {"accuracy": correct / len(questions), "llm_tokens": sorted(llm_tokens),
            "tower_tokens_match_schedule": tower_matches}


def expected_tower_tokens(arm: Arm, videos_per_batch: int) -> list[tuple[str, int, int]]:
    """The ``(module, block, tokens)`` the hooks must see for one batch of ``arm``, from the schedule (in patches)."""
    units = (FRAME_SIZE // 28) ** 2
    settings = video_settings(VISION["depth"], **arm.testa) if arm.testa is not None else None
    seen = []
    for index, ((s_in, u_in), (s_out, u_out)) in enumerate(block_grids(settings, arm.frames // 2, units)):
        seen += [("qkv", index, videos_per_batch * s_in * u_in * UNIT),
                 ("mlp", index, videos_per_batch * s_out * u_out * UNIT)]
    return seen


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def run(experiment: Experiment, log=print, on_seed=None) -> dict:
    """Trains one model per seed and evaluates every arm on it; ``on_seed(summary)`` after every seed (so that a
    long run leaves the seeds it finished). Returns the summary of all seeds."""
    train_videos, train_questions = make_vqa_split(experiment.train_videos, seed=experiment.data_seed, size=FRAME_SIZE)
    test_videos, test_questions = make_vqa_split(experiment.test_videos, seed=experiment.data_seed + 1,
                                                 size=FRAME_SIZE)
    validation = make_vqa_split(experiment.val_videos, seed=experiment.data_seed + 2, size=FRAME_SIZE)
    arms = make_arms()
    outcomes = {arm.name: [] for arm in arms}
    losses, validations = {}, {}
    summary = None
    for seed in experiment.seeds:
        start = time.perf_counter()
        model, processor = build_model(seed)
        losses[seed], validations[str(seed)] = train(model, processor, train_videos, train_questions, experiment, seed,
                                                     log, validation)
        for arm in arms:
            outcome = evaluate(model, processor, test_videos, test_questions, arm, experiment.eval_batch_size)
            outcomes[arm.name].append(outcome)
            log(f"  seed {seed} {arm.name}: {outcome['accuracy']:.3f} (LLM tokens {outcome['llm_tokens']})")
        log(f"seed {seed} done in {time.perf_counter() - start:.0f} s")
        summary = summarize(experiment, arms, outcomes, losses)
        summary["ceiling_accuracy"] = {str(n): ceiling_accuracy(test_videos, test_questions, n) for n in (8, 16)}
        summary["test_questions"] = len(test_questions)
        summary["validation_accuracy"] = validations
        if on_seed is not None:
            on_seed(summary)
    return summary


def summarize(experiment: Experiment, arms: list[Arm], outcomes: dict, losses: dict) -> dict:
    """The table (accuracy mean, min, max, standard deviation over the seeds done) and the targets; ``outcomes``:
    per arm name, one `evaluate` result per seed of ``losses`` (in that order)."""
    table = []
    for arm in arms:
        accuracies = [outcome["accuracy"] for outcome in outcomes[arm.name]]
        table.append({
            "arm": arm.name, "frames": arm.frames, "llm_video_tokens": arm.llm_tokens,
            "tower_macs": arm.tower_macs, "testa": arm.testa, "prune_to": arm.prune_to,
            "accuracy_per_seed": accuracies, "accuracy_mean": statistics.fmean(accuracies),
            "accuracy_min": min(accuracies), "accuracy_max": max(accuracies),
            "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            "measured_llm_tokens": sorted({t for outcome in outcomes[arm.name] for t in outcome["llm_tokens"]}),
            "measured_tower_tokens_match_schedule": all(o["tower_tokens_match_schedule"] for o in outcomes[arm.name]),
        })
    by_name = {row["arm"][:3]: row for row in table}
    b, a, c = by_name["(b)"], by_name["(a)"], by_name["(c)"]
    targets = {
        "b_beats_a_beyond_spread": b["accuracy_min"] > a["accuracy_max"],
        # "at least as accurate": (b)'s worst seed is no worse than (c)'s best one, so (b) >= (c) for every pair of
        # seeds; "beats": strictly better
        "b_at_least_c_on_every_seed": b["accuracy_min"] >= c["accuracy_max"],
        "b_beats_c_beyond_spread": b["accuracy_min"] > c["accuracy_max"],
        "b_mean_minus_a_mean": b["accuracy_mean"] - a["accuracy_mean"],
        "b_mean_minus_c_mean": b["accuracy_mean"] - c["accuracy_mean"],
    }
    return {
        "experiment": experiment.__dict__, "seeds_done": list(losses), "vision_config": VISION, "text_config": TEXT,
        "frame_size": FRAME_SIZE, "arms": table, "targets": targets,
        "final_train_loss": {str(s): statistics.fmean(l[-40:]) for s, l in losses.items()},
        "outcomes": outcomes, "losses": {str(s): l for s, l in losses.items()},
    }


def merge(parts: list[dict]) -> dict:
    """One summary from the summaries of runs of the same experiment on different seeds (``--seeds`` in separate
    processes; ``--merge``)."""
    first = parts[0]
    def same_run(part: dict) -> tuple:
        return ({k: v for k, v in part["experiment"].items() if k != "seeds"}, part["vision_config"],
                part["text_config"], part["frame_size"], part["ceiling_accuracy"], part["commit"])

    if any(same_run(part) != same_run(first) for part in parts[1:]):
        raise ValueError("cannot merge runs of different experiments, models, test sets or commits")
    experiment = Experiment(**{**first["experiment"], "seeds": tuple(s for p in parts for s in p["seeds_done"])})
    arms = make_arms()
    outcomes = {arm.name: [o for p in parts for o in p["outcomes"][arm.name]] for arm in arms}
    losses = {int(s): l for p in parts for s, l in p["losses"].items()}
    summary = summarize(experiment, arms, outcomes, losses)
    keep = ("ceiling_accuracy", "test_questions", "command", "cpu", "commit", "threads")
    summary.update({name: first[name] for name in keep})
    summary["validation_accuracy"] = {seed: log for p in parts for seed, log in p["validation_accuracy"].items()}
    summary["date"] = max(p["date"] for p in parts)
    summary["seconds_per_seed_run"] = [p["seconds"] for p in parts]
    summary["command"] = " ; ".join(p["command"] for p in parts) + " ; python -m benchmarks.video_llm_quality --merge ..."
    return summary


def markdown(result: dict) -> str:
    lines = ["| arm | LLM video tokens | tower MMACs | accuracy mean | min - max over seeds | per seed |",
             "|---|---|---|---|---|---|"]
    for row in result["arms"]:
        lines.append(f"| {row['arm']} | {row['llm_video_tokens']} | {row['tower_macs'] / 1e6:.1f} | "
                     f"{row['accuracy_mean']:.3f} | {row['accuracy_min']:.3f} - {row['accuracy_max']:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in row['accuracy_per_seed'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.video_llm_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few videos and steps: the pipeline end to end")
    parser.add_argument("--output", default=None, help="JSON path (default docs/video_llm_quality.json; none with "
                                                       "--quick)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="merge the JSON of runs on different seeds into --output and print the table")
    args = parser.parse_args(argv)
    if args.merge:
        parts = []
        for path in args.merge:
            with open(path, encoding="utf-8") as f:
                parts.append(json.load(f))
        result = merge(parts)
        with open(args.output or "docs/video_llm_quality.json", "w", encoding="utf-8", newline="\n") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(markdown(result))
        print(json.dumps(result["targets"]))
        return result
    experiment = QUICK if args.quick else Experiment()
    if args.seeds:
        experiment = replace(experiment, seeds=tuple(args.seeds))
    torch.set_num_threads(args.threads)
    output = args.output or (None if args.quick else "docs/video_llm_quality.json")
    start = time.perf_counter()
    command = " ".join(["python -m benchmarks.video_llm_quality", *(argv if argv is not None else sys.argv[1:])])
    context = {"command": command,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "cpu": _cpu(), "commit": _commit(), "threads": torch.get_num_threads()}

    def write(summary: dict) -> None:
        summary.update(context, seconds=time.perf_counter() - start)
        if output:
            with open(output, "w", encoding="utf-8", newline="\n") as f:
                json.dump(summary, f, indent=1)
                f.write("\n")

    result = run(experiment, log=lambda text: print(text, flush=True), on_seed=write)
    print(markdown(result))
    print(json.dumps(result["targets"]), f"{result['seconds']:.0f} s")
    return result


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} x {len(names)}" if names else platform.processor()
    except OSError:
        return platform.processor()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
