"""The `evaluate` metric modules in train/metrics/: offline loading, hand-worked cases, a plain re-computation."""

import os
import random
import statistics
from pathlib import Path

import pytest
from helpers.requirements import require


evaluate = require("evaluate")

METRICS = Path(__file__).resolve().parents[1] / "train" / "metrics"


@pytest.fixture(scope="module")
def retrieval():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by conftest: nothing may come from the Hub
    return evaluate.load(str(METRICS / "video_text_retrieval"))


@pytest.fixture(scope="module")
def ranked_lists():
    return evaluate.load(str(METRICS / "video_text_retrieval"), "ranked_lists")


@pytest.fixture(scope="module")
def qa():
    return evaluate.load(str(METRICS / "video_qa_accuracy"))


# ------------------------------------------------------------------------------------------------ retrieval


def test_hand_worked_ranks_with_ties_against_the_query(retrieval):
    scores = [
        [0.9, 0.1, 0.3, 0.0],  # positive 0 is first: rank 1
        [0.2, 0.8, 0.8, 0.1],  # positive 2 ties with item 1: the tie counts against it, rank 2
        [0.5, 0.4, 0.3, 0.6],  # positive 2 is behind items 3, 0, 1: rank 4
    ]
    result = retrieval.compute(predictions=scores, references=[[0], [2], [2]], ks=[1, 2, 3])
    assert result["R@1"] == pytest.approx(100 / 3)
    assert result["R@2"] == pytest.approx(200 / 3)
    assert result["R@3"] == pytest.approx(200 / 3)
    assert result["median_rank"] == 2.0 and result["mean_rank"] == pytest.approx(7 / 3)
    assert result["R_mean"] == pytest.approx((100 / 3 + 400 / 3) / 3)
    assert result["num_queries"] == 3


def test_several_positives_use_the_best_one_and_never_count_against_it(retrieval):
    # Positives 1 and 2 (0.8, 0.8) tie with each other and sit behind item 0: rank 2 (only item 0 is above).
    result = retrieval.compute(predictions=[[0.9, 0.8, 0.8, 0.1]], references=[[1, 2]], ks=[1, 2])
    assert (result["R@1"], result["R@2"], result["median_rank"]) == (0.0, 100.0, 2.0)
    # The best of several positives counts: item 3 is first.
    assert retrieval.compute(predictions=[[0.2, 0.1, 0.0, 0.9]], references=[[0, 3]], ks=[1])["R@1"] == 100.0


def test_both_directions_are_prefixed_and_averaged(retrieval):
    t2v = [[0.9, 0.1], [0.3, 0.2]]  # query 1's positive (item 1) is second
    v2t = [[0.7, 0.1], [0.1, 0.7]]  # both first
    result = retrieval.compute(predictions=t2v, references=[[0], [1]], reverse_predictions=v2t,
                               reverse_references=[[0], [1]], ks=[1])
    assert (result["t2v_R@1"], result["v2t_R@1"]) == (50.0, 100.0)
    assert result["R_mean"] == 75.0 and result["t2v_median_rank"] == 1.5
    with pytest.raises(ValueError, match="reverse_predictions.*reverse_references"):
        retrieval.compute(predictions=t2v, references=[[0], [1]], reverse_predictions=v2t)


def test_ranked_lists_including_truncated_ones(ranked_lists):
    result = ranked_lists.compute(predictions=[[3, 0, 1, 2], [2, 1, 0, 3]], references=[[0], [2]], ks=[1, 2])
    assert (result["R@1"], result["R@2"], result["mean_rank"]) == (50.0, 100.0, 1.5)
    truncated = ranked_lists.compute(predictions=[[1, 2], [0, 5]], references=[[2], [9]], ks=[1, 2])
    assert (truncated["R@1"], truncated["R@2"]) == (0.0, 50.0)
    assert truncated["median_rank"] is None and truncated["num_unranked"] == 1
    with pytest.raises(ValueError, match=r"Query 1.*no positive among its 2 ranked items.*R@5"):
        ranked_lists.compute(predictions=[[1, 2], [0, 5]], references=[[2], [9]], ks=[1, 5])


