"""The BLIP -> TESTA converter: equal to transformers' BLIP on one frame, settings carried, the CLI."""


import torch
from helpers.models import DEC, ENC, randomize, text_ids, tiny_blip_config
from transformers import BlipForConditionalGeneration, BlipForImageTextRetrieval, BlipForQuestionAnswering

from modeling_testa import TestaForPreTraining, TestaForVideoQA
from modeling_testa.convert_blip_to_testa import convert_blip_to_testa
from modeling_testa.convert_blip_to_testa import main as blip_main


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
    # BLIP merges nothing: its converted encoder is a TESTA model to train, under the library's default rule
    assert vision.score_grid == 2.0**-10
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
