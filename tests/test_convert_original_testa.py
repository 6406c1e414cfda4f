"""The original-checkpoint -> TESTA converter: every key accounted for, equal to the original forward, the CLI."""

import argparse

import pytest
import torch
from helpers.models import ENC

from modeling_testa import TestaForVideoQA, TestaForVideoTextRetrieval
from modeling_testa.convert_original_testa import convert_original_testa, parse_testa_r
from modeling_testa.convert_original_testa import main as original_main


from helpers.original_checkpoints import (
    FRAMES,
    GRID,
    HEADS,
    TEXT_OVERRIDES,
    WIDTH,
    original_config,
    original_state,
    reference_timesformer,
)


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
    state = original_state()
    path = tmp_path / "testa_f3.pth"
    torch.save({"model": state, "config": original_config(), "epoch": 3}, path)
    model, report = convert_original_testa(path, text_config=TEXT_OVERRIDES, enc_token_id=ENC)
    assert isinstance(model, TestaForVideoTextRetrieval)
    vision = model.config.vision_config
    assert vision.temporal_reduction == [1, 0] and vision.spatial_reduction == [3, 2]
    # the released code decides on raw scores: so does the converted model, whatever its frame rule (issue 45)
    assert vision.score_grid == 0.0 and vision.frame_matching == "original"
    assert convert_original_testa(path, text_config=TEXT_OVERRIDES, enc_token_id=ENC, frame_matching="mean")[
        0].config.vision_config.score_grid == 0.0
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
        {"model": state, "config": original_config(token_merging=False)}, text_config=TEXT_OVERRIDES, enc_token_id=ENC
    )
    video = torch.randn(2, FRAMES, 3, 32, 32)
    with torch.no_grad():
        ours = unmerged.vision_model(video).last_hidden_state.double()
    reference = reference_timesformer(state, video)
    torch.testing.assert_close(ours[:, 0], reference[:, 0], atol=1e-4, rtol=1e-4)
    ours_patches = ours[:, 1:].view(2, FRAMES, GRID * GRID, WIDTH).transpose(1, 2)  # frame-major -> (l t)
    torch.testing.assert_close(ours_patches.reshape(2, -1, WIDTH), reference[:, 1:], atol=1e-4, rtol=1e-4)


def test_original_qa_checkpoint_and_unmapped_keys(tmp_path):
    state = original_state(seed=1, task="qa")
    state["visual_encoder.blocks.0.temporal_scaling"] = torch.zeros(1, FRAMES, 1)
    model, report = convert_original_testa({"model": state, "config": original_config()}, text_config=TEXT_OVERRIDES,
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
        convert_original_testa({"model": state, "config": original_config()}, text_config=TEXT_OVERRIDES,
                               enc_token_id=ENC)
    _, report = convert_original_testa({"model": state, "config": original_config()}, text_config=TEXT_OVERRIDES,
                                       enc_token_id=ENC, strict=False)
    assert report.unmapped == ["visual_encoder.blocks.0.mystery.weight"]
    # A QA checkpoint forced into the retrieval head: its decoder has no place there, and the heads are missing.
    _, report = convert_original_testa({"model": state, "config": original_config()}, task="retrieval",
                                       text_config=TEXT_OVERRIDES, enc_token_id=ENC, strict=False)
    assert any(k.startswith("text_decoder.") for k in report.unmapped) and "itm_head.weight" in report.missing


def test_original_checkpoint_is_read_with_weights_only(tmp_path):
    path = tmp_path / "unsafe.pth"
    torch.save({"model": original_state(), "args": argparse.Namespace(lr=1.0)}, path)
    with pytest.raises(ValueError, match="weights_only"):
        convert_original_testa(path)


def test_original_cli_writes_a_loadable_folder(tmp_path, monkeypatch):
    state = original_state(seed=2)
    torch.save({"model": state, "config": original_config()}, tmp_path / "ckpt.pth")
    import modeling_testa.convert_original_testa as module

    original = module.convert_original_testa
    monkeypatch.setattr(  # the tiny vocabulary needs the token ids that a real 30524-word checkpoint has by default
        module, "convert_original_testa",
        lambda *a, **k: original(*a, text_config=TEXT_OVERRIDES, enc_token_id=ENC, **k),
    )
    original_main(["--checkpoint", str(tmp_path / "ckpt.pth"), "--output-dir", str(tmp_path / "out")])
    reloaded = TestaForVideoTextRetrieval.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.vision_config.spatial_reduction == [3, 2]
    assert reloaded.config.vision_config.score_grid == 0.0  # saved with the model
    torch.testing.assert_close(reloaded.itm_head.weight, state["itm_head.weight"])
    torch.testing.assert_close(reloaded.temp.detach(), state["temp"])
