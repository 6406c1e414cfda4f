"""Training-free TESTA for transformers' own video encoders: ``apply_testa(model, ...)`` / ``remove_testa(model)``.

``apply_testa`` replaces the ``forward`` of a model *instance* (never its class, never a module-level object) with one
that runs the same weights, block by block, with TESTA's token aggregation from :mod:`.aggregation` and attention
through ``torch.nn.functional.scaled_dot_product_attention``. ``remove_testa`` puts the previous ``forward`` back.

Supported models and where the aggregation happens:

* ``TimesformerModel`` / ``TimesformerForVideoClassification`` (``attention_type="divided_space_time"``): TESTA's
  exact placement. Frame aggregation (R_T frames per block, all patch positions together) after temporal attention,
  patch aggregation (R_S patches within every frame, CLS protected) after spatial attention, then the MLP. The
  classifier reads the CLS token, as it does unpatched.
* ``VideoMAEModel`` / ``VideoMAEForVideoClassification`` and ``VivitModel`` / ``VivitForVideoClassification``
  (joint space-time attention over tubelets): after each block's attention, the tubelet *time slices* are aggregated
  (R_T slices, the frame token is the mean of the slice's keys), then the tokens within each slice (R_S), then the
  MLP. Tokens then stand for several tubelets, so proportional attention (log-size bias, ToMe) is on by default.
  ``aggregation_dims="joint"`` is ToMe's merging over all space-time tokens instead (``spatial_reduction`` tokens per
  block). VideoMAE's mean-pooling head becomes a size-weighted mean; ViViT's head reads the CLS token.
* ``CLIPVisionModel`` run frame by frame (frames in the batch axis, as CLIP4Clip-style video encoders do): patch
  aggregation within every frame, CLS protected (ToMe on each frame); it has no temporal stage, so R_T must be 0.
  For ``CLIPVisionModelWithProjection`` and ``CLIPModel`` the image tower (``.vision_model``) is patched; their
  projections read its pooled CLS as before.

At ``temporal_reduction = spatial_reduction = 0`` the patched model computes what the unpatched one computes (the
tests check 1e-5 in fp32 for every class). Outputs gain ``token_sizes`` (input patches / tubelets per output token)
and, with ``trace_source=True``, ``source_map``: for every input patch (``(batch, time slices, patches per slice)``)
the index of the output token it ended in, counted in ``last_hidden_state`` without the CLS token (-1 = pruned).
:func:`visualize_patched_aggregation` draws it with :func:`.visualization.draw_aggregation`.

Imports are sibling-relative so that the module works as Hub remote code.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from .aggregation import attention_received
from .aggregation_block import (AggregationSettings, AttentionOutput, DividedHost, JointHost, TokenState, divided_block,
                                initial_state, joint_block, sequence, token_sizes_with_cls, weighted_token_mean)
from .aggregation_settings import DEFAULTS
from .visualization import AggregationGroups, displayable_frames, draw_aggregation, frame_groups_of


# ----------------------------------------------------------------------------------------------------------------------
# Outputs and settings
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TestaPatchedModelOutput(BaseModelOutputWithPooling):
    r"""
    Output of a base encoder patched by [`apply_testa`]: the model's usual fields, plus

    Args:
        token_sizes (`torch.FloatTensor` of shape `(batch, tokens)`): how many input patches (tubelets) every token of
            `last_hidden_state` stands for; a CLS token counts 1. Without pruning they sum to the input token count.
        source_map (`torch.LongTensor` of shape `(batch, time slices, patches per slice)`, *optional*): with
            `trace_source=True`, the index of the output token (in `last_hidden_state` without its CLS token) that
            every input patch ended in; -1 where pruned.
    """

    token_sizes: torch.FloatTensor | None = None
    source_map: torch.LongTensor | None = None


@dataclass
class TestaPatchedClassifierOutput(ImageClassifierOutput):
    r"""
    Output of a video classifier patched by [`apply_testa`]: `ImageClassifierOutput` plus the encoder's `token_sizes`
    and `source_map` (see [`TestaPatchedModelOutput`]).
    """

    token_sizes: torch.FloatTensor | None = None
    source_map: torch.LongTensor | None = None


class _Family(NamedTuple):
    name: str  # "timesformer", "videomae", "vivit", "clip"
    base_attribute: str | None  # where a head model keeps its base encoder (None: the model is the base)


# Class name -> family. Matched along the MRO, so subclasses of these classes are supported too.
_SUPPORTED = {
    "TimesformerModel": _Family("timesformer", None),
    "TimesformerForVideoClassification": _Family("timesformer", "timesformer"),
    "VideoMAEModel": _Family("videomae", None),
    "VideoMAEForVideoClassification": _Family("videomae", "videomae"),
    "VivitModel": _Family("vivit", None),
    "VivitForVideoClassification": _Family("vivit", "vivit"),
    "CLIPVisionModel": _Family("clip", None),
    # CLIP4Clip-style: the image tower of CLIP; its projection reads the pooled CLS, so only the tower is patched
    "CLIPVisionModelWithProjection": _Family("clip", "vision_model"),
    "CLIPModel": _Family("clip", "vision_model"),
}

_STATE_ATTRIBUTE = "_testa_patch"


@dataclass
class _PatchState:
    settings: AggregationSettings
    family: str
    # (module, the `forward` found in the instance's __dict__ before patching, or None when there was none)
    replaced: list[tuple[nn.Module, Any]]
    # a stack of lists that the base forward appends (token_sizes, source_map) to, read by CLS-head wrappers
    captures: list[list]


def _family_of(model: nn.Module) -> _Family:
    for cls in type(model).__mro__:
        if cls.__name__ in _SUPPORTED:
            return _SUPPORTED[cls.__name__]
    raise TypeError(
        f"apply_testa does not support {type(model).__name__}. Supported classes (and their subclasses): "
        f"{', '.join(_SUPPORTED)}."
    )


def _base_of(model: nn.Module, family: _Family) -> nn.Module:
    return model if family.base_attribute is None else getattr(model, family.base_attribute)


def _layers(base: nn.Module, family: str) -> nn.ModuleList:
    if family in ("timesformer", "videomae"):
        return base.encoder.layer
    if family == "vivit":
        return base.layers
    return base.encoder.layers


def _settings_for(
    base: nn.Module, family: str, temporal_reduction, spatial_reduction, **options
) -> AggregationSettings:
    """The validated settings (`AggregationSettings` raises for impossible ones), then what this host allows."""
    proportional = options.pop("proportional_attention")
    if proportional is None:  # the paper's setting for divided attention, ToMe's for joint attention
        proportional = family != "timesformer"
    settings = AggregationSettings.for_layers(
        len(_layers(base, family)), temporal_reduction, spatial_reduction, proportional_attention=proportional,
        **options,
    )
    name = type(base).__name__
    if family == "timesformer" and getattr(base.config, "attention_type", None) != "divided_space_time":
        raise ValueError(
            f"apply_testa supports {name} with attention_type='divided_space_time' only; this model has "
            f"attention_type={base.config.attention_type!r}."
        )
    if family == "timesformer" and settings.aggregation_dims == "joint":
        raise ValueError(
            f"aggregation_dims='joint' (ToMe over all space-time tokens) needs joint space-time attention; {name} "
            "uses divided space-time attention. Use it with VideoMAE or ViViT, or pick 'temporal+spatial', "
            "'temporal' or 'spatial'."
        )
    if family == "clip" and any(settings.temporal_reduction):
        raise ValueError(
            f"{name} encodes every frame on its own and has no temporal stage: temporal_reduction must be 0; got "
            f"{temporal_reduction!r}."
        )
    return settings


# ----------------------------------------------------------------------------------------------------------------------
# Each family as a host of the one TESTA block (`aggregation_block`): its attention, norms, residuals and MLP
# ----------------------------------------------------------------------------------------------------------------------


def _sdpa(query, key, value, bias, scale, dropout, training, need_importance) -> AttentionOutput:
    """``(batch, heads, tokens, head_dim)`` q/k/v -> context ``(batch, tokens, heads * head_dim)``, keys averaged over
    heads and Eq. 1 importance (or None)."""
    context = F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, dropout_p=dropout if training else 0.0, scale=scale
    )
    batch, heads, tokens, head_dim = query.shape
    context = context.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
    importance = attention_received(query, key, scale, bias) if need_importance else None
    return AttentionOutput(context, key.mean(dim=1), importance)


def _separate_qkv_sdpa(x, projections, head_dim, bias, scale, dropout, training, need_importance) -> AttentionOutput:
    """`_sdpa` of a host with separate query, key and value linears (``projections``, in that order) over the
    normalised tokens ``x`` ``(batch, tokens, hidden)``; the host applies its output projection."""
    batch, tokens = x.shape[:2]
    query, key, value = (linear(x).view(batch, tokens, -1, head_dim).transpose(1, 2) for linear in projections)
    return _sdpa(query, key, value, bias, scale, dropout, training, need_importance)


def _timesformer_attention(attention: nn.Module, x, bias, need_importance) -> AttentionOutput:
    """``TimeSformerAttention`` (``.attention.qkv``, ``.output.dense``) through SDPA."""
    inner = attention.attention
    batch, tokens, hidden = x.shape
    qkv = inner.qkv(x).reshape(batch, tokens, 3, inner.num_heads, hidden // inner.num_heads).permute(2, 0, 3, 1, 4)
    result = _sdpa(qkv[0], qkv[1], qkv[2], bias, inner.scale, inner.attn_drop.p, attention.training, need_importance)
    return result._replace(output=attention.output(result.output))


def _timesformer_temporal(layer, x, bias, need_importance, need_weights=False) -> AttentionOutput:
    result = _timesformer_attention(layer.temporal_attention, layer.temporal_layernorm(x), bias, need_importance)
    return result._replace(output=layer.temporal_dense(layer.drop_path(result.output)))


def _timesformer_spatial(layer, x, bias, need_importance, need_weights=False) -> AttentionOutput:
    result = _timesformer_attention(layer.attention, layer.layernorm_before(x), bias, need_importance)
    return result._replace(output=layer.drop_path(result.output))


TIMESFORMER_HOST = DividedHost(
    temporal=_timesformer_temporal,
    spatial=_timesformer_spatial,
    mlp_residual=lambda layer, x: x + layer.drop_path(layer.output(layer.intermediate(layer.layernorm_after(x)))),
)


def _videomae_attention(layer, x, bias, need_importance, need_weights=False) -> AttentionOutput:
    inner = layer.attention.attention
    result = _separate_qkv_sdpa(layer.layernorm_before(x), (inner.query, inner.key, inner.value),
                                inner.attention_head_size, bias, inner.scaling, inner.dropout_prob, inner.training,
                                need_importance)
    return result._replace(output=layer.attention.output(result.output, None))


def _vivit_attention(layer, x, bias, need_importance, need_weights=False) -> AttentionOutput:
    inner = layer.attention
    result = _separate_qkv_sdpa(layer.layernorm_before(x), (inner.q_proj, inner.k_proj, inner.v_proj), inner.head_dim,
                                bias, inner.scaling, inner.attention_dropout, inner.training, need_importance)
    return result._replace(output=inner.o_proj(result.output))


def _clip_attention(layer, x, bias, need_importance, need_weights=False) -> AttentionOutput:
    inner = layer.self_attn
    result = _separate_qkv_sdpa(layer.layer_norm1(x), (inner.q_proj, inner.k_proj, inner.v_proj), inner.head_dim,
                                bias, inner.scale, inner.dropout, inner.training, need_importance)
    return result._replace(output=inner.out_proj(result.output))


JOINT_HOSTS = {
    "videomae": JointHost(
        attention=_videomae_attention,
        attention_residual=lambda layer, x, out: x + out,
        mlp_residual=lambda layer, x: layer.output(layer.intermediate(layer.layernorm_after(x)), x),
    ),
    "vivit": JointHost(
        attention=_vivit_attention,
        attention_residual=lambda layer, x, out: x + layer.dropout(out),
        mlp_residual=lambda layer, x: x + layer.dropout(layer.mlp(layer.layernorm_after(x))),
    ),
    "clip": JointHost(
        attention=_clip_attention,
        attention_residual=lambda layer, x, out: x + out,
        mlp_residual=lambda layer, x: x + layer.mlp(layer.layer_norm2(x)),
    ),
}
"""The joint-attention families as hosts of `aggregation_block.joint_block`."""


# ----------------------------------------------------------------------------------------------------------------------
# Patched forwards
# ----------------------------------------------------------------------------------------------------------------------


def _run_block(block: Callable, host, layer: nn.Module, settings: AggregationSettings, index: int,
               state: TokenState) -> TokenState:
    """Runs one block, under activation checkpointing when the layer has it switched on (training). Attention
    weights are never asked for: the patched attention runs through SDPA (see `_check_flags`)."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(block, host, layer, settings, index, state, use_reentrant=False)
    return block(host, layer, settings, index, state)


