"""Builders: the public datasets' annotation formats -> our schema, as jsonl or parquet shards plus video paths.

=================== ======================================================= ============ ===========================
dataset             annotations (``--annotations DIR``)                     text         video (``--videos DIR``)
=================== ======================================================= ============ ===========================
``queryd``          ``raw_captions_combined_filtered.pkl`` (dict name ->     pre_caption  ``<name>`` (no extension;
                    list of token lists) + ``exists_{split}_list.txt``       128 words    then .mp4/.mkv/.webm)
``didemo``          ``{split}.jsonl`` lines ``{"clip_name", "caption"}``    raw caption  ``<clip_name>.mp4``
``activitynet``     ``{split}.json``: line 0 is a list of                   pre_caption  ``<video>``
                    ``{"video": "v_x.mp4", "caption": [sentences]}``;        50 words
                    split ``test`` reads ``val.json`` (as the paper)
``condensed_movies`` ``[metadata/]train_val_challf0.csv`` (train, val) and   pre_caption  ``<videoid>.mkv`` (then
                    ``test_challf0.csv``: columns videoid, caption, split    50 words     .mp4/.webm)
``activitynet_qa``  ``[annos/]{split}_q.json`` (question_id, question,      pre_question ``v_<video_name>.mp4``
                    video_name) + ``{split}_a.json`` (question_id, answer)   50 words     (then .webm/.mkv)
``webvid``          WebVid csv (``results_2M_train.csv`` /                   pre_caption  ``<page_dir>/<videoid>.mp4``
                    ``results_2M_val.csv``): videoid, name, page_dir, ...    30 words     (then ``<videoid>.mp4``)
``cc3m``            ``Train_GCC-training.tsv`` / ``Validation_GCC-1.1.0-     pre_caption  images downloaded by
                    Validation.tsv``: ``caption<TAB>url``, no header         30 words     img2dataset (see below)
=================== ======================================================= ============ ===========================

Text handling follows the original TESTA code: paragraphs are the sentences joined with single spaces, then
:func:`pre_caption` (lower-case, ``!"()*#~`` replaced by spaces, spaces collapsed, at most ``max_words`` words).
QuerYD keeps 128 words, ActivityNet and Condensed Movies the default 50, DiDeMo's paragraph is used raw, and the
pretraining corpora (WebVid, CC3M) keep 30 words as BLIP's pretraining datasets do. ActivityNet-QA questions go through
:func:`pre_question`; answers are kept verbatim.

Rows: retrieval / pretraining ``{"video", "text", "video_id"}`` (CC3M: ``{"image", "text", "image_id"}``); QA
``{"video", "question", "answer", "video_id", "question_id"}``. Evaluation splits (val, test) keep one row per video for
the retrieval datasets with one paragraph per video (DiDeMo deduplicates by ``clip_name`` as the original evaluation
does); training splits keep every row.

Missing videos are never dropped silently: each split reports how many were missing with examples, writes the full
list to ``OUT/missing_<split>.txt``, and ``--missing`` says what to do with those rows: ``drop`` (default), ``keep``
or ``error``.

Output (``PREFIX`` is ``qa_`` for ActivityNet-QA, else empty)::

    OUT/PREFIX<split>.jsonl | OUT/PREFIX<split>-00000-of-00004.parquet ...   rows, spread round-robin over shards
    OUT/README.md          dataset card (``load_dataset(OUT)`` works)
    OUT/build_report.json  rows / missing / duplicates per split

Media paths are absolute by default; ``--relative-paths`` writes them relative to ``OUT`` (then move ``OUT`` and the
videos together). :func:`processing.load_split` resolves both.

CC3M images: img2dataset (``--output_format files``) writes ``IMAGES/00000/000000000.jpg`` and one
``IMAGES/00000.parquet`` per shard with the columns ``url``, ``key`` and ``status``; the builder maps every tsv url to
its image through those parquet files (searched recursively). ``--image-layout flat`` instead expects
``IMAGES/<row index>.jpg``.

Usage::

    python -m processing.builders DATASET --annotations DIR --videos DIR --output-dir OUT \\
        [--format jsonl|parquet] [--num-shards N] [--splits train val test] [--missing drop|keep|error]
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import pickle
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field


MAX_EXAMPLES = 5  # missing videos listed in reports


# ----------------------------------------------------------------------------------------------------------------
# text normalisation (verbatim behaviour of the original TESTA `data/utils.py`)


def pre_caption(caption: str, max_words: int = 50) -> str:
    """TESTA's caption cleaning: lower-case, ``!"()*#~`` -> space, collapse whitespace runs, keep `max_words` words.

    Note that, as in the original, single spaces are not collapsed and only runs of 2+ whitespace characters are.
    """
    caption = re.sub(r"([!\"()*#~])", " ", caption.lower())
    caption = re.sub(r"\s{2,}", " ", caption)
    caption = caption.rstrip("\n").strip(" ")
    words = caption.split(" ")
    if len(words) > max_words:
        caption = " ".join(words[:max_words])
    return caption


def pre_question(question: str, max_ques_words: int = 50) -> str:
    """TESTA's question cleaning: lower-case, remove ``.!"()*#:;~``, strip trailing spaces, keep `max_ques_words`."""
    question = re.sub(r"([.!\"()*#:;~])", "", question.lower()).rstrip(" ")
    words = question.split(" ")
    if len(words) > max_ques_words:
        question = " ".join(words[:max_ques_words])
    return question


