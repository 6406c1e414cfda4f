"""The moment retrieval `evaluate` module (train/metrics/moment_retrieval) and moment evaluation straight from the
ActivityNet Captions and DiDeMo builders' rows (train/moment_evaluation.py).

Expected values are worked out by hand in the comments, or re-computed in plain Python (fractions) per query.
"""

import json
import os
import random
from fractions import Fraction
from pathlib import Path

import pytest
from helpers.requirements import require


evaluate = require("evaluate")

METRICS = Path(__file__).resolve().parents[1] / "train" / "metrics"


@pytest.fixture(scope="module")
def moments():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by conftest: nothing may come from the Hub
    return evaluate.load(str(METRICS / "moment_retrieval"))


def test_hand_worked_r1_at_iou_and_miou(moments):
    predictions = [
        [[0, 10]],  # exact: IoU 1
        [[5, 15]],  # vs [0, 10]: overlap 5, span 15 -> 1/3
        [[2, 12]],  # vs [0, 10]: overlap 8, span 12 -> 2/3
        [[20, 30], [0, 10]],  # top-1 disjoint from [0, 10]: IoU 0 (the exact second one does not count for R1)
        [[0, 20]],  # vs [5, 10]: overlap 5, span 20 -> 1/4
    ]
    references = [[0, 10], [0, 10], [0, 10], [0, 10], [5, 10]]
    result = moments.compute(predictions=predictions, references=references, map_thresholds=None)
    # IoUs 1, 1/3, 2/3, 0, 1/4: >= 0.3: 3 of 5; >= 0.5: 2; >= 0.7: 1
    assert result == pytest.approx({"R1@0.3": 60.0, "R1@0.5": 40.0, "R1@0.7": 20.0,
                                    "mIoU": 100 * (1 + 1 / 3 + 2 / 3 + 0 + 1 / 4) / 5, "num_queries": 5})


def test_threshold_is_inclusive_and_touching_moments_do_not_overlap(moments):
    # [0, 10] vs [5, 15]... IoU exactly 1/2 with [0, 10] vs [0, 20]; touching [10, 20] vs [0, 10]: IoU 0
    result = moments.compute(predictions=[[[0, 20]], [[10, 20]]], references=[[0, 10], [0, 10]],
                             iou_thresholds=[0.5], map_thresholds=None)
    assert result["R1@0.5"] == 50.0 and result["mIoU"] == 25.0


def test_recall_at_k_uses_the_best_of_the_top_k(moments):
    predictions = [[[20, 30], [0, 10], [0, 9]], [[20, 30], [40, 50], [0, 10]]]
    result = moments.compute(predictions=predictions, references=[[0, 10], [0, 10]], ks=[1, 2, 3],
                             iou_thresholds=[0.7], map_thresholds=None)
    assert (result["R1@0.7"], result["R2@0.7"], result["R3@0.7"]) == (0.0, 50.0, 100.0)


def test_map_is_one_over_the_rank_of_the_first_match_per_threshold(moments):
    # Query 0 vs [0, 10]: [0, 8] IoU 0.8, then [0, 10] IoU 1.
    #   thresholds 0.50..0.80 (7 of them): first match at rank 1 -> AP 1; 0.85..0.95 (3): rank 2 -> AP 1/2
    # Query 1 vs [0, 10]: [20, 30] IoU 0, then [0, 6] IoU 0.6: 0.50..0.60 (3): rank 2 -> 1/2; above: never -> 0
    predictions = [[[0, 8], [0, 10]], [[20, 30], [0, 6]]]
    result = moments.compute(predictions=predictions, references=[[0, 10], [0, 10]])
    query0 = (7 * 1 + 3 * 0.5) / 10
    query1 = (3 * 0.5) / 10
    assert result["mAP"] == pytest.approx(100 * (query0 + query1) / 2)
    assert result["mAP@0.5"] == pytest.approx(100 * (1 + 0.5) / 2)
    assert result["mAP@0.75"] == pytest.approx(100 * (1 + 0) / 2)


def test_video_corpus_mode_needs_the_right_video(moments):
    predictions = [[[0, 10], [0, 10]], [[0, 10]], [[50, 60], [0, 10], [3, 9]]]
    videos = [["b", "a"], ["a"], ["c", "c", "a"]]
    result = moments.compute(predictions=predictions, references=[[0, 10]] * 3, predicted_videos=videos,
                             reference_videos=["a", "a", "a"], video_ks=[1, 2], map_thresholds=[0.5])
    # top-1 IoUs: 0 (video b), 1, 0 (video c); distinct-video ranks of "a": 1, 0, 1
    assert (result["R1@0.3"], result["mIoU"]) == pytest.approx((100 / 3, 100 / 3))
    assert (result["video_R@1"], result["video_R@2"]) == pytest.approx((100 / 3, 100.0))
    # mAP@0.5: first match ranks 2, 1, 3 ([0, 10] in c is not a match, [3, 9] in a has IoU 0.6)
    assert result["mAP@0.5"] == pytest.approx(100 * (1 / 2 + 1 + 1 / 3) / 3)


