"""Configuration classes for TESTA (Temporal-Spatial Token Aggregation, Ren et al., EMNLP 2023 Findings).

`TestaVisionConfig` describes the TimeSformer-style video encoder and its token aggregation; `TestaConfig` is the
composite configuration of the full video-language model (video encoder + BLIP text modules + heads).
"""


import logging

from huggingface_hub.dataclasses import strict
from transformers import BlipTextConfig, PreTrainedConfig

from .aggregation_settings import (
    AGGREGATION_DIMS,
    AGGREGATION_FIELDS,
    AGGREGATION_STRATEGIES,
    DEFAULTS,
    FRAME_MATCHINGS,
    REDUCTION_MODES,
    AggregationSettings,
    check_choice,
    per_layer,
    switched_off_message,
    switched_off_reductions,
)


RAW_SCORES = 0.0
"""The ``score_grid`` of a saved config that has none: it was saved before the setting existed, when merge decisions
were taken on raw scores."""


def with_saved_rule(vision_config: dict) -> dict:
    """A saved vision config as a dict, with ``score_grid`` set to :data:`RAW_SCORES` where it has none (a model saved
    before the setting existed was trained on raw scores: it must not be served under another rule)."""
    if "score_grid" in vision_config:
        return vision_config
    logger.info("The config has no score_grid (saved before the setting existed): the model decides its merges on raw "
                "scores (score_grid=0), as it was trained.")
    return {**vision_config, "score_grid": RAW_SCORES}


# Whether transformers builds a composite config's sub-configs from `sub_configs_defaults` (newer 5.x releases). Older
# ones (e.g. 5.17) read the `sub_configs` mapping and leave the building to the config (see `TestaConfig`).
BUILDS_SUB_CONFIGS = hasattr(PreTrainedConfig, "sub_configs_defaults")

logger = logging.getLogger(__name__)


