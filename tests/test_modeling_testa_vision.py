"""TestaVisionModel: aggregation behaviour on hand-worked videos, invariants, HF plumbing and the paper's schedule."""

import itertools

import pytest
import torch
from helpers.models import tiny_vision_config

from modeling_testa import TestaVisionConfig, TestaVisionModel, token_schedule
from modeling_testa.flops import count_encoder_gmac


ALL_SETTINGS = [
    dict(aggregation_strategy=s, reduction_mode=m, aggregation_dims=d, frame_matching=f)
    for s, m, d, f in itertools.product(
        ["geometry", "importance"], ["merge", "prune"], ["temporal+spatial", "temporal", "spatial", "joint"],
        ["mean", "vote", "original"],
    )
    if not (m == "prune" and s == "importance")
    and not (f == "original" and d in ("spatial", "joint"))  # frame rules only matter where frames merge  # pruning always ranks by importance: one prune setting is enough
]


def _model(**overrides) -> TestaVisionModel:
    return TestaVisionModel(tiny_vision_config(**overrides)).eval()


def _video(batch=2, frames=8, size=32) -> torch.Tensor:
    return torch.randn(batch, frames, 3, size, size)


@pytest.mark.parametrize("settings", ALL_SETTINGS, ids=lambda s: "-".join(s.values()))
def test_every_setting_runs_with_the_scheduled_token_count_and_consistent_sizes(settings):
    model = _model(trace_source=True, **settings)
    out = model(_video())
    frames, patches = token_schedule(model.config)[-1]
    assert out.last_hidden_state.shape == (2, 1 + frames * patches, 32)
    assert out.token_sizes.shape == (2, 1 + frames * patches)
    assert out.token_sizes[:, 0].eq(1).all()  # CLS is never merged
    source = out.source_map
    if settings["reduction_mode"] == "merge":
        # every input patch lands in exactly one output token, and sizes count them
        assert out.token_sizes.sum(dim=1).eq(1 + 8 * 16).all()
        counts = torch.stack([torch.bincount(s.flatten(), minlength=frames * patches) for s in source])
        torch.testing.assert_close(counts.float(), out.token_sizes[:, 1:])
    else:
        assert out.token_sizes.eq(1).all()
        kept = (source >= 0).sum(dim=(1, 2))
        assert kept.eq(frames * patches).all()


