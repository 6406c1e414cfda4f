"""PyTorch TESTA video encoder: a TimeSformer-style ViT with divided space-time attention whose blocks aggregate
similar frames and similar patches (`aggregation_block`). Split out of the heads as transformers splits
`modeling_blip_text.py` out of `modeling_blip.py`."""

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, can_return_tuple

from .aggregation import attention_received
from .aggregation_block import (
    AggregationSettings,
    AttentionOutput,
    DividedHost,
    JointHost,
    TokenState,
    divided_block,
    initial_state,
    joint_block,
    sequence,
    token_sizes_with_cls,
    weighted_token_mean,
    with_sequence,
)
from .aggregation_settings import AGGREGATION_FIELDS
from .configuration_testa import TestaConfig, TestaVisionConfig
from .saving import TestaHubMixin


@dataclass
class TestaVisionModelOutput(ModelOutput):
    r"""
    Output of [`TestaVisionModel`].

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch, 1 + frames_out * patches_out, hidden_size)`):
            the post-LayerNorm tokens: the video CLS, then the aggregated patch tokens frame by frame (frame-major).
            Frames and patches come in the order the aggregation leaves them (see `aggregation.py`); use
            `source_map` to map them back to input positions.
        pooler_output (`torch.FloatTensor` of shape `(batch, hidden_size)`): the post-LayerNorm CLS token.
        token_sizes (`torch.FloatTensor` of shape `(batch, 1 + frames_out * patches_out)`): how many input patches
            every output token stands for (the CLS counts 1). With merging they sum to `1 + frames * patches`.
        source_map (`torch.LongTensor` of shape `(batch, frames, patches)`, *optional*): with `trace_source`, the
            index of the output patch token (0-based, CLS excluded) that every input patch ended in; -1 where pruned.
        hidden_states (`tuple(torch.FloatTensor)`, *optional*): with `output_hidden_states`, the tokens after the
            embeddings and after every block, `(batch, 1 + frames_i * patches_i, hidden_size)` each (pre-LayerNorm).
        attentions (`tuple(torch.FloatTensor)`, *optional*): with `output_attentions`, one tensor per block, as they
            are (their sizes shrink as tokens merge). Divided blocks: the spatial attention over `[CLS, patches]` of
            every frame, `(batch * frames_i, heads, 1 + patches_i, 1 + patches_i)`, where `frames_i` are the frames
            left after the block's frame merge and `patches_i` the patches before its patch merge (TimeSformer
            returns its spatial attention the same way). Joint mode: `(batch, heads, 1 + tokens_i, 1 + tokens_i)`
            before the block's merge.
        temporal_attentions (`tuple(torch.FloatTensor)`, *optional*): with `output_attentions` and divided blocks,
            one tensor per block: the temporal attention over the frames at every patch position, `(batch *
            patches_i, heads, frames_i, frames_i)`, before the block's frame merge.
    """

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    token_sizes: torch.FloatTensor | None = None
    source_map: torch.LongTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    temporal_attentions: tuple[torch.FloatTensor, ...] | None = None


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention; ``attention_mask`` is an additive float bias. Returns ``(B, N, heads, d)``."""
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class TestaAttention(nn.Module):
    """Multi-head self-attention that also returns the aggregation metric (keys averaged over heads).

    Used for temporal attention (sequences of frames at one patch position), spatial attention (CLS + the patches of
    one frame) and, in joint mode, attention over all space-time tokens.
    """

    def __init__(self, config: TestaVisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.projection = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        with_importance: bool = False,
        output_attentions: bool = False,
    ) -> AttentionOutput:
        """
        Args:
            hidden_states: ``(batch, tokens, hidden)``.
            attention_bias: additive logits bias ``(batch, 1, 1, tokens)`` (proportional attention) or None.
            with_importance: also return Eq. 1's attention received per token, ``(batch, tokens)``.
            output_attentions: also return the attention probabilities (computed by the eager attention, whatever
                the configured implementation, since fused kernels do not return them).
        """
        batch, tokens, hidden = hidden_states.shape
        qkv = self.qkv(hidden_states).view(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        attention_interface = eager_attention_forward
        if not output_attentions:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
        output, weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_bias,
            scaling=self.scaling,
            dropout=self.config.attention_dropout if self.training else 0.0,
        )
        output = self.dropout(self.projection(output.reshape(batch, tokens, hidden)))
        importance = attention_received(query, key, self.scaling, attention_bias) if with_importance else None
        return AttentionOutput(output, key.mean(dim=1), importance, weights if output_attentions else None)


class TestaMLP(nn.Module):
    def __init__(self, config: TestaVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(self.activation_fn(self.fc1(hidden_states)))))


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drops the whole residual branch of random samples."""
    if rate == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - rate)
    return x * keep / (1.0 - rate)


