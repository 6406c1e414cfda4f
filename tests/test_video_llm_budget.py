"""The frames budget of the Qwen towers (`video_llms.budget.tower_macs`, `plan_for_tower_budget`): the MAC model
against a hand-worked case and against `torch.utils.flop_counter` counting real runs of tiny towers (stock and
patched), and the plan against a brute-force search of the same candidates."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import video_llms as tiny

from video_llms import apply_testa_to_video_llm, token_grid
from video_llms.budget import QwenTowerShape, plan_for_tower_budget, plan_kept_fraction, tower_macs
from video_llms.common import video_settings

# A Qwen3-VL-shaped tower small enough to count by hand: 2 blocks, hidden 8 (2 heads of 4), MLP 16, output 8,
# 2 px patches, DeepStack tap after block 0.
HAND = QwenTowerShape("qwen3_vl", depth=2, hidden_size=8, intermediate_size=16, num_heads=2, out_hidden_size=8,
                      patch_size=2, temporal_patch_size=2, in_channels=3, deepstack_blocks=(0,))


def test_tower_macs_by_hand():
    # 8 frames of 8 x 8 px: 4 tubelets of 4 x 4 patches = 4 units (16 tokens) each
    embed = 16 * (3 * 2 * 2 * 2) * 8                     # per tubelet: tokens x patch volume x hidden
    block = 16 * 4 * 8 * 8 + 2 * 16 ** 2 * 8 + 16 * 2 * 8 * 16  # qkv + proj, Q K^T + A V, MLP
    merger = 4 * (32 * 32 + 32 * 8)                       # per unit: fc1 (4d -> 4d), fc2 (4d -> out)
    per_tubelet = embed + 2 * block + 2 * merger          # DeepStack merger + final merger
    assert per_tubelet == 37_888
    assert tower_macs(HAND, (4, 4, 4)) == 4 * per_tubelet == 151_552
    # R_T = 1, R_S = 1 at block 0: 4 -> 3 tubelets, 4 -> 3 units
    block0 = (64 * 4 * 64 + 2 * 4 * 16 ** 2 * 8        # qkv + proj and attention on 4 x 16 tokens
              + 2 * 2 * 4 + 3 * 2 * 2 * 4             # tubelet scores (2 even x 2 odd, head dim 4), units per tubelet
              + 36 * 2 * 8 * 16 + 9 * 1280)            # MLP on 3 x 3 units (36 tokens), DeepStack on 9 units
    block1 = 36 * 4 * 64 + 2 * 3 * 12 ** 2 * 8 + 36 * 2 * 8 * 16
    assert tower_macs(HAND, (4, 4, 4), {"temporal_reduction": [1, 0], "spatial_reduction": [1, 0]}) == (
        4 * embed + block0 + block1 + 9 * 1280) == 102_720


def test_frames_budget_by_hand():
    """8 frames in the compute of 4 (75,776 MACs): the R_T = R_S = 1 schedule above (102,720) does not fit; the
    plan keeps the most tokens that do, and equals a brute force over the same candidates."""
    plan = plan_for_tower_budget(HAND, 8, 4, height=8, width=8)
    budget = tower_macs(HAND, (2, 4, 4))
    assert budget == 75_776
    assert tower_macs(HAND, (4, 4, 4), plan) <= budget
    best = None
    for blocks in (1, 2):
        for kept in range(1, 17):
            try:
                candidate = plan_kept_fraction(2, 4, 4, kept / 16, merge_blocks=blocks)
            except ValueError:
                continue
            if tower_macs(HAND, (4, 4, 4), candidate) <= budget:
                s, u = token_grid(video_settings(2, **candidate), 4, 4)
                best = max(best or 0, s * u)
    s, u = token_grid(video_settings(2, **plan), 4, 4)
    assert s * u == best
    assert plan_for_tower_budget(HAND, 4, 4, height=8, width=8) == {"temporal_reduction": [0, 0],
                                                                   "spatial_reduction": [0, 0]}


def test_frames_budget_refuses_bad_input_by_name():
    for kwargs, name in (({"frames": 7}, "frames=7"), ({"budget_frames": 0}, "budget_frames"),
                         ({"height": 6}, "height=6"), ({"merge_blocks": 3}, "merge_blocks"),
                         ({"first_block": 2}, "first_block"), ({"temporal_share": 2}, "temporal_share")):
        arguments = {"frames": 8, "budget_frames": 4, "height": 8, "width": 8, **kwargs}
        with pytest.raises(ValueError, match=name):
            plan_for_tower_budget(HAND, arguments.pop("frames"), arguments.pop("budget_frames"), **arguments)
    with pytest.raises(TypeError, match="Qwen2.5-VL or Qwen3-VL"):
        QwenTowerShape.of(object())
    with pytest.raises(ValueError, match="cannot fit"):
        plan_for_tower_budget(HAND, 64, 2, height=8, width=8)


def _counted_tower_macs(model, inputs) -> int:
    """Multiply-accumulates of the model's vision tower on the videos, as torch's flop counter sees them."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    return counter.get_total_flops() // 2


