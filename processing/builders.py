"""Builders: the public datasets' annotation releases -> our schema, as jsonl or parquet shards plus video paths.

``docs/data.md`` says, for every dataset, where the annotations and videos come from, the command, and the counts
to expect. Each reader detects the format of its files by content and names it in its errors:

==================== ====================================================================== ============ ===========
dataset              annotations (``--annotations DIR``; reader module)                     text         word limit
==================== ====================================================================== ============ ===========
``queryd``           ``raw_captions_combined_filtered.pkl`` + ``[exists_]{split}_list.txt``  paragraph    128
                     (+ ``times_captions_...pkl``) (:mod:`.build_queryd`)
``didemo``           ``{split}_data.json`` release, or converted ``{split}.json`` /          paragraph    raw
                     ``{split}.jsonl`` (:mod:`.build_didemo`)
``activitynet``      ``train.json``, ``val_1.json`` (-> test), ``val_2.json`` (-> val), or   paragraph    50
                     converted ``train.json`` / ``val.json`` (:mod:`.build_activitynet`)
``condensed_movies`` challenge ``train_val_challf0.csv`` / ``test_challf0.csv``, or metadata    description  50
                     ``split.csv`` + ``descriptions.csv`` (:mod:`.build_condensed_movies`)
``activitynet_qa``   ``{split}_q.json`` + ``{split}_a.json`` (:mod:`.build_activitynet`)      question     50
``webvid``           ``results_2M_{split}.csv`` (:mod:`.build_webvid`)                        caption      30
``cc3m``             ``Train_GCC-training.tsv`` / ``Validation_GCC-1.1.0-Validation.tsv``     caption      30
                     (:mod:`.build_cc3m`)
==================== ====================================================================== ============ ===========

Paragraphs join a video's sentences with single spaces, in time order by default (``--sentence-order file`` keeps
the release's order), then :func:`pre_caption` (lower-case, ``!"()*#~`` -> space, whitespace runs collapsed, at most
``max_words`` words); DiDeMo's paragraph stays raw, as in the paper. Questions go through :func:`pre_question`.

Rows: retrieval / pretraining ``{"video", "text", "video_id"}`` (CC3M: ``{"image", "text", "image_id"}``), plus
``sentences``, ``timestamps`` (``[start, end]`` seconds per sentence), ``duration`` and ``video_names`` where the
release has them; QA ``{"video", "question", "answer", "video_id", "question_id"}``. Evaluation splits keep one row
per video (the first).

Nothing is lost silently and nothing is half-written:

* missing videos are reported once per video, with the rows each affects (``OUT/missing_<split>.tsv`` and
  ``build_report.json``); ``--missing drop`` (default) drops their rows, ``keep`` keeps them, ``error`` stops;
* the build fails (exit 1) when a split ends empty or ``drop`` loses more than ``--max-missing-share`` (default 5%)
  of a split's videos, unless ``--allow-missing``;
* everything is written to a temporary folder beside ``OUT`` that replaces ``OUT`` only when the whole build
  succeeded. Splits of a previous build of the same dataset in ``OUT`` that are not rebuilt are carried over.

Output (``PREFIX`` is ``qa_`` for ActivityNet-QA, else empty)::

    OUT/PREFIX<split>.jsonl | OUT/PREFIX<split>-00000-of-00004.parquet ...   rows, spread round-robin over shards
    OUT/README.md          dataset card (``load_dataset(OUT)`` works)
    OUT/build_report.json  per split: format, files read, rows, videos, missing videos/rows, duplicates, details
    OUT/missing_PREFIX<split>.tsv  video_id, rows, expected path of every missing video (only if any)

Media paths are absolute by default; ``--relative-paths`` writes them relative to ``OUT``. :func:`processing.load_split`
resolves both.

Usage::

    python -m processing.builders DATASET --annotations DIR --videos DIR --output-dir OUT \\
        [--format jsonl|parquet] [--num-shards N] [--splits train val test] [--missing drop|keep|error] \\
        [--max-missing-share 0.05] [--allow-missing] [--sentence-order time|file] [--debug]

Errors print one line naming the file, the field and the expected format (``--debug``: the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields

from .build_activitynet import read_activitynet, read_activitynet_qa
from .build_cc3m import IMAGE_LAYOUTS, read_cc3m
from .build_common import (
    SENTENCE_ORDERS,
    AnnotationError,
    AnnotationNotFound,
    BuildError,
    Media,
    MediaError,
    OptionError,
    ReadOptions,
    SplitSource,
    find_media,
    pre_caption,
    pre_question,
)
from .build_condensed_movies import read_condensed_movies
from .build_didemo import read_didemo
from .build_output import FORMATS, ShardWriter, card, staging
from .build_queryd import read_queryd
from .build_webvid import read_webvid


MAX_EXAMPLES = 5  # missing videos listed in reports and messages
MISSING_POLICIES = ("drop", "keep", "error")
DEFAULT_MAX_MISSING_SHARE = 0.05


@dataclass
class DatasetSpec:
    """A registered dataset: its split names, row kind and the function that reads one split."""

    name: str
    splits: tuple[str, ...]
    media_column: str  # "video" or "image"
    task: str  # "retrieval", "pretrain" or "qa"
    max_words: int | None  # default word limit of pre_caption (None: text used raw)
    dedup_eval: bool  # keep one row per video in val/test
    read: Callable[[str, str, str, ReadOptions], SplitSource]

    @property
    def prefix(self) -> str:
        """File name prefix of the dataset's splits (``qa_`` for QA)."""
        return "qa_" if self.task == "qa" else ""


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("queryd", ("train", "val", "test"), "video", "retrieval", 128, True, read_queryd),
        DatasetSpec("didemo", ("train", "val", "test"), "video", "retrieval", None, True, read_didemo),
        DatasetSpec("activitynet", ("train", "val", "test"), "video", "retrieval", 50, True, read_activitynet),
        DatasetSpec("condensed_movies", ("train", "val", "test"), "video", "retrieval", 50, True,
                    read_condensed_movies),
        DatasetSpec("activitynet_qa", ("train", "val", "test"), "video", "qa", 50, False, read_activitynet_qa),
        DatasetSpec("webvid", ("train", "val"), "video", "pretrain", 30, False, read_webvid),
        DatasetSpec("cc3m", ("train", "val"), "image", "pretrain", 30, False, read_cc3m),
    )
}


