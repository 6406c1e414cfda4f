"""The family-independent pieces of TESTA inside a video-LLM's vision tower.

* **Settings** (:func:`video_settings`, :func:`adapter_settings`): `modeling_testa.AggregationSettings` for a tower
  of N blocks, validated as `apply_testa` validates them, plus what the adapter's tower allows (its
  ``allowed_settings``, by default :data:`GEOMETRY_MERGE_ONLY`: the towers attend through SDPA / FlashAttention, which
  give no attention weights for importance or pruning), its defaults (``settings_defaults``) and its own options
  (``options``, e.g. ``chunk_frames``, checked by :data:`ADAPTER_OPTIONS`).
* **Patch state** (:class:`InstancePatch`): every attribute an adapter replaces on a model or processor *instance*,
  with what the instance's ``__dict__`` held before, so that :meth:`InstancePatch.restore` puts back exactly that
  (the class's own method again, the same objects). Kept on the model as ``model.testa_video_llm``.
* **Token groups** (:class:`TokenGroups`, :func:`merge_slices`, :func:`merge_units`): a video as ``(slices, units,
  ...)`` groups of tokens (a slice: one frame or one tubelet; a unit: the tokens that must stay together, e.g. the
  2x2 tokens of Qwen's patch merger), merged by TESTA's key-based bipartite matching (`modeling_testa.aggregation`)
  with size-weighted averages. A slice merge moves whole slices (every unit with its own size weight), a unit merge
  works within every slice. Any other per-unit tensor (positions, tapped features) is merged alike.
"""

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from modeling_testa.aggregation import Matching, capped_reduction, merge_tokens
from modeling_testa.aggregation_block import match_frames, match_tokens
from modeling_testa.aggregation_settings import AggregationSettings

STATE_ATTRIBUTE = "testa_video_llm"
"""Where the patch state lives on a patched model instance."""

_MISSING = object()


# ----------------------------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------------------------


GEOMETRY_MERGE_ONLY: dict[str, tuple[tuple, str]] = {
    "aggregation_strategy": (
        ("geometry",), "importance needs attention weights, which SDPA / FlashAttention do not give"),
    "reduction_mode": (("merge",), "pruning needs attention weights, which SDPA / FlashAttention do not give"),
    "aggregation_dims": (
        ("temporal+spatial", "temporal", "spatial"),
        "the tower attends within one frame or tubelet, so tokens of different ones never meet"),
    "proportional_attention": ((False,), "the attention runs through SDPA / FlashAttention, without a logits bias"),
    "trace_source": ((False,), "the tower returns no source map"),
}
"""What a tower that attends through SDPA / FlashAttention within one frame or tubelet allows (setting ->
``(allowed values, why others cannot run)``): an adapter's ``allowed_settings`` unless it allows more."""


def check_chunk_frames(chunk_frames: int | None) -> int | None:
    """``chunk_frames`` (frames through the tower at a time) when it is None or a positive int; else a ValueError
    naming it."""
    if chunk_frames is not None and (isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int)
                                     or chunk_frames < 1):
        raise ValueError(f"chunk_frames must be None (all frames at once) or a positive int; got {chunk_frames!r}.")
    return chunk_frames


CHUNK_OFFLOADS = ("cpu", "disk")
"""Where a chunked Qwen tower may hold the whole video's hidden states at a temporal merge (`check_chunk_offload`)."""


def check_chunk_offload(chunk_offload: str | None) -> str | None:
    """``chunk_offload``: None (the whole video's hidden states at a block with R_T > 0 stay where the tower runs),
    ``"cpu"`` (in host memory: a GPU then holds one chunk) or ``"disk"`` (in a temporary directory, `tempfile`'s,
    removed after the call: host memory then holds one chunk too); else a ValueError naming the allowed values."""
    if chunk_offload is not None and chunk_offload not in CHUNK_OFFLOADS:
        raise ValueError(f"chunk_offload must be None, {' or '.join(map(repr, CHUNK_OFFLOADS))}; got "
                         f"{chunk_offload!r}.")
    return chunk_offload


ADAPTER_OPTIONS = {"chunk_frames": check_chunk_frames, "chunk_offload": check_chunk_offload}
"""The options an adapter may take beside the aggregation settings (it names those it takes in ``options``), each
with its check; the validated value is kept on the :class:`InstancePatch` under the same name."""