@pytest.mark.parametrize("settings", ALL_SETTINGS, ids=lambda s: "-".join(s.values()))
def test_batch_independence(settings):
    model = _model(**settings)
    video = _video(batch=3)
    together = model(video)
    for i in range(3):
        alone = model(video[i : i + 1])
        torch.testing.assert_close(together.last_hidden_state[i : i + 1], alone.last_hidden_state, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(together.token_sizes[i : i + 1], alone.token_sizes)


@pytest.mark.parametrize("strategy", ["geometry", "importance"])
@pytest.mark.parametrize("frame_matching", ["mean", "vote", "original"])
def test_two_identical_frames_merge_first(strategy, frame_matching):
    """Frames 2 (set A) and 3 (set B) are the same image; every other frame is noise. In block 1, before any
    temporal mixing (temporal_fc and the temporal embedding start at zero), their keys are identical, so they are
    the most similar pair and the only frame merge (R_T=1). The importance strategy selects set A by attention, so
    for it we check only that a frame merged and the pair ends up together when frame 2 is chosen."""
    model = _model(temporal_reduction=[1, 0], spatial_reduction=0, trace_source=True,
                   aggregation_strategy=strategy, frame_matching=frame_matching)
    video = _video(batch=1)
    video[:, 3] = video[:, 2]
    source = model(video).source_map[0]  # (8 frames, 16 patches) -> output token
    frames_out = source // 16
    assert (frames_out[2] == frames_out[3]).all() or strategy == "importance"
    merged_frames = [t for t in range(8) if (frames_out == frames_out[t]).all(dim=1).sum() > 1]
    assert len(merged_frames) == 2
    if strategy == "geometry":
        assert merged_frames == [2, 3]
    elif 2 in merged_frames or 3 in merged_frames:
        assert merged_frames == [2, 3]


def test_constant_colour_region_merges_its_patches():
    """With the position embedding zeroed, the patches of a flat-colour region are identical tokens, so block 1's
    R_S=4 merges inside that region (positions 0-7 of every frame are the flat top half)."""
    model = _model(temporal_reduction=0, spatial_reduction=[4, 0], trace_source=True)
    with torch.no_grad():
        model.embeddings.position_embedding.zero_()
    video = _video(batch=1)
    video[..., :16, :] = 0.7  # top half: 2 rows of 4 patches
    source = model(video).source_map[0]
    for frame in range(8):
        merged = [p for p in range(16) if (source[frame] == source[frame, p]).sum() > 1]
        assert merged and all(p < 8 for p in merged), (frame, source[frame].tolist())


def test_fresh_model_is_the_image_vit_on_a_single_frame():
    """temporal_fc and the temporal embedding start at zero, so without aggregation one frame gives plain ViT."""
    model = _model(temporal_reduction=0, spatial_reduction=0)
    video = _video(batch=2, frames=1)
    out = model(video).last_hidden_state
    emb = model.embeddings
    x = emb.patch_embedding(video[:, 0]).flatten(2).transpose(1, 2)
    x = torch.cat([emb.class_embedding.expand(2, -1, -1), x], dim=1) + emb.position_embedding
    for layer in model.layers:
        h = layer.layer_norm1(x)
        qkv = layer.self_attn.qkv(h).view(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(qkv[0] @ qkv[1].transpose(-1, -2) / 8**0.5, dim=-1) @ qkv[2]
        x = x + layer.self_attn.projection(attn.transpose(1, 2).reshape(2, 17, 32))
        x = x + layer.mlp(layer.layer_norm2(x))
    torch.testing.assert_close(out, model.post_layernorm(x), atol=1e-5, rtol=1e-5)
    assert all(layer.temporal_fc.weight.abs().sum() == 0 for layer in model.layers)


def test_sdpa_equals_eager_and_hidden_states():
    config = tiny_vision_config()
    sdpa = TestaVisionModel._from_config(config, attn_implementation="sdpa").eval()
    eager = TestaVisionModel._from_config(config, attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    video = _video()
    a, b = sdpa(video, output_hidden_states=True), eager(video, output_hidden_states=True)
    torch.testing.assert_close(a.last_hidden_state, b.last_hidden_state, atol=1e-5, rtol=1e-5)
    assert len(a.hidden_states) == config.num_hidden_layers + 1
    assert a.hidden_states[0].shape == (2, 1 + 8 * 16, 32) and a.hidden_states[-1].shape[1] == a.last_hidden_state.shape[1]


def test_proportional_attention_changes_outputs_only_after_a_merge():
    base = _model(proportional_attention=False)
    prop = _model(proportional_attention=True)
    prop.load_state_dict(base.state_dict())
    video = _video()
    assert not torch.allclose(base(video).last_hidden_state, prop(video).last_hidden_state)
    plain = _model(temporal_reduction=0, spatial_reduction=0)
    plain_prop = _model(temporal_reduction=0, spatial_reduction=0, proportional_attention=True)
    plain_prop.load_state_dict(plain.state_dict())
    torch.testing.assert_close(plain(video).last_hidden_state, plain_prop(video).last_hidden_state)


def test_save_load_round_trip(tmp_path):
    model = _model(aggregation_strategy="importance", frame_matching="vote")
    model.save_pretrained(tmp_path)
    loaded, info = TestaVisionModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values())
    assert loaded.config.aggregation_strategy == "importance" and loaded.config.frame_matching == "vote"
    video = _video()
    torch.testing.assert_close(model(video).last_hidden_state, loaded.eval()(video).last_hidden_state)


def test_gradients_flow_and_checkpointing_gives_the_same_gradients():
    model = _model(hidden_dropout_prob=0.0)
    model.train()
    video = _video()

    def grads():
        model.zero_grad()
        model(video).last_hidden_state.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    assert all(g is not None for g in plain.values())
    assert plain["layers.0.temporal_fc.weight"].abs().sum() > 0  # zero-initialised, but it learns
    model.gradient_checkpointing_enable()
    checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5)


def test_interpolates_to_other_frame_counts_and_image_sizes():
    model = _model()
    out = model(_video(batch=1, frames=5, size=48))
    frames, patches = token_schedule(model.config, num_frames=5, image_size=48)[-1]
    assert (frames, patches) == (3, 30)  # 5 -> 4 -> 3 frames, 36 -> 33 -> 30 patches
    assert out.last_hidden_state.shape == (1, 1 + frames * patches, 32)
    emb = model.embeddings
    assert emb.spatial_position_embedding(6, 6).shape == (1, 37, 32)
    with torch.no_grad():
        emb.temporal_embedding.copy_(torch.arange(8.0).view(1, 8, 1).expand(1, 8, 32))
    assert emb.temporal_position_embedding(16)[0, :, 0].tolist() == [t // 2 for t in range(16)]
    torch.testing.assert_close(emb.spatial_position_embedding(4, 4), emb.position_embedding)


@pytest.mark.parametrize(
    "bad,message",
    [
        (torch.randn(8, 3, 32, 32), r"\(batch, frames, 3, height, width\).*pixel_values\[None\]"),
        (torch.randn(1, 8, 1, 32, 32), r"\(batch, frames, 3, height, width\).*got \(1, 8, 1, 32, 32\)"),
        (torch.randn(1, 8, 3, 30, 32), r"multiples of 8"),
        (torch.randn(1, 0, 3, 32, 32), r"got \(1, 0, 3, 32, 32\)"),
    ],
)
def test_wrong_input_shapes_name_the_expected_shape(bad, message):
    with pytest.raises(ValueError, match=message):
        _model()(bad)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(aggregation_strategy="random"), "aggregation_strategy='random'.*'geometry', 'importance'"),
        (dict(reduction_mode="drop"), "reduction_mode"),
        (dict(aggregation_dims="time"), "aggregation_dims"),
        (dict(frame_matching="mode"), "frame_matching"),
        (dict(temporal_reduction=-1), "temporal_reduction.*>= 0"),
        (dict(spatial_reduction=[1, 2, 3]), "spatial_reduction.*3 entries.*num_hidden_layers=2"),
        (dict(hidden_size=30), "not a multiple of num_attention_heads"),
    ],
)
def test_bad_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_vision_config(**overrides)


