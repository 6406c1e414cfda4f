"""GFLOPs–recall trade-off: sweeps R_T and R_S on a trained model (training-free) and plots recall against the
encoder's GMAC, like the paper's appendix figures.

    python -m benchmarks.tradeoff --model outputs/synthetic/train/final --data outputs/synthetic/data --output docs/tradeoff

Writes OUTPUT.png (needs matplotlib: `pip install matplotlib`), OUTPUT.md and OUTPUT.json.
"""

import argparse
import json
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from benchmarks.ablations import row
from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.processing_testa import TestaProcessor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "outputs" / "synthetic" / "train" / "final")
    parser.add_argument("--data", type=Path, default=REPO / "outputs" / "synthetic" / "data")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "tradeoff")
    parser.add_argument("--temporal", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--spatial", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--text-length", type=int, default=64)
    parser.add_argument("--k-test", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = TestaForVideoTextRetrieval.from_pretrained(str(args.model)).eval()
    processor = TestaProcessor.from_pretrained(str(args.model))
    trained = (model.vision_model.config.temporal_reduction, model.vision_model.config.spatial_reduction)
    points = []
    for r_t in args.temporal:
        for r_s in args.spatial:
            result = row(f"R_T={r_t}, R_S={r_s}", model, processor, args,
                         dict(temporal_reduction=r_t, spatial_reduction=r_s))
            points.append({"temporal_reduction": r_t, "spatial_reduction": r_s, **result})

    lines = [f"Model: {args.model} (trained with R_T={trained[0]}, R_S={trained[1]}); test split of {args.data}.", "",
             "| R_T | R_S | GMAC / video | video tokens | t2v R@1 | t2v R@5 | t2v R@10 | mean recall |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['temporal_reduction']} | {p['spatial_reduction']} | {p['gmac']:.3f} | {p['video_tokens']} | "
              f"{p['t2v_R@1']:.1f} | {p['t2v_R@5']:.1f} | {p['t2v_R@10']:.1f} | {p['mean_recall']:.1f} |" for p in points]
    text = "\n".join(lines)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(text + "\n")
    args.output.with_suffix(".json").write_text(json.dumps(points, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r_t in args.temporal:
        series = sorted((p for p in points if p["temporal_reduction"] == r_t), key=lambda p: p["gmac"])
        ax.plot([p["gmac"] for p in series], [p["mean_recall"] for p in series], marker="o", label=f"R_T={r_t}")
        for p in series:
            ax.annotate(f"R_S={p['spatial_reduction']}", (p["gmac"], p["mean_recall"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("video encoder GMAC per video")
    ax.set_ylabel("mean recall (t2v + v2t, R@1/5/10)")
    ax.set_title(f"Synthetic long-video retrieval (trained with R_T={trained[0]}, R_S={trained[1]})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output.with_suffix(".png"), dpi=120)
    print(f"wrote {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
