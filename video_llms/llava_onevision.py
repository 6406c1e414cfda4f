"""TESTA inside LLaVA-OneVision's SigLIP vision tower (issue 51), training-free, on transformers 5.24.

``apply_testa(model, processor=processor, ...)`` (or `video_llms.apply_testa_to_video_llm`) hands the model to
:class:`LlavaOnevisionAdapter`, which patches two *instances*, never a class, through the model's
`common.InstancePatch`:

* the model's ``LlavaOnevisionModel.get_video_features`` (``LlavaOnevisionForConditionalGeneration`` delegates to it),
  which then runs the SigLIP tower block by block with TESTA's aggregation (:func:`siglip_block`);
* the processor's ``replace_video_token`` (and ``_get_num_multimodal_tokens``, which serving engines read), which then
  emit the reduced number of ``<video>`` placeholders, so that ``processor(text=..., videos=..., return_tensors="pt")``
  followed by ``model.generate(**inputs)`` works unchanged.

``remove_testa(model)`` puts back exactly what was there (the class's methods again, or the instance attributes found
before patching). Images (``get_image_features``) run through the unpatched tower.

**Where the aggregation acts.** LLaVA-OneVision folds a video's frames into the tower's batch and SigLIP attends
within each frame, so a block is: per-frame attention, then (TESTA's order) frame aggregation, then patch aggregation
within every frame, then the MLP. Frame aggregation merges whole frames of one video by TESTA's bipartite matching on
the frame tokens (the mean of a frame's attention keys, ``frame_matching="mean"``), every patch position averaged with
its own size weight (`modeling_testa.aggregation_block.match_frames`, `merge`): merged frames are just fewer rows of
the tower's batch. The frames stay in temporal order (a merged frame takes the place of the frame it merged into,
:func:`in_input_order`), since the LLM reads time from their order. Patch aggregation merges ``R_S`` tokens within
every frame (`match_tokens`), no token protected (SigLIP has no CLS).

**Downstream.** ``apply_pooling`` reshapes every frame to the square patch grid (27x27 at 384 px), so patch merges are
undone before it (:func:`unmerge_to_grid`): every grid position gets back the token its patch ended in. Patch merges
therefore save tower compute and leave the LLM's tokens per frame as they were (196); frame merges cut both. The LLM
receives ``frames_kept * pooled^2 + 1`` video tokens (the ``+ 1`` is the one ``image_newline`` of the video), where
``frames_kept`` follows from the schedule alone (:func:`kept_frames`), which is what lets the processor emit the right
placeholder count before the tower runs.

**Settings** (:attr:`LlavaOnevisionAdapter.allowed_settings`, checked by `common.adapter_settings`): geometry or
importance matching, ``reduction_mode="merge"``, ``aggregation_dims`` ``"temporal+spatial"``, ``"temporal"`` or
``"spatial"``, every ``frame_matching``. Proportional attention (log-size logits bias, on by default here as in ToMe)
needs the SDPA or eager attention path; the flash-attention path refuses it.

**Chunks of frames.** With the adapter option ``chunk_frames`` the patch embedding and every block's attention and MLP
run over that many frames at a time; the merges run between them on all frames of the block, so the outputs are the
one-pass outputs (within rounding) and a frame merge across a chunk's edge is the one-pass merge. What a block computes
in between (attention scores, the MLP's hidden layer) then exists for one chunk at a time; the hidden states of all
frames at one block (the size of the tower's output) remain.

**Feature layer.** The LLM reads the hidden state ``vision_feature_layer`` selects (-1: the last block's output, before
``post_layernorm``). Merges in blocks after that layer change nothing the LLM sees; several layers can be selected only
if no frame merge happens between them (their frames must be the same ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionModel
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.siglip.modeling_siglip import eager_attention_forward

from modeling_testa.aggregation import (
    Matching,
    attention_received,
    capped_reduction,
    follow_frame_merge,
    follow_patch_merge,
    output_slot_of_inputs,
)
from modeling_testa.aggregation_block import AttentionOutput, TokenState, match_frames, match_tokens, merge, size_bias
from modeling_testa.aggregation_settings import AggregationSettings

from .common import GEOMETRY_MERGE_ONLY, patch_of


# ----------------------------------------------------------------------------------------------------------------------
# Pure functions: the schedule and the unmerge
# ----------------------------------------------------------------------------------------------------------------------


def hidden_state_indices(feature_layer: int | list[int], num_layers: int) -> list[int]:
    """The indices into ``(embeddings, block 1 output, ..., block N output)`` that ``vision_feature_layer`` selects
    (negative values count from the end, as transformers does); raises a ValueError naming the field when out of
    range."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    indices = []
    for layer in layers:
        index = layer if layer >= 0 else num_layers + 1 + layer
        if isinstance(layer, bool) or not 0 <= index <= num_layers:
            raise ValueError(
                f"vision_feature_layer={feature_layer!r} selects no hidden state of a {num_layers}-block tower; "
                f"allowed: -{num_layers + 1} .. {num_layers}."
            )
        indices.append(index)
    return indices


