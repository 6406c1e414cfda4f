"""The paper's ablations (Table 5 and section 4.7) on the synthetic long-video benchmark, with a model trained by our
scripts (the demo's, by default), all training-free: the same weights evaluated with different aggregation settings.

    python -m benchmarks.ablations --model outputs/synthetic/train/final --data outputs/synthetic/data [--output docs/ablations]

1. token aggregation vs token pruning (same R_T, R_S, so matched GMAC);
2. geometry-based vs importance-based aggregation;
3. temporal-only vs spatial-only vs both, at roughly equal GMAC (`suggest_reduction` picks the single-dimension R);
4. TESTA's divided aggregation vs ToMe-style joint merging (`aggregation_dims="joint"`) at matched GMAC — recall, and
   how encoder time and memory scale with the frame count (8, 16, 32, 64 frames) for a fixed small encoder.

The paper trained a model per setting for (2)-(4); here every setting reuses one model trained with the default
(geometry, temporal+spatial) aggregation, so the differences also measure how far each setting is from the one the
model was trained with. Joint merging runs the blocks with joint space-time attention, which the model never saw:
its recall is reported for completeness, and its scaling numbers are the point of part 4.

Writes OUTPUT.md (tables) and OUTPUT.json.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from modeling_testa import TestaForVideoTextRetrieval, TestaVisionConfig, TestaVisionModel
from modeling_testa.flops import count_encoder_gmac, suggest_reduction
from modeling_testa.processing_testa import TestaProcessor


def retrieval(model, processor, data: Path, num_frames: int, text_length: int, k_test: int) -> dict:
    from accelerate import Accelerator

    from train.evaluation import evaluate_retrieval

    recipe = {"data": {"dataset": str(data), "eval_split": "test", "num_frames": num_frames,
                       "max_text_length": text_length, "num_workers": 0},
              "eval": {"k_test": k_test, "batch_size": 16}}
    return evaluate_retrieval(model, processor, recipe, Accelerator(cpu=True))


def row(name: str, model, processor, args, settings: dict) -> dict:
    vision = model.vision_model
    original = {key: getattr(vision.config, key) for key in settings}
    vision.set_aggregation(**settings)
    try:
        gmac = count_encoder_gmac(vision.config)[0]
        metrics = retrieval(model, processor, args.data, vision.config.num_frames, args.text_length, args.k_test)
    finally:
        vision.set_aggregation(**original)
    result = {"setting": name, "gmac": gmac, **{k: metrics[k] for k in ("t2v_R@1", "t2v_R@5", "t2v_R@10",
                                                                         "mean_recall", "video_tokens")}}
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def encoder_scaling(frames_list: list[int], repeats: int) -> list[dict]:
    """Time and peak memory of one forward pass of a small encoder, divided (TESTA) vs joint (ToMe), with and
    without merging, at matched GMAC (the joint R is chosen by `suggest_reduction` to meet TESTA's GMAC)."""
    base = dict(image_size=112, patch_size=16, hidden_size=192, num_hidden_layers=6, num_attention_heads=3,
                intermediate_size=768)
    results = []
    for frames in frames_list:
        divided_none = TestaVisionConfig(num_frames=frames, temporal_reduction=0, spatial_reduction=0, **base)
        r_t, r_s = suggest_reduction(divided_none, target_ratio=0.55)
        testa = TestaVisionConfig(num_frames=frames, temporal_reduction=r_t, spatial_reduction=r_s, **base)
        target = count_encoder_gmac(testa)[0]
        joint_none = TestaVisionConfig(num_frames=frames, aggregation_dims="joint", temporal_reduction=0,
                                       spatial_reduction=0, **base)
        try:
            _, r_joint = suggest_reduction(joint_none, target_gmac=target)
        except ValueError:  # joint attention's quadratic cost: even halving the tokens every block stays above
            r_joint = frames * 49  # capped at half the tokens per block: the most ToMe can remove
        joint = TestaVisionConfig(num_frames=frames, aggregation_dims="joint", temporal_reduction=0,
                                  spatial_reduction=r_joint, **base)
        r_joint = f"{r_joint} (max)" if count_encoder_gmac(joint)[0] > target * 1.01 else r_joint
        for name, config in (("divided, no merging", divided_none), (f"TESTA R_T={r_t} R_S={r_s}", testa),
                             ("joint, no merging", joint_none), (f"ToMe joint R={r_joint}", joint)):
            model = TestaVisionModel(config).eval()
            video = torch.randn(1, frames, 3, 112, 112)
            with torch.inference_mode():
                model(video)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    model(video)
                    times.append(time.perf_counter() - start)
            results.append({"frames": frames, "encoder": name, "gmac": count_encoder_gmac(config)[0],
                            "seconds": statistics.median(times), "peak_mib": _peak_memory(config, frames)})
            print(json.dumps(results[-1]), flush=True)
    return results


def _peak_memory(config: TestaVisionConfig, frames: int) -> float:
    """Resident-set growth of one forward pass, in a fresh process (Linux)."""
    import subprocess

    code = (
        "import torch, json\n"
        "from pathlib import Path\n"
        "from modeling_testa import TestaVisionConfig, TestaVisionModel\n"
        "m = TestaVisionModel(TestaVisionConfig(**json.loads(%r))).eval(); v = torch.randn(1, %d, 3, 112, 112)\n"
        "kib = lambda f: int(next(l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith(f)).split()[1])\n"
        "Path('/proc/self/clear_refs').write_text('5'); base = kib('VmRSS:')\n"
        "with torch.inference_mode(): m(v)\n"
        "print((kib('VmHWM:') - base) / 1024)\n"
    ) % (json.dumps({k: v for k, v in config.to_dict().items() if k in TestaVisionConfig.__dataclass_fields__}), frames)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "outputs" / "synthetic" / "train" / "final")
    parser.add_argument("--data", type=Path, default=REPO / "outputs" / "synthetic" / "data")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "ablations")
    parser.add_argument("--text-length", type=int, default=64)
    parser.add_argument("--k-test", type=int, default=16)
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = TestaForVideoTextRetrieval.from_pretrained(str(args.model)).eval()
    processor = TestaProcessor.from_pretrained(str(args.model))
    vision = model.vision_model.config
    r_t, r_s = vision.temporal_reduction, vision.spatial_reduction
    trained = f"R_T={r_t}, R_S={r_s}"
    none = dict(temporal_reduction=0, spatial_reduction=0)
    both = dict(temporal_reduction=r_t, spatial_reduction=r_s, reduction_mode="merge", aggregation_strategy="geometry",
                aggregation_dims="temporal+spatial")
    target = count_encoder_gmac(TestaVisionConfig(**{**vision.to_dict(), **both}))[0]
    only_t = suggest_reduction(TestaVisionConfig(**{**vision.to_dict(), "aggregation_dims": "temporal"}), target_gmac=target * 1.05)
    only_s = suggest_reduction(TestaVisionConfig(**{**vision.to_dict(), "aggregation_dims": "spatial"}), target_gmac=target * 1.05)
    joint_r = suggest_reduction(TestaVisionConfig(**{**vision.to_dict(), "aggregation_dims": "joint"}), target_gmac=target * 1.05)

    tables = {
        "(0) reference": [row("no aggregation", model, processor, args, none)],
        "(1) aggregation vs pruning (training-free, matched GMAC)": [
            row(f"pruning ({trained})", model, processor, args, {**both, "reduction_mode": "prune"}),
            row(f"aggregation ({trained})", model, processor, args, both),
        ],
        "(2) aggregation strategy": [
            row("importance-based", model, processor, args, {**both, "aggregation_strategy": "importance"}),
            row("geometry-based", model, processor, args, both),
        ],
        "(3) aggregation dimension (about equal GMAC)": [
            row(f"only temporal (R_T={only_t[0]})", model, processor, args,
                {**both, "aggregation_dims": "temporal", "temporal_reduction": only_t[0], "spatial_reduction": 0}),
            row(f"only spatial (R_S={only_s[1]})", model, processor, args,
                {**both, "aggregation_dims": "spatial", "temporal_reduction": 0, "spatial_reduction": only_s[1]}),
            row(f"both ({trained})", model, processor, args, both),
        ],
        "(4) divided (TESTA) vs joint (ToMe) merging, matched GMAC": [
            row(f"ToMe joint (R={joint_r[1]})", model, processor, args,
                {**both, "aggregation_dims": "joint", "temporal_reduction": 0, "spatial_reduction": joint_r[1]}),
            row(f"TESTA divided ({trained})", model, processor, args, both),
        ],
    }
    scaling = encoder_scaling(args.frames, args.repeats)

    lines = [f"Model: {args.model} (trained with {trained}); test split of {args.data}.", ""]
    for title, rows in tables.items():
        lines += [f"**{title}**", "", "| setting | GMAC / video | video tokens | t2v R@1 | t2v R@5 | t2v R@10 | mean recall |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['gmac']:.3f} | {r['video_tokens']} | {r['t2v_R@1']:.1f} | {r['t2v_R@5']:.1f} | "
                  f"{r['t2v_R@10']:.1f} | {r['mean_recall']:.1f} |" for r in rows]
        lines.append("")
    lines += ["**(4b) encoder scaling with frames** (random-init encoder: hidden 192, 6 layers, 112 px, 49 patches "
              "per frame; batch 1; median of %d)" % args.repeats, "",
              "| frames | encoder | GMAC | time (s) | peak memory (MiB) |", "|---|---|---|---|---|"]
    lines += [f"| {r['frames']} | {r['encoder']} | {r['gmac']:.2f} | {r['seconds']:.3f} | {r['peak_mib']:.0f} |"
              for r in scaling]
    text = "\n".join(lines)
    print("\n" + text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(text + "\n")
    args.output.with_suffix(".json").write_text(json.dumps({"tables": tables, "scaling": scaling}, indent=1))


if __name__ == "__main__":
    main()
