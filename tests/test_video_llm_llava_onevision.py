"""TESTA inside LLaVA-OneVision's SigLIP tower (video_llms/llava_onevision.py, reached through `apply_testa`), tiny
random models (CPU, no download).

References are independent of the adapter: the unpatched model itself, a float64 re-computation of one merge step
written out here with plain tensor ops and Python loops, token counts worked by hand from the caps, and the model run
on one video at a time.
"""

import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionModel,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    PreTrainedTokenizerFast,
    Qwen2Config,
    SiglipVisionConfig,
)

from helpers import video_llms as tiny

from benchmarks.llava_onevision_tower_gmac import DOCUMENTED_SCHEDULES, frames_table, tower_gmac
from modeling_testa import apply_testa, remove_testa
from modeling_testa.aggregation_settings import AggregationSettings
from video_llms import apply_testa_to_video_llm
from video_llms.common import patch_of
from video_llms.llava_onevision import LlavaOnevisionAdapter, kept_frames, unmerge_to_grid, video_token_count


WORDS = ["<pad>", "<unk>", "<image>", "<video>", "hello", "what", "happens", "?", "a", "b", "c", "d"]
IMAGE, VIDEO = 2, 3
SIZE, PATCH = 30, 6  # a 5x5 patch grid per frame, pooled to 3x3 = 9 LLM tokens per frame
GRID, POOLED = (SIZE // PATCH) ** 2, math.ceil((SIZE // PATCH) / 2) ** 2
PROMPT = "hello <video> what happens ?"


def tiny_processor() -> LlavaOnevisionProcessor:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
    )
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size={"height": SIZE, "width": SIZE}),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": SIZE, "width": SIZE}),
        num_image_tokens=GRID,
        vision_feature_select_strategy="full",
    )


def tiny_config(vision_layers: int = 3, feature_layer=-1) -> LlavaOnevisionConfig:
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=vision_layers,
                                num_attention_heads=4, image_size=SIZE, patch_size=PATCH, vision_use_head=False)
    text = Qwen2Config(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(WORDS))
    return LlavaOnevisionConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMAGE, video_token_index=VIDEO,
        vision_feature_layer=feature_layer, vision_feature_select_strategy="full",
    )


def build(cls=LlavaOnevisionForConditionalGeneration, attn="sdpa", seed=0, **config):
    torch.manual_seed(seed)
    model = cls(tiny_config(**config)).eval()
    model.set_attn_implementation(attn)
    return model


def video(frames: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)


def prompt_inputs(processor, videos):
    return processor(text=[PROMPT] * len(videos), videos=videos, return_tensors="pt")


def video_tokens(inputs) -> int:
    return int((inputs["input_ids"] == VIDEO).sum())


