"""Moment retrieval metric: R1@IoU, mIoU and mAP over temporal IoU thresholds, and video-level recall.

An `evaluate` module: ``evaluate.load("train/metrics/moment_retrieval")`` works offline; the folder can be pushed to the
Hub as a metric unchanged. See README.md beside this file for the conventions.
"""

import datasets
import evaluate
import numpy as np


_CITATION = """\
@inproceedings{gao2017tall,
  title     = {TALL: Temporal Activity Localization via Language Query},
  author    = {Gao, Jiyang and Sun, Chen and Yang, Zhenheng and Nevatia, Ram},
  booktitle = {ICCV},
  year      = {2017}
}
@inproceedings{lei2021qvhighlights,
  title     = {QVHighlights: Detecting Moments and Highlights in Videos via Natural Language Queries},
  author    = {Lei, Jie and Berg, Tamara L. and Bansal, Mohit},
  booktitle = {NeurIPS},
  year      = {2021}
}
"""

_DESCRIPTION = """\
Moment retrieval (temporal grounding) metrics as Charades-STA, ActivityNet Captions and QVHighlights report them.
Every query has one ground-truth moment [start, end] (seconds) and a ranked list of predicted moments. The temporal
IoU of two moments is their overlap divided by the span from the earlier start to the later end. R{K}@{m} is the
percentage of queries with a prediction among the top K whose IoU with the ground truth is at least m; mIoU is the
mean IoU of the top-1 prediction (percent). With the videos of the predictions and of the references (video-corpus
moment retrieval), a prediction in another video has IoU 0, and video-level recall video_R@K counts the queries whose
video is among the first K distinct videos of the ranked list.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: one ranked list per query, best first, of predicted moments `[start, end]` in seconds
        (`list[list[float]]` per query). An empty list means no prediction (IoU 0, a miss).
    references: the ground-truth moment `[start, end]` of every query, with `end > start`.
    iou_thresholds: the m of R{K}@{m}, default `(0.3, 0.5, 0.7)`.
    ks: the K of R{K}@{m}, default `(1,)`.
    map_thresholds: the IoU thresholds averaged by `mAP`, default 0.5:0.05:0.95 (QVHighlights); `None` or `()` skips
        mAP. `mAP@0.5` and `mAP@0.75` are reported when among them.
    predicted_videos, reference_videos (optional, together): the video of every predicted moment
        (`list[list[str]]`, shaped as `predictions`) and of every query (`list[str]`): video-corpus moment retrieval.
    video_ks: the K of the video-level recall `video_R@K`, default `(1, 5, 10)`; only with videos.

Returns:
    `R{K}@{m}` for every K and m (percent), `mIoU` (percent), `mAP`, `mAP@0.5`, `mAP@0.75` (percent), `num_queries`,
    and with videos `video_R@K` (percent).

Examples:
    >>> import evaluate
    >>> moments = evaluate.load("train/metrics/moment_retrieval")
    >>> moments.compute(predictions=[[[0, 10], [20, 30]], [[5, 15]]], references=[[0, 10], [0, 10]],
    ...                 map_thresholds=None)
    {'R1@0.3': 100.0, 'R1@0.5': 50.0, 'R1@0.7': 50.0, 'mIoU': 66.66666666666666, 'num_queries': 2}
"""

DEFAULT_MAP_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))