# ----------------------------------------------------------------------------------------------------------------
# helpers


class AnnotationError(ValueError):
    """An annotation file is missing or malformed; the message names the file and the field."""


class AnnotationNotFound(AnnotationError, FileNotFoundError):
    """An annotation file of a split does not exist."""


@dataclass
class SplitReport:
    """What a builder did with one split."""

    split: str
    annotation_files: list[str]
    rows: int = 0
    missing: int = 0
    missing_examples: list[str] = field(default_factory=list)
    duplicates_dropped: int = 0
    files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.split}: {self.rows} rows"
        if self.duplicates_dropped:
            text += f", {self.duplicates_dropped} duplicate rows of already listed videos dropped"
        if self.missing:
            text += f", {self.missing} missing media (e.g. {', '.join(self.missing_examples)})"
        return text


@dataclass
class Media:
    """Where a row's video/image should be: `path` if found, else the first `candidates` entry is reported."""

    candidates: list[str]
    path: str | None


def find_media(candidates: list[str]) -> Media:
    """The first existing path among `candidates` (tried in order)."""
    for candidate in candidates:
        if os.path.isfile(candidate):
            return Media(candidates, candidate)
    return Media(candidates, None)


def _require(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise AnnotationNotFound(f"{what} not found: {path!r}")
    return path


def _first_existing(directory: str, names: list[str], what: str) -> str:
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise AnnotationNotFound(f"{what} not found in {directory!r}: looked for {names}")


def _field(record: dict, key: str, path: str, where: str) -> object:
    if not isinstance(record, dict):
        raise AnnotationError(f"{path}: {where} should be an object, got {type(record).__name__}")
    if key not in record:
        raise AnnotationError(f"{path}: {where} has no field {key!r} (fields: {sorted(record)})")
    return record[key]


# A builder yields (row without its media column, Media) pairs for one split.
RowStream = Iterator[tuple[dict, Media]]


@dataclass
class DatasetSpec:
    """A registered dataset: its split names, row kind and the function that reads one split."""

    name: str
    splits: tuple[str, ...]
    media_column: str  # "video" or "image"
    task: str  # "retrieval", "pretrain" or "qa"
    max_words: int | None  # default word limit of pre_caption (None: caption used raw)
    dedup_eval: bool  # keep one row per video in val/test
    read: Callable[..., tuple[list[str], RowStream]]


# ----------------------------------------------------------------------------------------------------------------
# the datasets


def read_queryd(annotations: str, videos: str, split: str, max_words: int | None = 128, **_: object):
    """QuerYD: the paragraph is every sentence (a token list joined by spaces) joined by spaces, then pre_caption."""
    list_file = _require(os.path.join(annotations, f"exists_{split}_list.txt"), f"QuerYD {split} list")
    pkl = _require(os.path.join(annotations, "raw_captions_combined_filtered.pkl"), "QuerYD captions pickle")
    with open(pkl, "rb") as f:
        captions = pickle.load(f)
    if not isinstance(captions, dict):
        raise AnnotationError(f"{pkl}: expected a dict name -> list of token lists, got {type(captions).__name__}")
    with open(list_file, encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip()]

    def rows() -> RowStream:
        for name in names:
            if name not in captions:
                raise AnnotationError(f"{pkl}: no captions for video {name!r} listed in {list_file}")
            sentences = captions[name]
            if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in sentences):
                raise AnnotationError(f"{pkl}: captions of {name!r} should be a list of token lists")
            text = " ".join(" ".join(tokens) for tokens in sentences)
            if max_words is not None:
                text = pre_caption(text, max_words)
            base = os.path.join(videos, name)
            media = find_media([base] + [base + ext for ext in (".mp4", ".mkv", ".webm")])
            yield {"text": text, "video_id": name}, media

    return [list_file, pkl], rows()