def test_torch_compile_matches_eager():
    model = _model()
    video = _video()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(video).last_hidden_state, model(video).last_hidden_state)


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    model = _model()
    video = _video()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(video).last_hidden_state, model(video).last_hidden_state, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# The paper's settings: token schedule (shared/notes/token-schedule.md) and GMAC (fvcore convention)
# ---------------------------------------------------------------------------------------------------------------------

SCHEDULE_32 = [5705, 5161, 4641, 4145, 3673, 3225, 2801, 2401, 2025, 1673, 1345, 1041]
SCHEDULE_96 = [17297, 15841, 14449, 13121, 11857, 10657, 9521, 8449, 7441, 6497, 5617, 4801]


def test_token_schedule_matches_the_paper():
    config_32 = TestaVisionConfig(num_frames=32, temporal_reduction=1, spatial_reduction=12)
    config_96 = TestaVisionConfig(num_frames=96, temporal_reduction=4, spatial_reduction=8)
    assert [1 + t * l for t, l in token_schedule(config_32)] == SCHEDULE_32
    assert [1 + t * l for t, l in token_schedule(config_96)] == SCHEDULE_96
    assert token_schedule(config_32)[-1] == (20, 52) and token_schedule(config_96)[-1] == (48, 100)


@pytest.mark.parametrize(
    "frames,r_t,r_s,paper_gmac,tokens",
    [(32, 0, 0, 786.8, 6273), (32, 1, 12, 419.8, 1041), (96, 0, 0, 2382.5, 18817), (96, 4, 8, 1381.4, 4801)],
)
def test_vit_b_gmac_and_tokens_match_the_paper(frames, r_t, r_s, paper_gmac, tokens):
    config = TestaVisionConfig(num_frames=frames, temporal_reduction=r_t, spatial_reduction=r_s)
    gmac, out_tokens = count_encoder_gmac(config)
    assert out_tokens == tokens
    assert abs(gmac - paper_gmac) / paper_gmac < 0.01, gmac


