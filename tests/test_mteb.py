"""MTEB 2 on a local split in the builders' format, offline, videos decoded by TESTA's processor (no torchcodec).

Reference: the library's own metric module (`train/metrics/video_text_retrieval`, through `train.evaluation`) on the
cosine scores of `get_text_features`/`get_video_features`, and, for re-ranking, `rank_videos` on the candidates."""

import json

import pytest
import torch
from helpers.pipelines import build_retrieval, save_folder, tiny_processor
from helpers.videos import write_noise_video
from helpers.requirements import require

from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.cross_encoder import save_cross_encoder

mteb = require("mteb")  # the `mteb` extra, installed by `make test`
sentence_transformers = require("sentence_transformers")

from train.evaluation import load_metric  # noqa: E402
from train.mteb_evaluation import (  # noqa: E402
    TestaMTEBCrossEncoder,
    TestaMTEBEncoder,
    first_stage_top_k,
    local_retrieval_task,
)

NUM = 8
CAPTIONS = [f"clip {i}: {'red green blue yellow white black pink gray'.split()[i]} squares flash" for i in range(NUM)]
CAPTIONS.append("a second caption of clip 0: squares flash on red")  # a video with two texts (v2t: two positives)
VIDEO_OF = list(range(NUM)) + [0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mteb")
    model, processor = build_retrieval(), tiny_processor()
    bi = save_folder(model, processor, root / "bi")
    ce = save_cross_encoder(model, processor, root / "ce")
    data = root / "data"
    with open(data.mkdir() or data / "test.jsonl", "w") as handle:
        for i in range(NUM):
            write_noise_video(data / "videos" / f"clip{i}.mp4", seed=50 + i)
        for caption, video in zip(CAPTIONS, VIDEO_OF):
            handle.write(json.dumps({"video": f"videos/clip{video}.mp4", "text": caption}) + "\n")
    return root, bi, ce, data


def cosine_scores(folder, data):
    model, processor = TestaForVideoTextRetrieval.from_pretrained(folder).eval(), tiny_processor()
    videos = [str(data / "videos" / f"clip{i}.mp4") for i in range(NUM)]
    with torch.no_grad():
        encoded = processor(text=CAPTIONS)
        text = model.get_text_features(encoded["input_ids"], encoded["attention_mask"]).pooler_output
        pixels = torch.cat([processor(videos=[v])["pixel_values"] for v in videos])
        tokens = model.get_video_tokens(pixels).last_hidden_state
        video = model.get_video_features(video_tokens=tokens).pooler_output
    return model, encoded, tokens, (text @ video.T).double()


def mteb_scores(model, task):
    result = mteb.evaluate(model, task, cache=None, show_progress_bar=False)
    return result.task_results[0].scores["test"][0]


def test_mteb_metrics_equal_the_library_metric_module_both_ways(setup):
    _, bi, _, data = setup
    encoder = TestaMTEBEncoder(sentence_transformers.SentenceTransformer(str(bi), trust_remote_code=True))
    assert encoder.mteb_model_meta.modalities == ["text", "video"]
    _, _, _, similarity = cosine_scores(bi, data)
    metric = load_metric("video_text_retrieval")
    t2v_positives = [[video] for video in VIDEO_OF]
    v2t_positives = [[t for t, video in enumerate(VIDEO_OF) if video == v] for v in range(NUM)]
    for direction, scores, positives in (("t2v", similarity, t2v_positives), ("v2t", similarity.T, v2t_positives)):
        ours = metric.compute(predictions=scores.tolist(), references=positives, return_ranks=True)
        got = mteb_scores(encoder, local_retrieval_task(str(data), direction=direction))
        for k in (1, 5, 10):  # the library's R@K: the best positive in the top K, MTEB's hit rate
            # MTEB rounds its scores to 5 decimals
            assert got[f"hit_rate_at_{k}"] * 100 == pytest.approx(ours[f"R@{k}"], abs=1e-3), (direction, k)
        mrr = sum(1 / (r + 1) for r in ours["ranks"] if r < 10) / len(positives)
        assert got["mrr_at_10"] == pytest.approx(mrr, abs=1e-5), direction


def test_mteb_re_ranking_equals_rank_videos_on_the_first_stage_candidates(setup):
    _, bi, ce, data = setup
    encoder = TestaMTEBEncoder(sentence_transformers.SentenceTransformer(str(bi), trust_remote_code=True))
    task = local_retrieval_task(str(data), direction="t2v")
    k = 3
    top = first_stage_top_k(encoder, task, k)
    model, encoded, tokens, similarity = cosine_scores(bi, data)
    expected_top = torch.sort(similarity, dim=1, descending=True, stable=True).indices[:, :k]
    assert [top[f"t{i}"] for i in range(len(CAPTIONS))] == [[f"v{j}" for j in row] for row in expected_top.tolist()]

    reranker = TestaMTEBCrossEncoder(sentence_transformers.CrossEncoder(str(ce), trust_remote_code=True))
    got = mteb_scores(reranker, local_retrieval_task(str(data), direction="t2v", top_ranked=top, name="rerank"))
    ranking = model.rank_videos(encoded["input_ids"], tokens, attention_mask=encoded["attention_mask"], k=k)
    best = ranking.scores.argmax(dim=1)  # the re-ranked top 1 of every query
    hits = (best == torch.tensor(VIDEO_OF)).double().mean().item()
    assert got["hit_rate_at_1"] == pytest.approx(hits, abs=1e-5)
    assert reranker.model[0].videos_encoded <= NUM  # every candidate video decoded once over all queries
