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
from .configuration_testa import TestaConfig, TestaVisionConfig


# ----------------------------------------------------------------------------------------------------------------------
# Token bookkeeping
# ----------------------------------------------------------------------------------------------------------------------


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
    if config.aggregation_dims == "joint":
        frames, patches = 1, frames * patches
    schedule = []
    for r_t, r_s in zip(config.temporal_reduction_per_layer, config.spatial_reduction_per_layer):
        if config.aggregation_dims != "joint":
            frames -= capped_reduction(r_t, frames, protected=1)
        patches -= capped_reduction(r_s, patches + 1, protected=1)
        schedule.append((frames, patches))
    return schedule


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
        patches = self.patch_embedding(pixel_values.flatten(0, 1).to(weight.dtype))  # (B*T, D, h, w)
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
        if not self._uses_importance():
            return geometry_matching(metric, r, protect_first=protect_first, vote_dim=vote_dim)
        prune = self.config.reduction_mode == "prune"
        return importance_matching(metric, importance, r, protect_first=protect_first, vote_dim=vote_dim, prune=prune)

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
            else:
                metric, vote_dim = keys, -3
            if importance is not None:
                importance = importance.view(batch, patches_per_frame, frames).mean(dim=1)
            matching = self._match(metric, importance, frame_reduction, protect_first=False, vote_dim=vote_dim)
            merged, sizes = merge_tokens(patches.reshape(batch, frames, -1), sizes, matching)
            frames = merged.shape[1]
            patches = merged.view(batch, frames, patches_per_frame, hidden)
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
            patches, sizes = merge_tokens(patches, sizes.unsqueeze(-1), matching)
            sizes = sizes.squeeze(-1)
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
            tokens, token_sizes = merge_tokens(tokens, token_sizes.unsqueeze(-1), matching)
            token_sizes = token_sizes.squeeze(-1)
            if source_map is not None:
                slots = output_slot_of_inputs(matching, num_tokens + 1)[:, 1:] - 1  # drop CLS; pruned stay < 0
                source_map = _follow_patch_merge(source_map, slots.unsqueeze(1), num_tokens, tokens.shape[1] - 1)
        tokens = tokens + drop_path(self.mlp(self.layer_norm2(tokens)), rate, training)
        cls, patches = tokens[:, :1], tokens[:, 1:].unsqueeze(1)
        return cls, patches, token_sizes[:, 1:].unsqueeze(1), source_map


# ----------------------------------------------------------------------------------------------------------------------
# Pre-trained models
# ----------------------------------------------------------------------------------------------------------------------


class TestaPreTrainedModel(PreTrainedModel):
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
        sizes = patches.new_ones(patches.shape[:3], dtype=torch.float32)
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


__all__ = ["TestaPreTrainedModel", "TestaVisionModel", "TestaVisionModelOutput", "token_schedule"]