def read_didemo(annotations: str, videos: str, split: str, max_words: int | None = None, **_: object):
    """DiDeMo: ``{split}.jsonl`` with the paragraph already concatenated in ``caption``; used raw by the paper."""
    path = _require(os.path.join(annotations, f"{split}.jsonl"), f"DiDeMo {split} annotations")

    def rows() -> RowStream:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise AnnotationError(f"{path}:{number}: invalid JSON ({error})") from None
                clip = str(_field(record, "clip_name", path, f"line {number}"))
                text = str(_field(record, "caption", path, f"line {number}"))
                if max_words is not None:
                    text = pre_caption(text, max_words)
                yield {"text": text, "video_id": clip}, find_media([os.path.join(videos, clip + ".mp4")])

    return [path], rows()


def read_activitynet(annotations: str, videos: str, split: str, max_words: int | None = 50, **_: object):
    """ActivityNet Captions: line 0 of ``{split}.json`` is a list of ``{video, caption: [sentences]}``; test = val."""
    file_split = "val" if split == "test" else split
    path = _require(os.path.join(annotations, f"{file_split}.json"), f"ActivityNet Captions {file_split} annotations")
    with open(path, encoding="utf-8") as f:
        first = f.readline()
        try:
            records = json.loads(first)
        except json.JSONDecodeError:  # a pretty-printed file: read it whole
            f.seek(0)
            try:
                records = json.load(f)
            except json.JSONDecodeError as error:
                raise AnnotationError(f"{path}: neither line 0 nor the whole file is JSON ({error})") from None
    if not isinstance(records, list):
        raise AnnotationError(
            f"{path}: line 0 should be a JSON list of {{video, caption}}, got {type(records).__name__}"
        )

    def rows() -> RowStream:
        for index, record in enumerate(records):
            video = str(_field(record, "video", path, f"entry {index}"))
            sentences = _field(record, "caption", path, f"entry {index}")
            if isinstance(sentences, str):
                sentences = [sentences]
            text = " ".join(str(s) for s in sentences)
            if max_words is not None:
                text = pre_caption(text, max_words)
            video_id = os.path.splitext(video)[0]
            yield {"text": text, "video_id": video_id}, find_media([os.path.join(videos, video)])

    return [path], rows()


def read_condensed_movies(annotations: str, videos: str, split: str, max_words: int | None = 50, **_: object):
    """Condensed Movies: rows of the challenge csv whose ``split`` column equals `split`; video ``<videoid>.mkv``."""
    name = "test_challf0.csv" if split == "test" else "train_val_challf0.csv"
    path = _first_existing(annotations, [name, os.path.join("metadata", name)], f"Condensed Movies {name}")

    def rows() -> RowStream:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for column in ("videoid", "caption", "split"):
                if column not in (reader.fieldnames or []):
                    raise AnnotationError(f"{path}: no column {column!r} (columns: {reader.fieldnames})")
            for record in reader:
                if record["split"] != split:
                    continue
                video_id = record["videoid"]
                text = record["caption"]
                if max_words is not None:
                    text = pre_caption(text, max_words)
                base = os.path.join(videos, video_id)
                media = find_media([base + ext for ext in (".mkv", ".mp4", ".webm")])
                yield {"text": text, "video_id": video_id}, media

    return [path], rows()


