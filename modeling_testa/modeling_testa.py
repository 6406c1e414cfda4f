"""PyTorch TESTA: a TimeSformer-style video encoder with temporal-spatial token aggregation, and its heads."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, can_return_tuple

from .aggregation import (
    Matching,
    attention_received,
    capped_reduction,
    geometry_matching,
    importance_matching,
    merge_tokens,
    output_slot_of_inputs,
    shift_protected,
)
from .configuration_testa import TestaConfig, TestaVisionConfig, token_schedule  # noqa: F401 (re-exported)
from .saving_testa import TestaHubMixin


# ----------------------------------------------------------------------------------------------------------------------
# Token bookkeeping
# ----------------------------------------------------------------------------------------------------------------------


def _follow_frame_merge(source_map: torch.Tensor, frame_slots: torch.Tensor, patches: int) -> torch.Tensor:
    """Updates ``source_map`` (``(B, T0, L0)`` flat ``t * patches + l`` indices, -1 = pruned) after a frame merge."""
    batch = source_map.shape[0]
    valid = source_map >= 0
    flat = source_map.clamp(min=0)
    frame, patch = flat // patches, flat % patches
    new_frame = frame_slots.gather(1, frame.view(batch, -1)).view_as(frame)
    new = new_frame * patches + patch
    return torch.where(valid & (new_frame >= 0), new, -1)


def _follow_patch_merge(
    source_map: torch.Tensor, patch_slots: torch.Tensor, patches_in: int, patches_out: int
) -> torch.Tensor:
    """Updates ``source_map`` after a per-frame patch merge; ``patch_slots`` is ``(B, T, patches_in)``."""
    batch = source_map.shape[0]
    valid = source_map >= 0
    flat = source_map.clamp(min=0)
    frame = flat // patches_in
    new_patch = patch_slots.view(batch, -1).gather(1, flat.view(batch, -1)).view_as(flat)
    new = frame * patches_out + new_patch
    return torch.where(valid & (new_patch >= 0), new, -1)


# ----------------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------------


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
    """

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    token_sizes: torch.FloatTensor | None = None
    source_map: torch.LongTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


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
        self, hidden_states: torch.Tensor, attention_bias: torch.Tensor | None = None, with_importance: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: ``(batch, tokens, hidden)``.
            attention_bias: additive logits bias ``(batch, 1, 1, tokens)`` (proportional attention) or None.
            with_importance: also return Eq. 1's attention received per token, ``(batch, tokens)``.

        Returns:
            ``(output, keys averaged over heads (batch, tokens, head_dim), importance or None)``.
        """
        batch, tokens, hidden = hidden_states.shape
        qkv = self.qkv(hidden_states).view(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention_interface(
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
        return output, key.mean(dim=1), importance


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
        position = self.position_embedding
        side = int(math.sqrt(position.shape[1] - 1))
        if (grid_height, grid_width) == (side, side):
            return position
        grid = position[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid.float(), size=(grid_height, grid_width), mode="bicubic", align_corners=False)
        grid = grid.to(position.dtype).permute(0, 2, 3, 1).flatten(1, 2)
        return torch.cat([position[:, :1], grid], dim=1)

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


class TestaVisionLayer(GradientCheckpointingLayer):
    """One divided space-time block with TESTA's two aggregation steps, in the original order:

    1. temporal attention over the frames at every patch position, then ``temporal_fc`` (zero-initialised);
    2. frame aggregation (R_T frames, all patch positions together);
    3. spatial attention over ``[CLS, patches]`` of every frame; the per-frame CLS outputs are averaged;
    4. patch aggregation (R_S patches within every frame; CLS protected);
    5. MLP.

    With ``aggregation_dims="joint"`` the block is a plain joint space-time ViT block with ToMe-style merging over
    all tokens between attention and MLP; the patch tensor is then ``(B, 1, N, D)``.
    """

    def __init__(self, config: TestaVisionConfig, layer_index: int, drop_path_rate: float):
        super().__init__()
        self.config = config
        self.temporal_reduction = config.temporal_reduction_per_layer[layer_index]
        self.spatial_reduction = config.spatial_reduction_per_layer[layer_index]
        self.drop_path_rate = drop_path_rate
        self.temporal_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.temporal_attention = TestaAttention(config)
        self.temporal_fc = nn.Linear(config.hidden_size, config.hidden_size)
        self.temporal_fc.zero_init = True  # read by _init_weights: a fresh block equals the image ViT block
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = TestaAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = TestaMLP(config)

    def _uses_importance(self) -> bool:
        return self.config.aggregation_strategy == "importance" or self.config.reduction_mode == "prune"

    def _match(
        self, metric: torch.Tensor, importance: torch.Tensor | None, r: int, protect_first: bool, vote_dim=None
    ) -> Matching:
        vote = self.config.frame_matching if vote_dim is not None else "vote"
        if not self._uses_importance():
            return geometry_matching(metric, r, protect_first=protect_first, vote_dim=vote_dim, vote=vote)
        prune = self.config.reduction_mode == "prune"
        return importance_matching(
            metric, importance, r, protect_first=protect_first, vote_dim=vote_dim, prune=prune, vote=vote
        )

    def _size_bias(self, sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Proportional attention: ``log(size)`` added to the logits of every key, ``(batch, 1, 1, keys)``."""
        if not self.config.proportional_attention:
            return None
        return sizes.log().to(dtype)[:, None, None, :]

    def forward(
        self,
        cls: torch.Tensor,
        patches: torch.Tensor,
        sizes: torch.Tensor,
        source_map: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """
        Args:
            cls: ``(B, 1, D)``. patches: ``(B, T, L, D)``. sizes: ``(B, T, L)`` input patches per token.
            source_map: ``(B, T0, L0)`` current token index of every input patch, when tracing.
        """
        if self.config.aggregation_dims == "joint":
            return self._joint_forward(cls, patches, sizes, source_map)
        batch, frames, patches_per_frame, hidden = patches.shape
        rate, training = self.drop_path_rate, self.training

        # 1. Temporal attention: every patch position attends over the frames (CLS excluded, as in TimeSformer).
        frame_reduction = capped_reduction(self.temporal_reduction, frames, protected=1)
        temporal_in = patches.transpose(1, 2).reshape(batch * patches_per_frame, frames, hidden)
        temporal_sizes = sizes.transpose(1, 2).reshape(batch * patches_per_frame, frames)
        residual, keys, importance = self.temporal_attention(
            self.temporal_layer_norm(temporal_in),
            self._size_bias(temporal_sizes, patches.dtype),
            with_importance=frame_reduction > 0 and self._uses_importance(),
        )
        residual = self.temporal_fc(drop_path(residual, rate, training))
        patches = patches + residual.view(batch, patches_per_frame, frames, hidden).transpose(1, 2)

        # 2. Frame aggregation: whole frames merge, every patch position with its own size weight.
        if frame_reduction > 0:
            keys = keys.view(batch, patches_per_frame, frames, -1)
            if self.config.frame_matching == "mean":
                metric, vote_dim = keys.mean(dim=1), None  # the paper's frame token
            else:  # "vote" / "original": every patch position compares the frames, then the positions decide
                metric, vote_dim = keys, -3
            if importance is not None:
                importance = importance.view(batch, patches_per_frame, frames).mean(dim=1)
            matching = self._match(metric, importance, frame_reduction, protect_first=False, vote_dim=vote_dim)
            patches, sizes = merge_tokens(patches, sizes, matching)
            frames = patches.shape[1]
            if source_map is not None:
                slots = output_slot_of_inputs(matching, matching.kept.shape[-1] + frame_reduction)
                source_map = _follow_frame_merge(source_map, slots, patches_per_frame)

        # 3. Spatial attention over [CLS, patches] of every frame; the CLS outputs are averaged over frames.
        patch_reduction = capped_reduction(self.spatial_reduction, patches_per_frame + 1, protected=1)
        spatial_in = torch.cat([cls.unsqueeze(1).expand(-1, frames, -1, -1), patches], dim=2)
        spatial_in = spatial_in.view(batch * frames, patches_per_frame + 1, hidden)
        spatial_sizes = F.pad(sizes, (1, 0), value=1.0).view(batch * frames, patches_per_frame + 1)
        residual, keys, importance = self.self_attn(
            self.layer_norm1(spatial_in),
            self._size_bias(spatial_sizes, patches.dtype),
            with_importance=patch_reduction > 0 and self._uses_importance(),
        )
        residual = drop_path(residual, rate, training).view(batch, frames, patches_per_frame + 1, hidden)
        cls = cls + residual[:, :, 0].mean(dim=1, keepdim=True)
        patches = patches + residual[:, :, 1:]

        # 4. Patch aggregation within every frame (CLS takes part in the split but is protected).
        if patch_reduction > 0:
            keys = keys.view(batch, frames, patches_per_frame + 1, -1)
            if importance is not None:
                importance = importance.view(batch, frames, patches_per_frame + 1)
            matching = shift_protected(self._match(keys, importance, patch_reduction, protect_first=True))
            patches, sizes = merge_tokens(patches, sizes, matching)
            if source_map is not None:
                slots = output_slot_of_inputs(matching, patches_per_frame)
                source_map = _follow_patch_merge(source_map, slots, patches_per_frame, patches.shape[2])
            patches_per_frame = patches.shape[2]

        # 5. MLP over all tokens.
        tokens = torch.cat([cls, patches.flatten(1, 2)], dim=1)
        tokens = tokens + drop_path(self.mlp(self.layer_norm2(tokens)), rate, training)
        cls, patches = tokens[:, :1], tokens[:, 1:].view(batch, frames, patches_per_frame, hidden)
        return cls, patches, sizes, source_map

    def _joint_forward(self, cls, patches, sizes, source_map):
        """Joint space-time attention over ``[CLS, all tokens]`` with ToMe merging (``patches`` is ``(B, 1, N, D)``)."""
        batch, _, num_tokens, hidden = patches.shape
        rate, training = self.drop_path_rate, self.training
        tokens = torch.cat([cls, patches[:, 0]], dim=1)
        token_sizes = F.pad(sizes[:, 0], (1, 0), value=1.0)
        reduction = capped_reduction(self.spatial_reduction, num_tokens + 1, protected=1)
        residual, keys, importance = self.self_attn(
            self.layer_norm1(tokens),
            self._size_bias(token_sizes, tokens.dtype),
            with_importance=reduction > 0 and self._uses_importance(),
        )
        tokens = tokens + drop_path(residual, rate, training)
        if reduction > 0:
            matching = self._match(keys, importance, reduction, protect_first=True)
            tokens, token_sizes = merge_tokens(tokens, token_sizes, matching)
            if source_map is not None:
                slots = output_slot_of_inputs(matching, num_tokens + 1)[:, 1:] - 1  # drop CLS; pruned stay < 0
                source_map = _follow_patch_merge(source_map, slots.unsqueeze(1), num_tokens, tokens.shape[1] - 1)
        tokens = tokens + drop_path(self.mlp(self.layer_norm2(tokens)), rate, training)
        cls, patches = tokens[:, :1], tokens[:, 1:].unsqueeze(1)
        return cls, patches, token_sizes[:, 1:].unsqueeze(1), source_map


# ----------------------------------------------------------------------------------------------------------------------
# Pre-trained models
# ----------------------------------------------------------------------------------------------------------------------


class TestaPreTrainedModel(TestaHubMixin, PreTrainedModel):
    config: TestaConfig
    base_model_prefix = "testa"
    main_input_name = "pixel_values"
    input_modalities = ("video", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["TestaVisionLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

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


class TestaVisionModel(TestaPreTrainedModel):
    """The TESTA video encoder: ``pixel_values (batch, frames, channels, height, width)`` -> aggregated tokens."""

    config: TestaVisionConfig
    input_modalities = ("video",)

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
        allowed = {
            "temporal_reduction", "spatial_reduction", "aggregation_strategy", "reduction_mode", "aggregation_dims",
            "frame_matching", "proportional_attention", "trace_source",
        }
        unknown = set(settings) - allowed
        if unknown:
            raise ValueError(f"set_aggregation() got {sorted(unknown)}; allowed settings are {sorted(allowed)}.")
        candidate = type(self.config)(**{**self.config.to_dict(), **settings})
        for name, value in settings.items():
            setattr(self.config, name, value)
        for layer, r_t, r_s in zip(
            self.layers, candidate.temporal_reduction_per_layer, candidate.spatial_reduction_per_layer
        ):
            layer.temporal_reduction, layer.spatial_reduction = r_t, r_s

    def _check_pixel_values(self, pixel_values: torch.Tensor) -> None:
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

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor,
        output_hidden_states: bool | None = None,
        trace_source: bool | None = None,
        **kwargs,
    ) -> TestaVisionModelOutput:
        r"""
        Args:
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`): the video frames,
                normalised (see `TestaVideoProcessor`). Any frame count and any size that is a multiple of the patch
                size work; the embeddings are interpolated.
            output_hidden_states (`bool`, *optional*): return the tokens after every block.
            trace_source (`bool`, *optional*): return `source_map` (defaults to `config.trace_source`).
        """
        self._check_pixel_values(pixel_values)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        trace_source = self.config.trace_source if trace_source is None else trace_source
        cls, patches = self.embeddings(pixel_values)
        batch, frames, patches_per_frame, hidden = patches.shape
        if self.config.aggregation_dims == "joint":
            patches = patches.reshape(batch, 1, frames * patches_per_frame, hidden)
        # sizes stay at least fp32 (exact integers for merge weights) and follow a float64 model
        sizes = patches.new_ones(patches.shape[:3], dtype=torch.promote_types(patches.dtype, torch.float32))
        source_map = None
        if trace_source:
            source_map = torch.arange(frames * patches_per_frame, device=patches.device)
            source_map = source_map.view(1, frames, patches_per_frame).expand(batch, -1, -1).contiguous()

        all_hidden_states = (torch.cat([cls, patches.flatten(1, 2)], dim=1),) if output_hidden_states else None
        for layer in self.layers:
            cls, patches, sizes, source_map = layer(cls, patches, sizes, source_map)
            if output_hidden_states:
                all_hidden_states += (torch.cat([cls, patches.flatten(1, 2)], dim=1),)

        last_hidden_state = self.post_layernorm(torch.cat([cls, patches.flatten(1, 2)], dim=1))
        token_sizes = F.pad(sizes.flatten(1), (1, 0), value=1.0)
        return TestaVisionModelOutput(
            last_hidden_state=last_hidden_state,
            pooler_output=last_hidden_state[:, 0],
            token_sizes=token_sizes,
            source_map=source_map,
            hidden_states=all_hidden_states,
        )


# ----------------------------------------------------------------------------------------------------------------------
# Video-language heads: retrieval (VTC + VTM), video QA and pre-training (VTC + VTM + CAP)
# ----------------------------------------------------------------------------------------------------------------------
# These imports live here, next to the heads that use them, so that the encoder code above stays untouched.

import torch.distributed as dist  # noqa: E402
from transformers.generation import GenerationConfig, GenerationMixin  # noqa: E402
from transformers.models.blip.modeling_blip_text import (  # noqa: E402
    BlipTextEmbeddings,
    BlipTextLMHeadModel,
    BlipTextModel,
)


class TestaGenerationConfig(GenerationConfig):
    """`GenerationConfig` of the generative TESTA heads. `TestaConfig.temperature` is the contrastive temperature, not a
    sampling one, so it is not copied into the generation config (which would make sampled answers far too greedy)."""

    @classmethod
    def from_model_config(cls, model_config) -> GenerationConfig:
        config_dict = model_config.to_dict() if not isinstance(model_config, dict) else dict(model_config)
        config_dict.pop("temperature", None)
        return super().from_model_config(config_dict)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if _world_size() > 1 else 0


def _check_same_shape_on_all_ranks(tensor: torch.Tensor, name: str, dims: tuple[int, ...]) -> None:
    """Raises a `ValueError` (on every rank) when ``tensor.shape[d]`` for ``d in dims`` differs between processes."""
    if _world_size() == 1:
        return
    local = torch.tensor([tensor.shape[d] for d in dims], device=tensor.device, dtype=torch.long)
    shapes = [torch.empty_like(local) for _ in range(_world_size())]
    dist.all_gather(shapes, local)
    if any(not torch.equal(s, local) for s in shapes):
        raise ValueError(
            f"`{name}` must have the same size along dims {dims} on every process to be gathered for the global "
            f"contrastive/matching losses; got {[s.tolist() for s in shapes]}. Use the same per-process batch size "
            "and number of frames on every process."
        )


def raise_on_every_rank(error: Exception | None, device: torch.device | None = None) -> None:
    """Collective (every process must call it at the same point): if any process passes an error, every process
    raises, so that no process is left waiting in the next collective. The failing process raises its own error; the
    others raise a `RuntimeError` that quotes it."""
    if _world_size() == 1:
        if error is not None:
            raise error
        return
    flags = torch.zeros(_world_size(), dtype=torch.long, device=device)
    flags[_rank()] = int(error is not None)
    dist.all_reduce(flags)
    if not bool(flags.any()):
        return
    messages = [None] * _world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = {rank: message for rank, message in enumerate(messages) if message is not None}
    raise RuntimeError(f"another process raised, so every process stops: {failed}")


@torch.no_grad()
def _gather_without_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates ``tensor`` from all processes along dim 0 (rank order); no gradient flows back."""
    if _world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def _gather_padded(tensor: torch.Tensor, pad_value: int) -> torch.Tensor:
    """Like `_gather_without_grad` for ``(batch, length)`` tensors whose length may differ between processes: every
    process's tensor is right-padded with ``pad_value`` to the longest one first."""
    if _world_size() == 1:
        return tensor
    length = _gather_without_grad(torch.tensor([tensor.shape[1]], device=tensor.device))
    tensor = F.pad(tensor, (0, int(length.max()) - tensor.shape[1]), value=pad_value)
    return _gather_without_grad(tensor)


class _AllGatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 that lets gradients flow back to every process's slice (BLIP's ``GatherLayer``).

    Each process's loss only sees its own rows, so the gradient of the summed losses with respect to the local slice
    is the sum over processes of the gradients they computed for it: backward all-reduces and keeps the local part.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        ctx.batch = tensor.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.batch
        return grad[start : start + ctx.batch]


def _gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if _world_size() == 1 else _AllGatherWithGrad.apply(tensor)


def _with_first_token(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
    """A copy of ``input_ids`` whose first token is ``token_id`` ([ENC] or [DEC]), as in the original code."""
    input_ids = input_ids.clone()
    input_ids[:, 0] = token_id
    return input_ids


def _check_ids(input_ids: torch.Tensor, name: str = "input_ids") -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"`{name}` must be a (batch, sequence_length) tensor of token ids, got {shape}.")


def _sequence_nll(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-sequence sum of the (label-smoothed) next-token cross-entropy of ``input_ids`` under ``logits``.

    Position 0 ([DEC]) is never predicted; padding (``attention_mask == 0``, or ``pad_token_id`` without a mask) is
    ignored. With ``label_smoothing=0`` this is minus the log-likelihood of the sequence.
    """
    targets = input_ids[:, 1:]
    valid = attention_mask[:, 1:].bool() if attention_mask is not None else targets.ne(pad_token_id)
    targets = targets.masked_fill(~valid, -100)
    loss = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, reduction="none", label_smoothing=label_smoothing
    )
    return loss.sum(dim=1)


@dataclass
class TestaVideoTextRetrievalOutput(ModelOutput):
    r"""
    Output of [`TestaForVideoTextRetrieval`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): with `return_loss=True`, `loss_vtc + loss_vtm`.
        loss_vtc (`torch.FloatTensor` of shape `()`, *optional*): video-text contrastive loss (momentum distillation,
            queue, positives by `video_ids`).
        loss_vtm (`torch.FloatTensor` of shape `()`, *optional*): video-text matching loss with hard negatives.
        itm_score (`torch.FloatTensor`): with `use_itm_head=True`, the `(batch, 2)` matching logits (index 1 = match)
            of each `(input_ids[i], pixel_values[i])` pair; otherwise the `(num_videos, num_texts)` cosine similarity.
        video_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`): the aggregated video tokens.
        video_token_sizes (`torch.FloatTensor` of shape `(batch, tokens)`): input patches per video token.
        question_embeds (`torch.FloatTensor` of shape `(batch, sequence_length, hidden_size)`): the text encoder
            output (video-grounded with the ITM head, unimodal otherwise), as in BLIP.
        negative_video_indices (`torch.LongTensor` of shape `(batch,)`, *optional*): with a loss, the hard negative
            video drawn for every text, as an index into the batch gathered over all processes.
        negative_text_indices (`torch.LongTensor` of shape `(batch,)`, *optional*): the same for the texts.
        vision_hidden_states (`tuple(torch.FloatTensor)`, *optional*): the video encoder's hidden states.
    """

    loss: torch.FloatTensor | None = None
    loss_vtc: torch.FloatTensor | None = None
    loss_vtm: torch.FloatTensor | None = None
    itm_score: torch.FloatTensor | None = None
    video_embeds: torch.FloatTensor | None = None
    video_token_sizes: torch.FloatTensor | None = None
    question_embeds: torch.FloatTensor | None = None
    negative_video_indices: torch.LongTensor | None = None
    negative_text_indices: torch.LongTensor | None = None
    vision_hidden_states: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class TestaRankingOutput(ModelOutput):
    r"""
    Output of the two-stage `rank_videos` / `rank_texts`.

    Args:
        scores (`torch.FloatTensor` of shape `(num_queries, num_candidates)`): the final scores. Re-ranked candidates
            hold the ITM score (plus the cosine by default); all others hold `-inf`.
        similarity (`torch.FloatTensor` of shape `(num_queries, num_candidates)`): first-stage cosine similarity.
        topk_indices (`torch.LongTensor` of shape `(num_queries, k)`): the candidates re-ranked per query, by
            decreasing cosine.
        topk_scores (`torch.FloatTensor` of shape `(num_queries, k)`): their final scores.
    """

    scores: torch.FloatTensor | None = None
    similarity: torch.FloatTensor | None = None
    topk_indices: torch.LongTensor | None = None
    topk_scores: torch.FloatTensor | None = None


@dataclass
class TestaVideoQAOutput(ModelOutput):
    r"""
    Output of [`TestaForVideoQA`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): with `labels`, `sum(answer_weights * answer_loss) /
            num_questions`, the original objective.
        answer_loss (`torch.FloatTensor` of shape `(num_answers,)`, *optional*): label-smoothed LM loss of every
            answer, summed over its tokens.
        logits (`torch.FloatTensor` of shape `(num_answers, answer_length, vocab_size)`): decoder logits.
        question_embeds (`torch.FloatTensor` of shape `(batch, question_length, hidden_size)`): the video-grounded
            question states the decoder attends to.
        video_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`): the aggregated video tokens.
    """

    loss: torch.FloatTensor | None = None
    answer_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    question_embeds: torch.FloatTensor | None = None
    video_embeds: torch.FloatTensor | None = None


@dataclass
class TestaAnswerRankingOutput(ModelOutput):
    r"""
    Output of [`TestaForVideoQA.rank_answers`].

    Args:
        answer_indices (`torch.LongTensor` of shape `(batch,)`): the chosen answer (an index into the candidate list).
        topk_indices (`torch.LongTensor` of shape `(batch, k)`): the `k` candidates with the most probable first token.
        topk_log_likelihoods (`torch.FloatTensor` of shape `(batch, k)`): their teacher-forced log-likelihoods (minus
            the label-smoothed loss when `label_smoothing > 0`, as in the original).
        first_token_probs (`torch.FloatTensor` of shape `(batch, k)`): the first-token probabilities used to pick them.
    """

    answer_indices: torch.LongTensor | None = None
    topk_indices: torch.LongTensor | None = None
    topk_log_likelihoods: torch.FloatTensor | None = None
    first_token_probs: torch.FloatTensor | None = None


@dataclass
class TestaPreTrainingOutput(ModelOutput):
    r"""
    Output of [`TestaForPreTraining`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): `loss_vtc + loss_vtm + loss_cap`.
        loss_vtc, loss_vtm (`torch.FloatTensor` of shape `()`, *optional*): as in [`TestaVideoTextRetrievalOutput`].
        loss_cap (`torch.FloatTensor` of shape `()`, *optional*): label-smoothed captioning loss, mean over tokens.
        caption_logits (`torch.FloatTensor` of shape `(batch, sequence_length, vocab_size)`): decoder logits.
        itm_score (`torch.FloatTensor` of shape `(batch, 2)`): matching logits of the positive pairs.
        video_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`): the aggregated video tokens.
        negative_video_indices, negative_text_indices (`torch.LongTensor` of shape `(batch,)`, *optional*): as in
            [`TestaVideoTextRetrievalOutput`].
    """

    loss: torch.FloatTensor | None = None
    loss_vtc: torch.FloatTensor | None = None
    loss_vtm: torch.FloatTensor | None = None
    loss_cap: torch.FloatTensor | None = None
    caption_logits: torch.FloatTensor | None = None
    itm_score: torch.FloatTensor | None = None
    video_embeds: torch.FloatTensor | None = None
    negative_video_indices: torch.LongTensor | None = None
    negative_text_indices: torch.LongTensor | None = None


class _TestaMultimodalPreTrainedModel(TestaPreTrainedModel):
    """Base of the heads with BLIP text modules: video input handling and the extra initialisation they need."""

    config: TestaConfig
    _no_split_modules = ["TestaVisionLayer", "BlipTextLayer", "BlipTextEmbeddings"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BlipTextEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
        if isinstance(module, _TestaContrastiveMixin):
            module._init_training_state()

    def _video_inputs(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Accepts videos ``(B, T, C, H, W)``, or images ``(B, C, H, W)`` that become static videos of
        ``vision_config.num_frames`` repeated frames (how the original pre-trains on image-text pairs)."""
        if isinstance(pixel_values, torch.Tensor) and pixel_values.ndim == 4:
            frames = self.config.vision_config.num_frames
            pixel_values = pixel_values.unsqueeze(1).expand(-1, frames, -1, -1, -1)
        return pixel_values

    def set_aggregation(self, **settings) -> None:
        """Changes the aggregation settings (`TestaVisionModel.set_aggregation`) of the video encoder **and** of its
        momentum copy when the head has one, so that distillation targets and queue features come from the same
        token schedule as the online encoder. Validates first and leaves the model unchanged on error."""
        self.vision_model.set_aggregation(**settings)
        momentum = getattr(self, "vision_model_m", None)
        if momentum is not None:
            momentum.set_aggregation(**settings)
        for name, value in settings.items():
            setattr(self.config.vision_config, name, value)

    def _pool_video(self, video_embeds: torch.Tensor, token_sizes: torch.Tensor | None) -> torch.Tensor:
        """The ``(batch, hidden)`` summary that `vision_proj` embeds, following ``config.video_pooling``."""
        pooling = self.config.video_pooling
        if pooling == "cls":
            return video_embeds[:, 0]
        if pooling == "weighted_mean":
            if token_sizes is None:
                raise ValueError("`video_pooling='weighted_mean'` needs the token sizes (`video_token_sizes`).")
            weights = token_sizes.to(video_embeds.dtype).unsqueeze(-1)
            return (video_embeds * weights).sum(dim=1) / weights.sum(dim=1)
        return video_embeds.mean(dim=1)


class _TestaContrastiveMixin:
    """VTC (momentum distillation + queue + positives by id) and VTM (hard negatives) for retrieval and pre-training.

    Expects ``vision_model``, ``text_encoder``, ``vision_proj``, ``text_proj``, ``itm_head``, ``temp`` and the momentum
    copies built by `_build_contrastive_state`.
    """

    _momentum_pairs = (
        ("vision_model", "vision_model_m"),
        ("vision_proj", "vision_proj_m"),
        ("text_encoder", "text_encoder_m"),
        ("text_proj", "text_proj_m"),
    )
    # Training state, rebuilt on load (the original drops queues on load as well); see `_build_contrastive_state`.
    _keys_to_ignore_on_load_missing = [
        r"^(vision_model_m|vision_proj_m|text_encoder_m|text_proj_m)\.",
        r"^(video_queue|text_queue|idx_queue|queue_ptr|momentum_initialized)$",
    ]

    def _build_contrastive_state(self, config: TestaConfig) -> None:
        vision_width, text_width = config.vision_config.hidden_size, config.text_config.hidden_size
        self.vision_proj = nn.Linear(vision_width, config.projection_dim)
        self.text_proj = nn.Linear(text_width, config.projection_dim)
        self.itm_head = nn.Linear(text_width, 2)
        self.temp = nn.Parameter(torch.tensor(config.temperature))
        # Momentum encoder: a frozen EMA copy that produces the distillation targets and the queue features.
        self.vision_model_m = TestaVisionModel(config.vision_config)
        self.vision_proj_m = nn.Linear(vision_width, config.projection_dim)
        self.text_encoder_m = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.text_proj_m = nn.Linear(text_width, config.projection_dim)
        self.register_buffer("video_queue", torch.zeros(config.projection_dim, config.queue_size))
        self.register_buffer("text_queue", torch.zeros(config.projection_dim, config.queue_size))
        self.register_buffer("idx_queue", torch.full((config.queue_size,), -100, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("momentum_initialized", torch.zeros((), dtype=torch.bool))
        self._freeze_momentum()

    def _finish_contrastive_state(self) -> None:
        """After `post_init`: training state is saved by `accelerate.save_state` (it is in the state dict) but not by
        `save_pretrained`, so checkpoints keep BLIP's size and layout."""
        prefixes = tuple(f"{m}." for _, m in self._momentum_pairs)
        names = ("video_queue", "text_queue", "idx_queue", "queue_ptr", "momentum_initialized")
        self._keys_to_ignore_on_save = {k for k in self.state_dict() if k.startswith(prefixes) or k in names}

    def _freeze_momentum(self) -> None:
        for _, momentum_name in self._momentum_pairs:
            getattr(self, momentum_name).requires_grad_(False)

    _QUEUE_BUFFERS = ("video_queue", "text_queue")

    def _fp32_state(self) -> list[tuple[nn.Module, str, str]]:
        """``(owner module, "_parameters" | "_buffers", name)`` of every tensor kept in fp32: the momentum copies'
        parameters and buffers, and the feature queues."""
        slots = [(self, "_buffers", name) for name in self._QUEUE_BUFFERS if self._buffers.get(name) is not None]
        for _, momentum_name in self._momentum_pairs:
            if momentum_name not in self._modules:  # not built yet
                continue
            for module in self._modules[momentum_name].modules():
                slots += [(module, "_parameters", n) for n, t in module._parameters.items() if t is not None]
                slots += [(module, "_buffers", n) for n, t in module._buffers.items() if t is not None]
        return slots

    def _apply(self, fn, recurse=True):
        """Casts (`.to(torch.bfloat16)`, `.half()`, DeepSpeed's or a launcher's module cast) leave the momentum
        encoder and the queues in fp32: an EMA with momentum 0.995 adds 0.5% of the difference per step, below bf16's
        resolution (the weights would barely move in bf16 and drift the wrong way in fp16). Device moves apply."""
        kept = [(owner, kind, name, getattr(owner, kind)[name]) for owner, kind, name in self._fp32_state()]
        kept = [(owner, kind, name, tensor.data) for owner, kind, name, tensor in kept if tensor.dtype == torch.float32]
        result = super()._apply(fn, recurse)
        for owner, kind, name, original in kept:
            tensor = getattr(owner, kind)[name]
            if tensor.dtype in (torch.float16, torch.bfloat16):
                if kind == "_parameters":
                    tensor.data = original.to(device=tensor.device)
                else:
                    owner._buffers[name] = original.to(device=tensor.device)
        return result

    @torch.no_grad()
    def _momentum_to_fp32(self) -> None:
        """Momentum copies and queues created in half precision (e.g. `from_pretrained(dtype=torch.bfloat16)`)
        become fp32; called when the momentum copies are (re)initialised from the online weights."""
        for owner, kind, name in self._fp32_state():
            tensor = getattr(owner, kind)[name]
            if tensor.dtype in (torch.float16, torch.bfloat16):
                if kind == "_parameters":
                    tensor.data = tensor.data.float()
                else:
                    owner._buffers[name] = tensor.float()

    @torch.no_grad()
    def _init_training_state(self) -> None:
        config = self.config
        init.constant_(self.temp, config.temperature)
        queue_shape = (config.projection_dim, config.queue_size)
        init.copy_(self.video_queue, F.normalize(torch.randn(queue_shape), dim=0))
        init.copy_(self.text_queue, F.normalize(torch.randn(queue_shape), dim=0))
        init.constant_(self.idx_queue, -100)
        init.zeros_(self.queue_ptr)
        # The momentum encoder is (re)synchronised with the online encoder at the first training step.
        init.zeros_(self.momentum_initialized)
        self._freeze_momentum()

    # ------------------------------------------------------------------------------------------------ momentum + queue

    @torch.no_grad()
    def copy_params_to_momentum(self) -> None:
        """Copies the online encoders and projections into their momentum copies (the original's ``copy_params``)."""
        self._momentum_to_fp32()
        for online_name, momentum_name in self._momentum_pairs:
            online, momentum = getattr(self, online_name), getattr(self, momentum_name)
            for p, p_m in zip(online.parameters(), momentum.parameters()):
                p_m.data.copy_(p.data.to(p_m.dtype))
        self.momentum_initialized.fill_(True)
        self._freeze_momentum()

    @torch.no_grad()
    def _momentum_update(self) -> None:
        """EMA of the online weights into the (fp32) momentum copies; the first call copies them instead."""
        if not bool(self.momentum_initialized):
            self.copy_params_to_momentum()
            return
        m = self.config.momentum
        for online_name, momentum_name in self._momentum_pairs:
            online, momentum = getattr(self, online_name), getattr(self, momentum_name)
            for p, p_m in zip(online.parameters(), momentum.parameters()):
                p_m.data.mul_(m).add_(p.data.to(p_m.dtype), alpha=1.0 - m)

    def defer_momentum_updates(self, enabled: bool = True) -> None:
        """Chooses when the momentum EMA and the queue update happen during training.

        - ``False`` (the default, and the original's behaviour): every training forward with a loss first updates the
          EMA, then enqueues its batch's momentum features.
        - ``True`` (what `train/loop.py` uses): forwards only *collect* their momentum features; the training loop
          calls `momentum_step()` once per optimiser step, after ``optimizer.step()``. With gradient accumulation, the
          EMA then runs once per optimiser step (not ``m ** accumulation``), and the features of all micro-batches of
          a step are enqueued together after it, in order, as one larger batch would be.
        """
        self._momentum_deferred = bool(enabled)
        self._pending_queue = []

    @torch.no_grad()
    def momentum_step(self) -> None:
        """Deferred mode (`defer_momentum_updates`): call once after every optimiser step. Enqueues the momentum
        features collected since the previous step, then moves the momentum copies towards the updated weights."""
        pending, self._pending_queue = getattr(self, "_pending_queue", []), []
        if pending:
            self._dequeue_and_enqueue(*(torch.cat(parts) for parts in zip(*pending)))
        self._momentum_update()

    @torch.no_grad()
    def _dequeue_and_enqueue(self, video_feat: torch.Tensor, text_feat: torch.Tensor, ids: torch.Tensor) -> None:
        """Writes the global batch into the ring-buffer queue (identical on every process). Any batch size works;
        a batch larger than the queue keeps its last ``queue_size`` entries."""
        size = self.config.queue_size
        if size == 0:
            return
        video_feat, text_feat, ids = video_feat[-size:], text_feat[-size:], ids[-size:]
        slots = (int(self.queue_ptr) + torch.arange(ids.shape[0], device=ids.device)) % size
        self.video_queue[:, slots] = video_feat.T.to(self.video_queue.dtype)
        self.text_queue[:, slots] = text_feat.T.to(self.text_queue.dtype)
        self.idx_queue[slots] = ids
        self.queue_ptr.fill_((int(self.queue_ptr) + ids.shape[0]) % size)

    # ---------------------------------------------------------------------------------------------------- features

    def _text_features(self, encoder: nn.Module, proj: nn.Module, input_ids, attention_mask) -> torch.Tensor:
        states = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(proj(states[:, 0]), dim=-1)

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """L2-normalised text embeddings ``(batch, projection_dim)``: `text_proj` of the unimodal encoder's first token
        (keep the tokenizer's [CLS]; [ENC] is only for the video-grounded encoder)."""
        _check_ids(input_ids)
        return self._text_features(self.text_encoder, self.text_proj, input_ids, attention_mask)

    def get_video_tokens(self, pixel_values: torch.Tensor, **kwargs) -> TestaVisionModelOutput:
        """Runs the video encoder once; cache ``last_hidden_state`` and ``token_sizes`` for `get_video_features` and
        the two-stage `rank_videos`/`rank_texts` (the merged tokens are what the ITM head cross-attends to)."""
        return self.vision_model(self._video_inputs(pixel_values), **kwargs)

    def get_video_features(
        self,
        pixel_values: torch.Tensor | None = None,
        video_tokens: torch.Tensor | None = None,
        video_token_sizes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """L2-normalised video embeddings ``(batch, projection_dim)``: `vision_proj` of the pooled video tokens
        (``config.video_pooling``; the original checkpoints use the plain mean over all output tokens).

        Give either ``pixel_values`` or cached ``video_tokens`` (+ ``video_token_sizes`` for ``"weighted_mean"``).
        """
        if (pixel_values is None) == (video_tokens is None):
            raise ValueError("Pass exactly one of `pixel_values` and `video_tokens` to `get_video_features`.")
        if pixel_values is not None:
            out = self.get_video_tokens(pixel_values)
            video_tokens, video_token_sizes = out.last_hidden_state, out.token_sizes
        video_tokens = video_tokens.to(self.vision_proj.weight.dtype)
        return F.normalize(self.vision_proj(self._pool_video(video_tokens, video_token_sizes)), dim=-1)

    def _itm_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, video_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Matching logits ``(batch, 2)`` of paired texts and videos, and the video-grounded text states. The first
        text token becomes [ENC] here; every video token is attended to (all-ones mask, as in the original)."""
        states = self.text_encoder(
            input_ids=_with_first_token(input_ids, self.config.enc_token_id),
            attention_mask=attention_mask,
            encoder_hidden_states=video_embeds,
        ).last_hidden_state
        return self.itm_head(states[:, 0]), states

    # ------------------------------------------------------------------------------------------------------ losses

    def _positives(self, video_ids: torch.Tensor | None, batch: int, columns: torch.Tensor, device) -> torch.Tensor:
        """``(batch, len(columns))`` bool: which columns share the video id of each local row. Without ids, a row's
        only positive is its own pair, at column ``rank * batch + row``."""
        if video_ids is not None:
            return video_ids.view(-1, 1).eq(columns.view(1, -1))
        positives = torch.zeros(batch, columns.shape[0], dtype=torch.bool, device=device)
        rows = torch.arange(batch, device=device)
        positives[rows, _rank() * batch + rows] = True
        return positives

    def _vtc_loss(
        self,
        video_feat: torch.Tensor,
        text_feat: torch.Tensor,
        video_feat_m: torch.Tensor,
        text_feat_m: torch.Tensor,
        video_ids: torch.Tensor | None,
        alpha: float,
    ) -> torch.Tensor:
        """Contrastive loss of the local rows against the momentum features of the **global** batch plus the queue.

        The original compares against the local batch plus the queue; gathering the batch makes the loss and its
        gradient independent of how the global batch is split over processes. Only momentum features (no gradient)
        are gathered: the gradient flows through the local online features, and DDP's gradient averaging then gives
        exactly the gradient of the global-batch loss.
        """
        batch = video_feat.shape[0]
        ids_batch = _gather_without_grad(video_ids) if video_ids is not None else None
        video_m_batch, text_m_batch = _gather_without_grad(video_feat_m), _gather_without_grad(text_feat_m)
        queue = self.config.queue_size
        # Momentum features and queues are fp32; the online logits take the online features' dtype.
        video_m_all = torch.cat([video_m_batch, self.video_queue.T.to(video_m_batch.dtype)], dim=0)
        text_m_all = torch.cat([text_m_batch, self.text_queue.T.to(text_m_batch.dtype)], dim=0)
        if video_ids is not None:
            columns = torch.cat([ids_batch, self.idx_queue])
            positives = self._positives(video_ids, batch, columns, video_feat.device)
        else:
            positives = self._positives(None, batch, torch.empty(video_m_batch.shape[0]), video_feat.device)
            positives = F.pad(positives, (0, queue), value=False)
        targets = positives.float() / positives.sum(dim=1, keepdim=True)
        temp = self.temp
        with torch.no_grad():
            targets_v2t = alpha * F.softmax(video_feat_m @ text_m_all.T / temp, dim=1) + (1 - alpha) * targets
            targets_t2v = alpha * F.softmax(text_feat_m @ video_m_all.T / temp, dim=1) + (1 - alpha) * targets
        loss_v2t = -(F.log_softmax(video_feat @ text_m_all.T.to(video_feat.dtype) / temp, dim=1) * targets_v2t)
        loss_t2v = -(F.log_softmax(text_feat @ video_m_all.T.to(text_feat.dtype) / temp, dim=1) * targets_t2v)
        loss_v2t, loss_t2v = loss_v2t.sum(dim=1).mean(), loss_t2v.sum(dim=1).mean()
        if self.training:
            if ids_batch is None:
                ids_batch = torch.full((video_m_batch.shape[0],), -100, dtype=torch.long, device=video_feat.device)
            if getattr(self, "_momentum_deferred", False):
                self._pending_queue.append((video_m_batch, text_m_batch, ids_batch))  # enqueued by momentum_step()
            else:
                self._dequeue_and_enqueue(video_m_batch, text_m_batch, ids_batch)
        return (loss_v2t + loss_t2v) / 2

    @staticmethod
    def sample_hard_negatives(weights: torch.Tensor) -> torch.Tensor:
        """Draws one negative per row of the ``(rows, candidates)`` sampling weights (``torch.multinomial``, as in the
        original). Override it for another sampler, e.g. a seeded or deterministic one."""
        return torch.multinomial(weights, 1).squeeze(1)

    @torch.no_grad()
    def hard_negative_weights(
        self, video_feat: torch.Tensor, text_feat: torch.Tensor, video_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The VTM sampling weights of the local rows over the candidate set: ``softmax(sim / temp)`` with every pair
        sharing a video id (or the pair itself) set to 0. With ``negative_all_rank`` the candidates are the batch
        gathered over all processes, otherwise the local batch. Returns ``(video->text, text->video)`` weights."""
        gather = self.config.negative_all_rank
        video_all = _gather_without_grad(video_feat) if gather else video_feat
        text_all = _gather_without_grad(text_feat) if gather else text_feat
        batch = video_feat.shape[0]
        if video_ids is not None:
            same = self._positives(video_ids, batch, _gather_without_grad(video_ids) if gather else video_ids, None)
        elif gather:
            same = self._positives(None, batch, torch.empty(video_all.shape[0]), video_feat.device)
        else:
            same = torch.eye(batch, dtype=torch.bool, device=video_feat.device)
        weights_v2t = F.softmax(video_feat @ text_all.T / self.temp, dim=1).masked_fill(same, 0)
        weights_t2v = F.softmax(text_feat @ video_all.T / self.temp, dim=1).masked_fill(same, 0)
        error = None
        for name, weights in (("video", weights_v2t), ("text", weights_t2v)):
            if error is None and (not torch.isfinite(weights).all() or (weights.sum(dim=1) <= 0).any()):
                error = ValueError(
                    f"Cannot draw a hard negative {name} pair: some rows have no candidate with a different video id "
                    "(every candidate shares the row's `video_ids`, or the global batch has one sample)."
                )
        raise_on_every_rank(error, video_feat.device)  # a rank-local failure must not leave the others waiting
        return weights_v2t, weights_t2v

    def _vtm_loss(
        self,
        video_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        video_feat: torch.Tensor,
        text_feat: torch.Tensor,
        video_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Matching loss over ``B`` positives, ``B`` (text, hard-negative video) and ``B`` (video, hard-negative text)
        pairs. Negative video tokens come from all processes with their gradients (``all_gather`` with backward)."""
        batch = video_embeds.shape[0]
        enc_ids = _with_first_token(input_ids, self.config.enc_token_id)
        gather = self.config.negative_all_rank and _world_size() > 1
        with torch.no_grad():
            weights_v2t, weights_t2v = self.hard_negative_weights(video_feat.detach(), text_feat.detach(), video_ids)
            negative_videos = self.sample_hard_negatives(weights_t2v)
            negative_texts = self.sample_hard_negatives(weights_v2t)
        pad = self.config.text_config.pad_token_id or 0
        if gather:
            _check_same_shape_on_all_ranks(video_embeds, "pixel_values -> video tokens", (0, 1))
            videos_all = _gather_with_grad(video_embeds)
            ids_all, mask_all = _gather_padded(enc_ids, pad), _gather_padded(attention_mask, 0)
        else:
            videos_all, ids_all, mask_all = video_embeds, enc_ids, attention_mask
        length = ids_all.shape[1]
        enc_ids = F.pad(enc_ids, (0, length - enc_ids.shape[1]), value=pad)
        attention_mask = F.pad(attention_mask, (0, length - attention_mask.shape[1]), value=0)

        text_ids = torch.cat([enc_ids, enc_ids, ids_all[negative_texts]], dim=0)
        text_mask = torch.cat([attention_mask, attention_mask, mask_all[negative_texts]], dim=0)
        videos = torch.cat([video_embeds, videos_all[negative_videos], video_embeds], dim=0)
        states = self.text_encoder(
            input_ids=text_ids, attention_mask=text_mask, encoder_hidden_states=videos
        ).last_hidden_state
        logits = self.itm_head(states[:, 0])
        labels = torch.cat([torch.ones(batch), torch.zeros(2 * batch)]).long().to(logits.device)
        return F.cross_entropy(logits.float(), labels), logits[:batch], negative_videos, negative_texts

    def _contrastive_losses(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        pixel_values: torch.Tensor,
        video_embeds: torch.Tensor,
        video_token_sizes: torch.Tensor,
        video_ids: torch.Tensor | None,
        alpha: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """VTC and VTM for one batch; returns ``(loss_vtc, loss_vtm, positive itm logits, neg videos, neg texts)``."""
        batch = input_ids.shape[0]
        alpha = self.config.alpha if alpha is None else alpha
        error = None
        if video_embeds.shape[0] != batch:
            error = ValueError(f"Got {video_embeds.shape[0]} videos but {batch} texts; training needs aligned pairs.")
        elif video_ids is not None:
            video_ids = torch.as_tensor(video_ids, device=input_ids.device).view(-1)
            if video_ids.shape[0] != batch or (video_ids < 0).any():
                error = ValueError(f"`video_ids` must hold {batch} non-negative ids, got {video_ids.tolist()}.")
        if error is None and not 0.0 <= alpha <= 1.0:
            error = ValueError(f"`alpha` must lie in [0, 1], got {alpha}.")
        raise_on_every_rank(error, input_ids.device)  # raised on every process or on none
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        _check_same_shape_on_all_ranks(input_ids, "input_ids", (0,))
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        video_feat = F.normalize(self.vision_proj(self._pool_video(video_embeds, video_token_sizes)), dim=-1)
        text_feat = self._text_features(self.text_encoder, self.text_proj, input_ids, attention_mask)
        with torch.no_grad():
            if self.training and not getattr(self, "_momentum_deferred", False):
                self._momentum_update()
            elif not bool(self.momentum_initialized):
                self.copy_params_to_momentum()
            momentum_dtype = self.vision_proj_m.weight.dtype
            out_m = self.vision_model_m(pixel_values.to(momentum_dtype))
            video_feat_m = F.normalize(
                self.vision_proj_m(self._pool_video(out_m.last_hidden_state, out_m.token_sizes)), dim=-1
            )
            text_feat_m = self._text_features(self.text_encoder_m, self.text_proj_m, input_ids, attention_mask)
        loss_vtc = self._vtc_loss(video_feat, text_feat, video_feat_m, text_feat_m, video_ids, alpha)
        loss_vtm, itm_logits, neg_videos, neg_texts = self._vtm_loss(
            video_embeds, input_ids, attention_mask, video_feat, text_feat, video_ids
        )
        return loss_vtc, loss_vtm, itm_logits, neg_videos, neg_texts

    # ------------------------------------------------------------------------------------------- two-stage ranking

    @torch.no_grad()
    def _two_stage_rank(
        self,
        queries_are_texts: bool,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        video_tokens: torch.Tensor,
        video_token_sizes: torch.Tensor | None,
        text_features: torch.Tensor | None,
        video_features: torch.Tensor | None,
        k: int | None,
        itm_score: str,
        add_cosine: bool,
        batch_size: int,
    ) -> TestaRankingOutput:
        _check_ids(input_ids)
        if not isinstance(video_tokens, torch.Tensor) or video_tokens.ndim != 3:
            raise ValueError("`video_tokens` must be the cached (num_videos, tokens, hidden) encoder output.")
        if itm_score not in ("logit", "softmax"):
            raise ValueError(f"Unknown itm_score={itm_score!r}; use 'logit' (original) or 'softmax'.")
        if batch_size <= 0:
            raise ValueError(f"`batch_size` must be positive, got {batch_size}.")
        k = self.config.k_test if k is None else k
        if k <= 0:
            raise ValueError(f"`k` must be positive, got {k}.")
        num_texts, num_videos = input_ids.shape[0], video_tokens.shape[0]
        for name, value, rows, unit in (("attention_mask", attention_mask, num_texts, "text"),
                                        ("text_features", text_features, num_texts, "text"),
                                        ("video_features", video_features, num_videos, "video"),
                                        ("video_token_sizes", video_token_sizes, num_videos, "video")):
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape[0] != rows):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"`{name}` must have one row per {unit} ({rows}), got {shape}.")
        num_queries, num_candidates = (num_texts, num_videos) if queries_are_texts else (num_videos, num_texts)
        if num_candidates == 0:
            empty = "video_tokens` holds no video" if queries_are_texts else "input_ids` holds no text"
            raise ValueError(f"Nothing to rank against: `{empty}.")
        device, dtype = self.itm_head.weight.device, self.itm_head.weight.dtype
        if num_queries == 0:
            # This process's share of the queries is empty (fewer queries than processes, e.g. with accelerate's
            # `split_between_processes`): empty outputs of the right widths, so that gathering them just works.
            k = min(k, num_candidates)
            empty = torch.empty(0, num_candidates, device=device, dtype=dtype)
            return TestaRankingOutput(
                scores=empty,
                similarity=empty.clone(),
                topk_indices=torch.empty(0, k, device=device, dtype=torch.long),
                topk_scores=torch.empty(0, k, device=device, dtype=dtype),
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if text_features is None:
            text_features = torch.cat(
                [
                    self.get_text_features(input_ids[i : i + batch_size], attention_mask[i : i + batch_size])
                    for i in range(0, input_ids.shape[0], batch_size)
                ]
            )
        if video_features is None:
            chunks = []
            for i in range(0, video_tokens.shape[0], batch_size):
                sizes = None if video_token_sizes is None else video_token_sizes[i : i + batch_size].to(device)
                tokens = video_tokens[i : i + batch_size].to(device)
                chunks.append(self.get_video_features(video_tokens=tokens, video_token_sizes=sizes))
            video_features = torch.cat(chunks)
        text_features, video_features = text_features.to(device, dtype), video_features.to(device, dtype)
        similarity = text_features @ video_features.T if queries_are_texts else video_features @ text_features.T
        k = min(k, similarity.shape[1])
        topk_sim, topk_indices = similarity.topk(k, dim=1)
        # Memory-bounded re-ranking: `batch_size` (text, video) pairs at a time, gathering only their video tokens.
        query_index = torch.arange(similarity.shape[0], device=device).repeat_interleave(k)
        candidate_index = topk_indices.flatten()
        pair_scores = []
        for start in range(0, query_index.shape[0], batch_size):
            queries, candidates = query_index[start : start + batch_size], candidate_index[start : start + batch_size]
            texts, videos = (queries, candidates) if queries_are_texts else (candidates, queries)
            logits, _ = self._itm_logits(
                input_ids[texts], attention_mask[texts], video_tokens[videos.cpu()].to(device, dtype)
            )
            pair_scores.append(logits[:, 1] if itm_score == "logit" else logits.float().softmax(dim=-1)[:, 1])
        topk_scores = torch.cat(pair_scores).view(-1, k).to(similarity.dtype)
        if add_cosine:
            topk_scores = topk_scores + topk_sim
        scores = torch.full_like(similarity, float("-inf")).scatter(1, topk_indices, topk_scores)
        return TestaRankingOutput(
            scores=scores, similarity=similarity, topk_indices=topk_indices, topk_scores=topk_scores
        )

    def rank_videos(
        self,
        input_ids: torch.Tensor,
        video_tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        video_token_sizes: torch.Tensor | None = None,
        text_features: torch.Tensor | None = None,
        video_features: torch.Tensor | None = None,
        k: int | None = None,
        itm_score: str = "logit",
        add_cosine: bool = True,
        batch_size: int = 128,
    ) -> TestaRankingOutput:
        r"""
        Text-to-video retrieval in two stages, as in the original evaluation: the cosine similarity of the VTC
        embeddings picks the top-``k`` videos of every text (``k`` defaults to ``config.k_test``), then the ITM head
        re-scores those pairs. The final score is the ITM match logit plus the cosine (original);
        ``itm_score="softmax"`` uses the match probability instead, and ``add_cosine=False`` drops the cosine.

        Memory is bounded by ``batch_size`` pairs: only their video tokens are gathered (and moved to the model's
        device) at a time, so ``video_tokens`` can stay on the CPU (e.g. in fp16).

        No query (e.g. a process's empty share when there are fewer queries than processes) gives empty outputs of
        the right widths (``(0, num_videos)`` scores), so that the shares can be gathered; no candidate raises.

        Args:
            input_ids (`torch.LongTensor` of shape `(num_texts, length)`): tokenised queries, [CLS] first.
            video_tokens (`torch.FloatTensor` of shape `(num_videos, tokens, hidden)`): cached `get_video_tokens`
                outputs (``last_hidden_state``).
            attention_mask (`torch.LongTensor`, *optional*): the texts' attention mask.
            video_token_sizes (`torch.FloatTensor` of shape `(num_videos, tokens)`, *optional*): needed for
                ``video_pooling="weighted_mean"``.
            text_features, video_features (`torch.FloatTensor`, *optional*): precomputed normalised embeddings.
        """
        return self._two_stage_rank(
            True, input_ids, attention_mask, video_tokens, video_token_sizes, text_features, video_features, k,
            itm_score, add_cosine, batch_size,
        )

    def rank_texts(
        self,
        input_ids: torch.Tensor,
        video_tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        video_token_sizes: torch.Tensor | None = None,
        text_features: torch.Tensor | None = None,
        video_features: torch.Tensor | None = None,
        k: int | None = None,
        itm_score: str = "logit",
        add_cosine: bool = True,
        batch_size: int = 128,
    ) -> TestaRankingOutput:
        """Video-to-text retrieval in two stages; the arguments are those of `rank_videos`, and the outputs are
        ``(num_videos, num_texts)``."""
        return self._two_stage_rank(
            False, input_ids, attention_mask, video_tokens, video_token_sizes, text_features, video_features, k,
            itm_score, add_cosine, batch_size,
        )


class TestaForVideoTextRetrieval(_TestaContrastiveMixin, _TestaMultimodalPreTrainedModel):
    r"""
    TESTA for video-text retrieval: the TESTA video encoder, BLIP's BERT text encoder (with cross-attention), the
    `vision_proj`/`text_proj` contrastive projections and the `itm_head` matching head. Parameter names equal
    transformers' [`BlipForImageTextRetrieval`] for the text side and the heads, so BLIP weights map one to one (see
    `convert_blip_to_testa`).

    The video embedding is `vision_proj` of the **unweighted mean over all output tokens** (CLS included), which is
    what the original TESTA checkpoints were trained with (`config.video_pooling="mean"`); `"weighted_mean"` weights
    every token by the number of patches it stands for, `"cls"` takes the CLS token like image BLIP.

    The momentum encoder, queues and `temp` clamp are training state: they are in the state dict (so
    `accelerate.save_state` resumes them) but not in `save_pretrained` checkpoints, and the momentum encoder is
    re-synchronised from the online weights at the first training step after loading.
    """

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        self.vision_model = TestaVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self._build_contrastive_state(config)
        self.post_init()
        self._finish_contrastive_state()

    def get_input_embeddings(self) -> nn.Module:
        return self.text_encoder.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.text_encoder.set_input_embeddings(value)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        use_itm_head: bool = True,
        return_loss: bool = False,
        video_ids: torch.LongTensor | None = None,
        alpha: float | None = None,
        output_hidden_states: bool | None = None,
    ) -> TestaVideoTextRetrievalOutput:
        r"""
        Mirrors [`BlipForImageTextRetrieval.forward`].

        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised texts with the tokenizer's [CLS]
                first. For the ITM head the model replaces it by [ENC] (`config.enc_token_id`), as the original
                does; transformers' BLIP leaves that to the caller (transformers issue #22732).
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`): the videos; images
                `(batch, channels, height, width)` are taken as static videos of `vision_config.num_frames` frames.
            attention_mask (`torch.LongTensor`, *optional*): the texts' attention mask.
            use_itm_head (`bool`, defaults to `True`): return the ITM logits of the pairs; otherwise the cosine
                similarity of every video with every text.
            return_loss (`bool`, defaults to `False`): compute the fine-tuning loss VTC + VTM on the batch of pairs.
            video_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): with a loss, the video id of every pair;
                all pairs (and queue entries) with the same id are positives. Without it, only the pair itself is.
            alpha (`float`, *optional*): distillation weight for this step (defaults to `config.alpha`; the original
                ramps it up linearly during the first epoch).
            output_hidden_states (`bool`, *optional*): return the video encoder's hidden states.
        """
        _check_ids(input_ids)
        pixel_values = self._video_inputs(pixel_values)
        vision = self.vision_model(pixel_values, output_hidden_states=output_hidden_states)
        video_embeds, token_sizes = vision.last_hidden_state, vision.token_sizes
        loss = loss_vtc = loss_vtm = neg_videos = neg_texts = None
        if return_loss:
            loss_vtc, loss_vtm, itm_score, neg_videos, neg_texts = self._contrastive_losses(
                input_ids, attention_mask, pixel_values, video_embeds, token_sizes, video_ids, alpha
            )
            loss = loss_vtc + loss_vtm
            question_embeds = None
        elif use_itm_head:
            if video_embeds.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"The ITM head scores (text, video) pairs: got {input_ids.shape[0]} texts and "
                    f"{video_embeds.shape[0]} videos. Use `use_itm_head=False` or `rank_videos` for all pairs."
                )
            itm_score, question_embeds = self._itm_logits(input_ids, attention_mask, video_embeds)
        else:
            question_embeds = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            text_feat = F.normalize(self.text_proj(question_embeds[:, 0]), dim=-1)
            video_feat = F.normalize(self.vision_proj(self._pool_video(video_embeds, token_sizes)), dim=-1)
            itm_score = video_feat @ text_feat.T
        return TestaVideoTextRetrievalOutput(
            loss=loss,
            loss_vtc=loss_vtc,
            loss_vtm=loss_vtm,
            itm_score=itm_score,
            video_embeds=video_embeds,
            video_token_sizes=token_sizes,
            question_embeds=question_embeds,
            negative_video_indices=neg_videos,
            negative_text_indices=neg_texts,
            vision_hidden_states=vision.hidden_states,
        )