def test_set_aggregation_switches_schedules_in_place():
    model = _model()
    video = _video()
    merged = model(video).last_hidden_state
    model.set_aggregation(temporal_reduction=0, spatial_reduction=0)
    assert model(video).last_hidden_state.shape[1] == 1 + 8 * 16
    assert model.config.temporal_reduction == 0
    fresh = TestaVisionModel(tiny_vision_config(temporal_reduction=0, spatial_reduction=0)).eval()
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(video).last_hidden_state, fresh(video).last_hidden_state)
    model.set_aggregation(temporal_reduction=1, spatial_reduction=3)
    torch.testing.assert_close(model(video).last_hidden_state, merged)
    with pytest.raises(ValueError, match="spatial_reduction"):
        model.set_aggregation(spatial_reduction=[1, 2, 3])
    assert model.config.spatial_reduction == 3  # unchanged after the error
    with pytest.raises(ValueError, match="allowed settings"):
        model.set_aggregation(hidden_size=8)


def test_output_does_not_depend_on_the_input_memory_layout():
    """A batched video-processor call can return channels-last strided pixels. Identical values must give identical
    tokens: flat regions make exact similarity ties, so last-bit differences from another convolution kernel would
    otherwise change which patches merge."""
    model = _model(temporal_reduction=1, spatial_reduction=3)
    video = torch.zeros(2, 8, 3, 32, 32)
    video[:, :, 0, 8:16, 8:24] = 1.0  # a flat red bar on black: many identical patches
    video[:, ::2, 1, 16:24, :] = torch.linspace(0, 1, 32)
    video = video + 0.3 * torch.randn(2, 8, 3, 1, 1)  # a different flat tint per frame
    channels_last = video.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
    assert torch.equal(channels_last, video) and channels_last.stride() != video.stride()
    layouts = []
    hook = model.embeddings.patch_embedding.register_forward_pre_hook(
        lambda module, args: layouts.append((args[0].stride(), args[0].is_contiguous()))
    )
    with torch.no_grad():
        expected = model(video).last_hidden_state
        got = model(channels_last).last_hidden_state
    hook.remove()
    # the convolution sees one layout whatever the caller's (the kernel choice depends on it) ...
    assert layouts[0] == layouts[1] and layouts[1][1]
    # ... so the tokens are identical
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------------- transformers conventions