def temporal_iou(predicted: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """IoU of every predicted moment `(n, 2)` with one reference `(2,)`: overlap / (later end - earlier start).

    The reference has a positive length, so the denominator is positive."""
    overlap = np.clip(np.minimum(predicted[:, 1], reference[1]) - np.maximum(predicted[:, 0], reference[0]), 0, None)
    span = np.maximum(predicted[:, 1], reference[1]) - np.minimum(predicted[:, 0], reference[0])
    return overlap / span


def first_hit_ranks(ious: list[np.ndarray], threshold: float) -> np.ndarray:
    """0-based rank of every query's first prediction with IoU >= threshold; -1 where none reaches it."""
    ranks = np.full(len(ious), -1, dtype=np.int64)
    for query, values in enumerate(ious):
        hits = np.flatnonzero(values >= threshold)
        if hits.size:
            ranks[query] = int(hits[0])
    return ranks


def average_precision(ranks: np.ndarray) -> np.ndarray:
    """Per-query AP with one ground-truth moment: 1 / (1-based rank of the first prediction matching it), 0 if none.

    Detection AP (greedy matching, interpolated precision) reduces to this with a single ground truth: the first match
    brings recall to 1 at precision 1/rank, and later matches are duplicates (false positives after full recall)."""
    precision = np.zeros(len(ranks))
    found = ranks >= 0
    precision[found] = 1.0 / (ranks[found] + 1)
    return precision


def distinct_videos_rank(videos: list[str], target: str) -> int:
    """0-based position of `target` among the distinct videos of a ranked list (in order of first appearance); -1 if
    absent."""
    seen: list[str] = []
    for video in videos:
        if video not in seen:
            if video == target:
                return len(seen)
            seen.append(video)
    return -1


def _moments(value, name: str, query: int) -> np.ndarray:
    """A query's moments as a float64 `(n, 2)` array, checked: finite, end >= start."""
    array = np.asarray(value, dtype=np.float64).reshape(-1, 2) if len(value) else np.zeros((0, 2))
    if not np.isfinite(array).all():
        raise ValueError(f"Query {query}: `{name}` has a non-finite time: {np.asarray(value).tolist()}.")
    if (array[:, 1] < array[:, 0]).any():
        bad = array[np.flatnonzero(array[:, 1] < array[:, 0])[0]].tolist()
        raise ValueError(f"Query {query}: `{name}` has a moment ending before it starts: {bad}.")
    return array


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MomentRetrieval(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float64"))),
                    "references": datasets.Sequence(datasets.Value("float64")),
                }
            ),
            reference_urls=["https://github.com/jayleicn/moment_detr/tree/main/standalone_eval"],
        )

    def _compute(
        self,
        predictions,
        references,
        iou_thresholds=(0.3, 0.5, 0.7),
        ks=(1,),
        map_thresholds=DEFAULT_MAP_THRESHOLDS,
        predicted_videos=None,
        reference_videos=None,
        video_ks=(1, 5, 10),
    ) -> dict:
        if len(predictions) == 0:
            raise ValueError("`predictions` is empty: moment retrieval metrics over no queries are undefined.")
        if len(predictions) != len(references):
            raise ValueError(f"`predictions` has {len(predictions)} queries but `references` has {len(references)}.")
        ks = [int(k) for k in ks]
        thresholds = [float(m) for m in iou_thresholds]
        if not ks or min(ks) < 1:
            raise ValueError(f"`ks` must be positive integers, got {ks}.")
        if not thresholds or not all(0.0 < m <= 1.0 for m in thresholds):
            raise ValueError(f"`iou_thresholds` must lie in (0, 1], got {thresholds}.")
        truths = []
        for query, reference in enumerate(references):
            if len(reference) != 2:
                raise ValueError(f"Query {query}: `references` must be one [start, end], got {list(reference)}.")
            truth = _moments(reference, "references", query)[0]
            if not truth[1] > truth[0]:
                raise ValueError(f"Query {query}: the reference moment {truth.tolist()} has no length (end <= start).")
            truths.append(truth)
        ious = [temporal_iou(_moments(ranked, "predictions", query), truth)
                for query, (ranked, truth) in enumerate(zip(predictions, truths))]
        results: dict = {}
        if (predicted_videos is None) != (reference_videos is None):
            raise ValueError("Give both `predicted_videos` and `reference_videos`, or neither.")
        if predicted_videos is not None:
            self._zero_other_videos(ious, predicted_videos, reference_videos)

        for k in ks:
            for m in thresholds:
                hits = [bool((values[:k] >= m).any()) for values in ious]
                results[f"R{k}@{m:g}"] = float(100.0 * np.mean(hits))
        results["mIoU"] = float(100.0 * np.mean([values[0] if values.size else 0.0 for values in ious]))
        if map_thresholds:
            per_threshold = {float(m): float(100.0 * average_precision(first_hit_ranks(ious, float(m))).mean())
                             for m in map_thresholds}
            results["mAP"] = float(np.mean(list(per_threshold.values())))
            for m in (0.5, 0.75):
                if m in per_threshold:
                    results[f"mAP@{m:g}"] = per_threshold[m]
        if predicted_videos is not None:
            video_ks = [int(k) for k in video_ks]
            ranks = np.array([distinct_videos_rank(list(videos), str(target))
                              for videos, target in zip(predicted_videos, reference_videos)])
            for k in video_ks:
                results[f"video_R@{k}"] = float(100.0 * np.mean((ranks >= 0) & (ranks < k)))
        results["num_queries"] = len(ious)
        return results

    @staticmethod
    def _zero_other_videos(ious: list[np.ndarray], predicted_videos, reference_videos) -> None:
        """Sets to 0 the IoU of every prediction that is not in its query's video (checked shapes)."""
        if len(predicted_videos) != len(ious) or len(reference_videos) != len(ious):
            raise ValueError(f"`predicted_videos` ({len(predicted_videos)}) and `reference_videos` "
                             f"({len(reference_videos)}) must have one entry per query ({len(ious)}).")
        for query, (values, videos, target) in enumerate(zip(ious, predicted_videos, reference_videos)):
            if len(videos) != len(values):
                raise ValueError(f"Query {query}: {len(values)} predicted moments but {len(videos)} predicted videos.")
            values[np.asarray([str(v) != str(target) for v in videos], dtype=bool)] = 0.0
