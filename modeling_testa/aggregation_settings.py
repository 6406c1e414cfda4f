"""TESTA's aggregation settings, declared once: the fields, their defaults, their validation and the token schedule.

:class:`AggregationSettings` is what the blocks run with (`aggregation_block`). `TestaVisionConfig` (the saved form),
`apply_testa` (transformers' encoders), the FLOP count and the training recipes all build one, so the allowed values,
the error messages and the per-block token counts are the same everywhere.

**One policy for impossible settings.** A value outside the allowed ones, a negative reduction, a per-block list of
the wrong length, or a reduction that ``aggregation_dims`` switches off (R_T > 0 with ``"spatial"`` or ``"joint"``,
R_S > 0 with ``"temporal"``) raises a `ValueError` naming the field, the value and what is allowed. The one exception
is for configs: `TestaVisionConfig` defaults to R_T=1, R_S=12, so configs (and saved folders) with
``aggregation_dims="spatial"`` / ``"joint"`` / ``"temporal"`` have always carried a reduction that the encoder ignores;
they still load, with a warning, and run with that reduction at 0 (:func:`switched_off_reductions`).

This module imports only `aggregation` (for the merge caps and the score grid), so that the config can use it: Hub
remote code, flat relative imports only.
"""

from dataclasses import dataclass, fields, replace

from .aggregation import DEFAULT_SCORE_GRID, capped_reduction, check_score_grid


AGGREGATION_STRATEGIES = ("geometry", "importance")
REDUCTION_MODES = ("merge", "prune")
AGGREGATION_DIMS = ("temporal+spatial", "temporal", "spatial", "joint")
FRAME_MATCHINGS = ("mean", "vote", "original")

CHOICES: dict[str, tuple[str, ...]] = {
    "aggregation_strategy": AGGREGATION_STRATEGIES,
    "reduction_mode": REDUCTION_MODES,
    "aggregation_dims": AGGREGATION_DIMS,
    "frame_matching": FRAME_MATCHINGS,
}
"""The string-valued settings and their allowed values."""

# Which reduction each `aggregation_dims` value switches off (it must then be 0).
SWITCHED_OFF: dict[str, tuple[str, ...]] = {
    "temporal+spatial": (),
    "temporal": ("spatial_reduction",),
    "spatial": ("temporal_reduction",),
    "joint": ("temporal_reduction",),
}