def kept_frames(settings: AggregationSettings, frames: int, hidden_index: int) -> int:
    """How many frames of a ``frames``-frame video remain in hidden state ``hidden_index`` (0: the embeddings), by the
    blocks' caps (`AggregationSettings.token_schedule`; at most ``(T - 1) // 2`` frames merged per block)."""
    if hidden_index == 0:
        return frames
    # patches per frame do not change the frame schedule; 1 keeps the call cheap
    return settings.token_schedule(frames, 1, has_cls=False)[hidden_index - 1][0]


def video_token_count(settings: AggregationSettings, frames: int, feature_layer: int | list[int],
                      num_image_tokens: int) -> int:
    """The number of ``<video>`` placeholders a patched model consumes for one video of ``frames`` frames: the kept
    frames' pooled tokens plus the one newline token, as the stock processor counts them for all frames
    (``num_image_tokens`` patches per frame, pooled to ``ceil(sqrt(num_image_tokens) / 2)`` squared)."""
    index = hidden_state_indices(feature_layer, settings.num_layers)[0]
    pooled = math.ceil(int(math.sqrt(num_image_tokens)) / 2)
    return kept_frames(settings, frames, index) * pooled * pooled + 1


def unmerge_to_grid(tokens: torch.Tensor, source_map: torch.Tensor | None) -> torch.Tensor:
    """The tokens of every remaining frame on the input patch grid, for a pooler that needs the square grid.

    Args:
        tokens: ``(B, T, L, D)``: ``T`` frames of ``L`` (merged) tokens.
        source_map: ``(B, T0, L0)``: for every input patch its current token as a flat index ``t * L + l``
            (`aggregation.follow_frame_merge` / `follow_patch_merge`), or None when nothing was merged within frames
            (then ``L`` is the grid already).

    Returns:
        ``(B, T, L0, D)``: position ``p`` of frame ``t`` is the token that patch ``p`` ended in, averaged over the input
        frames merged into ``t`` (they may have merged patch ``p`` into different tokens). Without frame merges these
        are exact copies of the tokens.
    """
    if source_map is None:
        return tokens
    batch, frames, per_frame, hidden = tokens.shape
    input_frames, grid = source_map.shape[1:]
    index = source_map.reshape(batch, input_frames * grid, 1).expand(-1, -1, hidden)
    per_input = tokens.reshape(batch, frames * per_frame, hidden).gather(1, index)
    per_input = per_input.view(batch, input_frames, grid, hidden)
    if input_frames == frames:
        return per_input
    frame_of_input = source_map[:, :, 0] // per_frame  # a frame merge moves every patch of a frame together
    summed = tokens.new_zeros(batch, frames, grid, hidden)
    summed.scatter_add_(1, frame_of_input.view(batch, input_frames, 1, 1).expand_as(per_input), per_input)
    counts = torch.zeros(batch, frames, dtype=tokens.dtype, device=tokens.device)
    counts.scatter_add_(1, frame_of_input, torch.ones_like(frame_of_input, dtype=tokens.dtype))
    return summed / counts.view(batch, frames, 1, 1)


def in_input_order(matching: Matching) -> Matching:
    """The same merges with the output tokens in input order (a merged token takes the place of the token it merged
    into), where TESTA's bipartite order is ``[unmerged A, B]``. Frames go to the LLM in this order, and its positions
    say time: a geometry frame matching would otherwise send the frames out of temporal order."""
    kept, order = matching.kept.sort(dim=-1)  # new slot j holds old slot order[j]
    new_slot = order.argsort(dim=-1)
    return Matching(kept=kept, sources=matching.sources, targets=new_slot.gather(-1, matching.targets))


