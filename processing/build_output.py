"""Writing a build: shards (jsonl / parquet), the dataset card, and the staging folder that becomes ``OUT`` only when
the whole build succeeded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from .build_common import OptionError


FORMATS = ("jsonl", "parquet")


def arrow_type(column: str, value: object):
    """The parquet type of a row column, from its first value: strings, numbers, lists of strings (``sentences``,
    ``video_names``) and lists of ``[start, end]`` (``timestamps``)."""
    import pyarrow as pa

    if isinstance(value, str) or value is None:
        return pa.float64() if column == "duration" else pa.string()
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, (int, float)):
        return pa.float64()
    if isinstance(value, list):
        if column == "timestamps":
            return pa.list_(pa.list_(pa.float64()))
        return pa.list_(pa.string())
    raise TypeError(f"column {column!r}: no parquet type for {type(value).__name__}")


class ShardWriter:
    """Writes rows round-robin into `num_shards` jsonl or parquet files (row i -> shard i % num_shards)."""

    def __init__(self, output_dir: str, stem: str, fmt: str, num_shards: int, batch_rows: int = 10_000):
        if fmt not in FORMATS:
            raise OptionError(f"--format must be one of {FORMATS}, got {fmt!r}")
        if num_shards < 1:
            raise OptionError(f"--num-shards must be >= 1, got {num_shards}")
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
        """Appends `row` to the next shard."""
        shard = self.count % self.num_shards
        self.count += 1
        if self.fmt == "jsonl":
            self._jsonl[shard].write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            if self._schema is None:
                import pyarrow as pa

                self._schema = pa.schema([(key, arrow_type(key, value)) for key, value in row.items()])
            self._buffers[shard].append(row)
            if len(self._buffers[shard]) >= self.batch_rows:
                self._flush(shard)

    def _flush(self, shard: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self._buffers[shard]
        if not rows:
            return
        if self._writers[shard] is None:
            self._writers[shard] = pq.ParquetWriter(self.paths[shard], self._schema)
        self._writers[shard].write_table(pa.Table.from_pylist(rows, schema=self._schema))  # type: ignore[union-attr]
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


def card(dataset: str, split_files: dict[str, str], summaries: list[str]) -> str:
    """The dataset card (``README.md``): `split_files` maps a split to its file pattern, so that
    ``datasets.load_dataset(OUT)`` finds them; `summaries` are one line per split."""
    split_names = {"train": "train", "val": "validation", "test": "test"}
    lines = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, pattern in split_files.items():
        lines += [f"  - split: {split_names.get(split, split)}", f"    path: {pattern}"]
    lines += ["---", "", f"# {dataset} in the TESTA schema", "",
              f"Built by `python -m processing.builders {dataset}`. See `build_report.json` for row and missing-media "
              f"counts. Relative media paths are relative to this directory; load with `processing.load_split`.", ""]
    lines += [f"- {summary}" for summary in summaries]
    return "\n".join(lines) + "\n"


def check_replaceable(output_dir: str) -> None:
    """:class:`OptionError` if `output_dir` exists and is neither empty nor a previous build (no ``build_report.json``),
    so that a build never replaces a folder of other files."""
    if os.path.isfile(output_dir):
        raise OptionError(f"--output-dir {output_dir!r} is a file")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and \
            not os.path.isfile(os.path.join(output_dir, "build_report.json")):
        raise OptionError(f"--output-dir {output_dir!r} holds files but no build_report.json, so it is not a previous "
                          f"build; choose a new or empty folder (the build replaces the folder as a whole)")


@contextmanager
def staging(output_dir: str) -> Iterator[str]:
    """A temporary folder beside `output_dir` to build into; on success it replaces `output_dir` (a previous build is
    removed), on any error it is deleted and `output_dir` is left as it was."""
    output_dir = os.path.abspath(output_dir)
    check_replaceable(output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.building-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the permissions of OUT
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = None
    if os.path.exists(output_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.old-", dir=parent)
        os.replace(output_dir, os.path.join(old, "previous"))
    os.replace(stage, output_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)
