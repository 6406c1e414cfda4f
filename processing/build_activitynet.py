"""ActivityNet Captions (Krishna et al. 2017) for paragraph-to-video retrieval, and ActivityNet-QA (Yu et al. 2019).

ActivityNet Captions, accepted files detected by content (``--annotations DIR``):

* the release (``captions.zip``; also ``ttengwang/PDVC`` ``data/anet/captiondata/``): ``train.json`` (PDVC:
  ``train_modified.json``), ``val_1.json``, ``val_2.json``, each a JSON object keyed by ``v_<youtube id>`` with
  ``{"duration": s, "timestamps": [[start, end], ...], "sentences": [...]}``;
* TESTA's converted ``train.json`` / ``val.json``: a JSON list (on line 0 of a JSON-lines file, or the whole file)
  of ``{"video": "v_x.mp4", "caption": [sentences]}``.

Splits: ``train`` <- ``train.json`` (else ``train_modified.json``); ``test`` <- ``val_1.json``, the set the
paragraph-retrieval papers and TESTA evaluate on (TESTA's converted ``val.json``); ``val`` <- ``val_2.json``, the
second, independent annotation of the same videos (with converted files: ``val.json`` as well). Rows keep
``timestamps`` (seconds) and ``duration``. Paragraph: the sentences joined, then :func:`pre_caption` (50 words).

Videos: ``v_<id>.mp4`` as the ActivityNet crawler (``Crawler/fetch_activitynet_videos.sh``) writes them, then
``.mkv`` / ``.webm``, then ``<id>.<ext>`` without the ``v_`` prefix.
"""

from __future__ import annotations

import os

from .build_common import (AnnotationError, ReadOptions, RowStream, Sentence, SplitSource, clean_text, describe,
                           find_annotation, find_media, is_reordered, load_json_any, paragraph_fields, pre_question,
                           require_field, require_seconds, require_text, text_list)


VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm")
RELEASE_FIELDS = "{duration, timestamps: [[start, end], ...], sentences: [...]}"
FILES = {
    "train": ["train.json", "train_modified.json"],
    "test": ["val_1.json", "val.json"],
    "val": ["val_2.json", "val.json"],
}


def media_candidates(videos: str, video_id: str) -> list[str]:
    """``v_<id>.<ext>`` then ``<id>.<ext>`` for the crawler's and common extensions."""
    bare = video_id[2:] if video_id.startswith("v_") else video_id
    return [os.path.join(videos, name + ext) for name in (video_id, bare) for ext in VIDEO_EXTENSIONS]


def detect_format(data: object, path: str) -> str:
    """``"release"`` (dict keyed by video) or ``"converted"`` (list of ``{video, caption}``); rejects the
    ActivityNet-Entities paragraph files (video -> paragraph string), which have no timestamps."""
    expected = (f"the ActivityNet Captions release (an object v_<id> -> {RELEASE_FIELDS}) or a converted list of "
                f"{{video, caption}}")
    if isinstance(data, dict) and data:
        first = next(iter(data.values()))
        if isinstance(first, dict) and "sentences" in first:
            return "release"
        if isinstance(first, str):
            raise AnnotationError(f"{path}: an ActivityNet-Entities paragraph file (video -> paragraph string, "
                                  f"without timestamps, re-split val/test); expected {expected}: use val_1.json")
    if isinstance(data, list) and data and isinstance(data[0], dict) and "video" in data[0]:
        return "converted"
    raise AnnotationError(f"{path}: not an ActivityNet Captions file: expected {expected}; got {describe(data)}")


