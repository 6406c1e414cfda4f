"""Training-free TESTA on transformers' own video encoders: accuracy at matched GMAC (issue 12).

No pretrained video weights can be downloaded here, so this script trains small `TimesformerForVideoClassification`,
`VideoMAEForVideoClassification` and `VivitForVideoClassification` models from scratch on synthetic long videos
(`processing.synthetic`: 30-120 s videos of 3-6 events, 16 frames sampled at segment midpoints, rendered in memory
at 32 px, no mp4 round trip) to name the colour of the shape in the video's last sampled frame (7 classes: the model
must find the final event on the timeline). Train and evaluation videos come from disjoint families.

Every trained model is then evaluated *unchanged* with `apply_testa`:

* R = 0 (the patched model computes what the unpatched one does);
* TESTA (`aggregation_dims="temporal+spatial"`: R_T frames per block, as a per-block schedule such as `1100`, and
  R_S >= 1 patches per frame per block) at about 75%, 60% and 45% of the R = 0 GMAC;
* the baseline at the same GMAC targets: ToMe-style joint merging over all space-time tokens
  (`aggregation_dims="joint"`) for the joint-attention models (VideoMAE, ViViT); TimeSformer has divided attention,
  so its baseline is per-frame ToMe (`aggregation_dims="spatial"`).

For each target the (R_T, R_S) pair or the joint r with the closest GMAC is used, and its GMAC is printed. GMAC is
counted with `torch.utils.flop_counter` on the patched model (SDPA in its math form, LayerNorm 5 per element as in
`modeling_testa.flops`, matching products included). Accuracy is the mean over training seeds, with min and max.

    python -m benchmarks.training_free [--seeds 0 1] [--steps 250] [--threads 2] [--output docs/training_free.json]
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]

from transformers import (
    TimesformerConfig,
    TimesformerForVideoClassification,
    VideoMAEConfig,
    VideoMAEForVideoClassification,
    VivitConfig,
    VivitForVideoClassification,
)

from modeling_testa import apply_testa, remove_testa
from processing.synthetic import COLOURS, event_state, make_specs, render_frames

FRAMES, SIZE, PATCH, TUBELET = 16, 32, 8, 2
CLASSES = list(COLOURS)
TARGETS = (0.75, 0.60, 0.45)


# ----------------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------------


def sample_video(spec) -> tuple[np.ndarray, int]:
    """16 frames at segment midpoints over the whole video, and the colour index shown in the last one."""
    indices = [math.floor((i + 0.5) * spec.num_frames / FRAMES) for i in range(FRAMES)]
    wanted, frames = set(indices), {}
    for t, frame in enumerate(render_frames(spec)):
        if t in wanted:
            frames[t] = frame
        if t >= indices[-1]:
            break
    last = indices[-1]
    event = next(e for e in spec.events if e.start <= last < e.end)
    colour = event_state(event, last, spec.size)[3]
    return np.stack([frames[t] for t in indices]), CLASSES.index(colour)


def build_data(num_videos: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    specs = make_specs(num_videos=num_videos, seed=seed, fps=2, size=SIZE, min_duration=30.0, max_duration=120.0)
    data = {"train": ([], []), "eval": ([], [])}
    for spec in specs:
        video, label = sample_video(spec)
        split = "train" if spec.split == "train" else "eval"
        data[split][0].append(video)
        data[split][1].append(label)
    out = {}
    for split, (videos, labels) in data.items():
        pixels = torch.from_numpy(np.stack(videos)).permute(0, 1, 4, 2, 3).float() / 255.0  # (N, T, 3, H, W)
        out[split] = ((pixels - 0.5) / 0.5, torch.tensor(labels))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, num_labels=len(CLASSES))


def build_model(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "TimeSformer":
        config = TimesformerConfig(**TINY, image_size=SIZE, patch_size=PATCH, num_frames=FRAMES)
        return TimesformerForVideoClassification(config)
    if family == "VideoMAE":
        config = VideoMAEConfig(**TINY, image_size=SIZE, patch_size=PATCH, num_frames=FRAMES, tubelet_size=TUBELET)
        return VideoMAEForVideoClassification(config)
    config = VivitConfig(**TINY, image_size=SIZE, tubelet_size=[TUBELET, PATCH, PATCH], num_frames=FRAMES)
    return VivitForVideoClassification(config)


def train(model, pixels, labels, steps: int, batch_size: int, lr: float, seed: int) -> float:
    """AdamW with linear warm-up and cosine decay. The model runs patched at R = 0 (SDPA attention; the same function
    as the unpatched model, faster for TimeSformer). Returns the seconds spent."""
    apply_testa(model)
    model.train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    order = torch.randperm(len(labels), generator=generator)
    position = 0
    for _ in range(steps):
        if position + batch_size > len(order):
            order, position = torch.randperm(len(labels), generator=generator), 0
        batch = order[position : position + batch_size]
        position += batch_size
        loss = model(pixels[batch], labels=labels[batch]).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
    remove_testa(model)
    return time.perf_counter() - start


@torch.no_grad()
def accuracy(model, pixels, labels, batch_size: int = 64) -> tuple[float, float]:
    """Accuracy over the evaluation videos, and the seconds the pass took."""
    model.eval()
    correct, start = 0, time.perf_counter()
    for i in range(0, len(labels), batch_size):
        correct += (model(pixels[i : i + batch_size]).logits.argmax(-1) == labels[i : i + batch_size]).sum().item()
    return correct / len(labels), time.perf_counter() - start


def layer_norm_flops(input_shape, *args, out_shape=None, **kwargs) -> int:
    return 10 * math.prod(input_shape)  # 5 operations per element (fvcore), 2 FLOPs per MAC


@torch.no_grad()
def gmac(model, video) -> tuple[float, int]:
    """GMAC of one video through the (patched) model, and its encoder's output tokens."""
    model.eval()
    mapping = {torch.ops.aten.native_layer_norm: layer_norm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, sdpa_kernel(SDPBackend.MATH):
        output = model(video)
    return counter.get_total_flops() / 2e9, output.token_sizes.shape[1]


# ----------------------------------------------------------------------------------------------------------------------
# Matched settings
# ----------------------------------------------------------------------------------------------------------------------


def candidates(family: str) -> dict[str, list[dict]]:
    # R_T per block (4 blocks): frames merged early or in every block; R_S the same in every block
    temporal = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [2, 1, 1, 1], [2, 2, 1, 1], [2, 2, 2, 2]]
    testa = [dict(temporal_reduction=r_t, spatial_reduction=r_s) for r_t in temporal for r_s in range(1, 9)]
    if family == "TimeSformer":
        baseline = [dict(spatial_reduction=r, aggregation_dims="spatial") for r in range(1, 9)]
    else:
        baseline = [dict(spatial_reduction=r, aggregation_dims="joint") for r in range(1, 65)]
    return {"TESTA": testa, "baseline": baseline}


