"""apply_testa / remove_testa on transformers' own video encoders (tiny random models, CPU, fp32).

References are independent of the patch: the unpatched model itself, and hand-worked cases in which merging is exact
(identical frames, time slices or patches merged with proportional attention behave as the duplicates they replace).
"""

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    TimesformerConfig,
    TimesformerForVideoClassification,
    TimesformerModel,
    VideoMAEConfig,
    VideoMAEForVideoClassification,
    VideoMAEModel,
    VivitConfig,
    VivitForVideoClassification,
    VivitModel,
)

from modeling_testa import apply_testa, remove_testa
from modeling_testa.patching import (
    get_testa_settings,
    patched_aggregation_groups,
    patched_token_grid,
    visualize_patched_aggregation,
)
from modeling_testa.visualization import draw_aggregation


TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)
SIZE, PATCH, FRAMES, TUBELET = 32, 8, 8, 2  # 16 patches per frame, 4 tubelet time slices


def timesformer_config(**overrides):
    return TimesformerConfig(**{**TINY, "image_size": SIZE, "patch_size": PATCH, "num_frames": FRAMES, **overrides})


def videomae_config(**overrides):
    settings = {**TINY, "image_size": SIZE, "patch_size": PATCH, "num_frames": FRAMES, "tubelet_size": TUBELET}
    return VideoMAEConfig(**{**settings, **overrides})


def vivit_config(**overrides):
    settings = {**TINY, "image_size": SIZE, "tubelet_size": [TUBELET, PATCH, PATCH], "num_frames": FRAMES}
    return VivitConfig(**{**settings, **overrides})


def clip_config(**overrides):
    return CLIPVisionConfig(**{**TINY, "image_size": SIZE, "patch_size": PATCH, **overrides})


CASES = {
    "TimesformerModel": (TimesformerModel, timesformer_config),
    "TimesformerForVideoClassification": (TimesformerForVideoClassification, timesformer_config),
    "VideoMAEModel": (VideoMAEModel, videomae_config),
    "VideoMAEForVideoClassification": (VideoMAEForVideoClassification, videomae_config),
    "VivitModel": (VivitModel, vivit_config),
    "VivitForVideoClassification": (VivitForVideoClassification, vivit_config),
    "CLIPVisionModel": (CLIPVisionModel, clip_config),
}


def build(name, seed=0, **overrides):
    model_class, config_fn = CASES[name]
    config = config_fn(**overrides)
    if name.endswith("Classification"):
        config.num_labels = 5
    torch.manual_seed(seed)
    return model_class(config).eval()


def inputs_for(name, batch=2, frames=FRAMES, seed=1):
    generator = torch.Generator().manual_seed(seed)
    if name == "CLIPVisionModel":  # frames in the batch axis
        return torch.randn(batch * 3, 3, SIZE, SIZE, generator=generator)
    return torch.randn(batch, frames, 3, SIZE, SIZE, generator=generator)


def main_output(output):
    return output.logits if "logits" in output else output.last_hidden_state


def patch_tokens(name, output):
    """``last_hidden_state`` without the CLS token (VideoMAE has none)."""
    hidden = output.last_hidden_state
    return hidden if name.startswith("VideoMAE") else hidden[:, 1:]


# ----------------------------------------------------------------------------------------------------------------------
# Exactness at R = 0 and restoration
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_zero_reduction_matches_unpatched_model(name):
    model = build(name)
    pixel_values = inputs_for(name)
    with torch.no_grad():
        reference = model(pixel_values, output_hidden_states=True)
        apply_testa(model, temporal_reduction=0, spatial_reduction=0)
        patched = model(pixel_values, output_hidden_states=True)
    torch.testing.assert_close(main_output(patched), main_output(reference), rtol=0, atol=1e-5)
    assert len(patched.hidden_states) == len(reference.hidden_states)
    for ours, theirs in zip(patched.hidden_states, reference.hidden_states):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    if reference.get("pooler_output") is not None:
        torch.testing.assert_close(patched.pooler_output, reference.pooler_output, rtol=0, atol=1e-5)
    # nothing merged: every token stands for one input patch
    assert torch.equal(patched.token_sizes, torch.ones_like(patched.token_sizes))