def video_settings(num_blocks: int, temporal_reduction, spatial_reduction, *,
                   allowed: dict[str, tuple[tuple, str]] = GEOMETRY_MERGE_ONLY, defaults: dict | None = None,
                   **options) -> AggregationSettings:
    """The aggregation settings of a vision tower of ``num_blocks`` blocks (R_T, R_S: an int for every block or one
    int per block; every other option as `apply_testa` takes it, None meaning the tower's default).

    Args:
        allowed: setting -> ``(allowed values, why others cannot run)``: the adapter's ``allowed_settings``. A value
            outside raises `ValueError` naming the setting, its allowed values and why.
        defaults: the adapter's ``settings_defaults``, where its tower's default differs from `AggregationSettings`'.
    """
    given = {name: value for name, value in options.items() if value is not None}
    settings = AggregationSettings.for_layers(num_blocks, temporal_reduction, spatial_reduction,
                                              **{**(defaults or {}), **given})
    for name, (values, why) in allowed.items():
        if getattr(settings, name) not in values:
            raise ValueError(
                f"{name}={getattr(settings, name)!r} is not supported inside this video-LLM's vision tower: {why}. "
                f"Allowed: {', '.join(map(repr, values))}."
            )
    return settings


def adapter_settings(adapter, num_blocks: int, temporal_reduction, spatial_reduction, **options
                     ) -> tuple[AggregationSettings, dict]:
    """The validated settings for ``adapter`` (:func:`video_settings` with its ``allowed_settings`` and
    ``settings_defaults``) and its own options (those of ``adapter.options``, checked by :data:`ADAPTER_OPTIONS`).
    An option the adapter does not take raises `ValueError` naming it and the ones it takes."""
    own = {name: options.pop(name) for name in list(options) if name in ADAPTER_OPTIONS}
    refused = sorted(set(own) - set(adapter.options))
    if refused:
        raise ValueError(
            f"{refused[0]}={own[refused[0]]!r} is not an option of {type(adapter).__name__}; its options: "
            f"{', '.join(adapter.options) or 'none'}."
        )
    own = {name: ADAPTER_OPTIONS[name](value) for name, value in own.items()}
    if own.get("chunk_offload") is not None and own.get("chunk_frames") is None:
        raise ValueError(f"chunk_offload={own['chunk_offload']!r} says where a tower run in chunks of frames holds "
                         "the whole video at a temporal merge: pass chunk_frames too.")
    settings = video_settings(num_blocks, temporal_reduction, spatial_reduction, allowed=adapter.allowed_settings,
                              defaults=adapter.settings_defaults, **options)
    return settings, own


def token_grid(settings: AggregationSettings, slices: int, units: int) -> tuple[int, int]:
    """``(slices, units per slice)`` a video of ``slices`` x ``units`` leaves the tower with: the caps of
    :func:`merge_slices` and :func:`merge_units` block by block (`AggregationSettings.token_schedule`, no CLS)."""
    if not settings.num_layers:
        return slices, units
    return settings.token_schedule(slices, units, has_cls=False)[-1]


# ----------------------------------------------------------------------------------------------------------------------
# Instance patching with exact restore
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class InstancePatch:
    """What an adapter changed on instances, to be undone exactly, and the state its replacements share.

    Attributes:
        settings: the validated settings.
        adapter: the adapter that applied the patch.
        processor: the processor instance patched with the model (or None).
        replaced: ``(object, attribute, what the object's __dict__ held or _MISSING)`` in patching order.
        cache: scratch space of the adapter (e.g. the features of the last encoded videos).
        chunk_frames: frames the tower takes at a time (None: the whole video at once).
        chunk_offload: where a chunked tower holds the whole video at a temporal merge (`check_chunk_offload`).
    """

    settings: AggregationSettings
    adapter: Any
    processor: Any = None
    replaced: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    chunk_frames: int | None = None
    chunk_offload: str | None = None

    def replace_attribute(self, obj: Any, name: str, value: Any) -> None:
        """Sets ``obj.name = value`` on the instance, remembering what its ``__dict__`` held."""
        self.replaced.append((obj, name, obj.__dict__.get(name, _MISSING)))
        obj.__dict__[name] = value

    def replace_method(self, obj: Any, name: str, function) -> None:
        """Binds ``function(obj, ...)`` as ``obj.name`` on the instance."""
        self.replace_attribute(obj, name, function.__get__(obj, type(obj)))

    def restore(self) -> None:
        """Puts back what every replaced attribute was, last replaced first."""
        for obj, name, previous in reversed(self.replaced):
            if previous is _MISSING:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = previous
        self.replaced.clear()
        self.cache.clear()


def patch_of(model) -> InstancePatch | None:
    """The patch state of a patched model, or None."""
    return model.__dict__.get(STATE_ATTRIBUTE)