def check_choice(value: str, allowed: tuple[str, ...], name: str) -> None:
    """Raises a `ValueError` naming ``name`` and the allowed values unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"Unknown {name}={value!r}; allowed values are {', '.join(map(repr, allowed))}.")


def per_layer(value: int | list[int] | tuple[int, ...], num_layers: int, name: str) -> list[int]:
    """Expands an int or per-layer list into a validated per-layer list; raises a `ValueError` naming ``name``."""
    values = [value] * num_layers if isinstance(value, int) else list(value)
    if len(values) != num_layers:
        raise ValueError(
            f"`{name}` has {len(values)} entries but the encoder has num_hidden_layers={num_layers}; "
            f"give one int for every layer or a list of exactly {num_layers} ints."
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"`{name}` must hold ints, got {v!r} in {values}.")
        if v < 0:
            raise ValueError(f"`{name}` must be >= 0 (tokens removed per layer), got {v} in {values}.")
    return values


def switched_off_message(name: str, value, aggregation_dims: str) -> str:
    """Why ``name`` must be 0 with ``aggregation_dims`` (the text of the error, and of the config's warning)."""
    if name == "temporal_reduction":
        why = (
            f"with aggregation_dims={aggregation_dims!r} nothing is merged along time by frames (in 'joint' mode "
            "spatial_reduction is the number of space-time tokens merged per block)"
        )
        keeps = "'temporal+spatial' or 'temporal'"
    else:
        why = f"with aggregation_dims={aggregation_dims!r} only frames are merged"
        keeps = "'temporal+spatial', 'spatial' or 'joint'"
    return f"{name}={value!r} is impossible: {why}, so {name} must be 0. Allowed: {name}=0, or aggregation_dims {keeps}."


def switched_off_reductions(aggregation_dims: str, temporal_reduction, spatial_reduction) -> list[str]:
    """The names of the reductions that are non-zero although ``aggregation_dims`` switches them off."""
    given = {"temporal_reduction": temporal_reduction, "spatial_reduction": spatial_reduction}
    switched = SWITCHED_OFF.get(aggregation_dims, ())
    return [name for name in switched if any(v != 0 for v in _as_list(given[name]))]


def _as_list(value) -> list:
    return [value] if isinstance(value, int) else list(value)


@dataclass(frozen=True)
class AggregationSettings:
    """The aggregation settings of one encoder: one R per block, and how tokens are matched. Validated on
    construction (see the module docstring); the meaning of every field is documented on `TestaVisionConfig`.

    Attributes:
        temporal_reduction: R_T per block, frames (time slices) merged.
        spatial_reduction: R_S per block, patches merged within every frame; in joint mode the space-time tokens
            merged.
        aggregation_strategy, reduction_mode, aggregation_dims, frame_matching: one of `CHOICES`.
        score_grid: the grid merge decisions are taken on (0 or a power of two; 0: raw scores): the rule the model
            was trained with, part of the model (`aggregation.check_score_grid`).
        proportional_attention: add log(token size) to the attention logits.
        trace_source: return the output token of every input patch.
    """

    temporal_reduction: tuple[int, ...]
    spatial_reduction: tuple[int, ...]
    aggregation_strategy: str = "geometry"
    reduction_mode: str = "merge"
    aggregation_dims: str = "temporal+spatial"
    frame_matching: str = "mean"
    score_grid: float = DEFAULT_SCORE_GRID
    proportional_attention: bool = False
    trace_source: bool = False

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            check_choice(getattr(self, name), allowed, name)
        object.__setattr__(self, "score_grid", check_score_grid(self.score_grid))
        for name in ("proportional_attention", "trace_source"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
        for name in ("temporal_reduction", "spatial_reduction"):
            if not isinstance(getattr(self, name), (tuple, list)):
                raise ValueError(
                    f"`{name}` must hold one int per block, got {getattr(self, name)!r} (AggregationSettings.for_layers "
                    "expands one int to every block)."
                )
        layers = len(self.temporal_reduction)
        for name in ("temporal_reduction", "spatial_reduction"):
            object.__setattr__(self, name, tuple(per_layer(list(getattr(self, name)), layers, name)))
        for name in switched_off_reductions(self.aggregation_dims, self.temporal_reduction, self.spatial_reduction):
            raise ValueError(switched_off_message(name, list(getattr(self, name)), self.aggregation_dims))

    @classmethod
    def for_layers(
        cls,
        num_layers: int,
        temporal_reduction: int | list[int] | tuple[int, ...],
        spatial_reduction: int | list[int] | tuple[int, ...],
        *,
        zero_switched_off: bool = False,
        **options,
    ) -> "AggregationSettings":
        """The settings of an encoder of ``num_layers`` blocks, from an int or one value per block for each
        reduction, and any other field as a keyword. Raises `ValueError` for impossible settings; with
        ``zero_switched_off`` (the config's legacy rule) a reduction that ``aggregation_dims`` switches off is set
        to 0 instead."""
        temporal = per_layer(temporal_reduction, num_layers, "temporal_reduction")
        spatial = per_layer(spatial_reduction, num_layers, "spatial_reduction")
        unknown = sorted(set(options) - set(AGGREGATION_FIELDS))
        if unknown:
            raise ValueError(f"Unknown aggregation setting(s) {unknown}; allowed settings are {list(AGGREGATION_FIELDS)}.")
        dims = options.get("aggregation_dims", cls.aggregation_dims)
        check_choice(dims, AGGREGATION_DIMS, "aggregation_dims")
        switched = switched_off_reductions(dims, temporal, spatial)
        if switched and not zero_switched_off:  # the error names the value as given
            given = {"temporal_reduction": temporal_reduction, "spatial_reduction": spatial_reduction}
            raise ValueError(switched_off_message(switched[0], given[switched[0]], dims))
        temporal = [0] * num_layers if "temporal_reduction" in switched else temporal
        spatial = [0] * num_layers if "spatial_reduction" in switched else spatial
        return cls(temporal_reduction=tuple(temporal), spatial_reduction=tuple(spatial), **options)

    @classmethod
    def from_config(cls, config) -> "AggregationSettings":
        """The settings of a `TestaVisionConfig` (reductions that its ``aggregation_dims`` switches off are 0)."""
        return cls.for_layers(
            config.num_hidden_layers,
            config.temporal_reduction,
            config.spatial_reduction,
            zero_switched_off=True,
            **{name: getattr(config, name) for name in AGGREGATION_FIELDS[2:]},
        )

    def with_reductions(self, temporal_reduction, spatial_reduction) -> "AggregationSettings":
        """The same settings with other reductions (an int for every block, or one value per block)."""
        layers = len(self.temporal_reduction)
        return replace(
            self,
            temporal_reduction=tuple(per_layer(temporal_reduction, layers, "temporal_reduction")),
            spatial_reduction=tuple(per_layer(spatial_reduction, layers, "spatial_reduction")),
        )

    @property
    def num_layers(self) -> int:
        return len(self.temporal_reduction)

    @property
    def uses_importance(self) -> bool:
        """Whether matching needs the attention received by every token (Eq. 1)."""
        return self.aggregation_strategy == "importance" or self.reduction_mode == "prune"

    def reductions(self, index: int) -> tuple[int, int]:
        """``(R_T, R_S)`` requested for block ``index`` (0 where `aggregation_dims` switches a step off). In joint
        mode R_S is the number of space-time tokens merged and R_T is 0."""
        return self.temporal_reduction[index], self.spatial_reduction[index]

    def token_schedule(self, frames: int, patches_per_frame: int, has_cls: bool = True) -> list[tuple[int, int]]:
        """``(frames, tokens per frame)`` after every block for an input of ``frames`` frames (or tubelet time
        slices) of ``patches_per_frame`` patches.

        The caps are the blocks' (`aggregation.capped_reduction`): the frame merge removes at most ``(T - 1) // 2``
        frames, the patch merge at most half of a frame's tokens, a CLS (``has_cls``) taking part in the split but
        protected. In joint mode all tokens form one "frame", so the entries read ``(1, tokens)``.
        """
        protected = int(has_cls)
        if self.aggregation_dims == "joint":
            frames, patches_per_frame = 1, frames * patches_per_frame
        schedule = []
        for r_t, r_s in zip(self.temporal_reduction, self.spatial_reduction):
            frames -= capped_reduction(r_t, frames, protected=1)
            patches_per_frame -= capped_reduction(r_s, patches_per_frame + protected, protected=protected)
            schedule.append((frames, patches_per_frame))
        return schedule


AGGREGATION_FIELDS: tuple[str, ...] = tuple(field.name for field in fields(AggregationSettings))
"""The names of the aggregation settings, in declaration order (the two reductions first)."""

DEFAULTS: dict[str, object] = {field.name: field.default for field in fields(AggregationSettings)[2:]}
"""The default of every setting but the reductions (whose defaults differ: the paper's R for a config, 0 for
`apply_testa`)."""


__all__ = [
    "AGGREGATION_DIMS",
    "AGGREGATION_FIELDS",
    "AGGREGATION_STRATEGIES",
    "AggregationSettings",
    "CHOICES",
    "DEFAULTS",
    "FRAME_MATCHINGS",
    "REDUCTION_MODES",
    "SWITCHED_OFF",
    "check_choice",
    "per_layer",
    "switched_off_message",
    "switched_off_reductions",
]