def _flag(config, kwargs: dict, name: str, default: bool) -> bool:
    """The call's ``name`` flag (popped from ``kwargs``), else the config's, as transformers' forwards read them."""
    value = kwargs.pop(name, None)
    return bool(getattr(config, name, default) if value is None else value)


def _check_flags(config, kwargs: dict) -> tuple[bool, bool]:
    """``(output_hidden_states, return_dict)``; attention weights cannot come out of SDPA."""
    if _flag(config, kwargs, "output_attentions", False):
        raise ValueError(
            "A model patched by apply_testa runs attention through scaled_dot_product_attention and cannot return "
            "attention weights; call remove_testa(model) to get them."
        )
    return _flag(config, kwargs, "output_hidden_states", False), _flag(config, kwargs, "return_dict", True)


def _finish(state: _PatchState, output: TestaPatchedModelOutput, return_dict: bool):
    if state.captures:
        state.captures[-1].append((output.token_sizes, output.source_map))
    return output if return_dict else output.to_tuple()


def _timesformer_layout(tokens: TokenState) -> torch.Tensor:
    """TimeSformer's token order: ``[CLS, (patch, frame)]``."""
    return torch.cat([tokens.cls, tokens.patches.transpose(1, 2).flatten(1, 2)], dim=1)


def _timesformer_forward(state: _PatchState):
    def forward(self, pixel_values: torch.Tensor, **kwargs):
        output_hidden_states, return_dict = _check_flags(self.config, kwargs)
        settings = state.settings
        embeddings = self.embeddings(pixel_values)  # [CLS, (patch, frame)]
        batch, frames = pixel_values.shape[:2]
        hidden = embeddings.shape[-1]
        per_frame = (embeddings.shape[1] - 1) // frames
        patches = embeddings[:, 1:].reshape(batch, per_frame, frames, hidden).transpose(1, 2)  # frame-major
        tokens = initial_state(embeddings[:, :1], patches, settings)
        all_hidden = (_timesformer_layout(tokens),) if output_hidden_states else None
        for index, layer in enumerate(self.encoder.layer):
            tokens = _run_block(divided_block, TIMESFORMER_HOST, layer, settings, index, tokens)
            if output_hidden_states:
                all_hidden += (_timesformer_layout(tokens),)
        sequence_out = _timesformer_layout(tokens)
        if self.layernorm is not None:
            sequence_out = self.layernorm(sequence_out)
        frames, per_frame = tokens.patches.shape[1:3]
        source_map = tokens.source_map
        if source_map is not None:  # frame-major t * L + l -> TimeSformer's output position l * T + t
            position = (source_map % per_frame) * frames + source_map // per_frame
            source_map = torch.where(source_map >= 0, position, -1)
        output = TestaPatchedModelOutput(
            last_hidden_state=sequence_out,
            hidden_states=all_hidden,
            token_sizes=F.pad(tokens.sizes.transpose(1, 2).flatten(1), (1, 0), value=1.0),
            source_map=source_map,
        )
        return _finish(state, output, return_dict)

    return forward


