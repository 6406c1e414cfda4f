"""Video-text retrieval metric: Recall@K, median rank and mean rank, with ties counted against the query.

An `evaluate` module: ``evaluate.load("train/metrics/video_text_retrieval")`` works offline; the folder can be pushed
to the Hub as a metric unchanged. See README.md beside this file for the conventions.
"""

import datasets
import evaluate
import numpy as np


_CITATION = """\
@inproceedings{ren2023testa,
  title     = {TESTA: Temporal-Spatial Token Aggregation for Long-form Video-Language Understanding},
  author    = {Ren, Shuhuai and Chen, Sishuo and Li, Shicheng and Sun, Xu and Hou, Lu},
  booktitle = {Findings of the Association for Computational Linguistics: EMNLP 2023},
  year      = {2023}
}
"""

_DESCRIPTION = """\
Recall@K (R@1/5/10 by default), median rank (MdR) and mean rank (MnR) for text-to-video or video-to-text retrieval,
as reported by TESTA and by the paragraph-to-video retrieval literature. Every query has one or several positive items
(several videos per paragraph, or several captions per video). A query's rank is that of its best positive among the
non-positive items, and ties count against the query: an item scoring exactly as high as the best positive ranks
above it.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: one entry per query.
        - configuration "scores" (default): the query's scores over all items, `list[float]` (higher is better).
        - configuration "ranked_lists": the item indices best first, `list[int]`; may be truncated (see below).
    references: the positive item indices of every query, `list[int]` (at least one each).
    ks: the K of Recall@K, default `(1, 5, 10)`.
    reverse_predictions, reverse_references (optional): the other direction (e.g. video-to-text when `predictions`
        are text-to-video), in the same format. The keys are then prefixed with `names[0]` and `names[1]`.
    names: prefixes for the two directions, default `("t2v", "v2t")`.
    truncated: with "ranked_lists", what a query whose list holds none of its positives means: `"error"` (default)
        raises when the list is shorter than the largest K, since the query's R@K is then unknown; `"miss"` counts
        it as not found at every K, for lists that are the complete set of retrieved candidates by design (TESTA's
        evaluation re-ranks only the top `k_test` videos; a positive outside them is a miss).
    return_ranks: also return `ranks`, every query's 0-based rank (`None` when unranked), per direction.

Returns:
    `R@K` (percent of queries whose best positive ranks in the top K), `median_rank` and `mean_rank` (1-based),
    `R_mean` (mean of the R@K values) and `num_queries`; prefixed per direction when both are given, with `R_mean`
    then also over both directions. With truncated ranked lists, a query none of whose positives appear in its list
    is "not found" at every K up to the list's length (a K above it raises), and its rank is unknown, so
    `median_rank`/`mean_rank` are `None` and `num_unranked` counts such queries.

Examples:
    >>> import evaluate
    >>> retrieval = evaluate.load("train/metrics/video_text_retrieval")
    >>> retrieval.compute(predictions=[[0.9, 0.1, 0.3], [0.2, 0.8, 0.8]], references=[[0], [2]], ks=[1, 2])
    {'R@1': 50.0, 'R@2': 100.0, 'median_rank': 1.5, 'mean_rank': 1.5, 'R_mean': 75.0, 'num_queries': 2}
"""


def ranks_from_scores(scores: np.ndarray, positives: list[list[int]]) -> np.ndarray:
    """0-based rank of every query's best positive: the non-positive items scoring at least as high (ties against)."""
    ranks = np.empty(len(positives), dtype=np.int64)
    for query, (row, targets) in enumerate(zip(scores, positives)):
        best = row[targets].max()
        ranks[query] = int((row >= best).sum()) - int((row[targets] >= best).sum())
    return ranks


