"""TESTA inside video-LLMs' vision towers (`video_llms`), on tiny offline models (`helpers.video_llms`).

References: the stock transformers model (exact when idle), transformers' own modules re-run by hand in float64 (one
merge step), the schedule's arithmetic (token counts), and per-video runs (batches)."""

import itertools

import pytest
import torch

from helpers import video_llms as tiny

from modeling_testa.patching import apply_testa, remove_testa
from video_llms import apply_testa_to_video_llm, is_video_llm, remove_testa_from_video_llm
from video_llms.common import token_grid, video_settings
from video_llms.qwen2_5_vl import video_token_counts

# Two videos of different lengths: 8 frames (4 tubelets) and 6 frames (3 tubelets), 4 merge units per tubelet.
VIDEOS = (8, 6)
SCHEDULE = {"temporal_reduction": [1, 0, 1, 0], "spatial_reduction": [0, 1, 1, 0]}


def _inputs(processor, frames=VIDEOS, seed=0, texts=None):
    videos = [tiny.video(count, seed + i) for i, count in enumerate(frames)]
    texts = texts or [text for text, _ in zip(itertools.cycle(["describe the video", "what happens"]), frames)]
    texts = [tiny.prompt(processor, text) for text in texts]
    return processor(text=texts, videos=videos, return_tensors="pt", padding=True)


def _run(model, inputs, new_tokens=4):
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return logits, tokens


@pytest.fixture(scope="module")
def qwen2_5():
    return tiny.qwen2_5_vl()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_qwen2_5_vl_idle_equals_stock(attention):
    """R = 0 everywhere: the patched tower (its own attention calls, rebuilt windows, rotary and positions) gives
    the stock logits within 1e-5 and the same greedy tokens, for a batch of two videos of different lengths."""
    model, processor = tiny.qwen2_5_vl(attention)
    inputs = _inputs(processor)
    stock_logits, stock_tokens = _run(model, inputs)
    apply_testa_to_video_llm(model, processor, temporal_reduction=0, spatial_reduction=0)
    patched_inputs = _inputs(processor)
    assert torch.equal(patched_inputs["input_ids"], inputs["input_ids"])
    logits, tokens = _run(model, patched_inputs)
    torch.testing.assert_close(logits, stock_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, stock_tokens)


def test_qwen2_5_vl_windows_idle_equals_stock_and_reduced_runs():
    """112x84 frames: 4x3 units in windows of 2x2 units (uneven windows, an empty padded one), so the rebuilt
    window segments are exercised: exact at R = 0, and a reduced run keeps the schedule's count."""
    model, processor = tiny.qwen2_5_vl(frame_pixels=112 * 84)

    def inputs():
        videos = [tiny.video(8, 0, 112, 84), tiny.video(4, 1, 112, 84)]
        return processor(text=[tiny.prompt(processor)] * 2, videos=videos, return_tensors="pt", padding=True)

    assert inputs()["video_grid_thw"].tolist() == [[4, 8, 6], [2, 8, 6]]
    stock_logits, stock_tokens = _run(model, inputs())
    apply_testa_to_video_llm(model, processor)
    logits, tokens = _run(model, inputs())
    torch.testing.assert_close(logits, stock_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, stock_tokens)
    apply_testa_to_video_llm(model, processor, temporal_reduction=[1, 0, 0, 0], spatial_reduction=[2, 1, 1, 1])
    reduced = inputs()
    # 4 x 12 -> 3 x 10 -> 3 x 9 -> 3 x 8 -> 3 x 7 = 21; 2 x 12 -> 2 x 10 -> ... -> 2 x 7 = 14
    assert (reduced["input_ids"] == model.config.video_token_id).sum(dim=1).tolist() == [21, 14]
    logits, _ = _run(model, reduced, new_tokens=2)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_base_model_idle_equals_stock(family):
    """`Qwen2_5_VLModel` / `Qwen3VLModel` (no LM head) are supported as well."""
    model, processor = getattr(tiny, family)()
    base = model.model
    make = _inputs if family == "qwen2_5_vl" else _qwen3_inputs
    inputs = make(processor)
    with torch.no_grad():
        stock = base(**inputs).last_hidden_state
        apply_testa(base, processor=processor)
        try:
            patched = base(**make(processor)).last_hidden_state
        finally:
            remove_testa(base)
    torch.testing.assert_close(patched, stock, atol=1e-5, rtol=0)


