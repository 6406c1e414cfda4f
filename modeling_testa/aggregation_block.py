"""The one TESTA block: temporal (frame) and spatial (patch) aggregation around a host model's attention and MLP.

Both TESTA's own encoder (`modeling_testa_vision`) and transformers' encoders patched by `apply_testa` (`patching`)
run their blocks through the two functions here. The host supplies how its attention, norms, residual projections and
MLP are computed (a :class:`DividedHost` or a :class:`JointHost`); the block owns matching, merging, token sizes and
source tracking, so a change to the matching order or to proportional attention is made once. The settings they run
with are an :class:`.aggregation_settings.AggregationSettings` (re-exported here).

Token layout between blocks (a :class:`TokenState`):

* ``cls``: ``(B, 1, D)``, or ``None`` for hosts without a CLS token (VideoMAE);
* ``patches``: ``(B, T, L, D)`` frame-major (``T`` frames, or tubelet time slices, of ``L`` tokens). In joint mode
  (``aggregation_dims="joint"``, ToMe over all space-time tokens) all tokens form one "frame": ``(B, 1, N, D)``;
* ``sizes``: ``(B, T, L)`` input patches per token, at least fp32 (exact integers for the merge weights);
* ``source_map``: ``(B, T0, L0)`` (when tracing): for every input patch its current token ``t * L + l``, -1 = pruned.

A divided space-time block (TimeSformer, TESTA), in order:

1. temporal attention over the frames at every patch position (CLS excluded), then the temporal projection;
2. frame aggregation: ``R_T`` frames merged, all patch positions together, each with its own size weight;
3. spatial attention over ``[CLS, patches]`` of every frame; the per-frame CLS outputs are averaged;
4. patch aggregation: ``R_S`` patches merged within every frame (the CLS takes part in the split, protected);
5. MLP over all tokens.

A joint-attention block (VideoMAE, ViViT, CLIP per frame, TESTA in joint mode): attention over all tokens, then frame
aggregation of the time slices and patch aggregation within every slice (or ToMe's merging over all tokens in joint
mode), then the MLP.

Proportional attention adds ``log(size)`` to the attention logits, once something has been merged (before that every
size is 1 and the bias is zero, so it is left out).

Merge decisions are taken on the settings' ``score_grid`` (the model's rule). Where the ``fused_kernels`` option of
the runtime allows (``"auto"``: CUDA at inference; :mod:`.fused_aggregation`), a geometry matching and its merge run
as two fused kernels (`match_tokens`, `merge`); everywhere else as `aggregation`'s PyTorch functions.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .aggregation import (
    Matching,
    capped_reduction,
    follow_frame_merge,
    follow_patch_merge,
    geometry_matching,
    importance_matching,
    merge_tokens,
    output_slot_of_inputs,
    shift_protected,
)
from .aggregation_settings import AggregationSettings
from .fused_aggregation import check_option as check_fused_kernels_option
from .fused_aggregation import fused_bipartite, matches, merge_pairs, merges


class AttentionOutput(NamedTuple):
    """What a host's attention step returns to the block.

    Attributes:
        output: ``(batch, tokens, hidden)``: the residual branch, after the host's output projection (and its
            temporal projection and drop-path, where the host has them).
        keys: ``(batch, tokens, head_dim)``: the attention keys averaged over heads, the matching metric.
        importance: ``(batch, tokens)`` attention received (Eq. 1), when asked for; else None.
        weights: ``(batch, heads, tokens, tokens)`` attention probabilities, when asked for (``need_weights``) and
            the host can give them; else None.
    """

    output: torch.Tensor
    keys: torch.Tensor
    importance: torch.Tensor | None
    weights: torch.Tensor | None = None


# (layer, tokens (batch, n, hidden), logits bias (batch, 1, 1, n) or None, need_importance, need_weights)
#   -> AttentionOutput
AttentionStep = Callable[[nn.Module, torch.Tensor, torch.Tensor | None, bool, bool], AttentionOutput]


class DividedHost(NamedTuple):
    """How a divided space-time block of a host model computes its pieces. Every callable takes the layer first.

    Attributes:
        temporal: pre-norm, temporal attention, drop-path and temporal projection (the temporal residual branch).
        spatial: pre-norm, spatial attention and drop-path (the spatial residual branch).
        mlp_residual: ``(layer, tokens) -> tokens``: the MLP sub-block with its residual connection.
    """

    temporal: AttentionStep
    spatial: AttentionStep
    mlp_residual: Callable[[nn.Module, torch.Tensor], torch.Tensor]


class JointHost(NamedTuple):
    """How a joint-attention (pre-norm) block of a host model computes its pieces. Every callable takes the layer
    first.

    Attributes:
        attention: pre-norm and attention over all tokens (the residual branch, before its residual connection).
        attention_residual: ``(layer, tokens, output) -> tokens``: the attention's residual connection.
        mlp_residual: ``(layer, tokens) -> tokens``: the MLP sub-block with its residual connection.
    """

    attention: AttentionStep
    attention_residual: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    mlp_residual: Callable[[nn.Module, torch.Tensor], torch.Tensor]


class TokenState(NamedTuple):
    """The tokens between blocks (see the module docstring for the layout); ``merged``: whether any block has merged
    or pruned tokens yet (proportional attention starts then)."""

    cls: torch.Tensor | None
    patches: torch.Tensor
    sizes: torch.Tensor
    source_map: torch.Tensor | None
    merged: bool = False


def initial_state(
    cls: torch.Tensor | None, patches: torch.Tensor, settings: AggregationSettings
) -> TokenState:
    """The state before the first block, from ``patches (B, T, L, D)``. In joint mode the patches are laid out as one
    frame of ``T * L`` tokens; the source map (when tracing) keeps the ``(B, T, L)`` input grid."""
    batch, frames, per_frame = patches.shape[:3]
    # sizes stay at least fp32 (exact integers for the merge weights) and follow a float64 model
    sizes = patches.new_ones((batch, frames, per_frame), dtype=torch.promote_types(patches.dtype, torch.float32))
    source_map = None
    if settings.trace_source:
        source_map = torch.arange(frames * per_frame, device=patches.device).view(1, frames, per_frame)
        source_map = source_map.expand(batch, -1, -1).contiguous()
    if settings.aggregation_dims == "joint":
        patches, sizes = patches.flatten(1, 2).unsqueeze(1), sizes.flatten(1).unsqueeze(1)
    return TokenState(cls=cls, patches=patches, sizes=sizes, source_map=source_map)


def size_bias(settings: AggregationSettings, sizes: torch.Tensor, dtype: torch.dtype, merged: bool):
    """Proportional attention: ``log(size)`` added to the logits of every key, ``(batch, 1, 1, keys)``; None when it
    is off or before anything was merged (all sizes are 1)."""
    if not (settings.proportional_attention and merged):
        return None
    return sizes.log().to(dtype)[:, None, None, :]


def match_tokens(
    settings: AggregationSettings,
    metric: torch.Tensor,
    importance: torch.Tensor | None,
    r: int,
    protect_first: bool,
    vote_dim: int | None = None,
    fused_kernels: str = "auto",
) -> Matching:
    """The matching of the configured strategy (geometry, importance or pruning), on scores snapped to
    ``settings.score_grid``. ``vote_dim`` marks per-position frame scores, which are decided by
    ``settings.frame_matching``. The released rule (``"original"``) is passed for patches too: it decides on raw
    scores, the others on snapped ones (`aggregation.FRAME_VOTES`). A geometry matching without ``vote_dim`` is one
    fused kernel where ``fused_kernels`` allows (`fused_aggregation.matches`)."""
    released = settings.frame_matching == "original"
    vote = settings.frame_matching if vote_dim is not None or released else "vote"
    grid = 0.0 if released else settings.score_grid
    if not settings.uses_importance:
        if vote_dim is None and matches(metric, r, int(protect_first), fused_kernels):
            return Matching(bipartite=fused_bipartite(metric, r, int(protect_first), grid))
        return geometry_matching(metric, r, protect_first=protect_first, vote_dim=vote_dim, vote=vote,
                                 score_grid=grid)
    prune = settings.reduction_mode == "prune"
    return importance_matching(
        metric, importance, r, protect_first=protect_first, vote_dim=vote_dim, prune=prune, vote=vote,
        score_grid=grid,
    )


def merge(x: torch.Tensor, size: torch.Tensor, matching: Matching, fused_kernels: str = "auto"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`aggregation.merge_tokens`, or for a geometry matching one fused kernel where ``fused_kernels`` allows
    (`fused_aggregation.merges`: computed in fp32 and rounded once, for a bf16 model within one bf16 step, at the
    features' magnitude, of the PyTorch path, which rounds every step)."""
    if matching.bipartite is not None and merges(x, size, fused_kernels):
        return merge_pairs(x, size, matching.bipartite)
    return merge_tokens(x, size, matching)


