"""What every dataset builder shares: errors, text cleaning, media look-up, annotation file look-up and parsing, and
the paragraph of a video from its timed sentences.

The readers (``build_<dataset>.py``) turn one split of one annotation release into a :class:`SplitSource`: the files
read, the format detected in them, and a stream of ``(row, Media)`` pairs. :mod:`processing.builders` writes them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


# ----------------------------------------------------------------------------------------------------------------
# errors


class BuildError(Exception):
    """A build cannot go on; the message names the input (file, field, expected format) and what to do."""


class AnnotationError(BuildError, ValueError):
    """An annotation file is missing or malformed; the message names the file, the field and the expected format."""


class AnnotationNotFound(AnnotationError, FileNotFoundError):
    """No annotation file of a split exists; the message lists the names looked for."""


class OptionError(BuildError, ValueError):
    """An argument of the build is not valid; the message names it and the allowed values."""


class MediaError(BuildError, FileNotFoundError):
    """Videos / images are missing beyond what the build allows, or their folder has an unsupported layout."""


# ----------------------------------------------------------------------------------------------------------------
# text normalisation (the behaviour of the original TESTA `data/utils.py`)


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


def clean_text(text: str, max_words: int | None) -> str:
    """`text` through :func:`pre_caption` with `max_words`, or unchanged when `max_words` is None (raw setting)."""
    return text if max_words is None else pre_caption(text, max_words)


# ----------------------------------------------------------------------------------------------------------------
# paragraphs from timed sentences

SENTENCE_ORDERS = ("time", "file")


@dataclass(frozen=True)
class Sentence:
    """One description of a video: its text and its (start, end) in seconds, or None where the release has none."""

    text: str
    start: float | None = None
    end: float | None = None


def order_sentences(sentences: Sequence[Sentence], order: str) -> list[Sentence]:
    """The sentences in `order`: ``"file"`` keeps the release's order; ``"time"`` sorts by start time.

    The sort is stable (equal starts keep file order). Sentences without a start time stay in file order.
    """
    if order not in SENTENCE_ORDERS:
        raise OptionError(f"sentence order must be one of {SENTENCE_ORDERS}, got {order!r}")
    if order == "file" or any(s.start is None for s in sentences):
        return list(sentences)
    return sorted(sentences, key=lambda s: s.start)  # type: ignore[arg-type, return-value]


def paragraph_fields(sentences: Sequence[Sentence], order: str, max_words: int | None) -> dict:
    """Row fields of a paragraph: ``text`` (sentences stripped, joined by single spaces, then cleaned), ``sentences``
    and, where every sentence has times, ``timestamps`` (``[start, end]`` in seconds, in the same order)."""
    ordered = order_sentences(sentences, order)
    texts = [s.text.strip() for s in ordered]
    fields: dict = {"text": clean_text(" ".join(texts), max_words), "sentences": texts}
    if ordered and all(s.start is not None and s.end is not None for s in ordered):
        fields["timestamps"] = [[float(s.start), float(s.end)] for s in ordered]  # type: ignore[arg-type]
    return fields


def is_reordered(sentences: Sequence[Sentence], order: str) -> bool:
    """Whether `order` changes the release's order of `sentences`."""
    return [id(s) for s in order_sentences(sentences, order)] != [id(s) for s in sentences]


# ----------------------------------------------------------------------------------------------------------------
# media


@dataclass
class Media:
    """Where a row's video/image should be: `path` if found; else `candidates[0]` is reported as the expected path."""

    candidates: list[str]
    path: str | None


def find_media(candidates: Sequence[str]) -> Media:
    """The first existing file among `candidates` (tried in order; duplicates are tried once)."""
    unique = list(dict.fromkeys(candidates))
    for candidate in unique:
        if os.path.isfile(candidate):
            return Media(unique, candidate)
    return Media(unique, None)


# ----------------------------------------------------------------------------------------------------------------
# annotation files