def test_images_go_through_the_stock_tower(qwen2_5):
    """An image and a video in one prompt: the image's features and positions are the stock ones; at R = 0 the
    whole output is."""
    from PIL import Image

    model, processor = qwen2_5
    image = Image.fromarray(tiny.video(1, 5)[0])

    def inputs():
        text = f"<|vision_start|> {processor.image_token} <|vision_end|> " + tiny.prompt(processor)
        return processor(text=[text], images=[image], videos=[tiny.video(8, 0)], return_tensors="pt")

    stock_logits, stock_tokens = _run(model, inputs())
    with torch.no_grad():
        stock_image = model.get_image_features(inputs()["pixel_values"], inputs()["image_grid_thw"]).pooler_output
    apply_testa_to_video_llm(model, processor)
    try:
        logits, tokens = _run(model, inputs())
        torch.testing.assert_close(logits, stock_logits, atol=1e-5, rtol=0)
        assert torch.equal(tokens, stock_tokens)
        apply_testa_to_video_llm(model, processor, **SCHEDULE)
        with torch.no_grad():
            image = model.get_image_features(inputs()["pixel_values"], inputs()["image_grid_thw"]).pooler_output
        assert torch.equal(image[0], stock_image[0])
        assert torch.isfinite(_run(model, inputs(), new_tokens=2)[0]).all()
    finally:
        remove_testa_from_video_llm(model)


def test_remove_restores_model_and_processor_exactly(qwen2_5):
    model, processor = qwen2_5
    base = model.model
    before = {name: base.__dict__.get(name) for name in ("get_video_features", "get_rope_index")}
    processor_before = processor.__dict__.get("replace_video_token")
    inputs = _inputs(processor)
    stock_logits, stock_tokens = _run(model, inputs)
    assert apply_testa(model, processor=processor, **SCHEDULE) is model  # dispatched to video_llms
    assert "get_video_features" in base.__dict__ and "replace_video_token" in processor.__dict__
    assert _inputs(processor)["input_ids"].shape[1] < inputs["input_ids"].shape[1]
    remove_testa(model)
    assert {name: base.__dict__.get(name) for name in before} == before == {"get_video_features": None,
                                                                           "get_rope_index": None}
    assert processor.__dict__.get("replace_video_token") is processor_before is None
    assert base.get_video_features.__func__ is type(base).get_video_features
    assert "testa_video_llm" not in model.__dict__
    restored_inputs = _inputs(processor)
    assert torch.equal(restored_inputs["input_ids"], inputs["input_ids"])
    logits, tokens = _run(model, restored_inputs)
    assert torch.equal(logits, stock_logits) and torch.equal(tokens, stock_tokens)


def test_apply_twice_replaces_the_settings(qwen2_5):
    model, processor = qwen2_5
    try:
        apply_testa_to_video_llm(model, processor, temporal_reduction=1)
        apply_testa_to_video_llm(model, processor, spatial_reduction=1)
        assert model.testa_video_llm.settings.temporal_reduction == (0, 0, 0, 0)
        assert len(model.testa_video_llm.replaced) == 3  # two model methods and the processor's, once each
    finally:
        remove_testa_from_video_llm(model)
    assert "get_video_features" not in model.model.__dict__


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_qwen2_5_vl_reduced_token_count_matches_schedule_and_generates(attention):
    model, processor = tiny.qwen2_5_vl(attention)
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    inputs = _inputs(processor)
    # by hand: 4 tubelets x 4 units -> R_T=1: 3 x 4 -> R_S=1: 3 x 3 -> R_T=1, R_S=1: 2 x 2 = 4 tokens (of 16);
    # 3 x 4 -> 2 x 4 -> 2 x 3 -> R_T capped at (2 - 1) // 2 = 0, R_S=1: 2 x 2 = 4 tokens (of 12)
    assert video_token_counts(model.testa_video_llm.settings, inputs["video_grid_thw"]) == [4, 4]
    counts = (inputs["input_ids"] == model.config.video_token_id).sum(dim=1).tolist()
    assert counts == [4, 4]
    with torch.no_grad():
        features = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
    assert [f.shape for f in features] == [torch.Size([4, 32])] * 2
    logits, tokens = _run(model, inputs, new_tokens=3)
    assert logits.shape[:2] == inputs["input_ids"].shape and tokens.shape == (2, inputs["input_ids"].shape[1] + 3)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_generate_runs_the_tower_once(family):
    """generate asks for positions before its prefill: the tower runs there, and the prefill takes its features."""
    model, processor = getattr(tiny, family)()
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    calls = []
    handle = model.model.visual.patch_embed.register_forward_hook(lambda *args: calls.append(1))
    try:
        inputs = _inputs(processor) if family == "qwen2_5_vl" else _qwen3_inputs(processor)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert len(calls) == 1
        with torch.no_grad():  # a forward pass: features first, positions from them
            model(**inputs)
        assert len(calls) == 2
    finally:
        handle.remove()
        remove_testa_from_video_llm(model)