def read_activitynet_qa(annotations: str, videos: str, split: str, max_words: int | None = 50, **_: object):
    """ActivityNet-QA: questions joined to answers by ``question_id``; video ``v_<video_name>.mp4`` (then .webm)."""
    q_name, a_name = f"{split}_q.json", f"{split}_a.json"
    q_path = _first_existing(annotations, [q_name, f"annos/{q_name}"], f"ActivityNet-QA {q_name}")
    a_path = _first_existing(annotations, [a_name, f"annos/{a_name}"], f"ActivityNet-QA {a_name}")
    with open(q_path, encoding="utf-8") as f:
        questions = json.load(f)
    with open(a_path, encoding="utf-8") as f:
        answers = json.load(f)
    for path, data in ((q_path, questions), (a_path, answers)):
        if not isinstance(data, list):
            raise AnnotationError(f"{path}: expected a JSON list, got {type(data).__name__}")
    qid2answer = {}
    for index, record in enumerate(answers):
        qid2answer[_field(record, "question_id", a_path, f"entry {index}")] = _field(
            record, "answer", a_path, f"entry {index}")

    def rows() -> RowStream:
        for index, record in enumerate(questions):
            qid = _field(record, "question_id", q_path, f"entry {index}")
            if qid not in qid2answer:
                raise AnnotationError(f"{a_path}: no answer for question_id {qid!r} of {q_path}")
            question = str(_field(record, "question", q_path, f"entry {index}"))
            if max_words is not None:
                question = pre_question(question, max_words)
            video_id = "v_" + str(_field(record, "video_name", q_path, f"entry {index}"))
            base = os.path.join(videos, video_id)
            media = find_media([base + ext for ext in (".mp4", ".webm", ".mkv")])
            yield {"question": question, "answer": str(qid2answer[qid]), "video_id": video_id,
                   "question_id": str(qid)}, media

    return [q_path, a_path], rows()


def read_webvid(annotations: str, videos: str, split: str, max_words: int | None = 30, **_: object):
    """WebVid-2M/10M csv (``videoid, contentUrl, duration, page_dir, name``); caption ``name`` (or ``caption``)."""
    size_tags = ("2M", "10M")
    names = [f"results_{tag}_{split}.csv" for tag in size_tags] + [f"{split}.csv"]
    path = annotations if os.path.isfile(annotations) else _first_existing(annotations, names, f"WebVid {split} csv")

    def rows() -> RowStream:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            caption_column = "name" if "name" in columns else "caption" if "caption" in columns else None
            if "videoid" not in columns or caption_column is None:
                raise AnnotationError(f"{path}: need columns 'videoid' and 'name' (or 'caption'), got {columns}")
            for record in reader:
                video_id = record["videoid"]
                text = record[caption_column]
                if max_words is not None:
                    text = pre_caption(text, max_words)
                candidates = [os.path.join(videos, video_id + ".mp4")]
                if record.get("page_dir"):
                    candidates.insert(0, os.path.join(videos, record["page_dir"], video_id + ".mp4"))
                yield {"text": text, "video_id": video_id}, find_media(candidates)

    return [path], rows()


def _img2dataset_index(images: str) -> dict[str, str]:
    """url -> image path from img2dataset's per-shard parquet files (rows with status "success")."""
    import pyarrow.parquet as pq

    index: dict[str, str] = {}
    for parquet in sorted(glob.glob(os.path.join(glob.escape(images), "**", "*.parquet"), recursive=True)):
        table = pq.read_table(parquet)
        missing = [c for c in ("url", "key") if c not in table.column_names]
        if missing:
            raise AnnotationError(f"{parquet}: not an img2dataset shard table, no column(s) {missing}")
        folder = os.path.splitext(parquet)[0]
        urls, keys = table.column("url").to_pylist(), table.column("key").to_pylist()
        status = table.column("status").to_pylist() if "status" in table.column_names else ["success"] * len(urls)
        for url, key, state in zip(urls, keys, status):
            if state == "success" and url not in index:
                index[url] = os.path.join(folder, f"{key}.jpg")
    return index