def test_no_prediction_is_a_miss(moments):
    result = moments.compute(predictions=[[], [[0, 10]]], references=[[0, 10], [0, 10]], map_thresholds=None)
    assert (result["R1@0.7"], result["mIoU"]) == (50.0, 50.0)


@pytest.mark.parametrize(
    "predictions, references, options, message",
    [
        ([], [], {}, "empty"),
        ([[[0, 1]]], [[0, 1], [0, 2]], {}, r"number of predictions \(1\) and references \(2\)"),
        ([[[0, 1]]], [[3, 3]], {}, r"Query 0: the reference moment \[3.0, 3.0\] has no length"),
        ([[[5, 1]]], [[0, 1]], {}, r"Query 0: `predictions` has a moment ending before it starts: \[5.0, 1.0\]"),
        ([[[0, float("nan")]]], [[0, 1]], {}, "non-finite"),
        ([[[0, 1]]], [[0, 1]], {"iou_thresholds": [0]}, r"iou_thresholds.*\(0, 1\]"),
        ([[[0, 1]]], [[0, 1]], {"predicted_videos": [["a"]]}, "both `predicted_videos` and `reference_videos`"),
        ([[[0, 1]]], [[0, 1]], {"predicted_videos": [["a", "b"]], "reference_videos": ["a"]},
         "Query 0: 1 predicted moments but 2 predicted videos"),
    ],
)
def test_bad_input_raises_a_clear_error(moments, predictions, references, options, message):
    with pytest.raises(ValueError, match=message):
        moments.compute(predictions=predictions, references=references, **options)


def _fraction_iou(prediction, reference):
    (s, e), (rs, re_) = [map(Fraction, prediction), map(Fraction, reference)]
    overlap = max(Fraction(0), min(e, re_) - max(s, rs))
    return overlap / (max(e, re_) - min(s, rs))


def test_equals_an_exact_recomputation_on_random_moments(moments):
    rng = random.Random(0)
    predictions, references = [], []
    for _ in range(60):
        start = rng.randrange(0, 100)
        references.append([start, start + rng.randrange(1, 40)])
        ranked = []
        for _ in range(rng.randrange(1, 5)):
            s = rng.randrange(0, 120)
            ranked.append([s, s + rng.randrange(0, 40)])  # zero-length predictions included
        predictions.append(ranked)
    result = moments.compute(predictions=predictions, references=references, ks=[1, 3])
    ious = [[_fraction_iou(p, r) for p in ranked] for ranked, r in zip(predictions, references)]
    for m in (Fraction(3, 10), Fraction(1, 2), Fraction(7, 10)):
        assert result[f"R1@{float(m):g}"] == pytest.approx(100 * sum(q[0] >= m for q in ious) / 60)
        assert result[f"R3@{float(m):g}"] == pytest.approx(100 * sum(max(q[:3]) >= m for q in ious) / 60)
    assert result["mIoU"] == pytest.approx(100 * float(sum(q[0] for q in ious)) / 60)
    thresholds = [Fraction(50 + 5 * i, 100) for i in range(10)]
    ap = [sum(next((Fraction(1, r + 1) for r, v in enumerate(q) if v >= m), Fraction(0)) for q in ious) / 60
          for m in thresholds]
    assert result["mAP"] == pytest.approx(100 * float(sum(ap)) / 10)