def release_sentences(key: str, entry: object, path: str) -> tuple[list[Sentence], float]:
    """The timed sentences and the duration of one video of the release, validated."""
    where = f"video {key!r}"
    sentences = text_list(require_field(entry, "sentences", path, where, RELEASE_FIELDS), path, f"{where} 'sentences'")
    stamps = require_field(entry, "timestamps", path, where, RELEASE_FIELDS)
    duration = require_seconds(require_field(entry, "duration", path, where, RELEASE_FIELDS), path,
                               f"{where} 'duration'")
    if not isinstance(stamps, list) or len(stamps) != len(sentences):
        raise AnnotationError(f"{path}: {where} 'timestamps' should be a list of one [start, end] per sentence "
                              f"({len(sentences)}), got {describe(stamps)}")
    timed = []
    for index, (text, pair) in enumerate(zip(sentences, stamps)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise AnnotationError(f"{path}: {where} 'timestamps'[{index}] should be [start, end], got {pair!r}")
        start = require_seconds(pair[0], path, f"{where} 'timestamps'[{index}][0]")
        end = require_seconds(pair[1], path, f"{where} 'timestamps'[{index}][1]")
        timed.append(Sentence(text, start, end))
    return timed, duration


def release_rows(data: dict, path: str, videos: str, options: ReadOptions, details: dict) -> RowStream:
    """One row per video of the release, with timestamps and duration."""
    details["sentences_reordered"] = 0
    for key, entry in data.items():
        sentences, duration = release_sentences(key, entry, path)
        details["sentences_reordered"] += is_reordered(sentences, options.sentence_order)
        row = {"video_id": key, **paragraph_fields(sentences, options.sentence_order, options.max_words),
               "duration": duration}
        yield row, find_media(media_candidates(videos, key))


def converted_rows(records: list, path: str, videos: str, options: ReadOptions) -> RowStream:
    """One row per ``{video, caption}`` record (TESTA's converted files)."""
    expected = "{video, caption: [sentences]}"
    for index, record in enumerate(records):
        where = f"entry {index}"
        video = require_text(require_field(record, "video", path, where, expected), path, f"{where} 'video'")
        sentences = text_list(require_field(record, "caption", path, where, expected), path, f"{where} 'caption'")
        video_id = os.path.splitext(video)[0]
        text = clean_text(" ".join(s.strip() for s in sentences), options.max_words)
        candidates = [os.path.join(videos, video)] + media_candidates(videos, video_id)
        yield {"text": text, "video_id": video_id}, find_media(candidates)


def read_activitynet(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """One split of ActivityNet Captions (see the module docstring for the split mapping)."""
    path = find_annotation(annotations, FILES[split], f"ActivityNet Captions {split} annotations",
                           subdirs=("", "captiondata"))
    data = load_json_any(path)
    fmt = detect_format(data, path)
    source = SplitSource([path], fmt, iter(()))
    if fmt == "release":
        assert isinstance(data, dict)
        source.rows = release_rows(data, path, videos, options, source.details)
        source.details["sentence_order"] = options.sentence_order
    else:
        assert isinstance(data, list)
        source.rows = converted_rows(data, path, videos, options)
    return source


# ----------------------------------------------------------------------------------------------------------------
# ActivityNet-QA


def read_activitynet_qa(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """ActivityNet-QA (``MILVLG/activitynet-qa`` ``dataset/{split}_{q,a}.json``): questions joined to answers by
    ``question_id``; video ``v_<video_name>.mp4`` (then .webm/.mkv, then without ``v_``)."""
    subdirs = ("", "annos", "dataset")
    q_path = find_annotation(annotations, [f"{split}_q.json"], f"ActivityNet-QA {split}_q.json", subdirs)
    a_path = find_annotation(annotations, [f"{split}_a.json"], f"ActivityNet-QA {split}_a.json", subdirs)
    questions, answers = load_json_any(q_path), load_json_any(a_path)
    for path, data, fields in ((q_path, questions, "{question_id, question, video_name}"),
                               (a_path, answers, "{question_id, answer, type}")):
        if not isinstance(data, list):
            raise AnnotationError(f"{path}: expected a JSON list of {fields}, got {describe(data)}")
    qid2answer = {}
    for index, record in enumerate(answers):
        qid = require_field(record, "question_id", a_path, f"entry {index}", "{question_id, answer, type}")
        qid2answer[qid] = require_field(record, "answer", a_path, f"entry {index}", "{question_id, answer, type}")

    def rows() -> RowStream:
        expected = "{question_id, question, video_name}"
        for index, record in enumerate(questions):
            qid = require_field(record, "question_id", q_path, f"entry {index}", expected)
            if qid not in qid2answer:
                raise AnnotationError(f"{a_path}: no answer for question_id {qid!r} of {q_path}")
            question = require_text(require_field(record, "question", q_path, f"entry {index}", expected), q_path,
                                    f"entry {index} 'question'")
            if options.max_words is not None:
                question = pre_question(question, options.max_words)
            name = str(require_field(record, "video_name", q_path, f"entry {index}", expected))
            video_id = "v_" + name
            yield ({"question": question, "answer": str(qid2answer[qid]), "video_id": video_id,
                    "question_id": str(qid)}, find_media(media_candidates(videos, video_id)))

    return SplitSource([q_path, a_path], "release", rows())