def match_frames(
    settings: AggregationSettings, keys: torch.Tensor, importance: torch.Tensor | None, r: int,
    fused_kernels: str = "auto",
) -> Matching:
    """Frame aggregation from per-position keys ``(B, L, T, C)`` and importance ``(B, L, T)`` or None.

    With ``frame_matching="mean"`` a frame token is the mean of the frame's patch keys (the paper's definition);
    with ``"vote"``/``"original"`` every patch position compares the frames and the positions decide."""
    if settings.frame_matching == "mean":
        metric, vote_dim = keys.mean(dim=1), None
    else:
        metric, vote_dim = keys, -3
    if importance is not None:
        importance = importance.mean(dim=1)
    return match_tokens(settings, metric, importance, r, protect_first=False, vote_dim=vote_dim,
                        fused_kernels=fused_kernels)


def _attend(step: AttentionStep, layer: nn.Module, tokens: torch.Tensor, bias: torch.Tensor | None, merges: bool,
            settings: AggregationSettings, attentions: list | None) -> AttentionOutput:
    """Runs a host's attention step, asking for Eq. 1 importance only when the block merges after it (``merges``)
    by importance, and for the attention probabilities only when the caller collects them (``attentions``)."""
    return step(layer, tokens, bias, merges and settings.uses_importance, attentions is not None)