# ------------------------------------------------------------------------------------------------ builder rows


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_activitynet_release_rows_become_one_query_per_sentence_and_score(tmp_path):
    from processing.builders import build
    from train.moment_evaluation import evaluate_moment_search, moment_queries

    ann, vids = tmp_path / "captions", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    val_1 = {
        "v_a": {"duration": 55.0, "timestamps": [[13.5, 54.0], [0.5, 60.0]],
                "sentences": ["Coach helps.", "A tutorial."]},
        "v_b": {"duration": 120, "timestamps": [[0, 30], [130, 140]], "sentences": ["A guy exercises.", "After end."]},
    }
    for name in ("train.json", "val_1.json", "val_2.json"):
        (ann / name).write_text(json.dumps(val_1))
    for video in ("v_a", "v_b"):
        (vids / f"{video}.mp4").write_bytes(b"\x00")
    build("activitynet", str(ann), str(vids), str(tmp_path / "out"), splits=["test"], progress=False)
    rows = _read_jsonl(tmp_path / "out" / "test.jsonl")

    built = moment_queries(rows)
    a, b = str(vids / "v_a.mp4"), str(vids / "v_b.mp4")
    # time order (the builder's default): v_a's [0.5, 60] first, clipped to its 55 s; v_b's [130, 140] lies after its
    # 120 s: no length left, skipped
    assert [(q.text, q.video, q.start, q.end) for q in built.queries] == [
        ("A tutorial.", a, 0.5, 55.0), ("Coach helps.", a, 13.5, 54.0), ("A guy exercises.", b, 0.0, 30.0)]
    assert built.skipped == [(1, 1, "moment [130.0, 140.0] has no length within the video's 120 s")]

    answers = {
        "A tutorial.": [{"video": a, "start": None, "end": None, "score": 0.9}],  # whole video [0, 55]: IoU 54.5/55
        "Coach helps.": [{"video": b, "start": 10.0, "end": 50.0, "score": 0.8},  # wrong video first
                         {"video": a, "start": 10.0, "end": 50.0, "score": 0.7}],
        "A guy exercises.": [{"video": b, "start": 0.0, "end": 20.0, "score": 0.6}],  # IoU 20/30
    }
    asked = []

    def search(texts):
        asked.extend(texts)
        return [answers[t] for t in texts]

    scores = evaluate_moment_search(rows, search, video_ks=[1, 2])
    assert asked == ["A tutorial.", "Coach helps.", "A guy exercises."]
    # top-1 IoUs: 54.5/55, 0 (other video), 2/3
    assert scores["R1@0.5"] == pytest.approx(200 / 3) and scores["R1@0.7"] == pytest.approx(100 / 3)
    assert scores["mIoU"] == pytest.approx(100 * (54.5 / 55 + 2 / 3) / 3)
    assert (scores["video_R@1"], scores["video_R@2"]) == pytest.approx((200 / 3, 100.0))
    assert scores["num_skipped"] == 1 and scores["num_queries"] == 3


def test_didemo_release_rows_use_the_annotators_mean_times(tmp_path):
    from processing.builders import build
    from train.moment_evaluation import moment_queries

    ann, vids = tmp_path / "LocalizingMoments" / "data", tmp_path / "videos"
    ann.mkdir(parents=True)
    vids.mkdir()
    name = "11@N00_100_aaa.mp4"
    record = {"video": name, "dl_link": "https://www.flickr.com/photos/11@N00/100/", "num_segments": 6}
    release = [dict(record, annotation_id=1, description="dog rolls over", times=[[2, 2], [2, 3], [3, 3], [2, 3]]),
               dict(record, annotation_id=2, description="dog sits", times=[[0, 0], [0, 0], [0, 1], [0, 0]])]
    (ann / "test_data.json").write_text(json.dumps(release))
    (vids / (name + ".mp4")).write_bytes(b"\x00")
    build("didemo", str(ann.parent), str(vids), str(tmp_path / "out"), splits=["test"], progress=False)
    built = moment_queries(_read_jsonl(tmp_path / "out" / "test.jsonl"))
    # dog sits: firsts 0 -> 0 s, lasts mean 0.25 -> 5 * 1.25 = 6.25 s; rolls over: firsts mean 2.25 -> 11.25 s,
    # lasts mean 2.75 -> 5 * 3.75 = 18.75 s (no duration in DiDeMo rows: not clipped)
    assert [(q.text, q.start, q.end, q.duration) for q in built.queries] == [
        ("dog sits", 0.0, 6.25, None), ("dog rolls over", 11.25, 18.75, None)]


def test_rows_without_timestamps_are_refused_by_name():
    from train.moment_evaluation import moment_queries

    with pytest.raises(ValueError, match=r"Row 0 has no 'timestamps'.*'sentences' and 'timestamps'"):
        moment_queries([{"video": "x.mp4", "text": "a paragraph", "sentences": ["a paragraph"]}])


def test_the_command_indexes_windows_and_scores_every_sentence(tmp_path, capsys):
    from helpers.pipelines import build_retrieval, save_folder, tiny_processor

    from modeling_testa import VideoTextRetrievalPipeline
    from processing.long_videos import generate_long_videos_dataset
    from train.moment_evaluation import main, moment_queries, score_moment_search

    rows = generate_long_videos_dataset(str(tmp_path / "data"), num_videos=2, minutes=1.5, events_per_video=2)
    model = save_folder(build_retrieval(), tiny_processor(), tmp_path / "model")
    scores = main(["--data", str(tmp_path / "data"), "--model", str(model), "--window", "30", "--stride", "15",
                   "--top-k", "5", "--save-index", str(tmp_path / "index")])
    assert json.loads(capsys.readouterr().out) == scores
    # the same numbers by hand: the saved index of moments searched with each sentence
    from testa_search.index import VideoIndex

    index = VideoIndex.load(tmp_path / "index")
    assert len(set(index.names)) == 2 and len(index) == 2 * 5  # 90 s in 30 s windows every 15 s: 5 each
    pipe = VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")
    queries = moment_queries([dict(r, video=str(tmp_path / "data" / r["video"])) for r in rows]).queries
    expected = score_moment_search(queries, pipe.search([q.text for q in queries], index, top_k=5))
    assert scores == {**expected, "num_skipped": 0, "num_videos_failed": 0}