def _run_joint(state: _PatchState, family: str, layers, cls, patches, output_hidden_states: bool):
    """Runs the blocks of a joint-attention encoder; returns ``(tokens, token_sizes, source_map, hidden_states)``."""
    settings, host = state.settings, JOINT_HOSTS[family]
    tokens = initial_state(cls, patches, settings)
    all_hidden = (sequence(tokens),) if output_hidden_states else None
    for index, layer in enumerate(layers):
        tokens = _run_block(joint_block, host, layer, settings, index, tokens)
        if output_hidden_states:
            all_hidden += (sequence(tokens),)
    return sequence(tokens), token_sizes_with_cls(tokens), tokens.source_map, all_hidden


def _videomae_forward(state: _PatchState):
    def forward(self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None, **kwargs):
        output_hidden_states, return_dict = _check_flags(self.config, kwargs)
        if bool_masked_pos is not None:
            raise ValueError(
                "A VideoMAE model patched by apply_testa needs every tubelet (masked pre-training input has no full "
                "token grid to aggregate); pass bool_masked_pos=None or call remove_testa(model)."
            )
        embeddings = self.embeddings(pixel_values, None)  # (B, slices * L, D), slice-major
        batch, _, hidden = embeddings.shape
        slices = pixel_values.shape[1] // self.config.tubelet_size
        patches = embeddings.view(batch, slices, -1, hidden)
        sequence, token_sizes, source_map, all_hidden = _run_joint(
            state, "videomae", self.encoder.layer, None, patches, output_hidden_states
        )
        if self.layernorm is not None:
            sequence = self.layernorm(sequence)
        output = TestaPatchedModelOutput(
            last_hidden_state=sequence, hidden_states=all_hidden, token_sizes=token_sizes, source_map=source_map
        )
        return _finish(state, output, return_dict)

    return forward


