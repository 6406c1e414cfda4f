"""Conceptual Captions 3M (Sharma et al. 2018), image-text pretraining pairs.

Annotations: ``Train_GCC-training.tsv`` / ``Validation_GCC-1.1.0-Validation.tsv``, lines ``caption<TAB>url``. The
release has no header; img2dataset's CC3M guide adds the header ``caption<TAB>url``, which is detected (either
column order) and not read as a row. ``--annotations`` may also be one TSV file (one split).

Images (``--videos``), ``--image-layout``:

* ``img2dataset`` (default), ``--output_format files``: ``IMAGES/00000/000000000.jpg`` plus one ``IMAGES/00000.parquet``
  per shard with columns ``url``, ``key``, ``status``; every TSV url is mapped to its image through those tables
  (searched recursively). ``--output_format webdataset`` tar shards cannot be referenced as files: the build stops
  and says how to extract them into this layout;
* ``flat``: ``IMAGES/<data row index>.jpg`` (the header, if any, is not counted).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

from .build_common import (AnnotationError, Media, MediaError, OptionError, ReadOptions, RowStream, SplitSource,
                           clean_text, find_annotation, find_media)


IMAGE_LAYOUTS = ("img2dataset", "flat")
IMAGE_EXTENSIONS = (".jpg", ".png", ".webp")
HEADER_NAMES = {"caption", "url"}


def split_line(line: str, path: str, number: int) -> list[str]:
    """The two fields of a TSV line (else :class:`AnnotationError` naming the line)."""
    parts = line.split("\t")
    if len(parts) != 2:
        raise AnnotationError(f"{path}:{number}: expected 'caption<TAB>url', got {len(parts)} tab-separated fields")
    return parts


def tsv_pairs(path: str) -> Iterator[tuple[int, str, str]]:
    """(data row index, caption, url) of a CC3M TSV; a first line ``caption<TAB>url`` (any order) is a header."""
    with open(path, encoding="utf-8", newline="") as f:
        caption_col, index = 0, 0
        for number, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            parts = split_line(line, path, number)
            if number == 1 and {p.strip().lower() for p in parts} == HEADER_NAMES:
                caption_col = [p.strip().lower() for p in parts].index("caption")
                continue
            yield index, parts[caption_col], parts[1 - caption_col]
            index += 1


def unextracted_shards(images: str) -> list[str]:
    """img2dataset webdataset shards (``NNNNN.tar``) under `images` that have no extracted folder beside them."""
    tars = sorted(glob.glob(os.path.join(glob.escape(images), "**", "*.tar"), recursive=True))
    return [t for t in tars if not os.path.isdir(os.path.splitext(t)[0])]


def img2dataset_index(images: str) -> dict[str, list[str]]:
    """url -> candidate image paths, from img2dataset's per-shard parquet tables (rows with status "success")."""
    import pyarrow.parquet as pq

    index: dict[str, list[str]] = {}
    for parquet in sorted(glob.glob(os.path.join(glob.escape(images), "**", "*.parquet"), recursive=True)):
        table = pq.read_table(parquet)
        missing = [c for c in ("url", "key") if c not in table.column_names]
        if missing:
            raise AnnotationError(f"{parquet}: not an img2dataset shard table: no column(s) {missing} (expected url, "
                                  f"key, status)")
        folder = os.path.splitext(parquet)[0]
        urls, keys = table.column("url").to_pylist(), table.column("key").to_pylist()
        status = table.column("status").to_pylist() if "status" in table.column_names else ["success"] * len(urls)
        for url, key, state in zip(urls, keys, status):
            if state == "success" and url not in index:
                index[url] = [os.path.join(folder, f"{key}{ext}") for ext in IMAGE_EXTENSIONS]
    return index


def check_image_folder(images: str, layout: str) -> dict[str, list[str]]:
    """The url index for `layout` (empty for ``flat``), or :class:`MediaError` for webdataset shards / no tables."""
    if layout not in IMAGE_LAYOUTS:
        raise OptionError(f"--image-layout must be one of {IMAGE_LAYOUTS}, got {layout!r}")
    shards = unextracted_shards(images)
    if shards:
        raise MediaError(
            f"{images!r} holds img2dataset webdataset shards ({os.path.basename(shards[0])}, {len(shards)} in all), "
            f"which the builder does not read: re-run img2dataset with --output_format files, or extract every shard "
            f"into a folder of its name: for t in {images}/*.tar; do mkdir -p \"${{t%.tar}}\" && tar -xf \"$t\" "
            f"-C \"${{t%.tar}}\"; done"
        )
    if layout == "flat":
        return {}
    index = img2dataset_index(images)
    if not index:
        raise MediaError(f"no img2dataset shard tables (NNNNN.parquet with url, key, status) under {images!r}; "
                         f"download with img2dataset --output_format files, or pass --image-layout flat for "
                         f"IMAGES/<row index>.jpg")
    return index


def read_cc3m(annotations: str, videos: str, split: str, options: ReadOptions) -> SplitSource:
    """One CC3M TSV as ``{text, image_id}`` rows with their images (see the module docstring)."""
    names = {"train": ["Train_GCC-training.tsv", "train.tsv"],
             "val": ["Validation_GCC-1.1.0-Validation.tsv", "val.tsv"]}.get(split, [f"{split}.tsv"])
    path = annotations if os.path.isfile(annotations) else find_annotation(annotations, names, f"CC3M {split} tsv")
    index = check_image_folder(videos, options.image_layout)

    def rows() -> RowStream:
        for row_index, caption, url in tsv_pairs(path):
            text = clean_text(caption, options.max_words)
            if options.image_layout == "flat":
                yield {"text": text, "image_id": str(row_index)}, find_media(
                    [os.path.join(videos, f"{row_index}{ext}") for ext in IMAGE_EXTENSIONS])
            elif url in index:
                media = find_media(index[url])
                yield {"text": text, "image_id": os.path.splitext(os.path.basename(index[url][0]))[0]}, media
            else:  # not downloaded: reported by its url
                yield {"text": text, "image_id": str(row_index)}, Media([url], None)

    return SplitSource([path], "release", rows())