@dataclass
class SplitReport:
    """What a build did with one split (``build_report.json`` holds one per split)."""

    split: str
    format: str = ""
    annotation_files: list[str] = field(default_factory=list)
    rows: int = 0
    videos: int = 0  # distinct videos / images of the split's rows (after dropping eval duplicates)
    missing_videos: int = 0
    missing_rows: int = 0
    missing_examples: list[dict] = field(default_factory=list)  # {video_id, rows, path}
    duplicates_dropped: int = 0
    files: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> SplitReport:
        """A report read back from ``build_report.json`` (unknown keys ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def missing_share(self) -> float:
        """Share of the split's videos that are missing."""
        return self.missing_videos / self.videos if self.videos else 0.0

    def summary(self) -> str:
        """One line: rows, videos, missing and duplicates."""
        text = f"{self.split}: {self.rows} rows, {self.videos} videos ({self.format})"
        if self.duplicates_dropped:
            text += f", {self.duplicates_dropped} duplicate rows of already listed videos dropped"
        if self.missing_videos:
            text += f", {self.missing_videos} missing videos ({self.missing_rows} rows)"
        return text


@dataclass
class MissingVideo:
    """A video (or image) not found: the path reported (first candidate) and how many rows it affects."""

    video_id: str
    path: str
    rows: int = 0


# ----------------------------------------------------------------------------------------------------------------
# one split


def consume_split(spec: DatasetSpec, source: SplitSource, split: str, writer: ShardWriter, missing: str,
                  relative_to: str | None) -> tuple[SplitReport, dict[str, MissingVideo]]:
    """Writes the rows of `source` whose media exist (or all, with ``missing="keep"``) and counts what happened."""
    report = SplitReport(split, source.format, source.files)
    lost: dict[str, MissingVideo] = {}
    seen: set[str] = set()
    dedup = spec.dedup_eval and split != "train"
    for row, media in source.rows:
        key = str(row.get("video_id", row.get("image_id")))
        if dedup and key in seen:
            report.duplicates_dropped += 1
            continue
        seen.add(key)
        if media.path is None:
            entry = lost.setdefault(key, MissingVideo(key, media.candidates[0]))
            entry.rows += 1
            if missing != "keep":
                continue
        path = media.path or media.candidates[0]
        if relative_to and os.path.isabs(path):
            path = os.path.relpath(path, relative_to)
        writer.write({spec.media_column: path, **row})
        report.rows += 1
    report.videos = len(seen)
    report.missing_videos = len(lost)
    report.missing_rows = sum(m.rows for m in lost.values())
    report.missing_examples = [asdict(m) for m in list(lost.values())[:MAX_EXAMPLES]]
    report.details = dict(source.details)
    return report, lost