@pytest.mark.parametrize("name", ["TimesformerForVideoClassification", "VideoMAEModel", "CLIPVisionModel"])
def test_zero_reduction_matches_with_tuple_outputs_and_labels(name):
    model = build(name)
    pixel_values = inputs_for(name)
    kwargs = {"labels": torch.tensor([1, 3])} if name.endswith("Classification") else {}
    with torch.no_grad():
        reference = model(pixel_values, return_dict=False, **kwargs)
        apply_testa(model)
        patched = model(pixel_values, return_dict=False, **kwargs)
    # the leading entries are the model's own (loss, logits / last_hidden_state); token_sizes is appended
    for ours, theirs in zip(patched, reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_remove_testa_restores_the_original_forward(name):
    model = build(name)
    modules = [model] + [module for module in model.children() if isinstance(module, torch.nn.Module)]
    pixel_values = inputs_for(name)
    with torch.no_grad():
        reference = main_output(model(pixel_values))
        apply_testa(model, temporal_reduction=0 if name == "CLIPVisionModel" else 1, spatial_reduction=2)
        assert "forward" in model.__dict__
        merged = main_output(model(pixel_values))
        assert get_testa_settings(model) is not None
        assert remove_testa(model) is model
        restored = main_output(model(pixel_values))
    assert all("forward" not in module.__dict__ for module in modules)
    assert type(model).forward is model.forward.__func__
    assert get_testa_settings(model) is None
    assert torch.equal(restored, reference)
    if name.endswith("Model"):  # with merging the encoder output is shorter
        assert merged.shape[1] < reference.shape[1]


def test_remove_testa_restores_an_existing_instance_forward():
    model = build("VivitForVideoClassification")
    original = model.forward
    wrapper_calls = []

    def user_forward(*args, **kwargs):  # e.g. another library's instance-level wrapper
        wrapper_calls.append(1)
        return original(*args, **kwargs)

    model.forward = user_forward
    apply_testa(model, temporal_reduction=1, spatial_reduction=1)
    apply_testa(model, temporal_reduction=0, spatial_reduction=3)  # re-applying replaces the settings
    assert get_testa_settings(model).spatial_reduction == (3, 3, 3)
    with torch.no_grad():
        model(inputs_for("VivitForVideoClassification"))
    assert wrapper_calls == [1]  # the patch wraps the user's forward
    remove_testa(model)
    assert model.__dict__["forward"] is user_forward
    assert "forward" not in model.vivit.__dict__


def test_patching_one_instance_leaves_other_instances_alone():
    class_forward = TimesformerModel.forward
    patched, plain = build("TimesformerModel"), build("TimesformerModel")
    pixel_values = inputs_for("TimesformerModel")
    apply_testa(patched, temporal_reduction=1, spatial_reduction=4)
    with torch.no_grad():
        assert patched(pixel_values).last_hidden_state.shape[1] < plain(pixel_values).last_hidden_state.shape[1]
    assert "forward" not in plain.__dict__ and TimesformerModel.forward is class_forward


# ----------------------------------------------------------------------------------------------------------------------
# Token schedule and hand-worked merges
# ----------------------------------------------------------------------------------------------------------------------


def test_timesformer_token_count_follows_the_schedule():
    # 8 frames x 16 patches, 3 blocks, R_T = 2, R_S = 5. Frames: cap (T - 1) // 2 -> 8-2=6, 6-2=4, 4-1=3.
    # Patches: cap L // 2 -> 16-5=11, 11-5=6, 6-3=3. Output: CLS + 3 frames x 3 patches.
    model = apply_testa(build("TimesformerModel"), temporal_reduction=2, spatial_reduction=5)
    assert patched_token_grid(model, 8, 16) == [(6, 11), (4, 6), (3, 3)]
    with torch.no_grad():
        output = model(inputs_for("TimesformerModel"))
    assert output.last_hidden_state.shape == (2, 1 + 3 * 3, 32)
    assert output.token_sizes.sum(dim=1).tolist() == [1 + 8 * 16] * 2


@pytest.mark.parametrize(
    "name, settings, tokens",
    [
        # 4 tubelet slices x 16: slices 4 -> 3 -> 2 -> 2 (cap (T-1)//2), patches 16 -> 13 -> 10 -> 7
        ("VideoMAEModel", dict(temporal_reduction=1, spatial_reduction=3), 2 * 7),
        ("VivitModel", dict(temporal_reduction=1, spatial_reduction=3), 1 + 2 * 7),
        # ToMe: 64 space-time tokens, 10 per block -> 34 (+ CLS for ViViT)
        ("VideoMAEModel", dict(spatial_reduction=10, aggregation_dims="joint"), 34),
        ("VivitModel", dict(spatial_reduction=10, aggregation_dims="joint"), 1 + 34),
        ("VivitModel", dict(spatial_reduction=[40, 40, 40], aggregation_dims="joint"), 1 + 8),  # capped: 64 -> 32 -> 16 -> 8
        # CLIP per frame: 16 -> 13 -> 10 -> 7 patches, CLS kept
        ("CLIPVisionModel", dict(spatial_reduction=3), 1 + 7),
    ],
)
def test_joint_attention_token_count_follows_the_schedule(name, settings, tokens):
    model = apply_testa(build(name), **settings)
    with torch.no_grad():
        output = model(inputs_for(name))
    assert output.last_hidden_state.shape[1] == tokens
    has_cls = not name.startswith("VideoMAE")
    inputs = 16 if name == "CLIPVisionModel" else 64
    assert torch.all(output.token_sizes.sum(dim=1) == inputs + has_cls)


def test_timesformer_two_identical_frames_merge_first():
    """Hand-worked: frames 2 and 3 are identical (zero time embedding), so their keys coincide and the only frame merge
    of a one-block model (R_T = 1; A = frames {0, 2}, B = {1, 3}) must be 2 -> 3. Output frames: [0, 1, 3 (+2)].
    Spatial attention per frame and the MLP act on each token on its own given the input CLS, so every patch token
    equals the unpatched model's token of the same frame (only the frame-averaged CLS differs)."""
    model = build("TimesformerModel", num_hidden_layers=1, num_frames=4)
    with torch.no_grad():
        model.embeddings.time_embeddings.zero_()
    pixel_values = inputs_for("TimesformerModel", frames=4)
    pixel_values[:, 3] = pixel_values[:, 2]
    with torch.no_grad():
        reference = model(pixel_values).last_hidden_state[:, 1:].view(2, 16, 4, 32)  # TimeSformer order (patch, frame)
        apply_testa(model, temporal_reduction=1, spatial_reduction=0, trace_source=True)
        output = model(pixel_values)
    patched = output.last_hidden_state[:, 1:].view(2, 16, 3, 32)
    torch.testing.assert_close(patched, reference[:, :, :3], rtol=0, atol=1e-5)
    positions = torch.arange(16) * 3  # output position of (patch l, frame t) is l * 3 + t
    expected = torch.stack([positions, positions + 1, positions + 2, positions + 2])
    assert torch.equal(output.source_map, expected.expand(2, -1, -1))
    expected_sizes = torch.tensor([1.0] + [1.0, 1.0, 2.0] * 16)
    assert torch.equal(output.token_sizes, expected_sizes.expand(2, -1))


@pytest.mark.parametrize("name", ["VideoMAEForVideoClassification", "VivitForVideoClassification"])
def test_identical_tubelet_slices_merge_exactly_with_proportional_attention(name):
    """Hand-worked: with zero position embeddings, time slices 1 and 2 (frames 2-3 and 4-5) are identical, so they
    stay identical through the unpatched model. TESTA (A = slices {0, 2}, B = {1}) merges 2 into 1 in the first block;
    with proportional attention the merged token of size 2 attends and is attended exactly like the two duplicates, and
    the size-weighted mean pool (VideoMAE) / CLS (ViViT) gives the unpatched logits."""
    model = build(name, num_frames=6)
    base = model.videomae if name.startswith("VideoMAE") else model.vivit
    with torch.no_grad():
        if name.startswith("VideoMAE"):
            base.embeddings.position_embeddings = torch.zeros_like(base.embeddings.position_embeddings)
        else:
            base.embeddings.position_embeddings.zero_()
    pixel_values = inputs_for(name, frames=6)
    pixel_values[:, 4:6] = pixel_values[:, 2:4]
    with torch.no_grad():
        reference = model(pixel_values).logits
        apply_testa(model, temporal_reduction=[1, 0, 0], spatial_reduction=0, trace_source=True)
        output = model(pixel_values)
    assert output.token_sizes.shape[1] == (name.startswith("Vivit")) + 2 * 16  # two slices left
    torch.testing.assert_close(output.logits, reference, rtol=0, atol=1e-5)
    # slice 1 stays in output slice 1 (B after the unmerged A slice 0), slice 2 joins it
    assert torch.equal(output.source_map[:, 2], output.source_map[:, 1])
    assert torch.equal(output.source_map[:, 1], torch.arange(16, 32).expand(2, -1))
    # without proportional attention the merged slice is under-weighted: not exact any more
    apply_testa(model, temporal_reduction=[1, 0, 0], proportional_attention=False)
    with torch.no_grad():
        assert not torch.allclose(model(pixel_values).logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["VideoMAEForVideoClassification", "CLIPVisionModel"])
def test_identical_patches_merge_exactly_with_proportional_attention(name):
    """Hand-worked, spatial: with zero position embeddings, patches 0 and 1 of every frame (or slice) show the same
    pixels, so they are identical tokens; R_S = 1 in the first block merges exactly that pair (0 is in A, 1 in B,
    score 1) and the result equals the unpatched model."""
    model = build(name)
    with torch.no_grad():
        if name.startswith("VideoMAE"):
            embeddings = model.videomae.embeddings
            embeddings.position_embeddings = torch.zeros_like(embeddings.position_embeddings)
        else:
            model.embeddings.position_embedding.weight.zero_()
    pixel_values = inputs_for(name)
    pixel_values[..., :PATCH, PATCH : 2 * PATCH] = pixel_values[..., :PATCH, :PATCH]
    with torch.no_grad():
        reference = model(pixel_values)
        apply_testa(model, temporal_reduction=0, spatial_reduction=[1, 0, 0], trace_source=True)
        output = model(pixel_values)
    if name.startswith("VideoMAE"):
        torch.testing.assert_close(output.logits, reference.logits, rtol=0, atol=1e-5)
        source = output.source_map  # (batch, 4 slices, 16)
    else:
        torch.testing.assert_close(output.pooler_output, reference.pooler_output, rtol=0, atol=1e-5)
        source = output.source_map  # (frames, 1, 16)
    assert torch.equal(source[..., 0], source[..., 1])
    assert (output.token_sizes == 2).sum().item() == source.shape[0] * source.shape[1]  # one pair per frame / slice


# ----------------------------------------------------------------------------------------------------------------------
# Source map, token sizes and visualisation
# ----------------------------------------------------------------------------------------------------------------------


SETTINGS = [
    dict(temporal_reduction=1, spatial_reduction=3),
    dict(temporal_reduction=1, spatial_reduction=3, aggregation_strategy="importance"),
    dict(temporal_reduction=1, spatial_reduction=3, reduction_mode="prune"),
    dict(temporal_reduction=2, spatial_reduction=2, frame_matching="vote"),
    dict(temporal_reduction=1, spatial_reduction=0, frame_matching="original", aggregation_dims="temporal"),
]


@pytest.mark.parametrize("name", ["TimesformerModel", "VideoMAEModel", "VivitModel", "CLIPVisionModel"])
@pytest.mark.parametrize("settings", range(len(SETTINGS) + 2))
def test_source_map_counts_match_token_sizes(name, settings):
    """Independent check of the bookkeeping: every output token's size is the number of input patches whose
    source_map points at it (pruned patches point nowhere)."""
    if settings >= len(SETTINGS):
        if name in ("TimesformerModel", "CLIPVisionModel"):
            pytest.skip("joint merging needs joint space-time attention")
        options = dict(spatial_reduction=9, aggregation_dims="joint")
        if settings > len(SETTINGS):
            options["reduction_mode"] = "prune"
    else:
        options = dict(SETTINGS[settings])
        if name == "CLIPVisionModel":
            if options.get("aggregation_dims") == "temporal":
                pytest.skip("CLIP has no temporal stage")
            options["temporal_reduction"] = 0
    model = apply_testa(build(name), trace_source=True, **options)
    with torch.no_grad():
        output = model(inputs_for(name))
    tokens = patch_tokens(name, output)
    sizes = output.token_sizes if name.startswith("VideoMAE") else output.token_sizes[:, 1:]
    source = output.source_map
    batch = source.shape[0]
    assert source.shape[1:] == ((1, 16) if name == "CLIPVisionModel" else (FRAMES if name.startswith("Times") else 4, 16))
    assert source.max() < tokens.shape[1]
    counts = torch.stack([torch.bincount(row[row >= 0], minlength=tokens.shape[1]) for row in source.view(batch, -1)])
    assert torch.equal(counts.to(sizes.dtype), sizes)
    if options.get("reduction_mode") == "prune":
        assert (source < 0).any()
    else:
        assert (source >= 0).all() and sizes.sum(dim=1).eq(source[0].numel()).all()


@pytest.mark.parametrize(
    "name, settings",
    [
        ("TimesformerForVideoClassification", dict(temporal_reduction=2, spatial_reduction=3)),
        ("VideoMAEModel", dict(temporal_reduction=1, spatial_reduction=3)),
        ("VivitModel", dict(spatial_reduction=12, aggregation_dims="joint")),
        ("CLIPVisionModel", dict(spatial_reduction=4)),
    ],
)
def test_aggregation_groups_follow_the_visualization_contract(name, settings):
    model = apply_testa(build(name), **settings)  # trace_source is switched on for the drawing only
    video = inputs_for(name, batch=1)
    groups = patched_aggregation_groups(model, video)
    frames = video.shape[0] if name == "CLIPVisionModel" else video.shape[1]
    slices = frames if name.startswith(("Times", "CLIP")) else frames // TUBELET
    assert groups.pixels.shape == (slices, 3, SIZE, SIZE)
    assert groups.source_map.shape == (slices, 16) and groups.patch_grid == (4, 4)
    assert groups.source_map.min() >= 0 and groups.source_map.max() < groups.num_tokens
    assert groups.frame_groups.shape == (slices,)
    with torch.no_grad():
        output = model(video)
    expected_tokens = output.token_sizes.shape[1] - (not name.startswith("VideoMAE"))  # CLS excluded
    if name == "CLIPVisionModel":
        expected_tokens *= frames
    assert groups.num_tokens == expected_tokens
    if settings.get("aggregation_dims") != "joint":
        # frames merge as a whole: all patches of an input frame lie in its output frame
        out_frame = groups.source_map // groups.grid[1]
        assert torch.equal(out_frame, groups.frame_groups[:, None].expand_as(out_frame))
    image = draw_aggregation(groups, patch_pixels=8)
    assert image.info["frame_groups"] == groups.frame_groups.tolist()
    assert visualize_patched_aggregation(model, video, patch_pixels=8).size == image.size
    assert get_testa_settings(model).trace_source is False


def test_visualization_groups_of_the_hand_worked_timesformer_case():
    model = build("TimesformerModel", num_hidden_layers=1, num_frames=4)
    with torch.no_grad():
        model.embeddings.time_embeddings.zero_()
    video = inputs_for("TimesformerModel", batch=1, frames=4)
    video[:, 3] = video[:, 2]
    apply_testa(model, temporal_reduction=1)
    groups = patched_aggregation_groups(model, video)
    assert groups.grid == (3, 16)
    assert groups.frame_groups.tolist() == [0, 1, 2, 2]
    assert torch.equal(groups.source_map[3], groups.source_map[2])


# ----------------------------------------------------------------------------------------------------------------------
# Heads, training and errors
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["TimesformerForVideoClassification", "VideoMAEForVideoClassification", "VivitForVideoClassification"]
)
def test_classifiers_train_through_the_merged_tokens(name):
    model = apply_testa(build(name), temporal_reduction=1, spatial_reduction=3)
    model.train()
    output = model(inputs_for(name), labels=torch.tensor([0, 4]))
    assert output.logits.shape == (2, 5) and torch.isfinite(output.loss)
    assert output.token_sizes is not None  # the encoder's sizes come through the head
    output.loss.backward()
    first_block = model.base_model.encoder.layer[0] if not name.startswith("Vivit") else model.vivit.layers[0]
    assert all(p.grad is not None for p in first_block.parameters() if p.requires_grad)


