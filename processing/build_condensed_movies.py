"""Condensed Movies (Bain et al. 2020) for text-to-clip retrieval.

Accepted annotation files (``--annotations DIR``; also ``DIR/metadata/`` and ``DIR/data/metadata/``):

* the challenge CSVs (``m-bain/CondensedMovies-chall``, inside the challenge tarball), preferred when present, as
  the authors ask and as TESTA uses: ``train_val_challf0.csv`` (train, val) and ``test_challf0.csv``, columns
  ``videoid, caption, split`` (and ``upload_year``);
* the public metadata of ``m-bain/CondensedMovies`` ``data/metadata/``: ``split.csv`` (``imdbid, split``) gives each
  movie's split and ``descriptions.csv`` (``imdbid, videoid, description``) the clip descriptions, joined by
  ``videoid`` with ``clips.csv`` (``upload_year``) and ``durations.csv`` (``duration``) where present. As the
  authors' own data loader does, descriptions that occur more than once in a split ("probably errors by the channel")
  are dropped, all copies, and counted in the report (``duplicate_descriptions_dropped``).

Videos: ``<upload_year>/<videoid>.mkv`` as the authors' ``data_prep/download.py`` writes them, then
``<videoid>.mkv`` (TESTA's flat folder), then ``.mp4`` / ``.webm`` in either layout.
"""

from __future__ import annotations

import csv
import os
from collections import Counter

from .build_common import (AnnotationError, AnnotationNotFound, ReadOptions, RowStream, SplitSource, clean_text,
                           find_annotation, find_media, find_optional)


SUBDIRS = ("", "metadata", os.path.join("data", "metadata"))
VIDEO_EXTENSIONS = (".mkv", ".mp4", ".webm")


def read_csv(path: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """The rows of a CSV file with a header holding `columns` (else :class:`AnnotationError`)."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise AnnotationError(f"{path}: no column(s) {missing}; expected a CSV with columns {list(columns)}, got "
                                  f"{reader.fieldnames}")
        return list(reader)


def year_of(value: str | None) -> str | None:
    """An upload year as a folder name (``"2019.0"`` -> ``"2019"``), None when empty."""
    if not value:
        return None
    try:
        return str(int(float(value)))
    except ValueError:
        return value


def media_candidates(videos: str, video_id: str, year: str | None) -> list[str]:
    """``<year>/<videoid>.<ext>`` (download tool) then ``<videoid>.<ext>`` (flat)."""
    folders = ([os.path.join(videos, year)] if year else []) + [videos]
    return [os.path.join(folder, video_id + ext) for folder in folders for ext in VIDEO_EXTENSIONS]


def challenge_rows(path: str, videos: str, split: str, options: ReadOptions) -> RowStream:
    """Rows of a challenge CSV whose ``split`` column equals `split`."""
    for record in read_csv(path, ("videoid", "caption", "split")):
        if record["split"] != split:
            continue
        video_id = record["videoid"]
        row = {"text": clean_text(record["caption"], options.max_words), "video_id": video_id}
        yield row, find_media(media_candidates(videos, video_id, year_of(record.get("upload_year"))))


def movie_splits(path: str) -> dict[str, str]:
    """imdbid -> split from ``split.csv``."""
    return {record["imdbid"]: record["split"] for record in read_csv(path, ("imdbid", "split"))}


def metadata_rows(annotations: str, videos: str, split: str, options: ReadOptions, details: dict) -> tuple[list[str],
                                                                                                            RowStream]:
    """Rows of the public metadata for `split` (see the module docstring), and the files read."""
    split_path = find_annotation(annotations, ["split.csv"], "Condensed Movies split.csv", SUBDIRS)
    desc_path = find_annotation(annotations, ["descriptions.csv"], "Condensed Movies descriptions.csv", SUBDIRS)
    clips_path = find_optional(annotations, ["clips.csv"], SUBDIRS)
    durations_path = find_optional(annotations, ["durations.csv"], SUBDIRS)
    splits = movie_splits(split_path)
    if split not in set(splits.values()):
        raise AnnotationNotFound(f"{split_path}: no movie has split {split!r}; splits present: "
                                 f"{sorted(set(splits.values()))}")
    descriptions = read_csv(desc_path, ("imdbid", "videoid", "description"))
    years = ({r["videoid"]: year_of(r.get("upload_year")) for r in read_csv(clips_path, ("videoid", "upload_year"))}
             if clips_path else {})
    durations = ({r["videoid"]: r["duration"] for r in read_csv(durations_path, ("videoid", "duration"))}
                 if durations_path else {})
    chosen = [r for r in descriptions if splits.get(r["imdbid"]) == split and r["description"].strip()]
    counts = Counter(r["description"] for r in chosen)
    dropped = [r["videoid"] for r in chosen if counts[r["description"]] > 1]
    details.update(duplicate_descriptions_dropped=len(dropped), duplicate_description_examples=dropped[:5],
                   descriptions_of_movies_without_split=sum(1 for r in descriptions if r["imdbid"] not in splits))

    def rows() -> RowStream:
        for record in chosen:
            if counts[record["description"]] > 1:
                continue
            video_id = record["videoid"]
            row: dict = {"text": clean_text(record["description"], options.max_words), "video_id": video_id}
            if durations_path:
                duration = durations.get(video_id)
                row["duration"] = float(duration) if duration else None
            yield row, find_media(media_candidates(videos, video_id, years.get(video_id)))

    files = [p for p in (split_path, desc_path, clips_path, durations_path) if p]
    return files, rows()


def read_condensed_movies(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """One split of Condensed Movies from the challenge CSV if present, else from the public metadata."""
    name = "test_challf0.csv" if split == "test" else "train_val_challf0.csv"
    challenge = find_optional(annotations, [name], SUBDIRS)
    if challenge:
        return SplitSource([challenge], "challenge", challenge_rows(challenge, videos, split, options))
    try:
        details: dict = {}
        files, rows = metadata_rows(annotations, videos, split, options, details)
    except AnnotationNotFound as error:
        raise AnnotationNotFound(f"Condensed Movies {split}: no challenge CSV ({name}) and no public metadata: "
                                 f"{error}") from None
    return SplitSource(files, "metadata", rows, details)