# ----------------------------------------------------------------------------------------------------------------------
# Exact when idle, exact after remove
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_zero_reduction_matches_the_stock_model(attn):
    model, processor = build(attn=attn), tiny_processor()
    inputs = prompt_inputs(processor, [video()])
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        apply_testa(model, processor=processor, temporal_reduction=0, spatial_reduction=0)
        patched_inputs = prompt_inputs(processor, [video()])
        patched_logits = model(**patched_inputs).logits
        patched_tokens = model.generate(**patched_inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(patched_inputs["input_ids"], inputs["input_ids"])
    assert (patched_logits - logits).abs().max() <= 1e-5
    assert torch.equal(patched_tokens, tokens)


def test_zero_reduction_matches_for_the_base_model_and_the_tower_outputs():
    model = build(cls=LlavaOnevisionModel)
    pixels = prompt_inputs(tiny_processor(), [video()])["pixel_values_videos"]
    with torch.no_grad():
        stock = model.get_video_features(pixels, return_dict=True)
        apply_testa(model)
        patched = model.get_video_features(pixels, return_dict=True)
        as_tuple = model.get_video_features(pixels, return_dict=False)
        model.config.return_dict = False  # as stock (`can_return_tuple`): the config decides when the call does not
        config_tuple = model.get_video_features(pixels)
        model.config.return_dict = True
    assert (patched.pooler_output - stock.pooler_output).abs().max() <= 1e-5
    assert (patched.last_hidden_state - stock.last_hidden_state).abs().max() <= 1e-5
    assert torch.equal(as_tuple[1], patched.pooler_output)
    assert isinstance(config_tuple, tuple) and torch.equal(config_tuple[1], patched.pooler_output)


def test_remove_restores_the_instances_exactly():
    model, processor = build(), tiny_processor()
    inputs = prompt_inputs(processor, [video()])
    with torch.no_grad():
        stock = model(**inputs).logits
    class_method = type(model.model).get_video_features
    custom = processor.replace_video_token  # an instance attribute the user set before patching stays theirs
    processor.replace_video_token = custom
    apply_testa(model, processor=processor, temporal_reduction=1, spatial_reduction=2)
    assert video_tokens(prompt_inputs(processor, [video()])) < video_tokens(inputs)
    remove_testa(model)
    assert "get_video_features" not in model.model.__dict__
    assert model.model.get_video_features.__func__ is class_method
    assert processor.__dict__["replace_video_token"] is custom
    assert "_get_num_multimodal_tokens" not in processor.__dict__
    assert patch_of(model) is None
    restored = prompt_inputs(processor, [video()])
    assert torch.equal(restored["input_ids"], inputs["input_ids"])
    with torch.no_grad():
        assert torch.equal(model(**restored).logits, stock)


def test_applying_again_replaces_the_settings_and_other_instances_stay_stock():
    model, other, processor = build(), build(), tiny_processor()
    class_attributes = (vars(LlavaOnevisionModel)["get_video_features"],
                        vars(LlavaOnevisionProcessor)["replace_video_token"])
    apply_testa(model, processor=processor, temporal_reduction=1)
    assert (vars(LlavaOnevisionModel)["get_video_features"],
            vars(LlavaOnevisionProcessor)["replace_video_token"]) == class_attributes
    apply_testa(model, processor=processor, temporal_reduction=[2, 1, 1])
    assert patch_of(model).settings.temporal_reduction == (2, 1, 1)
    assert "get_video_features" not in other.model.__dict__
    remove_testa(model)
    assert "get_video_features" not in model.model.__dict__ and "replace_video_token" not in processor.__dict__


# ----------------------------------------------------------------------------------------------------------------------
# With reduction: the token count, generate, the tower's work
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_reduced_video_token_count_is_the_predicted_one_and_generate_runs(attn):
    model, processor = build(attn=attn), tiny_processor()
    # 8 frames, R_T = [2, 1, 1]: 8 -> 6 -> 5 -> 4 frames (caps (T - 1) // 2 = 3, 2, 2); 4 frames * 9 + 1 newline
    apply_testa(model, processor=processor, temporal_reduction=[2, 1, 1], spatial_reduction=[4, 3, 0])
    inputs = prompt_inputs(processor, [video(8)])
    assert video_tokens(inputs) == 4 * POOLED + 1 == 37
    counts = processor._get_num_multimodal_tokens(video_sizes=[(8, SIZE, SIZE), (3, SIZE, SIZE)])
    assert counts.num_video_tokens == [37, 2 * POOLED + 1]  # 3 frames: one merge, 2 frames kept
    with torch.no_grad():
        features = model.get_video_features(inputs["pixel_values_videos"], return_dict=True).pooler_output
        generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert features.shape == (1, 37, model.config.text_config.hidden_size)
    assert generated.shape == (1, inputs["input_ids"].shape[1] + 5)


def test_the_tower_runs_fewer_frames_and_tokens():
    """Merges happen inside the tower: later blocks see fewer rows (frames) and fewer tokens per row."""
    model, processor = build(), tiny_processor()
    apply_testa(model, processor=processor, temporal_reduction=[2, 1, 0], spatial_reduction=[5, 0, 0])
    seen = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape[:2])))
             for layer in model.model.vision_tower.encoder.layers]
    with torch.no_grad():
        model(**prompt_inputs(processor, [video(8)]))
    for hook in hooks:
        hook.remove()
    assert seen == [(6, GRID - 5), (5, GRID - 5), (5, GRID - 5)]


def test_spatial_merges_are_undone_before_pooling():
    """R_S only: the tower merges tokens within frames, the LLM still gets every frame's pooled grid."""
    model, processor = build(), tiny_processor()
    stock_count = video_tokens(prompt_inputs(processor, [video(4)]))
    apply_testa(model, processor=processor, spatial_reduction=[6, 4, 2], aggregation_dims="spatial")
    inputs = prompt_inputs(processor, [video(4)])
    assert video_tokens(inputs) == stock_count == 4 * POOLED + 1
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3