def _vivit_forward(state: _PatchState):
    def forward(
        self,
        pixel_values: torch.Tensor,
        interpolate_pos_encoding: bool = False,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        output_hidden_states, return_dict = _check_flags(self.config, kwargs)
        if attention_mask is not None:
            raise ValueError("A ViViT model patched by apply_testa does not take an attention_mask over tubelets.")
        embeddings = self.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        batch, _, hidden = embeddings.shape
        slices = pixel_values.shape[1] // self.config.tubelet_size[0]
        patches = embeddings[:, 1:].reshape(batch, slices, -1, hidden)
        sequence, token_sizes, source_map, all_hidden = _run_joint(
            state, "vivit", self.layers, embeddings[:, :1], patches, output_hidden_states
        )
        sequence = self.layernorm(sequence)
        output = TestaPatchedModelOutput(
            last_hidden_state=sequence,
            pooler_output=self.pooler(sequence) if self.pooler is not None else None,
            hidden_states=all_hidden,
            token_sizes=token_sizes,
            source_map=source_map,
        )
        return _finish(state, output, return_dict)

    return forward


def _clip_forward(state: _PatchState):
    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool | None = False, **kwargs):
        output_hidden_states, return_dict = _check_flags(self.config, kwargs)
        if pixel_values is None or pixel_values.ndim != 4:
            shape = None if pixel_values is None else tuple(pixel_values.shape)
            raise ValueError(
                "A CLIPVisionModel patched by apply_testa encodes frames: pixel_values must be (frames, channels, "
                f"height, width), e.g. video.flatten(0, 1) for a (batch, frames, ...) video; got {shape}."
            )
        hidden_states = self.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        hidden_states = self.pre_layrnorm(hidden_states)
        cls, patches = hidden_states[:, :1], hidden_states[:, 1:].unsqueeze(1)  # every frame is its own sample
        sequence, token_sizes, source_map, all_hidden = _run_joint(
            state, "clip", self.encoder.layers, cls, patches, output_hidden_states
        )
        output = TestaPatchedModelOutput(
            last_hidden_state=sequence,
            pooler_output=self.post_layernorm(sequence[:, 0, :]),
            hidden_states=all_hidden,
            token_sizes=token_sizes,
            source_map=source_map,
        )
        return _finish(state, output, return_dict)

    return forward


