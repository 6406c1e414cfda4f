"""Speed of `apply_testa` on transformers' own `TimesformerModel` (ViT-B/16, 8 frames of 224 px), measured in one run.

    python -m benchmarks.transformers_encoders [--frames 8] [--target 0.55] [--runs 3] [--threads 2]

The (R_T, R_S) pair (the same in every block) whose GMAC is closest to ``--target`` times the unpatched GMAC is picked
with the closed-form count (`modeling_testa.flops.estimate_encoder_gmac` on the same ViT-B/16 shape), then both
GMACs are counted on the real models (`training_free.gmac`, FlopCounterMode). The unpatched transformers model
(eager attention, as transformers ships it), the patched model at R = 0 (SDPA) and the patched model at the picked
pair each run ``--runs`` forward passes of one random-weight video after a warm-up, interleaved, in this process; the
median times and their ratios are printed. Random weights: speed does not depend on them (accuracy is in
`training_free.py`).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch


REPO = Path(__file__).resolve().parents[1]

from transformers import TimesformerConfig, TimesformerModel

from modeling_testa import TestaVisionConfig, apply_testa, remove_testa
from modeling_testa.flops import estimate_encoder_gmac
from benchmarks.training_free import gmac


def pick_reduction(frames: int, target: float, temporal: tuple[int, ...]) -> tuple[int, int, float]:
    """The per-block (R_T in ``temporal``, R_S) whose closed-form GMAC is closest to ``target`` of the unmerged
    encoder's."""
    def estimate(r_t: int, r_s: int) -> float:
        config = TestaVisionConfig(num_frames=frames, temporal_reduction=r_t, spatial_reduction=r_s)
        return estimate_encoder_gmac(config)[0]

    base = estimate(0, 0)
    pairs = [(r_t, r_s) for r_t in temporal for r_s in range(0, 25)]
    r_t, r_s = min(pairs, key=lambda pair: abs(estimate(*pair) / base - target))
    return r_t, r_s, estimate(r_t, r_s) / base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.55, help="GMAC of the merged model / unmerged")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TimesformerModel(TimesformerConfig(num_frames=args.frames, image_size=224)).eval()
    video = torch.randn(1, args.frames, 3, 224, 224)
    # the closest pair overall, and the closest one that also merges frames
    picks = [pick_reduction(args.frames, args.target, (0, 1, 2)), pick_reduction(args.frames, args.target, (1, 2))]
    picks = list(dict.fromkeys(picks))

    apply_testa(model)
    counted = {(0, 0): gmac(model, video)}
    for r_t, r_s, _ in picks:
        apply_testa(model, temporal_reduction=r_t, spatial_reduction=r_s)
        counted[(r_t, r_s)] = gmac(model, video)
    remove_testa(model)
    base_gmac, base_tokens = counted[(0, 0)]

    settings = {"transformers (unpatched, eager)": None, "apply_testa, R = 0 (SDPA)": (0, 0)}
    settings.update({f"apply_testa, R_T={r_t} R_S={r_s}": (r_t, r_s) for r_t, r_s, _ in picks})
    times = {name: [] for name in settings}
    with torch.no_grad():
        for repeat in range(args.runs + 1):  # the first round is the warm-up
            for name, reduction in settings.items():
                if reduction is None:
                    remove_testa(model)  # a no-op on an unpatched model
                else:
                    apply_testa(model, temporal_reduction=reduction[0], spatial_reduction=reduction[1])
                start = time.perf_counter()
                model(video)
                if repeat:
                    times[name].append(time.perf_counter() - start)
    remove_testa(model)
    unpatched = statistics.median(times["transformers (unpatched, eager)"])
    print(f"TimesformerModel (ViT-B/16), {args.frames} frames of 224 px, batch 1, fp32, {args.threads} threads, "
          f"median of {args.runs} interleaved runs after a warm-up; random weights\n")
    print("| model | GMAC | % of unmerged | output tokens | median time (s) | speed-up vs transformers |")
    print("|---|---|---|---|---|---|")
    for name, reduction in settings.items():
        value, tokens = counted[reduction or (0, 0)]
        median = statistics.median(times[name])
        print(f"| {name} | {value:.1f} | {100 * value / base_gmac:.0f}% | {tokens} | {median:.2f} | "
              f"{unpatched / median:.2f}x |")
    for r_t, r_s, estimated in picks:
        print(f"\n(R_T={r_t}, R_S={r_s}) picked for {args.target:.0%} of the GMAC: closed form {estimated:.1%}, "
              f"counted {counted[(r_t, r_s)][0] / base_gmac:.1%}.")


if __name__ == "__main__":
    main()