def test_attention_outputs_per_block_with_merged_sizes_equal_a_float64_recomputation():
    """`output_attentions` returns, per block, the spatial attention (after the block's frame merge) and the temporal
    attention (before it), at the sizes the schedule gives; block 0 equals softmax(q k^T / sqrt(d)) recomputed by
    hand from the layer's weights (a fresh model: `temporal_fc` is zero, so the spatial input is the embedding)."""
    model = _model(temporal_reduction=2, spatial_reduction=3).double()
    video = _video().double()
    out = model(video, output_attentions=True)
    assert len(out.attentions) == len(out.temporal_attentions) == model.config.num_hidden_layers
    frames, patches = 8, 16
    for (frames_out, patches_out), spatial, temporal in zip(token_schedule(model.config), out.attentions,
                                                            out.temporal_attentions):
        frames_after_frame_merge = frames_out  # the patch merge comes after the spatial attention
        assert tuple(temporal.shape) == (2 * patches, 4, frames, frames)
        assert tuple(spatial.shape) == (2 * frames_after_frame_merge, 4, 1 + patches, 1 + patches)
        torch.testing.assert_close(spatial.sum(-1), torch.ones_like(spatial.sum(-1)))
        frames, patches = frames_out, patches_out

    layer, heads, head_dim = model.layers[0], 4, 8
    cls, embedded = model.embeddings(video)

    def attention(module, tokens):
        q, k, _ = module.qkv(tokens).view(tokens.shape[0], tokens.shape[1], 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        return torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5, dim=-1)

    temporal_in = layer.temporal_layer_norm(embedded.transpose(1, 2).reshape(2 * 16, 8, 32))
    torch.testing.assert_close(out.temporal_attentions[0], attention(layer.temporal_attention, temporal_in))
    # with R_T = 0 in block 0, its spatial attention covers every frame
    model.set_aggregation(temporal_reduction=[0, 2])
    out = model(video, output_attentions=True)
    spatial_in = torch.cat([cls.unsqueeze(1).expand(-1, 8, -1, -1), embedded], dim=2).reshape(2 * 8, 17, 32)
    torch.testing.assert_close(out.attentions[0], attention(layer.self_attn, layer.layer_norm1(spatial_in)))


def test_attention_outputs_in_joint_mode_and_off_by_default():
    model = _model(aggregation_dims="joint", temporal_reduction=0, spatial_reduction=20)
    out = model(_video(), output_attentions=True)
    assert out.temporal_attentions is None
    tokens = 8 * 16
    for attention in out.attentions:
        assert tuple(attention.shape) == (2, 4, 1 + tokens, 1 + tokens)
        tokens -= 20
    plain = model(_video())
    assert plain.attentions is None and plain.temporal_attentions is None


@pytest.mark.parametrize("use_reentrant", [None, True, False])
def test_gradient_checkpointing_gives_the_gradients_of_a_plain_backward(use_reentrant):
    """Both checkpointing modes carry gradients through the merged tokens (reentrant checkpointing only sees
    positional tensors, which is why a layer takes the token state's fields one by one)."""
    torch.manual_seed(0)
    config = tiny_vision_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    reference = TestaVisionModel(config).double().train()
    model = TestaVisionModel(config).double().train()
    model.load_state_dict(reference.state_dict())
    if use_reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    pixels = torch.randn(2, 8, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for m in (reference, model):
        m(pixels.clone().requires_grad_(True)).last_hidden_state.pow(2).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_returned_hidden_states_are_the_tensors_later_blocks_read():
    """As in transformers' models, a returned hidden state gets the gradient of the output (here: of the last
    hidden state's sum w.r.t. the embeddings, checked against autograd on a second, unmodified pass), and asking for
    hidden states changes no output."""
    model = TestaVisionModel(tiny_vision_config()).double().eval()
    pixels = torch.randn(2, 8, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = model(pixels, output_hidden_states=True)
    assert torch.equal(out.last_hidden_state, model(pixels).last_hidden_state)
    first = out.hidden_states[0]
    first.retain_grad()
    out.last_hidden_state.sum().backward()
    assert first.grad is not None and first.grad.abs().sum() > 0
    # the gradient w.r.t. block 1's output, recomputed by running block 2 and the LayerNorm on a leaf copy of it
    leaf = out.hidden_states[1].detach().requires_grad_(True)
    state = model.aggregation_settings(None)
    from modeling_testa.aggregation_block import TokenState, sequence, with_sequence

    template = model.run_blocks(pixels, state, last_layer=0)
    rebuilt = with_sequence(template, leaf)
    final = TokenState(*model.layers[1](*rebuilt, state, None))
    model.post_layernorm(sequence(final)).sum().backward()
    middle = model(pixels, output_hidden_states=True)
    middle.hidden_states[1].retain_grad()
    middle.last_hidden_state.sum().backward()
    torch.testing.assert_close(middle.hidden_states[1].grad, leaf.grad)
