"""Moment retrieval evaluated straight from the builders' format (ActivityNet Captions, DiDeMo: ``timestamps``).

The ActivityNet Captions and DiDeMo builders (``processing/build_activitynet.py``, ``processing/build_didemo.py``) write
one row per video with ``video`` (path), ``sentences`` and ``timestamps`` (``[start, end]`` seconds per sentence) and,
for ActivityNet, ``duration``. Every sentence is one moment query: find its video and its time.

* `moment_queries` turns such rows into one `MomentQuery` per sentence (unusable times reported, not guessed);
* `score_moment_search` scores ranked search results (``{"video", "start", "end", "score"}``, as
  ``pipe.search`` returns them) with the `train/metrics/moment_retrieval` `evaluate` module, in video-corpus mode: a
  moment in another video counts as a miss, and video-level recall is reported alongside R1@IoU and mIoU.

From the shell: index the split's videos as windows and score every sentence's search (prints JSON)::

    python -m train.moment_evaluation --data data/activitynet --split test --model FOLDER_OR_HUB_ID \
        --window 30 --stride 15 [--top-k 10] [--no-rerank] [--num-workers 2] [--save-index DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .evaluation import load_metric


MOMENT_METRIC = "moment_retrieval"


@dataclass(frozen=True)
class MomentQuery:
    """One sentence of a video and the time it describes."""

    text: str
    video: str
    start: float
    end: float
    duration: float | None = None


@dataclass
class MomentQueries:
    """The queries of a split, and the sentences left out with the reason (row index, sentence index, reason)."""

    queries: list[MomentQuery] = field(default_factory=list)
    skipped: list[tuple[int, int, str]] = field(default_factory=list)


def _row_field(row: Mapping, name: str, index: int):
    if name not in row or row[name] is None:
        raise ValueError(f"Row {index} has no {name!r}: moment evaluation needs rows with 'video', 'sentences' and "
                         f"'timestamps' (the ActivityNet Captions or DiDeMo builders' release format); got fields "
                         f"{sorted(row)}.")
    return row[name]


def moment_queries(rows: Iterable[Mapping]) -> MomentQueries:
    """One query per sentence of every row, with the sentence's ``timestamps`` entry as its moment.

    A moment is clipped to ``[0, duration]`` where the row has a ``duration`` (ActivityNet Captions has sentences that
    end after the video does). A sentence whose moment has no length after clipping (end <= start) cannot be scored by
    IoU: it is left out and listed in `skipped`. Rows without ``sentences``/``timestamps`` (a converted file) raise.
    """
    result = MomentQueries()
    for index, row in enumerate(rows):
        video = str(_row_field(row, "video", index))
        sentences = _row_field(row, "sentences", index)
        stamps = _row_field(row, "timestamps", index)
        if len(sentences) != len(stamps):
            raise ValueError(f"Row {index} ({video}): {len(sentences)} sentences but {len(stamps)} timestamps.")
        duration = row.get("duration")
        duration = float(duration) if duration is not None and math.isfinite(float(duration)) else None
        for number, (text, pair) in enumerate(zip(sentences, stamps)):
            start, end = float(pair[0]), float(pair[1])
            if duration is not None:
                start, end = min(max(start, 0.0), duration), min(max(end, 0.0), duration)
            if not end > start:
                result.skipped.append((index, number, f"moment [{pair[0]}, {pair[1]}] has no length"
                                       + (f" within the video's {duration:g} s" if duration is not None else "")))
                continue
            result.queries.append(MomentQuery(str(text).strip(), video, start, end, duration))
    return result


def result_moment(result: Mapping, durations: Mapping[str, float | None]) -> tuple[float, float]:
    """The ``[start, end]`` of one search result; a whole-video result (``start``/``end`` None) spans ``[0, duration]``
    of its video (``[0, 0]``, no overlap with anything, where the duration is unknown)."""
    start, end = result.get("start"), result.get("end")
    if start is None or end is None:
        return 0.0, float(durations.get(str(result["video"])) or 0.0)
    return float(start), float(end)


def score_moment_search(
    queries: Sequence[MomentQuery],
    results: Sequence[Sequence[Mapping]],
    iou_thresholds: Sequence[float] = (0.3, 0.5, 0.7),
    video_ks: Sequence[int] = (1, 5, 10),
    durations: Mapping[str, float] | None = None,
) -> dict:
    """R1@IoU, mIoU, mAP and video-level recall of ranked search `results` (one list per query, best first, of
    ``{"video", "start", "end", ...}``) against the queries' moments.

    `durations` (video -> seconds) resolves whole-video results; by default the queries' own durations."""
    if len(queries) != len(results):
        raise ValueError(f"{len(queries)} queries but {len(results)} result lists.")
    known = {q.video: q.duration for q in queries if q.duration is not None}
    known.update(durations or {})
    predictions = [[list(result_moment(r, known)) for r in ranked] for ranked in results]
    predicted_videos = [[str(r["video"]) for r in ranked] for ranked in results]
    return load_metric(MOMENT_METRIC).compute(
        predictions=predictions,
        references=[[q.start, q.end] for q in queries],
        predicted_videos=predicted_videos,
        reference_videos=[q.video for q in queries],
        iou_thresholds=tuple(iou_thresholds),
        video_ks=tuple(video_ks),
    )