@strict
class TestaVisionConfig(PreTrainedConfig):
    r"""
    Configuration of [`TestaVisionModel`]: a TimeSformer-style ViT with divided space-time attention, in which every
    block aggregates similar **frames** (temporal aggregation, `temporal_reduction` = R_T frames per block) and similar
    **patches within each frame** (spatial aggregation, `spatial_reduction` = R_S patches per block).

    The defaults are the paper's 32-frame ViT-B/16 setting (R_T=1, R_S=12: 6273 -> 1041 output tokens,
    786.8 -> 419.8 GMAC). The 96-frame setting is `num_frames=96, temporal_reduction=4, spatial_reduction=8`.

    Args:
        num_frames (`int`, defaults to 32): frames the temporal embedding is trained for. Other frame counts are
            accepted at run time; the temporal embedding is then interpolated (nearest, as in TimeSformer).
        image_size (`int`, defaults to 224): input resolution; other sizes interpolate the position embedding.
        patch_size (`int`, defaults to 16), num_channels (`int`, defaults to 3).
        hidden_size (`int`, defaults to 768), num_hidden_layers (`int`, defaults to 12),
        num_attention_heads (`int`, defaults to 12), intermediate_size (`int`, defaults to 3072),
        hidden_act (`str`, defaults to `"gelu"`), layer_norm_eps (`float`, defaults to 1e-6),
        qkv_bias (`bool`, defaults to `True`): the usual ViT-B/16 hyper-parameters.
        hidden_dropout_prob (`float`), attention_dropout (`float`), drop_path_rate (`float`): regularisation, all 0
            in the paper.
        temporal_reduction (`int` or `list[int]`, defaults to 1): R_T, frames removed per block (or one value per
            block). As in ToMe, a block never removes more than half of what it has: the frame merge is capped at
            `(T - 1) // 2` (the original code's cap) and the patch merge at `L // 2`.
        spatial_reduction (`int` or `list[int]`, defaults to 12): R_S, patches removed per frame per block. With
            `aggregation_dims="joint"` it is the number of space-time tokens removed per block instead.

            A reduction that `aggregation_dims` switches off (R_T with `"spatial"` or `"joint"`, R_S with
            `"temporal"`) must be 0, as `apply_testa` requires; because the defaults are R_T=1, R_S=12, configs that
            leave it non-zero (saved folders included) still load, with a warning, and the encoder runs with it at 0.
            The fields, allowed values and checks are `aggregation_settings.AggregationSettings`' (one declaration for
            the config, `apply_testa` and the FLOP count).
        aggregation_strategy (`str`, defaults to `"geometry"`): `"geometry"` is the paper's default: alternating
            bipartite split, the R most similar (A, B) pairs are merged. `"importance"` puts the R least-attended tokens
            (Eq. 1 of the paper) in set A and merges each into its most similar token of set B.
        reduction_mode (`str`, defaults to `"merge"`): `"merge"` (size-weighted average) or `"prune"` (drop the R least
            important tokens by Eq. 1, the paper's Table 5 baseline; it ignores `aggregation_strategy`).
        aggregation_dims (`str`, defaults to `"temporal+spatial"`): `"temporal"`, `"spatial"`, `"temporal+spatial"`,
            or `"joint"`: ToMe-style global merging over all space-time tokens, for which the blocks use joint
            space-time attention (the comparison baseline of the paper's section 4.7).
        frame_matching (`str`, defaults to `"mean"`): how frames are compared. `"mean"` is the paper's definition: a
            frame token is the mean of the frame's patch keys, compared by cosine. `"vote"` is the original code's
            per-position matching, where every patch position picks a destination frame and the majority wins; here
            ties go to the earliest frame and the pair score is the mean similarity to the voted frame, so the result
            is deterministic and the same on every device. `"original"` is the released TESTA code's rule exactly,
            as it runs on CPU: the destination is the same majority vote, and the pair score is the `torch.mode` over
            positions of every position's best similarity, which for distinct floats is their minimum (a frame scores
            as its worst position's best similarity). Converted original checkpoints default to it. The released code
            runs `torch.mode` on the GPU too, whose tie rule is unspecified (pytorch #90261), so GPU runs of the
            released code cannot be reproduced bit for bit; `"original"` reproduces the CPU run, deterministically on
            every device.
        score_grid (`float`, defaults to `2**-10`): merge decisions are taken on similarity scores rounded to
            multiples of this grid (0 or a power of two), so that scores that differ only by rounding tie, and ties
            go to the lowest index, on every runtime (PyTorch eager or compiled, OpenVINO, ONNX Runtime, CUDA). `0`
            decides on raw scores. It is the rule the model was trained with and part of the model: saved and loaded
            with it. **A config saved without it** (a model saved before the setting existed) **loads with `0`, raw
            scores**, which is what models before the grid were trained with (`from_dict`). `frame_matching="original"`
            decides on raw scores whatever it is.
        proportional_attention (`bool`, defaults to `False`): add log(token size) to the attention logits (ToMe). Off
            in the paper and in all original checkpoints.
        trace_source (`bool`, defaults to `False`): return `source_map`, the output token of every input patch.
        initializer_range (`float`, defaults to 0.02).
    """

    model_type = "testa_vision_model"
    base_config_key = "vision_config"

    num_frames: int = 32
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    hidden_dropout_prob: float = 0.0
    attention_dropout: float = 0.0
    drop_path_rate: float = 0.0
    initializer_range: float = 0.02
    temporal_reduction: int | list[int] = 1
    spatial_reduction: int | list[int] = 12
    # The aggregation fields: their defaults, checks and meaning are `AggregationSettings`' (declared once there).
    aggregation_strategy: str = DEFAULTS["aggregation_strategy"]
    reduction_mode: str = DEFAULTS["reduction_mode"]
    aggregation_dims: str = DEFAULTS["aggregation_dims"]
    frame_matching: str = DEFAULTS["frame_matching"]
    score_grid: float | int = DEFAULTS["score_grid"]
    proportional_attention: bool = DEFAULTS["proportional_attention"]
    trace_source: bool = DEFAULTS["trace_source"]

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_aggregation_settings()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As transformers' `from_dict`, with one rule for saved configs: one without ``score_grid`` loads with raw
        scores (`with_saved_rule`)."""
        return super().from_dict(with_saved_rule(config_dict), **kwargs)

    def check_aggregation_settings(self) -> None:
        """Raises `ValueError` with an explanation for any inconsistent setting."""
        for name in ("num_frames", "image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be a positive int, got {getattr(self, name)}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}."
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}.")
        self.aggregation_settings()  # raises for impossible aggregation settings, as apply_testa does
        for name in switched_off_reductions(self.aggregation_dims, self.temporal_reduction, self.spatial_reduction):
            # Configs default to R_T=1, R_S=12, so saved configs with another `aggregation_dims` carry a reduction
            # that the encoder has always ignored: they load, with a warning, and run with it at 0.
            logger.warning(
                "TestaVisionConfig: %s The encoder runs with %s=0; set it to 0 to silence this warning "
                "(apply_testa refuses such settings).",
                switched_off_message(name, getattr(self, name), self.aggregation_dims), name,
            )

    def aggregation_settings(self) -> AggregationSettings:
        """The settings the encoder's blocks run with (validated; a reduction that `aggregation_dims` switches off is
        0)."""
        return AggregationSettings.from_config(self)

    @property
    def temporal_reduction_per_layer(self) -> list[int]:
        """R_T for every block; zero where temporal aggregation is switched off by `aggregation_dims`."""
        return list(self.aggregation_settings().temporal_reduction)

    @property
    def spatial_reduction_per_layer(self) -> list[int]:
        """R_S (or the joint R) for every block; zero where `aggregation_dims` switches it off."""
        return list(self.aggregation_settings().spatial_reduction)

    @property
    def num_patches_per_frame(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@strict
class TestaConfig(PreTrainedConfig):
    r"""
    Configuration of the full TESTA video-language model: the [`TestaVisionConfig`] video encoder, transformers'
    [`BlipTextConfig`] for the BERT text encoder / video-grounded encoder / decoder (so BLIP weights map one to one), and
    the retrieval, matching and QA heads.

    Args:
        vision_config (`dict` or `TestaVisionConfig`): the video encoder.
        text_config (`dict` or `BlipTextConfig`): the text modules (BERT-base with cross-attention, vocab 30524).
        projection_dim (`int`, defaults to 256): size of the shared video-text embedding space.
        temperature (`float`, defaults to 0.07): initial contrastive temperature (learned, clamped to [0.001, 0.5]).
        momentum (`float`, defaults to 0.995): momentum-encoder update rate.
        queue_size (`int`, defaults to 32): feature-queue length for contrastive learning (57600 in pretraining).
        alpha (`float`, defaults to 0.4): weight of momentum distillation in the contrastive targets.
        k_test (`int`, defaults to 128): candidates re-ranked by the matching head in two-stage retrieval.
        negative_all_rank (`bool`, defaults to `True`): sample hard negatives from all processes.
        label_smoothing (`float`, defaults to 0.1): label smoothing of the captioning / answer LM loss.
        enc_token_id (`int`, defaults to 30523): id of `[ENC]`, the first token of video-grounded text.
        dec_token_id (`int`, defaults to 30522): id of `[DEC]`, the decoder's start token (also `bos_token_id`).
        video_pooling (`str`, defaults to `"mean"`): how the video embedding pools the encoder output before
            `vision_proj`. `"mean"` is the unweighted mean over all output tokens, which the original checkpoints were
            trained with; `"weighted_mean"` weights each token by the number of patches it stands for; `"cls"`.
    """

    model_type = "testa"
    sub_configs_defaults = {"text_config": BlipTextConfig, "vision_config": TestaVisionConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    projection_dim: int = 256
    temperature: float = 0.07
    momentum: float = 0.995
    queue_size: int = 32
    alpha: float = 0.4
    k_test: int = 128
    negative_all_rank: bool = True
    label_smoothing: float = 0.1
    enc_token_id: int = 30523
    dec_token_id: int = 30522
    video_pooling: str = "mean"
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        kwargs.setdefault("bos_token_id", self.dec_token_id)
        if not BUILDS_SUB_CONFIGS:  # as transformers' own composite configs did before `sub_configs_defaults`
            for key, config_class in self.sub_configs.items():
                value = getattr(self, key)
                if value is None or isinstance(value, dict):
                    setattr(self, key, config_class(**(value or {})))
        super().__post_init__(**kwargs)
        # The video-grounded encoder cross-attends to video tokens of the encoder's width.
        self.text_config.encoder_hidden_size = self.vision_config.hidden_size
        self.check_heads()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As transformers' `from_dict`, with one rule for saved configs: a vision config without ``score_grid`` loads
        with raw scores (`with_saved_rule`)."""
        vision = config_dict.get("vision_config")
        if isinstance(vision, dict):
            config_dict = {**config_dict, "vision_config": with_saved_rule(vision)}
        return super().from_dict(config_dict, **kwargs)

    @property
    def max_position_embeddings(self) -> int:
        """The longest text the model reads (`text_config.max_position_embeddings`), also at the top level, where
        generic code looks for it (Sentence Transformers caps its `max_seq_length` with it)."""
        return self.text_config.max_position_embeddings

    def check_heads(self) -> None:
        """Raises `ValueError` with an explanation for any inconsistent top-level setting."""
        if self.projection_dim <= 0:
            raise ValueError(f"`projection_dim` must be positive, got {self.projection_dim}.")
        if not 0.001 <= self.temperature <= 0.5:
            raise ValueError(f"`temperature` must lie in [0.001, 0.5] (it is clamped there), got {self.temperature}.")
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"`momentum` must lie in [0, 1], got {self.momentum}.")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"`alpha` must lie in [0, 1], got {self.alpha}.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"`label_smoothing` must lie in [0, 1), got {self.label_smoothing}.")
        if self.queue_size < 0 or self.k_test <= 0:
            raise ValueError(f"`queue_size` must be >= 0 and `k_test` > 0, got {self.queue_size} and {self.k_test}.")
        check_choice(self.video_pooling, ("mean", "weighted_mean", "cls"), "video_pooling")
        vocab = self.text_config.vocab_size
        for name in ("enc_token_id", "dec_token_id"):
            if not 0 <= getattr(self, name) < vocab:
                raise ValueError(
                    f"`{name}`={getattr(self, name)} is outside the text vocabulary (text_config.vocab_size={vocab})."
                )


if not BUILDS_SUB_CONFIGS:
    TestaConfig.sub_configs = dict(TestaConfig.sub_configs_defaults)


def token_schedule(
    config: TestaVisionConfig, num_frames: int | None = None, image_size: int | None = None
) -> list[tuple[int, int]]:
    """``(frames, patches per frame)`` after every block for an input of ``num_frames`` frames of ``image_size``
    pixels (defaults: the config's).

    The encoder output has ``1 + frames * patches`` tokens. In joint mode the tokens form one "frame" of
    ``frames * patches`` tokens, so the entries read ``(1, tokens)``.
    """
    frames = config.num_frames if num_frames is None else num_frames
    patches = ((image_size or config.image_size) // config.patch_size) ** 2
    return config.aggregation_settings().token_schedule(frames, patches)


__all__ = [
    "RAW_SCORES",
    "AGGREGATION_DIMS",
    "AGGREGATION_FIELDS",
    "AGGREGATION_STRATEGIES",
    "FRAME_MATCHINGS",
    "REDUCTION_MODES",
    "TestaConfig",
    "TestaVisionConfig",
    "check_choice",
    "per_layer",
    "token_schedule",
    "with_saved_rule",
]