def two_colour_frames(frames: int = 3) -> torch.Tensor:
    """Frames whose left 2 patch columns are one colour and right 3 another (colours differ between frames)."""
    generator = torch.Generator().manual_seed(7)
    video = torch.empty(frames, 3, SIZE, SIZE, dtype=torch.uint8)
    for t in range(frames):
        left, right = torch.randint(0, 256, (2, 3), generator=generator, dtype=torch.uint8)
        video[t, :, :, : 2 * PATCH] = left.view(3, 1, 1)
        video[t, :, :, 2 * PATCH:] = right.view(3, 1, 1)
    return video


@pytest.mark.parametrize("proportional", [True, False])
def test_merged_duplicate_patches_are_exact_with_proportional_attention(proportional):
    """Hand-worked exact case: without position embeddings, the patches of one colour are identical tokens, so merging
    them and weighting each merged token by its size (proportional attention) computes what the stock tower computes;
    without the size weighting the colours' shares of attention change and the features differ."""
    model, processor = build(), tiny_processor()
    torch.nn.init.zeros_(model.model.vision_tower.embeddings.position_embedding.weight)
    pixels = prompt_inputs(processor, [two_colour_frames()])["pixel_values_videos"]
    with torch.no_grad():
        stock = model.get_video_features(pixels, return_dict=True).pooler_output
        apply_testa(model, processor=processor, spatial_reduction=[6, 4, 0], aggregation_dims="spatial",
                                    proportional_attention=proportional)
        patched = model.get_video_features(pixels, return_dict=True).pooler_output
    difference = (patched - stock).abs().max()
    assert difference <= 1e-5 if proportional else difference > 1e-4  # measured: 1e-8 and 2e-3


@pytest.mark.parametrize("options", [dict(aggregation_strategy="importance"), dict(frame_matching="vote"),
                                     dict(proportional_attention=False)])
def test_other_matching_settings_run_with_the_predicted_count(options):
    model, processor = build(), tiny_processor()
    apply_testa(model, processor=processor, temporal_reduction=1, spatial_reduction=3, **options)
    inputs = prompt_inputs(processor, [video(6)])
    assert video_tokens(inputs) == 3 * POOLED + 1  # 6 -> 5 -> 4 -> 3 (caps 2, 2, 1)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)


def test_a_batch_of_videos_equals_each_video_alone():
    model, processor = build(), tiny_processor()
    apply_testa(model, processor=processor, temporal_reduction=[2, 1, 1], spatial_reduction=[4, 3, 0])
    clips = [video(8, seed=1), video(8, seed=2)]
    batch = prompt_inputs(processor, clips)
    with torch.no_grad():
        batched = model(**batch).logits
        alone = torch.cat([model(**prompt_inputs(processor, [clip])).logits for clip in clips])
        batched_tokens = model.generate(**batch, max_new_tokens=4, do_sample=False)
        alone_tokens = torch.cat([model.generate(**prompt_inputs(processor, [clip]), max_new_tokens=4,
                                                 do_sample=False) for clip in clips])
    assert (batched - alone).abs().max() <= 1e-5
    assert torch.equal(batched_tokens, alone_tokens)


def test_bfloat16_runs_with_the_predicted_count():
    model, processor = build().to(torch.bfloat16), tiny_processor()
    apply_testa(model, processor=processor, temporal_reduction=[2, 1, 1], spatial_reduction=[4, 3, 0])
    inputs = prompt_inputs(processor, [video(8)])
    with torch.no_grad():
        features = model.get_video_features(inputs["pixel_values_videos"].to(torch.bfloat16), return_dict=True)
        model.generate(**inputs.to(torch.bfloat16), max_new_tokens=2, do_sample=False)
    assert features.pooler_output.dtype == torch.bfloat16 and features.pooler_output.shape[1] == 37
    assert torch.isfinite(features.pooler_output).all()


def test_frames_stay_in_temporal_order():
    """Four frames, the first two identical: they merge, and the merged frame comes first, then frames 2 and 3."""
    model, processor = build(), tiny_processor()
    frames = video(4, seed=3)
    frames[1] = frames[0]
    apply_testa(model, processor=processor, temporal_reduction=[1, 0, 0])
    inputs = prompt_inputs(processor, [frames])
    pixels = inputs["pixel_values_videos"]
    with torch.no_grad():
        merged = model.get_video_features(pixels, return_dict=True).pooler_output
        remove_testa(model)
        stock = model.get_video_features(pixels, return_dict=True).pooler_output
    per_frame = stock[0, :-1].view(4, POOLED, -1)
    expected = torch.cat([per_frame[0], per_frame[2], per_frame[3], stock[0, -1:]])  # frame 0 == frame 1
    assert (merged[0] - expected).abs().max() <= 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# One merge step against a float64 hand computation