def write_missing_list(path: str, lost: dict[str, MissingVideo]) -> None:
    """``video_id<TAB>rows<TAB>expected path`` per missing video, with a header line."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("video_id\trows\texpected_path\n")
        for entry in lost.values():
            f.write(f"{entry.video_id}\t{entry.rows}\t{entry.path}\n")


def split_problem(report: SplitReport, missing: str, max_missing_share: float) -> str | None:
    """Why a split must fail the build (empty, or too many videos dropped), or None."""
    if report.rows == 0:
        if report.videos and report.missing_videos == report.videos:
            example = report.missing_examples[0]["path"] if report.missing_examples else "?"
            return f"{report.split} is empty: all {report.videos} videos are missing (e.g. {example})"
        return f"{report.split} is empty: {report.annotation_files} list no entries for it"
    if missing == "drop" and report.missing_share > max_missing_share:
        return (f"{report.split} lost {report.missing_videos} of {report.videos} videos "
                f"({report.missing_share:.1%} > --max-missing-share {max_missing_share:g}), e.g. "
                f"{report.missing_examples[0]['path']}")
    return None


# ----------------------------------------------------------------------------------------------------------------
# the whole build


def resolve_splits(spec: DatasetSpec, annotations: str, splits: Iterable[str] | None) -> tuple[tuple[str, ...], bool]:
    """The splits to build and whether they were asked for explicitly."""
    explicit = bool(splits)
    chosen = tuple(splits) if splits else spec.splits
    if os.path.isfile(annotations):  # one csv/tsv file (webvid, cc3m) is one split: train unless told otherwise
        if spec.name not in ("webvid", "cc3m"):
            raise OptionError(f"{spec.name} needs an annotation directory, got the file {annotations!r}")
        if not explicit:
            chosen = ("train",)
        elif len(chosen) != 1:
            raise OptionError(f"--annotations {annotations!r} is one file: build one split from it, got {chosen}")
    unknown = [s for s in chosen if s not in spec.splits]
    if unknown:
        raise OptionError(f"{spec.name} has no split(s) {unknown}; its splits are {list(spec.splits)}")
    return chosen, explicit


def previous_build(output_dir: str, dataset: str) -> dict:
    """The ``build_report.json`` of a previous build in `output_dir` ({} if none); another dataset's is an error."""
    path = os.path.join(output_dir, "build_report.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        previous = json.load(f)
    if previous.get("dataset") != dataset:
        raise OptionError(f"--output-dir {output_dir!r} holds a build of {previous.get('dataset')!r}, not {dataset!r}; "
                          f"choose another folder")
    return previous


def carry_over(previous: dict, output_dir: str, stage: str, prefix: str, built: Iterable[str]) -> dict[str, dict]:
    """Links (or copies) the files of the previous build's splits that this build does not write into `stage`;
    returns their report entries."""
    carried = {}
    for split, entry in previous.get("splits", {}).items():
        if split in built:
            continue
        names = list(entry.get("files", [])) + [f"missing_{prefix}{split}.tsv"]
        for name in names:
            source = os.path.join(output_dir, name)
            if not os.path.isfile(source):
                continue
            try:
                os.link(source, os.path.join(stage, name))
            except OSError:
                shutil.copy2(source, os.path.join(stage, name))
        carried[split] = entry
    return carried


def file_pattern(files: list[str]) -> str:
    """The dataset-card pattern of a split's files: the file itself, or ``stem-*-of-NNNNN.ext`` for shards."""
    if len(files) == 1:
        return files[0]
    return re.sub(r"-\d{5}-of-(\d{5})", r"-*-of-\1", files[0])


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
    sentence_order: str = "time",
    max_missing_share: float = DEFAULT_MAX_MISSING_SHARE,
    allow_missing: bool = False,
) -> dict[str, SplitReport]:
    """Builds `dataset` into `output_dir` and returns one :class:`SplitReport` per split built.

    Args:
        dataset: a key of :data:`DATASETS`.
        annotations: directory of the annotation files (WebVid / CC3M: also a single csv / tsv file).
        videos: directory of the videos (CC3M: of the images).
        output_dir: destination; replaced as a whole when the build succeeds, untouched when it fails.
        fmt: ``"jsonl"`` or ``"parquet"``.
        num_shards: files per split; rows are spread round-robin so shard sizes differ by at most one.
        splits: splits to build. Default: every split whose annotation file exists (a note is printed for the
            others); an explicitly requested split without annotations is an error.
        missing: rows whose video is missing are ``"drop"``-ped, ``"keep"``-t, or stop the build (``"error"``);
            always reported once per video.
        relative_paths: write media paths relative to `output_dir` instead of absolute.
        max_words: word limit of the text cleaning; ``-1`` = the dataset's default (paper setting), ``None`` = raw.
        image_layout: CC3M only: ``"img2dataset"`` or ``"flat"``.
        progress: show a tqdm progress bar per split.
        sentence_order: ``"time"`` (sort a video's sentences by start time) or ``"file"`` (the release's order).
        max_missing_share: with ``drop``, the largest share of a split's videos that may be missing.
        allow_missing: build even when a split ends empty or loses more than `max_missing_share`.

    Raises:
        BuildError: with a one-line message naming the input (its subclasses :class:`AnnotationError`,
            :class:`MediaError`, :class:`OptionError`).
    """
    from tqdm.auto import tqdm

    if dataset not in DATASETS:
        raise OptionError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    if missing not in MISSING_POLICIES:
        raise OptionError(f"--missing must be one of {MISSING_POLICIES}, got {missing!r}")
    if sentence_order not in SENTENCE_ORDERS:
        raise OptionError(f"--sentence-order must be one of {SENTENCE_ORDERS}, got {sentence_order!r}")
    if fmt not in FORMATS:
        raise OptionError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if not 0 <= max_missing_share <= 1:
        raise OptionError(f"--max-missing-share must be between 0 and 1, got {max_missing_share}")
    if image_layout not in IMAGE_LAYOUTS:
        raise OptionError(f"--image-layout must be one of {IMAGE_LAYOUTS}, got {image_layout!r}")
    spec = DATASETS[dataset]
    chosen, explicit = resolve_splits(spec, annotations, splits)
    if not os.path.exists(annotations):
        raise AnnotationNotFound(f"--annotations {annotations!r} does not exist")
    if not os.path.isdir(videos):
        raise MediaError(f"--videos {videos!r} is not a directory")
    words = spec.max_words if max_words == -1 else max_words
    options = ReadOptions(words, sentence_order, image_layout)
    out_abs = os.path.abspath(output_dir)
    previous = previous_build(out_abs, dataset)
    reports: dict[str, SplitReport] = {}
    skipped: list[str] = []
    with staging(out_abs) as stage:
        for split in chosen:
            try:
                source = spec.read(os.path.abspath(annotations), os.path.abspath(videos), split, options)
            except AnnotationNotFound as error:
                if explicit:
                    raise
                skipped.append(str(error))
                continue
            writer = ShardWriter(stage, f"{spec.prefix}{split}", fmt, num_shards)
            try:
                rows = tqdm(source.rows, desc=f"{dataset} {split}", unit="row", disable=not progress)
                source.rows = iter(rows)
                report, lost = consume_split(spec, source, split, writer, missing,
                                             out_abs if relative_paths else None)
            finally:
                report_files = [os.path.basename(p) for p in writer.close()]
            report.files = report_files
            if lost and missing == "error":
                first = next(iter(lost.values()))
                raise MediaError(f"{dataset} {split}: {len(lost)} of {report.videos} videos missing ({first.path!r} "
                                 f"and more); nothing was written. --missing keep writes the full list to "
                                 f"missing_{spec.prefix}{split}.tsv")
            if lost:
                write_missing_list(os.path.join(stage, f"missing_{spec.prefix}{split}.tsv"), lost)
            reports[split] = report
        if not reports:
            raise AnnotationNotFound(f"{dataset}: no annotation files for any of the splits {list(chosen)}: "
                                     + "; ".join(skipped))
        for note in skipped:
            print(f"note: {dataset}: split skipped: {note}", file=sys.stderr)
        problems = [p for r in reports.values() if (p := split_problem(r, missing, max_missing_share))]
        if problems and not allow_missing:
            raise MediaError(f"{dataset}: " + "; ".join(problems) + f". Nothing was written to {output_dir!r}: check "
                             f"--videos {videos!r}, or pass --allow-missing (or a larger --max-missing-share)")
        carried = carry_over(previous, out_abs, stage, spec.prefix, reports)
        all_reports = {**{s: SplitReport.from_dict(e) for s, e in carried.items()}, **reports}
        with open(os.path.join(stage, "build_report.json"), "w", encoding="utf-8") as f:
            json.dump({"dataset": dataset, "annotations": os.path.abspath(annotations),
                       "videos": os.path.abspath(videos), "format": fmt, "num_shards": num_shards,
                       "missing_policy": missing, "max_missing_share": max_missing_share,
                       "allow_missing": allow_missing, "max_words": words, "sentence_order": sentence_order,
                       "splits": {s: asdict(r) for s, r in all_reports.items()}}, f, indent=1)
            f.write("\n")
        with open(os.path.join(stage, "README.md"), "w", encoding="utf-8") as f:
            f.write(card(dataset, {s: file_pattern(r.files) for s, r in all_reports.items()},
                         [r.summary() for r in all_reports.values()]))
    for report in reports.values():
        if report.missing_videos:
            action = {"drop": "dropped", "keep": "kept"}[missing]
            print(f"WARNING: {dataset} {report.split}: {report.missing_videos} of {report.videos} videos missing "
                  f"({report.missing_rows} rows {action}), e.g. {report.missing_examples[0]['path']}; list in "
                  f"{os.path.join(output_dir, f'missing_{spec.prefix}{report.split}.tsv')}", file=sys.stderr)
    return reports