# ----------------------------------------------------------------------------------------------------------------------
# The SigLIP block with TESTA's aggregation
# ----------------------------------------------------------------------------------------------------------------------


def siglip_attention(layer: nn.Module, rows: torch.Tensor, bias: torch.Tensor | None,
                     need_importance: bool) -> AttentionOutput:
    """``SiglipEncoderLayer``'s pre-norm attention branch on ``(frames, tokens, hidden)`` rows, through the attention
    implementation the tower is configured with, plus the keys averaged over heads (the matching metric) and, when
    asked for, the attention every token receives (Eq. 1). ``bias``: the proportional-attention logits bias
    ``(frames, 1, 1, tokens)`` or None."""
    attention = layer.self_attn
    hidden = layer.layer_norm1(rows)
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    queries = attention.q_proj(hidden).view(shape).transpose(1, 2)
    keys = attention.k_proj(hidden).view(shape).transpose(1, 2)
    values = attention.v_proj(hidden).view(shape).transpose(1, 2)
    implementation = attention.config._attn_implementation
    if bias is not None and implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"proportional_attention=True adds a logits bias, which attn_implementation={implementation!r} cannot "
            "take; use 'sdpa' or 'eager', or apply TESTA with proportional_attention=False."
        )
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    context, _ = interface(
        attention, queries, keys, values, bias, is_causal=False, scaling=attention.scale,
        dropout=0.0 if not attention.training else attention.dropout,
    )
    output = attention.out_proj(context.reshape(*hidden.shape[:-1], -1).contiguous())
    importance = attention_received(queries, keys, attention.scale, bias) if need_importance else None
    return AttentionOutput(output, keys.mean(dim=1), importance)


def by_frame_chunks(function: Callable, inputs: tuple[torch.Tensor, ...], chunk_frames: int | None
                    ) -> tuple[torch.Tensor | None, ...]:
    """``function(*inputs)`` computed over chunks of ``chunk_frames`` rows (frames) of ``inputs`` at a time, its outputs
    (a tuple of tensors, or None) written into one tensor each: what a chunk computes in between (attention scores, the
    MLP's hidden layer) exists for one chunk only. ``chunk_frames=None`` (or a chunk as large as the input) calls
    ``function`` once on everything."""
    rows = inputs[0].shape[0]
    if chunk_frames is None or rows <= chunk_frames:
        return function(*inputs)
    outputs = None
    for start in range(0, rows, chunk_frames):
        pieces = function(*(x[start:start + chunk_frames] for x in inputs))
        if outputs is None:
            outputs = tuple(None if p is None else p.new_empty((rows, *p.shape[1:])) for p in pieces)
        for output, piece in zip(outputs, pieces):
            if output is not None:
                output[start:start + piece.shape[0]] = piece
    return outputs