def read_cc3m(annotations: str, videos: str, split: str, max_words: int | None = 30, image_layout: str = "img2dataset",
              **_: object):
    """CC3M tsv (``caption<TAB>url``, no header) -> ``{"image", "text", "image_id"}`` rows (see module docstring)."""
    names = {"train": ["Train_GCC-training.tsv", "train.tsv"],
             "val": ["Validation_GCC-1.1.0-Validation.tsv", "val.tsv"]}.get(split, [f"{split}.tsv"])
    path = annotations if os.path.isfile(annotations) else _first_existing(annotations, names, f"CC3M {split} tsv")
    if image_layout not in ("img2dataset", "flat"):
        raise ValueError(f"unknown image_layout {image_layout!r}; use 'img2dataset' or 'flat'")
    index = _img2dataset_index(videos) if image_layout == "img2dataset" else {}
    if image_layout == "img2dataset" and not index:
        raise AnnotationError(
            f"no img2dataset shard parquet files (url, key, status) under {videos!r}; download with img2dataset "
            f"--output_format files, or pass --image-layout flat for IMAGES/<row index>.jpg"
        )

    def rows() -> RowStream:
        with open(path, encoding="utf-8", newline="") as f:
            for number, line in enumerate(f):
                line = line.rstrip("\r\n")
                if not line:
                    continue
                parts = line.split("\t")
                if len(parts) != 2:
                    raise AnnotationError(f"{path}:{number + 1}: expected 'caption<TAB>url', got {len(parts)} fields")
                caption, url = parts
                text = pre_caption(caption, max_words) if max_words is not None else caption
                if image_layout == "flat":
                    media = find_media([os.path.join(videos, f"{number}.jpg")])
                    image_id = str(number)
                else:
                    found = index.get(url)
                    media = Media([found or url], found if found and os.path.isfile(found) else None)
                    image_id = os.path.splitext(os.path.basename(found))[0] if found else str(number)
                yield {"text": text, "image_id": image_id}, media

    return [path], rows()


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("queryd", ("train", "val", "test"), "video", "retrieval", 128, False, read_queryd),
        DatasetSpec("didemo", ("train", "val", "test"), "video", "retrieval", None, True, read_didemo),
        DatasetSpec("activitynet", ("train", "val", "test"), "video", "retrieval", 50, False, read_activitynet),
        DatasetSpec("condensed_movies", ("train", "val", "test"), "video", "retrieval", 50, False,
                    read_condensed_movies),
        DatasetSpec("activitynet_qa", ("train", "val", "test"), "video", "qa", 50, False, read_activitynet_qa),
        DatasetSpec("webvid", ("train", "val"), "video", "pretrain", 30, False, read_webvid),
        DatasetSpec("cc3m", ("train", "val"), "image", "pretrain", 30, False, read_cc3m),
    )
}


# ----------------------------------------------------------------------------------------------------------------
# writing