def _follow_frames(matching: Matching, frames_in: int, source_map, patches_per_frame: int):
    if source_map is None:
        return None
    return follow_frame_merge(source_map, output_slot_of_inputs(matching, frames_in), patches_per_frame)


def _follow_patches(matching: Matching, patches_in: int, patches_out: int, source_map):
    if source_map is None:
        return None
    return follow_patch_merge(source_map, output_slot_of_inputs(matching, patches_in), patches_in, patches_out)


def divided_block(
    host: DividedHost,
    layer: nn.Module,
    settings: AggregationSettings,
    index: int,
    state: TokenState,
    attentions: list | None = None,
    fused_kernels: str = "auto",
) -> TokenState:
    """One divided space-time block with TESTA's aggregation (the five steps of the module docstring). With an
    ``attentions`` list, appends the block's ``(temporal, spatial)`` attention probabilities: temporal
    ``(batch * patches, heads, frames, frames)`` before the frame merge, spatial
    ``(batch * frames', heads, 1 + patches, 1 + patches)`` after it. ``fused_kernels``: the runtime's option
    (`fused_aggregation.FUSED_KERNELS`)."""
    check_fused_kernels_option(fused_kernels)
    cls, patches, sizes, source_map, merged = state
    batch, frames, patches_per_frame, hidden = patches.shape
    r_t, r_s = settings.reductions(index)

    # 1. Temporal attention: every patch position attends over the frames (CLS excluded, as in TimeSformer).
    frame_reduction = capped_reduction(r_t, frames, protected=1)
    temporal_in = patches.transpose(1, 2).reshape(batch * patches_per_frame, frames, hidden)
    temporal_bias = None
    if settings.proportional_attention and merged:  # sizes are rearranged only when the bias needs them
        temporal_bias = size_bias(
            settings, sizes.transpose(1, 2).reshape(batch * patches_per_frame, frames), patches.dtype, merged
        )
    temporal = _attend(host.temporal, layer, temporal_in, temporal_bias, frame_reduction > 0, settings, attentions)
    patches = patches + temporal.output.view(batch, patches_per_frame, frames, hidden).transpose(1, 2)

    # 2. Frame aggregation: whole frames merge, every patch position with its own size weight.
    if frame_reduction > 0:
        keys = temporal.keys.view(batch, patches_per_frame, frames, -1)
        importance = temporal.importance
        if importance is not None:
            importance = importance.view(batch, patches_per_frame, frames)
        matching = match_frames(settings, keys, importance, frame_reduction, fused_kernels)
        patches, sizes = merge(patches, sizes, matching, fused_kernels)
        source_map = _follow_frames(matching, frames, source_map, patches_per_frame)
        frames, merged = patches.shape[1], True

    # 3. Spatial attention over [CLS, patches] of every frame; the CLS outputs are averaged over the frames.
    patch_reduction = capped_reduction(r_s, patches_per_frame + 1, protected=1)
    spatial_in = torch.cat([cls.unsqueeze(1).expand(-1, frames, -1, -1), patches], dim=2)
    spatial_in = spatial_in.view(batch * frames, patches_per_frame + 1, hidden)
    spatial_bias = None
    if settings.proportional_attention and merged:  # the CLS counts 1
        spatial_sizes = F.pad(sizes, (1, 0), value=1.0).view(batch * frames, patches_per_frame + 1)
        spatial_bias = size_bias(settings, spatial_sizes, patches.dtype, merged)
    spatial = _attend(host.spatial, layer, spatial_in, spatial_bias, patch_reduction > 0, settings, attentions)
    if attentions is not None:
        attentions.append((temporal.weights, spatial.weights))
    residual = spatial.output.view(batch, frames, patches_per_frame + 1, hidden)
    cls = cls + residual[:, :, 0].mean(dim=1, keepdim=True)
    patches = patches + residual[:, :, 1:]

    # 4. Patch aggregation within every frame (the CLS takes part in the split but is protected).
    if patch_reduction > 0:
        keys = spatial.keys.view(batch, frames, patches_per_frame + 1, -1)
        importance = spatial.importance
        if importance is not None:
            importance = importance.view(batch, frames, patches_per_frame + 1)
        matching = shift_protected(match_tokens(settings, keys, importance, patch_reduction, protect_first=True,
                                                fused_kernels=fused_kernels))
        patches, sizes = merge(patches, sizes, matching, fused_kernels)
        source_map = _follow_patches(matching, patches_per_frame, patches.shape[2], source_map)
        patches_per_frame, merged = patches.shape[2], True

    # 5. MLP over all tokens.
    tokens = host.mlp_residual(layer, torch.cat([cls, patches.flatten(1, 2)], dim=1))
    cls, patches = tokens[:, :1], tokens[:, 1:].view(batch, frames, patches_per_frame, hidden)
    return TokenState(cls, patches, sizes, source_map, merged)