def siglip_block(layer: nn.Module, settings: AggregationSettings, index: int, state: TokenState,
                 chunk_frames: int | None = None) -> TokenState:
    """One ``SiglipEncoderLayer`` over the frames of ``state.patches`` ``(B videos, T, L, D)``: attention within every
    frame, then frame aggregation (R_T whole frames of each video), then patch aggregation (R_S tokens within every
    frame), then the MLP. With nothing to merge and no bias it computes what the layer computes.

    ``chunk_frames``: the attention and the MLP run over that many frames at a time (:func:`by_frame_chunks`); the
    merges run between them on all frames of the block, so a frame merge across a chunk's edge is the one-pass merge.
    """
    patches, sizes, source_map, merged = state.patches, state.sizes, state.source_map, state.merged
    batch, frames, per_frame, hidden = patches.shape
    r_t, r_s = settings.reductions(index)
    frame_reduction = capped_reduction(r_t, frames, protected=1)
    patch_reduction = capped_reduction(r_s, per_frame, protected=0)
    reduces = frame_reduction > 0 or patch_reduction > 0

    def attention_residual(rows: torch.Tensor, row_sizes: torch.Tensor):
        bias = size_bias(settings, row_sizes, rows.dtype, merged)
        attention = siglip_attention(layer, rows, bias, reduces and settings.uses_importance)
        return rows + attention.output, attention.keys, attention.importance

    rows, keys, importance = by_frame_chunks(
        attention_residual,
        (patches.reshape(batch * frames, per_frame, hidden), sizes.reshape(batch * frames, per_frame)),
        chunk_frames,
    )

    if reduces:
        patches = rows.view(batch, frames, per_frame, hidden)
        keys = keys.view(batch, frames, per_frame, -1)
        if importance is not None:
            importance = importance.view(batch, frames, per_frame)
        if frame_reduction > 0:
            frame_importance = None if importance is None else importance.transpose(1, 2)
            matching = in_input_order(match_frames(settings, keys.transpose(1, 2), frame_importance, frame_reduction))
            keys = merge(keys, sizes, matching)[0]  # the patch step below matches the merged frames' keys
            if importance is not None:
                importance = merge(importance.unsqueeze(-1), sizes, matching)[0].squeeze(-1)
            patches, sizes = merge(patches, sizes, matching)
            if source_map is not None:
                source_map = follow_frame_merge(source_map, output_slot_of_inputs(matching, frames), per_frame)
            frames = patches.shape[1]
        if patch_reduction > 0:
            matching = match_tokens(settings, keys, importance, patch_reduction, protect_first=False)
            patches, sizes = merge(patches, sizes, matching)
            if source_map is not None:
                slots = output_slot_of_inputs(matching, per_frame)
                source_map = follow_patch_merge(source_map, slots, per_frame, patches.shape[2])
            per_frame = patches.shape[2]
        rows, merged = patches.reshape(batch * frames, per_frame, hidden), True

    rows = by_frame_chunks(lambda part: (part + layer.mlp(layer.layer_norm2(part)),), (rows,), chunk_frames)[0]
    return TokenState(None, rows.view(batch, frames, per_frame, hidden), sizes, source_map, merged)