class ShardWriter:
    """Writes rows round-robin into `num_shards` jsonl or parquet files (row i -> shard i % num_shards)."""

    def __init__(self, output_dir: str, stem: str, fmt: str, num_shards: int, batch_rows: int = 10_000):
        if fmt not in ("jsonl", "parquet"):
            raise ValueError(f"format must be 'jsonl' or 'parquet', got {fmt!r}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.fmt, self.num_shards, self.batch_rows = fmt, num_shards, batch_rows
        if num_shards == 1:
            self.paths = [os.path.join(output_dir, f"{stem}.{fmt}")]
        else:
            self.paths = [
                os.path.join(output_dir, f"{stem}-{i:05d}-of-{num_shards:05d}.{fmt}") for i in range(num_shards)
            ]
        self.count = 0
        self._jsonl = [open(p, "w", encoding="utf-8", newline="\n") for p in self.paths] if fmt == "jsonl" else []
        self._buffers: list[list[dict]] = [[] for _ in self.paths]
        self._writers: list[object | None] = [None] * num_shards
        self._schema = None

    def write(self, row: dict) -> None:
        shard = self.count % self.num_shards
        self.count += 1
        if self.fmt == "jsonl":
            self._jsonl[shard].write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            self._buffers[shard].append(row)
            if len(self._buffers[shard]) >= self.batch_rows:
                self._flush(shard)

    def _flush(self, shard: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self._buffers[shard]
        if self._schema is None:
            if not rows:
                return
            self._schema = pa.schema([(key, pa.string()) for key in rows[0]])
        if self._writers[shard] is None:
            self._writers[shard] = pq.ParquetWriter(self.paths[shard], self._schema)
        if rows:
            table = pa.Table.from_pylist(rows, schema=self._schema)
            self._writers[shard].write_table(table)  # type: ignore[union-attr]
        self._buffers[shard] = []

    def close(self) -> list[str]:
        """Finishes every file (empty shards become valid empty files) and returns their paths."""
        for f in self._jsonl:
            f.close()
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            for shard in range(self.num_shards):
                self._flush(shard)
            for shard, writer in enumerate(self._writers):
                if writer is None:  # a shard without rows, or no rows at all
                    schema = self._schema or pa.schema([])
                    pq.write_table(pa.Table.from_pylist([], schema=schema), self.paths[shard])
                else:
                    writer.close()  # type: ignore[union-attr]
        return self.paths


def _card(dataset: str, reports: dict[str, SplitReport], prefix: str, fmt: str, num_shards: int) -> str:
    split_names = {"train": "train", "val": "validation", "test": "test"}
    lines = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split in reports:
        pattern = f"{prefix}{split}.{fmt}" if num_shards == 1 else f"{prefix}{split}-*-of-*.{fmt}"
        lines += [f"  - split: {split_names.get(split, split)}", f"    path: {pattern}"]
    lines += ["---", "", f"# {dataset} in the TESTA schema", "",
              f"Built by `python -m processing.builders {dataset}`. See `build_report.json` for row and missing-media "
              f"counts. Relative media paths are relative to this directory; load with `processing.load_split`.", ""]
    for report in reports.values():
        lines.append(f"- {report.summary()}")
    return "\n".join(lines) + "\n"


def build(
    dataset: str,
    annotations: str,
    videos: str,
    output_dir: str,
    fmt: str = "jsonl",
    num_shards: int = 1,
    splits: Iterable[str] | None = None,
    missing: str = "drop",
    relative_paths: bool = False,
    max_words: int | None = -1,
    image_layout: str = "img2dataset",
    progress: bool = True,
) -> dict[str, SplitReport]:
    """Builds `dataset` into `output_dir` and returns one :class:`SplitReport` per split.

    Args:
        dataset: a key of :data:`DATASETS` (``queryd``, ``didemo``, ``activitynet``, ``condensed_movies``,
            ``activitynet_qa``, ``webvid``, ``cc3m``).
        annotations: directory of the annotation files (WebVid / CC3M: also a single csv / tsv file).
        videos: directory of the videos (CC3M: of the images).
        output_dir: destination directory (created).
        fmt: ``"jsonl"`` or ``"parquet"``.
        num_shards: files per split; rows are spread round-robin so shard sizes differ by at most one.
        splits: splits to build. Default: every split of the dataset whose annotation file exists (a note is
            printed for the others); an explicitly requested split without annotations is an error.
        missing: rows whose video is missing are ``"drop"``-ped (reported), ``"keep"``-t (reported) or raise
            (``"error"``).
        relative_paths: write media paths relative to `output_dir` instead of absolute.
        max_words: word limit of the text cleaning; ``-1`` = the dataset's default (paper setting), ``None`` = no
            cleaning at all.
        image_layout: CC3M only: ``"img2dataset"`` or ``"flat"``.
        progress: show a tqdm progress bar per split.
    """
    from tqdm.auto import tqdm

    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    if missing not in ("drop", "keep", "error"):
        raise ValueError(f"missing must be 'drop', 'keep' or 'error', got {missing!r}")
    spec = DATASETS[dataset]
    explicit = bool(splits)
    splits = tuple(splits) if splits else spec.splits
    if os.path.isfile(annotations):  # one csv/tsv file (webvid, cc3m) is one split: train unless told otherwise
        if dataset not in ("webvid", "cc3m"):
            raise AnnotationError(f"{dataset} needs an annotation directory, got the file {annotations!r}")
        if not explicit:
            splits = ("train",)
        elif len(splits) != 1:
            raise ValueError(f"--annotations {annotations!r} is one file: build one split from it, got {splits}")
    unknown = [s for s in splits if s not in spec.splits]
    if unknown:
        raise ValueError(f"{dataset} has no split(s) {unknown}; its splits are {list(spec.splits)}")
    if not os.path.isdir(videos):
        raise FileNotFoundError(f"video/image directory not found: {videos!r}")
    words = spec.max_words if max_words == -1 else max_words
    os.makedirs(output_dir, exist_ok=True)
    out_abs = os.path.abspath(output_dir)
    prefix = "qa_" if spec.task == "qa" else ""
    reports: dict[str, SplitReport] = {}
    for split in splits:
        try:
            files, rows = spec.read(os.path.abspath(annotations), os.path.abspath(videos), split, max_words=words,
                                    image_layout=image_layout)
        except AnnotationNotFound as error:
            if explicit:
                raise
            print(f"note: {dataset}: skipping split {split!r} ({error})", file=sys.stderr)
            continue
        report = SplitReport(split, files)
        writer = ShardWriter(output_dir, f"{prefix}{split}", fmt, num_shards)
        missing_list: list[str] = []
        seen: set[str] = set()
        dedup = spec.dedup_eval and split != "train"
        try:
            for row, media in tqdm(rows, desc=f"{dataset} {split}", unit="row", disable=not progress):
                key = row.get("video_id") or row.get("image_id")
                if dedup:
                    if key in seen:
                        report.duplicates_dropped += 1
                        continue
                    seen.add(key)
                if media.path is None:
                    report.missing += 1
                    missing_list.append(media.candidates[0])
                    if len(report.missing_examples) < MAX_EXAMPLES:
                        report.missing_examples.append(media.candidates[0])
                    if missing == "error":
                        raise FileNotFoundError(
                            f"{dataset} {split}: media of {key!r} not found (tried {media.candidates}); "
                            f"use --missing drop or keep to build anyway"
                        )
                    if missing == "drop":
                        continue
                path = media.path or media.candidates[0]
                if relative_paths and os.path.isabs(path):
                    path = os.path.relpath(path, out_abs)
                writer.write({spec.media_column: path, **row})
                report.rows += 1
        finally:
            report.files = [os.path.basename(p) for p in writer.close()]
        missing_file = os.path.join(output_dir, f"missing_{prefix}{split}.txt")
        if missing_list:
            with open(missing_file, "w", encoding="utf-8") as f:
                f.write("\n".join(missing_list) + "\n")
            action = {"drop": "dropped", "keep": "kept"}[missing]
            print(f"WARNING: {dataset} {split}: {report.missing} rows with missing media ({action}), e.g. "
                  f"{report.missing_examples}; full list in {missing_file}", file=sys.stderr)
        elif os.path.exists(missing_file):
            os.remove(missing_file)
        reports[split] = report
    if not reports:
        raise AnnotationNotFound(f"{dataset}: no annotation files for any of the splits {list(splits)} in "
                                 f"{annotations!r}")
    with open(os.path.join(output_dir, "build_report.json"), "w", encoding="utf-8") as f:
        json.dump({"dataset": dataset, "format": fmt, "num_shards": num_shards, "missing_policy": missing,
                   "max_words": words, "splits": {s: asdict(r) for s, r in reports.items()}}, f, indent=1)
        f.write("\n")
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(_card(dataset, reports, prefix, fmt, num_shards))
    return reports


def main(argv: list[str] | None = None) -> dict[str, SplitReport]:
    parser = argparse.ArgumentParser(
        prog="python -m processing.builders",
        description="Convert a public dataset's annotations into TESTA's jsonl/parquet schema.",
        epilog="Datasets: " + ", ".join(DATASETS) + ". See the module docstring for the expected files.",
    )
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--annotations", required=True, help="annotation directory (webvid/cc3m: or the csv/tsv)")
    parser.add_argument("--videos", required=True, help="video directory (cc3m: image directory)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--num-shards", type=int, default=1, help="files per split (use a multiple of the GPUs)")
    parser.add_argument("--splits", nargs="+", default=None, help="subset of the dataset's splits")
    parser.add_argument("--missing", choices=("drop", "keep", "error"), default="drop",
                        help="what to do with rows whose media file is missing (always reported)")
    parser.add_argument("--relative-paths", action="store_true", help="media paths relative to --output-dir")
    parser.add_argument("--max-words", type=int, default=-1,
                        help="word limit of pre_caption/pre_question (default: the paper's per-dataset value)")
    parser.add_argument("--image-layout", choices=("img2dataset", "flat"), default="img2dataset", help="cc3m only")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    reports = build(args.dataset, args.annotations, args.videos, args.output_dir, fmt=args.format,
                    num_shards=args.num_shards, splits=args.splits, missing=args.missing,
                    relative_paths=args.relative_paths, max_words=args.max_words, image_layout=args.image_layout,
                    progress=not args.no_progress)
    for report in reports.values():
        print(f"{args.dataset} {report.summary()} -> {', '.join(report.files)}")
    return reports


if __name__ == "__main__":
    main()