def joint_block(
    host: JointHost,
    layer: nn.Module,
    settings: AggregationSettings,
    index: int,
    state: TokenState,
    attentions: list | None = None,
    fused_kernels: str = "auto",
) -> TokenState:
    """One joint-attention block: attention over ``[CLS?, all tokens]``, then TESTA's aggregation (time slices, then
    tokens within every slice) or, in joint mode, ToMe's merging over all tokens, then the MLP. With an
    ``attentions`` list, appends the block's ``(None, attention probabilities (batch, heads, tokens, tokens))``,
    taken before the block merges. ``fused_kernels``: the runtime's option (`fused_aggregation.FUSED_KERNELS`)."""
    check_fused_kernels_option(fused_kernels)
    cls, patches, sizes, source_map, merged = state
    batch, frames, per_frame, hidden = patches.shape
    has_cls, first = cls is not None, int(cls is not None)
    joint = settings.aggregation_dims == "joint"
    r_t, r_s = settings.reductions(index)
    frame_reduction = 0 if joint else capped_reduction(r_t, frames, protected=1)
    patch_reduction = capped_reduction(r_s, per_frame + first, protected=first)

    tokens, token_sizes = patches.reshape(batch, frames * per_frame, hidden), sizes.reshape(batch, -1)
    needs_token_sizes = (settings.proportional_attention and merged) or (joint and patch_reduction > 0)
    if has_cls:
        tokens = torch.cat([cls, tokens], dim=1)
        if needs_token_sizes:  # padded only for the bias or the joint merge
            token_sizes = F.pad(token_sizes, (1, 0), value=1.0)
    attention = _attend(host.attention, layer, tokens, size_bias(settings, token_sizes, tokens.dtype, merged),
                        frame_reduction > 0 or patch_reduction > 0, settings, attentions)
    if attentions is not None:
        attentions.append((None, attention.weights))
    tokens = host.attention_residual(layer, tokens, attention.output)
    keys, importance = attention.keys, attention.importance

    if joint and patch_reduction > 0:  # ToMe: all space-time tokens at once (frames == 1 here)
        matching = match_tokens(settings, keys, importance, patch_reduction, protect_first=has_cls,
                                fused_kernels=fused_kernels)
        tokens, token_sizes = merge(tokens, token_sizes, matching, fused_kernels)
        if source_map is not None:
            slots = output_slot_of_inputs(matching, per_frame + first)
            slots = slots[:, 1:] - 1 if has_cls else slots  # pruned slots stay < 0
            source_map = follow_patch_merge(source_map, slots.unsqueeze(1), per_frame, tokens.shape[1] - first)
        sizes, per_frame, merged = token_sizes[:, first:].unsqueeze(1), tokens.shape[1] - first, True
    elif frame_reduction > 0 or patch_reduction > 0:
        cls_token = tokens[:, :1]
        patches = tokens[:, first:].view(batch, frames, per_frame, hidden)
        patch_keys = keys[:, first:].view(batch, frames, per_frame, -1)
        patch_importance = importance[:, first:].view(batch, frames, per_frame) if importance is not None else None
        if frame_reduction > 0:  # time slices, every position with its own size weight
            slice_importance = patch_importance.transpose(1, 2) if patch_importance is not None else None
            matching = match_frames(settings, patch_keys.transpose(1, 2), slice_importance, frame_reduction,
                                    fused_kernels)
            patch_keys = merge(patch_keys, sizes, matching, fused_kernels)[0]  # the step below matches merged keys
            if patch_importance is not None:
                patch_importance = merge(patch_importance.unsqueeze(-1), sizes, matching, fused_kernels)[0].squeeze(-1)
            patches, sizes = merge(patches, sizes, matching, fused_kernels)
            source_map = _follow_frames(matching, frames, source_map, per_frame)
            frames = patches.shape[1]
        if patch_reduction > 0:  # tokens within every time slice
            metric, slice_importance = patch_keys, patch_importance
            if has_cls:  # the CLS takes part in every slice's split, protected, as in TESTA's spatial step
                metric = torch.cat([keys[:, None, :1].expand(-1, frames, -1, -1), patch_keys], dim=2)
                if patch_importance is not None:
                    cls_importance = importance[:, None, :1].expand(-1, frames, -1)
                    slice_importance = torch.cat([cls_importance, patch_importance], dim=2)
            matching = match_tokens(settings, metric, slice_importance, patch_reduction, protect_first=has_cls,
                                    fused_kernels=fused_kernels)
            if has_cls:
                matching = shift_protected(matching)
            patches, sizes = merge(patches, sizes, matching, fused_kernels)
            source_map = _follow_patches(matching, per_frame, patches.shape[2], source_map)
            per_frame = patches.shape[2]
        tokens = patches.flatten(1, 2)
        if has_cls:
            tokens = torch.cat([cls_token, tokens], dim=1)
        merged = True
    tokens = host.mlp_residual(layer, tokens)
    cls = tokens[:, :1] if has_cls else None
    return TokenState(cls, tokens[:, first:].view(batch, frames, per_frame, hidden), sizes, source_map, merged)


