"""The BLIP -> TESTA and original-checkpoint -> TESTA converters."""

import argparse
import math

import pytest
import torch
import torch.nn.functional as F
from heads_helpers import DEC, ENC, PAD, TEXT_SETTINGS, randomize, text_ids, tiny_blip_config
from transformers import BlipForConditionalGeneration, BlipForImageTextRetrieval, BlipForQuestionAnswering

from modeling_testa import TestaForPreTraining, TestaForVideoQA, TestaForVideoTextRetrieval
from modeling_testa.convert_blip_to_testa import convert_blip_to_testa
from modeling_testa.convert_blip_to_testa import main as blip_main
from modeling_testa.convert_original_testa import convert_original_testa, parse_testa_r
from modeling_testa.convert_original_testa import main as original_main


NO_AGGREGATION = dict(temporal_reduction=0, spatial_reduction=0)


# ---------------------------------------------------------------------------------------------------------- BLIP


@torch.no_grad()
def test_blip_conversion_carries_settings_and_initialises_time_like_timesformer():
    blip = randomize(BlipForImageTextRetrieval(tiny_blip_config(layer_norm_eps=3e-4))).eval()
    model = convert_blip_to_testa(blip, num_frames=6, temporal_reduction=1, spatial_reduction=2, queue_size=12)
    vision, blip_vision = model.config.vision_config, blip.config.vision_config
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
                 "layer_norm_eps", "hidden_act"):
        assert getattr(vision, name) == getattr(blip_vision, name), name
    assert model.vision_model.layers[0].layer_norm1.eps == 3e-4
    assert (vision.num_frames, vision.temporal_reduction, vision.spatial_reduction) == (6, 1, 2)
    assert model.config.text_config.to_dict() | {"encoder_hidden_size": 32} == blip.config.text_config.to_dict()
    assert (model.config.dec_token_id, model.config.enc_token_id, model.config.queue_size) == (DEC, ENC, 12)
    assert model.config.projection_dim == blip.config.image_text_hidden_size
    for ours, theirs in zip(model.vision_model.layers, blip.vision_model.encoder.layers):
        torch.testing.assert_close(ours.temporal_attention.qkv.weight, theirs.self_attn.qkv.weight)
        torch.testing.assert_close(ours.temporal_attention.projection.bias, theirs.self_attn.projection.bias)
        torch.testing.assert_close(ours.temporal_layer_norm.weight, theirs.layer_norm1.weight)
        assert ours.temporal_fc.weight.eq(0).all() and ours.temporal_fc.bias.eq(0).all()
    assert model.vision_model.embeddings.temporal_embedding.eq(0).all()
    assert model.vision_model.embeddings.temporal_embedding.shape == (1, 6, 32)
    torch.testing.assert_close(model.itm_head.weight, blip.itm_head.weight)
    torch.testing.assert_close(
        model.text_encoder.encoder.layer[1].crossattention.self.key.weight,
        blip.text_encoder.encoder.layer[1].crossattention.self.key.weight,
    )
    assert model.conversion_report["unused_blip_keys"] == []


