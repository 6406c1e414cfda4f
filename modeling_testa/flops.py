"""FLOP accounting for the TESTA video encoder, in the paper's convention.

The paper's "GFLOPs" are fvcore counts of the **video encoder only** at batch 1, where one multiply-add counts as one
operation (i.e. GMAC), LayerNorm costs 5 operations per element, and the bipartite-matching similarity products are
included. :func:`count_encoder_gmac` measures that with ``torch.utils.flop_counter`` on the meta device (no memory,
no compute: ViT-B/16 at 96 frames counts in well under a second), with SDPA routed to the math kernel so attention is
counted.
"""

import copy
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from .aggregation_settings import AggregationSettings
from .configuration_testa import TestaVisionConfig
from .modeling_testa_vision import TestaVisionModel


def layer_norm_flops(input_shape, *args, out_shape=None, **kwargs) -> int:
    # fvcore counts 5 operations per normalised element; FlopCounterMode reports 2 FLOPs per MAC, hence 10.
    return 10 * math.prod(input_shape)


def count_encoder_gmac(
    config: TestaVisionConfig, num_frames: int | None = None, image_size: int | None = None
) -> tuple[float, int]:
    """Counts the encoder's GMAC for one video and returns ``(gmac, output_tokens)``.

    Args:
        config: the encoder configuration (aggregation settings included).
        num_frames, image_size: the input (defaults: ``config.num_frames``, ``config.image_size``).
    """
    frames = num_frames or config.num_frames
    size = image_size or config.image_size
    mapping = {torch.ops.aten.native_layer_norm: layer_norm_flops}
    with torch.device("meta"):
        model = TestaVisionModel(config).eval()
        pixel_values = torch.empty(1, frames, config.num_channels, size, size)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            tokens = model(pixel_values).last_hidden_state.shape[1]
    return counter.get_total_flops() / 2e9, tokens


# ----------------------------------------------------------------------------------------------------------------------
# Analytic GMAC and the compute-budget helper
# ----------------------------------------------------------------------------------------------------------------------


def _split_sizes(num_tokens: int) -> tuple[int, int]:
    """Sizes of the alternating (even, odd) sets of the geometry matcher."""
    return (num_tokens + 1) // 2, num_tokens // 2


def _matching_macs(config: TestaVisionConfig, num_tokens: int, reduction: int, positions: int = 1) -> int:
    """Similarity products of one matching of ``num_tokens`` tokens per sequence: the geometry matcher scores every
    even token against every odd one, the importance matcher the ``reduction`` sources against the rest (pruning
    scores nothing). ``positions`` > 1 for frame voting, where every patch position scores the frames separately."""
    channels = config.hidden_size // config.num_attention_heads  # keys averaged over heads
    if config.reduction_mode == "prune":
        return 0
    if config.aggregation_strategy == "geometry":
        even, odd = _split_sizes(num_tokens)
        return positions * even * odd * channels
    return positions * reduction * (num_tokens - reduction) * channels


def estimate_encoder_gmac(
    config: TestaVisionConfig, num_frames: int | None = None, image_size: int | None = None
) -> tuple[float, int]:
    """The encoder's GMAC and output tokens from a closed-form count, in the convention of :func:`count_encoder_gmac`.

    Sums, block by block on the :func:`token_schedule`, the multiply-adds that the counter sees: the patch embedding,
    every linear layer, attention (``Q K^T`` and ``A V``), LayerNorm at 5 per element, the matching similarity
    products, and with importance-based aggregation or pruning the attention-received scores of Eq. 1. It runs in
    microseconds, so budget searches can evaluate thousands of settings; ``tests/test_budget.py`` checks it against
    :func:`count_encoder_gmac` for every aggregation setting.

    Args:
        config: the encoder configuration (aggregation settings included).
        num_frames, image_size: the input (defaults: ``config.num_frames``, ``config.image_size``).
    """
    frames, size = _checked_input(config, num_frames, image_size)
    return _estimate(config, frames, size, config.aggregation_settings())


