"""The TESTA heads: equivalence with transformers' BLIP, the losses against float64 recomputations, two-stage
retrieval and answer ranking against brute force, and the HF plumbing (save/load, dtype, checkpointing)."""

import pytest
import torch
import torch.nn.functional as F
from helpers.models import DEC, ENC, PAD, randomize, text_ids, tiny_blip_config, tiny_config, videos
from transformers import BlipForImageTextRetrieval, BlipForQuestionAnswering

from modeling_testa import TestaForPreTraining, TestaForVideoQA, TestaForVideoTextRetrieval
from modeling_testa.convert_blip_to_testa import convert_blip_to_testa


NO_AGGREGATION = dict(temporal_reduction=0, spatial_reduction=0)


@pytest.fixture(scope="module")
def blip_retrieval():
    return randomize(BlipForImageTextRetrieval(tiny_blip_config())).eval()


@pytest.fixture(scope="module")
def blip_qa():
    return randomize(BlipForQuestionAnswering(tiny_blip_config()), seed=1).eval()


def _retrieval(**overrides) -> TestaForVideoTextRetrieval:
    return randomize(TestaForVideoTextRetrieval(tiny_config(**overrides))).eval()


# ------------------------------------------------------------------------------------------- equivalence with BLIP


@torch.no_grad()
def test_one_frame_itm_logits_equal_blip(blip_retrieval):
    """A converted model on a one-frame video with aggregation off computes exactly BLIP's ITM logits.

    Why it must hold: with one frame, temporal attention attends over a single token and goes through the zero
    ``temporal_fc`` (and a zero time embedding), so every block is BLIP's ViT block; the CLS average over one frame
    is the CLS itself; the text encoder, cross-attention and ``itm_head`` are BLIP's weights. The only difference is
    that TESTA puts [ENC] in place of the first token itself, while BLIP expects the caller to (transformers #22732):
    BLIP is given [ENC]-first ids, TESTA the tokenizer's [CLS]-first ids.
    """
    model = convert_blip_to_testa(blip_retrieval, num_frames=4, **NO_AGGREGATION)
    ids, images = text_ids(3, 7, seed=1), torch.randn(3, 3, 32, 32)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0  # padding must be handled the same way
    blip_logits = blip_retrieval(ids.clone().index_fill_(1, torch.tensor([0]), ENC), images, attention_mask=mask).itm_score
    testa_logits = model(ids, images[:, None], attention_mask=mask).itm_score
    torch.testing.assert_close(testa_logits, blip_logits, atol=1e-4, rtol=0)
    # Negative control: the comparison is sensitive. Keeping [CLS] (BLIP's default) gives other logits.
    assert (blip_retrieval(ids, images, attention_mask=mask).itm_score - blip_logits).abs().max() > 1e-2


@torch.no_grad()
def test_one_frame_cosine_equals_blip_with_cls_pooling(blip_retrieval):
    """``use_itm_head=False`` is BLIP's ITC cosine when the video embedding pools the CLS like image BLIP does (the
    original TESTA mean-pools all tokens instead, which must then differ)."""
    model = convert_blip_to_testa(blip_retrieval, num_frames=4, video_pooling="cls", **NO_AGGREGATION)
    ids, images = text_ids(3, 7, seed=2), torch.randn(3, 3, 32, 32)
    blip_cosine = blip_retrieval(ids, images, use_itm_head=False).itm_score
    torch.testing.assert_close(model(ids, images[:, None], use_itm_head=False).itm_score, blip_cosine, atol=1e-5, rtol=0)
    model.config.video_pooling = "mean"
    assert (model(ids, images[:, None], use_itm_head=False).itm_score - blip_cosine).abs().max() > 1e-3