def label(settings: dict) -> str:
    dims = settings.get("aggregation_dims", "temporal+spatial")
    if dims == "joint":
        return f"ToMe joint r={settings['spatial_reduction']}"
    if dims == "spatial":
        return f"ToMe per frame R_S={settings['spatial_reduction']}"
    r_t = settings["temporal_reduction"]
    r_t = r_t[0] if len(set(r_t)) == 1 else "".join(map(str, r_t))
    return f"TESTA R_T={r_t} R_S={settings['spatial_reduction']}"


def matched_settings(model, video) -> list[tuple[str, float, dict, float, int]]:
    """``(kind, target, settings, gmac, tokens)`` rows: R = 0, then for every target the closest TESTA and baseline."""
    apply_testa(model)
    base_gmac, base_tokens = gmac(model, video)
    rows = [("R=0", 1.0, {}, base_gmac, base_tokens)]
    family = {"TimesformerForVideoClassification": "TimeSformer"}.get(type(model).__name__, "other")
    measured = {}
    for kind, options in candidates(family).items():
        for settings in options:
            apply_testa(model, **settings)
            measured.setdefault(kind, []).append((settings, *gmac(model, video)))
    remove_testa(model)
    for target in TARGETS:
        for kind in ("TESTA", "baseline"):
            settings, value, tokens = min(measured[kind], key=lambda row: abs(row[1] / base_gmac - target))
            rows.append((kind, target, settings, value, tokens))
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["TimeSformer", "VideoMAE", "ViViT"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--videos", type=int, default=1000, help="synthetic videos (about 60%% train, 40%% eval)")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    data = build_data(args.videos, args.data_seed)
    (train_x, train_y), (eval_x, eval_y) = data["train"], data["eval"]
    majority = torch.bincount(eval_y, minlength=len(CLASSES)).max().item() / len(eval_y)
    print(f"data: {len(train_y)} train / {len(eval_y)} eval videos, {FRAMES} frames of {SIZE} px, {len(CLASSES)} "
          f"classes (majority class {majority:.3f}); {time.perf_counter() - start:.0f} s", flush=True)

    results = {"args": {k: str(v) for k, v in vars(args).items()}, "majority": majority, "families": {}}
    for family in args.families:
        rows, accuracies, times, unpatched_time = None, {}, {}, None
        for seed in args.seeds:
            model = build_model(family, seed)
            seconds = train(model, train_x, train_y, args.steps, args.batch_size, args.lr, seed)
            if rows is None:  # GMAC depends on the settings and the input size only
                rows = matched_settings(model, eval_x[:1])
                unpatched_accuracy, unpatched_time = accuracy(model, eval_x, eval_y)  # transformers' own forward
            for index, (kind, target, settings, value, tokens) in enumerate(rows):
                apply_testa(model, **settings)
                acc, eval_seconds = accuracy(model, eval_x, eval_y)
                accuracies.setdefault(index, []).append(acc)
                times.setdefault(index, []).append(eval_seconds)
            remove_testa(model)
            print(f"{family} seed {seed}: trained {args.steps} steps in {seconds:.0f} s, accuracy at R=0 "
                  f"{accuracies[0][-1]:.3f}; {time.perf_counter() - start:.0f} s so far", flush=True)
        table = []
        print(f"\n{family}: accuracy over seeds {args.seeds} (mean [min, max]); unpatched model (transformers' "
              f"forward) on seed {args.seeds[0]}: accuracy {unpatched_accuracy:.3f}, eval pass {unpatched_time:.1f} s")
        print("| target | setting | GMAC | % of R=0 | tokens | accuracy | eval time vs unpatched (seed "
              f"{args.seeds[0]}) |")
        print("|---|---|---|---|---|---|---|")
        for index, (kind, target, settings, value, tokens) in enumerate(rows):
            accs = accuracies[index]
            name = "R=0" if kind == "R=0" else label(settings)
            print(f"| {target:.0%} | {name} | {value:.3f} | {value / rows[0][3]:.1%} | {tokens} | "
                  f"{statistics.mean(accs):.3f} [{min(accs):.3f}, {max(accs):.3f}] | "
                  f"{times[index][0] / unpatched_time:.2f}x |")
            table.append({"target": target, "kind": kind, "setting": name, "settings": settings, "gmac": value,
                          "gmac_ratio": value / rows[0][3], "tokens": tokens, "accuracy": accs,
                          "eval_seconds": times[index], "unpatched_eval_seconds": unpatched_time})
        print(flush=True)
        results["families"][family] = table
    results["seconds"] = time.perf_counter() - start
    print(f"total {results['seconds']:.0f} s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