def token_sizes_with_cls(state: TokenState) -> torch.Tensor:
    """``(batch, tokens)`` sizes of the output sequence ``[CLS?, patches frame-major]`` (a CLS counts 1)."""
    sizes = state.sizes.flatten(1)
    return sizes if state.cls is None else F.pad(sizes, (1, 0), value=1.0)


def weighted_token_mean(tokens: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The ``(batch, hidden)`` mean of ``tokens`` ``(batch, tokens, hidden)`` weighted by how many input patches each
    stands for (``sizes``, ``(batch, tokens)``): with nothing merged, the plain mean."""
    weights = sizes.to(tokens.dtype).unsqueeze(-1)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1)


def sequence(state: TokenState) -> torch.Tensor:
    """The output sequence ``[CLS?, patches frame-major]``, ``(batch, tokens, hidden)``."""
    tokens = state.patches.flatten(1, 2)
    return tokens if state.cls is None else torch.cat([state.cls, tokens], dim=1)


def with_sequence(state: TokenState, tokens: torch.Tensor) -> TokenState:
    """The state whose tokens are views of ``tokens`` (laid out as `sequence` gives them), so that later blocks
    compute from ``tokens`` itself: returned hidden states are then part of the graph and receive gradients."""
    first = 0 if state.cls is None else state.cls.shape[1]
    cls = None if state.cls is None else tokens[:, :first]
    return state._replace(cls=cls, patches=tokens[:, first:].view(state.patches.shape))


__all__ = [
    "AggregationSettings",
    "AttentionOutput",
    "DividedHost",
    "JointHost",
    "TokenState",
    "divided_block",
    "initial_state",
    "joint_block",
    "match_frames",
    "match_tokens",
    "merge",
    "sequence",
    "size_bias",
    "token_sizes_with_cls",
    "weighted_token_mean",
    "with_sequence",
]