def test_videomae_head_pools_by_token_size():
    """The size-weighted mean of the merged tokens, through the model's own fc_norm and classifier."""
    model = apply_testa(build("VideoMAEForVideoClassification"), temporal_reduction=1, spatial_reduction=3)
    with torch.no_grad():
        output = model(inputs_for("VideoMAEForVideoClassification"), output_hidden_states=True)
        tokens = output.hidden_states[-1]  # VideoMAE with mean pooling has no final LayerNorm
        weights = output.token_sizes / output.token_sizes.sum(dim=1, keepdim=True)
        expected = model.classifier(model.fc_norm((tokens * weights[..., None]).sum(dim=1)))
        unweighted = model.classifier(model.fc_norm(tokens.mean(dim=1)))
    torch.testing.assert_close(output.logits, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(output.logits, unweighted, rtol=0, atol=1e-5)


def test_unsupported_model_names_the_class_and_the_supported_ones():
    from transformers import ViTConfig, ViTModel

    model = ViTModel(ViTConfig(**TINY, image_size=SIZE, patch_size=PATCH))
    with pytest.raises(TypeError, match=r"ViTModel.*TimesformerModel.*VideoMAEModel.*VivitModel.*CLIPVisionModel"):
        apply_testa(model, spatial_reduction=2)
    assert "forward" not in model.__dict__


def _without_video_llms(monkeypatch) -> None:
    """Makes ``import video_llms`` fail, as where only the Hub code (or another install) is there."""
    import sys

    for name in [n for n in sys.modules if n == "video_llms" or n.startswith("video_llms.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "video_llms", None)  # None in sys.modules: ImportError on import


def test_a_video_llm_without_the_video_llms_package_says_what_to_install(monkeypatch):
    """A Qwen2.5-VL given to apply_testa without the repository's `video_llms` package: one line naming the model and
    the install command (the pipelines' wording), not "does not support"; the model is left as it was."""
    from helpers import video_llms as tiny

    model, processor = tiny.qwen2_5_vl()
    _without_video_llms(monkeypatch)
    with pytest.raises(ImportError) as raised:
        apply_testa(model, temporal_reduction=1, processor=processor)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("apply_testa on a Qwen2_5_VLForConditionalGeneration (a video-LLM: "
                              "Qwen2_5_VLForConditionalGeneration) needs the TESTA library (`pip install testa-hf`)")
    assert "does not support" not in message
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert remove_testa(model) is model  # nothing to undo: no error


def test_without_the_video_llms_package_other_models_are_still_unsupported(monkeypatch):
    """Only video-LLM classes get the install line: another model keeps the "does not support" TypeError."""
    from transformers import ViTConfig, ViTModel

    _without_video_llms(monkeypatch)
    with pytest.raises(TypeError, match="apply_testa does not support ViTModel"):
        apply_testa(ViTModel(ViTConfig(**TINY, image_size=SIZE, patch_size=PATCH)), spatial_reduction=2)


def test_the_video_llm_class_names_are_the_adapters_own():
    """`patching.VIDEO_LLM_CLASSES` (how a video-LLM is recognised without `video_llms`) lists the classes the
    adapters support, no more, no less."""
    import video_llms
    from modeling_testa.patching import VIDEO_LLM_CLASSES

    assert sorted(VIDEO_LLM_CLASSES) == sorted(name for adapter in video_llms.ADAPTERS for name in adapter.classes)


@pytest.mark.parametrize(
    "name, settings, message",
    [
        ("TimesformerModel", dict(spatial_reduction=4, aggregation_dims="joint"), "joint space-time attention"),
        ("CLIPVisionModel", dict(temporal_reduction=1), "no temporal stage"),
        ("VivitModel", dict(temporal_reduction=1, aggregation_dims="joint"), "temporal_reduction must be 0"),
        ("VideoMAEModel", dict(spatial_reduction=[1, 2]), "list of exactly 3 ints"),
        ("VideoMAEModel", dict(spatial_reduction=-1), ">= 0"),
        ("VivitModel", dict(aggregation_strategy="random"), "aggregation_strategy"),
    ],
)
def test_invalid_settings_raise_clear_errors(name, settings, message):
    model = build(name)
    with pytest.raises(ValueError, match=message):
        apply_testa(model, **settings)
    assert get_testa_settings(model) is None and "forward" not in model.__dict__


def test_timesformer_other_attention_types_are_refused():
    with pytest.raises(ValueError, match="divided_space_time"):
        apply_testa(build("TimesformerModel", attention_type="joint_space_time"))


def test_requests_the_patch_cannot_serve_raise():
    model = apply_testa(build("VideoMAEModel"), spatial_reduction=2)
    pixel_values = inputs_for("VideoMAEModel")
    with pytest.raises(ValueError, match="attention weights"):
        model(pixel_values, output_attentions=True)
    with pytest.raises(ValueError, match="bool_masked_pos"):
        model(pixel_values, bool_masked_pos=torch.zeros(2, 64, dtype=torch.bool))
    clip = apply_testa(build("CLIPVisionModel"), spatial_reduction=2)
    with pytest.raises(ValueError, match=r"\(frames, channels, height, width\)"):
        clip(inputs_for("TimesformerModel"))


def test_timesformer_runs_other_frame_counts_when_patched():
    """The unpatched TimeSformer layers reshape with config.num_frames; the patched forward takes the frame count
    from the input (the time embedding is interpolated by transformers' embeddings)."""
    model = apply_testa(build("TimesformerModel"), temporal_reduction=1, spatial_reduction=2)
    with torch.no_grad():
        output = model(inputs_for("TimesformerModel", frames=12))
    # frames 12 -> 11 -> 10 -> 9, patches 16 -> 14 -> 12 -> 10
    assert output.last_hidden_state.shape[1] == 1 + 9 * 10


def test_activation_checkpointing_gives_the_same_gradients():
    pixel_values, labels = inputs_for("VideoMAEForVideoClassification"), torch.tensor([0, 4])
    gradients = []
    for checkpointing in (False, True):
        model = apply_testa(build("VideoMAEForVideoClassification"), temporal_reduction=1, spatial_reduction=3)
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        model(pixel_values, labels=labels).loss.backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.videomae.encoder.parameters()]))
    torch.testing.assert_close(gradients[1], gradients[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["TimesformerModel", "VivitModel"])
def test_attention_runs_through_sdpa(name, monkeypatch):
    """TimeSformer's own attention is eager-only; patched, both its temporal and spatial attention go through SDPA."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    model = apply_testa(build(name), spatial_reduction=1)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    with torch.no_grad():
        model(inputs_for(name))
    per_block = 2 if name == "TimesformerModel" else 1
    assert len(calls) == per_block * TINY["num_hidden_layers"]


def test_clip_towers_with_projection_are_patched_through_their_vision_model():
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionModelWithProjection

    frames = inputs_for("CLIPVisionModel")
    torch.manual_seed(0)
    tower = CLIPVisionModelWithProjection(clip_config(projection_dim=16)).eval()
    text = CLIPTextConfig(**TINY, vocab_size=50, max_position_embeddings=16)
    clip = CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=clip_config().to_dict(), projection_dim=16))
    clip.eval()
    with torch.no_grad():
        references = (tower(frames).image_embeds, clip.get_image_features(frames).pooler_output)
        apply_testa(tower)
        apply_testa(clip)
        outputs = (tower(frames).image_embeds, clip.get_image_features(frames).pooler_output)
        assert "forward" in tower.vision_model.__dict__ and "forward" not in tower.__dict__
        apply_testa(tower, spatial_reduction=3)
        merged = tower(frames)
    for ours, theirs in zip(outputs, references):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert merged.last_hidden_state.shape[1] == 1 + 7 and merged.image_embeds.shape == references[0].shape
    remove_testa(tower)
    remove_testa(clip)
    assert "forward" not in tower.vision_model.__dict__ and "forward" not in clip.vision_model.__dict__
