"""The heads own their generation and scoring: `generate` follows the head's `generation_config` (saved with the
model), the question answering pipeline generates through the head with the same settings and scores answers with
`answer_log_likelihoods`, `logit_scale` is the one clamped temperature, and ranking options are one frozen value.

References: a greedy decoding loop written out with the forward pass, float64 log-likelihoods recomputed from the
forward pass's logits, and the pipeline's documented defaults."""

import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from modeling_testa import TestaForPreTraining, TestaForVideoQA
from modeling_testa.pipeline_testa import (
    ANSWER_GENERATION_DEFAULTS,
    VideoQuestionAnsweringPipeline,
    ZeroShotVideoClassificationPipeline,
)
from modeling_testa.ranking import RankingOptions, two_stage_scores
from tests.helpers.models import randomize
from tests.helpers.pipelines import SIZE, TEXT, build_qa, build_retrieval, tiny_processor, tiny_testa_config, write_videos

QUESTIONS = ["what is on the screen?", "what colour is it?"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return write_videos(tmp_path_factory.mktemp("videos"))[:3]


@pytest.fixture(scope="module")
def processor():
    return tiny_processor()


def _decode(processor, sequences: torch.Tensor) -> list[str]:
    return [t.strip() for t in processor.tokenizer.decode(sequences.tolist(), skip_special_tokens=True)]


@torch.no_grad()
def test_generate_defaults_to_greedy_decoding_until_sep(processor, videos):
    model = build_qa()
    question = processor(text=QUESTIONS[:1])
    pixel_values = processor(videos=videos[0])["pixel_values"]
    generated = model.generate(question["input_ids"], pixel_values, question["attention_mask"])
    # reference: the forward pass, one argmax token at a time from [DEC], until [SEP] or 20 new tokens (transformers'
    # model-agnostic default length)
    sequence = torch.tensor([[model.config.dec_token_id]])
    while sequence.shape[1] < 21:
        logits = model(question["input_ids"], pixel_values, question["attention_mask"], decoder_input_ids=sequence).logits
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if int(sequence[0, -1]) == TEXT["sep_token_id"]:
            break
    assert torch.equal(generated, sequence)


@torch.no_grad()
def test_vqa_pipeline_answers_equal_generate_with_the_same_defaults(processor, videos):
    model = build_qa()
    pipe = VideoQuestionAnsweringPipeline(model=model, processor=processor, device="cpu")
    question = processor(text=QUESTIONS)
    pixel_values = processor(videos=videos[1])["pixel_values"].expand(2, -1, -1, -1, -1)
    assert ANSWER_GENERATION_DEFAULTS == {"num_beams": 3, "max_length": 10}  # the released code's settings

    # the model's generation config sets neither: the pipeline's defaults, i.e. generate(num_beams=3, max_length=10)
    results = pipe(video=videos[1], question=QUESTIONS)
    generated = model.generate(question["input_ids"], pixel_values, question["attention_mask"],
                               **ANSWER_GENERATION_DEFAULTS)
    assert [r[0]["answer"] for r in results] == _decode(processor, generated)
    # top_k answers: the top_k best beams, re-ordered by their likelihood
    two = pipe(video=videos[1], question=QUESTIONS[0], top_k=2)
    beams = model.generate(question["input_ids"][:1], pixel_values[:1], question["attention_mask"][:1],
                           num_return_sequences=2, **ANSWER_GENERATION_DEFAULTS)
    assert sorted(r["answer"] for r in two) == sorted(_decode(processor, beams))

    # settings in the model's generation config are the model's defaults and the pipeline's
    model.generation_config.num_beams = 2
    model.generation_config.max_new_tokens = 3
    results = pipe(video=videos[1], question=QUESTIONS)
    generated = model.generate(question["input_ids"], pixel_values, question["attention_mask"])
    assert generated.shape[1] <= 1 + 3
    assert [r[0]["answer"] for r in results] == _decode(processor, generated)
    assert torch.equal(generated, model.generate(question["input_ids"], pixel_values, question["attention_mask"],
                                                 num_beams=2, max_new_tokens=3))


@torch.no_grad()
def test_generation_config_is_saved_and_loaded_with_the_model(processor, videos, tmp_path):
    model = build_qa()
    model.generation_config.num_beams = 3
    model.generation_config.max_length = 10
    model.save_pretrained(tmp_path)
    loaded = TestaForVideoQA.from_pretrained(tmp_path).eval()
    assert (loaded.generation_config.num_beams, loaded.generation_config.max_length) == (3, 10)
    question = processor(text=QUESTIONS[:1])
    pixel_values = processor(videos=videos[2])["pixel_values"]
    expected = build_qa().generate(question["input_ids"], pixel_values, question["attention_mask"], num_beams=3,
                                   max_length=10)
    assert torch.equal(loaded.generate(question["input_ids"], pixel_values, question["attention_mask"]), expected)


@torch.no_grad()
def test_answer_log_likelihoods_equal_a_float64_recomputation(processor, videos):
    model = build_qa()
    question = processor(text=QUESTIONS)
    pixel_values = processor(videos=videos[0])["pixel_values"].expand(2, -1, -1, -1, -1)
    states, mask, _ = model.encode_question(question["input_ids"], pixel_values, question["attention_mask"])
    sep, pad = TEXT["sep_token_id"], TEXT["pad_token_id"]
    # [DEC] a b [SEP] [PAD] [PAD] and [DEC] c [SEP] d [SEP] e: tokens after the first [SEP] are not scored
    answers = torch.tensor([[model.config.dec_token_id, 2000, 2001, sep, pad, pad],
                            [model.config.dec_token_id, 2002, sep, 2003, sep, 2004]])
    got = model.answer_log_likelihoods(answers, states, mask)
    for row, length in ((0, 4), (1, 3)):
        sequence = answers[row : row + 1, :length]
        logits = model(question["input_ids"][row : row + 1], pixel_values[:1],
                       question["attention_mask"][row : row + 1], decoder_input_ids=sequence).logits.double()
        expected = logits[0, :-1].log_softmax(-1).gather(1, sequence[0, 1:, None]).sum()
        torch.testing.assert_close(got[row].double(), expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_pretraining_generate_follows_its_generation_config():
    torch.manual_seed(3)
    model = randomize(TestaForPreTraining(tiny_testa_config()), seed=3).eval()
    pixel_values = torch.randn(2, 4, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    model.generation_config.max_new_tokens = 2
    captions = model.generate(pixel_values)
    assert captions.shape[1] <= 3
    assert torch.equal(captions, model.generate(pixel_values, generation_config=GenerationConfig(max_new_tokens=2)))


@torch.no_grad()
def test_logit_scale_is_the_clamped_temperature_of_zero_shot_classification(processor, videos):
    model = build_retrieval()
    pipe = ZeroShotVideoClassificationPipeline(model=model, processor=processor, device="cpu")
    labels = ["surfing", "cooking", "a red car"]
    for temp, expected_scale in ((0.2, 0.2), (0.9, 0.5), (1e-5, 0.001)):
        model.temp.fill_(temp)
        assert float(model.logit_scale()) == pytest.approx(expected_scale)
        result = pipe(videos[0], candidate_labels=labels)
        text = processor(text=[f"a video of {label}." for label in labels])
        text_features = model.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output.double()
        video_features = model.get_video_features(processor(videos=videos[0])["pixel_values"]).pooler_output.double()
        probs = ((video_features @ text_features.T) / expected_scale).softmax(-1)[0]
        for item in result:
            assert item["score"] == pytest.approx(float(probs[labels.index(item["label"])]), abs=1e-5)
    assert float(model.temp) == pytest.approx(1e-5)  # inference does not change the parameter


def test_ranking_options_are_checked_frozen_and_passed_by_keyword():
    assert RankingOptions(k=4) == RankingOptions(k=4, itm_score="logit", add_cosine=True, batch_size=128)
    with pytest.raises(ValueError, match="itm_score='cosine'"):
        RankingOptions(k=4, itm_score="cosine")
    with pytest.raises(ValueError, match="`k` must be positive, got 0"):
        RankingOptions(k=0)
    with pytest.raises(ValueError, match="`batch_size` must be positive"):
        RankingOptions(k=1, batch_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RankingOptions(k=4).k = 5
    with pytest.raises(TypeError):
        two_stage_scores(None, True, None, None, None, None, None, RankingOptions(k=1))  # keyword arguments only
