"""Tiny configurations and inputs: the video encoder, the heads, BLIP, token ids and videos."""

import torch
from transformers import BlipConfig

from modeling_testa import TestaConfig, TestaVisionConfig, TestaVisionModel


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


VOCAB, CLS, SEP, PAD, DEC, ENC = 120, 101, 102, 0, 118, 119

TEXT_SETTINGS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    bos_token_id=DEC,
    sep_token_id=SEP,
    pad_token_id=PAD,
    label_smoothing=0.0,
)


def tiny_config(vision: dict | None = None, **overrides) -> TestaConfig:
    """A 2-layer video encoder (8 frames of 32x32, patches of 8) and a 2-layer BERT over a 120-word vocabulary."""
    settings = dict(projection_dim=16, queue_size=8, enc_token_id=ENC, dec_token_id=DEC)
    settings.update(overrides)
    return TestaConfig(
        vision_config=tiny_vision_config(**(vision or {})).to_dict(), text_config=dict(TEXT_SETTINGS), **settings
    )


def tiny_blip_config(image_size: int = 32, layer_norm_eps: float = 1e-5) -> BlipConfig:
    vision = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=image_size,
        patch_size=8, layer_norm_eps=layer_norm_eps,
    )
    return BlipConfig(text_config=dict(TEXT_SETTINGS), vision_config=vision, image_text_hidden_size=16)


@torch.no_grad()
def randomize(model: torch.nn.Module, gain: float = 1.5, seed: int = 0) -> torch.nn.Module:
    """Replaces every weight with noise scaled so that signals neither vanish nor saturate: matrices get
    N(0, gain^2 / fan_in), LayerNorm gains 1 + N(0, 0.2^2), biases and embeddings N(0, 0.2^2) and N(0, 1). With the
    default 0.02 init, attention is nearly uniform and cross-attention contributions too small for a 1e-4
    comparison to mean anything. Scalars (the contrastive temperature) are left alone."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if p.ndim == 0:
            continue
        if p.ndim == 1:
            is_norm_gain = "norm" in name.lower() and name.endswith("weight")
            p.copy_(1 + 0.2 * noise if is_norm_gain else 0.2 * noise)
        elif "embedding" in name or "embeddings" in name:
            p.copy_(noise)
        else:
            p.copy_(noise * gain / p[0].numel() ** 0.5)
    return model


def text_ids(batch: int, length: int, seed: int = 0, first: int = CLS, pad_to: int | None = None) -> torch.Tensor:
    """Random ``[first, words..., SEP]`` rows; with ``pad_to`` the rows are padded with PAD to that length."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000 % VOCAB, 100, (batch, length), generator=generator)
    ids[:, 0], ids[:, -1] = first, SEP
    if pad_to is not None:
        ids = torch.cat([ids, torch.full((batch, pad_to - length), PAD)], dim=1)
    return ids


def videos(batch: int, frames: int = 8, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, frames, 3, size, size, generator=torch.Generator().manual_seed(seed))


def random_vision_model(seed: int = 0, **overrides) -> TestaVisionModel:
    """A tiny `TestaVisionModel` (`tiny_vision_config` with ``overrides``) in eval mode, with randomized weights."""
    torch.manual_seed(seed)
    model = TestaVisionModel(tiny_vision_config(**overrides)).eval()
    randomize(model, seed=seed)
    return model


TINY_MODEL_RECIPE = [
    "--set", "model.vision_config.num_frames=4", "--set", "model.vision_config.image_size=32",
    "--set", "model.vision_config.patch_size=8", "--set", "model.vision_config.hidden_size=32",
    "--set", "model.vision_config.num_hidden_layers=2", "--set", "model.vision_config.num_attention_heads=2",
    "--set", "model.vision_config.intermediate_size=64", "--set", "model.vision_config.temporal_reduction=1",
    "--set", "model.vision_config.spatial_reduction=3",
    "--set", "model.text_config.hidden_size=32", "--set", "model.text_config.num_hidden_layers=2",
    "--set", "model.text_config.num_attention_heads=2", "--set", "model.text_config.intermediate_size=64",
    "--set", "model.projection_dim=16", "--set", "model.queue_size=8",
]
"""`--set` overrides that make a training recipe's model tiny (2 + 2 layers of width 32 on 4 frames of 32 px; the
data settings are each test's): the training-script tests' shared start."""