@pytest.mark.parametrize(
    "predictions, references, message",
    [
        ([], [], "empty"),
        ([[0.1, 0.2]], [[]], "Query 0 .* no positive"),
        ([[0.1, 0.2]], [[2]], "outside the 2 scored items"),
        ([[0.1, 0.2], [0.3]], [[0], [0]], "same items"),
        ([[0.1, float("nan")]], [[0]], "NaN"),
    ],
)
def test_bad_input_raises_a_clear_error(retrieval, predictions, references, message):
    with pytest.raises(ValueError, match=message):
        retrieval.compute(predictions=predictions, references=references)


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="'scores'.*'ranked_lists'"):
        evaluate.load(str(METRICS / "video_text_retrieval"), "ranks")


def _plain_ranks(scores, positives):
    """Independent re-computation: sort the items best first, putting tied non-positives before a positive."""
    ranks = []
    for row, targets in zip(scores, positives):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i in targets))
        ranks.append(next(position for position, item in enumerate(order) if item in targets))
    return ranks


def test_equals_a_plain_recomputation_on_random_scores_with_ties(retrieval, ranked_lists):
    rng = random.Random(0)
    queries, items = 40, 25
    scores = [[rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) + (rng.random() if q % 2 else 0.0) for _ in range(items)]
              for q in range(queries)]  # even queries: heavy ties
    positives = [rng.sample(range(items), rng.choice([1, 1, 2, 3])) for _ in range(queries)]
    ranks = _plain_ranks(scores, positives)
    ks = (1, 5, 10)
    expected = {f"R@{k}": 100.0 * sum(r < k for r in ranks) / queries for k in ks}
    result = retrieval.compute(predictions=scores, references=positives, ks=ks)
    for k in ks:
        assert result[f"R@{k}"] == pytest.approx(expected[f"R@{k}"])
    assert result["median_rank"] == statistics.median(r + 1 for r in ranks)
    assert result["mean_rank"] == pytest.approx(statistics.mean(r + 1 for r in ranks))
    # The same rankings written as lists (ties broken against the query) give the same numbers.
    lists = [sorted(range(items), key=lambda i, row=row, t=t: (-row[i], i in t)) for row, t in zip(scores, positives)]
    assert ranked_lists.compute(predictions=lists, references=positives, ks=ks) == result


# ------------------------------------------------------------------------------------------------------- QA


def test_qa_exact_match_is_the_official_rule(qa):
    result = qa.compute(predictions=["yes", "Red", "2 ", "dog"], references=["yes", "red", "2", "dog"])
    assert result == {"accuracy": 50.0, "num_questions": 4}  # "Red" != "red", "2 " != "2": no normalisation
    relaxed = qa.compute(predictions=["yes", "Red", "2 ", "dog"], references=["yes", "red", "2", "dog"],
                         normalization="whitespace_lowercase")
    assert relaxed["accuracy"] == 100.0


def test_qa_per_type_accuracy_with_activitynet_names(qa):
    result = qa.compute(
        predictions=["walk", "left", "yes", "red", "blue"], references=["run", "left", "yes", "red", "green"],
        question_types=[0, 1, 3, 4, 4], type_names="activitynet-qa",
    )
    assert result["accuracy"] == 60.0
    assert (result["accuracy_motion"], result["accuracy_spatial_relation"], result["accuracy_yes_no"]) == (0, 100, 100)
    assert result["accuracy_color"] == 50.0 and result["accuracy_free"] == pytest.approx(200 / 3)
    plain = qa.compute(predictions=["a", "b"], references=["a", "c"], question_types=["what", "where"])
    assert (plain["accuracy_what"], plain["accuracy_where"]) == (100.0, 0.0)


def test_qa_bad_input(qa):
    with pytest.raises(ValueError, match="empty"):
        qa.compute(predictions=[], references=[])
    with pytest.raises(ValueError, match="normalization.*exact"):
        qa.compute(predictions=["a"], references=["a"], normalization="stem")
    with pytest.raises(ValueError, match="0-8.*12"):
        qa.compute(predictions=["a"], references=["a"], question_types=[12], type_names="activitynet-qa")