_BASE_FORWARDS = {
    "timesformer": _timesformer_forward,
    "videomae": _videomae_forward,
    "vivit": _vivit_forward,
    "clip": _clip_forward,
}


def _videomae_classifier_forward(state: _PatchState):
    """VideoMAEForVideoClassification with a size-weighted mean pool (its head averages all tokens)."""

    def forward(self, pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs):
        return_dict = _flag(self.config, kwargs, "return_dict", True)
        outputs = self.videomae(pixel_values, return_dict=True, **kwargs)
        sequence = outputs.last_hidden_state
        if self.fc_norm is not None:
            pooled = self.fc_norm(weighted_token_mean(sequence, outputs.token_sizes))  # = the unpatched mean at R = 0
        else:  # the head reads the first token, as the unpatched model does
            pooled = sequence[:, 0]
        logits = self.classifier(pooled)
        loss = self.loss_function(labels, logits, self.config, **kwargs) if labels is not None else None
        output = TestaPatchedClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            token_sizes=outputs.token_sizes,
            source_map=outputs.source_map,
        )
        return output if return_dict else output.to_tuple()

    return forward


def _cls_classifier_forward(state: _PatchState, original: Callable):
    """Heads that read the CLS token (TimeSformer, ViViT) run unchanged; their output gains the encoder's
    ``token_sizes`` and ``source_map``."""

    def forward(self, *args, **kwargs):
        capture: list = []
        state.captures.append(capture)
        try:
            output = original(*args, **kwargs)
        finally:
            state.captures.pop()
        if not capture or not isinstance(output, ImageClassifierOutput):
            return output
        token_sizes, source_map = capture[-1]
        return TestaPatchedClassifierOutput(
            loss=output.loss,
            logits=output.logits,
            hidden_states=output.hidden_states,
            attentions=output.attentions,
            token_sizes=token_sizes,
            source_map=source_map,
        )

    return forward


