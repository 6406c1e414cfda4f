"""WebVid-2M / 10M (Bain et al. 2021), video-text pretraining pairs.

Annotations: the release CSVs ``results_2M_train.csv`` / ``results_2M_val.csv`` (10M: ``results_10M_*``), columns
``videoid, name, page_idx, page_dir, duration, contentUrl`` (``name`` is the caption; a ``caption`` column is
accepted too). ``--annotations`` may also be one CSV file (one split).

Videos: ``<page_dir>/<videoid>.mp4`` as ``m-bain/webvid``'s ``download.py`` lays them out, else ``<videoid>.mp4``.
Caption: :func:`pre_caption` with 30 words (BLIP's pretraining setting).
"""

from __future__ import annotations

import csv
import os

from .build_common import (AnnotationError, ReadOptions, RowStream, SplitSource, clean_text, find_annotation,
                           find_media)


def read_webvid(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """One WebVid CSV as rows ``{text, video_id}``."""
    names = [f"results_{tag}_{split}.csv" for tag in ("2M", "10M")] + [f"{split}.csv"]
    path = annotations if os.path.isfile(annotations) else find_annotation(annotations, names, f"WebVid {split} csv")

    def rows() -> RowStream:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            caption_column = "name" if "name" in columns else "caption" if "caption" in columns else None
            if "videoid" not in columns or caption_column is None:
                raise AnnotationError(f"{path}: expected the WebVid CSV with columns videoid and name (or caption), "
                                      f"got columns {columns}")
            for record in reader:
                video_id = record["videoid"]
                candidates = [os.path.join(videos, video_id + ".mp4")]
                if record.get("page_dir"):
                    candidates.insert(0, os.path.join(videos, record["page_dir"], video_id + ".mp4"))
                yield {"text": clean_text(record[caption_column], options.max_words), "video_id": video_id}, \
                    find_media(candidates)

    return SplitSource([path], "release", rows())
