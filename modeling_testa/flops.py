"""FLOP accounting for the TESTA video encoder, in the paper's convention.

The paper's "GFLOPs" are fvcore counts of the **video encoder only** at batch 1, where one multiply-add counts as one
operation (i.e. GMAC), LayerNorm costs 5 operations per element, and the bipartite-matching similarity products are
included. :func:`count_encoder_gmac` measures that with ``torch.utils.flop_counter`` on the meta device (no memory,
no compute: ViT-B/16 at 96 frames counts in well under a second), with SDPA routed to the math kernel so attention is
counted.
"""

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from .configuration_testa import TestaVisionConfig
from .modeling_testa import TestaVisionModel


def _layer_norm_flops(input_shape, *args, out_shape=None, **kwargs) -> int:
    # fvcore counts 5 operations per normalised element; FlopCounterMode reports 2 FLOPs per MAC, hence 10.
    return 10 * math.prod(input_shape)


def count_encoder_gmac(
    config: TestaVisionConfig, num_frames: int | None = None, image_size: int | None = None
) -> tuple[float, int]:
    """Counts the encoder's GMAC for one video and returns ``(gmac, output_tokens)``.

    Args:
        config: the encoder configuration (aggregation settings included).
        num_frames, image_size: the input (defaults: ``config.num_frames``, ``config.image_size``).
    """
    frames = num_frames or config.num_frames
    size = image_size or config.image_size
    mapping = {torch.ops.aten.native_layer_norm: _layer_norm_flops}
    with torch.device("meta"):
        model = TestaVisionModel(config).eval()
        pixel_values = torch.empty(1, frames, config.num_channels, size, size)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            tokens = model(pixel_values).last_hidden_state.shape[1]
    return counter.get_total_flops() / 2e9, tokens


__all__ = ["count_encoder_gmac"]
