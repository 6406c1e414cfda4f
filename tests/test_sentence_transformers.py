"""TESTA in Sentence Transformers 6: a `save_pretrained` folder as a bi-encoder, the matching head as a `CrossEncoder`.

References: the model's own `get_text_features`/`get_video_features` and `rank_videos` on the same inputs; the files
written; counted decoder calls."""

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.pipelines import build_retrieval, save_folder, tiny_processor, write_bad_files
from helpers.videos import write_noise_video
from helpers.requirements import require

from modeling_testa import TestaForVideoTextRetrieval, TestaVideoProcessor
from modeling_testa.cross_encoder import save_cross_encoder
from modeling_testa.saving import MODEL_CARD_MARKER

sentence_transformers = require("sentence_transformers")  # the `st` extra, installed by `make test`

QUERIES = ["first the screen is red. a blue square flashes.", "green blocks", "a dog catches a frisbee"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    model, processor = build_retrieval(), tiny_processor()
    bi = save_folder(model, processor, root / "bi")
    ce = save_cross_encoder(model, processor, root / "ce")
    videos = [str(write_noise_video(root / "videos" / f"clip{i}.mp4", seed=i)) for i in range(6)]
    return root, bi, ce, videos


def reference_features(folder: Path, texts: list[str], videos: list[str], **text_kwargs):
    model, processor = TestaForVideoTextRetrieval.from_pretrained(folder).eval(), tiny_processor()
    with torch.no_grad():
        encoded = processor(text=texts, **text_kwargs)
        text = model.get_text_features(encoded["input_ids"], encoded["attention_mask"]).pooler_output
        pixels = torch.cat([processor(videos=[v])["pixel_values"] for v in videos])
        video = model.get_video_features(pixels).pooler_output
    return text, video


def test_save_pretrained_writes_a_bi_encoder_that_transformers_still_loads(folders):
    _, bi, _, _ = folders
    modules = json.loads((bi / "modules.json").read_text())
    assert modules[0]["type"] == "sentence_transformers.base.modules.transformer.Transformer"
    config = json.loads((bi / "sentence_bert_config.json").read_text())
    assert config["modality_config"] == {
        "text": {"method": "get_text_features", "method_output_name": "pooler_output"},
        "video": {"method": "get_video_features", "method_output_name": "pooler_output"},
    }
    assert json.loads((bi / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == "cosine"
    assert json.loads((bi / "tokenizer_config.json").read_text())["model_max_length"] == 64
    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(bi, trust_remote_code=True)
    assert type(loaded).__name__ == "TestaForVideoTextRetrieval"


def test_bi_encoder_embeddings_equal_the_feature_methods(folders):
    _, bi, _, videos = folders
    st = sentence_transformers.SentenceTransformer(str(bi), trust_remote_code=True)
    assert sorted(st.modalities) == ["text", "video"] and st.max_seq_length == 64
    queries = st.encode_query(QUERIES, convert_to_tensor=True)
    documents = st.encode_document([{"video": v} for v in videos], convert_to_tensor=True)
    text, video = reference_features(bi, QUERIES, videos)
    torch.testing.assert_close(queries, text, rtol=0, atol=1e-6)
    torch.testing.assert_close(documents, video, rtol=0, atol=1e-6)
    similarity = st.similarity(queries, documents)
    torch.testing.assert_close(similarity, text @ video.T, rtol=0, atol=1e-6)

    st.max_seq_length = 8  # settable below the model's limit: texts are truncated to 8 tokens
    long = ["one two three four five six seven eight nine ten eleven twelve"]
    truncated, _ = reference_features(bi, long, videos[:1], max_length=8)
    torch.testing.assert_close(st.encode_query(long, convert_to_tensor=True), truncated, rtol=0, atol=1e-6)


def test_a_video_path_never_becomes_a_text_embedding(folders, tmp_path):
    _, bi, _, videos = folders
    st = sentence_transformers.SentenceTransformer(str(bi), trust_remote_code=True)
    webm = tmp_path / "clip.webm"
    webm.write_bytes(Path(videos[0]).read_bytes())  # exists, but not an extension ST takes as video
    for path in ("nope/missing.mp4", str(webm)):
        with pytest.raises(ValueError, match="is a video file name, not text") as error:
            st.encode_document([path])
        assert path in str(error.value)
    with pytest.raises(FileNotFoundError, match="nope/missing.mp4"):
        st.encode_document([{"video": "nope/missing.mp4"}])
    bad = write_bad_files(tmp_path / "bad", videos[0])
    with pytest.raises(ValueError, match="truncated.mp4"):
        st.encode_document([{"video": bad["truncated"]}])


def test_sentence_transformers_save_keeps_from_pretrained_and_the_card(folders, tmp_path):
    _, bi, _, videos = folders
    st = sentence_transformers.SentenceTransformer(str(bi), trust_remote_code=True)
    st.save(str(tmp_path / "saved"))
    assert MODEL_CARD_MARKER in (tmp_path / "saved" / "README.md").read_text()
    reloaded = TestaForVideoTextRetrieval.from_pretrained(tmp_path / "saved")
    original = TestaForVideoTextRetrieval.from_pretrained(bi)
    for (name, a), b in zip(original.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    again = sentence_transformers.SentenceTransformer(str(tmp_path / "saved"), trust_remote_code=True)
    torch.testing.assert_close(again.encode_query(QUERIES, convert_to_tensor=True),
                               st.encode_query(QUERIES, convert_to_tensor=True), rtol=0, atol=0)


def test_cross_encoder_rank_equals_rank_videos_with_ties_and_decodes_each_video_once(folders):
    _, _, ce_folder, videos = folders
    ce = sentence_transformers.CrossEncoder(str(ce_folder), trust_remote_code=True)
    candidates = videos + [videos[2]]  # a repeated video: its two scores tie
    model, processor = TestaForVideoTextRetrieval.from_pretrained(ce_folder).eval(), tiny_processor()
    with torch.no_grad():
        tokens = torch.cat([model.get_video_tokens(processor(videos=[v])["pixel_values"]).last_hidden_state
                            for v in candidates])
    remote_class = type(ce[0].processor.video_processor)  # the Hub-code copy of TestaVideoProcessor
    assert remote_class.__name__ == TestaVideoProcessor.__name__
    with mock.patch.object(remote_class, "__call__", autospec=True, side_effect=remote_class.__call__) as decodes:
        for query in QUERIES:
            ranked = ce.rank(query, [{"video": v} for v in candidates])
            encoded = processor(text=[query])
            reference = model.rank_videos(encoded["input_ids"], tokens, attention_mask=encoded["attention_mask"],
                                          k=len(candidates)).scores[0]
            # stable: ties by index; the reference scores one batch, whose rows differ from the same row alone in
            # the last bits on some CPUs, so scores equal to 1e-5 (the tolerance below) count as tied
            expected = sorted(range(len(candidates)), key=lambda i: -round(reference[i].item(), 5))
            assert [r["corpus_id"] for r in ranked] == expected
            torch.testing.assert_close(torch.tensor([r["score"] for r in ranked]), reference[expected],
                                       rtol=0, atol=1e-5)
            tie = [r["corpus_id"] for r in ranked if r["corpus_id"] in (2, len(videos))]
            assert tie == [2, len(videos)]
    assert decodes.call_count == len(videos)  # N distinct videos, not Q x N
    assert ce[0].videos_encoded == len(videos)


def test_cross_encoder_pairs_in_either_order_and_save_round_trip(folders, tmp_path):
    _, _, ce_folder, videos = folders
    ce = sentence_transformers.CrossEncoder(str(ce_folder), trust_remote_code=True)
    forward = ce.predict([(QUERIES[0], {"video": videos[0]}), (QUERIES[1], videos[1])])
    backward = ce.predict([({"video": videos[0]}, QUERIES[0]), (videos[1], QUERIES[1])])
    torch.testing.assert_close(torch.tensor(forward), torch.tensor(backward), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        ce.predict([(QUERIES[0], "missing.mp4")])
    ce.save(str(tmp_path / "saved"))
    again = sentence_transformers.CrossEncoder(str(tmp_path / "saved"), trust_remote_code=True)
    torch.testing.assert_close(torch.tensor(again.predict([(QUERIES[0], {"video": videos[0]})])),
                               torch.tensor(forward[:1]), rtol=0, atol=1e-6)