# ----------------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------------


def _replace_forward(state: _PatchState, module: nn.Module, forward: Callable) -> None:
    previous = module.__dict__.get("forward")
    module.forward = forward.__get__(module, type(module))
    state.replaced.append((module, previous))


def apply_testa(
    model: nn.Module,
    temporal_reduction: int | list[int] = 0,
    spatial_reduction: int | list[int] = 0,
    *,
    aggregation_strategy: str = DEFAULTS["aggregation_strategy"],
    reduction_mode: str = DEFAULTS["reduction_mode"],
    aggregation_dims: str = DEFAULTS["aggregation_dims"],
    frame_matching: str = DEFAULTS["frame_matching"],
    score_grid: float = DEFAULTS["score_grid"],
    proportional_attention: bool | None = None,
    trace_source: bool = DEFAULTS["trace_source"],
    processor: Any = None,
    **video_llm_options,
) -> nn.Module:
    """Makes ``model`` (a supported transformers video encoder, see the module docstring) aggregate tokens with TESTA,
    training-free, by replacing the ``forward`` of the model instance. Calling it again replaces the settings.

    Args:
        model: ``TimesformerModel``, ``TimesformerForVideoClassification``, ``VideoMAEModel``,
            ``VideoMAEForVideoClassification``, ``VivitModel``, ``VivitForVideoClassification``,
            ``CLIPVisionModel``, ``CLIPVisionModelWithProjection`` or ``CLIPModel`` (image tower only), or a subclass.
            Other classes raise ``TypeError``.
        temporal_reduction: R_T, frames (tubelet time slices) merged per block: an int, or one int per block. Capped at
            ``(T - 1) // 2`` per block, as in TESTA.
        spatial_reduction: R_S, patches merged within every frame per block (capped at half), or with
            ``aggregation_dims="joint"`` the number of space-time tokens merged per block (ToMe's r).
        aggregation_strategy, reduction_mode, frame_matching: as in `TestaVisionConfig` (`"geometry"`/`"importance"`,
            `"merge"`/`"prune"`, `"mean"`/`"vote"`/`"original"`).
        aggregation_dims: `"temporal+spatial"` (default), `"temporal"`, `"spatial"`, or `"joint"` (ToMe over all
            space-time tokens; VideoMAE and ViViT only).
        score_grid: the grid merge decisions are taken on, as in `TestaVisionConfig` (default 2^-10: near-ties decided
            alike on every runtime; 0: raw scores).
        proportional_attention: add log(token size) to the attention logits. Default (None): off for TimeSformer (as
            in the TESTA paper), on for the joint-attention models (as ToMe does).
        trace_source: return `source_map` (see the module docstring).
        processor: for a video-LLM (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision: see the repository's ``video_llms``
            package, to which such models are handed), its processor instance, patched to emit the reduced number of
            video placeholders.
        video_llm_options: a video-LLM adapter's own options (e.g. ``chunk_frames``, frames through LLaVA-OneVision's
            tower at a time); other models raise ``TypeError`` naming them.

    Returns:
        ``model`` itself, patched.
    """
    video_llms = _video_llms(model, required=True)
    if video_llms is not None:
        return video_llms.apply_testa_to_video_llm(
            model, processor, temporal_reduction=temporal_reduction, spatial_reduction=spatial_reduction,
            aggregation_strategy=aggregation_strategy, reduction_mode=reduction_mode,
            aggregation_dims=aggregation_dims, frame_matching=frame_matching, score_grid=score_grid,
            proportional_attention=proportional_attention, trace_source=trace_source, **video_llm_options,
        )
    if video_llm_options:
        raise TypeError(
            f"apply_testa got {sorted(video_llm_options)}, options of a video-LLM adapter; "
            f"{type(model).__name__} is not a video-LLM (see the repository's video_llms package)."
        )
    family = _family_of(model)
    base = _base_of(model, family)
    settings = _settings_for(
        base,
        family.name,
        temporal_reduction,
        spatial_reduction,
        aggregation_strategy=aggregation_strategy,
        reduction_mode=reduction_mode,
        aggregation_dims=aggregation_dims,
        frame_matching=frame_matching,
        score_grid=score_grid,
        proportional_attention=proportional_attention,
        trace_source=trace_source,
    )
    if getattr(model, _STATE_ATTRIBUTE, None) is not None:
        remove_testa(model)
    state = _PatchState(settings=settings, family=family.name, replaced=[], captures=[])
    _replace_forward(state, base, _BASE_FORWARDS[family.name](state))
    if family.base_attribute is not None and family.name != "clip":
        if family.name == "videomae":
            _replace_forward(state, model, _videomae_classifier_forward(state))
        else:
            _replace_forward(state, model, _cls_classifier_forward(state, model.forward))
    setattr(model, _STATE_ATTRIBUTE, state)
    return model


