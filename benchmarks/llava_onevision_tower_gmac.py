"""LLaVA-OneVision's SigLIP tower: frames and video tokens to the LLM, and tower GMAC, stock and with TESTA schedules
(the table of docs/video_llms.md, "LLaVA-OneVision").

    python -m benchmarks.llava_onevision_tower_gmac             # 32 frames, the documented schedules
    python -m benchmarks.llava_onevision_tower_gmac --frames 64

For transformers' default LLaVA-OneVision tower (26 SigLIP blocks, 729 patches per frame), counted by
``torch.utils.flop_counter`` on the meta device (no weights, nothing computed), so the figures are the same on every
machine and take seconds.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlavaOnevisionConfig, SiglipVisionModel

from modeling_testa.aggregation_settings import AggregationSettings
from modeling_testa.flops import layer_norm_flops
from video_llms.llava_onevision import encode_video_frames, kept_frames, video_token_count


def tower_gmac(vision_config, frames: int, settings: AggregationSettings | None = None) -> float:
    """The SigLIP tower's GMAC for one video of ``frames`` frames, stock (``settings=None``) or with TESTA, in the
    project's convention (`modeling_testa.flops`: one multiply-add is one operation, LayerNorm 5 per element,
    attention through the math kernel so that it is counted, the matching's similarity products included). The
    projector, the pooler and the LLM are not counted."""
    with torch.device("meta"):
        tower = SiglipVisionModel(vision_config).eval()
        pixels = torch.empty(1, frames, vision_config.num_channels, vision_config.image_size, vision_config.image_size)
    mapping = {torch.ops.aten.native_layer_norm: layer_norm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            if settings is None:
                tower(pixels.flatten(0, 1))
            else:  # what the patched get_video_features runs in the tower, post_layernorm included
                last = encode_video_frames(tower, pixels, settings, [settings.num_layers])[1]
                tower.post_layernorm(last.patches.flatten(0, 1))
    return counter.get_total_flops() / 2e9


DOCUMENTED_SCHEDULES = {
    "0 (stock)": (0, 0),
    "`[0] * 10 + [1] * 16`": ([0] * 10 + [1] * 16, 0),
    "`[0, 0] + [2] * 8 + [0] * 16`": ([0, 0] + [2] * 8 + [0] * 16, 0),
    "`[0] * 2 + [1] * 24`": ([0] * 2 + [1] * 24, 0),
    "`[0, 0] + [3] * 8 + [0] * 16`": ([0, 0] + [3] * 8 + [0] * 16, 0),
    "`[0, 0] + [3] * 8 + [0] * 16`, R_S `[0, 0] + [40] * 8 + [0] * 16`": (
        [0, 0] + [3] * 8 + [0] * 16, [0, 0] + [40] * 8 + [0] * 16),
}
"""The table's schedules: (temporal_reduction, spatial_reduction) for the 26-block tower."""


def frames_table(frames: int = 32) -> str:
    """The table for transformers' default LLaVA-OneVision tower: frames and video tokens to the LLM, frames the
    blocks receive (summed over the blocks), and tower GMAC."""
    vision = LlavaOnevisionConfig().vision_config
    blocks, grid = vision.num_hidden_layers, (vision.image_size // vision.patch_size) ** 2
    stock = tower_gmac(vision, frames)
    lines = ["| schedule (R_T, R_S = 0 unless given) | frames to the LLM | video tokens to the LLM | "
             "frames received by the blocks, summed | tower GMAC (x stock) |", "|---|---|---|---|---|"]
    for text, (temporal, spatial) in DOCUMENTED_SCHEDULES.items():
        settings = AggregationSettings.for_layers(blocks, temporal, spatial)
        received = sum(kept_frames(settings, frames, block) for block in range(blocks))
        gmac = tower_gmac(vision, frames, settings)
        lines.append(f"| {text} | {kept_frames(settings, frames, blocks)} | "
                     f"{video_token_count(settings, frames, -1, grid)} | {received} | "
                     f"{gmac:,.0f} ({gmac / stock:.2f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=32, help="frames of the video (default 32, as documented)")
    print(frames_table(parser.parse_args().frames))


if __name__ == "__main__":
    main()
