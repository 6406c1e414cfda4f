"""ITM re-ranking cost per query, with merged (TESTA) vs unmerged video tokens, ViT-B/16 + BERT-base at 224 px.

    python -m benchmarks.rerank_cost                       # 32 frames (f1p12) and 96 frames (f4p8)
    python -m benchmarks.rerank_cost --frames 64 --temporal-reduction 2 --spatial-reduction 10 --k-test 64

Two-stage retrieval re-scores the top `k_test` candidates of every query with the ITM head: the BERT text encoder
run on the query with cross-attention to all tokens of the candidate video. Its cost grows with the number of video
tokens (cross-attention K/V projections and attention), which TESTA's aggregation cuts. Counts are GMAC (one
multiply-add = 1, LayerNorm 5 per element, the paper's fvcore convention) of the real modules, run on the meta
device under `FlopCounterMode` with SDPA routed to the math kernel, so nothing is allocated or computed. The
encoder column is the video encoder's own cost (`count_encoder_gmac`), paid once per video, not per query.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modeling_testa import TestaConfig, TestaForVideoTextRetrieval, TestaVisionConfig
from modeling_testa.flops import layer_norm_flops, count_encoder_gmac


BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def itm_pair_gmac(config: TestaConfig, video_tokens: int, text_length: int) -> float:
    """GMAC of one (text, video) ITM forward: [ENC] text encoder with cross-attention to ``video_tokens``, plus the
    head."""
    with torch.device("meta"):
        model = TestaForVideoTextRetrieval(config).eval()
        input_ids = torch.zeros(1, text_length, dtype=torch.long)
        video = torch.empty(1, video_tokens, config.vision_config.hidden_size)
    mapping = {torch.ops.aten.native_layer_norm: layer_norm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            model.itm_logits(input_ids, None, video)
    return counter.get_total_flops() / 2e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int)
    parser.add_argument("--temporal-reduction", type=int, default=1)
    parser.add_argument("--spatial-reduction", type=int, default=12)
    parser.add_argument("--k-test", type=int, default=128, help="candidates re-ranked per query (paper: 128)")
    parser.add_argument("--text-length", type=int, default=128, help="query tokens (QuerYD pads to 128)")
    args = parser.parse_args()
    settings = [(32, 1, 12), (96, 4, 8)] if args.frames is None else [
        (args.frames, args.temporal_reduction, args.spatial_reduction)
    ]
    print(f"ITM re-rank cost per query: k_test={args.k_test} candidates, {args.text_length}-token query, ViT-B/16 "
          "+ BERT-base, 224 px (GMAC)\n")
    print("| frames | video tokens | R_T | R_S | encoder GMAC / video | ITM GMAC / pair | ITM re-rank GMAC / query |")
    print("|---|---|---|---|---|---|---|")
    for frames, r_t, r_s in settings:
        rows = []
        for temporal, spatial in ((0, 0), (r_t, r_s)):
            vision = TestaVisionConfig(num_frames=frames, temporal_reduction=temporal, spatial_reduction=spatial)
            config = TestaConfig(vision_config=vision, text_config=dict(BERT_BASE))
            encoder, tokens = count_encoder_gmac(vision)
            pair = itm_pair_gmac(config, tokens, args.text_length)
            rows.append((tokens, temporal, spatial, encoder, pair, pair * args.k_test))
            print(f"| {frames} | {tokens} | {temporal} | {spatial} | {encoder:.1f} | {pair:.1f} | "
                  f"{pair * args.k_test:,.0f} |")
        print(f"| {frames} | | | | ratio {rows[0][3] / rows[1][3]:.2f}x | ratio {rows[0][4] / rows[1][4]:.2f}x | "
              f"**{rows[0][5] / rows[1][5]:.2f}x fewer** |")


if __name__ == "__main__":
    main()
