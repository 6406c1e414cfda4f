"""Vision-encoder GMAC and output tokens for ViT-B/16 at 224 px, in the paper's (fvcore) convention.

    python -m benchmarks.flops            # the paper's four settings
    python -m benchmarks.flops --frames 64 --temporal-reduction 2 --spatial-reduction 10

One multiply-add counts 1, LayerNorm 5 per element, the matching products are included; text modules are not.
Counted on the meta device, so it takes about a second whatever the size.
"""

import argparse

from modeling_testa import TestaVisionConfig
from modeling_testa.flops import count_encoder_gmac


PAPER = [  # frames, R_T, R_S, paper GMAC, paper tokens
    (32, 0, 0, 786.8, 6273),
    (32, 1, 12, 419.8, 1041),
    (96, 0, 0, 2382.5, 18817),
    (96, 4, 8, 1381.4, 4801),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int)
    parser.add_argument("--temporal-reduction", type=int, default=0)
    parser.add_argument("--spatial-reduction", type=int, default=0)
    parser.add_argument("--frame-matching", default="mean", choices=["mean", "vote"])
    args = parser.parse_args()
    rows = PAPER if args.frames is None else [(args.frames, args.temporal_reduction, args.spatial_reduction, None, None)]
    print("| frames | R_T | R_S | GMAC (ours) | GMAC (paper) | diff | tokens (ours) | tokens (paper) |")
    print("|---|---|---|---|---|---|---|---|")
    for frames, r_t, r_s, paper_gmac, paper_tokens in rows:
        config = TestaVisionConfig(
            num_frames=frames, temporal_reduction=r_t, spatial_reduction=r_s, frame_matching=args.frame_matching
        )
        gmac, tokens = count_encoder_gmac(config)
        diff = f"{100 * (gmac - paper_gmac) / paper_gmac:+.3f}%" if paper_gmac else "-"
        print(
            f"| {frames} | {r_t} | {r_s} | {gmac:.1f} | {paper_gmac or '-'} | {diff} | {tokens} | {paper_tokens or '-'} |"
        )


if __name__ == "__main__":
    main()