SCHEDULES = [{}, {"temporal_reduction": [1, 0, 1, 0], "spatial_reduction": [0, 1, 1, 0]},
             {"temporal_reduction": [2, 0, 0, 0]}]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("schedule", range(len(SCHEDULES)))
def test_tower_macs_equal_the_flop_counter(family, schedule):
    """The stock tower and the patched one (eager attention: its products are counted), one 12-frame video: the
    model's MACs equal the counted ones (Qwen2.5-VL at 56 x 56 px: one window per frame, so exact)."""
    model, processor = tiny.qwen2_5_vl("eager") if family == "qwen2_5_vl" else tiny.qwen3_vl("eager")
    size = 56 if family == "qwen2_5_vl" else 64
    text = [tiny.prompt(processor, "describe the video")]
    video = [tiny.video(12, 0, size, size)]
    extra = {} if family == "qwen2_5_vl" else {"video_metadata": [tiny.metadata(12)]}
    if SCHEDULES[schedule]:
        apply_testa_to_video_llm(model, processor, **SCHEDULES[schedule])
    inputs = processor(text=text, videos=video, return_tensors="pt", **extra)
    grid = tuple(int(v) for v in inputs["video_grid_thw"][0])
    assert tower_macs(model, grid, SCHEDULES[schedule] or None) == _counted_tower_macs(model, inputs)


def test_window_attention_is_bounded():
    """Qwen2.5-VL at 112 x 84 px (4 uneven windows) with unit merges in window blocks: which windows lose units
    depends on the video, so the model gives the bound (at least the counted MACs), exact without unit merges."""
    model, processor = tiny.qwen2_5_vl("eager", frame_pixels=112 * 84)
    for schedule, exact in (({"temporal_reduction": [1, 0, 1, 0]}, True), ({"spatial_reduction": [2, 0, 1, 0]}, False)):
        apply_testa_to_video_llm(model, processor, **schedule)
        inputs = processor(text=[tiny.prompt(processor, "describe the video")], videos=[tiny.video(8, 0, 84, 112)],
                           return_tensors="pt")
        grid = tuple(int(v) for v in inputs["video_grid_thw"][0])
        counted, modelled = _counted_tower_macs(model, inputs), tower_macs(model, grid, schedule)
        assert modelled == counted if exact else modelled >= counted


def test_frames_budget_plan_runs_within_the_budget():
    """End to end on a tiny Qwen3-VL: 16 frames planned into the compute of 12, through apply_testa, count at most
    the MACs (flop counter) of the stock tower on 12 frames, and the LLM gets the plan's tokens (this tiny tower's
    patch embedding, which no merge reduces, is too large a part of it for the compute of 8)."""
    from modeling_testa import apply_testa, remove_testa

    model, processor = tiny.qwen3_vl("eager")
    text = [tiny.prompt(processor, "describe the video")]

    def inputs(frames):
        return processor(text=text, videos=[tiny.video(frames, 0, 64, 64)], video_metadata=[tiny.metadata(frames)],
                         return_tensors="pt")

    stock = _counted_tower_macs(model, inputs(12))
    plan = plan_for_tower_budget(model, 16, 12, height=64, width=64)
    apply_testa(model, processor=processor, **plan)
    try:
        batch = inputs(16)
        assert _counted_tower_macs(model, batch) <= stock
        slices, units = token_grid(model.testa_video_llm.settings, 8, 4)
        assert int((batch["input_ids"] == model.config.video_token_id).sum()) == slices * units < 8 * 4
    finally:
        remove_testa(model)


def test_docs_frames_budget_arithmetic():
    """The numbers of docs/video_llms.md's frames budget: Qwen2.5-VL-7B's tower (dimensions of its config.json, as
    the tower benchmark writes them), 64 frames at 448 x 448 px in the tower compute of 32."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from benchmarks.video_llm_towers import QWEN2_5_VL_7B_VISION

    config = Qwen2_5_VLVisionConfig(**QWEN2_5_VL_7B_VISION)
    budget = tower_macs(config, (16, 32, 32))
    assert round(budget / 1e12, 2) == 10.78  # TMAC of 32 frames, stock: 4096 video tokens
    plan = plan_for_tower_budget(config, 64, 32, height=448, width=448)
    assert token_grid(video_settings(32, **plan), 32, 256) == (23, 176)  # 4048 tokens
    assert sum(1 for r in plan["spatial_reduction"] if r) == 1 and plan["temporal_reduction"][0] == 9
    assert plan["spatial_reduction"][0] == 80
    assert round(tower_macs(config, (32, 32, 32), plan) / budget, 3) == 0.996
    gentle = plan_for_tower_budget(config, 64, 32, height=448, width=448, merge_blocks=32)
    assert token_grid(video_settings(32, **gentle), 32, 256) == (17, 144)  # 2448 tokens
    assert round(tower_macs(config, (32, 32, 32), gentle) / budget, 3) == 0.999
    assert round(tower_macs(config, (32, 32, 32)) / budget, 2) == 2.0 and round(tower_macs(config, (32, 32, 32)) / 1e12, 2) == 21.55