# ----------------------------------------------------------------------------------------------------------------------


def cosine_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity in whole steps of the default score grid (2^-10)."""
    return round(float(a @ b / (a.norm() * b.norm())) * 1024)


def bipartite_by_hand(metric: list[torch.Tensor], r: int) -> list[tuple[int, int]]:
    """ToMe's bipartite matching written out: A = even, B = odd positions; every A token's best B partner (first on
    ties); the r best A tokens merge (stable: lower index first on ties). Returns (source, target) input positions."""
    a_positions, b_positions = list(range(0, len(metric), 2)), list(range(1, len(metric), 2))
    best = []
    for a in a_positions:
        scores = [cosine_steps(metric[a], metric[b]) for b in b_positions]
        j = max(range(len(b_positions)), key=lambda j: (scores[j], -j))
        best.append((scores[j], a, b_positions[j]))
    ranked = sorted(range(len(best)), key=lambda i: -best[i][0])
    return [(best[i][1], best[i][2]) for i in ranked[:r]]


def merged_by_hand(tokens: list[torch.Tensor], sizes: list[float], pairs: list[tuple[int, int]]):
    """Size-weighted averages of every target and its sources; the sources leave. Returns tokens, sizes and, for
    every input position, its output position (targets keep their place in input order)."""
    groups = {t: [t] for t in range(len(tokens))}
    for source, target in pairs:
        groups[target].append(source)
        del groups[source]
    kept = sorted(groups)
    out_tokens = [sum(tokens[i] * sizes[i] for i in groups[t]) / sum(sizes[i] for i in groups[t]) for t in kept]
    out_sizes = [sum(sizes[i] for i in groups[t]) for t in kept]
    slot = {i: kept.index(t) for t in kept for i in groups[t]}
    return out_tokens, out_sizes, slot


def test_one_merge_step_matches_a_float64_hand_computation():
    """A one-block tower, 4 frames of 25 patches, R_T = 1 and R_S = 3 in the block, proportional attention (no effect
    before anything is merged), the LLM's input features checked end to end: attention per frame, the frame merge on
    mean keys, the patch merge on the merged keys, the MLP, the unmerge to the grid, the stock projector and pooler."""
    model = build(cls=LlavaOnevisionModel, vision_layers=1).to(torch.float64)
    apply_testa(model, temporal_reduction=1, spatial_reduction=3)
    tower = model.vision_tower
    layer = tower.encoder.layers[0]
    attention = layer.self_attn
    pixels = torch.randn(1, 4, 3, SIZE, SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.get_video_features(pixels, return_dict=True).pooler_output

        x = tower.embeddings(pixels[0])  # (4 frames, 25, 32)
        heads, head_dim = attention.num_heads, attention.head_dim
        frames_out, keys_out = [], []
        for frame in x:  # attention within the frame, written out per head
            h = torch.nn.functional.layer_norm(frame, (32,), layer.layer_norm1.weight, layer.layer_norm1.bias,
                                               layer.layer_norm1.eps)
            q, k, v = (proj(h).view(GRID, heads, head_dim) for proj in
                       (attention.q_proj, attention.k_proj, attention.v_proj))
            context = torch.stack([
                torch.softmax(q[:, i] @ k[:, i].T * head_dim**-0.5, dim=-1) @ v[:, i] for i in range(heads)
            ], dim=1)
            frames_out.append(frame + attention.out_proj(context.reshape(GRID, 32)))
            keys_out.append(k.mean(dim=1))
        # frame merge: one pair ((4 - 1) // 2 = 1), frame tokens = mean keys
        frame_pairs = bipartite_by_hand([k.mean(dim=0) for k in keys_out], 1)
        frames_out, frame_sizes, frame_slot = merged_by_hand(frames_out, [1.0] * 4, frame_pairs)
        keys_out = merged_by_hand(keys_out, [1.0] * 4, frame_pairs)[0]
        grids = []
        for frame, keys, size in zip(frames_out, keys_out, frame_sizes):  # 3 patch merges within every frame
            pairs = bipartite_by_hand(list(keys), 3)
            tokens, _, slot = merged_by_hand(list(frame), [size] * GRID, pairs)
            tokens = torch.stack(tokens)
            tokens = tokens + layer.mlp(layer.layer_norm2(tokens))
            grids.append(torch.stack([tokens[slot[p]] for p in range(GRID)]))  # back on the 5x5 grid
        expected = model.apply_pooling(model.multi_modal_projector(torch.stack(grids))).reshape(1, 3 * POOLED, -1)
        expected = torch.cat([expected, model.image_newline.view(1, 1, -1)], dim=1)
    # frame 0 merges into frame 3: the output frames are 1, 2, {0, 3}, in time order (TESTA's [A, B] order: 2, 1, ...)
    assert frame_pairs == [(0, 3)] and frame_slot == {0: 2, 1: 0, 2: 1, 3: 2}
    assert features.shape == expected.shape == (1, 3 * POOLED + 1, 32)
    assert (features - expected).abs().max() <= 1e-10


def test_unmerge_averages_the_frames_merged_together():
    """Hand case: 2 input frames of 3 patches merged into one frame of 2 tokens; frame 0 put its patches 0 and 1 in
    token 0, frame 1 its patches 1 and 2 in token 1."""
    tokens = torch.tensor([[[[1.0], [3.0]]]])  # (B=1, T=1, L=2, D=1)
    source_map = torch.tensor([[[0, 0, 1], [0, 1, 1]]])
    grid = unmerge_to_grid(tokens, source_map)
    assert grid.tolist() == [[[[1.0], [2.0], [3.0]]]]
    assert unmerge_to_grid(tokens, None) is tokens


# ----------------------------------------------------------------------------------------------------------------------
# Chunks of frames through the tower
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reductions", [dict(), dict(temporal_reduction=[2, 1, 1], spatial_reduction=[4, 3, 0])])
def test_chunked_tower_gives_the_one_pass_outputs(reductions):
    """Two 8-frame videos through the tower 3 frames at a time: chunks cross the videos' edge and frame merges pair
    frames of different chunks; the outputs are the one-pass outputs (and, at zero reduction, the stock ones)."""
    model, processor = build(), tiny_processor()
    inputs = prompt_inputs(processor, [video(8, seed=5), video(8, seed=6)])
    with torch.no_grad():
        stock = model(**inputs).logits
        apply_testa(model, processor=processor, **reductions)
        inputs = prompt_inputs(processor, [video(8, seed=5), video(8, seed=6)])
        one_pass = model(**inputs)
        apply_testa(model, processor=processor, **reductions, chunk_frames=3)
        chunked = model(**inputs)
    assert (chunked.logits - one_pass.logits).abs().max() <= 1e-5
    assert (chunked.video_outputs.pooler_output - one_pass.video_outputs.pooler_output).abs().max() <= 1e-5
    if not reductions:
        assert (chunked.logits - stock).abs().max() <= 1e-5


def test_chunks_bound_the_frames_each_block_computes_at_once():
    model, processor = build(), tiny_processor()
    apply_testa(model, processor=processor, temporal_reduction=[2, 1, 1], chunk_frames=3)
    seen = []
    tower = model.model.vision_tower
    modules = [tower.embeddings.patch_embedding] + [m for layer in tower.encoder.layers
                                                     for m in (layer.self_attn.q_proj, layer.mlp.fc1)]
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0])) for m in modules]
    with torch.no_grad():
        model(**prompt_inputs(processor, [video(8)]))
    for hook in hooks:
        hook.remove()
    assert max(seen) == 3
    # 8 frames in chunks 3, 3, 2: the embedding, then per block attention and MLP (8 -> 6 -> 5 -> 4 frames)
    assert seen == [3, 3, 2] + [3, 3, 2, 3, 3] + [3, 3, 3, 2] + [3, 2, 3, 1]


def test_chunked_tower_gives_the_one_pass_gradients():
    model = build(cls=LlavaOnevisionModel).train()
    pixels = prompt_inputs(tiny_processor(), [video(6)])["pixel_values_videos"]
    gradients = []
    for chunk in (None, 4):
        apply_testa(model, temporal_reduction=1, spatial_reduction=2, chunk_frames=chunk)
        model.zero_grad()
        model.get_video_features(pixels, return_dict=True).pooler_output.square().sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.vision_tower.parameters() if p.grad is not None]))
    assert gradients[0].abs().max() > 0
    assert (gradients[1] - gradients[0]).abs().max() <= 1e-5 * gradients[0].abs().max()


def test_activation_checkpointing_gives_the_same_gradients():
    model = build(cls=LlavaOnevisionModel).train()
    pixels = prompt_inputs(tiny_processor(), [video(6)])["pixel_values_videos"]
    apply_testa(model, temporal_reduction=1, spatial_reduction=2)
    gradients = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert model.vision_tower.encoder.layers[0].gradient_checkpointing is checkpointing
        model.zero_grad()
        model.get_video_features(pixels, return_dict=True).pooler_output.square().sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.vision_tower.parameters() if p.grad is not None]))
    assert (gradients[1] - gradients[0]).abs().max() <= 1e-6 * gradients[0].abs().max()


@pytest.mark.parametrize("chunk", [0, -2, 2.5, True])
def test_bad_chunk_sizes_raise_naming_chunk_frames(chunk):
    with pytest.raises(ValueError, match=f"chunk_frames .*got {chunk!r}"):
        apply_testa(build(), chunk_frames=chunk)


# ----------------------------------------------------------------------------------------------------------------------
# The adapter's contract and bad input
# ----------------------------------------------------------------------------------------------------------------------


def test_supports_the_two_classes_only():
    adapter = LlavaOnevisionAdapter()
    assert adapter.supports(build()) and adapter.supports(build(cls=LlavaOnevisionModel))
    assert not adapter.supports(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="LlavaOnevisionForConditionalGeneration.*Linear"):
        apply_testa_to_video_llm(torch.nn.Linear(2, 2), None)


def test_the_adapter_gets_the_settings_and_the_token_count_helper_agrees():
    model, processor = build(), tiny_processor()
    apply_testa(model, processor=processor, temporal_reduction=[3, 0, 1], spatial_reduction=[2, 2, 2])
    settings = patch_of(model).settings
    assert settings == AggregationSettings.for_layers(3, [3, 0, 1], [2, 2, 2], proportional_attention=True)
    # 16 frames: 16 -> 13 (R_T 3) -> 13 -> 12
    assert video_token_count(settings, 16, -1, GRID) == 12 * POOLED + 1
    assert video_tokens(prompt_inputs(processor, [video(16)])) == 12 * POOLED + 1
    remove_testa(model)


@pytest.mark.parametrize("settings, message", [
    (dict(spatial_reduction=2, aggregation_dims="joint"), "aggregation_dims='joint'.*within each frame"),
    (dict(temporal_reduction=1, reduction_mode="prune"), "reduction_mode='prune'"),
])
def test_settings_the_tower_cannot_run_raise_clear_errors(settings, message):
    model = build()
    with pytest.raises(ValueError, match=message):
        apply_testa(model, **settings)
    assert patch_of(model) is None


def test_each_adapter_declares_its_settings_and_one_check_applies_them():
    """Proportional attention: LLaVA-OneVision's default and allowed, refused by Qwen's tower naming the allowed value;
    trace_source refused by both; chunk_frames, an adapter option, refused for a model that is no video-LLM."""
    qwen, qwen_processor = tiny.qwen2_5_vl()
    with pytest.raises(ValueError, match="proportional_attention=True .*Allowed: False"):
        apply_testa(qwen, processor=qwen_processor, temporal_reduction=1, proportional_attention=True)
    assert patch_of(qwen) is None and "replace_video_token" not in qwen_processor.__dict__
    model = build()
    apply_testa(model, temporal_reduction=1)
    assert patch_of(model).settings.proportional_attention is True
    apply_testa(model, temporal_reduction=1, proportional_attention=False)
    assert patch_of(model).settings.proportional_attention is False
    remove_testa(model)
    for video_llm in (qwen, model):
        with pytest.raises(ValueError, match="trace_source=True .*Allowed: False"):
            apply_testa(video_llm, temporal_reduction=1, trace_source=True)
        assert patch_of(video_llm) is None
    with pytest.raises(TypeError, match="chunk_frames.*Linear is not a video-LLM"):
        apply_testa(torch.nn.Linear(2, 2), chunk_frames=2)


def test_wrong_block_count_and_layers_split_by_a_frame_merge_raise():
    with pytest.raises(ValueError, match="vision_feature_layer=\\[-2, -1\\].*frame merge"):
        apply_testa(build(feature_layer=[-2, -1]), temporal_reduction=[0, 0, 1])
    with pytest.raises(ValueError, match="temporal_reduction"):
        apply_testa(build(), temporal_reduction=[1, 1])


def test_selected_layers_before_the_merges_give_the_stock_features():
    """vision_feature_layer=[-3, -2] reads blocks 1 and 2; a frame merge in block 3 changes nothing the LLM sees."""
    model, processor = build(feature_layer=[-3, -2]), tiny_processor()
    inputs = prompt_inputs(processor, [video(4)])
    with torch.no_grad():
        stock = model(**inputs).logits
        apply_testa(model, processor=processor, temporal_reduction=[0, 0, 1])
        patched_inputs = prompt_inputs(processor, [video(4)])
        patched = model(**patched_inputs).logits
    assert torch.equal(patched_inputs["input_ids"], inputs["input_ids"])
    assert (patched - stock).abs().max() <= 1e-5


DOCS = Path(__file__).resolve().parents[1] / "docs" / "video_llms.md"

# (the schedule as the docs write it, frames to the LLM, video tokens, frames received by the blocks, tower GMAC)
DOCUMENTED_ROWS = [
    ("0 (stock)", 32, 6273, 832, "10,276 (1.00)"),
    ("`[0] * 10 + [1] * 16`", 16, 3137, 712, "8,680 (0.84)"),
    ("`[0, 0] + [2] * 8 + [0] * 16`", 16, 3137, 520, "6,313 (0.61)"),
    ("`[0] * 2 + [1] * 24`", 8, 1569, 556, "6,699 (0.65)"),
    ("`[0, 0] + [3] * 8 + [0] * 16`", 8, 1569, 364, "4,331 (0.42)"),
    ("`[0, 0] + [3] * 8 + [0] * 16`, R_S `[0, 0] + [40] * 8 + [0] * 16`", 8, 1569, 364, "3,229 (0.31)"),
]


def test_the_documented_frame_arithmetic():
    """The frame and token columns of the docs' table, worked out again here from the caps (no weights built)."""
    config = LlavaOnevisionConfig()
    blocks = config.vision_config.num_hidden_layers
    grid = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    assert (blocks, grid, config.vision_feature_layer) == (26, 729, -1)
    doc = DOCS.read_text()
    assert [row[0] for row in DOCUMENTED_ROWS] == list(DOCUMENTED_SCHEDULES)
    for (text, frames, tokens, received, gmac), (temporal, spatial) in zip(DOCUMENTED_ROWS,
                                                                          DOCUMENTED_SCHEDULES.values()):
        settings = AggregationSettings.for_layers(blocks, temporal, spatial)
        assert kept_frames(settings, 32, blocks) == frames
        assert video_token_count(settings, 32, -1, grid) == tokens == frames * 196 + 1
        assert sum(kept_frames(settings, 32, block) for block in range(blocks)) == received
        assert f"| {text} | {frames} | {tokens} | {received} | {gmac} |" in doc
    longer = AggregationSettings.for_layers(blocks, DOCUMENTED_SCHEDULES["`[0, 0] + [3] * 8 + [0] * 16`"][0], 0)
    assert (kept_frames(longer, 64, blocks), video_token_count(longer, 64, -1, grid)) == (40, 7841)
    assert "64 frames with the last row: 40 frames, 7841 tokens" in doc


def test_tower_gmac_counts_fewer_operations_for_fewer_frames_and_tokens():
    """On a tiny tower (fast): idle TESTA counts what the stock tower counts, and the counts fall with the merges."""
    vision = tiny_config().vision_config
    stock = tower_gmac(vision, 8)
    assert tower_gmac(vision, 8, AggregationSettings.for_layers(3, 0, 0)) == stock
    fewer_frames = tower_gmac(vision, 8, AggregationSettings.for_layers(3, [2, 1, 1], 0))
    fewer_tokens = tower_gmac(vision, 8, AggregationSettings.for_layers(3, [2, 1, 1], [4, 3, 0]))
    assert fewer_tokens < fewer_frames < stock


@pytest.mark.slow
def test_the_documented_tower_gmac():
    """The GMAC column of the docs' table, counted again (the real-size tower on the meta device)."""
    assert frames_table() in DOCS.read_text()