# ----------------------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of ``python -m processing.builders``."""
    parser = argparse.ArgumentParser(
        prog="python -m processing.builders",
        description="Convert a public dataset's annotation release into TESTA's jsonl/parquet schema.",
        epilog="Datasets: " + ", ".join(DATASETS) + ". docs/data.md gives the files and command of each.",
    )
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--annotations", required=True, help="annotation directory (webvid/cc3m: or the csv/tsv)")
    parser.add_argument("--videos", required=True, help="video directory (cc3m: image directory)")
    parser.add_argument("--output-dir", required=True, help="replaced as a whole when the build succeeds")
    parser.add_argument("--format", choices=FORMATS, default="jsonl")
    parser.add_argument("--num-shards", type=int, default=1, help="files per split (use a multiple of the GPUs)")
    parser.add_argument("--splits", nargs="+", default=None, help="subset of the dataset's splits")
    parser.add_argument("--missing", choices=MISSING_POLICIES, default="drop",
                        help="what to do with rows whose video is missing (always reported, once per video)")
    parser.add_argument("--max-missing-share", type=float, default=DEFAULT_MAX_MISSING_SHARE,
                        help="fail when --missing drop loses more than this share of a split's videos (default "
                             "%(default)s)")
    parser.add_argument("--allow-missing", action="store_true",
                        help="build even when a split ends empty or loses more than --max-missing-share")
    parser.add_argument("--sentence-order", choices=SENTENCE_ORDERS, default="time",
                        help="order of a video's sentences in its paragraph: by start time (default) or as in the file")
    parser.add_argument("--relative-paths", action="store_true", help="media paths relative to --output-dir")
    parser.add_argument("--max-words", type=int, default=-1,
                        help="word limit of pre_caption/pre_question (default: the paper's per-dataset value)")
    parser.add_argument("--image-layout", choices=IMAGE_LAYOUTS, default="img2dataset", help="cc3m only")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs a build; returns the exit status (0 built, 1 the build failed: one line on stderr, 2 bad usage)."""
    args = parse_args(argv)
    try:
        reports = build(args.dataset, args.annotations, args.videos, args.output_dir, fmt=args.format,
                        num_shards=args.num_shards, splits=args.splits, missing=args.missing,
                        relative_paths=args.relative_paths, max_words=args.max_words,
                        image_layout=args.image_layout, progress=not args.no_progress,
                        sentence_order=args.sentence_order, max_missing_share=args.max_missing_share,
                        allow_missing=args.allow_missing)
    except (BuildError, OSError) as error:
        if args.debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    for report in reports.values():
        print(f"{args.dataset} {report.summary()} -> {', '.join(report.files)}")
    return 0


__all__ = [
    "DATASETS", "AnnotationError", "AnnotationNotFound", "BuildError", "DatasetSpec", "Media", "MediaError",
    "OptionError", "SplitReport", "build", "find_media", "main", "pre_caption", "pre_question",
]


if __name__ == "__main__":
    sys.exit(main())