VIDEO_LLM_CLASSES = (
    "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel", "Qwen3VLForConditionalGeneration", "Qwen3VLModel",
    "LlavaOnevisionForConditionalGeneration", "LlavaOnevisionModel",
)
"""The transformers classes (and their subclasses) that the repository's ``video_llms`` adapters take, by name: how
`apply_testa` recognises a video-LLM when that package is not installed (a test keeps this list equal to the
adapters' own)."""


def _video_llms(model: nn.Module, required: bool = False):
    """The repository's ``video_llms`` package when ``model`` is a video-LLM it supports, else None. Imported here,
    not at the top: it is not part of a saved Hub folder, where this module must load without it. Without the
    package, a model whose class is one of `VIDEO_LLM_CLASSES` raises (when `required`) an `ImportError` saying in
    one line what to install, instead of being refused as an unsupported model."""
    try:
        import video_llms
    except ImportError as error:
        names = [cls.__name__ for cls in type(model).__mro__ if cls.__name__ in VIDEO_LLM_CLASSES]
        if required and names:
            from .pipeline_testa import LIBRARY  # the same wording as the pipelines' `library` helper

            raise ImportError(f"apply_testa on a {type(model).__name__} (a video-LLM: {names[0]}) needs {LIBRARY}, "
                              f"whose video_llms package adapts it; it is not in a Hub folder: {error}") from error
        return None
    return video_llms if video_llms.is_video_llm(model) else None


def remove_testa(model: nn.Module) -> nn.Module:
    """Undoes :func:`apply_testa`: every replaced ``forward`` is restored (the class's own method again, or whatever
    instance-level ``forward`` was there before); a video-LLM gets its model and processor back exactly. A model
    that is not patched is returned unchanged."""
    video_llms = _video_llms(model)
    if video_llms is not None:
        return video_llms.remove_testa_from_video_llm(model)
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        return model
    for module, previous in reversed(state.replaced):
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.forward = previous
    delattr(model, _STATE_ATTRIBUTE)
    return model


def get_testa_settings(model: nn.Module) -> AggregationSettings | None:
    """The settings ``model`` was patched with, or None when it is not patched."""
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    return None if state is None else state.settings


# ----------------------------------------------------------------------------------------------------------------------
# Token grid and visualisation
# ----------------------------------------------------------------------------------------------------------------------


