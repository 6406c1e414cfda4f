"""QuerYD (Oncescu et al. 2021) for paragraph-to-video retrieval.

The release (robots.ox.ac.uk, see ``oncescuandreea/QuerYD_downloader``'s README; also inside
``QuerYD-experts.tar.gz`` under ``data/QuerYD/structured-symlinks/``), looked for in ``--annotations DIR``, its
``structured-symlinks/`` and ``data/QuerYD/structured-symlinks/``:

* captions: ``raw_captions_combined_filtered.pkl`` (or as downloaded, ``raw_captions_combined_filtered-v2.pkl`` /
  ``-v1.pkl``): a pickled dict ``"video-<youtube id>"`` -> list of sentences, each a list of tokens;
* times (optional): ``times_captions_combined_filtered[-v2|-v1].pkl``, the same keys -> one ``[start, end]``
  (seconds) per sentence, in the same order;
* splits: ``exists_{split}_list.txt`` (the videos still online, as TESTA uses), else ``{split}_list.txt`` (the
  experts tarball): one video name per line.

Paragraph: every sentence's tokens joined by spaces, the sentences joined by spaces, then :func:`pre_caption`
(128 words, as TESTA). With a times file the sentences follow ``--sentence-order`` and rows keep ``timestamps``;
without one they stay in file order (the report says so).

Videos: ``<name>`` as ``download_queryd.py`` (pytube) saves them, then ``<name>.mp4`` / ``.mkv`` / ``.webm``.
"""

from __future__ import annotations

import os
import pickle

from .build_common import (AnnotationError, ReadOptions, RowStream, Sentence, SplitSource, describe, find_annotation,
                           find_media, find_optional, is_reordered, paragraph_fields, require_seconds)


SUBDIRS = ("", "structured-symlinks", os.path.join("data", "QuerYD", "structured-symlinks"))
VERSIONS = ("", "-v2", "-v1")
CAPTIONS_FORMAT = "a dict video name -> list of sentences (token lists)"
TIMES_FORMAT = "a dict video name -> list of [start, end] seconds, one per sentence"


def load_pickle_dict(path: str, expected: str) -> dict:
    """A pickled dict (else :class:`AnnotationError` naming the expected format)."""
    with open(path, "rb") as f:
        try:
            data = pickle.load(f)
        except (pickle.UnpicklingError, EOFError, ValueError) as error:
            raise AnnotationError(f"{path}: not a pickle file ({error}); expected {expected}") from None
    if not isinstance(data, dict):
        raise AnnotationError(f"{path}: expected {expected}, got {describe(data)}")
    return data


def sentence_texts(value: object, path: str, name: str) -> list[str]:
    """The sentences of a video: token lists joined by spaces (a plain string is taken as one sentence)."""
    if not isinstance(value, (list, tuple)):
        raise AnnotationError(f"{path}: captions of {name!r} should be a list of token lists, got {describe(value)}")
    texts = []
    for sentence in value:
        if isinstance(sentence, str):
            texts.append(sentence)
        elif isinstance(sentence, (list, tuple)) and all(isinstance(t, str) for t in sentence):
            texts.append(" ".join(sentence))
        else:
            raise AnnotationError(f"{path}: captions of {name!r} should be a list of token lists, got a sentence "
                                  f"{describe(sentence)}")
    return texts


def timed_sentences(texts: list[str], times: object, path: str, name: str) -> list[Sentence]:
    """`texts` with their ``[start, end]`` from the times pickle (same order), validated."""
    if not isinstance(times, (list, tuple)) or len(times) != len(texts):
        raise AnnotationError(f"{path}: times of {name!r} should be {len(texts)} [start, end] pairs (one per "
                              f"sentence), got {describe(times)}")
    sentences = []
    for index, (text, pair) in enumerate(zip(texts, times)):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise AnnotationError(f"{path}: times of {name!r}[{index}] should be [start, end], got {pair!r}")
        start = require_seconds(pair[0], path, f"times of {name!r}[{index}][0]")
        sentences.append(Sentence(text, start, require_seconds(pair[1], path, f"times of {name!r}[{index}][1]")))
    return sentences


def read_list(path: str) -> list[str]:
    """Video names, one per line (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def read_queryd(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """One split of QuerYD (see the module docstring)."""
    list_path = find_annotation(annotations, [f"exists_{split}_list.txt", f"{split}_list.txt"],
                                f"QuerYD {split} list", SUBDIRS)
    captions_path = find_annotation(annotations, [f"raw_captions_combined_filtered{v}.pkl" for v in VERSIONS],
                                    "QuerYD captions pickle", SUBDIRS)
    version = os.path.basename(captions_path)[len("raw_captions_combined_filtered"):-len(".pkl")]
    times_path = find_optional(annotations, [f"times_captions_combined_filtered{version}.pkl"], SUBDIRS)
    captions = load_pickle_dict(captions_path, CAPTIONS_FORMAT)
    times = load_pickle_dict(times_path, TIMES_FORMAT) if times_path else None
    names = read_list(list_path)
    order = options.sentence_order if times is not None else "file"
    source = SplitSource([p for p in (list_path, captions_path, times_path) if p], "release", iter(()),
                         {"sentence_order": order if times is not None else "file (no times file)",
                          "sentences_reordered": 0})

    def rows() -> RowStream:
        for name in names:
            if name not in captions:
                raise AnnotationError(f"{captions_path}: no captions for video {name!r} listed in {list_path}")
            texts = sentence_texts(captions[name], captions_path, name)
            if times is not None:
                if name not in times:
                    raise AnnotationError(f"{times_path}: no times for video {name!r} listed in {list_path}")
                sentences = timed_sentences(texts, times[name], str(times_path), name)
            else:
                sentences = [Sentence(text) for text in texts]
            source.details["sentences_reordered"] += is_reordered(sentences, order)
            row = {"video_id": name, **paragraph_fields(sentences, order, options.max_words)}
            base = os.path.join(videos, name)
            yield row, find_media([base, base + ".mp4", base + ".mkv", base + ".webm"])

    source.rows = rows()
    return source