class TestaForVideoQA(_TestaMultimodalPreTrainedModel, GenerationMixin):
    r"""
    TESTA for open-ended video question answering: the question, with [ENC] as its first token, is encoded by
    `text_encoder` with cross-attention to the video tokens; the answer decoder `text_decoder` (a
    [`BlipTextLMHeadModel`]) cross-attends to the question states. Parameter names equal transformers'
    [`BlipForQuestionAnswering`].

    Answers are produced either by `generate()` or by ranking a candidate list with `rank_answers()` (the original's
    `inference: rank`: top-k candidates by first-token probability, then the full log-likelihood).
    """

    generation_config_class = TestaGenerationConfig
    _tied_weights_keys = {
        "text_decoder.cls.predictions.decoder.bias": "text_decoder.cls.predictions.bias",
        "text_decoder.cls.predictions.decoder.weight": "text_decoder.bert.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        self.vision_model = TestaVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.text_decoder = BlipTextLMHeadModel(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.text_encoder.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.text_encoder.set_input_embeddings(value)

    def _pad_token_id(self) -> int:
        return self.config.text_config.pad_token_id or 0

    def encode_question(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(question_states, question_attention_mask, video_tokens)``; [ENC] replaces the first token."""
        _check_ids(input_ids)
        video_embeds = self.vision_model(self._video_inputs(pixel_values)).last_hidden_state
        if video_embeds.shape[0] != input_ids.shape[0]:
            raise ValueError(f"Got {input_ids.shape[0]} questions but {video_embeds.shape[0]} videos.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        states = self.text_encoder(
            input_ids=_with_first_token(input_ids, self.config.enc_token_id),
            attention_mask=attention_mask,
            encoder_hidden_states=video_embeds,
        ).last_hidden_state
        return states, attention_mask, video_embeds

    def _decode(self, answer_ids, answer_mask, question_states, question_mask) -> torch.Tensor:
        return self.text_decoder(
            input_ids=_with_first_token(answer_ids, self.config.dec_token_id),
            attention_mask=answer_mask,
            encoder_hidden_states=question_states,
            encoder_attention_mask=question_mask,
        ).logits

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.LongTensor | None = None,
        answer_weights: torch.FloatTensor | None = None,
        num_answers: torch.LongTensor | list[int] | None = None,
    ) -> TestaVideoQAOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised questions ([CLS] first; the model
                puts [ENC] there).
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`): the videos.
            attention_mask (`torch.LongTensor`, *optional*): the questions' attention mask.
            labels (`torch.LongTensor` of shape `(num_answers, answer_length)`, *optional*): tokenised answers
                ([CLS] ... [SEP]; the model puts [DEC] first). Padding (where `decoder_attention_mask` is 0, or
                `pad_token_id`/-100 without a mask) is ignored. Gives the loss.
            decoder_input_ids (`torch.LongTensor`, *optional*): decoder inputs without a loss (defaults to `labels`).
            decoder_attention_mask (`torch.LongTensor`, *optional*): the answers' attention mask.
            answer_weights (`torch.FloatTensor` of shape `(num_answers,)`, *optional*): weight of every answer
                (defaults to 1). The loss is `sum(weight * answer_loss) / batch`, as in the original.
            num_answers (`torch.LongTensor` or `list[int]` of length `batch`, *optional*): how many consecutive
                answers belong to each question (defaults to one each).
        """
        if labels is None and decoder_input_ids is None:
            raise ValueError(
                "TestaForVideoQA.forward needs `labels` (training) or `decoder_input_ids`; use `generate()` or "
                "`rank_answers()` for inference."
            )
        answer_ids = decoder_input_ids if decoder_input_ids is not None else labels
        _check_ids(answer_ids, "labels" if decoder_input_ids is None else "decoder_input_ids")
        answer_ids = answer_ids.masked_fill(answer_ids == -100, self._pad_token_id())
        question_states, question_mask, video_embeds = self.encode_question(input_ids, pixel_values, attention_mask)
        batch = input_ids.shape[0]
        counts = torch.ones(batch, dtype=torch.long) if num_answers is None else torch.as_tensor(num_answers).view(-1)
        if counts.shape[0] != batch or int(counts.sum()) != answer_ids.shape[0] or (counts < 1).any():
            raise ValueError(
                f"`num_answers` must give >= 1 answer for each of the {batch} questions and sum to the "
                f"{answer_ids.shape[0]} answers in `labels`; got {counts.tolist()}."
            )
        counts = counts.to(question_states.device)
        states = question_states.repeat_interleave(counts, dim=0)
        mask = question_mask.repeat_interleave(counts, dim=0)
        logits = self._decode(answer_ids, decoder_attention_mask, states, mask)
        loss = answer_loss = None
        if labels is not None:
            answer_mask = decoder_attention_mask
            if answer_mask is None:
                answer_mask = labels.ne(-100) & labels.ne(self._pad_token_id())
            answer_loss = _sequence_nll(
                logits, answer_ids, answer_mask, self._pad_token_id(), self.config.label_smoothing
            )
            if answer_weights is None:
                answer_weights = torch.ones_like(answer_loss)
            answer_weights = torch.as_tensor(answer_weights, device=answer_loss.device, dtype=answer_loss.dtype)
            answer_weights = answer_weights.view(-1)
            if answer_weights.shape != answer_loss.shape:
                raise ValueError(
                    f"`answer_weights` must hold one weight per answer ({answer_loss.shape[0]}), got "
                    f"{tuple(answer_weights.shape)}."
                )
            loss = (answer_weights * answer_loss).sum() / batch
        return TestaVideoQAOutput(
            loss=loss,
            answer_loss=answer_loss,
            logits=logits,
            question_embeds=question_states,
            video_embeds=video_embeds,
        )

    @torch.no_grad()
    def rank_answers(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        answer_ids: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        answer_attention_mask: torch.LongTensor | None = None,
        k: int | None = None,
        label_smoothing: float | None = None,
        batch_size: int = 512,
    ) -> TestaAnswerRankingOutput:
        r"""
        Picks an answer from a candidate list (the original's `rank_answer`): the decoder's first-step distribution
        after [DEC] selects the ``k`` candidates whose first token is most probable (``k`` defaults to
        ``config.k_test``), then each is scored by its teacher-forced log-likelihood and the best one wins.

        Args:
            answer_ids (`torch.LongTensor` of shape `(num_candidates, length)`): the tokenised candidate answers.
            answer_attention_mask (`torch.LongTensor`, *optional*): their attention mask (defaults to non-pad).
            label_smoothing (`float`, *optional*): smoothing of the likelihood score; defaults to
                `config.label_smoothing`, which the original used here too. Use 0.0 for the exact log-likelihood.
            batch_size (`int`, defaults to 512): candidate sequences decoded at a time.
        """
        _check_ids(answer_ids, "answer_ids")
        if answer_ids.shape[1] < 2:
            raise ValueError("`answer_ids` need at least two tokens ([CLS]/[DEC] and the first answer token).")
        smoothing = self.config.label_smoothing if label_smoothing is None else label_smoothing
        pad = self._pad_token_id()
        if answer_attention_mask is None:
            answer_attention_mask = answer_ids.ne(pad).long()
            answer_attention_mask[:, 0] = 1
        states, mask, _ = self.encode_question(input_ids, pixel_values, attention_mask)
        batch, device = states.shape[0], states.device
        answer_ids, answer_attention_mask = answer_ids.to(device), answer_attention_mask.to(device)
        start = torch.full((batch, 1), self.config.dec_token_id, dtype=torch.long, device=device)
        first_logits = self.text_decoder(
            input_ids=start, encoder_hidden_states=states, encoder_attention_mask=mask
        ).logits[:, 0]
        first_probs = first_logits.float().softmax(dim=-1).index_select(1, answer_ids[:, 1])
        k = min(self.config.k_test if k is None else k, answer_ids.shape[0])
        topk_probs, topk_indices = first_probs.topk(k, dim=1)
        question_index = torch.arange(batch, device=device).repeat_interleave(k)
        candidates = topk_indices.flatten()
        scores = []
        for i in range(0, candidates.shape[0], batch_size):
            q, c = question_index[i : i + batch_size], candidates[i : i + batch_size]
            logits = self._decode(answer_ids[c], answer_attention_mask[c], states[q], mask[q])
            scores.append(-_sequence_nll(logits, answer_ids[c], answer_attention_mask[c], pad, smoothing))
        log_likelihoods = torch.cat(scores).view(batch, k)
        best = log_likelihoods.argmax(dim=1)
        return TestaAnswerRankingOutput(
            answer_indices=topk_indices.gather(1, best[:, None]).squeeze(1),
            topk_indices=topk_indices,
            topk_log_likelihoods=log_likelihoods,
            first_token_probs=topk_probs,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        **generate_kwargs,
    ) -> torch.LongTensor:
        r"""
        Generates answers: the decoder starts from [DEC] and stops at [SEP] (`text_config.sep_token_id`). The
        original uses beam search with 3 beams and `max_length=10` (`num_beams=3, max_length=10`).

        Args:
            input_ids, pixel_values, attention_mask: as in `forward`.
            **generate_kwargs: passed to the decoder's `generate` (`max_new_tokens`, `num_beams`, ...).
        """
        states, mask, _ = self.encode_question(input_ids, pixel_values, attention_mask)
        start = torch.full((states.shape[0], 1), self.config.dec_token_id, dtype=torch.long, device=states.device)
        text_config = self.config.text_config
        generate_kwargs.setdefault("eos_token_id", text_config.sep_token_id)
        generate_kwargs.setdefault("pad_token_id", text_config.pad_token_id)
        return self.text_decoder.generate(
            input_ids=start, encoder_hidden_states=states, encoder_attention_mask=mask, **generate_kwargs
        )


# Encoder/decoder sharing (everything but self-attention), as a pattern over parameter names after the model prefix.
_SHARED_TEXT_MODULES = (
    r"(embeddings\.(word_embeddings|position_embeddings|LayerNorm)"
    r"|encoder\.layer\.\d+\.(crossattention|intermediate|output))\."
)


class TestaForPreTraining(_TestaContrastiveMixin, _TestaMultimodalPreTrainedModel, GenerationMixin):
    r"""
    TESTA pre-training (paper appendix, BLIP-style): VTC + VTM + CAP.

    - VTC and VTM as in [`TestaForVideoTextRetrieval`] (momentum distillation, queue, hard negatives).
    - CAP: captioning loss of `text_decoder` ([DEC] first) cross-attending to the video tokens, label-smoothed.
    - The text encoder and decoder share everything but self-attention (embeddings, cross-attention and feed-forward
      layers), as BLIP does; the decoder's output embedding is tied to the word embeddings.
    - Image-text pairs are accepted as static videos (`pixel_values` of shape `(batch, channels, height, width)`).

    `generate()` captions videos.
    """

    generation_config_class = TestaGenerationConfig
    _tied_weights_keys = {
        "text_decoder\\.bert\\." + _SHARED_TEXT_MODULES: "text_encoder\\." + _SHARED_TEXT_MODULES,
        "text_decoder.cls.predictions.decoder.bias": "text_decoder.cls.predictions.bias",
        "text_decoder.cls.predictions.decoder.weight": "text_decoder.bert.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        self.vision_model = TestaVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.text_decoder = BlipTextLMHeadModel(config.text_config)
        self._share_encoder_decoder()
        self._build_contrastive_state(config)
        self.post_init()
        self._finish_contrastive_state()

    def _share_encoder_decoder(self) -> None:
        """BLIP's ``tie_encoder_decoder_weights(text_encoder, text_decoder.bert, '', '/attention')``: the decoder
        uses the encoder's modules for everything except self-attention."""
        decoder = self.text_decoder.bert
        decoder.embeddings = self.text_encoder.embeddings
        for encoder_layer, decoder_layer in zip(self.text_encoder.encoder.layer, decoder.encoder.layer):
            decoder_layer.crossattention = encoder_layer.crossattention
            decoder_layer.intermediate = encoder_layer.intermediate
            decoder_layer.output = encoder_layer.output

    def get_input_embeddings(self) -> nn.Module:
        return self.text_encoder.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.text_encoder.set_input_embeddings(value)

    def _caption_logits(self, input_ids, attention_mask, video_embeds) -> torch.Tensor:
        return self.text_decoder(
            input_ids=_with_first_token(input_ids, self.config.dec_token_id),
            attention_mask=attention_mask,
            encoder_hidden_states=video_embeds,
        ).logits

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        video_ids: torch.LongTensor | None = None,
        alpha: float | None = None,
        return_loss: bool = True,
    ) -> TestaPreTrainingOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised captions ([CLS] first; the model
                uses [ENC] for VTM and [DEC] for captioning).
            pixel_values (`torch.FloatTensor`): videos `(batch, frames, channels, height, width)` or images
                `(batch, channels, height, width)` (static videos of `vision_config.num_frames` frames).
            attention_mask (`torch.LongTensor`, *optional*): the captions' attention mask.
            video_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): positives for VTC by id (pre-training
                uses one positive per pair: leave it out).
            alpha (`float`, *optional*): distillation weight for this step (defaults to `config.alpha`).
            return_loss (`bool`, defaults to `True`): compute VTC + VTM + CAP; otherwise only the caption logits and
                the ITM logits of the pairs.
        """
        _check_ids(input_ids)
        pixel_values = self._video_inputs(pixel_values)
        vision = self.vision_model(pixel_values)
        video_embeds, token_sizes = vision.last_hidden_state, vision.token_sizes
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        caption_logits = self._caption_logits(input_ids, attention_mask, video_embeds)
        loss = loss_vtc = loss_vtm = loss_cap = neg_videos = neg_texts = None
        if return_loss:
            loss_vtc, loss_vtm, itm_score, neg_videos, neg_texts = self._contrastive_losses(
                input_ids, attention_mask, pixel_values, video_embeds, token_sizes, video_ids, alpha
            )
            pad = self.config.text_config.pad_token_id or 0
            nll = _sequence_nll(caption_logits, input_ids, attention_mask, pad, self.config.label_smoothing)
            loss_cap = nll.sum() / attention_mask[:, 1:].sum().clamp(min=1)
            loss = loss_vtc + loss_vtm + loss_cap
        else:
            itm_score, _ = self._itm_logits(input_ids, attention_mask, video_embeds)
        return TestaPreTrainingOutput(
            loss=loss,
            loss_vtc=loss_vtc,
            loss_vtm=loss_vtm,
            loss_cap=loss_cap,
            caption_logits=caption_logits,
            itm_score=itm_score,
            video_embeds=video_embeds,
            negative_video_indices=neg_videos,
            negative_text_indices=neg_texts,
        )

    @torch.no_grad()
    def generate(
        self,
        pixel_values: torch.FloatTensor,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.LongTensor | None = None,
        **generate_kwargs,
    ) -> torch.LongTensor:
        r"""
        Captions videos with the decoder, which starts from [DEC] and stops at [SEP].

        Args:
            pixel_values (`torch.FloatTensor`): the videos (or images).
            input_ids (`torch.LongTensor`, *optional*): a tokenised prompt ([CLS] ... [SEP]); as in
                [`BlipForConditionalGeneration.generate`], its first token becomes [DEC] and its last token ([SEP])
                is dropped.
            attention_mask (`torch.LongTensor`, *optional*): the prompt's attention mask.
            **generate_kwargs: passed to the decoder's `generate`.
        """
        video_embeds = self.vision_model(self._video_inputs(pixel_values)).last_hidden_state
        batch = video_embeds.shape[0]
        if input_ids is None:
            input_ids = torch.full((batch, 1), self.config.dec_token_id, dtype=torch.long, device=video_embeds.device)
        else:
            _check_ids(input_ids)
            input_ids = _with_first_token(input_ids, self.config.dec_token_id)[:, :-1]
            attention_mask = attention_mask[:, :-1] if attention_mask is not None else None
        text_config = self.config.text_config
        generate_kwargs.setdefault("eos_token_id", text_config.sep_token_id)
        generate_kwargs.setdefault("pad_token_id", text_config.pad_token_id)
        return self.text_decoder.generate(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=video_embeds, **generate_kwargs
        )


__all__ = [
    "TestaPreTrainedModel",
    "TestaVisionModel",
    "TestaVisionModelOutput",
    "token_schedule",
    "TestaAnswerRankingOutput",
    "TestaForPreTraining",
    "TestaForVideoQA",
    "TestaForVideoTextRetrieval",
    "TestaPreTrainingOutput",
    "TestaRankingOutput",
    "TestaVideoQAOutput",
    "TestaVideoTextRetrievalOutput",
]