def run_block(layer: nn.Module, settings: AggregationSettings, index: int, state: TokenState,
              chunk_frames: int | None = None) -> TokenState:
    """:func:`siglip_block`, under activation checkpointing when the layer has it switched on (training)."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(siglip_block, layer, settings, index, state, chunk_frames,
                                                 use_reentrant=False)
    return siglip_block(layer, settings, index, state, chunk_frames)


def encode_video_frames(tower: nn.Module, pixel_values_videos: torch.Tensor, settings: AggregationSettings,
                        hidden_indices: list[int], all_hidden_states: bool = False, chunk_frames: int | None = None
                        ) -> tuple[list[TokenState], TokenState, tuple | None]:
    """Runs the SigLIP ``tower`` over videos ``(B, T, C, H, W)`` with TESTA's aggregation, the patch embedding and
    every block's attention and MLP over ``chunk_frames`` frames at a time (None: all at once).

    Returns the states at ``hidden_indices`` (0: the embeddings), the state after the last block and, with
    ``all_hidden_states``, every hidden state as the tower's rows ``(B * T_k, L_k, D)``.
    """
    batch, frames = pixel_values_videos.shape[:2]
    pixels = pixel_values_videos.reshape(batch * frames, *pixel_values_videos.shape[2:])
    embeddings = by_frame_chunks(lambda part: (tower.embeddings(part),), (pixels,), chunk_frames)[0]
    per_frame, hidden = embeddings.shape[1:]
    patches = embeddings.view(batch, frames, per_frame, hidden)
    sizes = patches.new_ones((batch, frames, per_frame), dtype=torch.promote_types(patches.dtype, torch.float32))
    deepest = max(hidden_indices)
    source_map = None
    if any(settings.spatial_reduction[:deepest]):  # the pooler needs the grid back: follow every patch
        source_map = torch.arange(frames * per_frame, device=patches.device).view(1, frames, per_frame)
        source_map = source_map.expand(batch, -1, -1).contiguous()
    state = TokenState(None, patches, sizes, source_map)
    selected = [state] if 0 in hidden_indices else []
    rows = lambda s: s.patches.flatten(0, 1)  # noqa: E731
    all_hidden = (rows(state),) if all_hidden_states else None
    for index, layer in enumerate(tower.encoder.layers):
        state = run_block(layer, settings, index, state, chunk_frames)
        if index + 1 in hidden_indices:
            selected.append(state)
        if all_hidden_states:
            all_hidden += (rows(state),)
    by_index = dict(zip(sorted(set(hidden_indices)), selected))
    return [by_index[i] for i in hidden_indices], state, all_hidden


# ----------------------------------------------------------------------------------------------------------------------
# The patched instance methods
# ----------------------------------------------------------------------------------------------------------------------


def video_features_method(settings: AggregationSettings, chunk_frames: int | None) -> Callable:
    """The patched ``get_video_features``: stock's signature and output (``pooler_output``: ``(B, kept frames *
    pooled + 1, text hidden)``), with the tower run by :func:`encode_video_frames` (``chunk_frames`` at a time)."""

    def get_video_features(self, pixel_values_videos: torch.Tensor, vision_feature_layer=None,
                           vision_feature_select_strategy=None, **kwargs):
        feature_layer = self.config.vision_feature_layer if vision_feature_layer is None else vision_feature_layer
        strategy = vision_feature_select_strategy or self.config.vision_feature_select_strategy
        return_dict = kwargs.pop("return_dict", None)  # as stock (`can_return_tuple`): else the config's
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if kwargs.pop("output_attentions", False):
            raise ValueError(
                "A LLaVA-OneVision model patched with TESTA runs its tower block by block and returns no attention "
                "weights; call remove_testa(model) to get them."
            )
        output_hidden_states = kwargs.pop("output_hidden_states", None)
        if output_hidden_states is None:  # as stock: the tower's config decides when the call does not
            output_hidden_states = self.vision_tower.config.output_hidden_states
        output_hidden_states = output_hidden_states is True
        if pixel_values_videos.ndim != 5:
            raise ValueError(
                "pixel_values_videos must be (batch, frames, channels, height, width); got "
                f"{tuple(pixel_values_videos.shape)}."
            )
        tower = self.vision_tower
        indices = hidden_state_indices(feature_layer, len(tower.encoder.layers))
        selected, last, all_hidden = encode_video_frames(
            tower, pixel_values_videos, settings, indices, output_hidden_states, chunk_frames
        )
        grids = [unmerge_to_grid(state.patches, state.source_map) for state in selected]
        frame_counts = {grid.shape[1] for grid in grids}
        if len(frame_counts) != 1:
            raise ValueError(
                f"vision_feature_layer={feature_layer!r} selects hidden states with different frames "
                f"({sorted(frame_counts)}): a frame merge happens between them. Merge frames only after the deepest "
                "selected layer's block or before the shallowest."
            )
        features = torch.cat(grids, dim=-1)
        batch, frames = features.shape[:2]
        features = features.flatten(0, 1)
        if strategy == "default":
            features = features[:, 1:]
        video_features = self.apply_pooling(self.multi_modal_projector(features))
        video_features = video_features.reshape(batch, frames * video_features.shape[1], -1)
        newline = self.image_newline[None, None, :].repeat(batch, 1, 1).to(video_features.device)
        output = BaseModelOutputWithPooling(
            last_hidden_state=tower.post_layernorm(last.patches.flatten(0, 1)),
            pooler_output=torch.cat((video_features, newline), dim=1),
            hidden_states=all_hidden,
        )
        return output if return_dict else output.to_tuple()

    return get_video_features


def frames_of(video_inputs: dict, video_idx: int) -> int:
    """The frame count of processed video ``video_idx``, read as the stock processor reads it."""
    processed = video_inputs["pixel_values_videos"][video_idx]
    return len(processed) if isinstance(processed, (list, tuple)) else processed.shape[0]


def placeholder_methods(base: nn.Module, settings: AggregationSettings, previous_counts: Callable
                        ) -> dict[str, Callable]:
    """The processor's patched ``replace_video_token`` and ``_get_num_multimodal_tokens`` for the patched
    ``LlavaOnevisionModel`` ``base`` (the latter calls the one found before patching, ``previous_counts``, and
    replaces its video counts)."""

    def count(frames: int, num_image_tokens: int) -> int:
        return video_token_count(settings, frames, base.config.vision_feature_layer, num_image_tokens)

    def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
        return self.video_token * count(frames_of(video_inputs, video_idx), self.num_image_tokens)

    def multimodal_token_counts(self, image_sizes=None, video_sizes=None, **kwargs):
        data = previous_counts(image_sizes=image_sizes, video_sizes=video_sizes, **kwargs)
        if video_sizes is not None:
            data.num_video_tokens = [count(frames, self.num_image_tokens) for frames, _, _ in video_sizes]
        return data

    return {"replace_video_token": replace_video_token, "_get_num_multimodal_tokens": multimodal_token_counts}


# ----------------------------------------------------------------------------------------------------------------------
# The adapter
# ----------------------------------------------------------------------------------------------------------------------


def base_model_of(model: nn.Module) -> nn.Module:
    """The ``LlavaOnevisionModel`` of ``model`` (itself, or a ``LlavaOnevisionForConditionalGeneration``'s
    ``.model``); raises a TypeError naming the class otherwise."""
    if isinstance(model, LlavaOnevisionForConditionalGeneration):
        return model.model
    if isinstance(model, LlavaOnevisionModel):
        return model
    raise TypeError(
        f"The LLaVA-OneVision adapter supports LlavaOnevisionForConditionalGeneration and LlavaOnevisionModel (and "
        f"their subclasses); got {type(model).__name__}."
    )


def check_feature_layer(settings: AggregationSettings, feature_layer: int | list[int]) -> None:
    """Raises a ValueError naming ``vision_feature_layer`` when it selects several hidden states with a frame merge
    between them (their frames would differ)."""
    indices = hidden_state_indices(feature_layer, settings.num_layers)
    frames = {kept_frames(settings, 1 << 20, index) for index in indices}  # a long video shows any frame merge
    if len(frames) != 1:
        raise ValueError(
            f"vision_feature_layer={feature_layer!r} selects several hidden states with a frame merge between them "
            f"(temporal_reduction={list(settings.temporal_reduction)}); their frames would differ."
        )


class LlavaOnevisionAdapter:
    """TESTA for ``LlavaOnevisionForConditionalGeneration`` and ``LlavaOnevisionModel`` (see the module docstring)."""

    name = "llava_onevision"
    classes = ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionModel")
    allowed_settings = {
        # SigLIP's attention is run here block by block, so importance (Eq. 1) and a logits bias are available
        "reduction_mode": (("merge",), "its pooler needs every patch of the grid, which a pruned token no longer "
                                       "covers"),
        "aggregation_dims": (GEOMETRY_MERGE_ONLY["aggregation_dims"][0],
                             "SigLIP attends within each frame, so tokens of different frames never meet"),
        "trace_source": GEOMETRY_MERGE_ONLY["trace_source"],
    }
    settings_defaults = {"proportional_attention": True}  # merged tokens weigh as many patches in attention, as ToMe
    options = ("chunk_frames",)

    def supports(self, model: nn.Module) -> bool:
        """Whether ``model`` is a LLaVA-OneVision model (or a subclass)."""
        return isinstance(model, (LlavaOnevisionForConditionalGeneration, LlavaOnevisionModel))

    def num_blocks(self, model: nn.Module) -> int:
        """The SigLIP tower's blocks (the length of a per-block schedule)."""
        return len(base_model_of(model).vision_tower.encoder.layers)

    def apply(self, model: nn.Module, processor: Any, settings: AggregationSettings) -> None:
        """Patches ``model``'s ``get_video_features`` and (unless None) ``processor``'s placeholder count, through
        ``patch_of(model)``, whose ``chunk_frames`` sets the frames through the tower at a time (the same outputs;
        see :func:`siglip_block`)."""
        base = base_model_of(model)
        check_feature_layer(settings, base.config.vision_feature_layer)
        patch = patch_of(model)
        patch.replace_method(base, "get_video_features", video_features_method(settings, patch.chunk_frames))
        if processor is not None:
            previous_counts = processor._get_num_multimodal_tokens
            for name, method in placeholder_methods(base, settings, previous_counts).items():
                patch.replace_method(processor, name, method)


__all__ = [
    "LlavaOnevisionAdapter",
    "encode_video_frames",
    "hidden_state_indices",
    "in_input_order",
    "kept_frames",
    "siglip_block",
    "unmerge_to_grid",
    "video_token_count",
]
