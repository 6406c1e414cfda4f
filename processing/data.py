"""Loading our jsonl / parquet splits with `datasets`, with video and image paths resolved.

File layout written by :mod:`processing.synthetic` and :mod:`processing.builders` (``PREFIX`` is ``""`` for
retrieval / pretraining rows and ``"qa_"`` for QA rows)::

    DIR/PREFIXtrain.jsonl                       # one shard
    DIR/PREFIXtrain-00000-of-00004.parquet      # or several shards (jsonl or parquet)
    DIR/README.md                               # dataset card whose `configs:` make `load_dataset(DIR)` work

Relative ``video`` / ``image`` paths in those files are relative to ``DIR`` (the directory of the file).
"""

from __future__ import annotations

import glob
import os
from typing import Any


MEDIA_COLUMNS = ("video", "image")
TASK_PREFIXES = {"retrieval": "", "pretrain": "", "qa": "qa_"}
SPLIT_ALIASES = {
    "train": ("train",),
    "val": ("val", "validation", "valid", "dev"),
    "validation": ("val", "validation", "valid", "dev"),
    "valid": ("val", "validation", "valid", "dev"),
    "dev": ("val", "validation", "valid", "dev"),
    "test": ("test",),
}
EXTENSIONS = ("jsonl", "json", "parquet")


def resolve_media_path(path: str, base_dir: str) -> str:
    """Returns `path` unchanged if it is absolute, else `path` joined to `base_dir` (normalised, absolute)."""
    if not isinstance(path, str):
        raise TypeError(f"expected a video/image path string, got {type(path).__name__}: {path!r}")
    if os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(os.path.abspath(base_dir), path))


def split_files(data_dir: str, split: str, task: str = "retrieval") -> list[str]:
    """The files of one split in a directory written by our generators / builders, sorted.

    Args:
        data_dir: the directory (``DIR`` above).
        split: ``"train"``, ``"val"`` (alias ``"validation"``), ``"test"`` or any other name used in the file names.
        task: ``"retrieval"`` / ``"pretrain"`` (files without prefix) or ``"qa"`` (files prefixed ``qa_``).
    """
    if task not in TASK_PREFIXES:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASK_PREFIXES)}")
    prefix = TASK_PREFIXES[task]
    for name in SPLIT_ALIASES.get(split, (split,)):
        for ext in EXTENSIONS:
            single = os.path.join(data_dir, f"{prefix}{name}.{ext}")
            if os.path.isfile(single):
                return [single]
            shards = sorted(glob.glob(os.path.join(glob.escape(data_dir), f"{prefix}{name}-[0-9]*-of-[0-9]*.{ext}")))
            if shards:
                return shards
    present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(data_dir), "*")))
    raise FileNotFoundError(
        f"no {task!r} files for split {split!r} in {data_dir!r}: expected {prefix}{split}.jsonl / .parquet or "
        f"{prefix}{split}-XXXXX-of-XXXXX shards; the directory holds {present[:20]}"
    )


def load_split(
    path: str,
    split: str = "train",
    task: str = "retrieval",
    streaming: bool = False,
    resolve_paths: bool = True,
) -> Any:
    """Loads one split of our schema with `datasets.load_dataset` and makes its media paths absolute.

    Args:
        path: a directory written by :mod:`processing.synthetic` / :mod:`processing.builders`, or one jsonl /
            parquet file.
        split: split name (``"val"`` and ``"validation"`` are the same split); ignored when `path` is a file.
        task: ``"retrieval"``, ``"pretrain"`` or ``"qa"`` (see :func:`split_files`).
        streaming: return a `datasets.IterableDataset` instead of a `datasets.Dataset`.
        resolve_paths: turn relative ``video`` / ``image`` values into absolute paths (relative to the file's
            directory). Absolute paths are kept.

    Returns:
        `datasets.Dataset` or `datasets.IterableDataset` with the file's columns; media columns hold path strings
        (decode them with decord / PyAV or the `TestaVideoProcessor`).
    """
    import datasets

    if os.path.isfile(path):
        files, base_dir = [path], os.path.dirname(os.path.abspath(path))
    elif os.path.isdir(path):
        files, base_dir = split_files(path, split, task), os.path.abspath(path)
    else:
        raise FileNotFoundError(f"{path!r} is neither a file nor a directory")
    builder = "parquet" if files[0].endswith(".parquet") else "json"
    dataset = datasets.load_dataset(builder, data_files={"data": files}, split="data", streaming=streaming)
    if not resolve_paths:
        return dataset
    columns = dataset.column_names  # None for some streaming datasets: then every row is checked
    if columns is not None and not any(c in columns for c in MEDIA_COLUMNS):
        return dataset

    # a module-level function, not a closure: a streamed split is pickled into DataLoader workers (forkserver)
    return dataset.map(resolve_media_row, fn_kwargs={"base_dir": base_dir})


def resolve_media_row(row: dict, base_dir: str) -> dict:
    """The row's media columns (``video``, ``image``) resolved against `base_dir` (see `resolve_media_path`)."""
    return {c: resolve_media_path(row[c], base_dir) for c in MEDIA_COLUMNS if row.get(c) is not None}


__all__ = ["load_split", "resolve_media_path", "resolve_media_row", "split_files"]