# ----------------------------------------------------------------------------------------------------------------------
# Token groups and their merges
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TokenGroups:
    """One video's tokens as ``(slices, units, ...)`` groups.

    Attributes:
        tokens: ``(slices, units, D)``; a unit's tokens flattened into D, so they always move together.
        sizes: ``(slices, units)`` float: how many input units every unit stands for.
        positions: ``(slices, units, P)`` float, merged as size-weighted means (where the unit came from).
        labels: ``(slices, units)`` long, or None: a categorical label (e.g. an attention window) that a merged unit
            takes from the unit it joins (its kept partner).
        carried: other ``(slices, units, E)`` tensors merged alike (e.g. features tapped at earlier blocks).
    """

    tokens: torch.Tensor
    sizes: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor | None = None
    carried: list = field(default_factory=list)

    @property
    def grid(self) -> tuple[int, int]:
        return self.tokens.shape[0], self.tokens.shape[1]


def _merged(groups: TokenGroups, matching: Matching, batched: bool) -> TokenGroups:
    """Every tensor of ``groups`` merged by ``matching`` (over slices, or with ``batched`` over units within every
    slice), by `aggregation.merge_tokens`: size-weighted means, sizes summed."""
    lead = (lambda t: t) if batched else (lambda t: t.unsqueeze(0))
    back = (lambda t: t) if batched else (lambda t: t.squeeze(0))
    sizes = lead(groups.sizes)

    def merge(t: torch.Tensor) -> torch.Tensor:
        return back(merge_tokens(lead(t), sizes, matching)[0])

    tokens, new_sizes = (back(t) for t in merge_tokens(lead(groups.tokens), sizes, matching))
    labels = None
    if groups.labels is not None:
        kept = matching.kept
        labels = back(lead(groups.labels).gather(kept.ndim - 1, kept if batched else
                                                  kept.unsqueeze(-1).expand(*kept.shape, groups.labels.shape[1])))
    return TokenGroups(tokens, new_sizes, merge(groups.positions), labels,
                       [merge(t) for t in groups.carried])


def merge_slices(groups: TokenGroups, keys: torch.Tensor, r: int, settings: AggregationSettings
                 ) -> tuple[TokenGroups, torch.Tensor]:
    """TESTA's frame aggregation on slices: merges ``r`` slices (capped at ``(slices - 1) // 2``, as TESTA caps its
    frames) into their most similar ones; a slice's metric is the mean of its units' keys (``frame_matching="mean"``)
    or the units vote (`aggregation_block.match_frames`). Every unit is averaged with the unit at the same index of
    the partner slice, with its own size weight.

    Args:
        keys: ``(slices, units, C)`` one key per unit (the mean of its tokens' attention keys).

    Returns:
        The merged groups and keys (the keys merged alike, for a unit merge in the same block).
    """
    r = capped_reduction(r, groups.grid[0], protected=1)
    if r == 0:
        return groups, keys
    matching = match_frames(settings, keys.transpose(0, 1).unsqueeze(0), None, r)
    merged = _merged(replace(groups, carried=[*groups.carried, keys]), matching, batched=False)
    keys = merged.carried.pop()
    return merged, keys


def merge_units(groups: TokenGroups, keys: torch.Tensor, r: int, settings: AggregationSettings
                ) -> tuple[TokenGroups, torch.Tensor]:
    """TESTA's patch aggregation on units, within every slice: ``r`` units per slice (capped at half) merge into
    their most similar unit of the same slice (bipartite matching on the units' keys, ``(slices, units, C)``)."""
    r = capped_reduction(r, groups.grid[1], protected=0)
    if r == 0:
        return groups, keys
    matching = match_tokens(settings, keys, None, r, protect_first=False)
    merged = _merged(replace(groups, carried=[*groups.carried, keys]), matching, batched=True)
    keys = merged.carried.pop()
    return merged, keys


def aggregate(groups: TokenGroups, keys: torch.Tensor, settings: AggregationSettings, block: int) -> TokenGroups:
    """Block ``block``'s aggregation: slices first, then units within every slice (TESTA's order)."""
    r_t, r_s = settings.reductions(block)
    groups, keys = merge_slices(groups, keys, r_t, settings)
    groups, _ = merge_units(groups, keys, r_s, settings)
    return groups


def chronological_order(positions: torch.Tensor) -> torch.Tensor:
    """The order of ``(tokens, P)`` positions sorted lexicographically by their columns (a stable sort by the last
    column, then the one before, ...): for ``(time, row, column)`` centroids, time first, then raster order. Input
    order breaks ties, so unmerged tokens keep the stock order."""
    order = torch.arange(positions.shape[0], device=positions.device)
    for column in reversed(range(positions.shape[1])):
        order = order[positions[order, column].argsort(stable=True)]
    return order


__all__ = [
    "ADAPTER_OPTIONS",
    "GEOMETRY_MERGE_ONLY",
    "InstancePatch",
    "STATE_ATTRIBUTE",
    "TokenGroups",
    "adapter_settings",
    "aggregate",
    "CHUNK_OFFLOADS",
    "check_chunk_frames",
    "check_chunk_offload",
    "chronological_order",
    "merge_slices",
    "merge_units",
    "patch_of",
    "token_grid",
    "video_settings",
]
