"""Data preparation for TESTA: a synthetic long-form video-language dataset, builders for the public datasets, and a
loader that resolves the video paths of our jsonl / parquet files.

Our schema (one row per line of a jsonl file or per row of a parquet file):

* retrieval / pretraining rows: ``{"video": path, "text": paragraph, "video_id": str}`` (``"image"`` instead of
  ``"video"`` for image-text pairs such as CC3M);
* QA rows: ``{"video": path, "question": str, "answer": str, "video_id": str}``.

A *relative* ``video`` / ``image`` path is relative to the directory of the file that holds the row; an absolute path
is used as is. :func:`load_split` loads a split with ``datasets`` and resolves the paths.
"""

from .data import load_split, resolve_media_path, split_files


__all__ = ["load_split", "resolve_media_path", "split_files"]