@torch.no_grad()
def test_static_video_encoder_output_is_blip_image_tokens(blip_retrieval):
    """On a static T-frame video (one image repeated) with aggregation off, the encoder output is BLIP's image tokens:
    the CLS once, then every patch token once per frame.

    Why it must hold: all frames are identical, so temporal attention averages T identical values and its output
    goes through the zero ``temporal_fc``; spatial attention of every frame is BLIP's attention on the image, and the
    CLS average over T identical per-frame CLS outputs is BLIP's CLS.

    The ITM logits, however, differ for T > 1: the text cross-attends to 1 + T*L tokens in which every patch key is
    duplicated T times while the CLS appears once, which reweighs the softmax (patches get T times the mass).
    """
    frames = 4
    model = convert_blip_to_testa(blip_retrieval, num_frames=frames, **NO_AGGREGATION)
    images = torch.randn(2, 3, 32, 32)
    blip_tokens = blip_retrieval.vision_model(images).last_hidden_state  # (2, 1 + 16, 32)
    tokens = model.vision_model(images[:, None].expand(-1, frames, -1, -1, -1)).last_hidden_state
    assert tokens.shape == (2, 1 + frames * 16, 32)
    torch.testing.assert_close(tokens[:, 0], blip_tokens[:, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(
        tokens[:, 1:].view(2, frames, 16, 32), blip_tokens[:, None, 1:].expand(-1, frames, -1, -1), atol=1e-4, rtol=0
    )
    ids = text_ids(2, 6, seed=3)
    static = model(ids, images[:, None].expand(-1, frames, -1, -1, -1)).itm_score
    single = model(ids, images[:, None]).itm_score
    assert (static - single).abs().max() > 1e-3


@torch.no_grad()
def test_qa_answer_log_likelihoods_and_generation_equal_blip(blip_qa):
    """On a one-frame video with aggregation off, TESTA's answer log-likelihoods equal BLIP's, and greedy generation
    gives BLIP's answers.

    Why: the vision tokens equal BLIP's (see the ITM test), the question encoder is BLIP's text encoder given [ENC]
    first, and the decoder is BLIP's decoder starting from [DEC] and cross-attending to the question states. BLIP's
    own ``forward(labels=...)`` returns the mean token loss of one answer, so its log-likelihood is ``-loss * tokens``.
    """
    model = convert_blip_to_testa(blip_qa, num_frames=2, **NO_AGGREGATION)
    model.config.label_smoothing = 0.0
    questions, images = text_ids(2, 6, seed=4), torch.randn(2, 3, 32, 32)
    answers = torch.cat([text_ids(3, 4, seed=5), text_ids(2, 3, seed=6, pad_to=4)])  # 5 candidates, some padded
    ranking = model.rank_answers(questions, images[:, None], answers, k=5, label_smoothing=0.0)
    blip_questions = questions.clone()
    blip_questions[:, 0] = ENC
    for q in range(2):
        for slot, a in enumerate(ranking.topk_indices[q].tolist()):
            answer = answers[a][answers[a] != PAD][None].clone()
            answer[:, 0] = DEC
            loss = blip_qa(blip_questions[q : q + 1], images[q : q + 1], labels=answer).loss
            expected = -loss * (answer.shape[1] - 1)
            torch.testing.assert_close(ranking.topk_log_likelihoods[q, slot], expected, atol=1e-4, rtol=1e-5)
    generated = model.generate(questions, images[:, None], max_new_tokens=6)
    blip_generated = blip_qa.generate(blip_questions, images, max_new_tokens=6)
    torch.testing.assert_close(generated, blip_generated)


# --------------------------------------------------------------------------------------------------- QA head


def _qa(**overrides) -> TestaForVideoQA:
    return randomize(TestaForVideoQA(tiny_config(**overrides))).eval()


def _smoothed_nll_float64(logits, ids, mask, smoothing):
    """Sum over tokens of (1 - e) * NLL + e * mean_v(-log p_v), written out, in float64."""
    logp = logits[:, :-1].double().log_softmax(-1)
    targets = ids[:, 1:]
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    uniform = -logp.mean(-1)
    per_token = (1 - smoothing) * nll + smoothing * uniform
    return (per_token * mask[:, 1:].double()).sum(1)


def test_qa_loss_weights_counts_and_label_smoothing():
    model = _qa(vision=NO_AGGREGATION, label_smoothing=0.1)
    questions, clips = text_ids(2, 5, seed=7), videos(2, frames=2)
    answers = torch.cat([text_ids(2, 4, seed=8), text_ids(1, 3, seed=9, pad_to=4)])
    mask = answers.ne(PAD).long()
    weights = torch.tensor([0.3, 0.7, 0.2])
    out = model(questions, clips, labels=answers, decoder_attention_mask=mask, answer_weights=weights, num_answers=[2, 1])
    # Answers 0 and 1 belong to question 0, answer 2 to question 1: decode each against its own question alone.
    per_answer = []
    for q, a in ((0, 0), (0, 1), (1, 2)):
        alone = model(questions[q : q + 1], clips[q : q + 1], labels=answers[a : a + 1], decoder_attention_mask=mask[a : a + 1])
        per_answer.append(_smoothed_nll_float64(alone.logits, answers[a : a + 1], mask[a : a + 1], 0.1))
    per_answer = torch.cat(per_answer)
    torch.testing.assert_close(out.answer_loss.double(), per_answer, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.double(), (weights.double() * per_answer).sum() / 2, atol=1e-5, rtol=1e-5)
    # Without a mask, padding is found from pad_token_id; -100 in labels is accepted as padding too.
    no_mask = model(questions, clips, labels=answers.masked_fill(answers == PAD, -100), num_answers=[2, 1])
    torch.testing.assert_close(no_mask.answer_loss, out.answer_loss)
    with pytest.raises(ValueError, match="num_answers"):
        model(questions, clips, labels=answers, num_answers=[1, 1])
    with pytest.raises(ValueError, match="labels"):
        model(questions, clips)


@torch.no_grad()
def test_rank_answers_top_k_by_first_token_then_full_likelihood():
    model = _qa(vision=NO_AGGREGATION)
    questions, clips = text_ids(2, 5, seed=10), videos(2, frames=2)
    answers = torch.cat([text_ids(4, 4, seed=11), text_ids(2, 3, seed=12, pad_to=4)])
    out = model.rank_answers(questions, clips, answers, k=3, label_smoothing=0.0)
    # Stage 1, recomputed: the decoder's first distribution after [DEC], read at every answer's first token.
    states, q_mask, _ = model.encode_question(questions, clips)
    first = model.text_decoder(
        input_ids=torch.full((2, 1), DEC), encoder_hidden_states=states, encoder_attention_mask=q_mask
    ).logits[:, 0].softmax(-1)[:, answers[:, 1]]
    expected_topk = first.topk(3, dim=1).indices
    torch.testing.assert_close(out.topk_indices, expected_topk)
    # Stage 2, recomputed with forward(): the best candidate by exact log-likelihood.
    for q in range(2):
        lls = []
        for a in out.topk_indices[q].tolist():
            mask = answers[a : a + 1].ne(PAD).long()
            logits = model(questions[q : q + 1], clips[q : q + 1], labels=answers[a : a + 1]).logits
            lls.append(-_smoothed_nll_float64(logits, answers[a : a + 1], mask, 0.0))
        lls = torch.cat(lls)
        torch.testing.assert_close(out.topk_log_likelihoods[q].double(), lls, atol=1e-4, rtol=1e-5)
        assert out.answer_indices[q] == out.topk_indices[q, lls.argmax()]


# ------------------------------------------------------------------------------------------------ retrieval head


@torch.no_grad()
def test_two_stage_ranking_equals_brute_force_and_is_chunked():
    model = _retrieval()
    ids, clips = text_ids(3, 6, seed=13), videos(4, seed=14)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    tokens = model.get_video_tokens(clips).last_hidden_state
    cosine = model.get_text_features(ids, mask).pooler_output @ model.get_video_features(clips).pooler_output.T  # (texts, videos)
    itm = torch.stack(
        [model(ids, clips[v : v + 1].expand(3, -1, -1, -1, -1), attention_mask=mask).itm_score for v in range(4)], dim=1
    )  # (texts, videos, 2)
    for itm_score, add_cosine, expected in (
        ("logit", True, itm[..., 1] + cosine),
        ("softmax", False, itm.softmax(-1)[..., 1]),
    ):
        out = model.rank_videos(ids, tokens, mask, k=2, itm_score=itm_score, add_cosine=add_cosine, batch_size=3)
        torch.testing.assert_close(out.similarity, cosine, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.topk_indices, cosine.topk(2, dim=1).indices)
        chosen = torch.zeros_like(cosine, dtype=torch.bool).scatter(1, out.topk_indices, True)
        torch.testing.assert_close(out.scores[chosen], expected[chosen], atol=1e-5, rtol=0)
        assert torch.isinf(out.scores[~chosen]).all() and (out.scores[~chosen] < 0).all()
    by_video = model.rank_texts(ids, tokens, mask, k=10, batch_size=5)  # k larger than the candidate set
    torch.testing.assert_close(by_video.scores, (itm[..., 1] + cosine).T, atol=1e-5, rtol=0)


@torch.no_grad()
def test_video_pooling_options():
    model = _retrieval(video_pooling="weighted_mean")
    out = model.get_video_tokens(videos(2))
    tokens, sizes = out.last_hidden_state, out.token_sizes
    assert sizes.sum(1).eq(1 + 8 * 16).all() and (sizes > 1).any()  # merging happened, sizes count patches
    weighted = (tokens * sizes[..., None]).sum(1) / sizes.sum(1, keepdim=True)
    expected = F.normalize(model.vision_proj(weighted), dim=-1)
    torch.testing.assert_close(model.get_video_features(video_tokens=tokens, video_token_sizes=sizes).pooler_output, expected)
    with pytest.raises(ValueError, match="token sizes"):
        model.get_video_features(video_tokens=tokens).pooler_output
    model.config.video_pooling = "mean"
    expected = F.normalize(model.vision_proj(tokens.mean(1)), dim=-1)
    torch.testing.assert_close(model.get_video_features(video_tokens=tokens).pooler_output, expected)
    with pytest.raises(ValueError, match="exactly one"):
        model.get_video_features().pooler_output


def _vtc_reference(video, text, video_m, text_m, queue_v, queue_t, queue_ids, ids, alpha, temp):
    """The VTC loss written out in float64 from the features (single process: the batch is the global batch)."""
    video, text, video_m, text_m = (x.double() for x in (video, text, video_m, text_m))
    all_t = torch.cat([text_m, queue_t.double().T])
    all_v = torch.cat([video_m, queue_v.double().T])
    positives = (ids[:, None] == torch.cat([ids, queue_ids])[None]).double()
    targets = positives / positives.sum(1, keepdim=True)
    t_v2t = alpha * (video_m @ all_t.T / temp).softmax(1) + (1 - alpha) * targets
    t_t2v = alpha * (text_m @ all_v.T / temp).softmax(1) + (1 - alpha) * targets
    loss_v2t = -((video @ all_t.T / temp).log_softmax(1) * t_v2t).sum(1).mean()
    loss_t2v = -((text @ all_v.T / temp).log_softmax(1) * t_t2v).sum(1).mean()
    return (loss_v2t + loss_t2v) / 2


def test_vtc_and_vtm_losses_match_float64_recomputation():
    model = _retrieval(queue_size=6, alpha=0.4).train()
    ids, clips = text_ids(4, 6, seed=15), videos(4, seed=16)
    video_ids = torch.tensor([3, 7, 3, 9])  # pairs 0 and 2 show the same video: both are positives
    # First step: the momentum encoder is synchronised with the online one, then the batch enters the queue.
    model(ids, clips, return_loss=True, video_ids=video_ids)
    assert bool(model.momentum.initialized) and int(model.momentum.queue_ptr) == 4
    torch.testing.assert_close(model.momentum.idx_queue[:4], video_ids)
    queue = (model.momentum.video_queue.clone(), model.momentum.text_queue.clone(), model.momentum.idx_queue.clone())
    with torch.no_grad():
        video_m = model.get_video_features(clips).pooler_output  # momentum == online after the synchronising first step
        text_m = model.get_text_features(ids).pooler_output
    torch.testing.assert_close(queue[0][:, :4].T, video_m, atol=1e-5, rtol=0)
    torch.testing.assert_close(queue[1][:, :4].T, text_m, atol=1e-5, rtol=0)

    # Second step (momentum update is a no-op while momentum == online): recompute both losses.
    out = model(ids, clips, return_loss=True, video_ids=video_ids)
    video, text = model.get_video_features(clips).pooler_output, model.get_text_features(ids).pooler_output
    expected_vtc = _vtc_reference(video, text, video_m, text_m, *queue, video_ids, 0.4, float(model.temp.detach()))
    torch.testing.assert_close(out.loss_vtc.double(), expected_vtc, atol=1e-5, rtol=1e-5)
    # Hard negatives never share the video id; the VTM loss is the 3-way CE over the pairs that were drawn.
    neg_v, neg_t = out.negative_video_indices, out.negative_text_indices
    assert (video_ids[neg_v] != video_ids).all() and (video_ids[neg_t] != video_ids).all()
    with torch.no_grad():
        pos, _ = model.itm_logits(ids, None, out.video_embeds)
        text_neg_video, _ = model.itm_logits(ids, None, out.video_embeds[neg_v])
        video_neg_text, _ = model.itm_logits(ids[neg_t], None, out.video_embeds)
    logits = torch.cat([pos, text_neg_video, video_neg_text]).double()
    labels = torch.tensor([1] * 4 + [0] * 8)
    torch.testing.assert_close(out.loss_vtm.double(), F.cross_entropy(logits, labels), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, out.loss_vtc + out.loss_vtm)
    # The sampling weights put zero mass on same-id pairs and follow softmax(sim / temp) elsewhere.
    w_v2t, w_t2v = model.hard_negative_weights(video, text, video_ids)
    same = video_ids[:, None] == video_ids[None]
    assert w_v2t[same].eq(0).all() and w_t2v[same].eq(0).all()
    torch.testing.assert_close(w_v2t[~same], (video @ text.T / model.temp).softmax(1)[~same])


def test_vtm_needs_a_negative_and_ids_are_validated():
    model = _retrieval().train()
    ids, clips = text_ids(2, 5), videos(2)
    with pytest.raises(ValueError, match="hard negative"):
        model(ids, clips, return_loss=True, video_ids=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="video_ids"):
        model(ids, clips, return_loss=True, video_ids=torch.tensor([1, -2]))
    with pytest.raises(ValueError, match="texts and"):
        model.eval()(ids, videos(3))


def test_training_step_and_gradient_checkpointing_give_equal_gradients():
    """One VTC + VTM step with activation checkpointing gives the same loss and gradients as without."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = _retrieval().train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.vision_model.layers[0].gradient_checkpointing
            assert model.text_encoder.encoder.layer[0].gradient_checkpointing
        model.sample_hard_negatives = lambda weights: weights.argmax(dim=1)  # deterministic negatives
        out = model(text_ids(3, 6), videos(3), return_loss=True)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        # The momentum encoder is frozen and the whole online model is trained.
        assert not any(n.startswith("momentum.") for n in grads[-1])
        assert any(n.startswith("vision_model.layers.0.temporal") for n in grads[-1])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------- pre-training head


def test_pretraining_losses_sharing_and_static_images():
    model = randomize(TestaForPreTraining(tiny_config(label_smoothing=0.1))).train()
    encoder, decoder = model.text_encoder, model.text_decoder.bert
    # BLIP's sharing: everything but self-attention.
    assert decoder.embeddings is encoder.embeddings
    for enc, dec in zip(encoder.encoder.layer, decoder.encoder.layer):
        assert dec.crossattention is enc.crossattention and dec.intermediate is enc.intermediate
        assert dec.output is enc.output and dec.attention is not enc.attention
    assert model.text_decoder.cls.predictions.decoder.weight is encoder.embeddings.word_embeddings.weight

    ids = text_ids(3, 6, seed=17, pad_to=7)
    mask = ids.ne(PAD).long()
    images = torch.randn(3, 3, 32, 32)
    model.sample_hard_negatives = lambda weights: weights.argmax(dim=1)
    out = model(ids, images, attention_mask=mask)
    expected_cap = _smoothed_nll_float64(out.caption_logits, ids, mask, 0.1).sum() / mask[:, 1:].sum()
    torch.testing.assert_close(out.loss_cap.double(), expected_cap, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, out.loss_vtc + out.loss_vtm + out.loss_cap)
    out.loss.backward()
    # An image is a static video of vision_config.num_frames frames.
    model.eval()
    with torch.no_grad():
        as_video = model(ids, images[:, None].expand(-1, 8, -1, -1, -1), attention_mask=mask, return_loss=False)
        as_image = model(ids, images, attention_mask=mask, return_loss=False)
    torch.testing.assert_close(as_image.caption_logits, as_video.caption_logits)
    captions = model.generate(images, max_new_tokens=4)
    assert captions.shape[0] == 3 and captions[:, 0].eq(DEC).all()


# ------------------------------------------------------------------------------------------------------ plumbing


@pytest.mark.parametrize("head", [TestaForVideoTextRetrieval, TestaForVideoQA, TestaForPreTraining])
def test_save_load_round_trip_and_dtype_auto(head, tmp_path):
    model = randomize(head(tiny_config())).eval()
    ids, clips = text_ids(2, 6, seed=18), videos(2, seed=19)
    answers = text_ids(2, 4, seed=20)

    def outputs(m):
        with torch.no_grad():
            if head is TestaForVideoQA:
                return m(ids, clips, labels=answers).logits
            if head is TestaForPreTraining:
                return m(ids, clips, return_loss=False).caption_logits
            return m(ids, clips).itm_score

    reference = outputs(model)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith("momentum.") or "queue" in k for k in saved)  # training state is not in checkpoints
    reloaded, info = head.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(outputs(reloaded.eval()), reference)
    if head is not TestaForVideoQA:
        assert not bool(reloaded.momentum.initialized)  # re-synchronised at the first training step
        assert not any(p.requires_grad for p in reloaded.momentum.vision_model.parameters())
        torch.testing.assert_close(reloaded.temp.detach(), model.temp.detach())
    if head is TestaForPreTraining:
        assert reloaded.text_decoder.bert.embeddings is reloaded.text_encoder.embeddings
        assert reloaded.text_decoder.cls.predictions.decoder.weight is reloaded.text_encoder.embeddings.word_embeddings.weight

    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    auto = head.from_pretrained(tmp_path / "bf16", dtype="auto").eval()
    assert auto.vision_model.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    assert auto.text_encoder.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    error = (outputs(auto).float() - reference).abs().max() / reference.abs().max()
    assert error < 0.05  # bf16 keeps ~3 significant digits; through a few layers a few percent of the range


def test_generation_config_does_not_take_the_contrastive_temperature():
    model = TestaForVideoQA(tiny_config(temperature=0.05))
    assert model.generation_config.temperature != 0.05
    assert model.generation_config.bos_token_id == DEC


def test_inputs_are_validated():
    model = _retrieval()
    ids, clips = text_ids(2, 5), videos(2)
    with torch.no_grad():  # return_dict=False gives the output as a tuple (can_return_tuple)
        torch.testing.assert_close(model(ids, clips, return_dict=False)[0], model(ids, clips).itm_score)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([1, 2, 3]), videos(1))
    with pytest.raises(ValueError, match="itm_score"):
        model.rank_videos(text_ids(1, 4), torch.zeros(2, 5, 32), itm_score="probability")
    with pytest.raises(ValueError, match="pixel_values"):
        model(text_ids(1, 4), torch.zeros(1, 8, 3, 30, 32))


# ------------------------------------------------------------------------------------------- transformers conventions


@pytest.mark.parametrize("head", [TestaForVideoTextRetrieval, TestaForVideoQA, TestaForPreTraining])
def test_main_input_name_is_the_first_argument_of_forward(head):
    import inspect

    from modeling_testa import TestaVisionModel

    for model_class in (head, TestaVisionModel):
        first = list(inspect.signature(model_class.forward).parameters)[1]
        assert model_class.main_input_name == first, model_class


def test_feature_methods_return_model_outputs_like_clip_and_blip():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    model = _retrieval()
    ids, clips = text_ids(3, 7), videos(2, seed=1)
    text = model.get_text_features(ids, output_hidden_states=True)
    assert isinstance(text, BaseModelOutputWithPooling)
    states = model.text_encoder(input_ids=ids).last_hidden_state
    torch.testing.assert_close(text.pooler_output, F.normalize(model.text_proj(states[:, 0]), dim=-1))
    torch.testing.assert_close(text.last_hidden_state, states)
    assert len(text.hidden_states) == model.config.text_config.num_hidden_layers + 1
    as_tuple = model.get_text_features(ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[1], text.pooler_output)

    video = model.get_video_features(clips, output_hidden_states=True)
    tokens = model.vision_model(clips).last_hidden_state
    torch.testing.assert_close(video.pooler_output, F.normalize(model.vision_proj(tokens.mean(dim=1)), dim=-1))
    torch.testing.assert_close(video.last_hidden_state, tokens)
    assert len(video.hidden_states) == model.config.vision_config.num_hidden_layers + 1
    as_tuple = model.get_video_features(clips, return_dict=False)
    assert torch.equal(as_tuple[0], video.last_hidden_state) and torch.equal(as_tuple[1], video.pooler_output)


def test_feature_methods_follow_the_config_flags_and_return_attentions():
    """`output_hidden_states=None` means "as the config says" (transformers' rule), and attentions come back too."""
    model = _retrieval()
    ids, clips = text_ids(2, 6), videos(2, seed=2)
    assert model.get_text_features(ids).hidden_states is None
    for sub in (model.config.text_config, model.config.vision_config):
        sub.output_hidden_states = True
    text, video = model.get_text_features(ids), model.get_video_features(clips)
    assert len(text.hidden_states) == model.config.text_config.num_hidden_layers + 1
    assert len(video.hidden_states) == model.config.vision_config.num_hidden_layers + 1
    text = model.get_text_features(ids, output_attentions=True)
    reference = model.text_encoder(input_ids=ids, output_attentions=True).attentions
    assert len(text.attentions) == len(reference) and all(torch.equal(a, b) for a, b in zip(text.attentions, reference))
    video = model.get_video_features(clips, output_attentions=True)
    reference = model.vision_model(clips, output_attentions=True).attentions
    assert all(torch.equal(a, b) for a, b in zip(video.attentions, reference))
    out = model(text_ids(2, 6), clips, output_attentions=True)
    assert all(torch.equal(a, b) for a, b in zip(out.vision_attentions, reference))
    assert len(out.vision_temporal_attentions) == model.config.vision_config.num_hidden_layers


@pytest.mark.parametrize("head", [TestaForVideoTextRetrieval, TestaForPreTraining])
def test_loading_is_deterministic_and_init_weights_rebuilds_the_buffers_of_init(head, tmp_path):
    """Training state is not saved: what `from_pretrained` returns for it is fixed (empty queues, momentum copies
    equal to the online weights), so two loads are identical; `_init_weights` on the meta device gives the buffers
    of `__init__`."""
    from transformers import PreTrainedModel

    model = randomize(head(tiny_config()))
    model.save_pretrained(tmp_path)
    first, second = head.from_pretrained(tmp_path), head.from_pretrained(tmp_path)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    for online, copy in ((first.vision_model, first.momentum.vision_model), (first.text_proj, first.momentum.text_proj)):
        for p, p_m in zip(online.parameters(), copy.parameters()):
            assert torch.equal(p, p_m)
    assert not first.momentum.video_queue.any() and (first.momentum.idx_queue == -100).all()

    original = PreTrainedModel._initialize_weights
    PreTrainedModel._initialize_weights = lambda *args, **kwargs: None
    try:
        from_init = head(tiny_config())  # buffers as the modules' __init__ define them
    finally:
        PreTrainedModel._initialize_weights = original
    with torch.device("meta"):
        from_meta = head(tiny_config())
    from_meta.to_empty(device="cpu")
    from_meta.init_weights()
    buffers = dict(from_meta.named_buffers())
    for name, buffer in from_init.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def test_start_momentum_fills_the_queues_and_copies_the_weights_once():
    model = _retrieval()
    with torch.no_grad():
        model.vision_proj.weight.add_(1.0)  # the copies no longer equal the online weights
    model.start_momentum()
    queue = model.momentum.video_queue.clone()
    torch.testing.assert_close(queue.norm(dim=0), torch.ones(queue.shape[1]))
    assert torch.equal(model.momentum.vision_proj.weight, model.vision_proj.weight)
    model.start_momentum()  # started: nothing changes
    assert torch.equal(model.momentum.video_queue, queue)


@pytest.mark.parametrize("head", [TestaForVideoTextRetrieval, TestaForPreTraining])
def test_keys_to_ignore_on_load_missing_match_the_training_state_only(head):
    import re

    model = head(tiny_config())
    saved_keys = set(model.state_dict())
    non_persistent = {name for name, _ in model.named_buffers()} - saved_keys
    ignored = {k for k in saved_keys | non_persistent for p in model._keys_to_ignore_on_load_missing if re.search(p, k)}
    assert ignored == {k for k in saved_keys if k.startswith("momentum.")}
    assert "momentum.text_encoder.embeddings.position_ids" in non_persistent


@pytest.mark.parametrize("head", [TestaForVideoTextRetrieval, TestaForVideoQA, TestaForPreTraining])
def test_resize_below_the_special_tokens_is_refused_and_above_keeps_working(head):
    model = randomize(head(tiny_config())).eval()
    with pytest.raises(ValueError, match=r"\[ENC\] = 119 and \[DEC\] = 118"):
        model.resize_token_embeddings(100)
    assert model.get_input_embeddings().num_embeddings == 120  # unchanged
    model.resize_token_embeddings(125)
    assert model.get_input_embeddings().num_embeddings == 125
    ids, clips = text_ids(2, 6), videos(2)
    with torch.no_grad():
        if head is TestaForVideoQA:
            assert torch.isfinite(model(ids, clips, labels=text_ids(2, 4, seed=2)).logits).all()
        else:
            assert torch.isfinite(model(ids, clips, return_loss=False).itm_score).all()