def test_batch_of_videos_equals_per_video_runs(qwen2_5):
    model, processor = qwen2_5
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    try:
        batch = _inputs(processor, texts=["what happens"] * 2)
        with torch.no_grad():
            together = model.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"]).pooler_output
            together_positions = model.testa_video_llm.cache["positions"]["positions"]
            for index, frames in enumerate(VIDEOS):
                alone = _inputs(processor, (frames,), seed=index, texts=["what happens"])
                features = model.get_video_features(alone["pixel_values_videos"], alone["video_grid_thw"])
                torch.testing.assert_close(features.pooler_output[0], together[index], atol=1e-5, rtol=0)
                positions = model.testa_video_llm.cache["positions"]["positions"][0]
                assert torch.equal(positions, together_positions[index])
                # and the LLM's next-token logits of that prompt alone
                single = model(**alone).logits[0, -1]
                torch.testing.assert_close(single, model(**batch).logits[index, -1], atol=1e-5, rtol=0)
    finally:
        remove_testa_from_video_llm(model)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sizes_and_centroids_are_conserved(family):
    """Merges are size-weighted means: the sizes of a video's tokens add up to its input units, and the
    size-weighted sum of their centroids is that of the input grid (each merge conserves both)."""
    model, processor = getattr(tiny, family)()
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    inputs = _inputs(processor) if family == "qwen2_5_vl" else _qwen3_inputs(processor)
    patch = model.testa_video_llm
    with torch.no_grad():
        videos = patch.adapter.encode(model.model, inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                      patch.settings)
    for video, (t, h, w) in zip(videos, inputs["video_grid_thw"].tolist()):
        grid = torch.tensor([[i, r, c] for i in range(t) for r in range(h // 2) for c in range(w // 2)]).double()
        assert video.sizes.sum() == t * h * w // 4 and video.features.shape[0] == 4
        assert bool((video.sizes > 1).any())  # something merged
        torch.testing.assert_close((video.positions.double() * video.sizes.double()[:, None]).sum(0), grid.sum(0),
                                   atol=1e-4, rtol=0)


def test_merged_positions_say_where_tokens_came_from(qwen2_5):
    """Every video token's M-RoPE position lies within its video's grid, and time positions are the tubelets'
    (centroids of the merged ones): sorted, first at the video's start."""
    model, processor = qwen2_5
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    try:
        inputs = _inputs(processor)
        with torch.no_grad():
            model(**inputs)
            positions, _ = model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"],
                second_per_grid_ts=inputs["second_per_grid_ts"], attention_mask=inputs["attention_mask"])
        interval = model.config.vision_config.tokens_per_second * inputs["second_per_grid_ts"]
        for index, (t, h, w) in enumerate(inputs["video_grid_thw"].tolist()):
            video = inputs["input_ids"][index] == model.config.video_token_id
            start = positions[1, index][video].min()  # the row offset: the video's first position
            rows, cols = positions[1, index][video] - start, positions[2, index][video] - start
            times = (positions[0, index][video] - start).float()
            assert rows.min() >= 0 and rows.max() < h // 2 and cols.min() >= 0 and cols.max() < w // 2
            assert times.min() >= 0 and times.max() <= (t - 1) * interval[index] and bool((times.diff() >= 0).all())
    finally:
        remove_testa_from_video_llm(model)


def test_unsupported_settings_are_refused_by_name(qwen2_5):
    model, processor = qwen2_5
    with pytest.raises(ValueError, match="aggregation_strategy='importance'"):
        apply_testa_to_video_llm(model, processor, temporal_reduction=1, aggregation_strategy="importance")
    with pytest.raises(ValueError, match="temporal_reduction"):
        apply_testa_to_video_llm(model, processor, temporal_reduction=[1, 1])  # 4 blocks
    assert "testa_video_llm" not in model.__dict__ and "replace_video_token" not in processor.__dict__
    assert is_video_llm(model) and is_video_llm(model.model) and not is_video_llm(model.model.visual)


def test_positions_before_the_tower_raise_a_clear_error():
    model, processor = tiny.qwen2_5_vl()
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    inputs = _inputs(processor)
    with pytest.raises(ValueError, match="depend on what the tower merged"):
        model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                   video_grid_thw=inputs["video_grid_thw"])


def test_stale_placeholders_raise():
    """Inputs from an unpatched processor have the stock number of placeholders: transformers' own check says so."""
    model, processor = tiny.qwen2_5_vl()
    inputs = _inputs(processor)
    apply_testa_to_video_llm(model, None, **SCHEDULE)
    with pytest.raises(ValueError, match="Video features and video tokens do not match"), torch.no_grad():
        model(**inputs)


# ----------------------------------------------------------------------------------------------------------------------
# One merge step re-computed by hand in float64
# ----------------------------------------------------------------------------------------------------------------------


def _bipartite_by_hand(metric: torch.Tensor, r: int) -> list[tuple[int, int]]:
    """ToMe's bipartite matching written out: A = even, B = odd rows; every A row's best B partner by cosine; the r
    best pairs ``(a, b)`` in input positions."""
    a_rows, b_rows = list(range(0, len(metric), 2)), list(range(1, len(metric), 2))
    unit = metric / metric.norm(dim=-1, keepdim=True)
    best = []
    for a in a_rows:
        scores = [float(unit[a] @ unit[b]) for b in b_rows]
        j = max(range(len(b_rows)), key=lambda k: (scores[k], -k))
        best.append((scores[j], a, b_rows[j]))
    best.sort(key=lambda item: -item[0])
    return [(a, b) for _, a, b in best[:r]]


@pytest.mark.parametrize("step", ["temporal", "spatial"])
def test_one_merge_step_against_float64_hand_computation(step):
    """A one-block tower (full attention), one video of 4 tubelets x 4 units, R_T = 1 or R_S = 1: the stock block's
    modules re-run by hand in float64, the matching written out, the size-weighted mean, the merger, the centroids."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as family

    model, processor = tiny.qwen2_5_vl(depth=1)
    model.config.vision_config.fullatt_block_indexes = [0]
    model.model.visual.fullatt_block_indexes = [0]
    model.double()
    reduction = {"temporal_reduction": 1} if step == "temporal" else {"spatial_reduction": 1}
    apply_testa_to_video_llm(model, processor, score_grid=0, **reduction)
    inputs = _inputs(processor, (8,))
    pixels, grid = inputs["pixel_values_videos"].double(), inputs["video_grid_thw"]
    with torch.no_grad():
        features = model.get_video_features(pixels, grid).pooler_output[0]
        positions = model.testa_video_llm.cache["positions"]["positions"][0]

        visual = model.model.visual
        block = visual.blocks[0]
        x = visual.patch_embed(pixels)  # (64, C): 4 tubelets x 4 units x 4 tokens, block order
        h = x + block.attn(block.norm1(x), cu_seqlens=torch.tensor([0, 16, 32, 48, 64], dtype=torch.int32),
                           position_embeddings=visual.rotary_pos_emb(x, family.get_vision_position_ids(grid, 2)))
        heads = block.attn.num_heads
        keys = block.attn.qkv(block.norm1(x)).view(64, 3, heads, -1)[:, 1].mean(dim=1)  # before the rotary
        units = h.view(4, 4, -1)  # (tubelets, units, 4 * C)
        unit_keys = keys.view(4, 4, 4, -1).mean(dim=2)
        centroids = torch.tensor([[t, u // 2, u % 2] for t in range(4) for u in range(4)], dtype=torch.float64)
        centroids = centroids.view(4, 4, 3)
        if step == "temporal":
            ((a, b),) = _bipartite_by_hand(unit_keys.mean(dim=1), 1)
            merged = (units[a] + units[b]) / 2
            kept = [t for t in range(4) if t != a]
            tokens = torch.stack([merged if t == b else units[t] for t in kept])
            where = torch.stack([(centroids[a] + centroids[b]) / 2 if t == b else centroids[t] for t in kept])
        else:
            tokens, where = [], []
            for t in range(4):
                ((a, b),) = _bipartite_by_hand(unit_keys[t], 1)
                kept = [u for u in range(4) if u != a]
                tokens.append(torch.stack([(units[t, a] + units[t, b]) / 2 if u == b else units[t, u] for u in kept]))
                where.append(torch.stack([(centroids[t, a] + centroids[t, b]) / 2 if u == b else centroids[t, u]
                                          for u in kept]))
            tokens, where = torch.stack(tokens), torch.stack(where)
        tokens = tokens.reshape(-1, h.shape[-1])
        out = visual.merger(tokens + block.mlp(block.norm2(tokens)))
        where = where.reshape(-1, 3)
        order = sorted(range(len(where)), key=lambda i: tuple(where[i].tolist()))
    torch.testing.assert_close(features, out[order], atol=1e-12, rtol=0)
    torch.testing.assert_close(positions, where[order].float(), atol=0, rtol=0)  # centroids are fp32
    assert features.shape[0] == 12  # 3 tubelets x 4 units, or 4 tubelets x 3 units


def test_token_grid_is_the_schedule():
    settings = video_settings(4, [1, 0, 1, 0], [0, 1, 1, 0])
    assert token_grid(settings, 4, 4) == (2, 2) and token_grid(settings, 3, 4) == (2, 2)
    assert token_grid(settings, 1, 100) == (1, 98)  # one tubelet: nothing to merge in time
    assert token_grid(video_settings(4, 0, 0), 7, 9) == (7, 9)


# ----------------------------------------------------------------------------------------------------------------------
# Qwen3-VL: one group of tokens per tubelet with its timestamp, DeepStack features
# ----------------------------------------------------------------------------------------------------------------------


def _qwen3_inputs(processor, frames=VIDEOS, texts=None, seed=0):
    videos = [tiny.video(count, seed + i, 64, 64) for i, count in enumerate(frames)]
    texts = texts or [text for text, _ in zip(itertools.cycle(["describe the video", "what happens"]), frames)]
    return processor(text=[tiny.prompt(processor, text) for text in texts], videos=videos,
                     video_metadata=[tiny.metadata(count) for count in frames], return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def qwen3():
    return tiny.qwen3_vl()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_qwen3_vl_idle_equals_stock(attention):
    """R = 0: stock logits (DeepStack included) within 1e-5 and the same greedy tokens; the same prompt (timestamps
    included) from the patched processor."""
    model, processor = tiny.qwen3_vl(attention)
    inputs = _qwen3_inputs(processor)
    stock_logits, stock_tokens = _run(model, inputs)
    apply_testa(model, processor=processor)
    patched_inputs = _qwen3_inputs(processor)
    assert torch.equal(patched_inputs["input_ids"], inputs["input_ids"])
    logits, tokens = _run(model, patched_inputs)
    torch.testing.assert_close(logits, stock_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, stock_tokens)
    remove_testa(model)
    assert "get_video_features" not in model.model.__dict__ and "replace_video_token" not in processor.__dict__
    assert torch.equal(_run(model, _qwen3_inputs(processor))[0], stock_logits)


def test_qwen3_vl_prompt_has_one_group_per_remaining_tubelet(qwen3):
    from video_llms.qwen3_vl import span_timestamps

    model, processor = qwen3
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    try:
        inputs = _qwen3_inputs(processor, (8,))
        text = processor.tokenizer.decode(inputs["input_ids"][0])
        # 4 tubelets of 4 units -> 2 x 2 (as for Qwen2.5-VL); stock timestamps at 4 fps: 0.125, 0.625, 1.125, 1.625
        assert text.count("<|video_pad|>") == 4 and text.count("seconds") == 2
        assert "< 0.4 seconds > <|vision_start|> <|video_pad|> <|video_pad|> <|vision_end|>" in text
        assert "< 1.4 seconds > <|vision_start|> <|video_pad|> <|video_pad|> <|vision_end|>" in text
        assert span_timestamps([0.125, 0.625, 1.125, 1.625], 2) == [0.375, 1.375]
        assert span_timestamps([0.5, 1.5, 2.5], 2) == [1.0, 2.5]  # numpy.array_split: the first spans are longer
        logits, tokens = _run(model, _qwen3_inputs(processor), new_tokens=3)
        assert torch.isfinite(logits).all() and tokens.shape[1] == _qwen3_inputs(processor)["input_ids"].shape[1] + 3
    finally:
        remove_testa_from_video_llm(model)


def test_qwen3_vl_deepstack_features_are_merged_like_the_tokens(qwen3):
    """Merges only in the last block, after both DeepStack taps: the tapped features are the stock ones, so every
    reduced DeepStack feature must be the size-weighted mean of the stock features of the units merged into its
    token (found from the token's centroid), in the order of the tokens."""
    model, processor = qwen3
    inputs = _qwen3_inputs(processor, (8,))
    pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    with torch.no_grad():
        stock = model.get_video_features(pixels, grid).deepstack_features  # [tap][video] (16, out), raster order
        apply_testa_to_video_llm(model, processor, temporal_reduction=[0, 0, 0, 1])
        try:
            reduced = model.get_video_features(pixels, grid)
            centroids = model.testa_video_llm.cache["positions"]["positions"][0]
        finally:
            remove_testa_from_video_llm(model)
    assert reduced.pooler_output[0].shape[0] == 12  # 3 tubelets x 4 units
    times = centroids[:, 0]
    merged_time = float(times[times != times.round()][0])  # the merged tubelet: centroid between two tubelets
    a, b = sorted(set(range(4)) - {int(t) for t in times[times == times.round()].tolist()})  # the two not left
    assert ((times == merged_time).sum()) == 4 and merged_time == (a + b) / 2
    for tap in range(2):
        for token, (t, row, col) in enumerate(centroids.tolist()):
            unit = int(row) * 2 + int(col)
            if t == merged_time:
                expected = (stock[tap][0][a * 4 + unit] + stock[tap][0][b * 4 + unit]) / 2
            else:
                expected = stock[tap][0][int(t) * 4 + unit]
            torch.testing.assert_close(reduced.deepstack_features[tap][0][token], expected, atol=1e-6, rtol=0)


def test_qwen3_vl_batch_of_videos_equals_per_video_runs(qwen3):
    model, processor = qwen3
    apply_testa_to_video_llm(model, processor, **SCHEDULE)
    try:
        batch = _qwen3_inputs(processor, texts=["what happens"] * 2)
        with torch.no_grad():
            together = model.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"])
            batch_logits = model(**batch).logits
            for index, frames in enumerate(VIDEOS):
                alone = _qwen3_inputs(processor, (frames,), texts=["what happens"], seed=index)
                features = model.get_video_features(alone["pixel_values_videos"], alone["video_grid_thw"])
                torch.testing.assert_close(features.pooler_output[0], together.pooler_output[index], atol=1e-5, rtol=0)
                for tap in range(2):
                    torch.testing.assert_close(features.deepstack_features[tap][0],
                                               together.deepstack_features[tap][index], atol=1e-5, rtol=0)
                torch.testing.assert_close(model(**alone).logits[0, -1], batch_logits[index, -1], atol=1e-5, rtol=0)
    finally:
        remove_testa_from_video_llm(model)


# ----------------------------------------------------------------------------------------------------------------------
# Budgets and the arithmetic the docs show
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.25, 0.1])
@pytest.mark.parametrize("grid", [(32, 256), (16, 196), (3, 4)])
def test_kept_fraction_plan_keeps_at_most_that_and_close_to_it(keep, grid):
    from video_llms.budget import plan_kept_fraction

    slices, units = grid
    if keep * slices * units < 2:  # 3 x 4 at 10%: 1.2 tokens, but merging never takes 2 tubelets to 1
        with pytest.raises(ValueError, match="fewer than the 2 x 1"):
            plan_kept_fraction(32, slices, units, keep)
        return
    plan = plan_kept_fraction(32, slices, units, keep)
    kept_slices, kept_units = token_grid(video_settings(32, **plan), slices, units)
    kept = kept_slices * kept_units
    assert kept <= keep * slices * units
    # one more unit per slice would exceed the budget: as close as whole units allow
    assert kept_slices * (kept_units + 1) > keep * slices * units or kept_units == units