def evaluate_moment_search(
    rows: Iterable[Mapping], search: Callable[[list[str]], list[list[Mapping]]], **metric_options
) -> dict:
    """Moment search scored on a builder split: `search` takes the query texts and returns ranked results per query
    (e.g. ``lambda texts: pipe.search(texts, index, k=10)``). Adds ``num_skipped`` (sentences without a scorable
    moment)."""
    built = moment_queries(rows)
    if not built.queries:
        raise ValueError("No sentence with a usable moment: nothing to evaluate.")
    results = search([q.text for q in built.queries])
    scores = score_moment_search(built.queries, results, **metric_options)
    scores["num_skipped"] = len(built.skipped)
    return scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.moment_evaluation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a builders folder (ActivityNet Captions, DiDeMo) or its jsonl")
    parser.add_argument("--split", default="test")
    parser.add_argument("--model", required=True, help="a retrieval model folder or Hub id")
    parser.add_argument("--window", type=float, required=True, help="seconds per window")
    parser.add_argument("--stride", type=float, default=None, help="seconds between windows (default: --window)")
    parser.add_argument("--top-k", type=int, default=10, help="moments kept per query (default: 10)")
    parser.add_argument("--no-rerank", action="store_true", help="rank by cosine only")
    parser.add_argument("--num-workers", type=int, default=0, help="decoding threads")
    parser.add_argument("--save-index", default=None, help="also save the index of moments in this folder")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error("--top-k must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    from modeling_testa import TestaProcessor, VideoTextRetrievalPipeline
    from processing.data import load_split

    from testa_search.cli.index import load_retrieval_model

    args = parse_args(argv)
    try:
        rows = list(load_split(args.data, split=args.split))
        model, _ = load_retrieval_model(args.model)
        pipe = VideoTextRetrievalPipeline(model=model, processor=TestaProcessor.from_pretrained(args.model),
                                          device="cpu")
        videos = list(dict.fromkeys(str(_row_field(row, "video", i)) for i, row in enumerate(rows)))
        index = pipe.encode_videos(videos, window=args.window, stride=args.stride, num_workers=args.num_workers)
        if args.save_index:
            index.save(args.save_index)
        rerank = False if args.no_rerank else None
        scores = evaluate_moment_search(rows, lambda texts: pipe.search(texts, index, top_k=args.top_k, rerank=rerank))
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    scores["num_videos_failed"] = len(index.failures)
    print(json.dumps(scores, indent=1))
    return scores


if __name__ == "__main__":
    main(sys.argv[1:])
