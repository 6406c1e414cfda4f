"""`AggregationSettings` is the one declaration of the aggregation settings: the config, `apply_testa`, the FLOP count
and the recipes share its fields, defaults, validation (the same error everywhere) and token schedule."""

import inspect
import logging

import pytest
import torch
from helpers.models import tiny_vision_config
from transformers import TimesformerConfig, TimesformerModel, VideoMAEConfig, VideoMAEModel

from modeling_testa import TestaVisionConfig, TestaVisionModel, apply_testa, token_schedule
from modeling_testa.aggregation_settings import (
    AGGREGATION_FIELDS,
    CHOICES,
    DEFAULTS,
    AggregationSettings,
    per_layer,
    switched_off_message,
)
from modeling_testa.flops import count_encoder_gmac, estimate_encoder_gmac
from modeling_testa.patching import patched_token_grid


TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)


def timesformer() -> TimesformerModel:
    return TimesformerModel(TimesformerConfig(**TINY, image_size=32, patch_size=8, num_frames=8))


def vision_config(**overrides) -> TestaVisionConfig:
    """A 3-block encoder, as the TimeSformer above (the per-block list messages name the block count)."""
    return tiny_vision_config(num_hidden_layers=3, **overrides)


# ---------------------------------------------------------------------------------------------------- one declaration


def test_the_config_and_apply_testa_declare_the_settings_fields_with_the_same_defaults():
    config = TestaVisionConfig()
    for name in AGGREGATION_FIELDS:
        assert hasattr(config, name), name
    for name, default in DEFAULTS.items():
        assert getattr(config, name) == default, name
    parameters = inspect.signature(apply_testa).parameters
    assert set(AGGREGATION_FIELDS) <= set(parameters)
    for name, default in DEFAULTS.items():
        if name != "proportional_attention":  # apply_testa's None: per host (off for TimeSformer, on for joint)
            assert parameters[name].default == default, name
    assert (parameters["temporal_reduction"].default, parameters["spatial_reduction"].default) == (0, 0)
    # the settings the encoder runs with are the config's
    settings = TestaVisionModel(vision_config(aggregation_strategy="importance", spatial_reduction=[1, 2, 3]))
    assert settings.aggregation_settings() == AggregationSettings(
        (1, 1, 1), (1, 2, 3), aggregation_strategy="importance")


# ------------------------------------------------------------------------------------------------- validation policy


IMPOSSIBLE = [
    (dict(aggregation_strategy="random"), "aggregation_strategy='random'; allowed values are 'geometry', 'importance'"),
    (dict(reduction_mode="drop"), "reduction_mode='drop'; allowed values are 'merge', 'prune'"),
    (dict(aggregation_dims="time"), "aggregation_dims='time'; allowed values are 'temporal+spatial'"),
    (dict(frame_matching="mode"), "frame_matching='mode'; allowed values are 'mean', 'vote', 'original'"),
    (dict(spatial_reduction=-1), "`spatial_reduction` must be >= 0"),
    (dict(temporal_reduction=[1, 2]), "`temporal_reduction` has 2 entries but the encoder has num_hidden_layers=3"),
]


@pytest.mark.parametrize("settings, message", IMPOSSIBLE, ids=lambda x: str(x)[:40])
def test_impossible_settings_raise_the_same_error_from_the_config_and_apply_testa(settings, message):
    with pytest.raises(ValueError) as from_config:
        vision_config(**{"temporal_reduction": 1, "spatial_reduction": 2, **settings})
    model = timesformer()
    with pytest.raises(ValueError) as from_patching:
        apply_testa(model, **{"temporal_reduction": 1, "spatial_reduction": 2, **settings})
    assert str(from_config.value) == str(from_patching.value)
    assert message in str(from_config.value)
    assert "forward" not in model.__dict__


@pytest.mark.parametrize(
    "dims, settings, field",
    [("spatial", dict(temporal_reduction=1, spatial_reduction=2), "temporal_reduction"),
     ("temporal", dict(temporal_reduction=1, spatial_reduction=[0, 2, 0]), "spatial_reduction")],
)
def test_a_reduction_that_aggregation_dims_switches_off(dims, settings, field, caplog):
    """apply_testa and `AggregationSettings` refuse it, naming the field, the value and what is allowed; a config
    (whose defaults are R_T=1, R_S=12, so saved configs carry such values) loads with a warning saying the same and
    runs with that reduction at 0."""
    value = settings[field]
    expected = switched_off_message(field, value, dims)
    assert f"{field}={value!r} is impossible" in expected and f"{field} must be 0" in expected
    assert "Allowed: " in expected and "aggregation_dims" in expected
    with pytest.raises(ValueError) as error:
        apply_testa(timesformer(), aggregation_dims=dims, **settings)
    assert str(error.value) == expected
    with pytest.raises(ValueError) as error:
        AggregationSettings.for_layers(3, aggregation_dims=dims, **settings)
    assert str(error.value) == expected
    per_block = {name: per_layer(v, 3, name) for name, v in settings.items()}
    with pytest.raises(ValueError) as error:
        AggregationSettings(**{name: tuple(v) for name, v in per_block.items()}, aggregation_dims=dims)
    assert str(error.value) == switched_off_message(field, per_block[field], dims)

    with caplog.at_level(logging.WARNING, logger="modeling_testa.configuration_testa"):
        config = vision_config(aggregation_dims=dims, **settings)
    assert expected in caplog.text and f"runs with {field}=0" in caplog.text
    assert getattr(config, field) == value  # kept as saved: the folder round-trips unchanged
    assert getattr(config.aggregation_settings(), field) == (0, 0, 0)
    zeroed = vision_config(aggregation_dims=dims, **{**settings, field: 0})
    torch.manual_seed(0)
    video = torch.randn(1, 8, 3, 32, 32)
    torch.manual_seed(1)
    loose = TestaVisionModel(config).eval()
    torch.manual_seed(1)
    strict = TestaVisionModel(zeroed).eval()
    with torch.no_grad():
        torch.testing.assert_close(loose(video).last_hidden_state, strict(video).last_hidden_state, rtol=0, atol=0)