def ranks_from_lists(ranked: list[np.ndarray], positives: list[list[int]]) -> np.ndarray:
    """0-based position of the first positive in every ranked list; -1 where no positive is in the list."""
    ranks = np.full(len(positives), -1, dtype=np.int64)
    for query, (items, targets) in enumerate(zip(ranked, positives)):
        hits = np.flatnonzero(np.isin(items, targets))
        if hits.size:
            ranks[query] = int(hits[0])
    return ranks


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class VideoTextRetrieval(evaluate.Metric):
    BUILDER_CONFIGS = ["scores", "ranked_lists"]

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in ("default", "scores", "ranked_lists"):
            raise ValueError(
                f"Unknown configuration {self.config_name!r} of video_text_retrieval; use 'scores' (the default) or "
                "'ranked_lists'."
            )
        item = datasets.Value("int64" if self.config_name == "ranked_lists" else "float64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Sequence(item), "references": datasets.Sequence(datasets.Value("int64"))}
            ),
            reference_urls=["https://github.com/RenShuhuai-Andy/TESTA"],
        )

    def _compute(
        self,
        predictions,
        references,
        ks=(1, 5, 10),
        reverse_predictions=None,
        reverse_references=None,
        names=("t2v", "v2t"),
        truncated="error",
        return_ranks=False,
    ) -> dict:
        if truncated not in ("error", "miss"):
            raise ValueError(f"`truncated` must be 'error' or 'miss', got {truncated!r}.")
        options = dict(ks=ks, truncated=truncated, return_ranks=return_ranks)
        results = self._one_direction(predictions, references, name="predictions", **options)
        if reverse_predictions is None and reverse_references is None:
            return results
        if reverse_predictions is None or reverse_references is None:
            raise ValueError("Give both `reverse_predictions` and `reverse_references`, or neither.")
        reverse = self._one_direction(reverse_predictions, reverse_references, name="reverse_predictions", **options)
        combined = {f"{names[0]}_{k}": v for k, v in results.items()}
        combined.update({f"{names[1]}_{k}": v for k, v in reverse.items()})
        combined["R_mean"] = (results["R_mean"] + reverse["R_mean"]) / 2
        return combined

    def _one_direction(self, predictions, references, ks, name: str, truncated: str, return_ranks: bool) -> dict:
        ks = [int(k) for k in ks]
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"`ks` must be positive integers, got {ks}.")
        if len(predictions) == 0:
            raise ValueError(f"`{name}` is empty: Recall@K over no queries is undefined.")
        if len(predictions) != len(references):
            raise ValueError(f"`{name}` has {len(predictions)} queries but the references have {len(references)}.")
        positives = []
        for query, targets in enumerate(references):
            targets = [int(t) for t in targets]
            if not targets:
                raise ValueError(f"Query {query} of `{name}` has no positive item in its references.")
            positives.append(targets)
        if self.config_name == "ranked_lists":
            lists = [np.asarray(items, dtype=np.int64) for items in predictions]
            ranks = ranks_from_lists(lists, positives)
            unranked = ranks < 0
            for query in np.flatnonzero(unranked) if truncated == "error" else []:
                if max(ks) > len(lists[query]):
                    raise ValueError(
                        f"Query {query} of `{name}`: no positive among its {len(lists[query])} ranked items, so "
                        f"R@{max(ks)} is unknown; give at least {max(ks)} items or the full ranking."
                    )
        else:
            lengths = {len(row) for row in predictions}
            if len(lengths) != 1:
                raise ValueError(f"Every score row of `{name}` must score the same items; got lengths {lengths}.")
            scores = np.asarray(predictions, dtype=np.float64)
            if np.isnan(scores).any():
                raise ValueError(f"`{name}` contains NaN scores (query {int(np.isnan(scores).any(1).argmax())}).")
            for query, targets in enumerate(positives):
                if min(targets) < 0 or max(targets) >= scores.shape[1]:
                    raise ValueError(
                        f"Query {query}: positive {targets} is outside the {scores.shape[1]} scored items."
                    )
            ranks = ranks_from_scores(scores, positives)
            unranked = np.zeros(len(ranks), dtype=bool)
        found = ~unranked
        results = {f"R@{k}": float(100.0 * np.mean(found & (ranks < k))) for k in ks}
        if unranked.any():
            results.update(median_rank=None, mean_rank=None, num_unranked=int(unranked.sum()))
        else:
            results.update(median_rank=float(np.median(ranks + 1)), mean_rank=float(np.mean(ranks + 1)))
        results["R_mean"] = float(np.mean([results[f"R@{k}"] for k in ks]))
        results["num_queries"] = len(ranks)
        if return_ranks:
            results["ranks"] = [int(r) if ok else None for r, ok in zip(ranks, found)]
        return results