def patched_token_grid(model: nn.Module, frames: int, patches_per_frame: int) -> list[tuple[int, int]]:
    """``(time slices, tokens per slice)`` after every block for an input of ``frames`` time slices (tubelet slices
    for VideoMAE / ViViT, 1 for a CLIP frame) of ``patches_per_frame`` patches. In joint mode ``(1, tokens)``."""
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call apply_testa(model, ...) first.")
    return state.settings.token_schedule(frames, patches_per_frame, has_cls=state.family != "videomae")


@torch.no_grad()
def patched_aggregation_groups(
    model: nn.Module, pixel_values: torch.Tensor, image_mean: Any = None, image_std: Any = None
) -> AggregationGroups:
    """The frame and patch groups of one video after the last block of a patched model, as
    :class:`.visualization.AggregationGroups` for :func:`.visualization.draw_aggregation`.

    Args:
        pixel_values: one video, ``(frames, channels, height, width)`` or ``(1, frames, channels, height, width)``,
            normalised as the model expects (for CLIP: its frames). Tubelet models show the first frame of every
            tubelet time slice.
        image_mean, image_std: the normalisation to undo for drawing (default: stretch to [0, 1]).
    """
    state = model.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call apply_testa(model, ...) first.")
    family = state.family
    base = _base_of(model, _family_of(model))
    video = pixel_values[0] if pixel_values.ndim == 5 else pixel_values
    if video.ndim != 4 or (pixel_values.ndim == 5 and pixel_values.shape[0] != 1):
        raise ValueError(f"`pixel_values` must be one video (frames, channels, height, width); got {tuple(pixel_values.shape)}.")
    settings, was_training = state.settings, base.training
    state.settings = replace(settings, trace_source=True)
    base.eval()
    try:
        device = next(base.parameters()).device
        inputs = video.to(device) if family == "clip" else video[None].to(device)
        output = base(inputs, return_dict=True)
    finally:
        state.settings = settings
        base.train(was_training)
    source_map = output.source_map.cpu()
    frames, _, height, width = video.shape
    patch = base.config.tubelet_size[1] if family == "vivit" else base.config.patch_size  # ViViT: (t, h, w) tubelets
    patch_grid = (height // patch, width // patch)
    slices = source_map.shape[0] if family == "clip" else source_map.shape[1]
    tubelet = frames // slices
    grid = patched_token_grid(model, 1 if family == "clip" else slices, patch_grid[0] * patch_grid[1])[-1]
    if family == "clip":  # frame t's tokens follow each other: flat id t * L' + l
        offsets = torch.arange(frames).view(frames, 1) * grid[1]
        tokens = torch.where(source_map[:, 0] >= 0, source_map[:, 0] + offsets, -1)
        grid = (frames, grid[1])
    elif family == "timesformer":  # output position l * T' + t -> frame-major t * L' + l
        sm = source_map[0]
        tokens = torch.where(sm >= 0, (sm % grid[0]) * grid[1] + sm // grid[0], -1)
    else:
        tokens = source_map[0]
    return AggregationGroups(
        pixels=displayable_frames(video[None, ::tubelet], image_mean=image_mean, image_std=image_std),
        source_map=tokens,
        frame_groups=frame_groups_of(tokens, grid[1], settings.aggregation_dims == "joint"),
        grid=tuple(grid),
        patch_grid=patch_grid,
        layer=len(_layers(base, family)) - 1,
        aggregation_dims=settings.aggregation_dims,
    )


def visualize_patched_aggregation(
    model: nn.Module, pixel_values: torch.Tensor, image_mean: Any = None, image_std: Any = None, **draw_kwargs
):
    """Draws which frames and patches a patched model merged (as ``visualize_aggregation`` does for TESTA's own
    encoder); ``draw_kwargs`` go to :func:`.visualization.draw_aggregation` (``patch_pixels``, ``columns``,
    ``alpha``). Returns a ``PIL.Image``."""
    return draw_aggregation(patched_aggregation_groups(model, pixel_values, image_mean, image_std), **draw_kwargs)


__all__ = [
    "AggregationSettings",
    "TestaPatchedClassifierOutput",
    "TestaPatchedModelOutput",
    "apply_testa",
    "get_testa_settings",
    "patched_aggregation_groups",
    "patched_token_grid",
    "remove_testa",
    "visualize_patched_aggregation",
]