def test_valid_settings_raise_nothing_and_warn_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="modeling_testa.configuration_testa"):
        vision_config(aggregation_dims="spatial", temporal_reduction=0, spatial_reduction=2)
        vision_config(aggregation_dims="joint", temporal_reduction=0, spatial_reduction=9)
        vision_config(aggregation_dims="temporal", temporal_reduction=1, spatial_reduction=0)
    assert caplog.text == ""
    for name, allowed in CHOICES.items():
        for value in allowed:
            AggregationSettings((0,), (0,), **{name: value})


def test_bools_are_bools():
    with pytest.raises(TypeError, match="`proportional_attention` must be a bool"):
        apply_testa(timesformer(), spatial_reduction=1, proportional_attention="yes")
    with pytest.raises(ValueError, match="one int per block"):
        AggregationSettings(1, 2)


# ----------------------------------------------------------------------------------------------------- token schedule


def test_token_schedule_of_a_hand_worked_case():
    """8 frames of 16 patches, R_T = 2, R_S = 5 per block, 3 blocks. Frames: 8 - min(2, 7 // 2) = 6, 6 - min(2, 5 // 2)
    = 4, 4 - min(2, 3 // 2) = 3. Patches (CLS protected, at most half of the 1 + L tokens' unprotected part):
    16 - min(5, 16 // 2) = 11, 11 - min(5, 11 // 2) = 6, 6 - min(5, 6 // 2) = 3."""
    settings = AggregationSettings((2, 2, 2), (5, 5, 5))
    assert settings.token_schedule(8, 16) == [(6, 11), (4, 6), (3, 3)]
    assert settings.token_schedule(8, 16, has_cls=False) == [(6, 11), (4, 6), (3, 3)]
    # joint: 2 frames x 4 patches = 8 tokens, R = 3: 8 - min(3, 8 // 2) = 5, 5 - min(3, 5 // 2) = 3
    joint = AggregationSettings((0, 0), (3, 3), aggregation_dims="joint")
    assert joint.token_schedule(2, 4) == [(1, 5), (1, 3)]
    # only frames: 5 frames, R_T = 4: 5 - min(4, 2) = 3, 3 - min(4, 1) = 2, 2 - min(4, 0) = 2
    assert AggregationSettings((4,) * 3, (0,) * 3, aggregation_dims="temporal").token_schedule(5, 9) == [
        (3, 9), (2, 9), (2, 9)]


def test_the_config_flops_and_patching_use_the_same_schedule():
    config = vision_config(temporal_reduction=[2, 1, 1], spatial_reduction=[3, 2, 5])
    expected = AggregationSettings((2, 1, 1), (3, 2, 5)).token_schedule(8, 16)
    assert token_schedule(config) == expected
    frames, patches = expected[-1]
    assert estimate_encoder_gmac(config)[1] == count_encoder_gmac(config)[1] == 1 + frames * patches
    model = apply_testa(timesformer(), temporal_reduction=[2, 1, 1], spatial_reduction=[3, 2, 5])
    assert patched_token_grid(model, 8, 16) == expected
    with torch.no_grad():
        tokens = model(torch.randn(1, 8, 3, 32, 32)).last_hidden_state.shape[1]
    assert tokens == 1 + frames * patches
    # VideoMAE: 4 tubelet slices of 16 tokens, no CLS
    videomae = VideoMAEModel(VideoMAEConfig(**TINY, image_size=32, patch_size=8, num_frames=8, tubelet_size=2))
    apply_testa(videomae, temporal_reduction=1, spatial_reduction=[4, 4, 4])
    grid = patched_token_grid(videomae, 4, 16)
    assert grid == AggregationSettings((1,) * 3, (4,) * 3, proportional_attention=True).token_schedule(4, 16, False)
    with torch.no_grad():
        tokens = videomae(torch.randn(1, 8, 3, 32, 32)).last_hidden_state.shape[1]
    assert tokens == grid[-1][0] * grid[-1][1]


