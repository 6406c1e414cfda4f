"""DiDeMo (Hendricks et al. 2017) for paragraph-to-video retrieval.

Accepted annotation files, detected by content (``--annotations DIR``; also ``DIR/data/``):

* the release, ``LisaAnne/LocalizingMoments`` ``data/{split}_data.json``: a JSON list of one object per description,
  ``{"annotation_id", "description", "times", "video", "dl_link", "num_segments"}``. ``times`` lists each
  annotator's ``[first, last]`` 5-second segment (0-5). The descriptions of a video are neither contiguous nor in time
  order in the file;
* a converted JSON list ``[{"video", "caption"}]`` (``caption`` a paragraph or a list of sentences), as
  TESTA-style repositories distribute, in ``{split}.json``;
* TESTA's JSON lines ``{"clip_name", "caption"}`` in ``{split}.jsonl``.

Release conversion: one row per video with the video's descriptions joined into a paragraph (raw, as the paper uses
DiDeMo's text). A description's time is the annotators' mean: start ``5 * mean(first)``, end
``5 * (mean(last) + 1)`` seconds. Names that differ only by their extension (``x.mov`` and ``x.mp4``: same Flickr
user, photo id and secret, so the same video, whose descriptions the release splits between the two names) are one
video ``x``; the report counts them as ``videos_with_several_names``. This gives the paper's 1,065 val / 1,004 test
videos.

Videos are looked for as ``<name>.mp4`` (``download_videos_AWS.py``), ``<name>`` (``download_videos.py`` from
Flickr, any of the release's extensions, some names ending in a bare ``.``), then ``<stem>.mp4`` (converted and
compressed copies, e.g. TESTA's ``didemo_30fps_224_trimed30``) and ``<stem>.<ext>`` for the other extensions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .build_common import (AnnotationError, ReadOptions, RowStream, Sentence, SplitSource, clean_text, describe,
                           find_annotation, find_media, is_reordered, load_json_any, paragraph_fields, require_field,
                           require_text, text_list)


SEGMENT_SECONDS = 5
RELEASE_FIELDS = "{annotation_id, description, times: [[first, last] segment per annotator], video, ...}"
# the extensions of the release's video names (and common ones of converted copies)
EXTENSIONS = (".mp4", ".mov", ".avi", ".mpg", ".m4v", ".3gp", ".wmv", ".mts", ".3g2", ".m2ts", ".mkv", ".webm")


def video_stem(name: str) -> str:
    """A release video name without its extension: ``a_b_c.mov`` -> ``a_b_c``; ``a_b_c.`` (bare dot) -> ``a_b_c``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def segment_times(times: object, path: str, where: str) -> tuple[float, float]:
    """(start, end) seconds of a description from its annotators' ``[first, last]`` 5-second segments (0-5)."""
    if not isinstance(times, list) or not times:
        raise AnnotationError(f"{path}: {where} field 'times' should be a non-empty list of [first, last] segment "
                              f"indices (0-5), got {describe(times)}")
    for pair in times:
        if (not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(x, int) and 0 <= x <= 5 for x in pair)
                or pair[0] > pair[1]):
            raise AnnotationError(f"{path}: {where} field 'times' should hold [first, last] segment indices with "
                                  f"0 <= first <= last <= 5, got {pair!r}")
    first = sum(pair[0] for pair in times) / len(times)
    last = sum(pair[1] for pair in times) / len(times)
    return SEGMENT_SECONDS * first, SEGMENT_SECONDS * (last + 1)


def media_candidates(videos: str, names: Sequence[str]) -> list[str]:
    """Paths a video may have, most likely first (see the module docstring)."""
    stem = video_stem(names[0])
    candidates = [os.path.join(videos, name + ".mp4") for name in names]
    candidates += [os.path.join(videos, name) for name in names]
    candidates += [os.path.join(videos, stem + ext) for ext in EXTENSIONS]
    return candidates


