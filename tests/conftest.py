import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from modeling_testa import TestaVisionConfig  # noqa: E402


def tiny_vision_config(**overrides) -> TestaVisionConfig:
    """A 2-layer encoder on 8 frames of 32x32 pixels (16 patches of 8x8 per frame)."""
    settings = dict(
        num_frames=8,
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        temporal_reduction=1,
        spatial_reduction=3,
    )
    settings.update(overrides)
    return TestaVisionConfig(**settings)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