def _checked_input(config: TestaVisionConfig, num_frames: int | None, image_size: int | None) -> tuple[int, int]:
    frames = config.num_frames if num_frames is None else num_frames
    size = config.image_size if image_size is None else image_size
    for name, value in (("num_frames", frames), ("image_size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if size % config.patch_size:
        raise ValueError(f"`image_size`={size} is not a multiple of patch_size={config.patch_size}.")
    return frames, size


def _estimate(config: TestaVisionConfig, frames: int, size: int, settings: AggregationSettings) -> tuple[float, int]:
    """:func:`estimate_encoder_gmac` with explicit settings: the blocks' token counts are ``settings``' schedule,
    the reductions each block makes are the differences between its entries."""
    dim, mlp = config.hidden_size, config.intermediate_size
    patches = (size // config.patch_size) ** 2
    importance = settings.uses_importance
    macs = frames * patches * dim * config.num_channels * config.patch_size**2  # patch embedding
    schedule = settings.token_schedule(frames, patches)
    joint = settings.aggregation_dims == "joint"
    if joint:
        frames, patches = 1, frames * patches
    for frames_out, patches_out in schedule:
        if joint:
            tokens = patches + 1
            r = patches - patches_out
            macs += 5 * tokens * dim + 4 * tokens * dim * dim + 2 * tokens * tokens * dim  # LN, qkv + proj, attention
            if r:
                macs += importance * tokens * tokens * dim + _matching_macs(config, tokens, r)
            patches = patches_out
            macs += (patches + 1) * (5 * dim + 2 * dim * mlp)  # LN + MLP
            continue
        # temporal attention over the frames at every patch position, then temporal_fc
        tokens = frames * patches
        macs += 5 * tokens * dim + 5 * tokens * dim * dim + 2 * patches * frames * frames * dim
        r = frames - frames_out
        if r:
            vote = patches if config.frame_matching != "mean" else 1
            macs += importance * patches * frames * frames * dim + _matching_macs(config, frames, r, vote)
            frames = frames_out
        # spatial attention over [CLS, patches] of every frame
        tokens = patches + 1
        macs += frames * (5 * tokens * dim + 4 * tokens * dim * dim + 2 * tokens * tokens * dim)
        r = patches - patches_out
        if r:
            macs += frames * (importance * tokens * tokens * dim + _matching_macs(config, tokens, r))
            patches = patches_out
        macs += (1 + frames * patches) * (5 * dim + 2 * dim * mlp)  # LN + MLP
    output_tokens = 1 + frames * patches
    macs += 5 * output_tokens * dim  # post LayerNorm
    return macs / 1e9, output_tokens


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def suggest_reduction(
    config: TestaVisionConfig,
    target_gmac: float | None = None,
    target_ratio: float | None = None,
    num_frames: int | None = None,
    image_size: int | None = None,
    verify: bool = True,
) -> tuple[int, int]:
    """The constant per-block ``(temporal_reduction, spatial_reduction)`` that fits a compute budget with TESTA's
    balance between frame and patch aggregation.

    Give exactly one budget: ``target_gmac`` (encoder GMAC per video, the paper's "GFLOPs") or ``target_ratio`` (a
    fraction in (0, 1] of the encoder's GMAC without aggregation, for the same input). All other settings of
    ``config`` (aggregation strategy, frame matching, ...) are kept, only R_T and R_S are chosen.

    **Rule.** For every R_T from 0 to the frame cap ``(T - 1) // 2``, take the smallest R_S (up to the patch cap
    ``L // 2``) whose GMAC meets the budget: each such pair spends as much of the budget as R_S allows, and larger R_S
    would only throw away more patches. Among these pairs, return the most *balanced* one; ties go to the pair whose
    GMAC is closest to the budget, then to the smaller R_T.

    **Balance** is the gap between the fraction of frames the encoder removes, ``f_T = 1 - T_out / T``, and the fraction
    of patches per frame it removes, ``f_S = 1 - L_out / L`` (``T_out``, ``L_out``: the output grid, see
    ``token_schedule``); the most balanced pair minimises ``|f_T - f_S|``. The paper's 96-frame setting is balanced in
    exactly this sense (R_T=4, R_S=8: 96 -> 48 frames, 196 -> 100 patches, f_T = 0.50, f_S = 0.49). At 32 frames R_T is
    too coarse a knob (R_T=1 removes 37.5% of the frames, R_T=2 already 75%), and the paper's R_T=1, R_S=12
    (f_T = 0.38, f_S = 0.73) is what the rule picks too. Sanity check, ViT-B/16 at 224 px (``tests/test_budget.py``):

    * 32 frames, budget 420 GMAC (the paper's 419.8; 53.4% of 786.8) -> ``(1, 12)``, the paper's pair;
    * 96 frames, budget 1381.4 GMAC (the paper's; 58.0% of 2382.5) -> ``(4, 8)``, the paper's pair.

    At other budgets the pair moves with the budget, e.g. 32 frames at 58% -> ``(1, 10)``, 96 frames at 53.4% ->
    ``(5, 9)``. The rule knows nothing about accuracy: it reproduces the paper's *choices*, not a measured optimum.

    With ``aggregation_dims="temporal"`` the answer is ``(R_T, 0)``, with ``"spatial"`` ``(0, R_S)`` and with
    ``"joint"`` ``(0, R)``, R being ToMe's joint reduction (stored in ``spatial_reduction``): the smallest reduction
    that meets the budget, as there is no balance to keep.

    The search uses :func:`estimate_encoder_gmac` (exact against the counter, microseconds per setting); the pick is
    then checked with :func:`count_encoder_gmac` unless ``verify=False``.

    Args:
        config: the encoder configuration; its reductions are ignored.
        target_gmac: the GMAC budget per video.
        target_ratio: the budget as a fraction of the unaggregated encoder's GMAC, in (0, 1].
        num_frames, image_size: the input (defaults: ``config.num_frames``, ``config.image_size``).
        verify: re-count the chosen setting with :func:`count_encoder_gmac` (about 0.3 s for ViT-B/16).

    Returns:
        ``(temporal_reduction, spatial_reduction)``, to be passed to the config as ints. ``(0, 0)`` when the budget is
        at least the unaggregated cost.

    Raises:
        ValueError: no budget or both, a non-positive / non-finite budget, a ratio above 1, or a budget below the
            cheapest reachable setting (the message gives the reachable range).
    """
    if (target_gmac is None) == (target_ratio is None):
        raise ValueError(
            f"Give exactly one of `target_gmac` or `target_ratio`; got target_gmac={target_gmac!r}, "
            f"target_ratio={target_ratio!r}."
        )
    frames, size = _checked_input(config, num_frames, image_size)
    patches = (size // config.patch_size) ** 2
    dims = config.aggregation_dims
    base = config.aggregation_settings()
    full_gmac = _estimate(config, frames, size, base.with_reductions(0, 0))[0]

    if target_ratio is not None:
        if not _is_number(target_ratio) or not 0 < target_ratio <= 1:
            raise ValueError(f"`target_ratio` must be a number in (0, 1], got {target_ratio!r}.")
        budget, asked = target_ratio * full_gmac, f"target_ratio={target_ratio}"
    else:
        if not _is_number(target_gmac) or target_gmac <= 0:
            raise ValueError(f"`target_gmac` must be a positive number, got {target_gmac!r}.")
        budget, asked = float(target_gmac), f"target_gmac={target_gmac}"

    max_t = (frames - 1) // 2 if dims in ("temporal", "temporal+spatial") else 0
    if dims == "joint":
        max_s = (frames * patches) // 2
    else:
        max_s = patches // 2 if dims in ("spatial", "temporal+spatial") else 0

    def constant(r_t: int, r_s: int) -> AggregationSettings:  # max_t / max_s are 0 where dims switch a step off
        return base.with_reductions(r_t if max_t else 0, r_s if max_s else 0)

    def gmac(r_t: int, r_s: int) -> float:
        return _estimate(config, frames, size, constant(r_t, r_s))[0]

    candidates = []  # (imbalance, distance to budget, R_T, R_S, gmac)
    for r_t in range(max_t + 1):
        for r_s in range(max_s + 1):
            cost = gmac(r_t, r_s)
            if cost <= budget:
                if dims == "temporal+spatial":
                    t_out, l_out = constant(r_t, r_s).token_schedule(frames, patches)[-1]
                    imbalance = abs((1 - t_out / frames) - (1 - l_out / patches))
                else:
                    imbalance = 0.0
                candidates.append((imbalance, budget - cost, r_t, r_s, cost))
                break
    if not candidates:
        cheapest = gmac(max_t, max_s)
        raise ValueError(
            f"{asked} cannot be met: with {frames} frames of {size} px and aggregation_dims={dims!r} the encoder "
            f"costs between {cheapest:.4g} GMAC (R_T={max_t}, R_S={max_s}, the most that can be removed) and "
            f"{full_gmac:.4g} GMAC (no aggregation); allowed range: target_gmac >= {cheapest:.4g} or "
            f"target_ratio >= {cheapest / full_gmac:.4f}."
        )
    _, _, r_t, r_s, cost = min(candidates, key=lambda c: (round(c[0], 12), c[1], c[2]))

    if verify:
        checked = copy.deepcopy(config)
        checked.temporal_reduction, checked.spatial_reduction = r_t, r_s
        counted = count_encoder_gmac(checked, frames, size)[0]
        if counted > budget * (1 + 1e-9) or not math.isclose(counted, cost, rel_tol=1e-9):
            raise RuntimeError(
                f"estimate_encoder_gmac ({cost:.6f}) and count_encoder_gmac ({counted:.6f}) disagree for R_T={r_t}, "
                f"R_S={r_s} ({asked}): the closed-form count is out of date with the model code."
            )
    return r_t, r_s


__all__ = ["count_encoder_gmac", "estimate_encoder_gmac", "suggest_reduction"]