def detect_format(records: object, path: str) -> str:
    """``"release"``, ``"converted"`` (``[{video, caption}]``) or ``"testa_jsonl"`` (``{clip_name, caption}``)."""
    expected = (f"the LocalizingMoments release (a JSON list of {RELEASE_FIELDS}), a converted JSON list of "
                f"{{video, caption}}, or JSON lines {{clip_name, caption}}")
    if not isinstance(records, list) or not records or not isinstance(records[0], dict):
        raise AnnotationError(f"{path}: not a DiDeMo annotation file: expected {expected}; got {describe(records)}")
    first = records[0]
    if first.keys() & {"description", "times", "annotation_id"}:
        return "release"
    if "clip_name" in first:
        return "testa_jsonl"
    if first.keys() & {"video", "caption"}:
        return "converted"
    raise AnnotationError(f"{path}: entry 0 is not a DiDeMo annotation: expected {expected}; got fields "
                          f"{sorted(first)}")


def group_release(records: list, path: str) -> dict[str, tuple[list[str], list[Sentence]]]:
    """Video stem -> (release names in order of first appearance, sentences in file order)."""
    videos: dict[str, tuple[list[str], list[Sentence]]] = {}
    for index, record in enumerate(records):
        where = f"entry {index}"
        name = require_text(require_field(record, "video", path, where, RELEASE_FIELDS), path, f"{where} 'video'")
        text = require_text(require_field(record, "description", path, where, RELEASE_FIELDS), path,
                            f"{where} 'description'")
        start, end = segment_times(require_field(record, "times", path, where, RELEASE_FIELDS), path, where)
        names, sentences = videos.setdefault(video_stem(name), ([], []))
        if name not in names:
            names.append(name)
        sentences.append(Sentence(text, start, end))
    return videos


def release_rows(records: list, path: str, videos: str, options: ReadOptions, details: dict) -> RowStream:
    """One row per video of the release (names differing only by extension merged)."""
    grouped = group_release(records, path)
    details.update(videos_with_several_names=0, several_names_examples=[], sentences_reordered=0)
    for stem, (names, sentences) in grouped.items():
        if len(names) > 1:
            details["videos_with_several_names"] += 1
            if len(details["several_names_examples"]) < 5:
                details["several_names_examples"].append(names)
        details["sentences_reordered"] += is_reordered(sentences, options.sentence_order)
        row = {"video_id": stem, **paragraph_fields(sentences, options.sentence_order, options.max_words),
               "video_names": names}
        yield row, find_media(media_candidates(videos, names))


def converted_rows(records: list, path: str, videos: str, options: ReadOptions, fmt: str) -> RowStream:
    """One row per record of a converted file (``{video, caption}`` or TESTA's ``{clip_name, caption}``)."""
    key = "clip_name" if fmt == "testa_jsonl" else "video"
    expected = "{clip_name, caption}" if fmt == "testa_jsonl" else "{video, caption}"
    for index, record in enumerate(records):
        where = f"entry {index}"
        name = require_text(require_field(record, key, path, where, expected), path, f"{where} {key!r}")
        sentences = text_list(require_field(record, "caption", path, where, expected), path, f"{where} 'caption'")
        text = clean_text(" ".join(s.strip() for s in sentences), options.max_words)
        if fmt == "testa_jsonl":  # TESTA: <clip_name>.mp4
            stem, candidates = name, [os.path.join(videos, name + ".mp4")]
        else:
            stem = video_stem(name)
            candidates = [os.path.join(videos, name), os.path.join(videos, name + ".mp4")]
        candidates += [os.path.join(videos, stem + ext) for ext in EXTENSIONS]
        yield {"text": text, "video_id": stem}, find_media(candidates)


def read_didemo(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """One split of DiDeMo from the release or a converted file (see the module docstring)."""
    path = find_annotation(annotations, [f"{split}_data.json", f"{split}.json", f"{split}.jsonl"],
                           f"DiDeMo {split} annotations", subdirs=("", "data"))
    records = load_json_any(path)
    fmt = detect_format(records, path)
    assert isinstance(records, list)
    source = SplitSource([path], fmt, iter(()))
    if fmt == "release":
        source.rows = release_rows(records, path, videos, options, source.details)
        source.details["sentence_order"] = options.sentence_order
    else:
        source.rows = converted_rows(records, path, videos, options, fmt)
    return source
