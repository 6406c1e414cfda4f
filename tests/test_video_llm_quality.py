"""The quality experiment of issue 51 (`benchmarks.video_llm_quality`) and its task (`processing.short_events_vqa`):
the questions and their ceiling, vLLM's EVS re-implemented, the pruned forward against the stock model, the compute
count against torch's FLOP counter, and the pipeline end to end (`--quick`) with the token counts every arm claims."""

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import benchmarks.video_llm_quality as quality
from processing.short_events import Flash, Scene, ShortEventVideo
from processing.short_events_vqa import colour_seen, make_vqa_split, oracle_accuracy, questions_for
from video_llms import apply_testa_to_video_llm, remove_testa_from_video_llm
from video_llms.common import video_settings


def hand_video() -> ShortEventVideo:
    """40 frames: red 0-20 with a blue flash at 5-7, green 20-40 with a white flash at 30-31."""
    return ShortEventVideo("v", "test", 0, 4, 56, 40, [
        Scene("red", 0, 20, [Flash("blue", 5, 7)]), Scene("green", 20, 40, [Flash("white", 30, 31)])])


def test_questions_ask_about_a_flash_and_an_absent_colour():
    video = hand_video()
    yes, no = questions_for(video, 0, random.Random(0))
    assert (yes.answer, no.answer) == ("yes", "no")
    assert yes.colour in {"blue", "white"} and yes.text == f"is there a square in {yes.colour}"
    assert no.colour not in {"red", "green", "blue", "white"}


def test_colour_seen_by_hand():
    # uniform sampling of 4 of 40 frames takes the middle of each 10-frame segment: 5, 15, 25, 35
    video = hand_video()
    assert colour_seen(video, "blue", 4) and colour_seen(video, "green", 4)
    assert not colour_seen(video, "white", 4)   # frame 30 only
    assert colour_seen(video, "white", 40)


def test_more_frames_raise_the_ceiling():
    videos, questions = make_vqa_split(64, seed=3, size=56)
    assert oracle_accuracy(videos, questions, 8) < oracle_accuracy(videos, questions, 16) <= 1.0
    assert oracle_accuracy(videos, questions, 32) == 1.0   # every flash lasts at least 1/20 of its video


def test_evs_keeps_the_first_tubelet_then_the_most_changed_tokens():
    features = torch.ones(3, 4, 2)             # 3 tubelets of 4 tokens
    features[1, 2] = torch.tensor([1.0, -1.0])   # tubelet 1 differs at token 2 (cosine 0: dissimilarity 1)
    features[2, 2] = torch.tensor([1.0, -1.0])   # tubelet 2 equals tubelet 1 ...
    features[2, 0] = torch.tensor([1.0, 0.0])    # ... but at token 0 (cosine 1/sqrt 2)
    mask = quality.evs_retention_mask(features.reshape(12, 2), 3, 4, keep=6)
    assert mask.tolist() == [True] * 4 + [False, False, True, False] + [True, False, False, False]
    assert quality.evs_retention_mask(features.reshape(12, 2), 3, 4, keep=1).sum() == 4   # one tubelet at least


@pytest.fixture(scope="module")
def model_and_processor():
    model, processor = quality.build_model(0)
    return model.eval(), processor


def test_pruning_nothing_is_the_stock_model(model_and_processor):
    model, processor = model_and_processor
    videos, questions = make_vqa_split(2, seed=5, size=quality.FRAME_SIZE)
    inputs = quality.encode(processor, videos, questions, 16)
    with torch.no_grad():
        stock = model(**inputs).logits[:, -1]
        pruned, counts = quality.pruned_forward(model, inputs, keep=32)
        fewer, fewer_counts = quality.pruned_forward(model, inputs, keep=12)
    assert counts == [32] * len(questions) and fewer_counts == [12] * len(questions)
    torch.testing.assert_close(pruned, stock, rtol=0, atol=1e-5)
    assert not torch.allclose(fewer, stock, atol=1e-3)


def test_tower_macs_match_torch_flop_counter(model_and_processor):
    """torch's counter sees the convolution and the linear layers (not the per-tubelet SDPA on the CPU): with the
    attention term added by hand, it equals `tower_macs` within 0.1% (the rest: TESTA's matching, counted
    approximately)."""
    model, processor = model_and_processor
    videos, questions = make_vqa_split(1, seed=5, size=quality.FRAME_SIZE)
    d, units = quality.VISION["hidden_size"], (quality.FRAME_SIZE // 28) ** 2
    for arm in quality.make_arms():
        if arm.prune_to is not None:
            continue
        settings = video_settings(quality.VISION["depth"], **arm.testa) if arm.testa else None
        attention = sum(2 * s * (u * quality.UNIT) ** 2 * d
                        for (s, u), _ in quality.block_grids(settings, arm.frames // 2, units))
        inputs = quality.encode(processor, videos, questions[:1], arm.frames)
        if arm.testa:
            apply_testa_to_video_llm(model, processor, **arm.testa)
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        finally:
            remove_testa_from_video_llm(model)
        assert counter.get_total_flops() / 2 + attention == pytest.approx(arm.tower_macs, rel=1e-3), arm.name


def test_testa_schedule_is_stock_when_the_budget_allows_and_refuses_an_impossible_one():
    units = (quality.FRAME_SIZE // 28) ** 2
    full = quality.testa_schedule(8, units, quality.tower_macs(None, 8, units))
    assert full["grid"] == [8, units] and not any(full["temporal_reduction"] + full["spatial_reduction"])
    with pytest.raises(ValueError, match="no TESTA schedule fits"):
        quality.testa_schedule(8, units, quality.tower_macs(None, 1, units))


def test_quick_run_end_to_end_with_the_token_counts_each_arm_claims():
    result = quality.run(quality.QUICK, log=lambda text: None)
    arms = {row["arm"][:3]: row for row in result["arms"]}
    assert arms["(a)"]["llm_video_tokens"] == 4 * 4 and arms["(d)"]["llm_video_tokens"] == 8 * 4
    assert arms["(b)"]["llm_video_tokens"] == arms["(c)"]["llm_video_tokens"] < arms["(a)"]["llm_video_tokens"]
    assert arms["(b)"]["tower_macs"] <= arms["(a)"]["tower_macs"] < arms["(c)"]["tower_macs"]
    for row in result["arms"]:
        assert row["measured_llm_tokens"] == [row["llm_video_tokens"]], row["arm"]   # what the LLM got
        assert row["measured_tower_tokens_match_schedule"], row["arm"]               # what every block saw
        assert 0 <= row["accuracy_mean"] <= 1
