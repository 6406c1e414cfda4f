"""The quality experiment of issue 51 (`benchmarks.video_llm_quality`) and its task (`processing.short_events_vqa`):
the questions, the frames and their ceiling, vLLM's EVS re-implemented, the pruned forward against the stock model,
the compute count against torch's FLOP counter, and the pipeline end to end (`--quick`) with the token counts every
arm claims."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import benchmarks.video_llm_quality as quality
from processing.short_events import Flash, Scene, ShortEventVideo
from processing.short_events_vqa import (FLASH_COLOURS, SCENE_COLOURS, Question, ceiling_accuracy, flash_seen,
                                         make_vqa_split, render_flash_frame, sampled_frames)
from processing.synthetic import COLOURS
from video_llms import apply_testa_to_video_llm, remove_testa_from_video_llm
from video_llms.common import video_settings


def hand_video() -> ShortEventVideo:
    """40 frames: red 0-20 with a purple flash at 5-7, green 20-40."""
    return ShortEventVideo("v", "test", 0, 4, 56, 40, [
        Scene("red", 0, 20, [Flash("purple", 5, 7)]), Scene("green", 20, 40)])


def test_each_video_has_one_flash_and_its_question_asks_for_its_colour():
    videos, questions = make_vqa_split(64, seed=3, size=56)
    assert len(questions) == len(videos) == 64
    for video, question in zip(videos, questions):
        assert question.text == "what colour is the flash" and len(video.flashes) == 1
        assert question.answer == video.flashes[0].colour in FLASH_COLOURS
        colours = [scene.colour for scene in video.scenes]
        assert set(colours) <= set(SCENE_COLOURS) and all(a != b for a, b in zip(colours, colours[1:]))
    assert {q.answer for q in questions} == set(FLASH_COLOURS)
    again, _ = make_vqa_split(64, seed=3, size=56)
    assert again == videos                                     # deterministic
    assert make_vqa_split(64, seed=4, size=56)[0] != videos


def test_the_flash_fills_the_frame_while_it_lasts():
    video = hand_video()
    for t, colour in ((5, "purple"), (6, "purple"), (7, "red"), (39, "green")):
        assert (render_flash_frame(video, t) == COLOURS[colour]).all(), t
    assert sampled_frames(video, 4).shape == (4, 56, 56, 3)
    with pytest.raises(ValueError, match="outside video"):
        render_flash_frame(video, 40)


def test_flash_seen_and_the_ceiling_by_hand():
    # uniform sampling of 4 of 40 frames takes the middle of each 10-frame segment: 5, 15, 25, 35
    video = hand_video()
    assert flash_seen(video, 4)
    late = ShortEventVideo("w", "test", 0, 4, 56, 40, [
        Scene("red", 0, 20), Scene("green", 20, 40, [Flash("white", 30, 31)])])
    assert not flash_seen(late, 4) and flash_seen(late, 40)
    questions = [Question(0, "purple"), Question(1, "white")]
    assert ceiling_accuracy([video, late], questions, 4) == pytest.approx((1 + 1 / 3) / 2)
    assert ceiling_accuracy([video, late], questions, 40) == 1.0


def test_more_frames_raise_the_ceiling():
    videos, questions = make_vqa_split(64, seed=3, size=56)
    assert ceiling_accuracy(videos, questions, 8) < ceiling_accuracy(videos, questions, 16) <= 1.0
    assert ceiling_accuracy(videos, questions, 32) == 1.0   # every flash lasts at least 1/20 of its video


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


def test_merge_of_two_seed_runs_keeps_both_seeds_and_every_target(tmp_path):
    """``--merge`` (one process per seed, then merged) gives one summary over both seeds: per-seed accuracies,
    validation logs and losses of each, and every target recomputed."""
    threads = ["--threads", str(torch.get_num_threads())]   # (main sets torch's thread count: keep the suite's)
    parts = []
    for seed in (0, 1):
        parts.append(str(tmp_path / f"s{seed}.json"))
        quality.main(["--quick", "--seeds", str(seed), *threads, "--output", parts[-1]])
    merged = quality.main(["--merge", *parts, "--output", str(tmp_path / "merged.json")])
    assert merged["seeds_done"] == [0, 1] and set(merged["validation_accuracy"]) == {"0", "1"}
    assert set(merged["final_train_loss"]) == {"0", "1"} and set(merged["ceiling_accuracy"]) == {"8", "16"}
    assert all(len(row["accuracy_per_seed"]) == 2 for row in merged["arms"])
    assert set(merged["targets"]) == {"b_beats_a_beyond_spread", "b_at_least_c_on_every_seed",
                                      "b_beats_c_beyond_spread", "b_mean_minus_a_mean", "b_mean_minus_c_mean"}
    with pytest.raises(ValueError, match="cannot merge"):
        other = quality.main(["--quick", "--seeds", "2", *threads, "--output", str(tmp_path / "s2.json")])
        other["frame_size"] = 28
        (tmp_path / "s2.json").write_text(json.dumps(other))
        quality.main(["--merge", parts[0], str(tmp_path / "s2.json"), "--output", str(tmp_path / "bad.json")])