def test_kept_fraction_plan_by_hand():
    from video_llms.budget import plan_kept_fraction

    # 4 blocks, 4 tubelets x 4 units, keep 25%: sqrt(0.25) = 0.5 of the tubelets (2) and 4 / 2 = 2 units each
    plan = plan_kept_fraction(4, 4, 4, 0.25)
    assert plan == {"temporal_reduction": [1, 1, 0, 0], "spatial_reduction": [1, 1, 0, 0]}
    assert token_grid(video_settings(4, **plan), 4, 4) == (2, 2)
    assert plan_kept_fraction(4, 4, 4, 1.0) == {"temporal_reduction": [0] * 4, "spatial_reduction": [0] * 4}
    with pytest.raises(ValueError, match="first_block"):
        plan_kept_fraction(4, 64, 4, 0.02, temporal_share=1.0, first_block=3)
    with pytest.raises(ValueError, match="keep=0"):
        plan_kept_fraction(4, 4, 4, 0)


def test_docs_arithmetic():
    """The numbers of docs/video_llms.md: Qwen2.5-VL-7B's tower (32 blocks) on 64 frames at 448x448 px."""
    from video_llms.budget import plan_kept_fraction

    slices, units = 64 // 2, (448 // 28) ** 2  # tubelets of 2 frames; 2x2 units of 14 px patches
    assert (slices, units, slices * units) == (32, 256, 8192)
    plan = plan_kept_fraction(32, slices, units, 0.25)
    assert token_grid(video_settings(32, **plan), slices, units) == (16, 128)
    assert plan["temporal_reduction"] == [1] * 16 + [0] * 16 and plan["spatial_reduction"] == [4] * 32
    assert token_grid(video_settings(32, 0, 2), slices, units) == (32, 192)  # R_S = 2 at every block: 75%
    # Qwen3-VL (16 px patches, 2x2 units of 32 px): 64 frames at 448x448 -> 32 x 196
    assert token_grid(video_settings(27, 0, 0), 32, (448 // 32) ** 2) == (32, 196)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_idle_get_video_features_keeps_the_stock_last_hidden_state_and_tuples(family):
    """R = 0: the patched ``get_video_features`` gives stock's ``last_hidden_state``: Qwen3-VL's in stock's order;
    Qwen2.5-VL's stock rows (which it keeps in window order) in the output order, 4 rows per output token, so the
    merger on them gives ``pooler_output``. ``return_dict=False`` (in the call or the config) gives stock's tuple."""
    if family == "qwen2_5_vl":  # 112x84 frames: 4 windows per frame, so stock's window order is not ours
        model, processor = tiny.qwen2_5_vl(frame_pixels=112 * 84)
        inputs = processor(text=[tiny.prompt(processor)] * 2, return_tensors="pt", padding=True,
                           videos=[tiny.video(8, 0, 112, 84), tiny.video(4, 1, 112, 84)])
    else:
        model, processor = tiny.qwen3_vl()
        inputs = _qwen3_inputs(processor)
    pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    with torch.no_grad():
        stock = model.get_video_features(pixels, grid)
        apply_testa_to_video_llm(model, processor)
        ours = model.get_video_features(pixels, grid)
        as_tuple = model.get_video_features(pixels, grid, return_dict=False)
        model.config.return_dict = False
        config_tuple = model.get_video_features(pixels, grid)
        model.config.return_dict = True
        merged = model.model.visual.merger(ours.last_hidden_state)
    remove_testa_from_video_llm(model)
    width = stock.last_hidden_state.shape[-1]
    assert ours.last_hidden_state.shape == stock.last_hidden_state.shape == (pixels.shape[0], width)
    torch.testing.assert_close(merged, torch.cat(ours.pooler_output), atol=1e-6, rtol=0)
    if family == "qwen3_vl":
        torch.testing.assert_close(ours.last_hidden_state, stock.last_hidden_state, atol=1e-5, rtol=0)
    else:  # every stock unit (4 rows) is one of ours, each once
        stock_units, our_units = (o.last_hidden_state.reshape(-1, 4 * width) for o in (stock, ours))
        distance, match = torch.cdist(our_units.double(), stock_units.double()).min(dim=1)
        assert distance.max() < 1e-4 and sorted(match.tolist()) == list(range(stock_units.shape[0]))
        assert match.tolist() != list(range(stock_units.shape[0]))
    for output in (as_tuple, config_tuple):
        assert isinstance(output, tuple) and len(output) == len(stock.to_tuple())
        torch.testing.assert_close(output[0], ours.last_hidden_state, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat(output[1]), torch.cat(ours.pooler_output), atol=0, rtol=0)
    # in chunks of frames the whole video's hidden states never exist: no last_hidden_state, the same features
    apply_testa_to_video_llm(model, processor, chunk_frames=2)
    with torch.no_grad():
        chunked = model.get_video_features(pixels, grid)
    remove_testa_from_video_llm(model)
    assert chunked.last_hidden_state is None
    torch.testing.assert_close(torch.cat(chunked.pooler_output), torch.cat(ours.pooler_output), atol=1e-5, rtol=0)