@torch.no_grad()
def test_blip_conversion_resizes_position_embedding_like_blip_interpolation():
    """Converting a 32-px BLIP to 48 px gives, on one frame, BLIP run at 48 px with ``interpolate_pos_encoding``:
    the same bicubic resize of the patch grid (4x4 -> 6x6), done once offline instead of at every call."""
    blip = randomize(BlipForImageTextRetrieval(tiny_blip_config())).eval()
    model = convert_blip_to_testa(blip, num_frames=2, image_size=48, **NO_AGGREGATION)
    assert model.vision_model.embeddings.position_embedding.shape == (1, 1 + 36, 32)
    images = torch.randn(2, 3, 48, 48)
    expected = blip.vision_model(images, interpolate_pos_encoding=True).last_hidden_state
    torch.testing.assert_close(model.vision_model(images[:, None]).last_hidden_state, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_captioning_conversion_equals_blip_decoder_on_one_frame():
    """`BlipForConditionalGeneration` becomes the pre-training head's decoder: on one frame (aggregation off) the
    caption logits and greedy captions equal BLIP's. The text encoder, absent from a captioning checkpoint, reads
    the shared decoder modules and starts its self-attention from the decoder's."""
    blip = randomize(BlipForConditionalGeneration(tiny_blip_config()), seed=2).eval()
    model = convert_blip_to_testa(blip, num_frames=2, **NO_AGGREGATION)
    assert isinstance(model, TestaForPreTraining)
    assert sorted(model.conversion_report["freshly_initialised"]) == sorted(
        ["itm_head.weight", "itm_head.bias", "temp", "text_proj.weight", "text_proj.bias", "vision_proj.weight",
         "vision_proj.bias"]
    )
    torch.testing.assert_close(
        model.text_encoder.encoder.layer[0].attention.self.query.weight,
        blip.text_decoder.bert.encoder.layer[0].attention.self.query.weight,
    )
    images, ids = torch.randn(2, 3, 32, 32), text_ids(2, 6, seed=3)
    blip_ids = ids.clone()
    blip_ids[:, 0] = DEC
    expected = blip(images, input_ids=blip_ids).logits
    ours = model(ids, images[:, None], return_loss=False).caption_logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.generate(images[:, None], max_new_tokens=5), blip.generate(images, max_new_tokens=5))


