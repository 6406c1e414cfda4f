"""suggest_reduction and the closed-form GMAC count, checked against the FLOP counter."""

import itertools
import math

import pytest
from helpers.models import tiny_vision_config

from modeling_testa import TestaVisionConfig, token_schedule
from modeling_testa.flops import count_encoder_gmac, estimate_encoder_gmac, suggest_reduction


ALL_SETTINGS = [
    dict(aggregation_strategy=s, reduction_mode=m, aggregation_dims=d, frame_matching=f)
    for s, m, d, f in itertools.product(
        ["geometry", "importance"], ["merge", "prune"], ["temporal+spatial", "temporal", "spatial", "joint"],
        ["mean", "vote", "original"],
    )
    if not (m == "prune" and s == "importance")
    and not (f == "original" and d in ("spatial", "joint"))  # frame rules only matter where frames merge
]


def _with(config: TestaVisionConfig, r_t: int, r_s: int) -> TestaVisionConfig:
    return TestaVisionConfig(**{**config.to_dict(), "temporal_reduction": r_t, "spatial_reduction": r_s})


@pytest.mark.parametrize("settings", ALL_SETTINGS, ids=lambda s: "-".join(s.values()))
def test_closed_form_gmac_equals_the_counter(settings):
    config = tiny_vision_config(temporal_reduction=[1, 3], spatial_reduction=[4, 2], **settings)
    for frames, size in [(8, 32), (11, 40)]:
        counted, tokens = count_encoder_gmac(config, frames, size)
        estimated, estimated_tokens = estimate_encoder_gmac(config, frames, size)
        assert math.isclose(estimated, counted, rel_tol=1e-12) and estimated_tokens == tokens


@pytest.mark.parametrize("frames, r_t, r_s", [(32, 1, 12), (96, 4, 8), (96, 0, 0)])
def test_closed_form_gmac_equals_the_counter_for_the_paper_settings(frames, r_t, r_s):
    config = TestaVisionConfig(num_frames=frames, temporal_reduction=r_t, spatial_reduction=r_s)
    assert estimate_encoder_gmac(config) == pytest.approx(count_encoder_gmac(config), rel=1e-12)


def _tight_pairs(config, budget, frames):
    """Brute force with the real counter: for every R_T, the smallest R_S that meets the budget."""
    patches = config.num_patches_per_frame
    pairs = []
    for r_t in range((frames - 1) // 2 + 1):
        for r_s in range(patches // 2 + 1):
            candidate = _with(config, r_t, r_s)
            gmac = count_encoder_gmac(candidate, frames)[0]
            if gmac <= budget:
                t_out, l_out = token_schedule(candidate, frames)[-1]
                pairs.append(((r_t, r_s), gmac, abs((1 - t_out / frames) - (1 - l_out / patches))))
                break
    return pairs


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_suggestion_meets_the_budget_and_is_the_most_balanced_tight_pair(ratio):
    config = tiny_vision_config(num_frames=8, num_hidden_layers=3)
    full = count_encoder_gmac(_with(config, 0, 0))[0]
    r_t, r_s = suggest_reduction(config, target_ratio=ratio)
    chosen = _with(config, r_t, r_s)
    gmac = count_encoder_gmac(chosen)[0]
    assert gmac <= ratio * full
    if r_s > 0:  # tight: one patch fewer per block would overshoot
        assert count_encoder_gmac(_with(config, r_t, r_s - 1))[0] > ratio * full
    pairs = _tight_pairs(config, ratio * full, 8)
    best = min(imbalance for _, _, imbalance in pairs)
    mine = [imbalance for pair, _, imbalance in pairs if pair == (r_t, r_s)]
    assert mine and mine[0] == pytest.approx(best)
    # the same budget given in GMAC gives the same answer
    assert suggest_reduction(config, target_gmac=ratio * full) == (r_t, r_s)


@pytest.mark.parametrize(
    "frames, budget, expected",
    [
        (32, dict(target_gmac=420.0), (1, 12)),  # the paper: 419.8 GMAC, 53% of 786.8
        (32, dict(target_ratio=0.534), (1, 12)),
        (96, dict(target_gmac=1381.4), (4, 8)),  # the paper: 1381.4 GMAC, 58% of 2382.5
        (96, dict(target_ratio=0.58), (4, 8)),
    ],
)
def test_paper_budgets_give_the_papers_pairs(frames, budget, expected):
    config = TestaVisionConfig()  # ViT-B/16, 224 px
    assert suggest_reduction(config, num_frames=frames, **budget) == expected


def test_other_aggregation_dims_use_one_knob():
    config = tiny_vision_config()
    for dims, zero_index in [("temporal", 1), ("spatial", 0), ("joint", 0)]:
        dims_config = tiny_vision_config(aggregation_dims=dims)
        pair = suggest_reduction(dims_config, target_ratio=0.8)
        assert pair[zero_index] == 0 and pair[1 - zero_index] > 0
        full = count_encoder_gmac(_with(dims_config, 0, 0))[0]
        assert count_encoder_gmac(_with(dims_config, *pair))[0] <= 0.8 * full
        smaller = list(pair)
        smaller[1 - zero_index] -= 1
        assert count_encoder_gmac(_with(dims_config, *smaller))[0] > 0.8 * full
    assert suggest_reduction(config, target_ratio=1.0) == (0, 0)
    assert suggest_reduction(config, target_gmac=1e9) == (0, 0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(), "exactly one"),
        (dict(target_gmac=1.0, target_ratio=0.5), "exactly one"),
        (dict(target_ratio=0.0), "(0, 1]"),
        (dict(target_ratio=1.5), "(0, 1]"),
        (dict(target_ratio=float("nan")), "(0, 1]"),
        (dict(target_ratio=True), "(0, 1]"),
        (dict(target_gmac=-3.0), "positive"),
        (dict(target_gmac=1e-6), "allowed range"),
        (dict(target_ratio=0.01), "allowed range"),
        (dict(target_ratio=0.5, num_frames=0), "num_frames"),
    ],
)
def test_invalid_or_impossible_budgets_raise(kwargs, words):
    with pytest.raises(ValueError) as info:
        suggest_reduction(tiny_vision_config(), **kwargs)
    assert words in str(info.value)


def test_impossible_budget_names_the_reachable_range():
    config = tiny_vision_config()
    cheapest = count_encoder_gmac(_with(config, 3, 8))[0]  # the caps: (8 - 1) // 2 frames, 16 // 2 patches
    full = count_encoder_gmac(_with(config, 0, 0))[0]
    with pytest.raises(ValueError) as info:
        suggest_reduction(config, target_gmac=cheapest * 0.99)
    message = str(info.value)
    assert f"{cheapest:.4g}" in message and f"{full:.4g}" in message
    assert suggest_reduction(config, target_gmac=cheapest) == (3, 8)