def resize_position_embedding(
    position_embedding: torch.Tensor, grid_height: int, grid_width: int | None = None
) -> torch.Tensor:
    """A ``(1, 1 + side**2, D)`` ViT position embedding for a ``grid_height x grid_width`` patch grid (``grid_width``
    defaults to ``grid_height``): itself for its own grid, else resized bicubically (the CLS entry kept), with the
    same call as BLIP's ``interpolate_pos_encoding`` (the run-time interpolation and the converters' resize)."""
    side = int(math.sqrt(position_embedding.shape[1] - 1))
    if side * side != position_embedding.shape[1] - 1:
        raise ValueError(f"Position embedding of shape {tuple(position_embedding.shape)} is not a square patch grid.")
    grid_width = grid_height if grid_width is None else grid_width
    if (grid_height, grid_width) == (side, side):
        return position_embedding
    grid = position_embedding[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=(grid_height, grid_width), mode="bicubic", align_corners=False)
    grid = grid.to(position_embedding.dtype).permute(0, 2, 3, 1).flatten(1, 2)
    return torch.cat([position_embedding[:, :1], grid], dim=1)


class TestaVisionEmbeddings(nn.Module):
    """Patch embedding, CLS, spatial position embedding and temporal embedding (zero-initialised, TimeSformer)."""

    def __init__(self, config: TestaVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.position_embedding = nn.Parameter(torch.zeros(1, 1 + config.num_patches_per_frame, config.hidden_size))
        self.temporal_embedding = nn.Parameter(torch.zeros(1, config.num_frames, config.hidden_size))

    def spatial_position_embedding(self, grid_height: int, grid_width: int) -> torch.Tensor:
        """``(1, 1 + h * w, D)``; bicubic interpolation of the patch grid when the image size differs."""
        return resize_position_embedding(self.position_embedding, grid_height, grid_width)

    def temporal_position_embedding(self, num_frames: int) -> torch.Tensor:
        """``(1, T, D)``; nearest interpolation (as TimeSformer does) when the frame count differs."""
        temporal = self.temporal_embedding
        if temporal.shape[1] == num_frames:
            return temporal
        resized = F.interpolate(temporal.float().transpose(1, 2), size=num_frames, mode="nearest")
        return resized.transpose(1, 2).to(temporal.dtype)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, C, H, W)`` -> ``cls (B, 1, D)`` and ``patches (B, T, L, D)``. The CLS gets no temporal term."""
        batch, frames = pixel_values.shape[:2]
        weight = self.patch_embedding.weight
        # A fixed memory layout: a channels-last batch (what a batched video processor call can return) would run
        # another convolution kernel, whose last-bit differences flip ties between identical patches when merging.
        frames_in = pixel_values.flatten(0, 1).to(weight.dtype).contiguous()
        patches = self.patch_embedding(frames_in)  # (B*T, D, h, w)
        grid_height, grid_width = patches.shape[-2:]
        patches = patches.flatten(2).transpose(1, 2)
        position = self.spatial_position_embedding(grid_height, grid_width)
        patches = (patches + position[:, 1:]).view(batch, frames, grid_height * grid_width, -1)
        patches = patches + self.temporal_position_embedding(frames).unsqueeze(2)
        cls = (self.class_embedding + position[:, :1]).expand(batch, -1, -1)
        return cls, patches


# How a TESTA block computes the pieces that `aggregation_block` asks of its host.
def _temporal_step(layer: "TestaVisionLayer", tokens, bias, need_importance, need_weights=False) -> AttentionOutput:
    attention = layer.temporal_attention(
        layer.temporal_layer_norm(tokens), bias, with_importance=need_importance, output_attentions=need_weights
    )
    residual = layer.temporal_fc(drop_path(attention.output, layer.drop_path_rate, layer.training))
    return attention._replace(output=residual)


def _spatial_step(layer: "TestaVisionLayer", tokens, bias, need_importance, need_weights=False) -> AttentionOutput:
    attention = layer.self_attn(
        layer.layer_norm1(tokens), bias, with_importance=need_importance, output_attentions=need_weights
    )
    return attention._replace(output=drop_path(attention.output, layer.drop_path_rate, layer.training))


def _mlp_residual(layer: "TestaVisionLayer", tokens: torch.Tensor) -> torch.Tensor:
    return tokens + drop_path(layer.mlp(layer.layer_norm2(tokens)), layer.drop_path_rate, layer.training)


TESTA_DIVIDED_HOST = DividedHost(temporal=_temporal_step, spatial=_spatial_step, mlp_residual=_mlp_residual)
TESTA_JOINT_HOST = JointHost(
    attention=_spatial_step, attention_residual=lambda layer, tokens, output: tokens + output, mlp_residual=_mlp_residual
)


class TestaVisionLayer(GradientCheckpointingLayer):
    """One block of the encoder: divided space-time attention with TESTA's frame and patch aggregation (see
    `aggregation_block.divided_block` for the order of the steps), or, with ``aggregation_dims="joint"``, a joint
    space-time ViT block with ToMe-style merging over all tokens (`aggregation_block.joint_block`). The layer holds
    the weights; the block function owns matching, merging, sizes and sources."""

    def __init__(self, config: TestaVisionConfig, layer_index: int, drop_path_rate: float):
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.drop_path_rate = drop_path_rate
        self.temporal_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.temporal_attention = TestaAttention(config)
        self.temporal_fc = nn.Linear(config.hidden_size, config.hidden_size)
        self.temporal_fc.zero_init = True  # read by _init_weights: a fresh block equals the image ViT block
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = TestaAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = TestaMLP(config)

    def forward(
        self,
        cls: torch.Tensor | None,
        patches: torch.Tensor,
        sizes: torch.Tensor,
        source_map: torch.Tensor | None,
        merged: bool,
        settings: AggregationSettings,
        attentions: list | None = None,
        fused_kernels: str = "auto",
    ) -> tuple:
        """Takes and returns the fields of a `TokenState` as a plain tuple of positional values: gradient
        checkpointing with `use_reentrant=True` only carries gradients through positional tensors, and returns
        tuples. ``fused_kernels``: the runtime's option (`fused_aggregation.FUSED_KERNELS`)."""
        state = TokenState(cls, patches, sizes, source_map, merged)
        block = joint_block if settings.aggregation_dims == "joint" else divided_block
        host = TESTA_JOINT_HOST if settings.aggregation_dims == "joint" else TESTA_DIVIDED_HOST
        return tuple(block(host, self, settings, self.layer_index, state, attentions, fused_kernels))