def find_annotation(directory: str, names: Sequence[str], what: str, subdirs: Sequence[str] = ("",)) -> str:
    """The first existing ``directory/subdir/name`` (subdirs outer, names inner); else :class:`AnnotationNotFound`
    listing every name looked for."""
    for subdir in subdirs:
        for name in names:
            path = os.path.join(directory, subdir, name)
            if os.path.isfile(path):
                return path
    looked = [os.path.join(subdir, name) for subdir in subdirs for name in names]
    raise AnnotationNotFound(f"{what} not found in {directory!r}: looked for {looked}")


def find_optional(directory: str, names: Sequence[str], subdirs: Sequence[str] = ("",)) -> str | None:
    """Like :func:`find_annotation`, but None when no file exists."""
    try:
        return find_annotation(directory, names, "", subdirs)
    except AnnotationNotFound:
        return None


def describe(value: object) -> str:
    """A short description of a JSON value for error messages: its type and, for objects, some keys."""
    if isinstance(value, dict):
        keys = list(value)[:6]
        return f"an object with keys {keys}{' ...' if len(value) > 6 else ''}"
    if isinstance(value, list):
        return f"a list of {len(value)} items" + (f", the first {describe(value[0])}" if value else "")
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def load_json_any(path: str) -> object:
    """A JSON document, or JSON lines: a file of one value per line gives the list of those values, except that lines
    holding lists are concatenated (TESTA-style converted files keep their whole list on line 0). A ``.jsonl`` file is
    always read as JSON lines (so that one line gives a list of one)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise AnnotationError(f"{path}: the file is empty; expected JSON")
    whole_error = "a .jsonl file is JSON lines"
    if not path.endswith(".jsonl"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            whole_error = str(error)
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise AnnotationError(f"{path}: neither one JSON document ({whole_error}) nor JSON lines (line "
                                  f"{number}: {error})") from None
    if values and all(isinstance(v, list) for v in values):
        return [item for value in values for item in value]
    return values


def require_field(record: object, key: str, path: str, where: str, expected: str) -> object:
    """``record[key]``, or :class:`AnnotationError` naming the file, the record, the field and the expected format."""
    if not isinstance(record, dict):
        raise AnnotationError(f"{path}: {where} should be an object ({expected}), got {describe(record)}")
    if key not in record:
        raise AnnotationError(f"{path}: {where} has no field {key!r}; expected {expected}, got fields {sorted(record)}")
    return record[key]


def require_text(value: object, path: str, where: str) -> str:
    """`value` if it is a string, else :class:`AnnotationError`."""
    if not isinstance(value, str):
        raise AnnotationError(f"{path}: {where} should be a string, got {describe(value)}")
    return value


def require_seconds(value: object, path: str, where: str) -> float:
    """`value` as float seconds if it is a non-negative number, else :class:`AnnotationError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise AnnotationError(f"{path}: {where} should be a non-negative number of seconds, got {value!r}")
    return float(value)


def text_list(value: object, path: str, where: str) -> list[str]:
    """A caption field as a list of sentences: a string is one sentence, a list must hold strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise AnnotationError(f"{path}: {where} should be a string or a list of strings, got {describe(value)}")


# ----------------------------------------------------------------------------------------------------------------
# what a reader returns

# (row without its media column, Media) pairs of one split
RowStream = Iterator[tuple[dict, Media]]


@dataclass
class ReadOptions:
    """Options every reader receives (each uses those that apply to it)."""

    max_words: int | None
    sentence_order: str = "time"
    image_layout: str = "img2dataset"


@dataclass
class SplitSource:
    """One split of a release: files read, the format detected in them, the rows, and dataset-specific counts that
    the reader fills while the rows are consumed (e.g. videos whose sentences were reordered)."""

    files: list[str]
    format: str
    rows: RowStream
    details: dict = field(default_factory=dict)