# ------------------------------------------------------------------------------- the merge rule is part of the model


def near_static_videos() -> torch.Tensor:
    """Four videos of 8 near-identical frames (a still shot with a little sensor noise): their frame scores differ
    only past the third decimal, so the rule decides the merges (raw scores: the noise; the grid: the lowest index)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, 1, 3, 32, 32, generator=generator) + 1e-3 * torch.randn(4, 8, 3, 32, 32,
                                                                                   generator=generator)


def merges(model: TestaVisionModel) -> torch.Tensor:
    with torch.no_grad():
        return model(near_static_videos(), trace_source=True).source_map


def rule_model(score_grid: float) -> TestaVisionModel:
    from helpers.models import randomize

    torch.manual_seed(0)
    model = TestaVisionModel(vision_config(temporal_reduction=2, spatial_reduction=3, score_grid=score_grid)).eval()
    return randomize(model, seed=0)


def test_the_rule_decides_the_merges_of_near_ties():
    raw, snapped = merges(rule_model(0.0)), merges(rule_model(2.0**-10))
    assert (raw != snapped).flatten(1).any(1).any()  # the case is there: the rule changes merges
    assert torch.equal(snapped, merges(rule_model(2.0**-10)))


@pytest.mark.parametrize("score_grid", [0.0, 2.0**-10, 2.0**-6])
def test_the_rule_round_trips_through_save_pretrained(score_grid, tmp_path):
    model = rule_model(score_grid)
    model.save_pretrained(tmp_path)
    loaded = TestaVisionModel.from_pretrained(tmp_path).eval()
    assert loaded.config.score_grid == score_grid and loaded.aggregation_settings().score_grid == score_grid
    assert torch.equal(merges(loaded), merges(model))


def test_the_rule_round_trips_in_a_heads_config(tmp_path):
    from helpers.pipelines import tiny_testa_config

    from modeling_testa import TestaConfig, TestaForVideoTextRetrieval

    config = tiny_testa_config()
    config.vision_config.score_grid = 2.0**-8
    model = TestaForVideoTextRetrieval(config)
    model.set_aggregation(score_grid=0.0)  # the head, its encoder and its momentum copy
    assert model.vision_model.config.score_grid == 0.0 == model.momentum.vision_model.config.score_grid
    model.save_pretrained(tmp_path)
    for loaded in (TestaConfig.from_pretrained(tmp_path), TestaForVideoTextRetrieval.from_pretrained(tmp_path).config):
        assert loaded.vision_config.score_grid == 0.0


def test_a_config_saved_without_the_rule_loads_with_raw_scores(tmp_path, caplog):
    """A model saved before `score_grid` existed was trained on raw scores: it must not be served under the grid."""
    import json

    from transformers import AutoConfig

    from modeling_testa import TestaConfig

    model = rule_model(2.0**-10)
    model.save_pretrained(tmp_path / "vision")
    TestaConfig().save_pretrained(tmp_path / "head")
    for path, section in ((tmp_path / "vision" / "config.json", None), (tmp_path / "head" / "config.json",
                                                                        "vision_config")):
        saved = json.loads(path.read_text())
        del (saved[section] if section else saved)["score_grid"]
        path.write_text(json.dumps(saved))
    caplog.set_level(logging.INFO, logger="modeling_testa.configuration_testa")
    loaded = TestaVisionModel.from_pretrained(tmp_path / "vision").eval()
    assert loaded.config.score_grid == 0.0 and "no score_grid (saved before the setting existed)" in caplog.text
    assert torch.equal(merges(loaded), merges(rule_model(0.0)))  # decided on raw scores, as it was trained
    assert TestaConfig.from_pretrained(tmp_path / "head").vision_config.score_grid == 0.0
    assert TestaVisionConfig.from_pretrained(tmp_path / "head").score_grid == 0.0  # its vision part alone
    assert AutoConfig.from_pretrained(tmp_path / "head").vision_config.score_grid == 0.0
    # a new config has the grid, and saving writes it, so the rule is never lost again
    assert TestaConfig().vision_config.score_grid == 2.0**-10
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["score_grid"] == 0.0


def test_set_aggregation_takes_the_rule_and_refuses_a_bad_one():
    model = rule_model(2.0**-10)
    before = merges(model)
    with pytest.raises(ValueError, match=r"score_grid=0.001 is not allowed; use 0 \(raw scores\) or a power of two"):
        model.set_aggregation(score_grid=0.001)
    assert model.config.score_grid == 2.0**-10 and torch.equal(merges(model), before)  # unchanged on error
    model.set_aggregation(score_grid=0.0)
    assert torch.equal(merges(model), merges(rule_model(0.0)))


def test_apply_testa_takes_the_rule():
    from modeling_testa.patching import get_testa_settings

    model = apply_testa(timesformer(), temporal_reduction=1, spatial_reduction=2, score_grid=0.0)
    assert get_testa_settings(model).score_grid == 0.0
    assert get_testa_settings(apply_testa(timesformer(), 1, 2)).score_grid == 2.0**-10