@torch.no_grad()
def initialise_missing_ties(model: PreTrainedModel, missing: set[str]) -> None:
    """Initialises the modules of `model` holding a tie of which the checkpoint had neither side (`missing`: the
    keys it lacked; a QA head's answer decoder started from a retrieval folder): transformers marks tied weights as
    loaded and skips them, so such a weight (the decoder's output bias) would keep uninitialised memory (NaN
    losses)."""
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in missing and source in missing:
            owner = model.get_submodule(source.rpartition(".")[0])
            for flagged in (owner, *owner.parameters(recurse=False)):
                flagged._is_hf_initialized = False
            model._init_weights(owner)


class TestaPreTrainedModel(TestaHubMixin, PreTrainedModel):
    config: TestaConfig
    base_model_prefix = "testa"
    main_input_name = "pixel_values"
    input_modalities = ("video", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["TestaVisionLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    weights_missing_at_load: tuple[str, ...] = ()
    """The weights `from_pretrained` did not find in the checkpoint (left at their initialisation, which
    transformers only logs); empty for a model built in memory. The pipelines refuse a model that lacks any."""

    @classmethod
    def from_pretrained(cls, *args: Any, output_loading_info: bool = False, **kwargs: Any) -> Any:
        """`PreTrainedModel.from_pretrained`, recording the weights the checkpoint lacked on the model
        (`weights_missing_at_load`), so that a folder of another head (a retrieval folder has no answer decoder) is
        refused where it is used rather than answering from random weights."""
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        model.weights_missing_at_load = tuple(sorted(info["missing_keys"]))
        initialise_missing_ties(model, set(info["missing_keys"]))
        return (model, info) if output_loading_info else model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """TimeSformer/ViT init; ``temporal_fc`` and the temporal embedding start at zero, so that a fresh encoder is
        the image ViT applied to every frame. Runs after meta-device loading, for missing weights only."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            if getattr(module, "zero_init", False):
                init.zeros_(module.weight)
            else:
                init.trunc_normal_(module.weight, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=std)
        if isinstance(module, TestaVisionEmbeddings):
            init.trunc_normal_(module.class_embedding, std=std)
            init.trunc_normal_(module.position_embedding, std=std)
            init.zeros_(module.temporal_embedding)


def pool_video_tokens(video_embeds: torch.Tensor, token_sizes: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """The ``(batch, hidden)`` summary of the encoder's output tokens that a contrastive head projects
    (``config.video_pooling``): the plain mean over all tokens (``"mean"``, what the released checkpoints use), the
    mean weighted by the patches each token stands for (``"weighted_mean"``, needs ``token_sizes``), or the CLS token
    (``"cls"``)."""
    if pooling == "cls":
        return video_embeds[:, 0]
    if pooling == "weighted_mean":
        if token_sizes is None:
            raise ValueError("`video_pooling='weighted_mean'` needs the token sizes (`video_token_sizes`).")
        return weighted_token_mean(video_embeds, token_sizes)
    return video_embeds.mean(dim=1)


class TestaVisionModel(TestaPreTrainedModel):
    """The TESTA video encoder: ``pixel_values (batch, frames, channels, height, width)`` -> aggregated tokens."""

    config: TestaVisionConfig
    input_modalities = ("video",)
    runtime = None
    """What runs `forward` (a `testa_runtimes` runtime), set by `optimize_for_inference`; `None`: `eager_forward`."""

    def __init__(self, config: TestaVisionConfig):
        super().__init__(config)
        self.config = config
        self.embeddings = TestaVisionEmbeddings(config)
        last = max(config.num_hidden_layers - 1, 1)
        rates = [config.drop_path_rate * index / last for index in range(config.num_hidden_layers)]  # linear decay
        self.layers = nn.ModuleList(
            [TestaVisionLayer(config, index, rate) for index, rate in enumerate(rates)]
        )
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    def set_aggregation(self, **settings) -> None:
        """Changes aggregation settings in place (e.g. ``temporal_reduction=0, spatial_reduction=0`` to evaluate the
        same weights without aggregation). Accepts any `TestaVisionConfig` aggregation field; validates like the
        config does and leaves the model unchanged on error."""
        allowed = set(AGGREGATION_FIELDS)
        unknown = set(settings) - allowed
        if unknown:
            raise ValueError(f"set_aggregation() got {sorted(unknown)}; allowed settings are {sorted(allowed)}.")
        type(self.config)(**{**self.config.to_dict(), **settings})  # validates
        for name, value in settings.items():
            setattr(self.config, name, value)

    def aggregation_settings(self, trace_source: bool | None = None) -> AggregationSettings:
        """The settings the blocks run with (from the config; ``trace_source`` overrides the config's)."""
        settings = self.config.aggregation_settings()
        if trace_source is not None:
            settings = replace(settings, trace_source=bool(trace_source))
        return settings

    def check_pixel_values(self, pixel_values: torch.Tensor) -> None:
        """Raises a `TypeError`/`ValueError` naming the expected shape unless ``pixel_values`` is a batch of videos
        ``(batch, frames, channels, height, width)`` with sides that are multiples of the patch size."""
        config = self.config
        expected = f"(batch, frames, {config.num_channels}, height, width) with height and width multiples of {config.patch_size}"
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"`pixel_values` must be a torch.Tensor of shape {expected}; got {type(pixel_values)}.")
        shape = tuple(pixel_values.shape)
        if pixel_values.ndim != 5 or shape[2] != config.num_channels:
            hint = " (a single video needs a batch axis: pixel_values[None])" if pixel_values.ndim == 4 else ""
            raise ValueError(f"`pixel_values` must have shape {expected}; got {shape}{hint}.")
        if shape[0] == 0 or shape[1] == 0 or shape[3] % config.patch_size or shape[4] % config.patch_size or shape[3] == 0 or shape[4] == 0:
            raise ValueError(f"`pixel_values` must have shape {expected}; got {shape}.")

    def run_blocks(
        self,
        pixel_values: torch.Tensor,
        settings: AggregationSettings,
        last_layer: int | None = None,
        hidden_states: list | None = None,
        attentions: list | None = None,
        fused_kernels: str = "auto",
    ) -> TokenState:
        """Embeds ``pixel_values`` and runs blocks ``0 .. last_layer`` (all by default); returns the tokens before
        the final LayerNorm. With a ``hidden_states`` list, the sequence after the embeddings and after every block
        is appended to it; with an ``attentions`` list, every block's ``(temporal or None, spatial or joint)``
        attention probabilities. ``fused_kernels``: when the merges run as fused GPU kernels, the runtime's option
        (`fused_aggregation.FUSED_KERNELS`; ``"auto"``: on CUDA at inference)."""
        self.check_pixel_values(pixel_values)
        cls, patches = self.embeddings(pixel_values)
        state = initial_state(cls, patches, settings)
        layers = self.layers if last_layer is None else self.layers[: last_layer + 1]
        for index in range(len(layers) + 1):
            if hidden_states is not None:  # the returned tensors are the ones the next block reads
                hidden_states.append(sequence(state))
                state = with_sequence(state, hidden_states[-1])
            if index < len(layers):
                state = TokenState(*layers[index](*state, settings, attentions, fused_kernels))
        return state

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        trace_source: bool | None = None,
        **kwargs,
    ) -> TestaVisionModelOutput:
        r"""
        Args:
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`): the video frames,
                normalised (see `TestaVideoProcessor`). Any frame count and any size that is a multiple of the patch
                size work; the embeddings are interpolated.
            output_hidden_states (`bool`, *optional*): return the tokens after every block.
            output_attentions (`bool`, *optional*): return every block's attention probabilities (see
                `TestaVisionModelOutput` for their shapes); they are computed by the eager attention.
            trace_source (`bool`, *optional*): return `source_map` (defaults to `config.trace_source`).

        After `optimize_for_inference`, the call goes to the model's `runtime` (OpenVINO, CUDA graphs, ...).
        """
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if self.runtime is not None:
            return self.runtime(pixel_values, output_hidden_states=bool(output_hidden_states),
                                output_attentions=bool(output_attentions), trace_source=trace_source)
        return self.eager_forward(pixel_values, output_hidden_states, output_attentions, trace_source)

    def eager_forward(self, pixel_values: torch.Tensor, output_hidden_states: bool = False,
                      output_attentions: bool = False, trace_source: bool | None = None,
                      fused_kernels: str = "auto") -> TestaVisionModelOutput:
        """The forward as PyTorch runs it, module by module (what `forward` does without a `runtime`;
        ``fused_kernels``: `run_blocks`)."""
        all_hidden_states = [] if output_hidden_states else None
        attentions = [] if output_attentions else None
        state = self.run_blocks(pixel_values, self.aggregation_settings(trace_source), hidden_states=all_hidden_states,
                                attentions=attentions, fused_kernels=fused_kernels)
        last_hidden_state = self.post_layernorm(sequence(state))
        divided = self.config.aggregation_dims != "joint"
        return TestaVisionModelOutput(
            last_hidden_state=last_hidden_state,
            pooler_output=last_hidden_state[:, 0],
            token_sizes=token_sizes_with_cls(state),
            source_map=state.source_map,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            attentions=tuple(spatial for _, spatial in attentions) if output_attentions else None,
            temporal_attentions=tuple(t for t, _ in attentions) if output_attentions and divided else None,
        )


__all__ = [
    "TestaAttention",
    "TestaPreTrainedModel",
    "TestaVisionEmbeddings",
    "TestaVisionLayer",
    "TestaVisionModel",
    "TestaVisionModelOutput",
    "drop_path",
    "eager_attention_forward",
    "pool_video_tokens",
    "resize_position_embedding",
]