def test_blip_cli_writes_a_loadable_folder(tmp_path):
    blip = randomize(BlipForQuestionAnswering(tiny_blip_config()), seed=4).eval()
    blip.save_pretrained(tmp_path / "blip")
    out = tmp_path / "testa"
    blip_main(["--blip", str(tmp_path / "blip"), "--num-frames", "3", "--image-size", "40", "--output-dir", str(out),
               "--temporal-reduction", "0", "--spatial-reduction", "0"])
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    from modeling_testa.processing_testa import TestaProcessor

    processor = TestaProcessor.from_pretrained(out)  # the video processor follows the converted model
    assert processor.video_processor.num_frames == 3 and processor.video_processor.crop_size["height"] == 40
    model = TestaForVideoQA.from_pretrained(out).eval()
    assert model.config.vision_config.image_size == 40 and model.config.vision_config.num_frames == 3
    direct = convert_blip_to_testa(blip, num_frames=3, image_size=40, **NO_AGGREGATION)
    questions, clips, answers = text_ids(2, 5), torch.randn(2, 3, 3, 40, 40), text_ids(2, 4, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(
            model(questions, clips, labels=answers).logits, direct(questions, clips, labels=answers).logits
        )


# ------------------------------------------------------------------------------------------ original checkpoints

WIDTH, HEADS, MLP, PATCH, GRID, FRAMES, LAYERS = 32, 4, 64, 8, 4, 3, 2


def _original_state(seed: int = 0, task: str = "retrieval") -> dict[str, torch.Tensor]:
    """A synthetic original TESTA state dict: the key names are written out from the original module tree
    (TimeSformer `visual_encoder`, med.py `text_encoder`), with tiny shapes and random values."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        scale = scale if scale is not None else (1.0 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.2)
        return torch.randn(*shape, generator=g) * scale

    state = {}
    for prefix in ("visual_encoder", "visual_encoder_m") if task == "retrieval" else ("visual_encoder",):
        state[f"{prefix}.cls_token"] = rnd(1, 1, WIDTH, scale=1.0)
        state[f"{prefix}.pos_embed"] = rnd(1, 1 + GRID * GRID, WIDTH, scale=1.0)
        state[f"{prefix}.time_embed"] = rnd(1, FRAMES, WIDTH, scale=1.0)
        state[f"{prefix}.patch_embed.proj.weight"] = rnd(WIDTH, 3, PATCH, PATCH, scale=0.1)
        state[f"{prefix}.patch_embed.proj.bias"] = rnd(WIDTH)
        for i in range(LAYERS):
            b = f"{prefix}.blocks.{i}"
            for norm in ("norm1", "temporal_norm1", "norm2"):
                state[f"{b}.{norm}.weight"] = 1 + rnd(WIDTH)
                state[f"{b}.{norm}.bias"] = rnd(WIDTH)
            for attn in ("attn", "temporal_attn"):
                state[f"{b}.{attn}.qkv.weight"] = rnd(3 * WIDTH, WIDTH)
                state[f"{b}.{attn}.qkv.bias"] = rnd(3 * WIDTH)
                state[f"{b}.{attn}.proj.weight"] = rnd(WIDTH, WIDTH)
                state[f"{b}.{attn}.proj.bias"] = rnd(WIDTH)
            state[f"{b}.temporal_fc.weight"] = rnd(WIDTH, WIDTH)  # non-zero: temporal attention matters
            state[f"{b}.temporal_fc.bias"] = rnd(WIDTH)
            state[f"{b}.mlp.fc1.weight"], state[f"{b}.mlp.fc1.bias"] = rnd(MLP, WIDTH), rnd(MLP)
            state[f"{b}.mlp.fc2.weight"], state[f"{b}.mlp.fc2.bias"] = rnd(WIDTH, MLP), rnd(WIDTH)
        state[f"{prefix}.norm.weight"], state[f"{prefix}.norm.bias"] = 1 + rnd(WIDTH), rnd(WIDTH)
    text_prefixes = ("text_encoder", "text_encoder_m") if task == "retrieval" else ("text_encoder", "text_decoder.bert")
    for prefix in text_prefixes:
        state[f"{prefix}.embeddings.position_ids"] = torch.arange(64)[None]
        state[f"{prefix}.embeddings.word_embeddings.weight"] = rnd(TEXT_SETTINGS["vocab_size"], WIDTH, scale=1.0)
        state[f"{prefix}.embeddings.position_embeddings.weight"] = rnd(64, WIDTH, scale=1.0)
        state[f"{prefix}.embeddings.LayerNorm.weight"] = 1 + rnd(WIDTH)
        state[f"{prefix}.embeddings.LayerNorm.bias"] = rnd(WIDTH)
        for i in range(LAYERS):
            layer = f"{prefix}.encoder.layer.{i}"
            for attn in ("attention", "crossattention"):
                for proj in ("query", "key", "value"):
                    state[f"{layer}.{attn}.self.{proj}.weight"] = rnd(WIDTH, WIDTH)
                    state[f"{layer}.{attn}.self.{proj}.bias"] = rnd(WIDTH)
                state[f"{layer}.{attn}.output.dense.weight"] = rnd(WIDTH, WIDTH)
                state[f"{layer}.{attn}.output.dense.bias"] = rnd(WIDTH)
                state[f"{layer}.{attn}.output.LayerNorm.weight"] = 1 + rnd(WIDTH)
                state[f"{layer}.{attn}.output.LayerNorm.bias"] = rnd(WIDTH)
            state[f"{layer}.intermediate.dense.weight"], state[f"{layer}.intermediate.dense.bias"] = rnd(MLP, WIDTH), rnd(MLP)
            state[f"{layer}.output.dense.weight"], state[f"{layer}.output.dense.bias"] = rnd(WIDTH, MLP), rnd(WIDTH)
            state[f"{layer}.output.LayerNorm.weight"], state[f"{layer}.output.LayerNorm.bias"] = 1 + rnd(WIDTH), rnd(WIDTH)
    if task == "retrieval":
        for name in ("vision_proj", "text_proj", "vision_proj_m", "text_proj_m"):
            state[f"{name}.weight"], state[f"{name}.bias"] = rnd(16, WIDTH), rnd(16)
        state["itm_head.weight"], state["itm_head.bias"] = rnd(2, WIDTH), rnd(2)
        state["temp"] = torch.tensor(0.05)
        state["image_queue"], state["text_queue"] = rnd(16, 8), rnd(16, 8)
        state["idx_queue"], state["ptr_queue"] = torch.full((1, 8), -100), torch.zeros(1, dtype=torch.long)
        # What the original `load_checkpoint` leaves behind when given a TESTA checkpoint:
        state["visual_encoder.blocks.0.temporal_temporal_attn.qkv.weight"] = rnd(3 * WIDTH, WIDTH)
    else:
        state["text_decoder.cls.predictions.bias"] = rnd(TEXT_SETTINGS["vocab_size"])
        state["text_decoder.cls.predictions.transform.dense.weight"] = rnd(WIDTH, WIDTH)
        state["text_decoder.cls.predictions.transform.dense.bias"] = rnd(WIDTH)
        state["text_decoder.cls.predictions.transform.LayerNorm.weight"] = 1 + rnd(WIDTH)
        state["text_decoder.cls.predictions.transform.LayerNorm.bias"] = rnd(WIDTH)
        state["text_decoder.cls.predictions.decoder.weight"] = state["text_decoder.bert.embeddings.word_embeddings.weight"]
        state["text_decoder.cls.predictions.decoder.bias"] = state["text_decoder.cls.predictions.bias"]
    return state


def _original_config(**overrides) -> dict:
    config = dict(num_frames=FRAMES, image_size=GRID * PATCH, testa_r=[1, 3, 0, 2], merging_type="frame&patch",
                  token_merging=True, num_heads=HEADS, queue_size=8, alpha=0.4, k_test=16, negative_all_rank=True,
                  learnable_temporal_scaling=False)
    config.update(overrides)
    return config


TEXT_OVERRIDES = dict(num_attention_heads=HEADS, bos_token_id=DEC, sep_token_id=102, pad_token_id=PAD)


def _reference_timesformer(state: dict, video: torch.Tensor) -> torch.Tensor:
    """The original TimeSformer divided space-time forward (no merging), written from the notes with the original
    key names, in float64. Returns ``[CLS, patch tokens]`` in the original ``(l t)`` (patch-major) order."""
    s = {k[len("visual_encoder."):]: v.double() for k, v in state.items() if k.startswith("visual_encoder.")}
    b, t = video.shape[:2]
    d, heads = WIDTH, HEADS

    def ln(x, name):
        return F.layer_norm(x, (d,), s[f"{name}.weight"], s[f"{name}.bias"], eps=1e-6)

    def attention(x, name):
        n, length = x.shape[:2]
        qkv = F.linear(x, s[f"{name}.qkv.weight"], s[f"{name}.qkv.bias"]).view(n, length, 3, heads, d // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) * (d // heads) ** -0.5).softmax(-1)
        out = (weights @ v).transpose(1, 2).reshape(n, length, d)
        return F.linear(out, s[f"{name}.proj.weight"], s[f"{name}.proj.bias"])

    frames = video.double().flatten(0, 1)
    x = F.conv2d(frames, s["patch_embed.proj.weight"], s["patch_embed.proj.bias"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([s["cls_token"].expand(b * t, -1, -1), x], 1) + s["pos_embed"]
    cls = x[:b, :1]
    patches = x[:, 1:].reshape(b, t, GRID * GRID, d).transpose(1, 2) + s["time_embed"][:, None]  # (b, l, t, d)
    length = GRID * GRID
    x = torch.cat([cls, patches.reshape(b, length * t, d)], 1)  # 'b (l t) d'
    for i in range(LAYERS):
        blk = f"blocks.{i}"
        xt = x[:, 1:].reshape(b * length, t, d)
        res_t = attention(ln(xt, f"{blk}.temporal_norm1"), f"{blk}.temporal_attn").reshape(b, length * t, d)
        xt = x[:, 1:] + F.linear(res_t, s[f"{blk}.temporal_fc.weight"], s[f"{blk}.temporal_fc.bias"])
        init_cls = x[:, :1]
        xs = xt.reshape(b, length, t, d).transpose(1, 2).reshape(b * t, length, d)
        xs = torch.cat([init_cls.repeat_interleave(t, 0), xs], 1)
        res_s = attention(ln(xs, f"{blk}.norm1"), f"{blk}.attn")
        cls_res = res_s[:, :1].reshape(b, t, d).mean(1, keepdim=True)
        res_s = res_s[:, 1:].reshape(b, t, length, d).transpose(1, 2).reshape(b, length * t, d)
        x = torch.cat([init_cls, xt], 1) + torch.cat([cls_res, res_s], 1)
        h = F.gelu(F.linear(ln(x, f"{blk}.norm2"), s[f"{blk}.mlp.fc1.weight"], s[f"{blk}.mlp.fc1.bias"]))
        x = x + F.linear(h, s[f"{blk}.mlp.fc2.weight"], s[f"{blk}.mlp.fc2.bias"])
    return ln(x, "norm")


def test_parse_testa_r_reads_the_interleaved_schedule():
    assert parse_testa_r([1, 12] * 12) == ([1] * 12, [12] * 12)
    assert parse_testa_r([4, 8] * 12) == ([4] * 12, [8] * 12)
    assert parse_testa_r([1, 3, 0, 2], num_layers=2) == ([1, 0], [3, 2])
    assert parse_testa_r([2, 5], num_layers=2) == ([2, 0], [5, 0])  # zero-padded like the original parse_r
    assert parse_testa_r([5, 6], merging_type="patch", num_layers=2) == ([0, 0], [5, 6])
    assert parse_testa_r([1, 12] * 12, token_merging=False) == ([0] * 12, [0] * 12)
    with pytest.raises(ValueError, match="merging_type"):
        parse_testa_r([1], merging_type="frame-patch")


def test_original_retrieval_checkpoint_converts_and_accounts_for_every_key(tmp_path):
    state = _original_state()
    path = tmp_path / "testa_f3.pth"
    torch.save({"model": state, "config": _original_config(), "epoch": 3}, path)
    model, report = convert_original_testa(path, text_config=TEXT_OVERRIDES, enc_token_id=ENC)
    assert isinstance(model, TestaForVideoTextRetrieval)
    vision = model.config.vision_config
    assert vision.temporal_reduction == [1, 0] and vision.spatial_reduction == [3, 2]
    assert (vision.num_frames, vision.image_size, vision.num_attention_heads) == (FRAMES, 32, HEADS)
    assert (model.config.queue_size, model.config.k_test, model.config.projection_dim) == (8, 16, 16)
    # Every key is mapped or dropped with a reason; nothing is unmapped or missing.
    assert not report.unmapped and not report.missing
    assert set(report.mapped) | set(report.dropped) == set(state)
    assert set(report.dropped) == {
        "image_queue", "text_queue", "idx_queue", "ptr_queue", "text_encoder.embeddings.position_ids",
        "text_encoder_m.embeddings.position_ids", "visual_encoder.blocks.0.temporal_temporal_attn.qkv.weight",
    }
    # Spot checks of the renames, written out independently of the converter's tables.
    layer = model.vision_model.layers[1]
    for original, ours in [
        ("visual_encoder.blocks.1.temporal_attn.qkv.weight", layer.temporal_attention.qkv.weight),
        ("visual_encoder.blocks.1.temporal_attn.proj.bias", layer.temporal_attention.projection.bias),
        ("visual_encoder.blocks.1.temporal_norm1.weight", layer.temporal_layer_norm.weight),
        ("visual_encoder.blocks.1.temporal_fc.weight", layer.temporal_fc.weight),
        ("visual_encoder.blocks.1.attn.proj.weight", layer.self_attn.projection.weight),
        ("visual_encoder.blocks.1.norm1.bias", layer.layer_norm1.bias),
        ("visual_encoder.blocks.1.norm2.weight", layer.layer_norm2.weight),
        ("visual_encoder.blocks.1.mlp.fc2.weight", layer.mlp.fc2.weight),
        ("visual_encoder.norm.weight", model.vision_model.post_layernorm.weight),
        ("visual_encoder.time_embed", model.vision_model.embeddings.temporal_embedding),
        ("visual_encoder_m.blocks.0.attn.qkv.bias", model.momentum.vision_model.layers[0].self_attn.qkv.bias),
        ("text_encoder.encoder.layer.1.crossattention.self.value.weight",
         model.text_encoder.encoder.layer[1].crossattention.self.value.weight),
        ("text_proj_m.weight", model.momentum.text_proj.weight),
        ("temp", model.temp),
    ]:
        torch.testing.assert_close(ours.detach(), state[original], msg=original)
    assert bool(model.momentum.initialized)  # the checkpoint's momentum encoder is used as is

    # Functional check against the original block algorithm (aggregation off, so token orders can be compared).
    unmerged, _ = convert_original_testa(
        {"model": state, "config": _original_config(token_merging=False)}, text_config=TEXT_OVERRIDES, enc_token_id=ENC
    )
    video = torch.randn(2, FRAMES, 3, 32, 32)
    with torch.no_grad():
        ours = unmerged.vision_model(video).last_hidden_state.double()
    reference = _reference_timesformer(state, video)
    torch.testing.assert_close(ours[:, 0], reference[:, 0], atol=1e-4, rtol=1e-4)
    ours_patches = ours[:, 1:].view(2, FRAMES, GRID * GRID, WIDTH).transpose(1, 2)  # frame-major -> (l t)
    torch.testing.assert_close(ours_patches.reshape(2, -1, WIDTH), reference[:, 1:], atol=1e-4, rtol=1e-4)


def test_original_qa_checkpoint_and_unmapped_keys(tmp_path):
    state = _original_state(seed=1, task="qa")
    state["visual_encoder.blocks.0.temporal_scaling"] = torch.zeros(1, FRAMES, 1)
    model, report = convert_original_testa({"model": state, "config": _original_config()}, text_config=TEXT_OVERRIDES,
                                           enc_token_id=ENC)
    assert isinstance(model, TestaForVideoQA)
    assert "visual_encoder.blocks.0.temporal_scaling" in report.dropped and not report.unmapped and not report.missing
    torch.testing.assert_close(
        model.text_decoder.cls.predictions.transform.dense.weight,
        state["text_decoder.cls.predictions.transform.dense.weight"],
    )
    assert model.text_decoder.cls.predictions.decoder.weight is model.text_decoder.bert.embeddings.word_embeddings.weight

    state["visual_encoder.blocks.0.mystery.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="mystery"):
        convert_original_testa({"model": state, "config": _original_config()}, text_config=TEXT_OVERRIDES,
                               enc_token_id=ENC)
    _, report = convert_original_testa({"model": state, "config": _original_config()}, text_config=TEXT_OVERRIDES,
                                       enc_token_id=ENC, strict=False)
    assert report.unmapped == ["visual_encoder.blocks.0.mystery.weight"]
    # A QA checkpoint forced into the retrieval head: its decoder has no place there, and the heads are missing.
    _, report = convert_original_testa({"model": state, "config": _original_config()}, task="retrieval",
                                       text_config=TEXT_OVERRIDES, enc_token_id=ENC, strict=False)
    assert any(k.startswith("text_decoder.") for k in report.unmapped) and "itm_head.weight" in report.missing


def test_original_checkpoint_is_read_with_weights_only(tmp_path):
    path = tmp_path / "unsafe.pth"
    torch.save({"model": _original_state(), "args": argparse.Namespace(lr=1.0)}, path)
    with pytest.raises(ValueError, match="weights_only"):
        convert_original_testa(path)


def test_original_cli_writes_a_loadable_folder(tmp_path, monkeypatch):
    state = _original_state(seed=2)
    torch.save({"model": state, "config": _original_config()}, tmp_path / "ckpt.pth")
    import modeling_testa.convert_original_testa as module

    original = module.convert_original_testa
    monkeypatch.setattr(  # the tiny vocabulary needs the token ids that a real 30524-word checkpoint has by default
        module, "convert_original_testa",
        lambda *a, **k: original(*a, text_config=TEXT_OVERRIDES, enc_token_id=ENC, **k),
    )
    original_main(["--checkpoint", str(tmp_path / "ckpt.pth"), "--output-dir", str(tmp_path / "out")])
    reloaded = TestaForVideoTextRetrieval.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.vision_config.spatial_reduction == [3, 2]
    torch.testing.assert_close(reloaded.itm_head.weight, state["itm_head.weight"])
    torch.testing.assert_close(reloaded.temp.detach(), state["temp"])
